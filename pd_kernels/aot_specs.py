"""The specialisations the AOT compile check (``pd_kernels.aot``) compiles: every one the engine can launch.

Each is compiled with the alignment Triton specialises a real launch on:
pointers 16-byte aligned and every ``stride_*`` argument a multiple of 16
(``tt.divisibility``), as the engine's launches are: its tensors are
allocations or views at whole-head offsets, and its strides are multiples of
``head_dim`` or ``hidden`` (all multiples of 16 in the supported models).
The block table's row stride (``max_blocks_per_seq``) can be any number and
is left unmarked. Without the marks every load is scalar, with a 64-bit
address per element: such a build (a launch on odd strides) is another
kernel, and the attention kernel then uses 255 registers and spills.
Constexprs that depend on the device are set for the arch compiled: a kernel
that takes ``FP8_HW`` gets ``arch >= 89``, as ``hardware_fp8`` would choose.

The specialisations are the host launchers' own choices (``gpu_tiles``,
``prefill_tiles``, ``row_block``, ``norm_num_warps``, the MoE and scaled-MM
tiles), over fp16 and bf16, the head dims of the supported architectures (64,
80, 96 and 128; Qwen3's is 128), block sizes 16 and 32, GQA groups 1, 4, 7
and 8, decode-only, split-KV, mixed and prefill batches, with and without a
sliding window; the fused MoE's two GEMMs at its decode and prefill tiles;
fp32 queries for attention and the MoE GEMMs, whose products must stay IEEE
(``--quick``: each attention path once, and the MoE's prefill tile); and the
FP8 scaled product (``scaled_mm``; sm_90 only: sm_80 has no FP8). FP8 KV
pages (``kv_dtype`` in the record): float8_e4m3fn pages under fp16 and bf16
queries at head dims 64 and 128 (every attention path, and the store), and
float8_e5m2 in one of each. Both arches build them: without ``FP8_HW`` the
kernels read and write FP8 pages as bytes with integer conversions
(``pd_kernels.triton.fp8_kv``), which sm_80 needs (Triton refuses e4m3 below
sm_89). Multi-head latent attention at DeepSeek-V3's latent row (512 + 64) over
16 and 128 heads, single pass and split-KV, its pages and e4m3 ones under
fp16, bf16 and fp32 queries (``latent_specs``). The multi-LoRA delta's shrink
and expand over fp16, bf16 and fp32, ranks 16 and 64, 1 to 3 slices at
Llama-3-8B's widths (``lora_specs``; ``--quick``: bf16, rank 16, q|k|v).
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
from dataclasses import dataclass, field

import torch

# The arches checked, and the dynamic shared memory a block may use there: A100 (sm_80), H100/H200 (sm_90).
SHARED_LIMIT_BYTES = {80: 166_912, 90: 232_448}
# Strides a launch may pass as any number (see the module doc): compiled without the multiple-of-16 mark.
UNALIGNED_STRIDES = frozenset({"stride_block_table"})
ELEMENT_SIZES = {"fp16": 2, "bf16": 2, "fp32": 4}
DTYPES = ("fp16", "bf16")  # every kernel's
IEEE_DTYPES = ("fp32",)  # attention's and the MoE GEMMs': products in IEEE fp32, never on tensor cores
HEAD_DIMS = (64, 80, 96, 128)
BLOCK_SIZES = (16, 32)
GROUPS = (1, 4, 7, 8)
# (hidden size, for norms) of the supported model shapes: 0.5B, 1.5B/7B Qwen2, Llama 3 8B, Mistral 7B.
HIDDEN_SIZES = (896, 1536, 3584, 4096)
KV_FORMAT_NAMES = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
_GPU = torch.device("cuda")  # a device object only: the launchers' GPU choices, no GPU needed


@dataclass(frozen=True)
class Spec:
    """One compile: a kernel, its argument types and constexprs, and its launch options."""

    kernel: str
    name: str  # kernel.path.format (pd_kernels.aot's doc)
    fn: object
    dtype: str
    head_dim: int | None
    block_size: int | None
    pointers: dict[str, str]  # pointer argument -> element type, e.g. "fp32"
    constexprs: dict
    num_warps: int = 4
    num_stages: int = 3
    max_registers: int | None = None  # Triton's maxnreg
    min_arch: int = 0  # compiled for arches from this one (FP8 products: sm_89 and later)
    arch: int | None = None  # compiled for this arch only, whose launcher's choice it is; None: for every one
    extra: dict = field(default_factory=dict)

    def signature(self) -> dict[str, str]:
        types = {}
        for param in self.fn.params:
            if param.is_constexpr:
                types[param.name] = "constexpr"
            elif param.name.endswith("_ptr"):
                types[param.name] = "*" + self.pointers.get(param.name, self.dtype)
            elif param.name in ("softmax_scale", "softcap", "eps", "k_scale", "v_scale"):
                types[param.name] = "fp32"
            else:
                types[param.name] = "i32"
        return types

    def attributes(self) -> dict[tuple[int], list]:
        """The divisibility marks of an engine launch (module doc): aligned pointers, strides multiples of 16."""
        aligned = [i for i, param in enumerate(self.fn.params) if not param.is_constexpr and (
            param.name.endswith("_ptr") or param.name.startswith("stride_") and param.name not in UNALIGNED_STRIDES)]
        return {(i,): [["tt.divisibility", 16]] for i in aligned}

    def constexprs_for(self, arch: int) -> dict:
        """The constexprs of the compile for ``arch``: the spec's, and ``FP8_HW`` (FP8 pages read by the
        hardware's conversions) from sm_89 on in a kernel that takes it, as ``hardware_fp8`` chooses."""
        if any(param.name == "FP8_HW" for param in self.fn.params):
            return {**self.constexprs, "FP8_HW": hardware_fp8_arch(arch)}
        return self.constexprs


