"""How many adapters a batch may run at once: a waiting request is admitted only where its adapter has a slot.

Every running request is in every step, so admitting at most ``max_loras``
adapters among the running (and those pulling their KV to run) keeps each
step within the device's slots. A request whose adapter finds no room is
passed over, and those behind it admitted where they fit, as vLLM does; but
once it has been passed over ``MAX_WAITS`` times, nothing behind it is
admitted, so the running adapters drain and it gets a slot (no adapter
starves behind busy ones).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pd.engine.request import Request

MAX_WAITS = 64  # steps a request may be passed over for its adapter before the queue behind it stops


class AdapterRoom:
    """The adapters of ``running`` requests, and whether a waiting request's fits beside them."""

    def __init__(self, max_loras: int, running: Iterable[Request]):
        self.max_loras = max_loras
        self.active = {request.lora for request in running if request.lora is not None}

    def fits(self, request: Request) -> bool:
        return request.lora is None or request.lora in self.active or len(self.active) < self.max_loras

    def admitted(self, request: Request) -> None:
        if request.lora is not None:
            self.active.add(request.lora)
