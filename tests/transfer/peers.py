"""Engine-like peer processes for transfer tests.

Each ``Peer`` is a spawned process that owns a small block-major KV pool
(every block filled with a pattern unique to its engine seed and block id)
and a transport, and runs the commands the test sends over a pipe. A torch
prefill peer also serves its transport's ``handle_control`` on a Unix
socket; a torch decode peer's ``control`` connects there.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import Client, Listener

import torch

NUM_BLOCKS = 64
BLOCK_SHAPE = (2, 2, 4, 2, 16)  # [num_layers, 2, block_size, num_kv_heads, head_dim], float32
BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4
COMMAND_TIMEOUT_S = 30.0


def block_pattern(seed: int, block_id: int) -> bytes:
    """The bytes of block ``block_id`` in the pool of the engine seeded ``seed``."""
    offsets = torch.arange(BLOCK_BYTES, dtype=torch.int64)
    return ((offsets * 7 + block_id * 131 + seed * 1009) % 251).to(torch.uint8).numpy().tobytes()


def new_pool(seed: int | None) -> torch.Tensor:
    """A pool with every block patterned, or all zeros when ``seed`` is None."""
    pool = torch.zeros(NUM_BLOCKS, *BLOCK_SHAPE, dtype=torch.float32)
    if seed is not None:
        raw = pool.view(NUM_BLOCKS, -1).view(torch.uint8)
        for block_id in range(NUM_BLOCKS):
            raw[block_id] = torch.frombuffer(bytearray(block_pattern(seed, block_id)), dtype=torch.uint8)
    return pool


class PeerError(RuntimeError):
    """A command raised inside the peer process; the message names the exception."""


class Peer:
    """A transport in its own process: ``call(command, *args)`` runs ``command`` there."""

    def __init__(self, kind: str, name: str, *, role: str, seed: int | None, timeout_s: float = 5.0):
        ctx = multiprocessing.get_context("spawn")
        self.name = name
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, kind, name, role, seed, timeout_s), daemon=True)
        self.process.start()
        child.close()
        try:
            self.metadata: bytes = self.call("metadata")
            self.control_address: str | None = self.call("control_address")
        except BaseException:
            self.stop()
            raise

    def call(self, command: str, *args, timeout: float = COMMAND_TIMEOUT_S):
        self._conn.send((command, args))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"{self.name}: {command} did not answer in {timeout}s")
        try:
            ok, value = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise PeerError(f"{self.name} exited during {command}: {exc!r}") from None
        if not ok:
            raise PeerError(value)
        return value

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)

    def stop(self) -> None:
        try:
            if self.process.is_alive():
                self._conn.send(("exit", ()))
                self.process.join(5)
        except (OSError, EOFError):
            pass
        finally:
            self.kill()
            self._conn.close()


def stop_all(peers) -> None:
    for peer in peers:
        peer.stop()


class _ControlClient:
    """A torch decode transport's ``control``: one Unix-socket exchange per message."""

    def __init__(self):
        self.addresses: dict[str, str] = {}

    def __call__(self, peer: str, message: bytes) -> bytes:
        with Client(self.addresses[peer], family="AF_UNIX") as conn:
            conn.send_bytes(message)
            if not conn.poll(COMMAND_TIMEOUT_S):
                raise TimeoutError(f"{peer} did not answer a control message")
            return conn.recv_bytes()


def _serve_control(transport, listener: Listener, die_on_send: threading.Event) -> None:
    """The prefill process's control loop: each message goes to ``handle_control``."""
    while True:
        try:
            conn = listener.accept()
        except OSError:
            return
        with conn:
            try:
                message = conn.recv_bytes()
            except (EOFError, OSError):
                continue
            if die_on_send.is_set() and b"torch_send" in message:
                os._exit(1)  # a prefill replica dying mid-transfer
            conn.send_bytes(transport.handle_control(message))


def _serve(conn, kind: str, name: str, role: str, seed: int | None, timeout_s: float) -> None:
    from transfer import create_transport

    pool = new_pool(seed)
    options: dict = {"timeout_s": timeout_s}
    control = die_on_send = listener = None
    if kind == "torch":
        options["role"] = role
        if role == "decode":
            control = options["control"] = _ControlClient()
    transport = create_transport(kind, name, **options)
    transport.register(pool)
    if kind == "torch" and role == "prefill":
        address = os.path.join(tempfile.mkdtemp(prefix="kv-control-"), "control.sock")
        listener = Listener(address, family="AF_UNIX")
        die_on_send = threading.Event()
        threading.Thread(target=_serve_control, args=(transport, listener, die_on_send), daemon=True).start()
    commands = {
        **_transport_commands(transport),
        "control_address": lambda: listener.address if listener is not None else None,
        "set_control": lambda peer, address: control.addresses.__setitem__(peer, address),
        "blocks": lambda ids: [pool[b].view(-1).view(torch.uint8).numpy().tobytes() for b in ids],
        "zero": lambda: pool.zero_().sum().item(),
        "die_on_send": lambda: die_on_send.set(),
    }
    try:
        _run_commands(conn, commands)
    finally:
        transport.close()
        if listener is not None:
            listener.close()
            shutil.rmtree(os.path.dirname(listener.address), ignore_errors=True)


def _transport_commands(transport) -> dict:
    """The commands that drive the transport itself."""

    def read(specs, wait_s):
        """Start every ``(peer, remote_ids, local_ids, notify)`` read, then wait for all."""
        start = time.monotonic()
        handles = [transport.read_blocks(*spec) for spec in specs]
        results = []
        for handle in handles:
            state = handle.wait(max(0.0, start + wait_s - time.monotonic()))
            results.append((state.value, handle.error, time.monotonic() - start))
        return results

    def notifications(prefix, count, wait_s):
        """Notifications starting with ``prefix``, polled until ``count`` came or ``wait_s`` passed."""
        deadline, seen = time.monotonic() + wait_s, []
        while True:
            seen += [n for n in transport.poll_notifications() if n.startswith(prefix)]
            if len(seen) >= count or time.monotonic() >= deadline:
                return seen
            time.sleep(0.005)

    def close_twice():
        transport.close()
        transport.close()
        try:
            transport.local_metadata()
        except Exception as exc:
            return type(exc).__name__
        return None

    return {"metadata": transport.local_metadata, "add_peer": transport.add_peer, "read": read,
            "notifications": notifications, "close_twice": close_twice}


def _run_commands(conn, commands: dict) -> None:
    """Answer ``(command, args)`` from ``conn`` until ``exit`` or the pipe closes."""
    try:
        while True:
            command, args = conn.recv()
            if command == "exit":
                return
            try:
                conn.send((True, commands[command](*args)))
            except Exception as exc:
                conn.send((False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"))
    except (EOFError, OSError):
        pass
