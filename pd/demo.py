"""Offline generation with the built-in model, then speculative decoding against plain decoding: ``python -m pd.demo``.

The trained default model answers a chat question. Then the same prompt, an
edit of a text it is given, runs on an engine that speculates (``ngram``
drafts: continuations looked up in the prompt) and on one that does not, both
here and now: the tokens each step yields, the time against plain decoding,
and whether the outputs agree (greedy: they must).
"""

from __future__ import annotations

import argparse
import time

from pd import LLM, SamplingParams

QUESTION = "Explain what a CPU does in one sentence."
# An edit that copies most of its source: what prompt lookup finds drafts in.
GROUNDED = """Correct the typos in the following text and return it in full:

The first lighthouses were simple fires lit on hilltops to warn sailors of danger. Later, towers were built so \
that the ligth could be seen from farther away. The most famous was the Pharos of Alexandria, wich stood for more \
then a thousand years. In 1822 the French physicist Augustin Fresnel designed a lens made of rings of prisms, and \
lighthouses with his lens could be seen more than thirty kilometres out to sea. Today most lighthouses are \
controled remotely, but many are still kept running as a backup for satellite navigation."""
SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def chat_ids(llm: LLM, content: str) -> list[int]:
    # A chat template already writes BOS, so its text is encoded without special tokens.
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": content}])
    return llm.tokenizer.encode(text, add_special_tokens=False)


def timed(llm: LLM, prompt: list[int], params: SamplingParams):
    """``(output, seconds, decode steps)`` of one request alone on ``llm``."""
    steps = llm.engine.stats().decode_steps
    start = time.perf_counter()
    (output,) = llm.generate([prompt], params)
    return output, time.perf_counter() - start, llm.engine.stats().decode_steps - steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    plain = LLM(args.model, num_threads=args.threads)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    answer, seconds, _ = timed(plain, chat_ids(plain, QUESTION), params)
    print(f"user: {QUESTION}\nassistant: {answer.text.strip()}")
    print(f"({len(answer.token_ids)} tokens in {seconds:.2f} s, {len(answer.token_ids) / seconds:.1f} tok/s)\n")

    spec = LLM(args.model, num_threads=args.threads, speculative_config=SPECULATIVE_CONFIG)
    spec.generate([chat_ids(spec, "Hello!")], SamplingParams(max_tokens=4))  # its one-time setup, untimed
    prompt = chat_ids(plain, GROUNDED)
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    before = spec.engine.stats()
    with_drafts, spec_s, spec_steps = timed(spec, prompt, greedy)
    after = spec.engine.stats()
    without, plain_s, plain_steps = timed(plain, prompt, greedy)
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    num_tokens = len(with_drafts.token_ids)
    print(f"user: {GROUNDED.splitlines()[0]} [a paragraph of {len(prompt)} tokens with typos]")
    print(f"assistant: {with_drafts.text.strip()}\n")
    print(f"speculative decoding (ngram, k={SPECULATIVE_CONFIG['num_speculative_tokens']}) against plain decoding, "
          f"{num_tokens} tokens, greedy:")
    print(f"  plain:       {plain_steps} decode steps, {(num_tokens - 1) / max(plain_steps, 1):.2f} tokens a step, "
          f"{plain_s:.2f} s")
    print(f"  speculative: {spec_steps} decode steps, {(num_tokens - 1) / max(spec_steps, 1):.2f} tokens a step, "
          f"{spec_s:.2f} s ({plain_s / spec_s:.2f}x), {accepted} of {drafted} draft tokens accepted")
    print(f"  same tokens as plain decoding: {'yes' if with_drafts.token_ids == without.token_ids else 'NO'}")


if __name__ == "__main__":
    main()
