"""Rotary position embeddings (Su et al. 2021) and the scalings public long-context checkpoints use.

:func:`frequencies` gives the inverse frequencies of the ``head_dim / 2`` rotated pairs and a scale applied to both
``cos`` and ``sin``; :func:`rotary` rotates queries or keys with them. The variants follow the published formulas,
with the parameter names of Hugging Face's ``rope_scaling`` (which the converter reads):

* ``linear`` — position interpolation (Chen et al. 2023, arXiv 2306.15595): every frequency divided by ``factor``.
* ``ntk`` — NTK-aware scaling (bloc97, 2023; Peng et al. 2023 Sec. 3.1): the base becomes
  ``theta * factor ** (d / (d - 2))``, so the lowest frequency is interpolated and the highest kept.
* ``yarn`` — YaRN (Peng et al. 2023, arXiv 2309.00071, Sec. 3.2-3.4): "NTK-by-parts" interpolation between the
  original and the interpolated frequency by wavelength, ramped between ``beta_fast`` and ``beta_slow`` rotations over
  the original context, and the attention temperature ``0.1 ln(factor) + 1`` folded into ``cos`` and ``sin``.
* ``llama3`` — Llama 3.1's by-parts rule (wavelengths above ``original / low_freq_factor`` interpolated, below
  ``original / high_freq_factor`` kept, a linear blend between).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from mercury_jax.config import ModelConfig


def _original_length(cfg: ModelConfig) -> int:
  return cfg.rope_original_length or max(1, int(cfg.max_length / cfg.rope_factor))


def frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
  """``(inverse frequencies [head_dim // 2] float64, cos/sin scale)`` of ``cfg``'s rotary embedding."""
  half = cfg.head_dim // 2
  base = cfg.rope_theta
  exponents = np.arange(half, dtype=np.float64) / half  # 2i / d
  factor = cfg.rope_factor
  if cfg.rope_scaling == "ntk":
    base = base * factor ** (cfg.head_dim / (cfg.head_dim - 2))
  inv_freq = base**-exponents
  if cfg.rope_scaling in ("none", "ntk"):
    return inv_freq, 1.0
  if cfg.rope_scaling == "linear":
    return inv_freq / factor, 1.0
  original = _original_length(cfg)
  if cfg.rope_scaling == "yarn":
    # The pair index whose wavelength makes `rotations` turns over the original context (YaRN Eq. 17).
    def pair(rotations: float) -> float:
      return (cfg.head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(cfg.rope_theta))

    low = max(math.floor(pair(cfg.rope_beta_fast)), 0)
    high = min(math.ceil(pair(cfg.rope_beta_slow)), cfg.head_dim - 1)  # bounded by head_dim - 1, as in the reference
    high = high + 0.001 if low == high else high  # avoids a division by zero in the ramp
    ramp = np.clip((np.arange(half, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
    inv_freq = (inv_freq / factor) * (1.0 - keep) + inv_freq * keep
    scale = cfg.rope_attention_factor or 0.1 * math.log(factor) + 1.0
    return inv_freq, scale
  # llama3
  low_wavelength = original / cfg.rope_low_freq_factor
  high_wavelength = original / cfg.rope_high_freq_factor
  wavelength = 2 * math.pi / inv_freq
  smooth = (original / wavelength - cfg.rope_low_freq_factor) / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
  blended = (1.0 - smooth) * inv_freq / factor + smooth * inv_freq
  inv_freq = np.where(wavelength > low_wavelength, inv_freq / factor, inv_freq)
  between = (wavelength <= low_wavelength) & (wavelength >= high_wavelength)
  return np.where(between, blended, inv_freq), 1.0


def rotary(x: jax.Array, positions: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Rotates ``x`` [batch, length, heads, head_dim] by ``positions`` [batch, length] (half-split pairs, as in
  GPT-NeoX and Hugging Face's ``rotate_half``)."""
  if cfg.rope_scaling == "none":  # In float32 as ever, so unscaled models keep their exact outputs.
    half = x.shape[-1] // 2
    inv_freq, scale = cfg.rope_theta ** (-jnp.arange(half, dtype=jnp.float32) / half), 1.0
  else:
    inv_freq, scale = frequencies(cfg)
    inv_freq = jnp.asarray(inv_freq, jnp.float32)
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [batch, length, half]
  sin, cos = (scale * jnp.sin(angles))[:, :, None, :], (scale * jnp.cos(angles))[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
