"""FP8 scaled matrix product: ``C = (A @ B^T) * scales``, accumulated in fp32, one rounding to C's dtype.

Two scalings (``A [M, K]`` and ``B [N, K]`` float8_e4m3fn, row-major):

- per token x per channel: ``a_scale [M]``, ``b_scale [N]``; ``C = (A @ B^T) * a_scale[:, None] * b_scale[None, :]``,
  applied once after the K loop (W8A8 FP8, compressed-tensors' ``FP8_DYNAMIC``).
- blocks: ``a_scale [M, ceil(K/128)]`` (a token's 128-column groups), ``b_scale [ceil(N/scale_rows),
  ceil(K/128)]`` (``scale_rows`` 128: DeepSeek-V3's 128x128 blocks; 1: a scale row per weight row, as the
  engine holds fused layers). Each 128-column group's partial product is scaled as it is added, so
  ``BLOCK_K`` divides 128.

Program ``(m, n)`` computes one ``BLOCK_M x BLOCK_N`` tile of C. ``scaled_mm_reference`` is the torch
reference with the same signature; ``quantize_fp8_rows`` makes A and its scales from activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pd_kernels.triton.launch import check_launchable, is_interpreted

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
GROUP_K = 128  # the K group of block scales
MIN_SCALE = 1e-12
OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class MmTiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# A decode step's few rows, and a prefill chunk's many. BLOCK_K 128 is one scale group per iteration. On sm_90
# (the pd_kernels.aot specialisations, fp16/bf16 out): none spills; block scales at 128x128 spilled 128 bytes
# (255 registers: the scaled partial product is a second 128x128 fp32 tile), so they take 128x64.
DECODE_TILES = MmTiles(16, 64, 128, 4, 4)
PREFILL_TILES = MmTiles(128, 128, 128, 8, 3)
BLOCK_PREFILL_TILES = MmTiles(128, 64, 128, 8, 3)
INTERPRETED_TILES = MmTiles(16, 32, 64, 1, 1)
DECODE_MAX_ROWS = 64


def mm_tiles(num_rows: int, device: torch.device, block_scaled: bool) -> MmTiles:
    if is_interpreted(device):
        return INTERPRETED_TILES
    if num_rows <= DECODE_MAX_ROWS:
        return DECODE_TILES
    return BLOCK_PREFILL_TILES if block_scaled else PREFILL_TILES


@triton.jit
def _scaled_mm_kernel(
    a_ptr,  # [M, K] fp8, row-major
    b_ptr,  # [N, K] fp8, row-major
    a_scale_ptr,  # fp32 [M] or [M, ceil(K / GROUP_K)]
    b_scale_ptr,  # fp32 [N] or [ceil(N / SCALE_ROWS), ceil(K / GROUP_K)]
    bias_ptr,  # [N] of C's dtype (unused without HAS_BIAS)
    c_ptr,  # [M, N], row-major
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_as,  # a_scale's row stride (block scales)
    stride_bs,  # b_scale's row stride (block scales)
    HAS_BIAS: tl.constexpr,
    BLOCK_SCALED: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < N
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :]
    b_ptrs = b_ptr + cols.to(tl.int64)[None, :] * stride_bn + ks[:, None]  # [BLOCK_K, BLOCK_N]: B^T's tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = ks + k0 < K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if BLOCK_SCALED:
            group = k0 // GROUP
            sa = tl.load(a_scale_ptr + rows * stride_as + group, mask=row_mask, other=0.0)
            sb = tl.load(b_scale_ptr + (cols // SCALE_ROWS) * stride_bs + group, mask=col_mask, other=0.0)
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not BLOCK_SCALED:
        sa = tl.load(a_scale_ptr + rows, mask=row_mask, other=0.0)
        sb = tl.load(b_scale_ptr + cols, mask=col_mask, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _fail(name: str, message: str) -> None:
    raise ValueError(f"{name}: {message}")


def check_scaled_mm_args(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                         scale_rows: int | None, bias: torch.Tensor | None, out_dtype: torch.dtype) -> bool:
    """Shapes, dtypes and strides as the module's doc states them; True for block scales."""
    for name, t in (("a", a), ("b", b)):
        if t.dim() != 2 or t.dtype != FP8:
            _fail(name, f"expected a 2-D {FP8} tensor, got {t.dtype} {tuple(t.shape)}")
        if t.stride(1) != 1:
            _fail(name, f"its last dimension must be contiguous, strides {t.stride()}")
    (m, k), (n, k_b) = a.shape, b.shape
    if k != k_b:
        _fail("b", f"in_features {k_b} differs from a's {k}")
    if out_dtype not in OUT_DTYPES:
        _fail("out_dtype", f"{out_dtype} is not one of {OUT_DTYPES}")
    for name, t in (("a_scale", a_scale), ("b_scale", b_scale)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            _fail(name, f"expected a contiguous fp32 tensor, got {t.dtype} strides {t.stride()}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        _fail("bias", f"expected a contiguous [{n}] tensor, got {tuple(bias.shape)}")
    for name, t in (("b", b), ("a_scale", a_scale), ("b_scale", b_scale), ("bias", bias)):
        if t is not None and t.device != a.device:
            _fail(name, f"on {t.device}, a on {a.device}")
    groups = -(-k // GROUP_K)
    if scale_rows is None:
        if a_scale.shape != (m,) or b_scale.shape != (n,):
            _fail("a_scale", f"per-token and per-channel scales are [{m}] and [{n}], got {tuple(a_scale.shape)} "
                             f"and {tuple(b_scale.shape)}")
        return False
    if scale_rows not in (1, GROUP_K):
        _fail("scale_rows", f"must be 1 or {GROUP_K}, got {scale_rows}")
    if a_scale.shape != (m, groups):
        _fail("a_scale", f"block scales of a [{m}, {k}] are [{m}, {groups}], got {tuple(a_scale.shape)}")
    if b_scale.shape != (-(-n // scale_rows), groups):
        _fail("b_scale", f"block scales of b [{n}, {k}] with {scale_rows} rows a scale are "
                         f"[{-(-n // scale_rows)}, {groups}], got {tuple(b_scale.shape)}")
    return True


def scaled_mm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
              scale_rows: int | None = None, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``C [M, N]`` of ``out_dtype`` (see the module's doc); ``scale_rows`` None: per-token x per-channel."""
    block_scaled = check_scaled_mm_args(a, b, a_scale, b_scale, scale_rows, bias, out_dtype)
    check_launchable(a.device)
    (m, k), n = a.shape, b.shape[0]
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    tiles = mm_tiles(m, a.device, block_scaled)
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))
    _scaled_mm_kernel[grid](
        a, b, a_scale, b_scale, bias if bias is not None else c, c, m, n, k,
        a.stride(0), b.stride(0), c.stride(0),
        a_scale.stride(0) if block_scaled else 0, b_scale.stride(0) if block_scaled else 0,
        HAS_BIAS=bias is not None, BLOCK_SCALED=block_scaled, SCALE_ROWS=scale_rows or 1, GROUP=GROUP_K,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return c


def scaled_mm_reference(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                        scale_rows: int | None = None, bias: torch.Tensor | None = None,
                        out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The same product in fp32 from dequantized operands."""
    block_scaled = check_scaled_mm_args(a, b, a_scale, b_scale, scale_rows, bias, out_dtype)
    k, n = a.shape[1], b.shape[0]
    if block_scaled:
        a_full = a.float() * a_scale.repeat_interleave(GROUP_K, dim=1)[:, :k]
        b_rows = b_scale.repeat_interleave(scale_rows, dim=0)[:n]
        b_full = b.float() * b_rows.repeat_interleave(GROUP_K, dim=1)[:, :k]
        out = a_full @ b_full.t()
    else:
        out = (a.float() @ b.float().t()) * a_scale[:, None] * b_scale[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def quantize_fp8_rows(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` as e4m3 with dynamic absmax scales: per row (``[M]``), or per row and ``group``
    columns (``[M, ceil(K / group)]``), each scale ``absmax / 448``."""
    x = x.float()
    m, k = x.shape
    if group is None:
        scale = x.abs().amax(dim=1).div_(FP8_MAX).clamp_(min=MIN_SCALE)
        return (x / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale
    padded = torch.nn.functional.pad(x, (0, -k % group)).view(m, -1, group)
    scale = padded.abs().amax(dim=2).div_(FP8_MAX).clamp_(min=MIN_SCALE)
    q = (padded / scale[:, :, None]).clamp_(-FP8_MAX, FP8_MAX).view(m, -1)[:, :k].to(FP8)
    return q, scale
