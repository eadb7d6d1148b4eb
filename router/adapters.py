"""What a replica's LoRA adapter slots mean for a request placed there. Pure Python, no Ray.

A replica reports the adapters in its device slots and how many slots it has
(``RoutingStats.adapters``, ``max_loras``). Placed on it, a request under an
adapter falls in one of three cases (``AdapterFit``):

- ``HELD``: the replica holds the adapter (or the request runs on the base
  model): nothing to do.
- ``LOAD``: a slot is free: the adapter's weights are copied into it between
  two steps, once.
- ``EVICT``: every slot is held: the load evicts the least recently used
  adapter, which whoever runs it next must load again, and the request may
  wait for a slot: the engine's scheduler admits at most ``max_loras``
  adapters among its running requests, passing the others over until one
  drains (``pd.lora.admission``).

The wait is priced whenever every slot is held, not scaled by the load the
replica last reported: a report comes once a period, a replica idle at its
report need not be idle when the request lands, and the requests of an
adapter brought to a replica keep coming there (their prefixes are cached
there), so the adapter it displaced churns on. As with a prefix copied into
a second cache (``router.policy``), the price stands for that churn.

A replica that reports no slots (``max_loras`` 0: no report yet) is a ``LOAD``.
Each policy prices the three cases in its own units (``router.policy``,
``router.decode_policy``, ``router.latency``).
"""

from __future__ import annotations

import enum
from typing import Collection


class AdapterFit(enum.Enum):
    """What placing a request on a replica takes for its adapter."""

    HELD = "held"  # no adapter asked for, or the replica holds it
    LOAD = "load"  # a free slot: one load
    EVICT = "evict"  # every slot held: a load, another's reload, perhaps a wait for a slot

    def price(self, load: float, wait: float) -> float:
        """The case in a policy's own units, given what one ``load`` and a ``wait`` for a slot cost: nothing
        held, one load for a free slot, and for a full one the load, the evicted adapter's next load and the
        wait."""
        if self is AdapterFit.HELD:
            return 0.0
        return load if self is AdapterFit.LOAD else 2 * load + wait


def adapter_fit(adapter: str | None, held: Collection[str], max_loras: int) -> AdapterFit:
    """The case of a request under ``adapter`` (None: the base model) on a replica holding ``held`` of its
    ``max_loras`` slots."""
    if adapter is None or adapter in held:
        return AdapterFit.HELD
    if max_loras and len(held) >= max_loras:
        return AdapterFit.EVICT
    return AdapterFit.LOAD


class SentAdapters:
    """The adapters a router sent each replica since that replica's last report.

    A replica runs a request's adapter once the request lands, before its next
    report can show it: a router counts the adapters it sent as held there, as
    its prefix index holds a routed prompt's blocks (``PrefixIndex.insert``).
    Without it, the requests of an adapter that spilled to a new replica would
    each be priced a load there until its report came, and spill further.
    """

    def __init__(self) -> None:
        self._sent: dict[str, set[str]] = {}

    def fit(self, adapter: str | None, replica_id: str, held: Collection[str], max_loras: int) -> AdapterFit:
        """``adapter_fit`` on a replica whose report says ``held``, with what was sent it since."""
        sent = self._sent.get(replica_id)
        if not sent:
            return adapter_fit(adapter, held, max_loras)
        if adapter is None or adapter in sent or adapter in held:
            return AdapterFit.HELD
        return adapter_fit(adapter, sent.union(held), max_loras)

    def sent(self, replica_id: str, adapter: str | None) -> None:
        if adapter is not None:
            self._sent.setdefault(replica_id, set()).add(adapter)

    def reported(self, replica_id: str) -> None:
        """A new report from ``replica_id``: its ``adapters`` show what it holds now."""
        self._sent.pop(replica_id, None)