def hardware_fp8_arch(arch: int) -> bool:
    """Whether ``arch`` (major * 10 + minor) has FP8 conversion instructions, as ``fp8_kv.hardware_fp8`` judges
    a device: sm_89 (Ada), sm_90 (Hopper) and later."""
    from pd_kernels.triton.fp8_kv import FP8_HW_CAPABILITY

    return divmod(arch, 10) >= FP8_HW_CAPABILITY


def kv_pointers(kv_dtype: torch.dtype | None) -> dict[str, str]:
    """The cache pointers' element type: FP8 pages reach the kernels as bytes."""
    return {"k_cache_ptr": "u8", "v_cache_ptr": "u8"} if kv_dtype is not None else {}


def kv_format(kv_dtype: torch.dtype | None) -> int:
    from pd_kernels.triton.fp8_kv import KV_NATIVE
    from pd_kernels.triton.fp8_kv import kv_format as fp8_format

    return fp8_format(kv_dtype) if kv_dtype is not None else KV_NATIVE.value


def kv_name(kv_dtype: torch.dtype | None) -> str | None:
    return str(kv_dtype).removeprefix("torch.") if kv_dtype is not None else None


def format_name(dtype: str, kv_dtype: torch.dtype | None) -> str:
    """The last part of a ``name``: the pages' format, the queries' dtype for native pages."""
    return KV_FORMAT_NAMES[kv_dtype] if kv_dtype is not None else dtype


def fp8_kv_grid(paths: tuple) -> list[tuple]:
    """(pages, dtype, head_dim, path) of the FP8 KV specialisations: e4m3 in full, e5m2 once per path."""
    e4m3 = itertools.product((torch.float8_e4m3fn,), DTYPES, (64, 128), paths)
    return [*e4m3, *((torch.float8_e5m2, "bf16", 128, path) for path in paths)]


# Pointers of the attention kernels that are not of the queries' dtype.
ATTENTION_POINTERS = {"partial_out_ptr": "fp32", "partial_max_ptr": "fp32", "partial_sum_ptr": "fp32",
                      "cu_seqlens_q_ptr": "i32", "seq_lens_ptr": "i32", "block_table_ptr": "i32"}


def attention_spec(kernel: str, fn: object, path: str, dtype: str, head_dim: int, block_size: int, group: int,
                   window: bool, kv_dtype: torch.dtype | None, tiles: object, constexprs: dict,
                   arch: int | None = None) -> Spec:
    """One specialisation of an attention kernel: the constexprs both kernels share, and ``constexprs``."""
    return Spec(
        kernel, f"attention.{path}.hd{head_dim}.{format_name(dtype, kv_dtype)}", fn, dtype, head_dim, block_size,
        {**ATTENTION_POINTERS, **kv_pointers(kv_dtype)},
        {"HEAD_DIM": head_dim, "BLOCK_SIZE": block_size, "GROUP": group, "BLOCK_Q": tiles.block_q,
         "BLOCK_M": tiles.block_m, "TILE": tiles.tile, "USE_SOFTCAP": False, "USE_WINDOW": window,
         "KV_FORMAT": kv_format(kv_dtype), **constexprs},
        tiles.num_warps, tiles.num_stages, max_registers=tiles.max_registers, arch=arch,
        extra={"group": group, "batch": path, "sliding_window": window, "kv_dtype": kv_name(kv_dtype)},
    )


