"""The ``cpu`` backend: paged decode attention in C++, everything else the torch reference.

The C++ kernel (``paged_decode.cpp``) reads each decoding sequence's keys and
values straight from the block-major pool through its block table; the
reference gathers every sequence's whole context into a padded copy first.
Prefill chunks stay on the reference (a gather, then SDPA's matrix products,
which a per-query loop cannot beat). fp32 only; other dtypes take the
reference.

The extension is compiled with ``torch.utils.cpp_extension`` on first use
(tens of seconds; ``build()`` runs it at engine start) and cached under
``TORCH_EXTENSIONS_DIR``.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import torch

from kernels import reference

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_decode.cpp")
_build_lock = threading.Lock()
_extension = None


def build():
    """The compiled extension; compiles it the first time (logged with its time)."""
    global _extension
    with _build_lock:
        if _extension is None:
            from torch.utils.cpp_extension import load

            started = time.monotonic()
            _extension = load(
                name="pd_paged_decode", sources=[str(_SOURCE)],
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-fopenmp-simd"],
                extra_ldflags=["-fopenmp"], verbose=False,
            )
            logger.info("cpu attention kernel ready in %.1f s", time.monotonic() - started)
        return _extension


def unified_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, softmax_scale, *,
                      sliding_window=None, softcap=None, out=None):
    """``kernels.unified_attention`` with decode rows read in place from the pool."""
    if q.device.type != "cpu":
        raise ValueError(f"the cpu backend runs on CPU tensors, got {q.device.type}; use backend='triton' or 'auto'")
    if q.dtype != torch.float32 or k_cache.dtype != torch.float32:
        return reference.unified_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, softmax_scale,
                                           sliding_window=sliding_window, softcap=softcap, out=out)
    if out is None:
        out = torch.empty_like(q)
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
            sliding_window or 0, softcap or 0.0, out,
        )
    if len(decode_ids) < len(lens):
        reference.prefill_attention(q, k_cache, v_cache, cu, lens, block_table, softmax_scale, sliding_window,
                                    softcap, out)
    return out


store_kv = reference.store_kv
rms_norm = reference.rms_norm
rotary_embedding = reference.rotary_embedding
