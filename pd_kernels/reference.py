"""Torch reference implementations of every kernel in this package.

They are the CPU default and the ground truth the Triton kernels are tested
against. Each has the same signature as its Triton twin. They favour clarity,
but the attention path batches all decode sequences into one gather so that the
CPU engine is not dominated by per-sequence Python overhead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pd_kernels import fp8
from pd_kernels.reference_lora import lora_delta  # noqa: F401 - the multi-LoRA delta's reference


def _key_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """``[..., q, k]`` True where a query may see a key (causal, optional window)."""
    q = query_positions.unsqueeze(-1)
    k = key_positions.unsqueeze(-2)
    visible = k <= q
    if sliding_window is not None:
        visible &= k > q - sliding_window
    return visible


def _softcapped_attention(q, k, v, visible, softmax_scale, softcap):
    """Explicit attention for the cases SDPA cannot express.

    q: [..., kv_heads, group, q_len, head_dim]; k, v: [..., kv_heads, 1, k_len, head_dim];
    visible: broadcastable to [..., kv_heads, group, q_len, k_len], or None when every key is visible.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)) * softmax_scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _gather_pages(cache: torch.Tensor, block_ids: torch.Tensor, scale: float) -> torch.Tensor:
    """Pages ``block_ids [..., n]`` of ``cache`` as fp32 ``[..., n * block_size, kv_heads, head_dim]``
    (an FP8 pool's dequantized with its ``scale``)."""
    pages = cache[block_ids].flatten(-4, -3)  # [..., n * block_size, kv_heads, head_dim]
    return fp8.dequantize(pages, scale) if fp8.is_fp8(cache.dtype) else pages.to(torch.float32)


def unified_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, softmax_scale: float,
    *, sliding_window: int | None = None, softcap: float | None = None, out: torch.Tensor | None = None,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> torch.Tensor:
    """Reference paged attention over a mixed batch; see ``pd_kernels.unified_attention``."""
    if out is None:
        out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    q_lens = [cu[i + 1] - cu[i] for i in range(len(lens))]
    decode_ids = [i for i, q_len in enumerate(q_lens) if q_len == 1]
    if decode_ids:
        decode_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, softmax_scale, decode_ids,
                         lens, sliding_window, softcap, out, k_scale, v_scale)
    prefill_attention(q, k_cache, v_cache, cu, lens, block_table, softmax_scale, sliding_window, softcap, out,
                      k_scale=k_scale, v_scale=v_scale)
    return out


def latent_attention(q: torch.Tensor, latent_cache: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                     block_table: torch.Tensor, softmax_scale: float, *, v_dim: int, out: torch.Tensor | None = None,
                     scale: float = 1.0) -> torch.Tensor:
    """Reference MLA attention over latent pages; see ``pd_kernels.latent_attention``.

    The latent row is both the key (all of it) and the value (its first ``v_dim`` values), so this is the
    paged attention with one KV head read as both, its output cut to ``v_dim``.
    """
    full = unified_attention(q, latent_cache, latent_cache, cu_seqlens_q, seq_lens, block_table, softmax_scale,
                             k_scale=scale, v_scale=scale)
    if out is None:
        return full[..., :v_dim].contiguous()
    out.copy_(full[..., :v_dim])
    return out


