"""Prefill side of the torch backend: one ``Pair`` per decode engine, sending its runs in order."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

import torch

from transfer.torch.group import DECODE_RANK, PREFILL_RANK, TAG_LIMIT, abort_group

logger = logging.getLogger(__name__)


class Pair:
    """One decode engine's group and the thread that sends to it.

    The thread joins the group as rank 0 (its decode peer joins as rank 1),
    then sends each submitted request's runs, tagged ``first_tag + i``, and
    reports the request id to ``on_sent`` once every run is out. When a send
    fails (the reader gave up or is gone), the group is aborted and
    ``on_broken`` told: the reader reconnects with a new group.
    """

    def __init__(self, decode: str, group: str, make_group: Callable[[int], object], pool: torch.Tensor,
                 on_sent: Callable[[str], None], on_broken: Callable[["Pair"], None]):
        self.decode = decode
        self.group = group
        self._pool = pool
        self._process_group = None
        # Passed in by the transport: the group factory and what to do after each send.
        self._make_group = make_group
        self._on_sent = on_sent
        self._on_broken = on_broken
        self._queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"kv-pair-{decode}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, request_id: str, runs: list[tuple[int, int]], first_tag: int) -> None:
        self._queue.put((request_id, runs, first_tag))

    def stop(self) -> None:
        self._queue.put(None)
        abort_group(self._process_group)

    def _run(self) -> None:
        try:
            self._process_group = self._make_group(PREFILL_RANK)
        except Exception as exc:  # noqa: BLE001 - the reader times out and reconnects
            logger.warning("group %s with %s never formed: %s", self.group, self.decode, exc)
            self._on_broken(self)
            return
        try:
            while (item := self._queue.get()) is not None:
                request_id, runs, first_tag = item
                try:
                    self._send(runs, first_tag)
                except Exception as exc:  # noqa: BLE001 - the reader is gone or gave up; it will reconnect
                    logger.warning("sending %s to %s failed: %s", request_id, self.decode, exc)
                    abort_group(self._process_group)
                    self._on_broken(self)
                    return
                self._on_sent(request_id)
        finally:
            self._process_group = None

    def _send(self, runs: list[tuple[int, int]], first_tag: int) -> None:
        works = [self._process_group.send([self._pool[start : start + n]], DECODE_RANK, (first_tag + i) % TAG_LIMIT)
                 for i, (start, n) in enumerate(runs)]
        for work in works:
            work.wait()
