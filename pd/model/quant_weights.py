"""8-bit weights as the engine holds them: quantize (round to nearest), dequantize, read, slice and fuse.

A ``QuantizedWeight`` is an ``[out, in]`` int8 or FP8 (e4m3) matrix and its fp32 scales, so that
``weight ~= q.float() * scale`` elementwise once the scale is broadcast:

- per output channel: ``scale [out]``;
- in blocks of ``BLOCK`` columns: ``scale [ceil(out / block_rows), ceil(in / 128)]``, one scale per
  ``block_rows x 128`` tile. A checkpoint's 128x128 blocks are read with ``block_rows`` 1 (each row its
  block's scale), so that the loader's fusions (q/k/v, gate/up) and tensor-parallel row slices need no
  alignment to 128 rows; ``compact_rows`` gives 128-row tiles back wherever the rows allow it exactly.

    in:        0 ........ 127 | 128 ....... 255 | 256 .. in-1
    out 0..127   scale[0, 0]    | scale[0, 1]     | scale[0, 2]      (block_rows 128)
    out 128..    scale[1, 0]    | ...
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pd.model.quant_scheme import BLOCK, QuantScheme, WeightFormat

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
INT8_MAX = 127
# A zero row or block gets this scale rather than zero, so that it quantizes to zeros without 0 / 0.
MIN_SCALE = 1e-12
QUANTIZED_DTYPES = {"I8": torch.int8, "F8_E4M3": FP8}


@dataclass(frozen=True)
class QuantizedWeight:
    weight: torch.Tensor  # [out, in] int8 or float8_e4m3fn
    scale: torch.Tensor  # fp32 [out], or [ceil(out / block_rows), ceil(in / 128)]
    format: WeightFormat
    block_rows: int = 1  # rows per scale in the block format

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @property
    def num_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.scale.numel() * 4


def _round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (already within the format's range) as ``dtype``, rounded to nearest, ties to even."""
    if dtype == torch.int8:
        return torch.round(x).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return x.clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def quantize(weight: torch.Tensor, weight_format: WeightFormat) -> QuantizedWeight:
    """``weight [out, in]`` in ``weight_format`` by round to nearest: absmax scales per output channel, or
    per 128x128 block (no calibration data)."""
    w = weight.float()
    if weight_format is WeightFormat.FP8_BLOCK:
        out_features, in_features = w.shape
        rows, cols = BLOCK
        padded = torch.nn.functional.pad(w, (0, -in_features % cols, 0, -out_features % rows))
        tiles = padded.view(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
        scale = tiles.abs().amax(dim=(1, 3)).div_(FP8_MAX).clamp_(min=MIN_SCALE)  # [out blocks, in blocks]
        q = _round_to(tiles / scale[:, None, :, None], FP8).view(padded.shape)[:out_features, :in_features]
        return QuantizedWeight(q.contiguous(), scale, weight_format, block_rows=rows)
    top = INT8_MAX if weight_format is WeightFormat.INT8_CHANNEL else FP8_MAX
    scale = w.abs().amax(dim=1).div_(top).clamp_(min=MIN_SCALE)  # [out]
    dtype = torch.int8 if weight_format is WeightFormat.INT8_CHANNEL else FP8
    return QuantizedWeight(_round_to(w / scale[:, None], dtype), scale, weight_format)


def expanded_scale(q: QuantizedWeight) -> torch.Tensor:
    """The scale broadcast to every element of the weight, fp32 ``[out, in]``."""
    if q.format is not WeightFormat.FP8_BLOCK:
        return q.scale[:, None].expand(q.shape)
    out_features, in_features = q.shape
    per_row = q.scale.repeat_interleave(q.block_rows, dim=0)[:out_features]
    return per_row.repeat_interleave(BLOCK[1], dim=1)[:, :in_features]


def dequantize(q: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight as ``dtype`` (computed in fp32, rounded once)."""
    return (q.weight.float() * expanded_scale(q)).to(dtype)


def per_row(q: QuantizedWeight) -> QuantizedWeight:
    """A block-format weight with one scale row per weight row (``block_rows`` 1); others as they are."""
    if q.format is not WeightFormat.FP8_BLOCK or q.block_rows == 1:
        return q
    scale = q.scale.repeat_interleave(q.block_rows, dim=0)[:q.shape[0]].contiguous()
    return QuantizedWeight(q.weight, scale, q.format, block_rows=1)


def compact_rows(q: QuantizedWeight, block_rows: int = BLOCK[0]) -> QuantizedWeight:
    """A per-row block-format weight as ``block_rows``-row tiles where every tile's rows share their
    scales exactly (a fusion of 128-aligned parts); else unchanged."""
    if q.format is not WeightFormat.FP8_BLOCK or q.block_rows != 1:
        return q
    starts = q.scale[::block_rows]
    if not torch.equal(starts.repeat_interleave(block_rows, dim=0)[:q.shape[0]], q.scale):
        return q
    return QuantizedWeight(q.weight, starts.contiguous(), q.format, block_rows=block_rows)


def fuse(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Parts of one format stacked along the output dimension (q/k/v, gate/up): channel scales
    concatenate; block scales concatenate per row, then compact where the parts were 128-row aligned."""
    if len(parts) == 1:
        return parts[0]
    formats = {p.format for p in parts}
    if len(formats) != 1:
        raise ValueError(f"fused layers must share one quantized format, got {sorted(f.value for f in formats)}")
    rows = [per_row(p) for p in parts]
    fused = QuantizedWeight(torch.cat([p.weight for p in rows]), torch.cat([p.scale for p in rows]),
                            parts[0].format, block_rows=1)
    return compact_rows(fused)


def read_quantized(checkpoint, scheme: QuantScheme, module: str, shape: tuple[int, int],
                   rows: tuple[int, int] | None, cols: tuple[int, int] | None,
                   device: torch.device) -> QuantizedWeight | torch.Tensor:
    """``module``'s weight (its ``rows`` or ``cols`` slice) and scales from ``checkpoint``.

    A block-format column slice that does not start on a 128-column boundary (a tensor-parallel split
    of a small layer) cannot keep its blocks: that slice comes back dequantized, fp32.
    """
    name, scale_name = f"{module}.weight", f"{module}.{scheme.scale_name}"
    for needed in (name, scale_name):
        if needed not in checkpoint:
            raise ValueError(f"checkpoint is missing {needed!r}, which quantization_config's scheme "
                             f"({scheme.format.value}) needs for {module!r}")
    found = checkpoint.shape(name)
    if found != shape:
        raise ValueError(f"weight {name!r} has shape {found}, config implies {shape}")
    wanted = torch.int8 if scheme.format is WeightFormat.INT8_CHANNEL else FP8
    stored = QUANTIZED_DTYPES.get(checkpoint.dtype(name))
    if stored != wanted:
        raise ValueError(f"weight {name!r} is stored as {checkpoint.dtype(name)}, but quantization_config's "
                         f"scheme ({scheme.format.value}) stores {wanted}")
    _check_zero_point(checkpoint, module)
    scale = checkpoint.read(scale_name).float()
    out_features, in_features = shape
    if scheme.format is WeightFormat.FP8_BLOCK:
        blocks = (-(-out_features // BLOCK[0]), -(-in_features // BLOCK[1]))
        if tuple(scale.shape) != blocks:
            raise ValueError(f"{scale_name!r} has shape {tuple(scale.shape)}, a {shape} weight in {list(BLOCK)} "
                             f"blocks has {blocks}")
        whole = QuantizedWeight(checkpoint.read(name, rows=rows), scale, scheme.format, BLOCK[0])
        q = per_row(whole) if rows is None else _row_slice(whole, rows)
        if cols is not None:
            if cols[0] % BLOCK[1]:
                weight = dequantize(QuantizedWeight(q.weight, q.scale, q.format, 1))
                return weight[:, cols[0]:cols[1]].contiguous().to(device)
            q = QuantizedWeight(q.weight[:, cols[0]:cols[1]],
                                q.scale[:, cols[0] // BLOCK[1]:-(-cols[1] // BLOCK[1])], q.format, 1)
    else:
        if scale.numel() == 1:  # strategy "tensor": every channel has the one scale
            scale = scale.reshape(1).expand(out_features)
        if scale.numel() != out_features:
            raise ValueError(f"{scale_name!r} has shape {tuple(scale.shape)}: a per-channel scale of a {shape} "
                             f"weight has {out_features} entries ([{out_features}, 1])")
        scale = scale.reshape(out_features)
        if rows is not None:
            scale = scale[rows[0]:rows[1]]
        q = QuantizedWeight(checkpoint.read(name, rows=rows, cols=cols), scale, scheme.format)
    return QuantizedWeight(q.weight.contiguous().to(device), q.scale.contiguous().to(device), q.format,
                           q.block_rows)


def _row_slice(whole: QuantizedWeight, rows: tuple[int, int]) -> QuantizedWeight:
    """``whole``'s weight already holds only ``rows``; its 128-row block scales become per-row ones."""
    start, stop = rows
    scale = whole.scale.repeat_interleave(BLOCK[0], dim=0)[start:stop]
    return QuantizedWeight(whole.weight, scale.contiguous(), whole.format, 1)


def _check_zero_point(checkpoint, module: str) -> None:
    """A symmetric checkpoint may store zero points anyway (older compressed-tensors): they must be zero."""
    name = f"{module}.weight_zero_point"
    if name in checkpoint and checkpoint.read(name).any():
        raise ValueError(f"{name!r} holds non-zero zero points: asymmetric weights are not supported")
