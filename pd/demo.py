"""Offline generation demo with the built-in model: ``python -m pd.demo``."""

from __future__ import annotations

import argparse
import time

from pd import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="builtin:tiny-llama")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    llm = LLM(args.model)
    messages = [
        [{"role": "user", "content": "Tell me about the sea."}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a block table?"}],
    ]
    # A chat template already writes BOS, so its text is encoded without special tokens.
    templated = [llm.tokenizer.apply_chat_template(m) for m in messages]
    prompts = [llm.tokenizer.encode(t, add_special_tokens=False) for t in templated]
    prompts.append(llm.tokenizer.encode("Once upon a time"))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for out in outputs:
        prompt = llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
        print(f"--- prompt ({len(out.prompt_token_ids)} tokens): {prompt!r}")
        print(f"    output ({len(out.token_ids)} tokens, {out.finish_reason}): {out.text!r}")
    total = sum(len(o.token_ids) for o in outputs)
    print(f"{total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tok/s); the built-in model has random weights")


if __name__ == "__main__":
    main()
