"""A prefill engine in its own process, driven over a pipe by tests and benchmarks.

Commands (tuples) on ``conn``:
    ("prefill", request_id, token_ids)   -> encoded KVHandle bytes
    ("stats",)                           -> EngineStats as a dict
    ("step", seconds)                    -> None, after stepping that long (leases, notifications)
    ("stop",)                            -> exits
Control messages for the torch transport arrive on ``control_conn`` as bytes
and are answered with ``transport.handle_control``'s bytes.
"""

from __future__ import annotations

import dataclasses
import time


def prefill_worker(conn, control_conn, model_dir: str, transport_kind: str, engine_kwargs: dict) -> None:
    from pd import SamplingParams
    from pd.config import EngineConfig
    from pd.engine.engine import LLMEngine
    from transfer import create_transport

    options = {"role": "prefill"} if transport_kind == "torch" else {}
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
