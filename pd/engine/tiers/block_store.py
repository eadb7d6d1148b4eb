"""KV blocks kept outside the engine's memory, moved by NIXL: block files on a local disk, or objects in an S3 store.

One record per block, named by the namespace (the model and its KV layout)
and the block's chained hash, so a name says what it holds:

    disk:   <path>/<namespace>/slot-<k>/<hash hex>.kv     NIXL POSIX backend (DRAM <-> FILE)
    store:  s3://<bucket>/<namespace>/<hash hex>  NIXL OBJ backend (DRAM <-> OBJ, the S3 API)

    record = | block data (data_bytes) | trailer: magic, version, hash, token count, data bytes, layout, tokens |

A write sends the whole record from one staging buffer (the OBJ backend
writes whole objects only). A read sends the data straight into its host-tier
slot and the trailer into a small buffer, one transfer for a whole run of
blocks. ``check_trailer`` then rejects a record whose trailer does not name
the block the reader asked for (its hash and every token) in the reader's
layout (the namespace's digest of the layout fingerprint: the KV dtype and,
for FP8, the scales' digest among it): a short, corrupt or foreign record is
a miss, never wrong tokens, nor bytes that mean other values.

A disk record is written under a temporary name and renamed when complete,
so a crash mid-write leaves no record that looks whole. Object stores make a
PUT visible only once it is complete.
"""

from __future__ import annotations

import array
import fcntl
import hashlib
import itertools
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

logger = logging.getLogger(__name__)

RECORD_MAGIC = b"PDKV"
RECORD_VERSION = 2
# magic, version, token count, block hash (8 bytes), data bytes, layout (the namespace's 8 bytes); then the
# tokens as int32.
_HEADER = struct.Struct("<4sHH8sQ8s")
TEMP_SUFFIX = ".tmp"
# A transfer in progress is looked at again at once for SPIN_S (a sleep costs more than a local read), then every POLL_S.
SPIN_S = 0.001
POLL_S = 0.0002
RECORD_SUFFIX = ".kv"


def trailer_bytes(block_size: int) -> int:
    return _HEADER.size + 4 * block_size


def namespace_of(fingerprint: bytes) -> str:
    """A short name for the model and KV layout whose blocks a store holds."""
    return hashlib.blake2b(fingerprint, digest_size=8).hexdigest()


def _layout_bytes(namespace: str) -> bytes:
    """The 8 bytes a record's trailer names its namespace (its layout) by."""
    return hashlib.blake2b(namespace.encode(), digest_size=8).digest()


def pack_trailer(out: np.ndarray, block_hash: bytes, token_ids: Sequence[int], data_bytes: int,
                 namespace: str) -> None:
    """Write a record's trailer into ``out`` (uint8, ``trailer_bytes`` long)."""
    _HEADER.pack_into(out, 0, RECORD_MAGIC, RECORD_VERSION, len(token_ids), block_hash, data_bytes,
                      _layout_bytes(namespace))
    tokens = out[_HEADER.size:].view(np.int32)
    tokens[:] = 0
    tokens[:len(token_ids)] = token_ids


def check_trailer(trailer: bytes, block_hash: bytes, token_ids: Sequence[int], data_bytes: int,
                  namespace: str) -> str | None:
    """Why a record read back (its trailer's bytes) is not the block asked for; None when it is."""
    magic, version, num_tokens, stored_hash, stored_bytes, layout = _HEADER.unpack_from(trailer, 0)
    if magic != RECORD_MAGIC or version != RECORD_VERSION:
        return f"not a version-{RECORD_VERSION} record"
    if layout != _layout_bytes(namespace):
        return "a record of another KV layout (dtype or FP8 scales)"
    if stored_hash != block_hash or stored_bytes != data_bytes or num_tokens != len(token_ids):
        return "a record of another block"
    if trailer[_HEADER.size:_HEADER.size + 4 * num_tokens] != array.array("i", token_ids).tobytes():
        return "its tokens differ"
    return None


@dataclass(frozen=True)
class ObjectStoreConfig:
    """An S3 bucket for the NIXL OBJ backend; credentials come from the usual AWS variables."""

    bucket: str
    endpoint: str | None = None  # e.g. http://127.0.0.1:9000 for an S3-compatible server; None: AWS
    region: str = "us-east-1"

    def backend_params(self) -> dict[str, str]:
        params = {"bucket": self.bucket, "region": self.region, "use_virtual_addressing": "false",
                  "req_checksum": "supported"}
        for name, env in (("access_key", "AWS_ACCESS_KEY_ID"), ("secret_key", "AWS_SECRET_ACCESS_KEY")):
            if os.environ.get(env):
                params[name] = os.environ[env]
        if self.endpoint:
            params["endpoint_override"] = self.endpoint
            params["scheme"] = self.endpoint.split("://", 1)[0] if "://" in self.endpoint else "https"
        return params


