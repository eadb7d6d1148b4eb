"""A prefill engine in its own process, driven over a pipe by tests and benchmarks.

Commands (tuples) on ``conn``:
    ("prefill", request_id, token_ids)   -> encoded KVHandle bytes
    ("stats",)                           -> EngineStats as a dict
    ("step", seconds)                    -> None, after stepping that long (leases, notifications)
    ("stop",)                            -> exits
Control messages for the torch transport arrive on ``control_conn`` as bytes
and are answered with ``transport.handle_control``'s bytes.

A slow peer, on purpose: ``send_pause_s`` makes a torch prefill pause before
sending each run of blocks; ``ucx_tls`` restricts a NIXL prefill's UCX
transports (with ``"tcp"``, a READ cannot complete while this process is
stopped, since the target must make progress).
"""

from __future__ import annotations

import dataclasses
import os
import time


def prefill_worker(conn, control_conn, model_dir: str, transport_kind: str, engine_kwargs: dict,
                   send_pause_s: float = 0.0, ucx_tls: str | None = None) -> None:
    if ucx_tls is not None:
        os.environ["UCX_TLS"] = ucx_tls
    from pd import SamplingParams
    from pd.config import EngineConfig
    from pd.engine.engine import LLMEngine
    from transfer import create_transport

    options = {"role": "prefill"} if transport_kind == "torch" else {}
    if send_pause_s > 0:
        options["new_group"] = paused_sends(send_pause_s)
    transport = create_transport(transport_kind, f"prefill-{transport_kind}", **options)
    engine = LLMEngine(EngineConfig(model=model_dir, **engine_kwargs), transport)
    conn.send(("ready", engine.engine_id))
    params = SamplingParams(max_tokens=1, temperature=0)

    def serve_control() -> None:
        while control_conn is not None and control_conn.poll():
            control_conn.send(transport.handle_control(control_conn.recv()))

    try:
        while True:
            serve_control()
            if not conn.poll(0.002):
                engine.step()  # housekeeping: notifications and lease expiry
                continue
            command = conn.recv()
            if command[0] == "stop":
                return
            if command[0] == "stats":
                engine.step()
                conn.send(dataclasses.asdict(engine.stats()))
            elif command[0] == "step":
                deadline = time.monotonic() + command[1]
                while time.monotonic() < deadline:
                    serve_control()
                    engine.step()
                    time.sleep(0.002)
                conn.send(None)
            elif command[0] == "prefill":
                _, request_id, token_ids = command
                engine.add_request(request_id, token_ids, params, pin_kv=True)
                handle = None
                while handle is None:
                    for out in engine.step():
                        if out.request_id == request_id and out.finished:
                            handle = out.kv_handle
                conn.send(handle)
    finally:
        transport.close()


class _PausedSends:
    """A process group whose every ``send`` starts ``pause_s`` after it is asked for."""

    def __init__(self, group, pause_s: float):
        self._group = group
        self._pause_s = pause_s

    def send(self, tensors, rank: int, tag: int):
        time.sleep(self._pause_s)
        return self._group.send(tensors, rank, tag)

    def __getattr__(self, name: str):
        return getattr(self._group, name)


def paused_sends(pause_s: float):
    """A ``new_group`` for ``TorchTransport`` whose groups pause before each send."""
    from transfer.torch import new_pair_group

    def new_group(*args, **kwargs):
        return _PausedSends(new_pair_group(*args, **kwargs), pause_s)

    return new_group
