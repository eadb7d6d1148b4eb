"""Speculative decoding against plain decoding of the same engine, in the same run.

``python -m bench.spec_decode [--workload grounded,repeat,free] [--batch 1,8] [--method ngram,suffix] [--k 4]
[--max-tokens 128] [--threads 2] [--num-prompts N] [--no-backoff]`` prints one JSON line per (workload,
batch, method): the engine with ``speculative_config`` (``tok_s``, ``itl_p50_s``) against the same engine
without it (``baseline_*``), greedy, on the trained default model with its chat template
(``bench.spec_workloads`` has the prompts and says what each workload is for).

Each (workload, batch) builds fresh engines, the plain one and one per method, so no suffix cache and
no prefix cache carries over from another line. The prompts run in rounds of ``batch``: the ``batch``
requests of a round are added together and the round ends when the last finishes (at batch 1, one request
at a time). The engines run side by side in this process, a step of each in turn (``Driver``), each timed
on its own clock, the seconds of its own calls: on a shared host a burst of other work then lands on
every engine alike, where whole rounds one after another gave ratios that a burst could double. Per engine:

- ``tok_s``: output tokens over the engine's own seconds (prefill included);
- ``speedup_p50``: the median over rounds of the plain engine's seconds for the round over this one's;
- ``itl_p50_s``: the median gap between a request's outputs, a step that brought ``n`` tokens counting
  as ``n`` gaps of a ``1 / n`` share each (a verify step's tokens arrive together). The median is over
  tokens, so the tokens of a step that accepted drafts weigh more than the one of a step that accepted
  none; ``tpot_s``, their mean (decode time over the tokens after each request's first), is what
  throughput follows;
- ``tokens_per_step``: the tokens a request gained per step it was decoded in, after its first
  (1.0 for plain decoding);
- ``acceptance_rate``: accepted over verified draft tokens; ``mean_accepted``: accepted drafts per verify
  group (a group also yields one token of its own, so tokens per verify step is ``1 + mean_accepted``);
- ``outputs_equal``: the prompts whose tokens are the plain engine's (greedy: all of them), and
  ``unequal``, the indices of any that differ.

``host_load`` is the host's 1-minute load average before and after the line's rounds: above the
thread count, other work shared the cores, and a step of two threads can stall for a scheduler slice
at each of its parallel regions. The medians (``speedup_p50``, ``itl_*``) hold up under that better
than ``tok_s``, whose sums take in every stall.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from dataclasses import dataclass, field

from bench.spec_workloads import WORKLOADS
from pd import LLM, SamplingParams
from pd.engine.engine import LLMEngine
from pd.model.paths import resolve_model_path
from pd.model.tokenizer import Tokenizer
from pd.workload.host import cpu_flags, cpu_name
from pd.workload.stats import percentile

MODEL = "builtin:smollm2-135m-instruct"
BASELINE = "baseline"
BLOCK_SIZE = 16
SPEC_COUNTERS = ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")


@dataclass
class Tally:
    """One engine's rounds of a (workload, batch), summed."""

    token_ids: dict[int, list[int]] = field(default_factory=dict)  # prompt index -> output tokens
    round_seconds: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)  # one per output token after each request's first
    num_decode_outputs: int = 0  # outputs after a request's first
    num_decode_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(tokens) for tokens in self.token_ids.values())

    @property
    def tok_s(self) -> float:
        return self.num_tokens / sum(self.round_seconds)


