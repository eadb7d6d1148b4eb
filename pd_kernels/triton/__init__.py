"""Triton backend: the same signatures as ``pd_kernels.reference``.

Runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (set
before anything imports triton). One module per kernel:

- ``paged_attention``: the paged attention kernel and its tile choice;
- ``split_kv``: split-KV (flash-decoding) launch, merge kernel and heuristic;
- ``attention``: ``unified_attention``, which picks between the two;
- ``latent_attention``: multi-head latent attention (MLA) over latent pages, single pass or split-KV;
- ``store_kv``, ``norm``, ``rotary``, ``activation``: the KV store and fused row-wise kernels;
- ``fp8_kv``: FP8 KV pages, written and read as codes in registers;
- ``moe``: the fused MoE (slots sorted by expert, two grouped GEMMs);
- ``lora``: the multi-LoRA delta (shrink, then expand; rows of each adapter slot masked per program).
"""

from pd_kernels.triton.activation import silu_and_mul
from pd_kernels.triton.attention import unified_attention
from pd_kernels.triton.latent_attention import latent_attention, split_latent_attention
from pd_kernels.triton.lora import lora_delta
from pd_kernels.triton.moe import fused_moe
from pd_kernels.triton.norm import rms_norm
from pd_kernels.triton.rotary import rotary_embedding
from pd_kernels.triton.split_kv import choose_num_splits, split_kv_attention
from pd_kernels.triton.store_kv import store_kv

__all__ = ["unified_attention", "split_kv_attention", "choose_num_splits", "store_kv", "rms_norm", "rotary_embedding", "silu_and_mul",
           "fused_moe", "latent_attention", "split_latent_attention", "lora_delta"]
