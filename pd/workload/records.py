"""What one load-test run leaves next to locust's CSVs, and how it is read back.

For ``locust --csv PREFIX`` the locustfile writes:

- ``PREFIX_requests.csv``: one row per request (locust's own CSVs hold only
  aggregates rounded to whole milliseconds);
- ``PREFIX_meta.json``: the run's settings (workload, arrival mode, SLOs,
  label) and its start and end times, so a report needs nothing else.

Stdlib only: the report reads these without importing locust.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

REQUESTS_SUFFIX = "_requests.csv"
META_SUFFIX = "_meta.json"
STATS_SUFFIX = "_stats.csv"


class Status:
    OK = "ok"
    FAILED = "failed"
    # Still in flight when the run ended: neither a success nor a failure.
    CUTOFF = "cutoff"


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it. Latencies in milliseconds; NaN where unknown."""

    index: int
    kind: str
    endpoint: str
    start_time: float  # unix seconds, when the request was sent
    status: str
    ttft_ms: float
    tpot_ms: float  # (e2e - ttft) / (output_tokens - 1); NaN for one-token outputs
    e2e_ms: float  # for a cut-off request: how long it had run
    prompt_tokens: int
    max_tokens: int
    output_tokens: int
    num_chunks: int
    itl_ms: tuple[float, ...]  # every gap between streamed chunks
    error: str = ""

    def row(self) -> dict[str, str]:
        values = asdict(self)
        values["itl_ms"] = " ".join(f"{gap:.3f}" for gap in self.itl_ms)
        for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
            values[name] = "" if math.isnan(values[name]) else f"{values[name]:.3f}"
        values["start_time"] = f"{self.start_time:.6f}"
        return values

    @classmethod
    def from_row(cls, row: dict[str, str]) -> "RequestRecord":
        def number(name: str) -> float:
            return float(row[name]) if row[name] else math.nan

        return cls(
            index=int(row["index"]), kind=row["kind"], endpoint=row["endpoint"],
            start_time=float(row["start_time"]), status=row["status"],
            ttft_ms=number("ttft_ms"), tpot_ms=number("tpot_ms"), e2e_ms=number("e2e_ms"),
            prompt_tokens=int(row["prompt_tokens"] or 0), max_tokens=int(row.get("max_tokens") or 0),
            output_tokens=int(row["output_tokens"] or 0),
            num_chunks=int(row["num_chunks"] or 0),
            itl_ms=tuple(float(gap) for gap in row["itl_ms"].split()), error=row.get("error", ""),
        )


COLUMNS = [field.name for field in fields(RequestRecord)]


class RequestLog:
    """Appends rows to ``PREFIX_requests.csv`` as requests end; each row is flushed."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("w", newline="")
        self._writer = csv.DictWriter(self._file, COLUMNS)
        self._writer.writeheader()
        self._file.flush()

    def write(self, record: RequestRecord) -> None:
        if self._file.closed:
            return
        self._writer.writerow(record.row())
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_requests(path: str | Path) -> list[RequestRecord]:
    with Path(path).open(newline="") as f:
        return [RequestRecord.from_row(row) for row in csv.DictReader(f)]


@dataclass(frozen=True)
class RunMeta:
    """The settings a run was made with; ``end_time`` is 0 until it ends."""

    label: str
    workload: str
    workload_args: str
    seed: int
    model: str
    host: str
    stream: bool
    arrival_rate: float | None  # requests/s in open-loop mode; None for closed-loop users
    arrival_process: str
    num_users: int
    slo_ttft_ms: float
    slo_tpot_ms: float
    start_time: float
    end_time: float = 0.0

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, path: str | Path) -> "RunMeta":
        data = json.loads(Path(path).read_text())
        known = {field.name for field in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})
