"""A load test's runs replayed in the simulator: the same arrivals, prompts and output lengths.

``simulate_runs`` serves every request of some runs on one simulated
deployment, each arriving when it did, and gives back the records the load
test's client would have logged for them (``pd.workload.records.RequestRecord``),
so that both sides are summarized by the same code.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from pd.model.paths import resolve_model_path
from pd.model.tokenizer import Tokenizer
from pd.sampling_params import SamplingParams
from pd.workload.records import META_SUFFIX, REQUESTS_SUFFIX, RequestRecord, RunMeta, Status, read_requests
from pd.workload.summary import RunSummary, summarize
from pd.workload.workloads import CHAT_PATH, LoadRequest, make_workload, parse_workload_args
from sim.clock import EventLoop
from sim.cluster import ClusterSpec, SimCluster
from sim.replica import RequestRecord as SimRecord


def prompt_token_ids(request: LoadRequest, endpoint: str, tokenizer: Tokenizer) -> list[int]:
    """The prompt the ingress made of ``request`` on ``endpoint``: the chat template, or the text as sent."""
    if endpoint == CHAT_PATH:
        return tokenizer.encode(tokenizer.apply_chat_template(request.chat_messages()), False)
    prompt = request.completion_prompt()
    return list(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt)


def _as_loadtest_record(real: RequestRecord, sim: SimRecord, end_s: float, arrival_s: float,
                        delivery_s: Sequence[float] = ()) -> RequestRecord:
    """A simulated request as the load test would have logged it, cut off at the run's end.

    ``delivery_s`` (one per token, or none) delays each token on its way to
    the client, in order: a token that would overtake the one before it
    arrives with it.
    """
    delays = delivery_s or [0.0] * len(sim.token_times_s)
    if len(delays) != len(sim.token_times_s):
        raise ValueError(f"{len(delays)} delivery delays for {len(sim.token_times_s)} tokens")
    arrivals = list(itertools.accumulate((t + d for t, d in zip(sim.token_times_s, delays)), max))
    tokens = [t for t in arrivals if t <= end_s]
    done_s = max([sim.finished_s, *arrivals[-1:]]) if sim.finished_s is not None else None
    finished = done_s is not None and done_s <= end_s
    finished_s = done_s if finished else end_s
    ttft_ms = (tokens[0] - arrival_s) * 1000 if tokens else math.nan
    e2e_ms = (finished_s - arrival_s) * 1000
    tpot_ms = (e2e_ms - ttft_ms) / (len(tokens) - 1) if finished and len(tokens) > 1 else math.nan
    return RequestRecord(
        index=real.index, kind=real.kind, endpoint=real.endpoint, start_time=real.start_time,
        status=Status.OK if finished else Status.CUTOFF, ttft_ms=ttft_ms, tpot_ms=tpot_ms, e2e_ms=e2e_ms,
        prompt_tokens=sim.num_prompt_tokens, max_tokens=real.max_tokens, output_tokens=len(tokens),
        num_chunks=len(tokens), itl_ms=tuple((b - a) * 1000 for a, b in zip(tokens, tokens[1:])))


@dataclass(frozen=True)
class Run:
    """One locust run's log: ``PREFIX_requests.csv`` and ``PREFIX_meta.json``."""

    prefix: Path
    records: list[RequestRecord]
    meta: RunMeta

    @classmethod
    def read(cls, prefix: Path) -> Run:
        return cls(prefix, read_requests(str(prefix) + REQUESTS_SUFFIX), RunMeta.read(str(prefix) + META_SUFFIX))

    def summary(self, records: list[RequestRecord] | None = None) -> RunSummary:
        return summarize(self.prefix.name, self.records if records is None else records, self.meta)


def simulate_runs(runs: list[Run], spec: ClusterSpec, delivery_jitter_s: float = 0.0,
                  ) -> tuple[list[list[RequestRecord]], int]:
    """The runs' requests, each arriving when it did, on one simulated deployment; and the prompt-length mismatches.

    One deployment for all of a config's runs, in the order they ran: the
    real app's prefix caches carry from one run to the next (each run's
    workload starts again at request 0), and so do the simulated ones. Each
    token reaches the client after a delay drawn from an exponential of mean
    ``delivery_jitter_s`` (seeded by the request), in order.
    """
    tokenizer = Tokenizer.from_dir(resolve_model_path(spec.decode.engine.model))
    loop = EventLoop()
    cluster = SimCluster(loop, spec)
    origin = min(run.meta.start_time for run in runs)
    mismatched = 0
    for number, run in enumerate(runs):
        meta = run.meta
        workload = make_workload(meta.workload, meta.seed, parse_workload_args(meta.workload_args))
        for record in run.records:
            prompt = prompt_token_ids(workload.request(record.index), record.endpoint, tokenizer)
            if record.status == Status.OK and len(prompt) != record.prompt_tokens:
                mismatched += 1
            params = SamplingParams(max_tokens=record.max_tokens, ignore_eos=True)
            loop.at(record.start_time - origin, lambda request_id=f"{number}-{record.index}", prompt=prompt,
                    params=params: cluster.submit(request_id, prompt, params))
    loop.run()
    simulated = []
    for number, run in enumerate(runs):
        end_s = run.meta.end_time - origin
        records = []
        for record in run.records:
            request_id = f"{number}-{record.index}"
            sim = cluster.records[request_id]
            delays = ()
            if delivery_jitter_s:
                draw = random.Random(request_id)
                delays = [draw.expovariate(1 / delivery_jitter_s) for _ in sim.token_times_s]
            records.append(_as_loadtest_record(record, sim, end_s, record.start_time - origin, delays))
        simulated.append(records)
    return simulated, mismatched