class Driver:
    """One engine's rounds, advanced a step at a time and timed on the engine's own clock.

    The clock counts only the seconds spent in this engine's calls (``add_request``, ``step``), so
    engines stepped in turn in one process each see the load the host had during their own steps:
    a burst from other processes lands on all of them, not on whichever ran a whole round then.
    An output arrives at the clock's reading after the step that brought it.
    """

    def __init__(self, engine: LLMEngine, rounds: list[dict[int, list[int]]], params: SamplingParams,
                 request_ids: itertools.count):
        self.engine, self.params, self.request_ids = engine, params, request_ids
        self.rounds = list(reversed(rounds))
        self.tally = Tally()
        self.clock = 0.0
        self._round_start = 0.0
        self._ids: dict[str, int] = {}
        self._last_output: dict[str, float] = {}

    def advance(self) -> bool:
        """One step (starting the next round first if the last one ended); False once every round is done."""
        if not self.engine.has_unfinished_requests():
            if self._ids:
                self.tally.round_seconds.append(self.clock - self._round_start)
                self._ids, self._last_output = {}, {}
            if not self.rounds:
                return False
            self._start_round(self.rounds.pop())
        start = time.perf_counter()
        outputs = self.engine.step()
        self.clock += time.perf_counter() - start
        for out in outputs:
            num_new = len(out.new_token_ids)
            if not num_new:
                continue
            self.tally.token_ids[self._ids[out.request_id]].extend(out.new_token_ids)
            if out.request_id in self._last_output:
                self.tally.itls.extend([(self.clock - self._last_output[out.request_id]) / num_new] * num_new)
                self.tally.num_decode_outputs += 1
                self.tally.num_decode_tokens += num_new
            self._last_output[out.request_id] = self.clock
        return True

    def _start_round(self, prompts: dict[int, list[int]]) -> None:
        """All of ``prompts`` in flight together; the round ends when the last finishes."""
        self._ids = {f"bench-{next(self.request_ids)}": index for index in prompts}
        self._round_start = self.clock
        start = time.perf_counter()
        for request_id, index in self._ids.items():
            self.engine.add_request(request_id, prompts[index], self.params)
            self.tally.token_ids[index] = []
        self.clock += time.perf_counter() - start


def run_interleaved(drivers: list[Driver]) -> None:
    """A step of each driver in turn, the order rotated each pass, until all are done."""
    active = list(drivers)
    for turn in itertools.count():
        if not active:
            return
        shift = turn % len(active)
        active = [d for d in active[shift:] + active[:shift] if d.advance()]


def spec_config(method: str, k: int, backoff: bool) -> dict:
    return {"method": method, "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
            "backoff": backoff}


