"""The machine a figure was measured on, as ``/proc/cpuinfo`` describes it.

Every benchmark line and simulator profile names its CPU, because figures
differ between Intel and AMD hosts and between vector ISAs. Stdlib only; a
host without ``/proc/cpuinfo`` reads as ``"unknown"`` with no flags.
"""

from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
# The flags that decide which kernels and oneDNN paths a run takes.
ISA_FLAGS = frozenset({"avx2", "avx512f", "avx512_bf16", "avx_ne_convert", "amx_bf16", "avx512_vnni", "avx_vnni",
                       "amx_int8"})


def _cpuinfo_field(name: str) -> str | None:
    """The value of the first ``name : value`` line of ``/proc/cpuinfo``; None where there is none."""
    try:
        for line in CPUINFO.read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU model, as /proc/cpuinfo names it (figures differ between Intel and AMD hosts)."""
    return _cpuinfo_field("model name") or "unknown"


def cpu_flags() -> list[str]:
    """Which of ``ISA_FLAGS`` this CPU has, sorted."""
    return sorted(set((_cpuinfo_field("flags") or "").split()) & ISA_FLAGS)
