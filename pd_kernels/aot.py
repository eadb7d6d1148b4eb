"""Ahead-of-time compile check: every Triton kernel specialisation the engine can launch, for real GPUs.

``python -m pd_kernels.aot [--arch 80,90] [--quick] [--allow-spills] [--jobs N]``
compiles each specialisation to a cubin with Triton's bundled ``ptxas``. No
GPU is needed. It prints one JSON object per (specialisation, arch):
``kernel``, ``arch``, ``dtype``, ``head_dim``, ``block_size``, ``ok``,
``registers``, ``spills``, ``shared_bytes`` and ``shared_limit_bytes``. It
exits non-zero if any failed to compile, needs more shared memory than the
arch gives a block, or spills registers (to local memory, a round trip
through the caches and DRAM): ``--allow-spills`` reports spills without
failing, to explore tile sizes.

Each is compiled with the alignment Triton specialises a real launch on:
pointers 16-byte aligned and every ``stride_*`` argument a multiple of 16
(``tt.divisibility``), as the engine's launches are: its tensors are
allocations or views at whole-head offsets, and its strides are multiples of
``head_dim`` or ``hidden`` (all multiples of 16 in the supported models).
The block table's row stride (``max_blocks_per_seq``) can be any number and
is left unmarked. Without the marks every load is scalar, with a 64-bit
address per element: such a build (a launch on odd strides) is another
kernel, and the attention kernel then uses 255 registers and spills.

The specialisations are the host launchers' own choices (``gpu_tiles``,
``row_block``, ``norm_num_warps``), over fp16 and bf16, the head dims of the
supported architectures (64, 80, 96 and 128; Qwen3's is 128), block sizes 16
and 32, GQA groups 1, 4, 7 and 8, decode-only, split-KV and mixed batches,
with and without a sliding window; the fused MoE's two GEMMs at its decode and prefill tiles; and the FP8 scaled product (``scaled_mm``; sm_90 only: sm_80 has no FP8).
FP8 KV pages (``kv_dtype`` in the record): float8_e4m3fn pages under fp16 and
bf16 queries at head dims 64 and 128 (decode, split-KV, mixed; and the
store), and float8_e5m2 in one of each. Both arches build them: the kernels
read and write FP8 pages as bytes with integer conversions
(``pd_kernels.triton.fp8_kv``), so nothing needs sm_89's float8 instructions,
which Triton refuses for e4m3 below sm_89.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Dynamic shared memory a block may use: A100 (sm_80) and H100/H200 (sm_90).
SHARED_LIMIT_BYTES = {80: 166_912, 90: 232_448}
# Strides a launch may pass as any number (see the module doc): compiled without the multiple-of-16 mark.
UNALIGNED_STRIDES = frozenset({"stride_block_table"})
DTYPES = {"fp16": 2, "bf16": 2}
HEAD_DIMS = (64, 80, 96, 128)
BLOCK_SIZES = (16, 32)
GROUPS = (1, 4, 7, 8)
# (hidden size, for norms) of the supported model shapes: 0.5B, 1.5B/7B Qwen2, Llama 3 8B, Mistral 7B.
HIDDEN_SIZES = (896, 1536, 3584, 4096)
_GPU = torch.device("cuda")  # a device object only: the launchers' GPU choices, no GPU needed


@dataclass(frozen=True)
class Spec:
    """One compile: a kernel, its argument types and constexprs, and its launch options."""

    kernel: str
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


def fp8_kv_grid(quick: bool, batches: tuple) -> list[tuple]:
    """(pages, dtype, head_dim, batch) of the FP8 KV specialisations: e4m3 in full, e5m2 once per batch kind."""
    if quick:
        return [(torch.float8_e4m3fn, "bf16", 128, batches[0]), (torch.float8_e4m3fn, "fp16", 64, batches[2])]
    e4m3 = itertools.product((torch.float8_e4m3fn,), DTYPES, (64, 128), batches)
    return [*e4m3, *((torch.float8_e5m2, "bf16", 128, batch) for batch in batches)]


def kv_pointers(kv_dtype: torch.dtype | None) -> dict[str, str]:
    """The cache pointers' element type: FP8 pages reach the kernels as bytes."""
    return {"k_cache_ptr": "u8", "v_cache_ptr": "u8"} if kv_dtype is not None else {}


def kv_format(kv_dtype: torch.dtype | None) -> int:
    from pd_kernels.triton.fp8_kv import KV_NATIVE
    from pd_kernels.triton.fp8_kv import kv_format as fp8_format

    return fp8_format(kv_dtype) if kv_dtype is not None else KV_NATIVE.value


def kv_name(kv_dtype: torch.dtype | None) -> str | None:
    return str(kv_dtype).removeprefix("torch.") if kv_dtype is not None else None


