"""Does speculative decoding pay, for this model, GPU, draft quality and load? ``python -m sim.spec``

``python -m sim.spec --model llama-3-8b --hardware h200 --acceptance 0.7 --found 0.8 --rates 1,4,16,64``

One replica of the model on one GPU (analytic profile, ``sim.hardware``;
``--profile`` for a measured one) serves the same Poisson trace at each
arrival rate twice: without speculation, and with ``speculative_config``
(``--method``, ``--k``) whose drafts fare as ``--found`` (the share of decode
steps whose lookup finds a draft) and ``--acceptance`` (the chance the target
draws each draft token) say (``sim.engine.DraftModel``). The engine's own
``Speculator`` decides, from its fit of the modelled steps, which requests
verify how many drafts, and backs off where they do not pay: the same code
as a served replica. Prints one JSON line per rate: output tokens/s, the
time per output token (TPOT, per request: a verify step's tokens arrive
together) and TTFT, with and without, their ratios, drafts accepted per
verify group, and ``pays`` (TPOT p50 lower and throughput at least 0.97 of
plain decoding).
"""

from __future__ import annotations

import argparse
import json
import random

from pd.config import EngineConfig
from pd.model.config import load_model_config
from pd.workload.trace import TraceRequest
from sim.cost import CostModel
from sim.engine import DraftModel, sim_engine
from sim.hardware import HARDWARE, analytic_cost, kv_cache_bytes, model_dir
from sim.replica import percentile, replay, summarize

BLOCK_TOKENS = 512


def poisson_trace(rate_per_s: float, num_requests: int, prompt_tokens: int, output_tokens: int,
                  seed: int) -> list[TraceRequest]:
    """``num_requests`` arrivals at ``rate_per_s``, no two sharing a prompt block."""
    rng, now_ms, requests = random.Random(seed), 0.0, []
    for index in range(num_requests):
        now_ms += rng.expovariate(rate_per_s) * 1000
        first = 10_000_000 * (index + 1)
        requests.append(TraceRequest(timestamp_ms=now_ms, input_length=prompt_tokens, output_length=output_tokens,
                                     hash_ids=tuple(range(first, first + -(-prompt_tokens // BLOCK_TOKENS)))))
    return requests


def compare(config: EngineConfig, cost: CostModel, drafts: DraftModel, speculative: dict,
            trace: list[TraceRequest], seed: int = 0) -> dict:
    """The trace served without and with speculation: each one's summary, and the ratios."""
    rows = {}
    for name, spec in (("plain", None), ("spec", speculative)):
        engine = sim_engine(EngineConfig(**{**vars(config), "speculative_config": spec}), cost, seed, drafts=drafts)
        records = replay(trace, engine, BLOCK_TOKENS)
        rows[name] = summarize(records)
        rows[name]["steps"] = engine.runner.num_steps
        # Time per output token after the first, per request: a verify step's tokens arrive together, so
        # the gaps between them (ITL) are zero and say less.
        tpots = [(r.e2e_s - r.ttft_s) / (len(r.token_times_s) - 1) for r in records
                 if r.finished_s is not None and len(r.token_times_s) > 1]
        rows[name]["tpot_p50_s"] = percentile(tpots, 50) if tpots else None
        stats = engine.stats()
        if spec is not None:
            rows[name]["mean_accepted"] = stats.spec_num_accepted_tokens / max(1, stats.spec_num_drafts)
            rows[name]["verify_groups_per_step"] = stats.spec_num_drafts / max(1, engine.runner.num_steps)
    plain, spec = rows["plain"], rows["spec"]
    tpot_ratio = plain["tpot_p50_s"] / spec["tpot_p50_s"] if spec["tpot_p50_s"] else None
    throughput_ratio = spec["output_tokens_per_s"] / plain["output_tokens_per_s"]
    return {"plain": plain, "spec": spec, "tpot_p50_ratio": tpot_ratio, "throughput_ratio": throughput_ratio,
            "pays": bool(tpot_ratio and tpot_ratio > 1.0 and throughput_ratio >= 0.97)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--hardware", default="h200", choices=sorted(HARDWARE))
    parser.add_argument("--profile", help="a measured CostModel JSON (python -m sim.profile) instead of analytic")
    parser.add_argument("--method", default="ngram")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--found", type=float, default=0.8)
    parser.add_argument("--acceptance", type=float, default=0.7)
    parser.add_argument("--rates", default="1,4,16,64", help="arrival rates, requests/s, comma-separated")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = model_dir(args.model)
    model = load_model_config(path)
    gpu = HARDWARE[args.hardware]
    cost = CostModel.load(args.profile) if args.profile else analytic_cost(model, gpu)
    config = EngineConfig(model=path, kv_cache_bytes=kv_cache_bytes(model, gpu), max_num_seqs=args.max_num_seqs,
                          max_model_len=args.prompt_tokens + args.output_tokens + 64)
    speculative = {"method": args.method, "num_speculative_tokens": args.k}
    drafts = DraftModel(found=args.found, acceptance=args.acceptance)
    for rate in (float(r) for r in args.rates.split(",")):
        trace = poisson_trace(rate, args.num_requests, args.prompt_tokens, args.output_tokens, args.seed)
        print(json.dumps({"model": args.model, "hardware": gpu.name, "rate_per_s": rate, "found": args.found,
                          "acceptance": args.acceptance, "k": args.k,
                          **compare(config, cost, drafts, speculative, trace, args.seed)}), flush=True)


if __name__ == "__main__":
    main()
