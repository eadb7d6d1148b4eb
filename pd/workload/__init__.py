"""What a load is and how it went: the leaf package that sim, bench and loadtest share.

- ``trace``: Mooncake-format request traces and the seeded trace generators.
- ``workloads``: deterministic request streams (chat, prompt classes, mixed,
  trace replay) and arrival processes.
- ``records``: one load-test request as the client saw it, and a run's meta.
- ``summary``: a run's percentiles, SLO attainment and goodput.
- ``stats``: the one definition of a percentile.
- ``host``: the CPU a figure was measured on.

Invariant: this package imports only the standard library, numpy and msgspec,
never another part of ``pd`` nor Ray, so anything may import it
(``tests/test_layering.py`` checks).
"""
