"""A tensor-parallel worker: ranks 1..N-1 of an engine (``python -m pd.engine.tp.worker``, its spec on stdin).

It joins its driver's group, loads only its shard, reports ready, then runs
each step it is sent until told to stop or its driver's connection closes.
It holds no scheduling state: the driver's block tables say where its KV goes.
In a disaggregated engine it also has a KV transport of its own, and reads
the KV heads the driver's ``Pull`` names (``RankPulls``): from the prefill
ranks that hold them, or, for heads this rank shares with a lower one (MLA's
latent), from that rank's pool once it has pulled them.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

import torch

from pd.config import EngineConfig
from pd.engine.tp.driver import (
    TP_WIRE_VERSION,
    ExpertsOp,
    Failed,
    LoraLoad,
    Pull,
    PullDone,
    Ready,
    Release,
    Stop,
    WorkerSpec,
    connect_to_driver,
    decode_to_worker,
    default_worker_threads,
    encode,
    read_worker_spec,
)
from transfer.base import HeadSlice, KVTransport, TransferError, TransferHandle, TransferState

logger = logging.getLogger(__name__)

# While a pull is in flight and no message comes, how often its reads are polled.
PULL_POLL_S = 0.001


def serve_rank(spec: WorkerSpec) -> None:
    """Run rank ``spec.rank`` until stopped; any error is reported to the driver, then raised."""
    from pd.engine.model_runner import ModelRunner
    from pd.engine.tp.group import TPGroup
    from pd.model.config import load_model_config

    config = EngineConfig(**spec.engine_config)
    torch.set_num_threads(config.num_threads or default_worker_threads(spec.size))
    connection = connect_to_driver(spec)
    device = torch.device(spec.device)
    try:
        if spec.version != TP_WIRE_VERSION:
            raise ValueError(f"the driver speaks tensor-parallel version {spec.version}, "
                             f"this worker {TP_WIRE_VERSION}")
        group = TPGroup(spec.rank, spec.size, spec.driver_host, spec.store_port, device,
                        config.tensor_parallel_timeout_s)
        group.connect()
        runner = ModelRunner(config, load_model_config(spec.model_dir), spec.model_dir, spec.num_blocks,
                             spec.max_model_len, group=group, device=device)
        pulls = RankPulls(rank_transport(spec, runner.kv_cache), connection)
        connection.send_bytes(encode(Ready(TP_WIRE_VERSION, spec.rank, os.getpid(), runner.weight_bytes,
                                           pulls.metadata())))
        try:
            while True:
                if pulls.pending and not connection.poll(PULL_POLL_S):
                    pulls.poll()
                    continue
                try:
                    message = decode_to_worker(connection.recv_bytes())
                except (EOFError, OSError):
                    return  # the driver is gone
                if isinstance(message, Stop):
                    return
                if isinstance(message, (Pull, Release)):
                    pulls.handle(message)
                elif isinstance(message, ExpertsOp):
                    runner.experts_control.run(message)
                elif isinstance(message, LoraLoad):
                    runner.load_lora_slot(message.slot, message.name, message.path, message.digest)
                else:
                    runner.forward(message)
                pulls.poll()
        finally:
            pulls.close()
    except BaseException as exc:
        try:
            connection.send_bytes(encode(Failed(spec.rank, f"{type(exc).__name__}: {exc}")))
        except OSError:
            pass
        raise
    finally:
        connection.close()


def rank_transport(spec: WorkerSpec, kv_cache: torch.Tensor) -> KVTransport | None:
    """This rank's own KV transport (named ``<engine_id>-r<rank>``) over its pool, when the engine moves KV."""
    if spec.transport is None:
        return None
    from pd.engine.kv_layout import pool_heads
    from transfer import create_transport

    os.environ.update(spec.transport_env)  # UCX reads its settings when the agent starts
    transport = create_transport(spec.transport, f"{spec.engine_id}-r{spec.rank}")
    transport.register(kv_cache, num_heads=pool_heads(kv_cache))
    return transport


class RankPulls:
    """The KV reads the driver asked of this rank, each answered with ``PullDone`` once it is quiesced."""

    def __init__(self, transport: KVTransport | None, connection):
        self.transport = transport
        self.connection = connection
        self._pulls: dict[int, tuple[list[TransferHandle], list[str]]] = {}  # id -> handles, errors
        self._peers: dict[bytes, str] = {}

    @property
    def pending(self) -> bool:
        return bool(self._pulls)

    def metadata(self) -> bytes:
        return self.transport.local_metadata() if self.transport is not None else b""

    def handle(self, message: Pull | Release) -> None:
        if isinstance(message, Release):
            for handle in self._pulls.get(message.pull_id, ([], []))[0]:
                handle.release()
            return
        handles, errors = [], []
        self._pulls[message.pull_id] = (handles, errors)
        try:
            if self.transport is None:
                raise TransferError("this rank has no KV transport")
            for metadata, remote_head, local_head, count in message.sources:
                if metadata not in self._peers:
                    self._peers[metadata] = self.transport.add_peer(metadata)
                handles.append(self.transport.read_blocks(
                    self._peers[metadata], message.remote_block_ids, message.local_block_ids, notify="",
                    heads=HeadSlice(remote_head, local_head, count)))
        except Exception as exc:  # noqa: BLE001 - answered as a failed pull; the driver recomputes
            errors.append(f"{type(exc).__name__}: {exc}")
            for handle in handles:
                handle.release()

    def poll(self) -> None:
        """Answer every pull whose reads all ended and can no longer write."""
        if self.transport is not None:
            self.transport.poll_notifications()  # reads of this rank post none; drained all the same
        for pull_id, (handles, errors) in list(self._pulls.items()):
            states = [handle.poll() for handle in handles]
            if TransferState.PENDING in states or not all(handle.quiesced() for handle in handles):
                continue
            errors += [handle.error or "failed" for handle, state in zip(handles, states)
                       if state is not TransferState.DONE]
            del self._pulls[pull_id]
            counts = [handle.moved_bytes for handle in handles]
            moved = None if errors or None in counts else sum(counts)
            self.connection.send_bytes(encode(PullDone(pull_id, not errors, "; ".join(errors) or None, moved)))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


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
