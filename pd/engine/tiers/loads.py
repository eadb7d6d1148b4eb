"""Loads from the disk tier and the shared store, off the engine's step: a request waits for its blocks, not the batch.

A request arriving with a prompt whose chain continues below the host tier
is held back by the engine (``begin``) while the tiers' reader threads query
the shared store and read the records into host slots. ``finish`` applies
each result between steps and submits the next tier's work; a request whose
loads are done is ready, and the engine hands it to the scheduler. Its
prefix match then finds the loaded blocks in host memory and copies them
into device blocks (``KVTiers.promote``).

    begin:   device run | host run (reserved) | disk run -> read | store run -> query -> read
                                                      \\ the chain ends at the first tier that lacks the next block

Host slots a load fills, and the host hits found at ``begin``, stay reserved
for the request until ``release`` (after its first prefix match) or until its
load ends after it was cancelled: a demotion cannot take them meanwhile.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

from pd.engine.block_pool import BlockPool
from pd.engine.request import Request
from pd.engine.tiers.host import HostTier
from pd.engine.tiers.store import StoreTier


@dataclass
class _Load:
    request: Request
    ticket: int
    hashes: Sequence[bytes]  # the prompt's blocks that may be hits (all but the last token's)
    position: int  # the chain's length so far
    reserved: list[bytes] = field(default_factory=list)  # host entries held for the request
    tier: int = 0  # the lower tier to look in next
    asked: bool = False  # that tier's store was asked already
    reading: list[tuple[bytes, Sequence[int], int]] = field(default_factory=list)  # (hash, tokens, slot) in flight
    in_flight: bool = False
    cancelled: bool = False


class TierLoads:
    def __init__(self, pool: BlockPool, host: HostTier, lower: list[StoreTier], block_size: int):
        self.pool, self.host, self.lower, self.block_size = pool, host, lower, block_size
        self._loads: dict[str, _Load] = {}  # request id -> its load, until released
        self._tickets: dict[int, _Load] = {}  # loads with a query or a read in flight
        self._next_ticket = itertools.count()
        self._ready: list[Request] = []

    @property
    def num_waiting(self) -> int:
        """Requests held back for a load in flight."""
        return len(self._tickets)

    def begin(self, request: Request) -> bool:
        """Start loading what ``request``'s prompt finds below the host tier; True when it must wait for it."""
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[:max_blocks]
        start = len(self.pool.match(hashes, request.token_ids, self.block_size))
        host_run = self.host.match(hashes[start:], request.token_ids, self.block_size, start)
        load = _Load(request, next(self._next_ticket), hashes, start + len(host_run))
        if load.position == len(hashes):
            return False
        self.host.reserve(host_run)  # before any slot is taken for a read, which could evict them
        load.reserved += host_run
        if not self._advance(load):
            self.host.unreserve(host_run)
            return False
        self._loads[request.request_id] = load
        return True

    def finish(self, tier: StoreTier, kind: str, ticket: int, run: int) -> None:
        """Apply a query's or a read's result (``StoreTier.finished``), and go on down the chain."""
        load = self._tickets.pop(ticket, None)
        if load is None:
            return
        load.in_flight = False
        if kind == "query":
            more = bool(run) and self._submit_read(load, tier, run)
        else:
            for block_hash, tokens, slot in load.reading[:run]:
                self.host.admit(slot, block_hash, tokens)
                load.reserved.append(block_hash)
            self.host.give_back([slot for _, _, slot in load.reading[run:]])
            whole = run == len(load.reading)
            load.position += run
            load.reading = []
            # A whole read goes on in the same tier (a run may take several reads); a short one ends the chain.
            load.tier, load.asked = (load.tier if whole else len(self.lower)), False
            more = self._advance(load)
        if not more:
            if load.cancelled:
                self.release(load.request.request_id)
            else:
                self._ready.append(load.request)

    def take_ready(self) -> list[Request]:
        """Requests whose loads are done, in the order they finished."""
        ready, self._ready = self._ready, []
        return ready

    def release(self, request_id: str) -> None:
        """The request has had its prefix match (or is gone): end its reservations."""
        load = self._loads.get(request_id)
        if load is None or load.in_flight:
            return
        del self._loads[request_id]
        self.host.unreserve(load.reserved)

    def cancel(self, request_id: str) -> bool:
        """The request was aborted: its reservations end now, or when its load in flight ends.

        True when it was held for its load (the scheduler never had it).
        """
        load = self._loads.get(request_id)
        if load is None:
            return False
        held = load.in_flight or any(request is load.request for request in self._ready)
        load.cancelled = True
        self._ready = [request for request in self._ready if request is not load.request]
        self.release(request_id)
        return held

    def _advance(self, load: _Load) -> bool:
        """Submit the next query or read for ``load``; False when there is nothing more to wait for."""
        while load.tier < len(self.lower) and load.position < len(load.hashes):
            tier = self.lower[load.tier]
            wanted = load.hashes[load.position:]
            run = tier.local_run(wanted)
            if run:
                return self._submit_read(load, tier, run)
            if not load.asked and tier.worth_asking(wanted):
                load.asked = True
                tier.submit_query(load.ticket, wanted)
                self._in_flight(load)
                return True
            load.tier, load.asked = load.tier + 1, False
        return False

    def _submit_read(self, load: _Load, tier: StoreTier, run: int) -> bool:
        slots = self.host.take_slots(min(run, tier.max_read_blocks))
        if not slots:
            return False  # every host slot is pinned: the request computes the rest
        first, size, tokens = load.position, self.block_size, load.request.token_ids
        load.reading = [(block_hash, tokens[(first + i) * size:(first + i + 1) * size], slot)
                        for i, (block_hash, slot) in enumerate(zip(load.hashes[first:], slots))]
        tier.submit_read(load.ticket, load.reading)
        self._in_flight(load)
        return True

    def _in_flight(self, load: _Load) -> None:
        load.in_flight = True
        self._tickets[load.ticket] = load