def paged_specs(quick: bool) -> list[Spec]:
    """The single-pass and split-KV kernel (``paged_attention``) at ``gpu_tiles``'s choices, per path."""
    from pd_kernels.triton.paged_attention import _paged_attention_kernel, gpu_tiles, padded_head_dim

    paths = (("decode", True, False), ("split", True, True), ("mixed", False, False))
    grid = itertools.product((*DTYPES, *IEEE_DTYPES), HEAD_DIMS, BLOCK_SIZES, GROUPS, paths, (False, True))
    if quick:
        grid = [("bf16", 128, 16, 4, paths[0], False), ("fp16", 80, 32, 7, paths[2], True),
                ("bf16", 64, 32, 8, paths[1], False), ("fp32", 128, 16, 4, paths[0], False),
                ("fp32", 80, 16, 1, paths[1], False), ("fp32", 128, 16, 7, paths[2], False)]
    fp8_grid = fp8_kv_grid(paths)
    if quick:
        fp8_grid = [(torch.float8_e4m3fn, "bf16", 128, paths[0]), (torch.float8_e4m3fn, "fp16", 64, paths[2]),
                    (torch.float8_e5m2, "bf16", 128, paths[1])]
    grid = [(*point, None) for point in grid]
    grid += [(dtype, head_dim, 16, 8, path, False, kv_dtype) for kv_dtype, dtype, head_dim, path in fp8_grid]
    specs = []
    for dtype, head_dim, block_size, group, (path, decode_only, split), window, kv_dtype in grid:
        # FP8 pages' key tiles as the launchers ask for them: split_kv's launch keeps the native pages' tiles.
        tiles = gpu_tiles(ELEMENT_SIZES[dtype], head_dim, group, decode_only, split,
                          kv_fp8=kv_dtype is not None and not split)
        specs.append(attention_spec("paged_attention", _paged_attention_kernel, path, dtype, head_dim, block_size,
                                    group, window, kv_dtype, tiles,
                                    {"HEAD_DIM_PAD": padded_head_dim(head_dim), "SPLIT": split}))
    return specs


def prefill_specs(quick: bool) -> list[Spec]:
    """The prefill attention kernel (``pd_kernels/triton/prefill_attention.py``, path ``prefill``: steps with
    long prompt chunks, tiled for the tensor cores) at ``prefill_tiles``'s choice for each arch; none where
    that module does not exist. Its arguments mirror ``_paged_attention_kernel``'s, without the split-KV
    ones."""
    if importlib.util.find_spec("pd_kernels.triton.prefill_attention") is None:
        return []
    from pd_kernels.triton.prefill_attention import _prefill_attention_kernel, head_dim_parts, prefill_tiles

    grid = itertools.product((*DTYPES, *IEEE_DTYPES), HEAD_DIMS, BLOCK_SIZES, GROUPS, (False, True))
    if quick:
        grid = [("bf16", 128, 16, 4, False), ("fp16", 80, 32, 7, True), ("fp32", 128, 16, 1, False)]
    fp8_grid = fp8_kv_grid(("prefill",))
    if quick:
        fp8_grid = [(torch.float8_e4m3fn, "bf16", 128, "prefill")]
    grid = [(*point, None) for point in grid]
    grid += [(dtype, head_dim, 16, 8, False, kv_dtype) for kv_dtype, dtype, head_dim, _ in fp8_grid]
    return [attention_spec("prefill_attention", _prefill_attention_kernel, "prefill", dtype, head_dim, block_size,
                           group, window, kv_dtype, prefill_tiles(ELEMENT_SIZES[dtype], head_dim, group, arch),
                           dict(zip(("HEAD_DIM_LO", "HEAD_DIM_HI"), head_dim_parts(head_dim))), arch)
            for dtype, head_dim, block_size, group, window, kv_dtype in grid for arch in SHARED_LIMIT_BYTES]


