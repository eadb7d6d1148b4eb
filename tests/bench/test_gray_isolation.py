"""``bench.gray_isolation``'s summary of a prefill-pool run: when the slow replica became a suspect, was
quarantined and readmitted, and the prompt tokens each replica computed before the quarantine (no Ray)."""

from __future__ import annotations

import argparse

from bench.gray_isolation import StreamingLoad, summarise

SLOW, FAST = "replica-slow0001", "replica-fast0002"


def _sample(t: float, quarantined=(), suspects=(), slow_tokens=0, fast_tokens=0) -> dict:
    return {"t_s": t, "quarantined": list(quarantined), "suspects": list(suspects),
            "slowness": {SLOW[-8:]: 1.0, FAST[-8:]: 1.0},
            "computed_tokens": {SLOW[-8:]: slow_tokens, FAST[-8:]: fast_tokens}}


def test_a_prefill_run_is_summarised_from_its_samples():
    load = StreamingLoad("http://127.0.0.1:1")  # never entered: no client runs
    load.outcomes = ["done"] * 4
    # Streams' token gaps: 10 ms before the fault, the same after (enough for each window's p99).
    load.gaps = [(load.started + i * 0.1, 0.01) for i in range(400)]
    samples = [_sample(0.0), _sample(10.0, slow_tokens=2000, fast_tokens=2000),
               _sample(12.0, suspects=[SLOW], slow_tokens=3400, fast_tokens=4000),
               _sample(14.0, suspects=[SLOW], slow_tokens=4424, fast_tokens=6000),
               _sample(16.0, quarantined=[SLOW], slow_tokens=4424, fast_tokens=8000),
               _sample(31.0), _sample(40.0)]
    args = argparse.Namespace(pool="prefill", model="m", clients=1, think_s=3.0, gray="{}", fault=True,
                              bursty=False, bucket_s=2, fault_at=10.0, fault_for=20.0, warmup_s=1.0, settle_s=3.0)
    result = summarise(load, samples, {"replica_id": SLOW}, args)
    assert (result["suspect_after_s"], result["quarantined_after_s"], result["readmitted_after_s"]) == (2.0, 6.0, 1.0)
    assert result["fault_tokens_before_quarantine"] == {SLOW[-8:]: 2424, FAST[-8:]: 6000}
    assert result["num_failed_streams"] == 0 and result["think_s"] == 3.0
