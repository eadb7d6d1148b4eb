"""Replay a trace on one simulated replica: ``python -m sim.run --trace F --profile P``.

Options set the engine's limits (``--max-num-seqs``, ``--max-num-batched-tokens``,
``--num-blocks``, ``--block-size``), the model whose config and tokenizer it
reads (``--model``), and how far the trace is scaled down
(``--block-tokens``, see ``pd.workload.token_prompts``). Prints one JSON object: the
latency percentiles and throughput (``sim.replica.summarize``) and the
simulator's own speed.
"""

from __future__ import annotations

import argparse
import json
import time

from pd.config import EngineConfig
from pd.workload.trace import load_trace
from sim.cost import CostModel
from sim.engine import sim_engine
from sim.replica import replay, summarize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--model", default="builtin:tiny-llama", help="what the engine reads: config and tokenizer")
    parser.add_argument("--profile", required=True, help="a CostModel JSON file (python -m sim.profile)")
    parser.add_argument("--block-tokens", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=16384)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = EngineConfig(model=args.model, block_size=args.block_size, num_blocks=args.num_blocks,
                          max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)
    engine = sim_engine(config, CostModel.load(args.profile), args.seed)
    trace = load_trace(args.trace)
    start = time.perf_counter()
    records = replay(trace, engine, args.block_tokens)
    wall = time.perf_counter() - start
    print(json.dumps({**summarize(records), "steps": engine.runner.num_steps, "wall_s": round(wall, 3),
                      "requests_per_wall_s": round(len(trace) / wall, 1)}))


if __name__ == "__main__":
    main()
