"""The ``cpu`` backend: paged decode attention and the small-op chains in C++.

- ``paged_decode.cpp`` reads each decoding sequence's keys and values straight
  from the block-major pool through its block table; the reference gathers
  every sequence's whole context into a padded copy first.
- ``paged_prefill.cpp``: prefill chunks whose context is at most
  ``MAX_PAGED_PREFILL_KEYS`` keys, read from the pool in blocks of 128 keys
  with flash attention's online softmax, a tile of queries times the heads
  sharing a KV head per task. Longer contexts stay on the reference (a gather
  of the chunk's context, then SDPA, whose matrix products win there).
- ``latent_decode.cpp``: multi-head latent attention (DeepSeek's MLA, weights absorbed) for decode
  rows: each latent row read once for all the heads that share it, in tiles of 32 keys with the
  online softmax, a long context split over the threads and merged by log-sum-exp. Rows of
  sequences with more than one query (prefill chunks) take the reference: the engine runs MLA's
  prefill decompressed, so ``latent_attention`` sees decodes. So do latent or value widths that are
  not multiples of ``LATENT_LANES``. With 16 or more heads per row it is bound by the multiply-adds,
  not by the bytes it reads (``bench.latent_decode``).
- ``dense_rows.cpp``: a dense layer for a batch of a few rows (a decode
  step's), reading the weight once from panels of its own layout
  (``pack_rows_weight``); oneDNN's packed GEMM, tuned for many rows, took
  1.4-2.2x as long at one to eight rows.
- ``moe.cpp``: the fused MoE in one call for up to ``moe.MAX_SLOTS_PER_EXPERT`` slots per expert
  (``pd_kernels.cpu.moe`` chooses): each touched expert's weights read once per group of slots, SiLU-and-mul
  and the routed weight fused, each token's sum owned by one thread per column range.
- ``lora.cpp``: the multi-LoRA delta (``pd_kernels.cpu.lora``): rows grouped by adapter slot, each
  slot's A and B read once per group of its rows, rows without an adapter skipped.
- ``block_copy.cpp``: whole KV blocks between pools, one memcpy each (the
  host tier's promotions).
- ``small_ops.cpp``: residual add with RMSNorm, rotary, SiLU-and-mul and the KV
  store, each one pass over its rows instead of a chain of aten ops. On this
  project's 2-core VMs, ``torch.compile`` of the same chains lost to eager
  torch: Dynamo's guards and call cost about 27 us per compiled region, more
  than the chains themselves take at decode batch sizes.

fp32 activations only; other dtypes take the reference, but in attention, whose half-precision
queries are made fp32 for the same kernels (the reference computes in fp32 too). The attention kernels and the KV store also read and write FP8 pages
(``kv_fp8.h``, ``pd_kernels.fp8``), and the attention kernels bf16 pages.

The extension is compiled with ``torch.utils.cpp_extension`` for the host's
vector ISA level (``isa()``: AVX-512, AVX2 or none, with flags of its own,
never ``-march=native``) and cached under ``TORCH_EXTENSIONS_DIR``, in a
folder named for this checkout and that level: two checkouts sharing one
folder would each rewrite the other's build file (it names its sources by
path) and recompile on every start. ``make venv`` builds it (``python -m
pd_kernels.cpu``), so an engine start loads it; one that finds it missing
compiles it there (tens of seconds), never on a request's path. It is built
with the ninja the project installs (``project_ninja``), whatever ``PATH``
finds first.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

from pd_kernels import reference
from pd_kernels.checks import check_linear_args
from pd_kernels.cpu.lora import lora_delta  # noqa: F401 - the backend's multi-LoRA delta
from pd_kernels.cpu.moe import fused_moe  # noqa: F401 - the backend's fused MoE
from pd_kernels.fp8 import FP8_DTYPES, is_fp8

logger = logging.getLogger(__name__)

_SOURCES = [str(Path(__file__).with_name(name)) for name in ("bindings.cpp", "paged_decode.cpp", "paged_prefill.cpp",
                                                                 "small_ops.cpp", "block_copy.cpp", "dense_rows.cpp",
                                                                 "moe.cpp", "int8.cpp", "int8_gemm.cpp",
                                                                 "latent_decode.cpp", "lora.cpp")]
_build_lock = threading.Lock()
# Prefill chunks whose context (keys) is at most this long run in paged_prefill.cpp; longer ones on the
# reference's SDPA, whose matrix products win there. Ours against SDPA, one sequence, 2 threads (AMD EPYC),
# head dims 32, 64 and 128: 1.1-1.9x at up to 488 keys, 1.0-1.3x at 811-1024, 0.9-1.1x at 2048.
MAX_PAGED_PREFILL_KEYS = 1024
# The pages the C++ attention kernels read (with fp32 queries).
PAGE_DTYPES = (torch.float32, torch.bfloat16, *FP8_DTYPES)
# latent_decode.cpp's latent and value widths are multiples of this (every ISA's vector width);
# DeepSeek's are 576 and 512.
LATENT_LANES = 16
_extension = None


# The flags each ISA level is built with, never ``-march=native``: a build made on one host then runs on
# any host of its level (a venv or image copied to an older host of the same cluster would otherwise die
# of an illegal instruction). The level is the one torch itself dispatches to here (``isa()``), and each
# level builds into a folder and a module of its own, so hosts of different levels sharing a cache never
# rewrite each other's build. The AVX-512 set is torch's own for its AVX512 kernels.
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2"],
    "DEFAULT": [],
}


def isa() -> str:
    """The vector ISA level the extension is built for here: torch's CPU capability.

    ``ATEN_CPU_CAPABILITY=avx2`` (or ``default``) lowers it, which is how an AVX-512 host runs and tests
    the AVX2 build. A level we have no flags for (another architecture's) builds without vector flags.
    """
    capability = torch.backends.cpu.get_cpu_capability()
    return capability if capability in ISA_FLAGS else "DEFAULT"


def capability_flags(level: str) -> list[str]:
    """The compiler flags for ``level``, ATen's ``Vectorized`` of that width included.

    Without ``CPU_CAPABILITY`` the header's generic fallback (scalar loops) is compiled in:
    correct, but no faster than plain C++.
    """
    flags = list(ISA_FLAGS[level])
    if level != "DEFAULT":
        flags += [f"-DCPU_CAPABILITY={level}", f"-DCPU_CAPABILITY_{level}"]
    return flags


def build():
    """The compiled extension for this host's ``isa()``; compiles it the first time (logged with its time).

    ``make venv`` builds it ahead, so an engine start only loads it.
    """
    global _extension
    if _extension is not None:
        return _extension
    with _build_lock:
        if _extension is None:
            from torch.utils.cpp_extension import load

            level = isa()
            started = time.monotonic()
            directory = _build_directory(level)
            with project_ninja(), one_builder(directory):
                _extension = load(
                    name=f"pd_cpu_kernels_{level.lower()}", sources=_SOURCES,
                    build_directory=str(directory),
                    extra_cflags=["-O3", "-fopenmp", "-fopenmp-simd", *capability_flags(level),
                                  f"-DPD_HEADERS={_headers_digest()}"],
                    extra_ldflags=["-fopenmp"], verbose=False,
                )
            logger.info("cpu kernels (%s) ready in %.1f s", level, time.monotonic() - started)
        return _extension


@contextlib.contextmanager
def one_builder(directory: Path):
    """Held around torch's build (or load) in ``directory``: one process at a time, by a lock the kernel
    drops when its holder dies.

    Torch's own lock is a file (``lock``) that a builder removes when done. A builder killed mid-build
    leaves it, and every later start then waits on it for ever. Whoever holds this lock knows no builder
    of ours is running, so a ``lock`` file it finds is such a leftover, and it removes it.
    """
    with open(directory / "pd-builder.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            leftover = directory / "lock"
            if leftover.exists():
                logger.warning("removing %s, left by a kernel build that was stopped before it finished", leftover)
                leftover.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def project_ninja():
    """``PATH`` led by the ``ninja`` package's (a dependency of ours) while torch runs ``ninja`` by name.

    Ninja versions keep build logs of different versions, and one that finds another's starts over,
    recompiling everything: without this, a venv used activated (its own ninja first on ``PATH``) and
    unactivated (a system ninja first) rebuilt the extension, minutes on 2 cores, at each switch.
    """
    try:
        import ninja
    except ImportError:  # a system ninja only: the one torch finds
        yield
        return
    saved = os.environ.get("PATH", "")
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + saved
    try:
        yield
    finally:
        os.environ["PATH"] = saved


def _headers_digest() -> str:
    """A digest of the headers the sources include: torch rebuilds on changed sources or flags, not headers."""
    digest = hashlib.sha256()
    for header in sorted(Path(__file__).parent.glob("*.h")):
        digest.update(header.read_bytes())
    return digest.hexdigest()[:16]


def _build_directory(level: str, create: bool = True) -> Path:
    from torch.utils.cpp_extension import get_default_build_root

    checkout = hashlib.sha256(str(Path(__file__).resolve().parent).encode()).hexdigest()[:12]
    directory = Path(get_default_build_root()) / f"pd_cpu_kernels-{checkout}-{level.lower()}"
    if create:
        directory.mkdir(parents=True, exist_ok=True)
    return directory


def build_state(level: str | None = None) -> tuple[Path, str]:
    """Where ``build()`` keeps the library for ``level`` (default: this host's ``isa()``), and whether it is
    ``"built"``, ``"stale"`` (older than a source or header: loading it recompiles) or ``"missing"``.

    Creates nothing and compiles nothing (``pd doctor`` asks before it builds).
    """
    level = level or isa()
    library = _build_directory(level, create=False) / f"pd_cpu_kernels_{level.lower()}.so"
    if not library.is_file():
        return library, "missing"
    sources = Path(__file__).resolve().parent
    newest = max(path.stat().st_mtime for pattern in ("*.cpp", "*.h") for path in sources.glob(pattern))
    return library, "built" if library.stat().st_mtime >= newest else "stale"


def unified_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, softmax_scale, *,
                      sliding_window=None, softcap=None, out=None, k_scale=1.0, v_scale=1.0):
    """``pd_kernels.unified_attention`` with decode rows read in place from the pool."""
    if q.device.type != "cpu":
        raise ValueError(f"the cpu backend runs on CPU tensors, got {q.device.type}; use backend='triton' or 'auto'")
    if k_cache.dtype not in PAGE_DTYPES:  # fp16 pages
        return reference.unified_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, softmax_scale,
                                           sliding_window=sliding_window, softcap=softcap, out=out,
                                           k_scale=k_scale, v_scale=v_scale)
    args = (k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, softmax_scale, sliding_window, softcap,
            k_scale, v_scale)
    if q.dtype == torch.float32:
        return _attention_fp32(q, *args, torch.empty_like(q) if out is None else out)
    # bf16 or fp16 activations: the kernels compute in fp32 as the reference does (it converts q and
    # the pages to fp32 too), so q is converted once and the output once.
    result = _attention_fp32(q.float(), *args, torch.empty(q.shape, dtype=torch.float32))
    if out is None:
        return result.to(q.dtype)
    return out.copy_(result)


def _attention_fp32(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, softmax_scale, sliding_window,
                    softcap, k_scale, v_scale, out):
    """``unified_attention`` for fp32 ``q`` and ``out``: decodes and short prefills in C++, long ones on SDPA."""
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    decode_ids = [i for i in range(len(lens)) if cu[i + 1] - cu[i] == 1]
    if decode_ids:
        if len(decode_ids) == len(lens):
            rows, table, decode_lens = cu_seqlens_q[:-1].long(), block_table, seq_lens
        else:
            ids = torch.tensor(decode_ids)
            rows, table, decode_lens = cu_seqlens_q[ids].long(), block_table[ids], seq_lens[ids]
        build().paged_decode_attention(
            q, k_cache, v_cache, table.contiguous(), decode_lens.contiguous(), rows.contiguous(), softmax_scale,
            sliding_window or 0, softcap or 0.0, k_scale, v_scale, out,
        )
    if len(decode_ids) < len(lens):
        ours, theirs = [], []
        for i in range(len(lens)):
            if cu[i + 1] - cu[i] > 1:
                (ours if lens[i] <= MAX_PAGED_PREFILL_KEYS else theirs).append(i)
        if ours:
            build().paged_prefill_attention(q, k_cache, v_cache, block_table.contiguous(), cu, lens, ours,
                                            softmax_scale, sliding_window or 0, softcap or 0.0, k_scale, v_scale, out)
        if theirs:
            reference.prefill_attention(q, k_cache, v_cache, cu, lens, block_table, softmax_scale, sliding_window,
                                        softcap, out, only=theirs, k_scale=k_scale, v_scale=v_scale)
    return out


def latent_attention(q, latent_cache, cu_seqlens_q, seq_lens, block_table, softmax_scale, *, v_dim, out=None,
                     scale=1.0):
    """``pd_kernels.latent_attention`` with decode rows in ``latent_decode.cpp``, prefill chunks on the reference."""
    if q.device.type != "cpu":
        raise ValueError(f"the cpu backend runs on CPU tensors, got {q.device.type}; use backend='triton' or 'auto'")
    if latent_cache.dtype not in PAGE_DTYPES or q.shape[2] % LATENT_LANES or v_dim % LATENT_LANES:
        return reference.latent_attention(q, latent_cache, cu_seqlens_q, seq_lens, block_table, softmax_scale,
                                          v_dim=v_dim, out=out, scale=scale)
    args = (latent_cache, cu_seqlens_q, seq_lens, block_table, softmax_scale, v_dim, scale)
    shape = (q.shape[0], q.shape[1], v_dim)
    if q.dtype == torch.float32:
        if out is not None and out.stride(-1) == 1:
            return _latent_fp32(q, *args, out)
        result = _latent_fp32(q, *args, torch.empty(shape, dtype=torch.float32))
        return result if out is None else out.copy_(result)
    # bf16 or fp16 activations: computed in fp32 as the reference does, q converted once and the output once.
    result = _latent_fp32(q.float(), *args, torch.empty(shape, dtype=torch.float32))
    return result.to(q.dtype) if out is None else out.copy_(result)


def _latent_fp32(q, latent_cache, cu_seqlens_q, seq_lens, block_table, softmax_scale, v_dim, scale, out):
    """``latent_attention`` for fp32 ``q`` and ``out`` (last axis contiguous): decodes in C++, the rest on
    the reference."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    cu = cu_seqlens_q.tolist()
    num_seqs = len(cu) - 1
    decode_ids = [i for i in range(num_seqs) if cu[i + 1] - cu[i] == 1]
    if decode_ids:
        if len(decode_ids) == num_seqs:
            rows, table, decode_lens = cu_seqlens_q[:-1].long(), block_table, seq_lens
        else:
            ids = torch.tensor(decode_ids)
            rows, table, decode_lens = cu_seqlens_q[ids].long(), block_table[ids], seq_lens[ids]
        if table.stride(-1) != 1:
            table = table.contiguous()
        build().latent_decode_attention(q, latent_cache, table, decode_lens.contiguous(), rows.contiguous(),
                                        softmax_scale, scale, out)
    chunk_ids = [i for i in range(num_seqs) if cu[i + 1] - cu[i] > 1]
    if chunk_ids:
        # The chunks as a batch of their own: their rows of q, their metadata.
        starts = [0]
        for i in chunk_ids:
            starts.append(starts[-1] + cu[i + 1] - cu[i])
        token_ids = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in chunk_ids])
        ids = torch.tensor(chunk_ids)
        out[token_ids] = reference.latent_attention(q[token_ids], latent_cache, torch.tensor(starts, dtype=torch.int32),
                                                    seq_lens[ids], block_table[ids], softmax_scale, v_dim=v_dim,
                                                    scale=scale)
    return out


