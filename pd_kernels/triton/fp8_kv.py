"""FP8 KV pages in the Triton kernels: read with the hardware's conversion where there is one, else
(and always written) with integer arithmetic.

``pd_kernels.fp8`` defines what a stored element means. The kernels see an FP8
pool as bytes (a ``uint8`` view).

Read on sm_89 and later (``FP8_HW``, chosen by the host from the device): the
bytes are bitcast to Triton's float8 type and cast to q's dtype, which lowers
to ``cvt.rn.f16x2.e4m3x2`` (``e5m2x2``): one instruction converts two codes,
exactly, NaN codes to NaN. The pages then read as their values (``read_scale``
1). The integer decode below costs about eight integer operations a code,
which at HBM speed left the FP8 decode kernel bound by its ALUs (0.49x the
bf16 pages' time on an H200, reading half the bytes). The same conversion as
inline assembly, four codes a word, measured slower (1.09x against 1.29x at
batch 64 x 4,096): it kept the operand's shared-memory round trip in fp16.

Everywhere else (the interpreter, sm_80) the kernels convert in registers
themselves rather than through Triton's float8 casts, for three reasons:

- the interpreter's float8 casts are not torch's: fp32 -> fp8 rounds half
  up instead of to even and never saturates, and it reads the NaN codes as
  numbers (e4m3fn 0x7F as 480), so tests on CPU would check another format;
- sm_80 has no float8e4nv type in Triton at all ("not supported in this
  architecture"): A100s could not read e4m3 pages;
- bit for bit the same codes on every device, by construction.

Read: a code becomes fp16 exactly, then q's dtype (exact again: fp16, bf16
and fp32 all hold every FP8 value).

    e5m2   S.EEEEE.MM   -> fp16 bits S.EEEEE.MM00000000: the same value (inf and NaN too)
    e4m3fn S.EEEE.MMM   -> fp16 bits S.0EEEE.MMM0000000: the value / 2^8 (bias 15 against 7;
                           e4m3 subnormals land on fp16 subnormals, still exact); S.1111.111 -> NaN

so an e4m3 page reads as ``value / 256``: ``read_scale`` folds the 256 into
the KV scale, which the attention kernel folds into the softmax scale (K)
and the output (V).

Store: ``quantize`` is c10's float -> float8 conversion (round to nearest
even, subnormals by one fp32 add of a magic number), after ``x / scale`` in
IEEE division (``div_rn``; a GPU's ``/`` is approximate) and a saturation on
the magnitude's bits that leaves NaN alone (``tl.minimum`` on floats may not).
A NaN stores a NaN code; its sign is the division's, which on a GPU is the
canonical positive NaN whatever the input's.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# KV_FORMAT, the kernels' constexpr for the pool's element type.
KV_NATIVE = tl.constexpr(0)  # the activations' dtype: loaded as is
KV_E4M3 = tl.constexpr(1)
KV_E5M2 = tl.constexpr(2)

_FORMATS = {torch.float8_e4m3fn: KV_E4M3.value, torch.float8_e5m2: KV_E5M2.value}


def kv_format(dtype: torch.dtype) -> int:
    """The ``KV_FORMAT`` constexpr of a pool of ``dtype``."""
    return _FORMATS.get(dtype, KV_NATIVE.value)


def kv_pages(cache: torch.Tensor) -> torch.Tensor:
    """What a kernel is given for a pool: FP8 pages as a ``uint8`` view (same strides), others as they are."""
    return cache.view(torch.uint8) if cache.dtype in _FORMATS else cache


def read_scale(dtype: torch.dtype, scale: float, hardware: bool = False) -> float:
    """The factor a kernel multiplies what ``dequantize`` returns by: ``scale``, times 256 for e4m3fn read
    with integers (``hardware`` False)."""
    return scale * 256.0 if dtype == torch.float8_e4m3fn and not hardware else scale


# The first compute capability whose FP8 conversions Triton lowers to hardware instructions (Ada, Hopper).
FP8_HW_CAPABILITY = (8, 9)


@functools.cache
def hardware_fp8(device: torch.device) -> bool:
    """Whether kernels on ``device`` read FP8 pages with the hardware's conversion (``FP8_HW``): compiled
    for a CUDA device of compute capability 8.9 or later; never under the interpreter, whose float8 casts
    are not torch's (module doc)."""
    from pd_kernels.triton.launch import is_interpreted

    if device.type != "cuda" or is_interpreted(device):
        return False
    return torch.cuda.get_device_capability(device) >= FP8_HW_CAPABILITY


@triton.jit
def dequantize(codes, dtype: tl.constexpr, KV_FORMAT: tl.constexpr, FP8_HW: tl.constexpr):
    """FP8 ``codes`` (uint8) as ``dtype``: with ``FP8_HW`` their values, by the hardware's conversion; else
    e5m2 exact and e4m3fn its value / 256, with integers (see the module doc)."""
    if FP8_HW:
        if KV_FORMAT == KV_E4M3:
            return codes.to(tl.float8e4nv, bitcast=True).to(dtype)
        return codes.to(tl.float8e5, bitcast=True).to(dtype)
    bits = codes.to(tl.int32)
    if KV_FORMAT == KV_E4M3:
        half = ((bits & 0x7F) << 7) | ((bits & 0x80) << 8)
        half = tl.where((bits & 0x7F) == 0x7F, 0x7E00, half)  # the NaN code -> fp16 NaN
    else:
        half = bits << 8
    return half.to(tl.uint16).to(tl.float16, bitcast=True).to(dtype)


@triton.jit
def quantize(x, scale, KV_FORMAT: tl.constexpr):
    """The FP8 codes (uint8) of ``x / scale``: saturated, rounded to nearest even, NaN kept (``pd_kernels.fp8``)."""
    if KV_FORMAT == KV_E4M3:
        max_bits: tl.constexpr = 0x43E00000  # 448.0
        min_normal: tl.constexpr = 121 << 23  # 2^-6
        magic: tl.constexpr = 141 << 23  # 2^14: its ulp is e4m3's subnormal step, 2^-9
        rebias: tl.constexpr = (7 - 127) << 23
        shift: tl.constexpr = 20  # fp32's 23 mantissa bits to 3
    else:
        max_bits: tl.constexpr = 0x47600000  # 57344.0
        min_normal: tl.constexpr = 113 << 23  # 2^-14
        magic: tl.constexpr = 134 << 23  # 2^7: its ulp is 2^-16
        rebias: tl.constexpr = (15 - 127) << 23
        shift: tl.constexpr = 21
    bits = tl.div_rn(x.to(tl.float32), scale).to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    is_nan = magnitude > 0x7F800000
    magnitude = tl.minimum(magnitude, max_bits)  # saturate: an integer min, in the order of the floats
    # Normal: rebias the exponent and round the mantissa, ties to even; a carry moves into the exponent.
    normal = (magnitude + (rebias + (1 << (shift - 1)) - 1) + ((magnitude >> shift) & 1)) >> shift
    # Subnormal: the fp32 add rounds to the magic number's ulp; its low bits are then the code.
    magic_value = tl.full(magnitude.shape, magic, tl.int32).to(tl.float32, bitcast=True)
    subnormal = (magnitude.to(tl.float32, bitcast=True) + magic_value).to(tl.int32, bitcast=True) - magic
    code = tl.where(magnitude < min_normal, subnormal, normal)
    return (tl.where(is_nan, 0x7F, code) | sign).to(tl.uint8)
