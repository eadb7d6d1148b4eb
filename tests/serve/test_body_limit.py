"""The body limit at the ASGI level: it stops reading at the first byte past the limit."""

from __future__ import annotations

import asyncio

import pytest
from starlette.exceptions import HTTPException

from pd.serve.body_limit import MAX_DRAINED_BODY_FACTOR, BodyLimit

LIMIT = 4 << 20
CHUNK = 1 << 20


class Upload:
    """An ASGI ``receive`` that yields ``num_chunks`` chunks of 1 MiB and counts what was pulled."""

    def __init__(self, num_chunks: int):
        self.num_chunks = num_chunks
        self.pulled = 0

    async def __call__(self) -> dict:
        self.pulled += 1
        more = self.pulled < self.num_chunks
        return {"type": "http.request", "body": b"x" * CHUNK, "more_body": more}


async def _read_all(scope, receive, send) -> None:
    """An app that reads its whole body, as FastAPI does before parsing it."""
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _run(headers: list, upload: Upload) -> list[dict]:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "headers": headers}
    asyncio.run(BodyLimit(_read_all, limit=lambda: LIMIT)(scope, upload, send))
    return sent


def test_a_chunked_body_is_read_no_further_than_the_limit():
    upload = Upload(num_chunks=64)
    with pytest.raises(HTTPException) as refused:  # FastAPI turns it into the 413 response
        _run([], upload)
    assert refused.value.status_code == 413
    assert upload.pulled == LIMIT // CHUNK + 1  # the chunk that crossed the limit, and not one more


def test_a_declared_oversized_body_gets_413_after_a_bounded_drain():
    upload = Upload(num_chunks=1000)
    sent = _run([(b"content-length", str(1000 * CHUNK).encode())], upload)
    assert sent[0]["status"] == 413 and b"request_too_large" in sent[1]["body"]
    assert upload.pulled <= MAX_DRAINED_BODY_FACTOR * LIMIT // CHUNK + 1


def test_a_body_within_the_limit_reaches_the_app():
    upload = Upload(num_chunks=4)
    sent = _run([], upload)
    assert sent[0]["status"] == 200 and upload.pulled == 4
