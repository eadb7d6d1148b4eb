"""The driver's side of tensor parallelism: it is rank 0, and starts and feeds ranks 1..N-1.

The engine (scheduler, block pool, sampler) stays in the driver's process,
which runs rank 0's shard itself. Each step it sends the step's flattened
inputs (``StepLists``, typed msgpack) to every worker over an authenticated
local connection, then runs its own forward pass; the collectives inside it
keep the ranks in step, and the logits arrive whole on rank 0. Workers hold
no scheduling state (``pd.engine.tp.worker``).

The connection carries steps, and a disaggregated engine's KV pulls
(``Pull``, ``Release``; each rank answers ``PullDone``, see
``pd.engine.disagg.pulls``). An idle engine holds no collective open: a
collective's timeout bounds a step, not the wait for one. A worker
that dies closes its connection and its group sockets: the driver's next
collective or send fails, naming the rank, and the engine stops (a Serve
replica is then replaced). A driver that dies closes the connections, and
its workers exit.

Workers start through a launcher: ``LocalLauncher`` runs them as child
processes (the offline API, tests); ``pd.serve`` launches them as Ray actors
in the replica's placement group.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from typing import Protocol

import msgspec
import torch

from pd.engine.kv_budget import DeviceShare
from pd.engine.tp.group import TPGroup

logger = logging.getLogger(__name__)

# 2: a worker's pool may be a share of its device (WorkerSpec.num_blocks); 3: PullDone.moved_bytes
TP_WIRE_VERSION = 4


class WorkerSpec(msgspec.Struct, frozen=True):
    """What a worker needs to build its rank: the engine's config and where to find the driver."""

    version: int
    rank: int
    size: int
    engine_config: dict  # ``EngineConfig`` fields
    model_dir: str
    device: str  # the worker's own device, as it names it
    # The pool's blocks, or a share of each rank's device: every rank profiles its own, and all take the
    # fewest blocks any has room for (pd.engine.kv_profile).
    num_blocks: int | DeviceShare
    max_model_len: int
    driver_host: str
    driver_port: int  # the step connection
    store_port: int  # the group's TCP store
    authkey: str  # hex
    # A KV transport of the rank's own for disaggregated serving ("nixl"), named ``<engine_id>-r<rank>``,
    # created with these environment variables (UCX_*) set; None: the engine moves no KV.
    transport: str | None = None
    transport_env: dict[str, str] = {}
    engine_id: str = ""


class StepLists(msgspec.Struct, tag="step", frozen=True):
    """One step's flattened inputs, as ``ModelRunner.flatten`` builds them (see ``ModelRunner.prepare``)."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    logits_indices: list[int]
    cu_seqlens: list[int]
    seq_lens: list[int]
    block_table: list[int]  # [num_seqs, max_blocks], row-major, padded
    max_blocks: int
    # Each token's LoRA slot (``pd_kernels.NO_LORA``: the base model), when a request of the step has an adapter.
    lora_rows: list[int] | None = None


class Stop(msgspec.Struct, tag="stop", frozen=True):
    pass


class ExpertsOp(msgspec.Struct, tag="experts", frozen=True):
    """Before the next step (expert parallelism, ``pd.engine.ep.dispatch``): add up the ranks' expert loads
    (``sync_load``), then move layer ``move_layer``'s experts to their new placement (-1: none)."""

    sync_load: bool
    move_layer: int = -1


class LoraLoad(msgspec.Struct, tag="lora_load", frozen=True):
    """Before the next step: load LoRA adapter ``name`` (the weights of ``digest``, at ``path``) into ``slot``,
    this rank's shard of it (``pd.lora.slots``)."""

    slot: int
    name: str
    path: str
    digest: str


class Pull(msgspec.Struct, tag="pull", frozen=True):
    """Read KV heads into this rank's pool: from each source ``(peer metadata, remote head, local head, count)``,
    blocks ``remote_block_ids`` into ``local_block_ids``. Answered with ``PullDone`` once no byte can land.

    A source is a prefill rank, or a rank of this engine that pulled the same (replicated) heads already."""

    pull_id: int
    sources: list[tuple[bytes, int, int, int]]
    remote_block_ids: list[int]
    local_block_ids: list[int]


class Release(msgspec.Struct, tag="release", frozen=True):
    """Give a pull up (its ``PullDone`` still comes, once its reads are quiesced)."""

    pull_id: int


class PullDone(msgspec.Struct, tag="pull_done", frozen=True):
    """A pull's reads have ended and can no longer write; ``moved_bytes``: what the transport measured they
    moved, when ``ok`` and it measured every read (NIXL's telemetry), else None."""

    pull_id: int
    ok: bool
    error: str | None = None
    moved_bytes: int | None = None


class Ready(msgspec.Struct, tag="ready", frozen=True):
    version: int
    rank: int
    pid: int
    weight_bytes: int  # the shard's, as loaded
    transport_metadata: bytes = b""  # its KV transport's local_metadata(), when it has one


