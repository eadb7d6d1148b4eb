"""``bench.latent_decode``: the MLA decode kernel against the stream bandwidth and the matmul peak, tiny sizes."""

from __future__ import annotations

import json

from bench import latent_decode


def test_each_case_reports_its_bandwidth_and_flops_against_the_hosts_limits(capsys, monkeypatch):
    monkeypatch.setattr(latent_decode, "POOL_BYTES", 4 * 1024**2)
    monkeypatch.setattr(latent_decode, "STREAM_BYTES", 8 * 1024**2)
    monkeypatch.setattr(latent_decode, "MATMUL_SIZE", 128)
    latent_decode.main(["--context", "100", "--heads", "1", "16", "--batch", "1", "3", "--pages", "fp32", "bf16",
                        "--threads", "1", "--repeats", "2"])
    report = json.loads(capsys.readouterr().out)
    assert report["case"] == "latent_decode" and report["cpu"] and report["isa"] in ("AVX512", "AVX2", "DEFAULT")
    assert isinstance(report["cpu_flags"], list) and len(report["loadavg"]) == 2 and report["context"] == 100
    assert (report["latent_dim"], report["v_dim"]) == (576, 512)
    cases = [(r["pages"], r["threads"], r["heads"], r["batch"]) for r in report["results"]]
    assert cases == [(pages, 1, heads, batch) for pages in ("float32", "bfloat16") for heads in (1, 16)
                     for batch in (1, 3)]
    for line in report["results"]:
        for field in ("ours_ms", "pages_gb_s", "stream_gb_s", "frac_of_stream", "gflop_s", "matmul_gflop_s",
                      "frac_of_matmul", "bound_ms", "bound_over_ours", "wake_ms"):
            assert line[field] > 0, field
        assert line["max_abs_error"] < 1e-4  # the kernel against the reference on the benchmark's own inputs
        # The fields agree with each other: GB/s over the stream's is the fraction reported.
        ratio = line["pages_gb_s"] / line["stream_gb_s"]
        assert abs(ratio - line["frac_of_stream"]) < 0.02 + 0.02 * ratio
