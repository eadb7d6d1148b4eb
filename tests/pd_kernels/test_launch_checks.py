"""Host wrappers reject bad launches with a ValueError naming the argument."""

from __future__ import annotations

import pytest
import torch

import pd_kernels
import pd_kernels.triton
from pd_kernels.triton.launch import check_launchable
from tests.pd_kernels.paged_batch import make_batch


def _attention_args():
    paged = make_batch([(1, 20), (3, 9)], 4, 2, 64, 16, torch.float32)
    return dict(
        q=paged.q, k_cache=paged.k_cache, v_cache=paged.v_cache, cu_seqlens_q=paged.cu_seqlens_q,
        seq_lens=paged.seq_lens, block_table=paged.block_table, softmax_scale=0.125,
    )


def _head_dim_50(args):
    args["q"] = torch.randn(4, 4, 50)
    args["k_cache"] = args["v_cache"] = torch.randn(3, 16, 2, 50)


ATTENTION_MISTAKES = {
    "cu_seqlens_q": lambda args: args.update(cu_seqlens_q=args["cu_seqlens_q"].long()),
    "q": _head_dim_50,
    "k_cache": lambda args: args.update(k_cache=args["k_cache"].half()),
    "v_cache": lambda args: args.update(v_cache=args["v_cache"][:, :8]),
    "block_table": lambda args: args.update(block_table=args["block_table"][:1]),
    "seq_lens": lambda args: args.update(seq_lens=args["seq_lens"].float()),
    "sliding_window": lambda args: args.update(sliding_window=0),
    "softcap": lambda args: args.update(softcap=-1.0),
    "out": lambda args: args.update(out=torch.empty_like(args["q"]).half()),
}


@pytest.mark.parametrize("name", ATTENTION_MISTAKES)
@pytest.mark.parametrize("entry", ["public", "triton", "split_kv"])
def test_attention_rejects(entry, name):
    args = _attention_args()
    ATTENTION_MISTAKES[name](args)
    with pytest.raises(ValueError, match=f"^{name}:"):
        if entry == "public":
            pd_kernels.unified_attention(**args, backend="triton")
        elif entry == "triton":
            pd_kernels.triton.unified_attention(**args)
        else:
            pd_kernels.triton.split_kv_attention(**args, num_splits=2)


def test_attention_rejects_layouts_the_kernels_cannot_read():
    args = _attention_args()
    with pytest.raises(ValueError, match="^q: num_heads 3 is not a multiple"):
        pd_kernels.triton.unified_attention(**{**args, "q": torch.randn(4, 3, 64)})
    with pytest.raises(ValueError, match="^k_cache: the head_dim axis must be contiguous"):
        k_cache = args["k_cache"].transpose(1, 3).contiguous().transpose(1, 3)
        pd_kernels.triton.unified_attention(**{**args, "k_cache": k_cache})
    with pytest.raises(ValueError, match="^q: the last axis must be contiguous"):
        q = args["q"].transpose(1, 2).contiguous().transpose(1, 2)
        pd_kernels.triton.unified_attention(**{**args, "q": q})
    with pytest.raises(ValueError, match="^num_splits:"):
        pd_kernels.triton.split_kv_attention(**args, num_splits=0)


def test_cpu_launch_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        check_launchable(torch.device("cpu"))


def test_store_kv_rejects():
    key = torch.randn(3, 2, 64)
    cache = torch.zeros(4, 16, 2, 64)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="^slot_mapping:"):
        pd_kernels.store_kv(key, key, cache, cache, slots[:2], backend="triton")
    with pytest.raises(ValueError, match="^value:"):
        pd_kernels.store_kv(key, key.half(), cache, cache, slots, backend="triton")
    with pytest.raises(ValueError, match="^key:"):
        pd_kernels.store_kv(key[:, :1], key[:, :1], cache, cache, slots, backend="triton")


def test_rms_norm_rejects():
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="^weight:"):
        pd_kernels.rms_norm(x, torch.ones(32), 1e-6, backend="triton")
    with pytest.raises(ValueError, match="^residual:"):
        pd_kernels.rms_norm(x, torch.ones(64), 1e-6, x.half(), backend="triton")
    with pytest.raises(ValueError, match="^x:"):
        pd_kernels.rms_norm(x.int(), torch.ones(64), 1e-6, backend="triton")


def test_rotary_rejects():
    q, k = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    cache, positions = torch.randn(10, 64), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="^q: head_dim 63 must be even"):
        pd_kernels.rotary_embedding(q[..., :63], k[..., :63], positions, cache[:, :63], backend="triton")
    with pytest.raises(ValueError, match="^cos_sin_cache:"):
        pd_kernels.rotary_embedding(q, k, positions, cache.half(), backend="triton")
    with pytest.raises(ValueError, match="^positions:"):
        pd_kernels.rotary_embedding(q, k, positions[:2], cache, backend="triton")
    with pytest.raises(ValueError, match="^k:"):
        pd_kernels.rotary_embedding(q, k[:2], positions, cache, backend="triton")
