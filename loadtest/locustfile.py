"""Locust users for an OpenAI-compatible LLM server, with streamed TTFT and inter-token latency.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 8 -r 2 -t 60s \\
        --workload chat --csv runs/chat/locust
    python -m loadtest.report runs/chat

Users (locust picks one unless classes are named on the command line):

- ``LLMUser`` (closed loop, the default): sends a request, waits for the
  whole answer, sends the next. Chat requests go to ``/v1/chat/completions``,
  prompts to ``/v1/completions`` (``--endpoint`` forces one).
- ``ChatUser`` / ``CompletionsUser``: the same, always to that endpoint.
- ``OpenLoopUser`` (with ``--arrival-rate R`` or a trace): one dispatcher
  that sends requests at their arrival times (Poisson or constant at ``R``
  requests/s, or the trace's own times) whether or not earlier ones have
  been answered, so latency is measured under a known offered load.

Each request fires locust events TTFT, ITL, TPOT and E2E (see
``loadtest/run.py``); with ``--csv PREFIX`` it also writes one row per
request to ``PREFIX_requests.csv`` and the run's settings to
``PREFIX_meta.json``. Settings are command-line options, each with an
environment variable, listed in ``loadtest/settings.py`` (locust 2.47 prints
``--help`` before it loads a locustfile, so they are not in it).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # loaded by path (locust -f): make the repository's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gevent
import locust.stats
import requests
from gevent.pool import Group
from locust import User, constant, events, task
from locust.exception import StopUser
from locust.runners import MasterRunner
from requests.adapters import HTTPAdapter

from loadtest import client
from loadtest.run import LoadRun
from loadtest.settings import LoadSettings, add_arguments
from pd.workload.workloads import make_workload

logger = logging.getLogger(__name__)


def _session() -> requests.Session:
    session = requests.Session()
    # Open-loop dispatch can hold many requests at once on one session.
    adapter = HTTPAdapter(pool_connections=1, pool_maxsize=512)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


class LLMUser(User):
    """Closed loop: one request at a time, the next as soon as the last is answered."""

    wait_time = constant(0)
    endpoint = "auto"

    def on_start(self) -> None:
        self.session = _session()

    @task
    def send_next(self) -> None:
        run = _current_run(self.environment)
        index = run.next_index()
        if index is None:
            run.finish_when_idle()
            raise StopUser()
        run.send(self.session, run.workload.request(index), self.endpoint)

    def on_stop(self) -> None:
        self.session.close()


class ChatUser(LLMUser):
    """Closed loop, always ``/v1/chat/completions`` (a text prompt becomes one user turn)."""

    endpoint = "chat"


class CompletionsUser(LLMUser):
    """Closed loop, always ``/v1/completions`` (chat turns become ``role: content`` lines)."""

    endpoint = "completions"


class OpenLoopUser(User):
    """Open loop: sends each request at its arrival time, never waiting for replies."""

    fixed_count = 1
    wait_time = constant(0)

    def on_start(self) -> None:
        self.session = _session()
        self.run = _current_run(self.environment)
        self.in_flight = Group()

    @task
    def dispatch(self) -> None:
        start = time.monotonic()
        for at, index in self.run.arrivals():
            delay = start + at - time.monotonic()
            if delay > 0:
                gevent.sleep(delay)
            if self.run.stopping:  # a graceful stop (--stop-timeout): no new arrivals, let these finish
                break
            self.in_flight.spawn(self.run.send, self.session, self.run.workload.request(index))
        self.in_flight.join()
        self.run.finish_when_idle()
        raise StopUser()

    def on_stop(self) -> None:
        self.in_flight.kill(block=True)  # their requests are logged as cut off
        self.session.close()


def _current_run(environment) -> LoadRun:
    run = getattr(environment, "loadtest_run", None)
    if run is None:  # the test could not start (the log says why)
        raise StopUser()
    return run


def pick_user_class(settings: LoadSettings) -> type[User]:
    return OpenLoopUser if settings.open_loop else LLMUser


@events.init_command_line_parser.add_listener
def _add_arguments(parser, **_kwargs) -> None:
    add_arguments(parser)


@events.init.add_listener
def _check_settings(environment, **_kwargs) -> None:
    """Fail fast on bad settings (locust exits 2), and pick the user class."""
    options = environment.parsed_options
    if options is None:  # used as a library
        return
    settings = LoadSettings.from_options(options)
    workload = make_workload(settings.workload, settings.seed, settings.workload_args, settings.max_tokens,
                             settings.trace_file or None)
    workload.num_requests  # noqa: B018 - a trace is read here, so a bad file fails before the test
    if not options.user_classes:
        environment.user_classes = [pick_user_class(settings)]
        logger.info("users: %s", environment.user_classes[0].__name__)
    if OpenLoopUser in environment.user_classes and not settings.open_loop:
        raise ValueError("OpenLoopUser needs --arrival-rate (requests/s) or a trace to replay")
    if settings.open_loop and (options.num_users or 1) > 1:
        logger.info("open loop: one OpenLoopUser sends every request; the load is set by --arrival-rate, not -u")


@events.test_start.add_listener
def _start_run(environment, **_kwargs) -> None:
    if isinstance(environment.runner, MasterRunner):
        return
    environment.loadtest_run = None
    # Read again here: the web UI may have changed the options since init.
    settings = LoadSettings.from_options(environment.parsed_options)
    if not environment.host:
        _abort(environment, "no host: pass --host http://HOST:PORT")
        return
    model = settings.model
    if not model:
        try:
            with requests.Session() as session:
                model = client.fetch_model(session, environment.host,
                                           client.RequestOptions(model="", api_key=settings.api_key or None))
        except (requests.RequestException, RuntimeError, KeyError, ValueError) as exc:
            _abort(environment, f"could not read the model from {environment.host}/v1/models: {exc!r}")
            return
        logger.info("model: %s (from /v1/models)", model)
    environment.loadtest_run = LoadRun(environment, settings, model)


@events.test_stopping.add_listener
def _stopping(environment, **_kwargs) -> None:
    run = getattr(environment, "loadtest_run", None)
    if run is not None:
        run.stop()


@events.test_stop.add_listener
def _stop_run(environment, **_kwargs) -> None:
    run = getattr(environment, "loadtest_run", None)
    if run is not None:
        run.close()


@events.quitting.add_listener
def _let_locust_write_final_csv(environment, **_kwargs) -> None:
    # Locust rewrites *_stats.csv every CSV_STATS_INTERVAL_SEC, not at exit, so the file can miss the
    # last second of a run (locust issues #1806, #2299). One more turn of its writer makes it final.
    if environment.parsed_options is not None and environment.parsed_options.csv_prefix:
        gevent.sleep(locust.stats.CSV_STATS_INTERVAL_SEC + 0.2)


def _abort(environment, message: str) -> None:
    logger.error(message)
    environment.process_exit_code = 2
    gevent.spawn(environment.runner.quit)
