"""Dense layers, stored in whichever form the device multiplies fastest.

Two forms:

- ``onednn``: pre-packed once for oneDNN's GEMM, fp32 accumulation throughout.
  With ``few_rows`` (fp32 on CPU, where the ``cpu`` kernels run), the layer
  also keeps its weight as ``pd_kernels.cpu.pack_rows_weight``'s panels, and a
  batch of at most ``FEW_ROWS`` rows (a decode step of a small batch) runs in
  ``pd_kernels.cpu.linear_rows``, which reads them once as sequential streams.
  On the built-in model's 32 layers and LM head (24 MiB, past the caches;
  AMD EPYC, ``python -m bench.dense_rows``) oneDNN's packed GEMM took
  1.4-2.2x as long from one row to eight, on one thread or two. The cost is
  a second copy of the weights in host memory.
- ``dense``: transposed, ``[in, out]``, for a plain matmul (the default BLAS).
  One copy.

Which is faster depends on the host. On an AMD EPYC, oneDNN ran 2-3x faster
at every row count (the default BLAS takes a slow generic path there). On an
Intel Xeon, the default BLAS streamed a one-row product (a single sequence's
decode step) about 1.5x faster than oneDNN from weights past the cache, and
oneDNN was 5-10% faster from 16 rows up. So ``choose_form`` times both on the
model's fused gate/up layer when an engine starts (``linear_form: auto``), unless
the few-row kernel takes the decode steps: then it is ``onednn`` unmeasured.
Without oneDNN (GPUs) the form is ``dense``. A half-precision layer that
oneDNN cannot run natively on this CPU (fp16; bf16 without AVX-512 or
AVX-NE-CONVERT) holds fp32 weights and takes fp32's forms (``compute_dtype``).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import pd_kernels.cpu
from pd_kernels.onednn import BUCKETS_PER_OCTAVE, EXACT_ROWS, bf16_supported, padded_rows  # noqa: F401 (dense layers')
from pd_kernels.onednn import linear_pointwise as _linear_pointwise

logger = logging.getLogger(__name__)

ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed GEMM runs ``dtype`` on this host.

    bf16 needs AVX512-BW/VL/DQ or AVX-NE-CONVERT (``torch.ops.mkldnn._is_mkldnn_bf16_supported``, which honours
    ``ONEDNN_MAX_CPU_ISA``). Where it has none, ``compute_dtype`` says how a bf16 layer multiplies instead.
    """
    if device.type != "cpu" or dtype not in ONEDNN_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bf16_supported()


def compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype a layer of ``dtype`` weights multiplies in here: its own, or fp32 for a half-precision
    one that oneDNN has no native path for on this CPU (bf16 without AVX-512 or AVX-NE-CONVERT; fp16).

    Such a layer holds an fp32 copy of its weights (``make_linear``): its inputs are cast up, its outputs
    back. The other choice, a plain ``torch.matmul`` on the half-precision weight (``dense``'s layout),
    falls to ATen's scalar GEMM there: about 0.9 GFLOP/s on 2 threads of an AMD EPYC, 80x slower than
    fp32's oneDNN at 64 rows (bf16 under ``ONEDNN_MAX_CPU_ISA=AVX2``, and fp16 on AVX-512 too); on an
    ``[out, in]`` weight it is a fast GEMV at one row but 4x slower than fp32 at 64. The copy costs
    fp32's weight memory and runs at fp32's speed (``python -m bench.bf16_fallback``); the model's
    activations and its KV cache stay in ``dtype``.
    """
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and not onednn_available(device, dtype):
        return torch.float32
    return dtype


# Batches of at most this many rows run in the few-row kernel where a layer has one (see the module's doc).
FEW_ROWS = 8


@dataclass(frozen=True)
class Linear:
    """``y = x @ W^T + b`` for ``x [num_tokens, in_features]``."""

    weight: torch.Tensor  # oneDNN-packed [out, in] when ``packed``, else dense [in, out]
    bias: torch.Tensor | None  # [out]
    packed: bool
    # The few-row path: the weight's panels (pd_kernels.cpu.pack_rows_weight), the kernel that multiplies a
    # few rows by them, and the layer's output features; all or none.
    rows_weight: torch.Tensor | None = None
    rows_kernel: Callable | None = None
    out_features: int = 0
    # Set where a half-precision layer holds fp32 weights (``compute_dtype``): the inputs' dtype, which the
    # outputs are cast back to.
    output_dtype: torch.dtype | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.output_dtype is not None:
            return self._multiply(x.float()).to(self.output_dtype)
        return self._multiply(x)

    def _multiply(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows_kernel is not None and x.shape[0] <= FEW_ROWS:
            return self.rows_kernel(x, self.rows_weight, self.bias, self.out_features)
        if self.packed:
            num_rows = x.shape[0]
            bucket = padded_rows(num_rows)
            if bucket != num_rows:
                padded = x.new_zeros(bucket, x.shape[1])
                padded[:num_rows] = x
                return _linear_pointwise(padded, self.weight, self.bias, "none", [], "")[:num_rows]
            return _linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return torch.matmul(x, self.weight) if self.bias is None else torch.addmm(self.bias, x, self.weight)


FORMS = ("onednn", "dense")


def few_rows_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``pd_kernels.cpu.linear_rows`` runs this device and dtype (it is built by the ``cpu`` backend)."""
    return device.type == "cpu" and dtype == torch.float32


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, form: str = "onednn",
                few_rows: bool = False) -> Linear:
    """Build from an HF-layout ``[out, in]`` weight already on its device and dtype.

    ``form`` is ``"onednn"`` (where oneDNN runs this device and dtype; else dense) or ``"dense"``.
    ``few_rows``: an ``onednn`` layer keeps ``weight``'s panels for batches of up to ``FEW_ROWS`` rows
    too, where ``few_rows_available``; the caller has built ``pd_kernels.cpu``. A half-precision weight with
    no native GEMM here is held in fp32 (``compute_dtype``).
    """
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    work = compute_dtype(weight.device, weight.dtype)
    if work != weight.dtype:
        output_dtype = weight.dtype
        layer = make_linear(weight.to(work), None if bias is None else bias.to(work), form, few_rows)
        return dataclasses.replace(layer, output_dtype=output_dtype)
    if form == "onednn" and onednn_available(weight.device, weight.dtype):
        weight = weight.contiguous()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        if few_rows and few_rows_available(weight.device, weight.dtype):
            bias = None if bias is None else bias.contiguous()
            return Linear(packed, bias, packed=True, rows_weight=pd_kernels.cpu.pack_rows_weight(weight),
                          rows_kernel=pd_kernels.cpu.build().linear_rows, out_features=weight.shape[0])
        return Linear(packed, bias, packed=True)
    return Linear(weight.t().contiguous(), bias, packed=False)


