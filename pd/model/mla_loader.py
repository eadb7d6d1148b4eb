"""Load a multi-head latent attention layer (DeepSeek-V2/V3) into ``MlaWeights``.

HF's names under ``self_attn.``: ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``
(or ``q_proj`` without a low-rank query), ``kv_a_proj_with_mqa``,
``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``. At load:

- ``q_a_proj`` (or this rank's heads of ``q_proj``) and ``kv_a_proj_with_mqa``
  become one GEMM, as both read the layer's input;
- ``kv_b_proj`` is split into the absorbed decode's ``W_UK`` and ``W_UV``
  (``[heads, nope, rank]``, ``[heads, v, rank]``), which the decompressed
  prefill reads too;
- interleaved rotary dims (V2; V3's ``rope_interleave``) are permuted to
  rotate-half order in the query's and the latent's rotary rows:
  ``(x0, x1), (x2, x3), ...`` becomes ``x0, x2, ... | x1, x3, ...``. HF's
  interleaved rotation of a pair equals rotate-half's on the permuted dims,
  and a query-key product is the same under any one permutation of both.

Weights load unquantized: a checkpoint that quantizes these modules is refused
by ``_Weights.get``, naming the weight.
"""

from __future__ import annotations

import torch

from pd.model.config import ModelConfig
from pd.model.linear import make_linear
from pd.model.mla import MlaWeights
from pd.model.tp import TPShard


def rotate_half_order(rope_dim: int) -> torch.Tensor:
    """The permutation taking interleaved rotary pairs to rotate-half halves: evens, then odds."""
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


def _query_rows_in_order(weight: torch.Tensor, heads: int, config: ModelConfig) -> torch.Tensor:
    """``[heads * qk_head_dim, in]`` with each head's rotary rows (its last ``qk_rope_head_dim``) permuted."""
    m = config.mla
    per_head = weight.view(heads, m.qk_head_dim, -1)
    rope = per_head[:, m.qk_nope_head_dim:][:, rotate_half_order(m.qk_rope_head_dim)]
    return torch.cat([per_head[:, :m.qk_nope_head_dim], rope], dim=1).reshape(weight.shape)


def load_mla_attention(w, config: ModelConfig, shard: TPShard, attn: str, form: str, few_rows: bool) -> MlaWeights:
    """Rank ``shard``'s MLA layer (``attn``: its names' prefix); ``w`` is the loader's ``_Weights``."""
    m, h = config.mla, config.hidden_size
    first, last = shard.heads(config)
    local = last - first
    whole = shard.size == 1
    qk, kv_b_width, rank = m.qk_head_dim, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank
    latent_rows = m.kv_lora_rank + m.qk_rope_head_dim
    kv_a = w.get(attn + "kv_a_proj_with_mqa.weight", (latent_rows, h))
    kv_a_bias = w.optional(attn + "kv_a_proj_with_mqa.bias", (latent_rows,)) if m.attention_bias else None
    if m.rope_interleave:  # the latent's rotary rows: its last qk_rope_head_dim
        order = torch.cat([torch.arange(rank), rank + rotate_half_order(m.qk_rope_head_dim)])
        kv_a = kv_a[order]
        kv_a_bias = None if kv_a_bias is None else kv_a_bias[order]
    head_rows = None if whole else (first * qk, last * qk)
    if m.q_lora_rank is not None:
        q_first = w.get(attn + "q_a_proj.weight", (m.q_lora_rank, h))
        q_bias = w.optional(attn + "q_a_proj.bias", (m.q_lora_rank,)) if m.attention_bias else None
        q_b = w.get(attn + "q_b_proj.weight", (config.num_heads * qk, m.q_lora_rank), rows=head_rows)
        q_b = _query_rows_in_order(q_b, local, config) if m.rope_interleave else q_b
        q_b_proj = make_linear(q_b, None, form, few_rows)
    else:
        q_first = w.get(attn + "q_proj.weight", (config.num_heads * qk, h), rows=head_rows)
        q_first = _query_rows_in_order(q_first, local, config) if m.rope_interleave else q_first
        q_bias, q_b_proj = None, None
    bias = None
    if kv_a_bias is not None or q_bias is not None:
        bias = torch.cat([q_first.new_zeros(q_first.shape[0]) if q_bias is None else q_bias,
                          kv_a.new_zeros(latent_rows) if kv_a_bias is None else kv_a_bias])
    kv_b = w.get(attn + "kv_b_proj.weight", (config.num_heads * kv_b_width, rank),
                 rows=None if whole else (first * kv_b_width, last * kv_b_width)).view(local, kv_b_width, rank)
    o_weight = w.get(attn + "o_proj.weight", (h, config.num_heads * m.v_head_dim),
                     cols=None if whole else (first * m.v_head_dim, last * m.v_head_dim))
    o_bias = w.optional(attn + "o_proj.bias", (h,)) if m.attention_bias else None
    return MlaWeights(
        qkv_a_proj=make_linear(torch.cat([q_first, kv_a]), bias, form, few_rows),
        q_a_norm=w.get(attn + "q_a_layernorm.weight", (m.q_lora_rank,)) if m.q_lora_rank is not None else None,
        q_b_proj=q_b_proj,
        kv_a_norm=w.get(attn + "kv_a_layernorm.weight", (rank,)),
        w_uk=kv_b[:, :m.qk_nope_head_dim].contiguous(),
        w_uv=kv_b[:, m.qk_nope_head_dim:].contiguous(),
        # Row-parallel: its bias in the GEMM when one rank runs it, else added after the all-reduce.
        o_proj=make_linear(o_weight, o_bias if whole else None, form, few_rows),
        o_bias=None if whole else o_bias,
    )