def build_engines(args, methods: list[str], batch: int, max_prompt_len: int) -> dict[str, LLM]:
    """The plain engine and one per method, each with a pool for ``batch`` requests and their drafts."""
    blocks_per_request = -(-(max_prompt_len + args.max_tokens + args.k + 1) // BLOCK_SIZE)
    common = dict(dtype=args.dtype, num_threads=args.threads, block_size=BLOCK_SIZE,
                  num_blocks=batch * blocks_per_request + 8)
    engines = {BASELINE: LLM(args.model, **common)}
    for method in methods:
        engines[method] = LLM(args.model, **common, speculative_config=spec_config(method, args.k, args.backoff))
    return engines


def chat_prompts(tokenizer: Tokenizer, workload: str, num_prompts: int | None) -> list[list[int]]:
    conversations = WORKLOADS[workload]()
    if num_prompts is not None:
        conversations = conversations[:num_prompts]
    # A chat template already writes BOS, so its text is encoded without special tokens.
    return [tokenizer.encode(tokenizer.apply_chat_template(c), add_special_tokens=False) for c in conversations]


def bench_line(args, workload: str, batch: int, methods: list[str], prompts: list[list[int]]) -> list[dict]:
    """One (workload, batch): every engine over the same rounds; a record per method."""
    engines = build_engines(args, methods, batch, max(len(p) for p in prompts))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    warmup = SamplingParams(max_tokens=8, temperature=0.0)
    for llm in engines.values():  # one-time costs (kernel setup, first allocations) out of the rounds
        llm.generate([prompts[0][:32]], warmup)
    load_before = os.getloadavg()[0]
    before = {name: llm.engine.stats() for name, llm in engines.items()}
    rounds = [{i: prompts[i] for i in range(first, min(first + batch, len(prompts)))}
              for first in range(0, len(prompts), batch)]
    request_ids = itertools.count()
    drivers = {name: Driver(llm.engine, rounds, params, request_ids) for name, llm in engines.items()}
    run_interleaved(list(drivers.values()))
    tallies = {name: driver.tally for name, driver in drivers.items()}
    after = {name: llm.engine.stats() for name, llm in engines.items()}
    for llm in engines.values():
        llm.close()
    host_load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return [dict(record(args, workload, batch, method, len(prompts), tallies, before[method], after[method]),
                 host_load=host_load) for method in methods]


def record(args, workload: str, batch: int, method: str, num_prompts: int, tallies: dict[str, Tally],
           before, after) -> dict:
    spec, base = tallies[method], tallies[BASELINE]
    drafts, draft_tokens, accepted = (getattr(after, c) - getattr(before, c) for c in SPEC_COUNTERS)
    itl, base_itl = percentile(spec.itls, 50), percentile(base.itls, 50)
    tpot, base_tpot = sum(spec.itls) / len(spec.itls), sum(base.itls) / len(base.itls)
    unequal = [i for i in sorted(base.token_ids) if spec.token_ids[i] != base.token_ids[i]]
    return {
        "case": "spec_decode", "workload": workload, "batch": batch, "method": method, "k": args.k,
        "backoff": args.backoff, "num_prompts": num_prompts, "max_tokens": args.max_tokens,
        "output_tokens": spec.num_tokens, "baseline_output_tokens": base.num_tokens,
        "tok_s": round(spec.tok_s, 2), "baseline_tok_s": round(base.tok_s, 2),
        "speedup_tok_s": round(spec.tok_s / base.tok_s, 3),
        "speedup_p50": round(percentile([b / s for b, s in zip(base.round_seconds, spec.round_seconds)], 50), 3),
        "itl_p50_s": round(itl, 5), "baseline_itl_p50_s": round(base_itl, 5), "itl_ratio": round(base_itl / itl, 3),
        "tpot_s": round(tpot, 5), "baseline_tpot_s": round(base_tpot, 5), "tpot_ratio": round(base_tpot / tpot, 3),
        "acceptance_rate": round(accepted / draft_tokens, 3) if draft_tokens else None,
        "mean_accepted": round(accepted / drafts, 3) if drafts else None,
        "tokens_per_step": round(spec.num_decode_tokens / max(spec.num_decode_outputs, 1), 3),
        "spec_num_drafts": drafts, "spec_num_draft_tokens": draft_tokens, "spec_num_accepted_tokens": accepted,
        "outputs_equal": num_prompts - len(unequal), "unequal": unequal,
        "model": args.model, "dtype": args.dtype, "threads": args.threads, "cpu": cpu_name(),
        "cpu_flags": cpu_flags(), "isa": _isa(),
    }


def _isa() -> str:
    import pd_kernels.cpu

    return pd_kernels.cpu.isa()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="grounded", help=f"comma-separated, of {sorted(WORKLOADS)}")
    parser.add_argument("--batch", default="1", help="comma-separated batch sizes: requests in flight together")
    parser.add_argument("--method", default="ngram,suffix", help="comma-separated speculative methods")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=None, help="the first N of each workload's prompts")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--no-backoff", dest="backoff", action="store_false",
                        help="verify every draft found, whatever the step cost (the speculator's back-off off)")
    args = parser.parse_args(argv)
    workloads = args.workload.split(",")
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; known: {sorted(WORKLOADS)}")
    methods = args.method.split(",")
    tokenizer = Tokenizer.from_dir(resolve_model_path(args.model))
    for workload in workloads:
        prompts = chat_prompts(tokenizer, workload, args.num_prompts)
        for batch in (int(b) for b in args.batch.split(",")):
            for line in bench_line(args, workload, batch, methods, prompts):
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