def attention_specs(quick: bool) -> list[Spec]:
    from pd_kernels.triton.launch import next_power_of_2
    from pd_kernels.triton.paged_attention import _paged_attention_kernel, gpu_tiles, padded_head_dim
    from pd_kernels.triton.split_kv import _merge_splits_kernel

    pointers = {"partial_out_ptr": "fp32", "partial_max_ptr": "fp32", "partial_sum_ptr": "fp32",
                "cu_seqlens_q_ptr": "i32", "seq_lens_ptr": "i32", "block_table_ptr": "i32"}
    batches = (("decode", True, False), ("split", True, True), ("mixed", False, False))
    grid = itertools.product(DTYPES, HEAD_DIMS, BLOCK_SIZES, GROUPS, batches, (False, True))
    if quick:
        grid = [("bf16", 128, 16, 4, batches[0], False), ("fp16", 80, 32, 7, batches[2], True),
                ("bf16", 64, 32, 8, batches[1], False)]
    grid = [(dtype, head_dim, block_size, group, batch, window, None)
            for dtype, head_dim, block_size, group, batch, window in grid]
    grid += [(dtype, head_dim, 16, 8, batch, False, kv_dtype)
             for kv_dtype, dtype, head_dim, batch in fp8_kv_grid(quick, batches)]
    specs = []
    for dtype, head_dim, block_size, group, (batch, decode_only, split), window, kv_dtype in grid:
        tiles = gpu_tiles(DTYPES[dtype], head_dim, group, decode_only, split)
        specs.append(Spec(
            "paged_attention", _paged_attention_kernel, dtype, head_dim, block_size,
            {**pointers, **kv_pointers(kv_dtype)},
            {"HEAD_DIM": head_dim, "HEAD_DIM_PAD": padded_head_dim(head_dim), "BLOCK_SIZE": block_size,
             "GROUP": group, "BLOCK_Q": tiles.block_q, "BLOCK_M": tiles.block_m, "TILE": tiles.tile,
             "USE_SOFTCAP": False, "USE_WINDOW": window, "SPLIT": split, "KV_FORMAT": kv_format(kv_dtype)},
            tiles.num_warps, tiles.num_stages, max_registers=tiles.max_registers,
            extra={"group": group, "batch": batch, "sliding_window": window, "kv_dtype": kv_name(kv_dtype)},
        ))
    for dtype, head_dim in itertools.product(DTYPES, HEAD_DIMS if not quick else (128,)):
        specs.append(Spec(
            "merge_splits", _merge_splits_kernel, dtype, head_dim, None,
            {"partial_out_ptr": "fp32", "partial_max_ptr": "fp32", "partial_sum_ptr": "fp32"},
            {"HEAD_DIM": head_dim, "HEAD_DIM_PAD": padded_head_dim(head_dim),
             "SPLITS_PAD": next_power_of_2(16), "BLOCK_H": 1},
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
        specs.append(Spec("store_kv", _store_kv_kernel, dtype, head_dim, block_size,
                          {"slot_mapping_ptr": "i64", **kv_pointers(kv_dtype)},
                          {"HEAD_DIM": head_dim, "HEAD_DIM_PAD": pad, "BLOCK_SIZE": block_size,
                           "BLOCK_ROWS": row_block(pad, _GPU), "KV_FORMAT": kv_format(kv_dtype)},
                          extra={"kv_dtype": kv_name(kv_dtype)}))
        if block_size == BLOCK_SIZES[0] and kv_dtype is None:
            half_pad = next_power_of_2(head_dim // 2)
            specs.append(Spec("rotary", _rotary_kernel, dtype, head_dim, None,
                              {"positions_ptr": "i64", "cos_sin_cache_ptr": "fp32"},
                              {"HALF": head_dim // 2, "HALF_PAD": half_pad, "BLOCK_ROWS": row_block(half_pad, _GPU)}))
    widths = [(h, True) for h in HIDDEN_SIZES] + [(h, False) for h in HEAD_DIMS]  # layer norms; q/k norms
    for dtype, (width, residual) in itertools.product(DTYPES, widths):
        if quick and width not in (4096, 128):
            continue
        pad = next_power_of_2(width)
        rows = row_block(pad, _GPU)
        specs.append(Spec("rms_norm", _rms_norm_kernel, dtype, None, None, {},
                          {"HIDDEN": width, "HIDDEN_PAD": pad, "BLOCK_ROWS": rows, "HAS_RESIDUAL": residual},
                          norm_num_warps(pad, rows), extra={"hidden": width}))
    for dtype in DTYPES:
        specs.append(Spec("silu_and_mul", _silu_and_mul_kernel, dtype, None, None, {}, {"BLOCK": GPU_BLOCK}))
    return specs


def moe_specs(quick: bool) -> list[Spec]:
    """The fused MoE's two grouped GEMMs, at each tile ``moe_tiles`` picks on a GPU (decode, prefill)."""
    from pd_kernels.triton.moe import DECODE_TILES, PREFILL_TILES, _moe_down_kernel, _moe_gate_up_kernel

    pointers = {"sorted_slots_ptr": "i32", "block_experts_ptr": "i32", "topk_weights_ptr": "fp32"}
    specs = []
    for dtype, tiles in itertools.product(DTYPES, (DECODE_TILES, PREFILL_TILES)):
        if quick and (dtype, tiles.block_m) not in (("bf16", 16), ("fp16", 64)):
            continue
        for name, fn in (("moe_gate_up", _moe_gate_up_kernel), ("moe_down", _moe_down_kernel)):
            specs.append(Spec(name, fn, dtype, None, None, pointers,
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
        specs.append(Spec("scaled_mm", _scaled_mm_kernel, dtype, None, None, pointers,
                          {"HAS_BIAS": has_bias, "BLOCK_SCALED": block_scaled, "SCALE_ROWS": scale_rows,
                           "GROUP": GROUP_K, "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n,
                           "BLOCK_K": tiles.block_k},
                          tiles.num_warps, tiles.num_stages, extra={"block_m": tiles.block_m}, min_arch=89))
    return specs


def compile_spec(spec: Spec, arch: int, shared_limit: int, allow_spills: bool = False) -> dict:
    """Compile one spec for ``arch``; the JSON record."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    record = {"kernel": spec.kernel, "arch": arch, "dtype": spec.dtype, "head_dim": spec.head_dim,
              "block_size": spec.block_size, **spec.extra, "num_warps": spec.num_warps,
              "shared_limit_bytes": shared_limit}
    try:
        source = ASTSource(fn=spec.fn, signature=spec.signature(), constexprs=spec.constexprs,
                           attrs=spec.attributes())
        options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages, "maxnreg": spec.max_registers}
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                  options={k: v for k, v in options.items() if v is not None})
        registers, spills = ptxas_usage(compiled.asm["ptx"], arch)
    except Exception as exc:  # noqa: BLE001 - a compile error is this record's failure, reported
        return {**record, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                "registers": None, "spills": None, "shared_bytes": None}
    shared = int(compiled.metadata.shared)
    return {**record, "ok": shared <= shared_limit and (allow_spills or spills == 0), "registers": registers,
            "spills": spills, "shared_bytes": shared}


def ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    """``(registers, spill bytes)`` of the kernel in ``ptx``, from Triton's bundled ``ptxas -v``."""
    from triton.backends.nvidia.compiler import get_ptxas

    target = re.search(r"^\.target\s+(\S+)", ptx, re.MULTILINE).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        done = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={target}", str(path), "-o",
                               str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True, check=True)
    report = done.stdout + done.stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))
    return registers, spills


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's current default, stated: no warning
    parser = argparse.ArgumentParser(prog="python -m pd_kernels.aot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="80,90", help="comma-separated compute capabilities (80, 90)")
    parser.add_argument("--quick", action="store_true", help="one specialisation per kernel and batch kind")
    parser.add_argument("--shared-limit", type=int, default=None,
                        help="check against this many bytes of shared memory per block instead (another GPU)")
    parser.add_argument("--allow-spills", action="store_true", help="report register spills without failing")
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET=1 is set: kernels would be interpreted, not compiled; unset it")
    arches = [int(a) for a in args.arch.split(",")]
    unknown = [a for a in arches if a not in SHARED_LIMIT_BYTES]
    if unknown:
        parser.error(f"--arch {unknown}: this check knows {sorted(SHARED_LIMIT_BYTES)}")
    specs = all_specs(args.quick)
    jobs = [(args.quick, index, arch, args.shared_limit or SHARED_LIMIT_BYTES[arch], args.allow_spills)
            for index in range(len(specs)) for arch in arches if arch >= specs[index].min_arch]
    ok = True
    with ProcessPoolExecutor(args.jobs) if args.jobs > 1 else nullcontext() as pool:
        records = pool.map(_compile_job, jobs) if pool is not None else map(_compile_job, jobs)
        for record in records:
            ok &= record["ok"]
            print(json.dumps(record), flush=True)
    return 0 if ok else 1


@functools.cache
def all_specs(quick: bool) -> list[Spec]:
    return attention_specs(quick) + row_specs(quick) + moe_specs(quick) + scaled_mm_specs(quick)


def _compile_job(job: tuple) -> dict:
    """One (spec, arch) compile, named by the spec's index: a worker process builds the same list."""
    quick, index, *rest = job
    return compile_spec(all_specs(quick)[index], *rest)


if __name__ == "__main__":
    sys.exit(main())
