"""The ingress's error handlers: a client that left is a cancellation, never an internal error."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from fastapi import FastAPI
from ray.exceptions import TaskCancelledError
from ray.serve.exceptions import RequestCancelledError
from starlette.requests import Request

from pd.serve.errors import CLIENT_CLOSED, classify, install_error_handlers
from pd.serve.timeline import Timeline


def _handle(exc: Exception, timeline: Timeline) -> tuple[int, dict]:
    app = FastAPI()
    install_error_handlers(app)
    request = Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []})
    request.state.request_id = "req-1"
    request.state.timeline = timeline
    response = asyncio.run(app.exception_handlers[Exception](request, exc))
    return response.status_code, json.loads(response.body)


@pytest.mark.parametrize("exc", [RequestCancelledError("req-1"), TaskCancelledError()])
def test_a_cancelled_call_is_the_client_leaving_not_an_internal_error(exc, caplog):
    timeline = Timeline("req-1")
    with caplog.at_level(logging.DEBUG, logger="pd.serve.errors"):
        status, body = _handle(exc, timeline)
    assert status == CLIENT_CLOSED == 499
    assert body["error"]["type"] == "cancelled" and body["error"]["request_id"] == "req-1"
    assert timeline.status == "cancelled"
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]


def test_an_unknown_failure_is_still_a_logged_500(caplog):
    timeline = Timeline("req-1")
    with caplog.at_level(logging.ERROR, logger="pd.serve.errors"):
        status, body = _handle(RuntimeError("boom"), timeline)
    assert status == 500 and body["error"]["message"] == "internal server error"
    assert timeline.status == "error"
    assert [record.message for record in caplog.records] == ["internal error: RuntimeError('boom')"]


def test_classify_names_a_cancellation():
    assert classify(RequestCancelledError("req-1")).status == CLIENT_CLOSED
    assert classify(RuntimeError("boom")).status == 500