def store_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, *, scale: float = 1.0) -> None:
    """Write each token's latent row ``[num_tokens, latent_dim]`` into its slot of ``cache`` ``[num_blocks,
    block_size, 1, latent_dim]``; negative slots are skipped; an FP8 pool stores ``quantize(x, scale)``."""
    block_size = cache.shape[1]
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, latent = slots[keep], latent[keep]
    if fp8.is_fp8(cache.dtype):
        latent = fp8.quantize(latent, scale, cache.dtype)
    cache[slots // block_size, slots % block_size, 0] = latent.to(cache.dtype)


def decode_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, softmax_scale, decode_ids, lens,
                     sliding_window, softcap, out, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """The single-query sequences ``decode_ids`` of a batch, into ``out``: one padded gather, one SDPA."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    compute_dtype = torch.float32
    # All single-query sequences in one padded gather:
    # query [n, heads, 1, head_dim]; k, v [n, kv_heads, max_len, head_dim].
    num_decodes = len(decode_ids)
    decode_lens = [lens[i] for i in decode_ids]
    max_len = max(decode_lens)
    num_pages = -(-max_len // block_size)
    if num_decodes == len(lens):  # a decode-only batch needs no row selection
        rows = slice(None)
        query = q.to(compute_dtype).unsqueeze(2)
    else:
        rows = torch.tensor(decode_ids, device=q.device)
        token_ids = cu_seqlens_q[rows].long()
        query = q[token_ids].to(compute_dtype).unsqueeze(2)
    pages = block_table[rows, :num_pages].long()
    k = _gather_pages(k_cache, pages, k_scale).transpose(1, 2)
    v = _gather_pages(v_cache, pages, v_scale).transpose(1, 2)
    if sliding_window is None and min(decode_lens) == max_len:
        # Equal lengths: every gathered key up to max_len is visible.
        k, v, visible = k[:, :, :max_len], v[:, :, :max_len], None
    else:
        query_positions = (seq_lens[rows].long() - 1).view(-1, 1)  # [n, 1]
        key_positions = torch.arange(num_pages * block_size, device=q.device)
        visible = _key_mask(query_positions, key_positions, sliding_window)  # [n, 1, pages * block_size]
    if softcap is None:
        result = F.scaled_dot_product_attention(
            query, k, v, attn_mask=None if visible is None else visible.unsqueeze(1),
            scale=softmax_scale, enable_gqa=group > 1,
        )
    else:
        result = _softcapped_attention(
            query.view(num_decodes, num_kv_heads, group, 1, head_dim), k.unsqueeze(2), v.unsqueeze(2),
            None if visible is None else visible.view(num_decodes, 1, 1, 1, -1), softmax_scale, softcap,
        )
    result = result.reshape(num_decodes, num_heads, head_dim).to(out.dtype)
    if num_decodes == len(lens):
        out.copy_(result)
    else:
        out[token_ids] = result


def prefill_attention(q, k_cache, v_cache, cu, lens, block_table, softmax_scale, sliding_window, softcap,
                      out, only: list[int] | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """The sequences of a batch with more than one query (``cu``, ``lens`` as lists), into ``out``
    (``only``: just those of these indices)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    compute_dtype = torch.float32
    for i in range(len(lens)) if only is None else only:
        q_len = cu[i + 1] - cu[i]
        if q_len <= 1:
            continue
        kv_len = lens[i]
        num_pages = -(-kv_len // block_size)
        pages = block_table[i, :num_pages].long()
        k = _gather_pages(k_cache, pages, k_scale)[:kv_len]  # [kv_len, kv_heads, head_dim]
        v = _gather_pages(v_cache, pages, v_scale)[:kv_len]
        query = q[cu[i] : cu[i + 1]].to(compute_dtype)  # [q_len, heads, head_dim]
        query_positions = torch.arange(kv_len - q_len, kv_len, device=q.device)
        key_positions = torch.arange(kv_len, device=q.device)
        # A whole prompt without a window is plain causal: no mask to build or read.
        plain_causal = q_len == kv_len and sliding_window is None
        visible = None if plain_causal else _key_mask(query_positions, key_positions, sliding_window)  # [q_len, kv_len]
        if softcap is None:
            # 4-D [1, heads, len, head_dim]: SDPA's fused CPU kernel takes only 4-D input (3-D takes
            # the unfused math path, 1.5-2x slower at 300-512 tokens here).
            result = F.scaled_dot_product_attention(
                query.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                attn_mask=visible, is_causal=plain_causal, scale=softmax_scale, enable_gqa=group > 1,
            )[0].transpose(0, 1)
        else:
            if visible is None:
                visible = _key_mask(query_positions, key_positions, sliding_window)
            query = query.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
            result = _softcapped_attention(
                query, k.permute(1, 0, 2).unsqueeze(1), v.permute(1, 0, 2).unsqueeze(1),
                visible, softmax_scale, softcap,
            ).permute(2, 0, 1, 3)
        out[cu[i] : cu[i + 1]] = result.reshape(q_len, num_heads, head_dim).to(out.dtype)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write ``key``/``value`` ``[num_tokens, kv_heads, head_dim]`` into their slots.

    Slot ``s`` is offset ``s % block_size`` of block ``s // block_size``.
    Tokens whose slot is negative (``PAD_SLOT_ID`` is) are skipped. An FP8
    pool stores ``pd_kernels.fp8.quantize(x, scale)``.
    """
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()
    keep = slots >= 0  # a negative slot would index blocks from the end
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    block_ids = slots // block_size
    offsets = slots % block_size
    if fp8.is_fp8(k_cache.dtype):
        key, value = fp8.quantize(key, k_scale, k_cache.dtype), fp8.quantize(value, v_scale, v_cache.dtype)
    k_cache[block_ids, offsets] = key
    v_cache[block_ids, offsets] = value


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm computed in fp32, as HF Llama does.

    With ``residual``, first adds it to ``x`` and returns ``(normed, x + residual)``.
    """
    if residual is not None:
        x = x + residual
        residual = x
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    normed = weight * (hidden * torch.rsqrt(variance + eps)).to(x.dtype)
    return normed if residual is None else (normed, residual)


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half (NeoX-style) rotary embedding over the whole head_dim.

    q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim],
    cos_sin_cache: [max_positions, head_dim] fp32, cos in the first half, sin in the second.
    """
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [num_tokens, head_dim / 2] each
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(1).to(q.dtype)
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(1).to(q.dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    return rotate(q), rotate(k)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` ``[num_tokens, 2 * n]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T + bias`` for ``x [rows, in]`` and ``weight [out, in]``, as checkpoints hold it."""
    return F.linear(x, weight, bias)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool, *, scoring: str = "softmax",
                   score_bias: torch.Tensor | None = None, topk_method: str = "greedy", num_groups: int = 1,
                   topk_group: int = 1, routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``top_k`` experts of each token and their weights, as HF's MoE routers choose them.

    Scores in fp32: softmax over all experts (Mixtral, Qwen-MoE, DeepSeek-V2) or
    sigmoid (DeepSeek-V3). ``score_bias`` ``[E]`` (V3's ``e_score_correction_bias``)
    is added for the choice only; the weights are always the unbiased scores.
    ``topk_method``:

    - ``greedy``: ``torch.topk`` over all experts (groups ignored, as HF's V2).
    - ``group_limited_greedy`` (V2): each of ``num_groups`` equal groups of
      consecutive experts scored by its best; the other experts of all but the
      best ``topk_group`` groups score 0.0, then ``torch.topk``.
    - ``noaux_tc`` (V3): groups scored by the sum of their best two biased scores;
      the others masked to -inf, then ``torch.topk`` over the biased scores.

    With ``renormalize`` the chosen weights are divided by their sum (+ 1e-20 for
    sigmoid scores, as V3's ``norm_topk_prob``), then all multiplied by
    ``routed_scaling_factor``. HF picks with ``sorted=False``: the same experts,
    here ordered best first. Returns ``(topk_weights fp32 [T, k], topk_ids int64
    [T, k])``; the model casts the weights to its dtype, as HF does.
    """
    if scoring == "sigmoid":
        scores = router_logits.float().sigmoid()  # [T, E]
    else:
        scores = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    choice = scores if score_bias is None else scores + score_bias  # [T, E]: what picks, never what weighs
    if topk_method != "greedy":
        num_tokens, num_experts = choice.shape
        group_size = num_experts // num_groups
        grouped = choice.view(num_tokens, num_groups, group_size)  # [T, G, E / G]: consecutive experts
        if topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        else:
            group_scores = grouped.amax(dim=-1)  # [T, G]
        kept_group_ids = torch.topk(group_scores, topk_group, dim=-1).indices  # [T, topk_group]
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_group_ids, True)  # [T, G]
        kept = kept[:, :, None].expand(num_tokens, num_groups, group_size).reshape(num_tokens, num_experts)
        # V3's biased scores may be negative, so its dropped experts need -inf; V2's fill is HF's 0.0, which
        # also decides the same ties with experts whose softmax underflowed to 0.
        choice = choice.masked_fill(~kept, float("-inf") if topk_method == "noaux_tc" else 0.0)
    ids = torch.topk(choice, top_k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, ids)  # [T, k]
    if renormalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + 1e-20 if scoring == "sigmoid" else total)
    return weights * routed_scaling_factor, ids


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """Each token's routed experts' SwiGLU MLPs, weighted and summed: HF's eager expert loop.

    For token ``t`` and slot ``j`` with expert ``e = topk_ids[t, j]``:
    ``out[t] += topk_weights[t, j] * (silu(x W_gate^T) * (x W_up^T)) W_down^T``, where
    ``w13[e] = [W_gate; W_up]`` (``[2I, H]``) and ``w2[e] = W_down`` (``[H, I]``).
    The weights are cast to ``hidden``'s dtype and the sum runs in it, in
    expert order, as ``transformers`` does.
    """
    out = torch.zeros_like(hidden)
    weights = topk_weights.to(hidden.dtype)
    for expert in torch.unique(topk_ids).tolist():
        tokens, slots = torch.where(topk_ids == expert)
        y = F.linear(silu_and_mul(F.linear(hidden[tokens], w13[expert])), w2[expert])
        out.index_add_(0, tokens, y * weights[tokens, slots, None])
    return out