class Failed(msgspec.Struct, tag="failed", frozen=True):
    rank: int
    error: str


ToWorker = StepLists | Stop | Pull | Release | ExpertsOp | LoraLoad
FromWorker = Ready | Failed | PullDone
_to_worker = msgspec.msgpack.Decoder(ToWorker)
_from_worker = msgspec.msgpack.Decoder(FromWorker)
_encoder = msgspec.msgpack.Encoder()


class TPWorkerError(RuntimeError):
    """A tensor-parallel worker failed or died; the engine cannot go on."""


class Launcher(Protocol):
    """Starts the worker for ``spec.rank`` and can stop them all."""

    def check(self, size: int, device: torch.device) -> None:
        """Raise ``ValueError`` if ``size`` ranks cannot run here."""

    def device_of(self, rank: int, device: torch.device) -> str:
        """The device rank ``rank`` runs on, as it names it."""

    def launch(self, spec: WorkerSpec) -> None: ...

    def stop(self, timeout_s: float) -> None: ...


class LocalLauncher:
    """Workers as child processes of this one (``python -m pd.engine.tp.worker``, the spec on stdin)."""

    def __init__(self) -> None:
        self.processes: dict[int, subprocess.Popen] = {}

    def check(self, size: int, device: torch.device) -> None:
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"{size} ranks (tensor_parallel_size, expert_parallel_size) need {size} devices, and this machine has "
                             f"{torch.cuda.device_count()} CUDA devices")

    def device_of(self, rank: int, device: torch.device) -> str:
        return f"cuda:{rank}" if device.type == "cuda" else device.type

    def launch(self, spec: WorkerSpec) -> None:
        process = subprocess.Popen([sys.executable, "-m", "pd.engine.tp.worker"], stdin=subprocess.PIPE)
        process.stdin.write(worker_spec_json(spec))
        process.stdin.close()
        self.processes[spec.rank] = process

    def pids(self) -> dict[int, int]:
        return {rank: process.pid for rank, process in self.processes.items()}

    def stop(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()


def worker_spec_json(spec: WorkerSpec) -> bytes:
    return msgspec.json.encode(spec)


def read_worker_spec(data: bytes) -> WorkerSpec:
    return msgspec.json.decode(data, type=WorkerSpec)


def encode(message: ToWorker | FromWorker) -> bytes:
    return _encoder.encode(message)


def decode_to_worker(data: bytes) -> ToWorker:
    return _to_worker.decode(data)


def _node_address() -> str:
    """This node's address as its peers on it reach it (loopback is enough: the group never leaves the node)."""
    return "127.0.0.1"


class TPWorkers:
    """Ranks 1..N-1 of this driver's group, connected and ready; ``send`` each step, ``close`` at the end."""

    def __init__(self, size: int, launcher: Launcher, timeout_s: float):
        self.size = size
        self.launcher = launcher
        self.timeout_s = timeout_s
        self.host = _node_address()
        self._authkey = secrets.token_bytes(32)
        self._listener = socket.create_server((self.host, 0))
        self.connections: dict[int, Connection] = {}
        self.ready: dict[int, Ready] = {}  # each worker's report
        self.pulls_done: dict[tuple[int, int], PullDone] = {}  # (rank, pull id) -> its answer, until taken
        self._receive_lock = threading.Lock()  # the engine's thread and the health check both read

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    def launch(self, engine_config, model_dir: str, num_blocks: int | DeviceShare, max_model_len: int,
               store_port: int, device: torch.device, worker_transport: dict | None = None) -> None:
        """Start every worker; returns once each has connected (they then join the group and load)."""
        for rank in range(1, self.size):
            self.launcher.launch(WorkerSpec(
                version=TP_WIRE_VERSION, rank=rank, size=self.size, engine_config=dataclasses.asdict(engine_config),
                model_dir=str(model_dir), device=self.launcher.device_of(rank, device), num_blocks=num_blocks, max_model_len=max_model_len, driver_host=self.host,
                driver_port=self.port, store_port=store_port, authkey=self._authkey.hex(),
                **(worker_transport or {})))
        self._listener.settimeout(self.timeout_s)
        try:
            while len(self.connections) < self.size - 1:
                rank, connection = self._accept()
                self.connections[rank] = connection
        except (OSError, EOFError, ValueError) as exc:
            self.close()
            raise TPWorkerError(f"tensor-parallel workers did not connect within {self.timeout_s} s "
                                f"({len(self.connections)} of {self.size - 1}): {exc}") from exc

    def _accept(self) -> tuple[int, Connection]:
        """One worker's connection, authenticated both ways (as ``multiprocessing.connection.Listener``), and its rank."""
        sock, _ = self._listener.accept()
        sock.setblocking(True)
        connection = Connection(sock.detach())
        deliver_challenge(connection, self._authkey)
        answer_challenge(connection, self._authkey)
        if not connection.poll(self.timeout_s):
            raise ValueError("a worker connected but did not name its rank")
        rank = int.from_bytes(connection.recv_bytes(), "little")
        if not 0 < rank < self.size or rank in self.connections:
            raise ValueError(f"a worker named rank {rank}, not one of the ranks still missing")
        return rank, connection

    def wait_ready(self) -> None:
        """Each worker's report that its shard is loaded (or its error)."""
        for rank, connection in sorted(self.connections.items()):
            message = self._receive(rank, connection)
            if isinstance(message, Failed):
                self.close()
                raise TPWorkerError(f"tensor-parallel rank {rank} failed to start: {message.error}")
            if message.version != TP_WIRE_VERSION:
                self.close()
                raise TPWorkerError(f"tensor-parallel rank {rank} speaks version {message.version}, "
                                    f"the driver {TP_WIRE_VERSION}")
            self.ready[rank] = message

    def _receive(self, rank: int, connection: Connection) -> FromWorker:
        if not connection.poll(self.timeout_s):
            self.close()
            raise TPWorkerError(f"tensor-parallel rank {rank} did not report within {self.timeout_s} s")
        try:
            return _from_worker.decode(connection.recv_bytes())
        except (EOFError, OSError) as exc:
            self.close()
            raise TPWorkerError(f"tensor-parallel rank {rank} exited before it was ready") from exc

    def send(self, step: StepLists) -> None:
        data = encode(step)
        for rank in self.connections:
            self.send_to(rank, data)

    def send_to(self, rank: int, data: bytes | Pull | Release | ExpertsOp | LoraLoad) -> None:
        if not isinstance(data, bytes):
            data = encode(data)
        try:
            self.connections[rank].send_bytes(data)
        except OSError as exc:
            raise TPWorkerError(f"tensor-parallel rank {rank} is gone ({exc})") from exc

    def transport_metadata(self, rank: int) -> bytes:
        """Rank ``rank``'s KV transport's metadata, as its ``Ready`` said (empty without one)."""
        return self.ready[rank].transport_metadata

    def take_pull_done(self, rank: int, pull_id: int) -> PullDone | None:
        """Rank ``rank``'s answer to pull ``pull_id``, once it came (raises if a worker failed or died)."""
        self.check_alive()
        return self.pulls_done.pop((rank, pull_id), None)

    def failure(self, exc: BaseException) -> TPWorkerError:
        """What a failed collective means: the error a worker reported, else which worker's connection closed."""
        try:
            self.check_alive()
        except TPWorkerError as found:
            return found
        return TPWorkerError(f"a tensor-parallel collective failed: {exc}")

    def check_alive(self) -> None:
        """Read what workers sent: keep pull answers; raise ``TPWorkerError`` if a worker reported a failure
        or its connection closed (it died)."""
        with self._receive_lock:
            for rank, connection in self.connections.items():
                while True:
                    try:
                        if not connection.poll(0):
                            break  # nothing more to read: alive
                        message = _from_worker.decode(connection.recv_bytes())
                    except (EOFError, OSError, msgspec.DecodeError) as exc:
                        raise TPWorkerError(f"tensor-parallel rank {rank} died ({type(exc).__name__})") from exc
                    if isinstance(message, Failed):
                        raise TPWorkerError(f"tensor-parallel rank {rank} failed: {message.error}")
                    if isinstance(message, PullDone):
                        self.pulls_done[(rank, message.pull_id)] = message

    def close(self) -> None:
        """Tell every worker to stop, and wait for them (killing any that does not stop in time)."""
        for connection in self.connections.values():
            try:
                connection.send_bytes(encode(Stop()))
                connection.close()
            except OSError:
                pass
        self.connections.clear()
        self._listener.close()
        self.launcher.stop(timeout_s=min(self.timeout_s, 10.0))


def connect_to_driver(spec: WorkerSpec) -> Connection:
    """A worker's connection to its driver, announcing its rank."""
    connection = Client((spec.driver_host, spec.driver_port), authkey=bytes.fromhex(spec.authkey))
    connection.send_bytes(spec.rank.to_bytes(4, "little"))
    return connection


def default_worker_threads(size: int) -> int:
    """CPU threads per rank when the config names none: the machine's cores shared among the ranks."""
    return max(1, (os.cpu_count() or 1) // size)


def start_driver(config, model_dir, num_blocks: int | DeviceShare, max_model_len: int, launcher: Launcher | None,
                 device, worker_transport: dict | None = None) -> tuple[TPGroup, TPWorkers]:
    """Rank 0's group, with ranks 1..N-1 launched and joined (they load their shards meanwhile)."""
    size = config.num_ranks
    launcher = launcher or LocalLauncher()
    launcher.check(size, device)
    group = TPGroup(0, size, _node_address(), 0, device, config.tensor_parallel_timeout_s)
    workers = TPWorkers(size, launcher, config.tensor_parallel_timeout_s)
    try:
        workers.launch(config, model_dir, num_blocks, max_model_len, group.port, device, worker_transport)
        group.connect()
    except BaseException:
        workers.close()
        group.close()
        raise
    return group, workers
