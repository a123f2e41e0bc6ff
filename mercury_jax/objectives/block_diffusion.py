"""Block diffusion (BD3-LM): masked diffusion within blocks, autoregressive across them.

Arriola et al. 2025, "Block Diffusion: Interpolating Between Autoregressive and Diffusion Language Models" (arXiv
2503.09573). The sequence ``x`` of length ``n`` is cut into ``B = n / L'`` blocks ``x^1 .. x^B`` of ``L'`` tokens;
the likelihood factorises over blocks, ``log p(x) = Σ_b log p(x^b | x^{<b})``, and each block is a masked
diffusion chain conditioned on the clean blocks before it. The negative ELBO (their eq. for the block NELBO, with
MDLM's continuous-time bound per block) is

    -ELBO(x) = Σ_b ∫_0^1  -alpha'_t / (1 - alpha_t)  ·  E_{x_t^b ~ q(.|x^b)} [ Σ_{n: x_t^{b,n} = m}
                   -log p_θ(x^{b,n} | x_t^b, x^{<b}) ] dt.

Vectorised training (their Sec. 3.2): one forward pass over ``x_t ⊕ x_0`` (length ``2n``, both halves at the
positions ``0 .. n-1``) under the ``block_diffusion`` attention mask (:mod:`mercury_jax.kernels.masks`): a noisy
block sees itself and the clean blocks before it, a clean block sees the clean blocks up to itself. The logits of
the noisy half are exactly those of ``B`` separate passes over ``x_t^b`` with a key-value cache of ``x^{<b}``.

Token kinds are ``mercury_jax.kinds``: only ``TARGET`` positions are noised and scored; ``FIXED`` ones (an SFT
prompt) are clean context in both halves; ``PAD`` is segment 0 and never attended to.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from mercury_jax import kinds as K
from mercury_jax.config import ObjectiveConfig
from mercury_jax.objectives import masked_diffusion
from mercury_jax.objectives.nll import token_nll


def noise(
  key: jax.Array, x: jax.Array, kinds: jax.Array, mask_id: int, cfg: ObjectiveConfig, *, training: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Draws one t per (sequence, block) and ``x_t ~ q(x_t | x)`` block by block.

  Every block gets its own t: each block is its own diffusion chain conditioned on the clean blocks before it, as
  at inference, where every block is denoised from t = 1; and ``batch × blocks`` independent draws instead of
  ``batch`` lower the variance of the estimate. The draws are stratified over the whole ``batch × blocks`` grid,
  with the strata dealt at random (``masked_diffusion.sample_t``), so t is not correlated with a block's index.

  Args:
    key: PRNG key for t and the mask.
    x: clean tokens, [batch, length] int32; ``length`` a multiple of ``cfg.block_size``.
    kinds: token kinds, [batch, length].
    mask_id: the ``[MASK]`` token id.
    cfg: the objective config (``block_size``, the schedule and its training clip).
    training: draw t from the clipped schedule (``masked_diffusion.t_range``).

  Returns:
    ``(x_t, is_masked, t)``: the noised tokens and where they are masked, [batch, length], and t, [batch, blocks].
  """
  batch, length = x.shape
  block = cfg.block_size
  if block < 1 or length % block:
    raise ValueError(f"sequence length {length} must be a multiple of objective.block_size={block} (>= 1)")
  t_key, mask_key = jax.random.split(key)
  t = masked_diffusion.sample_t(t_key, (batch, length // block), cfg, training=training)  # [batch, blocks]
  t_tokens = jnp.repeat(t, block, axis=1)  # [batch, length]
  x_t, is_masked = masked_diffusion.mask_tokens(mask_key, x, kinds, t_tokens, mask_id, cfg)
  return x_t, is_masked, t


def loss(
  logits_fn: Callable[..., jax.Array],
  x: jax.Array,
  kinds: jax.Array,
  key: jax.Array,
  mask_id: int,
  cfg: ObjectiveConfig,
  *,
  segment_ids: jax.Array | None = None,
  training: bool = False,
) -> dict[str, jax.Array]:
  """One-sample Monte Carlo estimate of the block negative ELBO (module docstring) for a batch, in one pass.

  Args:
    logits_fn: ``(tokens, t, **overrides) -> logits`` (``mercury_jax.objectives.LogitsFn``); called once with
      ``t=None`` and the overrides ``segment_ids``, ``positions``, ``mask="block_diffusion"`` and
      ``diffusion_block`` for the ``2 * length`` tokens ``x_t ⊕ x``.
    x: clean tokens, [batch, length] int32.
    kinds: token kinds, [batch, length].
    key: PRNG key for t and the mask.
    mask_id: the ``[MASK]`` token id.
    cfg: the objective config (``block_size``, schedule, antithetic t, t_min, the training clip).
    segment_ids: [batch, length] attention segments (0 is padding); default ``kinds.segment_ids(kinds)``.
    training: draw t from the clipped schedule; evaluation leaves it False so the estimate stays a bound.

  Returns:
    ``{"loss_sum": Σ weighted NLL over the batch, "tokens": number of target tokens, "masked": number masked}``,
    as ``masked_diffusion.loss``: ``loss_sum / tokens`` is the block negative ELBO in nats per target token.
  """
  batch, length = x.shape
  block = cfg.block_size
  x_t, is_masked, t = noise(key, x, kinds, mask_id, cfg, training=training)
  segment_ids = K.segment_ids(kinds) if segment_ids is None else segment_ids
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  logits = logits_fn(
    jnp.concatenate([x_t, x], axis=1),  # [batch, 2 * length]: x_t ⊕ x_0
    None,
    segment_ids=jnp.concatenate([segment_ids, segment_ids], axis=1),
    positions=jnp.concatenate([positions, positions], axis=1),
    mask="block_diffusion",
    diffusion_block=block,
    logits_length=length,  # [batch, length, vocab]: only the noisy half scores (the masked tokens)
  )
  nll = token_nll(masked_diffusion.without_mask_class(logits, mask_id), x)  # [batch, length]
  nll = jnp.where(is_masked, nll, 0.0).reshape(batch, length // block, block)  # [batch, blocks, block]
  per_block = masked_diffusion.elbo_weight(t, cfg) * nll.sum(axis=-1)  # [batch, blocks]
  return {
    "loss_sum": per_block.sum(),
    "tokens": (kinds == K.TARGET).sum().astype(jnp.float32),
    "masked": is_masked.sum().astype(jnp.float32),
  }