def _fp32(*tensors) -> bool:
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_cpu:
            return False
    return True


def store_kv(key, value, k_cache, v_cache, slot_mapping, *, k_scale=1.0, v_scale=1.0) -> None:
    # Rows of the pool's dtype are copied; fp32 or bf16 rows into FP8 pages are quantized.
    same = k_cache.dtype == key.dtype and key.dtype in (torch.float32, torch.bfloat16, torch.float16)
    quantized = is_fp8(k_cache.dtype) and key.dtype in (torch.float32, torch.bfloat16)
    ours = key.is_cpu and k_cache.is_cpu and (same or quantized)
    if not (ours and all(t.stride(-1) == 1 for t in (key, value, k_cache, v_cache))):
        return reference.store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    build().store_kv(key, value, k_cache, v_cache, slot_mapping.long(), k_scale, v_scale)


def rms_norm(x, weight, eps: float, residual=None):
    if not _fp32(x, weight) or x.stride(-1) != 1 or not weight.is_contiguous():
        return reference.rms_norm(x, weight, eps, residual)
    if residual is None:
        return build().rms_norm(x, weight, eps)
    if not _fp32(residual):
        return reference.rms_norm(x, weight, eps, residual)
    normed, summed = build().add_rms_norm(x.contiguous(), residual.contiguous(), weight, eps)
    return normed, summed


