"""One locust test run: the workload, the request counter, the per-request log and the locust events.

Every request fires locust request events, so they show in locust's
statistics, CSVs and web UI, each with its own ``request_type``:

    TTFT  time to first token          response_length = output tokens
    ITL   one per inter-token gap      response_length = 0
    TPOT  (E2E - TTFT) / (tokens - 1)  response_length = output tokens
    E2E   end to end; failures here    response_length = output tokens

A request still in flight when the run stops is logged as ``cutoff``, with
its timings so far, and fires no event: it is neither a success nor a failure.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

# locust first: importing it monkey-patches the stdlib for gevent, which must precede requests.
from locust.exception import ResponseError  # isort: skip
import gevent
from gevent import GreenletExit

from loadtest import client
from loadtest.settings import LoadSettings
from pd.workload.records import META_SUFFIX, REQUESTS_SUFFIX, RequestLog, RequestRecord, RunMeta, Status
from pd.workload.workloads import LoadRequest, TraceWorkload, Workload, arrivals, make_workload, trace_arrivals

if TYPE_CHECKING:
    import requests

logger = logging.getLogger(__name__)


class LoadRun:
    """State shared by the users of one run (from locust's ``test_start`` to ``test_stop``)."""

    def __init__(self, environment, settings: LoadSettings, model: str):
        self.environment = environment
        self.settings = settings
        self.workload: Workload = make_workload(settings.workload, settings.seed, settings.workload_args,
                                                settings.max_tokens, settings.trace_file or None)
        self.options = client.RequestOptions(model=model, stream=settings.stream, ignore_eos=settings.ignore_eos,
                                             api_key=settings.api_key or None,
                                             timeout_s=settings.request_timeout_s)
        self.base_url = environment.host
        self._indices = itertools.count()
        self.num_in_flight = 0
        self.stopping = False
        self._quitting = False
        prefix = environment.parsed_options.csv_prefix if environment.parsed_options else None
        self.log = RequestLog(prefix + REQUESTS_SUFFIX) if prefix else None
        self.meta_path = prefix + META_SUFFIX if prefix else None
        options = environment.parsed_options
        self.meta = RunMeta(
            label=settings.label or self.base_url, workload=settings.workload,
            workload_args=options.workload_args if options else "", seed=settings.seed, model=model,
            host=self.base_url, stream=settings.stream, arrival_rate=settings.arrival_rate,
            arrival_process=settings.arrival_process if settings.open_loop else "closed",
            num_users=getattr(options, "num_users", None) or 0,
            slo_ttft_ms=settings.slo_ttft_ms, slo_tpot_ms=settings.slo_tpot_ms, start_time=time.time(),
        )
        if self.meta_path:
            self.meta.write(self.meta_path)

    # Which request next -------------------------------------------------------

    def next_index(self) -> int | None:
        """The next request index for a closed-loop user; None once a finite workload is used up."""
        index = next(self._indices)
        total = self.workload.num_requests
        return index if total is None or index < total else None

    def arrivals(self) -> Iterator[tuple[float, int]]:
        """``(seconds from the start, request index)`` of each open-loop arrival, in order."""
        if isinstance(self.workload, TraceWorkload):
            return trace_arrivals(self.workload, self.settings.arrival_rate)
        return arrivals(self.settings.arrival_rate, self.settings.arrival_process, self.settings.seed)

    # Sending --------------------------------------------------------------------

    def endpoint_is_chat(self, request: LoadRequest, endpoint: str) -> bool:
        if endpoint == "auto":
            endpoint = self.settings.endpoint
        return request.is_chat if endpoint == "auto" else endpoint == "chat"

    def send(self, session: requests.Session, request: LoadRequest, endpoint: str = "auto") -> None:
        """Send one request, log it, fire its events. ``endpoint``: auto, chat or completions."""
        chat = self.endpoint_is_chat(request, endpoint)
        path = client.CHAT_PATH if chat else client.COMPLETIONS_PATH
        body = client.request_body(request, chat, self.options)
        result = client.StreamResult(start_time=time.time())
        started = time.perf_counter()
        self.num_in_flight += 1
        try:
            client.send(session, self.base_url, path, body, self.options, result)
        except GreenletExit:
            result.e2e_s = time.perf_counter() - started  # how long it had run when the run ended
            self._log(request, path, result, Status.CUTOFF)
            raise
        finally:
            self.num_in_flight -= 1
        if result.error is not None and self.stopping:
            self._log(request, path, result, Status.CUTOFF)
            return
        self._log(request, path, result, Status.OK if result.error is None else Status.FAILED)
        self._fire(f"{path} ({request.kind})", result)

    def _fire(self, name: str, result: client.StreamResult) -> None:
        fire = self.environment.events.request.fire
        tokens = result.output_tokens
        if result.error is not None:
            fire(request_type="E2E", name=name, response_time=result.e2e_s * 1000, response_length=tokens,
                 exception=ResponseError(result.error), context={})
            return
        fire(request_type="TTFT", name=name, response_time=result.ttft_s * 1000, response_length=tokens,
             exception=None, context={})
        for gap in result.itl_s:
            fire(request_type="ITL", name=name, response_time=gap * 1000, response_length=0, exception=None,
                 context={})
        if not math.isnan(result.tpot_s):
            fire(request_type="TPOT", name=name, response_time=result.tpot_s * 1000, response_length=tokens,
                 exception=None, context={})
        fire(request_type="E2E", name=name, response_time=result.e2e_s * 1000, response_length=tokens,
             exception=None, context={})

    def _log(self, request: LoadRequest, path: str, result: client.StreamResult, status: str) -> None:
        if self.log is None:
            return
        self.log.write(RequestRecord(
            index=request.index, kind=request.kind, endpoint=path, start_time=result.start_time, status=status,
            ttft_ms=result.ttft_s * 1000, tpot_ms=result.tpot_s * 1000, e2e_ms=result.e2e_s * 1000,
            prompt_tokens=result.prompt_tokens, max_tokens=request.max_tokens, output_tokens=result.output_tokens,
            num_chunks=result.num_chunks,
            itl_ms=tuple(gap * 1000 for gap in result.itl_s), error=result.error or "",
        ))

    # Ending ---------------------------------------------------------------------

    def finish_when_idle(self) -> None:
        """A finite workload is used up: end the test once the last request is answered."""
        if self.num_in_flight == 0 and not self._quitting:
            self._quitting = True
            logger.info("workload finished: every request was sent and answered")
            gevent.spawn(self.environment.runner.quit)

    def stop(self) -> None:
        self.stopping = True

    def close(self) -> None:
        if self.meta_path:
            end = RunMeta(**{**self.meta.__dict__, "end_time": time.time()})
            end.write(self.meta_path)
        if self.log is not None:
            self.log.close()