# The row counts choose_form times: a single sequence's decode step, and a prefill chunk's.
PROBE_ROWS = (1, 256)
# dense is kept only if it is faster at one row and at most this much slower at many (AMD: 2-3x slower).
DENSE_MAX_SLOWDOWN = 1.5
# The probe cycles through copies of the layer adding up to this many bytes, past the caches, as a
# forward pass reads its weights; one copy is capped at that size.
PROBE_BYTES = 64 * 1024**2
# Below this many elements (4 MiB of fp32) a layer stays in cache and either form takes microseconds: oneDNN,
# unmeasured, so that small models run the same arithmetic on every host and every start.
PROBE_MIN_ELEMENTS = 1024**2


@dataclass(frozen=True)
class FormChoice:
    form: str
    # Each probed row count's time with ``dense`` over its time with ``onednn`` (empty when not measured).
    dense_over_onednn: dict[int, float]


def time_forms(out_features: int, in_features: int, dtype: torch.dtype, repeats: int = 5) -> dict[int, float]:
    """Per ``PROBE_ROWS`` count: the median time of ``dense`` layers over ``onednn`` ones, on this host now."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    out_features = max(1, min(out_features, PROBE_BYTES // itemsize // max(1, in_features)))
    copies = max(1, -(-PROBE_BYTES // (out_features * in_features * itemsize)))
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(out_features, in_features, generator=generator).to(dtype) for _ in range(copies)]
    layers = {form: [make_linear(weight, None, form) for weight in weights] for form in FORMS}
    del weights
    ratios = {}
    for rows in PROBE_ROWS:
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        medians = {}
        for form, stack in layers.items():
            stack[0](x)  # oneDNN builds its kernel for the shape
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                for layer in stack:
                    layer(x)
                times.append(time.perf_counter() - started)
            medians[form] = statistics.median(times)
        ratios[rows] = medians["dense"] / medians["onednn"]
    return ratios


def choose_form(requested: str, device: torch.device, dtype: torch.dtype, out_features: int,
                in_features: int, few_rows: bool = False) -> FormChoice:
    """The form an engine's dense layers take: ``requested``, or for ``"auto"`` the faster here.

    ``dense`` is chosen when it is faster at one row and within ``DENSE_MAX_SLOWDOWN`` of oneDNN at
    256; oneDNN otherwise, for a layer under ``PROBE_MIN_ELEMENTS``, where ``few_rows`` (the
    few-row kernel, which only the ``onednn`` form uses, takes the decode steps that ``dense`` won),
    and for bf16: no BLAS has a bf16 GEMM, so ``dense`` is oneDNN unpacked, and on SmolLM2's layers
    it took 1.9x as long at one row (``bench.bf16_fallback``'s ``matmul`` on AVX-512), where the
    probe had picked it in a contended start. The shape given is the model's fused gate/up layer as
    this rank holds it.
    """
    dtype = compute_dtype(device, dtype)
    if not onednn_available(device, dtype):
        return FormChoice("dense", {})
    if requested != "auto":
        return FormChoice(requested, {})
    if (out_features * in_features < PROBE_MIN_ELEMENTS or (few_rows and few_rows_available(device, dtype))
            or dtype == torch.bfloat16):
        return FormChoice("onednn", {})
    ratios = time_forms(out_features, in_features, dtype)
    dense = ratios[PROBE_ROWS[0]] < 1.0 and ratios[PROBE_ROWS[-1]] <= DENSE_MAX_SLOWDOWN
    return FormChoice("dense" if dense else "onednn", {rows: round(r, 3) for rows, r in ratios.items()})