def attention_specs(quick: bool) -> list[Spec]:
    """Every attention path (decode, split, mixed, prefill) and the split-KV merge."""
    from pd_kernels.triton.launch import next_power_of_2
    from pd_kernels.triton.paged_attention import padded_head_dim
    from pd_kernels.triton.split_kv import _merge_splits_kernel

    specs = paged_specs(quick) + prefill_specs(quick)
    for dtype, head_dim in itertools.product(DTYPES, HEAD_DIMS if not quick else (128,)):
        specs.append(Spec(
            "merge_splits", f"merge_splits.hd{head_dim}.{dtype}", _merge_splits_kernel, dtype, head_dim, None,
            {"partial_out_ptr": "fp32", "partial_max_ptr": "fp32", "partial_sum_ptr": "fp32"},
            {"HEAD_DIM": head_dim, "HEAD_DIM_PAD": padded_head_dim(head_dim),
             "SPLITS_PAD": next_power_of_2(16), "BLOCK_H": 1},
        ))
    return specs


# DeepSeek-V3's multi-head latent attention: a latent row of kv_lora_rank 512 + rope 64 values; 128 query heads,
# 16 a rank at TP 8.
LATENT_V_DIM, LATENT_ROPE_DIM = 512, 64
LATENT_HEADS = (16, 128)


def latent_specs(quick: bool) -> list[Spec]:
    """The latent attention kernel (``pd_kernels.triton.latent_attention``) at ``gpu_latent_tiles``'s choices,
    V3's row, single pass (``decode``) and split-KV (``split``): fp16, bf16 and fp32 queries over their own
    pages and e4m3 pages, e5m2 and block size 32 once each; and the split-KV merge at its 512 values."""
    from pd_kernels.triton.latent_attention import _latent_attention_kernel, gpu_latent_tiles, padded_dim
    from pd_kernels.triton.launch import next_power_of_2
    from pd_kernels.triton.split_kv import MAX_SPLITS, _merge_splits_kernel

    paths = (("decode", False), ("split", True))
    grid = [(dtype, kv_dtype, heads, 16, path) for dtype, kv_dtype, heads, path in itertools.product(
        (*DTYPES, *IEEE_DTYPES), (None, torch.float8_e4m3fn), LATENT_HEADS, paths)
        if dtype not in IEEE_DTYPES or heads == LATENT_HEADS[0]]  # fp32 takes 16 heads a program at any count
    grid += [("bf16", torch.float8_e5m2, 16, 16, path) for path in paths]
    grid += [("bf16", None, 16, 32, path) for path in paths]
    if quick:
        grid = [("bf16", None, 16, 16, paths[0]), ("fp16", torch.float8_e4m3fn, 128, 16, paths[1]),
                ("fp32", None, 16, 16, paths[0])]
    latent_dim = LATENT_V_DIM + LATENT_ROPE_DIM
    specs = []
    for dtype, kv_dtype, heads, block_size, (path, split) in grid:
        tiles = gpu_latent_tiles(ELEMENT_SIZES[dtype], heads)
        pointers = {**ATTENTION_POINTERS, **({"cache_ptr": "u8"} if kv_dtype is not None else {})}
        specs.append(Spec(
            "latent_attention", f"latent_attention.{path}.{format_name(dtype, kv_dtype)}", _latent_attention_kernel,
            dtype, latent_dim, block_size, pointers,
            {"V_DIM": LATENT_V_DIM, "V_PAD": padded_dim(LATENT_V_DIM), "ROPE_DIM": LATENT_ROPE_DIM,
             "ROPE_PAD": padded_dim(LATENT_ROPE_DIM), "BLOCK_SIZE": block_size, "BLOCK_H": tiles.block_h,
             "TILE": tiles.tile, "SPLIT": split, "KV_FORMAT": kv_format(kv_dtype)},
            tiles.num_warps, tiles.num_stages, max_registers=tiles.max_registers,
            extra={"heads": heads, "block_m": tiles.block_h, "batch": path, "kv_dtype": kv_name(kv_dtype)},
        ))
    for dtype in DTYPES if not quick else ("bf16",):
        specs.append(Spec(
            "merge_splits", f"merge_splits.hd{LATENT_V_DIM}.{dtype}", _merge_splits_kernel, dtype, LATENT_V_DIM,
            None, {"partial_out_ptr": "fp32", "partial_max_ptr": "fp32", "partial_sum_ptr": "fp32"},
            {"HEAD_DIM": LATENT_V_DIM, "HEAD_DIM_PAD": padded_dim(LATENT_V_DIM),
             "SPLITS_PAD": next_power_of_2(MAX_SPLITS), "BLOCK_H": 1},
        ))
    return specs


