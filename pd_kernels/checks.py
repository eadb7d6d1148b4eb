"""Host-side launch checks shared by every attention backend.

Each public kernel entry point calls these before doing any work, so a bad
shape, dtype or stride fails with a message naming the argument instead of
producing garbage or crashing inside a kernel.
"""

from __future__ import annotations

import torch

from pd_kernels.fp8 import FP8_DTYPES, check_scale, is_fp8

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256

# Padding tokens own no slot and carry this one; store_kv skips every negative slot.
PAD_SLOT_ID = -1
# A row without a LoRA adapter carries this slot in ``lora_delta``'s ``row_slots``: its output is left as it is.
NO_LORA = -1


def _fail(name: str, message: str) -> None:
    raise ValueError(f"{name}: {message}")


def check_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    if dtype is None:
        if tensor.dtype not in SUPPORTED_DTYPES:
            _fail(name, f"dtype {tensor.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    elif tensor.dtype != dtype:
        _fail(name, f"expected dtype {dtype}, got {tensor.dtype}")


def check_ndim(name: str, tensor: torch.Tensor, ndim: int) -> None:
    if tensor.dim() != ndim:
        _fail(name, f"expected {ndim} dimensions, got shape {tuple(tensor.shape)}")


def check_kv_pool(k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype, k_scale: float,
                  v_scale: float) -> None:
    """One layer's K and V views of the pool: ``[num_blocks, block_size, num_kv_heads, head_dim]``, one shape,
    of the activations' ``dtype`` or an FP8 one (``pd_kernels.fp8``), with scales only where FP8."""
    check_ndim("k_cache", k_cache, 4)
    check_ndim("v_cache", v_cache, 4)
    if k_cache.shape != v_cache.shape:
        _fail("v_cache", f"shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}")
    if k_cache.dtype != dtype and not is_fp8(k_cache.dtype):
        _fail("k_cache", f"dtype {k_cache.dtype} is neither the activations' {dtype} nor one of {FP8_DTYPES}")
    check_dtype("v_cache", v_cache, k_cache.dtype)
    check_scale("k_scale", k_scale)
    check_scale("v_scale", v_scale)
    if not is_fp8(k_cache.dtype) and (k_scale != 1.0 or v_scale != 1.0):
        _fail("k_scale", f"KV scales apply to FP8 pages only; the pool is {k_cache.dtype} "
                         f"(got k_scale {k_scale}, v_scale {v_scale})")


def check_attention_args(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
    sliding_window: int | None, softcap: float | None, out: torch.Tensor | None,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Validate the unified attention call: the arguments of ``pd_kernels.unified_attention`` but the softmax scale."""
    check_ndim("q", q, 3)
    check_dtype("q", q)
    check_kv_pool(k_cache, v_cache, q.dtype, k_scale, v_scale)
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, _, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        _fail("k_cache", f"head_dim {cache_head_dim} differs from q's {head_dim}")
    if head_dim > MAX_HEAD_DIM or head_dim % 8 != 0:
        _fail("q", f"head_dim {head_dim} is not supported (a multiple of 8, at most {MAX_HEAD_DIM})")
    if num_heads % num_kv_heads != 0:
        _fail("q", f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(-1) != 1:
            _fail(name, f"the head_dim axis must be contiguous, got strides {cache.stride()}")
    check_batch_metadata(q, cu_seqlens_q, seq_lens, block_table, {"k_cache": k_cache, "v_cache": v_cache})
    if sliding_window is not None and sliding_window < 1:
        _fail("sliding_window", f"must be >= 1 or None, got {sliding_window}")
    if softcap is not None and softcap <= 0:
        _fail("softcap", f"must be > 0 or None, got {softcap}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        _fail("out", f"expected shape {tuple(q.shape)} and dtype {q.dtype}, got {tuple(out.shape)} {out.dtype}")


def check_batch_metadata(q: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                         block_table: torch.Tensor, caches: dict[str, torch.Tensor]) -> None:
    """A varlen batch's metadata (``AttentionMetadata``'s): int32, shapes that agree, on q's device."""
    check_dtype("cu_seqlens_q", cu_seqlens_q, torch.int32)
    check_dtype("seq_lens", seq_lens, torch.int32)
    check_dtype("block_table", block_table, torch.int32)
    check_ndim("cu_seqlens_q", cu_seqlens_q, 1)
    check_ndim("seq_lens", seq_lens, 1)
    check_ndim("block_table", block_table, 2)
    num_seqs = seq_lens.shape[0]
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        _fail("cu_seqlens_q", f"expected {num_seqs + 1} entries for {num_seqs} sequences, got {cu_seqlens_q.shape[0]}")
    if block_table.shape[0] != num_seqs:
        _fail("block_table", f"expected {num_seqs} rows, got {block_table.shape[0]}")
    for name, tensor in (*caches.items(), ("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens),
                         ("block_table", block_table)):
        if tensor.device != q.device:
            _fail(name, f"is on {tensor.device}, q is on {q.device}")


def check_latent_pool(name: str, cache: torch.Tensor, dtype: torch.dtype, scale: float) -> None:
    """One layer's view of an MLA latent pool: ``[num_blocks, block_size, 1, latent_dim]``, rows contiguous,
    of ``dtype`` or FP8 (a scale only where FP8)."""
    check_ndim(name, cache, 4)
    if cache.shape[2] != 1:
        _fail(name, f"a latent pool holds one row per token (axis 2 of size 1), got shape {tuple(cache.shape)}")
    if cache.stride(-1) != 1:
        _fail(name, f"the latent axis must be contiguous, got strides {cache.stride()}")
    if cache.dtype != dtype and not is_fp8(cache.dtype):
        _fail(name, f"dtype {cache.dtype} is neither the activations' {dtype} nor one of {FP8_DTYPES}")
    check_scale("scale", scale)
    if not is_fp8(cache.dtype) and scale != 1.0:
        _fail("scale", f"a KV scale applies to FP8 pages only; the pool is {cache.dtype} (got {scale})")


def check_latent_attention_args(q: torch.Tensor, latent_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                seq_lens: torch.Tensor, block_table: torch.Tensor, v_dim: int,
                                out: torch.Tensor | None, scale: float) -> None:
    """Validate ``pd_kernels.latent_attention``."""
    check_ndim("q", q, 3)
    check_dtype("q", q)
    check_latent_pool("latent_cache", latent_cache, q.dtype, scale)
    if q.shape[2] != latent_cache.shape[3]:
        _fail("q", f"its last axis ({q.shape[2]}) must be the latent row's ({latent_cache.shape[3]})")
    if not 0 < v_dim <= q.shape[2]:
        _fail("v_dim", f"must be within (0, {q.shape[2]}], got {v_dim}")
    check_batch_metadata(q, cu_seqlens_q, seq_lens, block_table, {"latent_cache": latent_cache})
    expected = (q.shape[0], q.shape[1], v_dim)
    if out is not None and (tuple(out.shape) != expected or out.dtype != q.dtype):
        _fail("out", f"expected shape {expected} and dtype {q.dtype}, got {tuple(out.shape)} {out.dtype}")


def check_store_latent_args(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                            scale: float) -> None:
    """Validate ``pd_kernels.store_latent``."""
    check_ndim("latent", latent, 2)
    check_dtype("latent", latent)
    check_latent_pool("cache", cache, latent.dtype, scale)
    if latent.shape[1] != cache.shape[3]:
        _fail("latent", f"rows of {latent.shape[1]} values do not match the pool's {cache.shape[3]}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        _fail("slot_mapping", f"expected int32 or int64, got {slot_mapping.dtype}")
    if slot_mapping.shape != (latent.shape[0],):
        _fail("slot_mapping", f"expected shape ({latent.shape[0]},), got {tuple(slot_mapping.shape)}")


def check_store_kv_args(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Validate ``pd_kernels.store_kv``."""
    check_ndim("key", key, 3)
    check_ndim("value", value, 3)
    check_dtype("key", key)
    check_kv_pool(k_cache, v_cache, key.dtype, k_scale, v_scale)
    if key.shape != value.shape:
        _fail("value", f"shape {tuple(value.shape)} differs from key {tuple(key.shape)}")
    if tuple(key.shape[1:]) != tuple(k_cache.shape[2:]):
        _fail("key", f"per-token shape {tuple(key.shape[1:])} does not match the cache's {tuple(k_cache.shape[2:])}")
    check_dtype("value", value, key.dtype)
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        _fail("slot_mapping", f"expected int32 or int64, got {slot_mapping.dtype}")
    if slot_mapping.shape != (key.shape[0],):
        _fail("slot_mapping", f"expected shape ({key.shape[0]},), got {tuple(slot_mapping.shape)}")


def check_last_dim_contiguous(name: str, tensor: torch.Tensor) -> None:
    if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        _fail(name, f"the last axis must be contiguous, got strides {tensor.stride()}")


def check_triton_attention_args(q: torch.Tensor, block_table: torch.Tensor, out: torch.Tensor | None) -> None:
    """What the Triton attention kernels need beyond ``check_attention_args``."""
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("block_table", block_table)
    if out is not None:
        check_last_dim_contiguous("out", out)
        if out.device != q.device:
            _fail("out", f"is on {out.device}, q is on {q.device}")


def check_triton_store_kv_args(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """What the Triton KV store needs beyond ``check_store_kv_args``: contiguous last axes, one device."""
    for name, tensor in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, tensor)
    for name, tensor in (("value", value), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        if tensor.device != key.device:
            _fail(name, f"is on {tensor.device}, key is on {key.device}")


def check_rms_norm_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    """Validate ``pd_kernels.rms_norm``: x [..., hidden], weight [hidden], residual like x."""
    check_dtype("x", x)
    check_dtype("weight", weight)
    if x.dim() < 1:
        _fail("x", "must have at least one dimension")
    check_last_dim_contiguous("x", x)
    if weight.shape != (x.shape[-1],):
        _fail("weight", f"expected shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    if weight.device != x.device:
        _fail("weight", f"is on {weight.device}, x is on {x.device}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            _fail("residual", f"expected shape {tuple(x.shape)} and dtype {x.dtype}, "
                              f"got {tuple(residual.shape)} {residual.dtype}")
        if residual.device != x.device:
            _fail("residual", f"is on {residual.device}, x is on {x.device}")
        check_last_dim_contiguous("residual", residual)


def check_rotary_args(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """Validate ``pd_kernels.rotary_embedding``.

    q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim],
    positions: int [num_tokens], cos_sin_cache: fp32 [max_positions, head_dim].
    """
    check_ndim("q", q, 3)
    check_ndim("k", k, 3)
    check_dtype("q", q)
    check_dtype("k", k, q.dtype)
    head_dim = q.shape[2]
    if k.shape[0] != q.shape[0] or k.shape[2] != head_dim:
        _fail("k", f"shape {tuple(k.shape)} does not match q's {tuple(q.shape)} in tokens and head_dim")
    if head_dim % 2 != 0:
        _fail("q", f"head_dim {head_dim} must be even for rotate-half rotary")
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("k", k)
    check_ndim("positions", positions, 1)
    if positions.dtype not in (torch.int32, torch.int64):
        _fail("positions", f"expected int32 or int64, got {positions.dtype}")
    if positions.shape[0] != q.shape[0]:
        _fail("positions", f"expected {q.shape[0]} entries, got {positions.shape[0]}")
    check_ndim("cos_sin_cache", cos_sin_cache, 2)
    check_dtype("cos_sin_cache", cos_sin_cache, torch.float32)
    if cos_sin_cache.shape[1] != head_dim:
        _fail("cos_sin_cache", f"expected {head_dim} columns (cos then sin halves), got {cos_sin_cache.shape[1]}")
    check_last_dim_contiguous("cos_sin_cache", cos_sin_cache)
    for name, tensor in (("k", k), ("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        if tensor.device != q.device:
            _fail(name, f"is on {tensor.device}, q is on {q.device}")


def check_linear_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Validate a dense layer's launch: x [rows, in], weight [out, in] contiguous, bias [out]; one dtype."""
    check_ndim("x", x, 2)
    check_ndim("weight", weight, 2)
    check_dtype("x", x)
    check_dtype("weight", weight, x.dtype)
    check_last_dim_contiguous("x", x)
    if not weight.is_contiguous():
        _fail("weight", "must be contiguous [out_features, in_features]")
    if weight.shape[1] != x.shape[1]:
        _fail("weight", f"has {weight.shape[1]} input features, x has {x.shape[1]}")
    if weight.device != x.device:
        _fail("weight", f"is on {weight.device}, x is on {x.device}")
    if bias is not None:
        check_dtype("bias", bias, x.dtype)
        if bias.shape != (weight.shape[0],):
            _fail("bias", f"expected shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        if bias.device != x.device:
            _fail("bias", f"is on {bias.device}, x is on {x.device}")


def check_fused_moe_args(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                         topk_weights: torch.Tensor) -> None:
    """Validate a fused-MoE launch: hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_ids and topk_weights [T, k].

    Expert ids are checked against ``E`` on CPU tensors only: on a GPU that check would wait for the device.
    """
    check_ndim("hidden", hidden, 2)
    check_ndim("w13", w13, 3)
    check_ndim("w2", w2, 3)
    check_ndim("topk_ids", topk_ids, 2)
    check_ndim("topk_weights", topk_weights, 2)
    check_dtype("hidden", hidden)
    check_dtype("w13", w13, hidden.dtype)
    check_dtype("w2", w2, hidden.dtype)
    num_experts, two_i, size = w13.shape
    if size != hidden.shape[1]:
        _fail("w13", f"has {size} input features, hidden has {hidden.shape[1]}")
    if two_i % 2:
        _fail("w13", f"must stack gate and up projections ([E, 2 * I, H]), got {two_i} rows")
    if tuple(w2.shape) != (num_experts, size, two_i // 2):
        _fail("w2", f"expected [E, H, I] = {(num_experts, size, two_i // 2)}, got {tuple(w2.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        _fail("topk_ids", f"expected an integer dtype (int32 or int64), got {topk_ids.dtype}")
    if not topk_weights.dtype.is_floating_point:
        _fail("topk_weights", f"expected a floating dtype, got {topk_weights.dtype}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != hidden.shape[0]:
        _fail("topk_ids", f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must "
                          f"both be [T, k] with T = {hidden.shape[0]} tokens")
    for name, tensor in (("w13", w13), ("w2", w2), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if tensor.device != hidden.device:
            _fail(name, f"is on {tensor.device}, hidden is on {hidden.device}")
    if hidden.device.type == "cpu" and topk_ids.numel():
        low, high = int(topk_ids.min()), int(topk_ids.max())
        if low < 0 or high >= num_experts:
            _fail("topk_ids", f"expert ids must be in [0, {num_experts}), got [{low}, {high}]")


def check_select_experts_args(router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax",
                              score_bias: torch.Tensor | None = None, topk_method: str = "greedy",
                              num_groups: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0) -> None:
    """router_logits [T, E]; a scoring with one of its topk methods (HF's routers: softmax with greedy or
    group_limited_greedy, sigmoid with noaux_tc); for the grouped methods, E in num_groups equal groups of
    which the kept topk_group hold at least top_k experts; score_bias [E] fp32, with sigmoid only;
    1 <= top_k <= E and routed_scaling_factor > 0."""
    methods_by_scoring = {"softmax": ("greedy", "group_limited_greedy"), "sigmoid": ("noaux_tc",)}
    check_ndim("router_logits", router_logits, 2)
    check_dtype("router_logits", router_logits)
    num_experts = router_logits.shape[1]
    if scoring not in methods_by_scoring:
        _fail("scoring", f"unknown scoring {scoring!r}; supported: {', '.join(methods_by_scoring)}")
    if topk_method not in methods_by_scoring[scoring]:
        known = [method for methods in methods_by_scoring.values() for method in methods]
        reason = "is unknown" if topk_method not in known else f"does not route {scoring} scores"
        _fail("topk_method", f"{topk_method!r} {reason}; {scoring} scores route by "
                             f"{', '.join(methods_by_scoring[scoring])}")
    max_top_k, holding = num_experts, "the number of experts"
    if topk_method != "greedy":  # greedy ignores the groups, as HF's DeepSeek-V2 router does
        if num_groups < 1 or num_experts % num_groups:
            _fail("num_groups", f"{num_groups} must divide the {num_experts} experts into equal groups")
        group_size = num_experts // num_groups
        if topk_method == "noaux_tc" and group_size < 2:
            _fail("num_groups", f"{num_groups} groups of {num_experts} experts hold {group_size} each; noaux_tc "
                                f"scores a group by its best two")
        if not 1 <= topk_group <= num_groups:
            _fail("topk_group", f"must be in [1, {num_groups}] (num_groups), got {topk_group}")
        max_top_k, holding = topk_group * group_size, f"the experts of the {topk_group} kept groups of {group_size}"
    if not 1 <= top_k <= max_top_k:
        _fail("top_k", f"must be in [1, {max_top_k}] ({holding}), got {top_k}")
    if score_bias is not None:
        if scoring != "sigmoid":
            _fail("score_bias", f"is added to sigmoid scores only (noaux_tc); scoring is {scoring!r}")
        if score_bias.shape != (num_experts,) or score_bias.dtype != torch.float32:
            _fail("score_bias", f"expected fp32 [{num_experts}] (one per expert), got {score_bias.dtype} "
                                f"{tuple(score_bias.shape)}")
        if score_bias.device != router_logits.device:
            _fail("score_bias", f"is on {score_bias.device}, router_logits is on {router_logits.device}")
    if not 0 < routed_scaling_factor < float("inf"):
        _fail("routed_scaling_factor", f"must be positive and finite, got {routed_scaling_factor}")


def check_lora_args(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    row_slots: torch.Tensor, slice_starts: tuple[int, ...]) -> None:
    """Validate ``pd_kernels.lora_delta`` (its docstring gives the shapes). Slots are checked against
    ``num_slots`` on CPU tensors only: on a GPU that check would wait for the device."""
    for name, tensor, ndim in (("out", out, 2), ("x", x, 2), ("lora_a", lora_a, 3), ("lora_b", lora_b, 3),
                               ("row_slots", row_slots, 1)):
        check_ndim(name, tensor, ndim)
    check_dtype("out", out)
    for name, tensor in (("x", x), ("lora_a", lora_a), ("lora_b", lora_b)):
        check_dtype(name, tensor, out.dtype)
    check_dtype("row_slots", row_slots, torch.int32)
    (num_rows, out_features), (num_slots, _, rank) = out.shape, lora_b.shape
    if x.shape[0] != num_rows:
        _fail("x", f"x {tuple(x.shape)} has {x.shape[0]} rows, out {tuple(out.shape)} has {num_rows}")
    if row_slots.shape[0] != num_rows:
        _fail("row_slots", f"expected {num_rows} entries (one per row of out), got {row_slots.shape[0]}")
    if lora_b.shape[1] != out_features or rank < 1:
        _fail("lora_b", f"expected [num_slots, out_features = {out_features}, rank >= 1], got {tuple(lora_b.shape)}")
    _check_slice_starts(slice_starts, out_features)
    expected_a = (num_slots, len(slice_starts) * rank, x.shape[1])
    if tuple(lora_a.shape) != expected_a:
        _fail("lora_a", f"expected [num_slots, num_slices * rank, in_features] = {expected_a} for lora_b "
                        f"{tuple(lora_b.shape)}, {len(slice_starts)} slices and x {tuple(x.shape)}, "
                        f"got {tuple(lora_a.shape)}")
    check_last_dim_contiguous("out", out)
    check_last_dim_contiguous("x", x)
    for name, tensor in (("lora_a", lora_a), ("lora_b", lora_b), ("row_slots", row_slots)):
        if not tensor.is_contiguous():
            _fail(name, f"must be contiguous, got strides {tensor.stride()} for shape {tuple(tensor.shape)}")
    for name, tensor in (("x", x), ("lora_a", lora_a), ("lora_b", lora_b), ("row_slots", row_slots)):
        if tensor.device != out.device:
            _fail(name, f"is on {tensor.device}, out is on {out.device}")
    if out.device.type == "cpu" and num_rows:
        low, high = (int(v) for v in torch.aminmax(row_slots))
        if low < NO_LORA or high >= num_slots:
            _fail("row_slots", f"slots must be in [0, {num_slots}) or NO_LORA ({NO_LORA}), got [{low}, {high}]")


def _check_slice_starts(slice_starts: tuple[int, ...], out_features: int) -> None:
    """Each slice's first output column: ``(0,)`` for an unfused layer, ``(0, q, q + kv)`` for a fused q|k|v."""
    if not isinstance(slice_starts, (tuple, list)) or not slice_starts \
            or not all(isinstance(start, int) for start in slice_starts):
        _fail("slice_starts", f"must be a non-empty tuple of ints, got {slice_starts!r}")
    if slice_starts[0] != 0:
        _fail("slice_starts", f"the first slice starts at column 0, got {tuple(slice_starts)}")
    if any(a >= b for a, b in zip(slice_starts, slice_starts[1:])) or slice_starts[-1] >= out_features:
        _fail("slice_starts", f"must ascend strictly below out_features {out_features} (no empty slice), "
                              f"got {tuple(slice_starts)}")
