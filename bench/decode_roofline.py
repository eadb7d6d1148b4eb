"""Decode steps against the memory roofline: ``python -m bench.decode_roofline [--batches 1,32,128,256]``.

A decode step must read, at least once, every weight it multiplies by and the KV it attends to:

    weights  every layer's projections and norms, the final norm and the LM head, in bf16
             (+ one embedding row a sequence: the table is gathered, not read whole)
    KV       sum over the batch of context x layers x 2 (K, V) x kv_heads x head_dim x 2 bytes

Its roofline time is those bytes over the device-to-device copy bandwidth measured at the start of the
same run (``bench.kernels.measure_copy``: bytes read + written, the most HBM moves here). Our engine
(``LLMEngine``, synchronous, on the random Llama-3-8B-shaped bf16 checkpoint that ``bench.random_models``
caches) takes ``batch`` prompts of ``--prompt-len`` tokens; once every prompt is in, ``--steps`` decode
steps are timed with CUDA graphs, then as many eager (after a few untimed ones each), every request
decoding one token in each; with ``--async-scheduling``, the engine launches each step before reading the
one before (``EngineConfig.async_scheduling``) and only graphs are timed (mode ``graphs_async``). Per step:

- ``step_ms``: wall time of ``LLMEngine.step`` (schedule, launch, the device's work, the read-back, update);
- ``device_ms``: CUDA events from the step's copy of its inputs to the device to the end of its forward
  and sampling (``bench.timing.DeviceTimer``): the device's time, with any wait it has while the host
  enqueues them.

Prints one JSON line per (batch, mode) with the medians, the bytes and ``fraction_of_roofline`` (roofline
time over ``step_ms``; ``device_fraction`` over ``device_ms``). The issue's goal: >= 0.85 with graphs at
batch 32 to 256. Needs CUDA; without it prints one line saying it was skipped.

With ``--verify-k K`` the engine speculates (``speculative_config``, no back-off) and, at the batches of
``--verify-batches``, the same running batch is timed in verify steps too (modes ``verify_graphs``,
``verify_eager``): every request verifies K drafts (its last token repeated, accepted where the model draws
it) in a step of K + 1 tokens a sequence, replayed from the verify graphs. Their lines add
``tokens_per_step`` (output tokens a sequence a step) and ``step_over_decode``: the verify step's time over
the plain decode step's in the same mode, what K drafts cost.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from bench.random_models import SHAPES, ModelShape
from bench.timing import DeviceTimer
from pd.workload.stats import percentile

WARM_UP_STEPS = 3
SLACK_TOKENS = 8  # past the timed steps, so that no request finishes inside them
MAX_PREFILL_TOKENS = 32768
MAX_PREFILL_STEPS = 64
DTYPE_BYTES = 2  # bf16 weights and KV


def weight_bytes(shape: ModelShape, num_layers: int, batch: int, dtype_bytes: int = DTYPE_BYTES) -> int:
    """The weights a decode step of ``batch`` sequences reads (see the module's doc); dense models only."""
    if shape.moe:
        raise ValueError("a dense model's step reads every weight; an MoE step reads the routed experts only")
    hidden, q_width = shape.hidden_size, shape.num_heads * shape.head_dim
    kv_width = shape.num_kv_heads * shape.head_dim
    attention = hidden * q_width + 2 * hidden * kv_width + q_width * hidden  # q, k, v, o
    mlp = 3 * hidden * shape.config["intermediate_size"]  # gate, up, down
    per_layer = attention + mlp + 2 * hidden  # and its two norms
    return dtype_bytes * (num_layers * per_layer + hidden + shape.vocab_size * hidden + batch * hidden)


def kv_bytes(shape: ModelShape, num_layers: int, kv_tokens: int, dtype_bytes: int = DTYPE_BYTES) -> int:
    """The K and V of ``kv_tokens`` positions (the batch's contexts summed) over every layer."""
    return kv_tokens * num_layers * 2 * shape.num_kv_heads * shape.head_dim * dtype_bytes


def roofline_ms(num_bytes: int, copy_gbps: float) -> float:
    return num_bytes / copy_gbps / 1e6


def time_steps(engine, timer: DeviceTimer, generated: dict[str, int], prompt_len: int, num_steps: int) -> dict:
    """Run ``WARM_UP_STEPS`` then ``num_steps`` timed decode steps; medians, and the KV the timed ones read.

    ``timer`` is read through ``take`` only, so a CPU test passes a stand-in."""
    walls, device, kv_tokens, every_row_decoded = [], [], [], True
    for step in range(WARM_UP_STEPS + num_steps):
        attended = sum(prompt_len + n for n in generated.values())  # the step's token is the n-th sampled
        timer.take()
        started = time.perf_counter()
        outputs = engine.step()
        wall_ms = 1e3 * (time.perf_counter() - started)
        device_ms = timer.take()
        for out in outputs:
            generated[out.request_id] += len(out.new_token_ids)
        if step < WARM_UP_STEPS:
            continue
        walls.append(wall_ms)
        device.append(device_ms)
        kv_tokens.append(attended)
        every_row_decoded &= len(outputs) == len(generated) and all(len(o.new_token_ids) == 1 for o in outputs)
    return {"step_ms": percentile(walls, 50), "device_ms": percentile(device, 50),
            "kv_tokens": sum(kv_tokens) / len(kv_tokens), "every_row_decoded": every_row_decoded}


class RepeatLast:
    """Drafts ``k`` copies of a request's last token (``pd.engine.spec.base.Proposer``)."""

    def propose(self, request_id, token_ids, k):
        return [token_ids[-1]] * k

    def finish(self, request_id, token_ids, num_prompt_tokens):
        pass


def steps_tokens(args) -> int:
    """The most tokens a request may sample in the timed modes (each verify step up to K + 1)."""
    k = getattr(args, "verify_k", 0)
    per_step = 2 + 2 * (k + 1 if k else 0)
    return 1 + per_step * (WARM_UP_STEPS + args.steps) + SLACK_TOKENS


def measure_batch(engine, timer: DeviceTimer, graphs, batch: int, copy_gbps: float, args,
                  rng: random.Random, speculator=None) -> list[dict]:
    """Graphs, then eager (and verify steps with ``speculator``), on the same running batch; its requests
    aborted at the end."""
    from pd.sampling_params import SamplingParams

    shape = SHAPES[args.model]
    max_tokens = steps_tokens(args)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    generated = {f"b{batch}-{i}": 0 for i in range(batch)}
    for request_id in generated:
        engine.add_request(request_id, [rng.randrange(3, shape.vocab_size - 1) for _ in range(args.prompt_len)], params)
    rows = []
    try:
        for _ in range(MAX_PREFILL_STEPS):  # until every prompt is in, each with its first token sampled
            if min(generated.values()) > 0:
                break
            for out in engine.step():
                if out.finished:
                    raise RuntimeError(f"{out.request_id} finished early ({out.finish_reason}: {out.error})")
                generated[out.request_id] += len(out.new_token_ids)
        else:
            raise RuntimeError(f"the prompts were not in after {MAX_PREFILL_STEPS} steps")
        modes = ("graphs_async",) if args.async_scheduling else ("graphs", "eager")
        if speculator is not None and batch in verify_batches(args):
            modes += ("verify_graphs", "verify_eager")
        plain_ms = {}
        for mode in modes:
            engine.runner.graphs = graphs if "graphs" in mode else None
            engine.scheduler.speculator = speculator if mode.startswith("verify") else None
            before = sum(generated.values())
            timed = time_steps(engine, timer, generated, args.prompt_len, args.steps)
            tokens_per_step = (sum(generated.values()) - before) / batch / (WARM_UP_STEPS + args.steps)
            weights = weight_bytes(shape, args.layers, batch)
            kv = kv_bytes(shape, args.layers, round(timed["kv_tokens"]))
            bound_ms = roofline_ms(weights + kv, copy_gbps)
            rows.append({
                "case": "decode_roofline", "model": args.model, "layers": args.layers, "batch": batch, "mode": mode,
                "steps": args.steps, "context": round(timed["kv_tokens"] / batch, 1),
                "step_ms": timed["step_ms"], "device_ms": timed["device_ms"],
                "weight_bytes": weights, "kv_bytes": kv, "copy_gbps": round(copy_gbps, 1),
                "roofline_ms": bound_ms, "fraction_of_roofline": bound_ms / timed["step_ms"],
                "device_fraction": bound_ms / timed["device_ms"],
                "tok_s": round(1e3 * batch * tokens_per_step / timed["step_ms"], 1),
                "every_row_decoded": timed["every_row_decoded"],
            })
            plain_ms[mode] = timed["step_ms"]
            if mode.startswith("verify"):
                rows[-1].update(tokens_per_step=round(tokens_per_step, 3), verify_k=args.verify_k,
                                step_over_decode=timed["step_ms"] / plain_ms[mode.removeprefix("verify_")])
    finally:
        engine.runner.graphs = graphs
        engine.scheduler.speculator = None
        for request_id in generated:
            engine.abort_request(request_id)
    return rows


def make_engine(path, args, max_batch: int, device: str = "cuda"):
    from pd.config import EngineConfig
    from pd.engine.engine import LLMEngine

    shape = SHAPES[args.model]
    max_model_len = args.prompt_len + steps_tokens(args) + 16
    pool_bytes = kv_bytes(shape, args.layers, max_batch * max_model_len) * 5 // 4
    engine = LLMEngine(EngineConfig(
        model=str(path), dtype="bfloat16", device=device, kv_cache_bytes=pool_bytes, max_num_seqs=max_batch,
        max_num_batched_tokens=min(MAX_PREFILL_TOKENS, max(2048, max_batch * args.prompt_len)),
        cuda_graph_max_batch=max_batch, max_model_len=max_model_len,
        async_scheduling=args.async_scheduling,
        speculative_config={"method": "ngram", "num_speculative_tokens": args.verify_k, "backoff": False}
        if getattr(args, "verify_k", 0) else None))
    engine.warm_up()
    if engine.speculator is not None:
        engine.speculator.proposer = RepeatLast()
    return engine


def verify_batches(args) -> list[int]:
    return [int(b) for b in args.verify_batches.split(",")] if getattr(args, "verify_k", 0) else []


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=[name for name, shape in SHAPES.items() if not shape.moe],
                        default="llama3-8b")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batches", default="1,32,128,256")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--async-scheduling", action="store_true",
                        help="the engine with async scheduling (pd.engine.overlap), graphs only: mode graphs_async")
    parser.add_argument("--verify-k", type=int, default=0, help="also time verify steps of K drafts a sequence")
    parser.add_argument("--verify-batches", default="32")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"case": "decode_roofline", "skipped": "no CUDA device"}), flush=True)
        return
    from bench.kernels import measure_copy
    from bench.random_models import cached_checkpoint

    _, copy_gbps = measure_copy()
    path, built = cached_checkpoint(args.model, args.layers)
    del built
    torch.cuda.empty_cache()
    batches = [int(b) for b in args.batches.split(",")]
    engine = make_engine(path, args, max(batches))
    graphs = engine.runner.graphs
    speculator, engine.scheduler.speculator = engine.speculator, None  # the plain modes decode plainly
    timer = DeviceTimer(engine.runner)
    rng = random.Random(0)
    for batch in batches:
        try:
            rows = measure_batch(engine, timer, graphs, batch, copy_gbps, args, rng, speculator)
        except Exception as exc:  # noqa: BLE001 - one batch's failure is its line; the others still run
            rows = [{"case": "decode_roofline", "batch": batch, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}]
        for row in rows:
            print(json.dumps(row), flush=True)
    engine.close()


if __name__ == "__main__":
    main()