def rotary_embedding(q, k, positions, cos_sin_cache):
    if not _fp32(q, k, cos_sin_cache) or q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        return reference.rotary_embedding(q, k, positions, cos_sin_cache)
    q_out, k_out = build().rotary(q, k, positions.long(), cos_sin_cache)
    return q_out, k_out


def copy_blocks(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int]) -> None:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` for every i: whole blocks of contiguous CPU pools."""
    build().copy_blocks(src, src_ids, dst, dst_ids)


def silu_and_mul(gate_up):
    if not _fp32(gate_up):
        return reference.silu_and_mul(gate_up)
    return build().silu_and_mul(gate_up.contiguous())


def pack_rows_weight(weight):
    """``weight [out, in]`` (fp32, CPU) as the panels ``linear_rows`` reads: ``[ceil(out / L), in, L]``."""
    return build().pack_rows_weight(weight.contiguous())


def linear_rows(x, weight, bias=None):
    """``x @ weight^T + bias`` for a few rows ``x [rows, in]``, ``weight [out, in]`` (``reference.linear_rows``).

    Packs ``weight`` on every call; a layer packs it once (``pd.model.linear``).
    """
    check_linear_args(x, weight, bias)
    if not _fp32(x, weight) or (bias is not None and not _fp32(bias)):
        return reference.linear_rows(x, weight, bias)
    return build().linear_rows(x, pack_rows_weight(weight), None if bias is None else bias.contiguous(),
                               weight.shape[0])
