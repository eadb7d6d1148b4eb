"""A tensor-parallel worker: ranks 1..N-1 of an engine (``python -m pd.engine.tp_worker``, its spec on stdin).

It joins its driver's group, loads only its shard, reports ready, then runs
each step it is sent until told to stop or its driver's connection closes.
It holds no scheduling state: the driver's block tables say where its KV goes.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

import torch

from pd.config import EngineConfig
from pd.engine.tp_workers import (
    TP_WIRE_VERSION,
    Failed,
    Ready,
    Stop,
    WorkerSpec,
    connect_to_driver,
    decode_to_worker,
    default_worker_threads,
    encode,
    read_worker_spec,
)

logger = logging.getLogger(__name__)


def serve_rank(spec: WorkerSpec) -> None:
    """Run rank ``spec.rank`` until stopped; any error is reported to the driver, then raised."""
    from pd.engine.model_runner import ModelRunner
    from pd.engine.tp_group import TPGroup
    from pd.model.config import load_model_config

    config = EngineConfig(**spec.engine_config)
    torch.set_num_threads(config.num_threads or default_worker_threads(spec.size))
    connection = connect_to_driver(spec)
    device = torch.device(spec.device)
    try:
        group = TPGroup(spec.rank, spec.size, spec.driver_host, spec.store_port, device,
                        config.tensor_parallel_timeout_s)
        group.connect()
        runner = ModelRunner(config, load_model_config(spec.model_dir), spec.model_dir, spec.num_blocks,
                             spec.max_model_len, group=group, device=device)
        connection.send_bytes(encode(Ready(TP_WIRE_VERSION, spec.rank, os.getpid(), runner.weight_bytes)))
        while True:
            try:
                message = decode_to_worker(connection.recv_bytes())
            except (EOFError, OSError):
                return  # the driver is gone
            if isinstance(message, Stop):
                return
            runner.forward(message)
    except BaseException as exc:
        try:
            connection.send_bytes(encode(Failed(spec.rank, f"{type(exc).__name__}: {exc}")))
        except OSError:
            pass
        raise
    finally:
        connection.close()


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    spec = read_worker_spec(sys.stdin.buffer.read())
    try:
        serve_rank(spec)
    except Exception:  # noqa: BLE001 - reported to the driver already; the exit status says it too
        traceback.print_exc()
        sys.exit(1)


if __name__ == "__main__":
    main()