def row_specs(quick: bool) -> list[Spec]:
    from pd_kernels.triton.activation import GPU_BLOCK, _silu_and_mul_kernel
    from pd_kernels.triton.launch import next_power_of_2, row_block
    from pd_kernels.triton.norm import _rms_norm_kernel, norm_num_warps
    from pd_kernels.triton.rotary import _rotary_kernel
    from pd_kernels.triton.store_kv import _store_kv_kernel

    specs = []
    stores = [(*spec, None) for spec in itertools.product(DTYPES, HEAD_DIMS, BLOCK_SIZES)]
    stores += [(dtype, head_dim, 16, torch.float8_e4m3fn) for dtype, head_dim in itertools.product(DTYPES, (64, 128))]
    stores += [("bf16", 128, 16, torch.float8_e5m2)]
    for dtype, head_dim, block_size, kv_dtype in stores:
        if quick and (head_dim, block_size) != (128, 16) or quick and kv_dtype is not None and dtype != "bf16":
            continue
        pad = next_power_of_2(head_dim)
        specs.append(Spec("store_kv", f"store_kv.hd{head_dim}.{format_name(dtype, kv_dtype)}", _store_kv_kernel,
                          dtype, head_dim, block_size, {"slot_mapping_ptr": "i64", **kv_pointers(kv_dtype)},
                          {"HEAD_DIM": head_dim, "HEAD_DIM_PAD": pad, "BLOCK_SIZE": block_size,
                           "BLOCK_ROWS": row_block(pad, _GPU), "KV_FORMAT": kv_format(kv_dtype)},
                          extra={"kv_dtype": kv_name(kv_dtype)}))
        if block_size == BLOCK_SIZES[0] and kv_dtype is None:
            half_pad = next_power_of_2(head_dim // 2)
            specs.append(Spec("rotary", f"rotary.hd{head_dim}.{dtype}", _rotary_kernel, dtype, head_dim, None,
                              {"positions_ptr": "i64", "cos_sin_cache_ptr": "fp32"},
                              {"HALF": head_dim // 2, "HALF_PAD": half_pad, "BLOCK_ROWS": row_block(half_pad, _GPU)}))
    widths = [(h, True) for h in HIDDEN_SIZES] + [(h, False) for h in HEAD_DIMS]  # layer norms; q/k norms
    for dtype, (width, residual) in itertools.product(DTYPES, widths):
        if quick and width not in (4096, 128):
            continue
        pad = next_power_of_2(width)
        rows = row_block(pad, _GPU)
        specs.append(Spec("rms_norm", f"rms_norm.h{width}.{dtype}", _rms_norm_kernel, dtype, None, None, {},
                          {"HIDDEN": width, "HIDDEN_PAD": pad, "BLOCK_ROWS": rows, "HAS_RESIDUAL": residual},
                          norm_num_warps(pad, rows), extra={"hidden": width}))
    for dtype in DTYPES:
        specs.append(Spec("silu_and_mul", f"silu_and_mul.{dtype}", _silu_and_mul_kernel, dtype, None, None, {},
                          {"BLOCK": GPU_BLOCK}))
    return specs


def moe_specs(quick: bool) -> list[Spec]:
    """The fused MoE's two grouped GEMMs, at each tile ``moe_tiles`` picks on a GPU (decode, prefill)."""
    from pd_kernels.triton.moe import (
        DECODE_TILES,
        DECODE_TILES_FP32,
        PREFILL_TILES,
        _moe_down_kernel,
        _moe_gate_up_kernel,
    )

    pointers = {"sorted_slots_ptr": "i32", "block_experts_ptr": "i32", "topk_weights_ptr": "fp32"}
    specs = []
    for dtype, path in itertools.product((*DTYPES, *IEEE_DTYPES), ("decode", "prefill")):
        if quick and (dtype, path) not in (("bf16", "decode"), ("fp16", "prefill"), ("fp32", "prefill"),
                                           ("fp32", "decode")):
            continue
        tiles = PREFILL_TILES if path == "prefill" else DECODE_TILES_FP32 if dtype in IEEE_DTYPES else DECODE_TILES
        for kernel, fn in (("moe_gate_up", _moe_gate_up_kernel), ("moe_down", _moe_down_kernel)):
            specs.append(Spec(kernel, f"{kernel}.{path}.{dtype}", fn, dtype, None, None, pointers,
                              {"BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k},
                              tiles.num_warps, tiles.num_stages, extra={"block_m": tiles.block_m}))
    return specs


def scaled_mm_specs(quick: bool) -> list[Spec]:
    """The FP8 scaled product at each tile ``mm_tiles`` picks on a GPU: per-token x per-channel scales, and
    block scales per weight row (``scale_rows`` 1: the engine's fused layers) or per 128x128 block."""
    from pd_kernels.triton.scaled_mm import BLOCK_PREFILL_TILES, DECODE_TILES, GROUP_K, PREFILL_TILES, _scaled_mm_kernel

    pointers = {"a_ptr": "fp8e4nv", "b_ptr": "fp8e4nv", "a_scale_ptr": "fp32", "b_scale_ptr": "fp32"}
    specs = []
    for dtype, prefill, (block_scaled, scale_rows), has_bias in itertools.product(
            DTYPES, (False, True), ((False, 1), (True, 1), (True, GROUP_K)), (False, True)):
        if quick and (has_bias or dtype != "bf16" or (block_scaled and scale_rows == 1)):
            continue
        tiles = (BLOCK_PREFILL_TILES if block_scaled else PREFILL_TILES) if prefill else DECODE_TILES
        path = "prefill" if prefill else "decode"
        specs.append(Spec("scaled_mm", f"scaled_mm.{path}.{dtype}", _scaled_mm_kernel, dtype, None, None, pointers,
                          {"HAS_BIAS": has_bias, "BLOCK_SCALED": block_scaled, "SCALE_ROWS": scale_rows,
                           "GROUP": GROUP_K, "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n,
                           "BLOCK_K": tiles.block_k},
                          tiles.num_warps, tiles.num_stages, extra={"block_m": tiles.block_m}, min_arch=89))
    return specs


# LoRA adapters' ranks, and the slice starts of the layers they adapt at Llama-3-8B's widths: o_proj and down
# unfused (1 slice), gate|up (2: 2 x 14336), q|k|v (3: 4096 + 2 x 1024).
LORA_RANKS = (16, 64)
LORA_SLICE_STARTS = {1: (0,), 2: (0, 14336), 3: (0, 4096, 5120)}


def lora_specs(quick: bool) -> list[Spec]:
    """The multi-LoRA delta's shrink and expand (``pd_kernels.triton.lora``) at ``lora_tiles``'s choices: fp16,
    bf16 and fp32, ranks 16 and 64, 1 to 3 slices (the shrink once per column block it takes); ``quick``:
    bf16, rank 16, q|k|v."""
    from pd_kernels.triton.lora import _lora_expand_kernel, _lora_shrink_kernel, lora_tiles, rank_pad, shrink_block_n

    grid = list(itertools.product((*DTYPES, *IEEE_DTYPES), LORA_RANKS, LORA_SLICE_STARTS))
    if quick:
        grid = [("bf16", 16, 3)]
    pointers = {"row_slots_ptr": "i32", "partial_ptr": "fp32"}
    specs, shrinks = [], set()
    for dtype, rank, num_slices in grid:
        tiles = lora_tiles(ELEMENT_SIZES[dtype])
        launch = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
        block_n = shrink_block_n(tiles, num_slices * rank)
        if (dtype, block_n) not in shrinks:
            shrinks.add((dtype, block_n))
            specs.append(Spec("lora_shrink", f"lora_shrink.n{block_n}.{dtype}", _lora_shrink_kernel, dtype, None,
                              None, pointers, {"BLOCK_M": tiles.block_m, "BLOCK_N": block_n, "BLOCK_K": tiles.block_k},
                              **launch, extra={"block_m": tiles.block_m, "block_n": block_n}))
        slice_starts = LORA_SLICE_STARTS[num_slices]
        specs.append(Spec("lora_expand", f"lora_expand.r{rank}.s{num_slices}.{dtype}", _lora_expand_kernel, dtype,
                          None, None, pointers,
                          {"SLICE_STARTS": slice_starts, "NUM_SLICES": num_slices, "RANK": rank,
                           "RANK_PAD": rank_pad(rank), "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.expand_n},
                          **launch, extra={"block_m": tiles.block_m, "rank": rank, "slices": num_slices}))
    return specs


@functools.cache
def all_specs(quick: bool) -> list[Spec]:
    """Every specialisation (``quick``: one or a few per kernel and path), in a fixed order: workers index it."""
    return (attention_specs(quick) + latent_specs(quick) + row_specs(quick) + moe_specs(quick)
            + scaled_mm_specs(quick) + lora_specs(quick))
