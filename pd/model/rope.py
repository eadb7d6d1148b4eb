"""Rotary embedding tables and MLA's softmax scale, computed exactly as HF ``transformers`` does.

Each formula keeps HF's order of float operations (``modeling_rope_utils``), so tables match its
rotary embedding bit for bit rather than to a tolerance.
"""

from __future__ import annotations

import math

import torch

from pd.model.config import RopeConfig


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (HF's ``yarn_get_mscale``); 1 when not
    extending (``factor <= 1``)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(rope: RopeConfig) -> float:
    """The scale HF's rotary embedding applies to cos and sin (its ``attention_scaling``): 1 except for YaRN,
    where it is the config's ``attention_factor`` or else derived from ``mscale`` and ``mscale_all_dim``."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


def softmax_scale(rope: RopeConfig, qk_head_dim: int) -> float:
    """``q @ k^T``'s scale for multi-head latent attention (HF's ``yarn_apply_mscale``): ``qk_head_dim ** -0.5``,
    times ``yarn_mscale(factor, mscale_all_dim)`` squared when the rope is scaled and ``mscale_all_dim`` set.

    This covers every head dim, rotary or not; the cos/sin tables carry only ``attention_factor``."""
    scale = qk_head_dim**-0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        mscale = yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


def _yarn_correction_range(rope: RopeConfig, head_dim: int) -> tuple[float, float]:
    """The dims where ``beta_fast`` and ``beta_slow`` rotations fit the original context: dims below ``low``
    keep their frequency (extrapolate), dims above ``high`` are divided by ``factor`` (interpolate)."""

    def correction_dim(num_rotations: float) -> float:
        wavelengths = rope.original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return (head_dim * math.log(wavelengths)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)


def _yarn_inverse_frequencies(rope: RopeConfig, head_dim: int, exponents: torch.Tensor) -> torch.Tensor:
    """YaRN (HF's ``_compute_yarn_parameters``): a linear ramp over the correction range blends each
    frequency from kept (extrapolated) to divided by ``factor`` (interpolated)."""
    pos_freqs = rope.theta**exponents
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope.factor * pos_freqs)
    low, high = _yarn_correction_range(rope, head_dim)
    if low == high:
        high += 0.001  # a one-dim ramp would divide by zero
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """``[head_dim / 2]`` fp32 inverse frequencies, with linear, llama3 or YaRN scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    if rope.rope_type == "yarn":
        return _yarn_inverse_frequencies(rope, head_dim, exponents)
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band
    # between them interpolated smoothly.
    low_freq_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_freq_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_cache(rope: RopeConfig, head_dim: int, max_positions: int) -> torch.Tensor:
    """``[max_positions, head_dim]`` fp32: cos in the first half, sin in the second, both times
    ``attention_factor(rope)`` (exactly 1, so a no-op, for every rope type but YaRN)."""
    inv_freq = inverse_frequencies(rope, head_dim)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    scale = attention_factor(rope)
    return torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1)