def take_slot(root: Path) -> tuple[Path, int]:
    """The first directory ``root/slot-<k>`` no live process holds, locked; ``(directory, lock fd)``.

    Replicas on one machine sharing a disk path each get their own slot, and
    the lock dies with its process: a replica that replaces a crashed one
    takes over its slot, and finds its blocks (a warm restart).
    """
    root.mkdir(parents=True, exist_ok=True)
    for index in itertools.count():
        directory = root / f"slot-{index}"
        directory.mkdir(exist_ok=True)
        fd = os.open(directory / ".lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return directory, fd
    raise AssertionError("unreachable")


class StoreError(RuntimeError):
    """A store operation failed as a whole (the tier using it is disabled)."""


class NixlBlockStore:
    """Records of ``data_bytes`` + trailer, on a disk path or in a bucket; NIXL moves the bytes.

    Thread-safe: one lock around the agent, which is not.
    """

    def __init__(self, name: str, namespace: str, block_size: int, data_bytes: int, *,
                 path: str | None = None, bucket: ObjectStoreConfig | None = None):
        if (path is None) == (bucket is None):
            raise ValueError("a block store is either a disk path or a bucket")
        self.block_size, self.data_bytes = block_size, data_bytes
        self.trailer_bytes = trailer_bytes(block_size)
        self.record_bytes = data_bytes + self.trailer_bytes
        self.namespace = namespace
        self.bucket = bucket
        self._lock = threading.RLock()
        self._next_dev_id = 1
        from transfer.nixl_api import nixl_agent, nixl_agent_config  # here: an engine without these tiers needs no NIXL

        self._slot_lock: int | None = None
        if path is not None:
            self.dir, self._slot_lock = take_slot(Path(path) / namespace)
            self._dir_prefix = f"{self.dir}{os.sep}"
            self.backend, self.remote_type = "POSIX", "FILE"
            self.agent = nixl_agent(name, nixl_agent_config(enable_listen_thread=False, backends=["POSIX"]))
        else:
            self.dir = None
            self.backend, self.remote_type = "OBJ", "OBJ"
            self.agent = nixl_agent(name, nixl_agent_config(enable_listen_thread=False, backends=[]))
            self.agent.create_backend("OBJ", bucket.backend_params())
        self.name = name

    def close(self) -> None:
        """Give up the disk slot (the files stay, for whoever takes the slot next)."""
        if self._slot_lock is not None:
            os.close(self._slot_lock)  # releases the lock
            self._slot_lock = None

    def register(self, tensor) -> None:
        """Register host memory that records are written from or read into."""
        with self._lock:
            self.agent.register_memory(tensor)

    def key(self, block_hash: bytes) -> str:
        return f"{self.namespace}/{block_hash.hex()}"

    def path(self, block_hash: bytes) -> Path:
        return Path(self._file(block_hash))

    def _file(self, block_hash: bytes) -> str:
        return f"{self._dir_prefix}{block_hash.hex()}{RECORD_SUFFIX}"

    def write(self, records: Sequence[tuple[bytes, int]]) -> None:
        """Store each ``(block hash, address)`` record (``record_bytes`` of registered memory), in one transfer."""
        local = [(address, self.record_bytes, 0) for _, address in records]
        if self.dir is None:
            self._transfer("WRITE", local, [(self.key(block_hash), 0, self.record_bytes) for block_hash, _ in records])
            return
        finals = [self._file(block_hash) for block_hash, _ in records]
        fds = []
        try:
            for final in finals:
                fds.append(os.open(final + TEMP_SUFFIX, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644))
            self._transfer("WRITE", local, [(fd, 0, self.record_bytes) for fd in fds])
        except BaseException:
            for final in finals[:len(fds)]:
                Path(final + TEMP_SUFFIX).unlink(missing_ok=True)
            raise
        finally:
            for fd in fds:
                os.close(fd)
        for final in finals:
            os.replace(final + TEMP_SUFFIX, final)

    def read(self, items: Sequence[tuple[bytes, int, int]]) -> list[bool]:
        """Read each ``(block hash, data address, trailer address)``; which records could be read.

        One transfer for all of them; when it fails, each is tried alone, so
        one missing or short record costs only itself.
        """
        if not items:
            return []
        opened = self._open_for_read([block_hash for block_hash, _, _ in items])
        try:
            try:
                self._read_records([(item, where) for item, where in zip(items, opened) if where is not None])
                return [where is not None for where in opened]
            except StoreError:
                ok = []
                for item, where in zip(items, opened):
                    try:
                        if where is None:
                            raise StoreError("not found")
                        self._read_records([(item, where)])
                        ok.append(True)
                    except StoreError:
                        ok.append(False)
                return ok
        finally:
            for where in opened:
                if isinstance(where, int):
                    os.close(where)

    def exists(self, block_hashes: Sequence[bytes]) -> list[bool]:
        """Which records the store holds (one query for all of them)."""
        if self.dir is not None:
            return [self.path(block_hash).exists() for block_hash in block_hashes]
        with self._lock:
            results = self.agent.query_memory(
                [(0, 0, self._dev_id(), self.key(block_hash)) for block_hash in block_hashes], "OBJ", "OBJ")
        return [result is not None for result in results]

    def delete(self, block_hashes: Sequence[bytes]) -> None:
        """Remove records (missing ones are ignored)."""
        if self.dir is not None:
            for block_hash in block_hashes:
                self.path(block_hash).unlink(missing_ok=True)
            return
        # NIXL moves bytes but deletes nothing: objects are removed with the S3 API itself.
        import boto3

        client = boto3.client("s3", endpoint_url=self.bucket.endpoint, region_name=self.bucket.region)
        for start in range(0, len(block_hashes), 1000):
            keys = [{"Key": self.key(block_hash)} for block_hash in block_hashes[start:start + 1000]]
            client.delete_objects(Bucket=self.bucket.bucket, Delete={"Objects": keys, "Quiet": True})

    def scan(self) -> list[bytes]:
        """The hashes of the whole records on disk, oldest first; temporary and malformed files are removed."""
        found = []
        for entry in sorted(self.dir.iterdir(), key=lambda p: p.stat().st_mtime):
            name = entry.name
            if name == ".lock":
                continue
            whole = name.endswith(RECORD_SUFFIX) and entry.stat().st_size == self.record_bytes
            try:
                block_hash = bytes.fromhex(name.removesuffix(RECORD_SUFFIX)) if whole else None
            except ValueError:
                block_hash = None
            if block_hash is None or len(block_hash) * 2 + len(RECORD_SUFFIX) != len(name):
                entry.unlink(missing_ok=True)
                continue
            found.append(block_hash)
        return found

    def listing(self) -> list[tuple[float, bytes]]:
        """``(last write, hash)`` of every record in the bucket under this namespace, any writer's.

        S3 keeps a write's time to the second."""
        import boto3

        client = boto3.client("s3", endpoint_url=self.bucket.endpoint, region_name=self.bucket.region)
        found = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket.bucket,
                                                                      Prefix=f"{self.namespace}/"):
            for item in page.get("Contents", []):
                try:
                    found.append((item["LastModified"].timestamp(), bytes.fromhex(item["Key"].rsplit("/", 1)[1])))
                except ValueError:
                    continue  # not one of ours
        return found

    def _open_for_read(self, block_hashes: Sequence[bytes]) -> list[int | str | None]:
        """Where each record is read from: an open file, an object key, or None (no such file)."""
        if self.dir is None:
            return [self.key(block_hash) for block_hash in block_hashes]
        opened = []
        for block_hash in block_hashes:
            try:
                opened.append(os.open(self._file(block_hash), os.O_RDONLY))
            except FileNotFoundError:
                opened.append(None)
        return opened

    def _read_records(self, pairs) -> None:
        local, remote = [], []
        for (_, data_address, trailer_address), where in pairs:
            local += [(data_address, self.data_bytes, 0), (trailer_address, self.trailer_bytes, 0)]
            remote += [(where, 0, self.data_bytes), (where, self.data_bytes, self.trailer_bytes)]
        if local:
            self._transfer("READ", local, remote)

    def _transfer(self, op: str, local: list[tuple[int, int, int]], remote: list[tuple[int | str, int, int]]) -> None:
        """One NIXL transfer between host memory and records ``(file descriptor or key, offset, length)``."""
        with self._lock:
            agent = self.agent
            targets = {}
            for where, _, _ in remote:
                if where not in targets:
                    targets[where] = where if isinstance(where, int) else self._dev_id()
            length = self.record_bytes
            registered = agent.register_memory(
                [(0, length, dev, where if isinstance(where, str) else "") for where, dev in targets.items()],
                self.remote_type)
            handle = None
            try:
                remote_descs = agent.get_xfer_descs(
                    [(offset, size, targets[where]) for where, offset, size in remote], self.remote_type)
                handle = agent.initialize_xfer(op, agent.get_xfer_descs(local, "DRAM"), remote_descs, self.name)
                state = agent.transfer(handle)
                waited = time.perf_counter()
                while state == "PROC":
                    if time.perf_counter() - waited > SPIN_S:  # a remote store's round trips: let others run
                        time.sleep(POLL_S)
                    state = agent.check_xfer_state(handle)
            except Exception as exc:  # NIXL reports a failed transfer by raising its backend error
                raise StoreError(f"{op} failed: {exc}") from exc
            finally:
                if handle is not None:
                    agent.release_xfer_handle(handle)
                agent.deregister_memory(registered)
            if state != "DONE":
                raise StoreError(f"{op} ended {state}")

    def _dev_id(self) -> int:
        self._next_dev_id += 1
        return self._next_dev_id

