"""Load-test settings: locust command-line options, each with an environment variable.

    locust -f loadtest/locustfile.py --workload chat --max-tokens 64 --slo-ttft-ms 1000
    LOADTEST_WORKLOAD=chat LOADTEST_MAX_TOKENS=64 locust -f loadtest/locustfile.py

They also show in locust's web UI (custom parameters) and can go in a ``locust.conf``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pd.workload.workloads import WORKLOADS, parse_workload_args

ENDPOINTS = ("auto", "chat", "completions")
ARRIVAL_PROCESSES = ("poisson", "constant")


def add_arguments(parser) -> None:
    """Add the load-test options to locust's parser (``init_command_line_parser``).

    On the parser itself, not a group: only those show in locust's web UI.
    """
    group = parser
    group.add_argument("--workload", choices=WORKLOADS, default="mixed", env_var="LOADTEST_WORKLOAD",
                       help="request mix (default: mixed; see pd/workload/workloads.py)")
    group.add_argument("--workload-args", default="", env_var="LOADTEST_WORKLOAD_ARGS",
                       help="comma-separated key=value overrides of the workload's lengths and counts, "
                            "e.g. system_prompt_len=256,num_turns=2 (mixed: chat.num_turns=2)")
    group.add_argument("--trace-file", default="", env_var="LOADTEST_TRACE_FILE",
                       help="Mooncake-format JSONL trace to replay (implies --workload trace)")
    group.add_argument("--seed", type=int, default=0, env_var="LOADTEST_SEED",
                       help="seed of the workload and of Poisson arrivals")
    group.add_argument("--max-tokens", type=int, default=None, env_var="LOADTEST_MAX_TOKENS",
                       help="output tokens per request (default: the workload's own lengths)")
    group.add_argument("--model", default="", env_var="LOADTEST_MODEL",
                       help="model id to request (default: the first id of GET /v1/models)")
    group.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""), env_var="LOADTEST_API_KEY",
                       is_secret=True, help="bearer token (default: $OPENAI_API_KEY)")
    group.add_argument("--endpoint", choices=ENDPOINTS, default="auto", env_var="LOADTEST_ENDPOINT",
                       help="auto: chat requests to /v1/chat/completions, prompts to /v1/completions")
    group.add_argument("--no-stream", action="store_true", default=False, env_var="LOADTEST_NO_STREAM",
                       help="ask for whole responses (TTFT is then the end-to-end latency)")
    group.add_argument("--no-ignore-eos", action="store_true", default=False, env_var="LOADTEST_NO_IGNORE_EOS",
                       help="let EOS end outputs early (by default they run to max_tokens)")
    group.add_argument("--arrival-rate", type=float, default=0.0, env_var="LOADTEST_ARRIVAL_RATE",
                       help="open loop: send this many requests/s whatever the latency (one OpenLoopUser); "
                            "0 (default): closed-loop users, each waits for its reply. With a trace, "
                            "rescales the trace's times to this mean rate")
    group.add_argument("--arrival-process", choices=ARRIVAL_PROCESSES, default="poisson",
                       env_var="LOADTEST_ARRIVAL_PROCESS", help="gaps between open-loop arrivals")
    group.add_argument("--slo-ttft-ms", type=float, default=2000.0, env_var="LOADTEST_SLO_TTFT_MS",
                       help="time-to-first-token SLO for attainment and goodput (default 2000)")
    group.add_argument("--slo-tpot-ms", type=float, default=100.0, env_var="LOADTEST_SLO_TPOT_MS",
                       help="time-per-output-token SLO for attainment and goodput (default 100)")
    group.add_argument("--label", default="", env_var="LOADTEST_LABEL",
                       help="name of this run's series in reports (default: the host)")
    group.add_argument("--request-timeout", type=float, default=600.0, env_var="LOADTEST_REQUEST_TIMEOUT",
                       help="seconds to wait for a response to move before failing it")


@dataclass(frozen=True)
class LoadSettings:
    workload: str
    workload_args: dict[str, str]
    trace_file: str
    seed: int
    max_tokens: int | None
    model: str
    api_key: str
    endpoint: str
    stream: bool
    ignore_eos: bool
    arrival_rate: float | None  # None: closed loop
    arrival_process: str
    slo_ttft_ms: float
    slo_tpot_ms: float
    label: str
    request_timeout_s: float

    @property
    def open_loop(self) -> bool:
        return self.arrival_rate is not None or self.workload == "trace"

    @classmethod
    def from_options(cls, options) -> "LoadSettings":
        """From locust's parsed options; raises ValueError naming a bad value."""
        workload = "trace" if options.trace_file else options.workload
        if options.max_tokens is not None and options.max_tokens < 1:
            raise ValueError("--max-tokens must be at least 1")
        if options.arrival_rate < 0:
            raise ValueError("--arrival-rate must be positive, or 0 for closed-loop users")
        if options.slo_ttft_ms <= 0 or options.slo_tpot_ms <= 0:
            raise ValueError("SLO thresholds must be positive")
        if workload == "trace" and options.endpoint == "chat":
            raise ValueError("trace prompts are token ids: they go to /v1/completions, not --endpoint chat")
        return cls(
            workload=workload,
            workload_args=parse_workload_args(options.workload_args),
            trace_file=options.trace_file,
            seed=options.seed,
            max_tokens=options.max_tokens,
            model=options.model,
            api_key=options.api_key,
            endpoint=options.endpoint,
            stream=not options.no_stream,
            ignore_eos=not options.no_ignore_eos,
            arrival_rate=options.arrival_rate or None,
            arrival_process=options.arrival_process,
            slo_ttft_ms=options.slo_ttft_ms,
            slo_tpot_ms=options.slo_tpot_ms,
            label=options.label,
            request_timeout_s=options.request_timeout,
        )
