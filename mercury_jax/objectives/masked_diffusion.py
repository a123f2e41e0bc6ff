"""Absorbing-state (masked) discrete diffusion: schedules, the forward process and the continuous-time ELBO.

Notation follows MD4 (Shi et al. 2024, "Simplified and Generalized Masked Diffusion for Discrete Data") and MDLM
(Sahoo et al. 2024): ``alpha_t`` is the probability that a token is still clean at time t in [0, 1]
(``alpha_0 = 1``, ``alpha_1 = 0``), ``z_t`` the partially masked sequence. The negative ELBO is (MD4 eq. 5)

    -ELBO(x) = ∫_0^1  -alpha'_t / (1 - alpha_t)  ·  E_{z_t ~ q(z_t|x)} [ Σ_{n: z_t^n = m} -log p_θ(x^n | z_t) ] dt,

estimated with one t per sequence. Everything here is a plain function over ``denoise_fn(z_t, t) -> logits``;
the network knows nothing of this.

Token kinds are ``mercury_jax.kinds``: only ``TARGET`` positions are noised and scored; ``FIXED`` ones (an SFT
prompt) are clean context and ``PAD`` is never attended to.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from mercury_jax import kinds as K
from mercury_jax.config import ObjectiveConfig
from mercury_jax.objectives.nll import token_nll

DenoiseFn = Callable[[jax.Array, jax.Array], jax.Array]  # (z_t [batch, length], t [batch]) -> logits [b, l, vocab]


# ---------------------------------------------------------------------------------------------- schedules


def alpha(t: jax.Array, cfg: ObjectiveConfig) -> jax.Array:
  """Probability that a token is unmasked at time ``t``."""
  if cfg.schedule == "linear":
    return 1.0 - t
  if cfg.schedule == "cosine":
    return 1.0 - jnp.cos(0.5 * jnp.pi * (1.0 - t))
  if cfg.schedule == "polynomial":
    return 1.0 - t**cfg.exponent
  raise ValueError(f"objective.schedule={cfg.schedule!r} must be one of linear, cosine, polynomial")


def dalpha(t: jax.Array, cfg: ObjectiveConfig) -> jax.Array:
  """Time derivative ``alpha'_t`` of the schedule."""
  if cfg.schedule == "linear":
    return -jnp.ones_like(t)
  if cfg.schedule == "cosine":
    return -0.5 * jnp.pi * jnp.sin(0.5 * jnp.pi * (1.0 - t))
  if cfg.schedule == "polynomial":
    return -cfg.exponent * t ** (cfg.exponent - 1.0)
  raise ValueError(f"objective.schedule={cfg.schedule!r} must be one of linear, cosine, polynomial")


def elbo_weight(t: jax.Array, cfg: ObjectiveConfig) -> jax.Array:
  """The ELBO weight ``-alpha'_t / (1 - alpha_t)``, written in closed form for numerical stability."""
  if cfg.schedule == "linear":
    return 1.0 / t
  if cfg.schedule == "cosine":
    return 0.5 * jnp.pi * jnp.tan(0.5 * jnp.pi * (1.0 - t))
  if cfg.schedule == "polynomial":
    return cfg.exponent / t
  raise ValueError(f"objective.schedule={cfg.schedule!r} must be one of linear, cosine, polynomial")


def sample_t(key: jax.Array, batch: int, cfg: ObjectiveConfig) -> jax.Array:
  """Draws t in [t_min, 1] for a batch; antithetic (stratified) when ``cfg.antithetic``.

  The stratified draw ``u_i = (u + i / batch) mod 1`` puts exactly one t in each of ``batch`` equal strata, which
  lowers the variance of the ELBO estimate (Kingma et al. 2021, VDM, appendix on low-discrepancy sampling).
  """
  if cfg.antithetic:
    u = jnp.mod(jax.random.uniform(key, ()) + jnp.arange(batch) / batch, 1.0)
  else:
    u = jax.random.uniform(key, (batch,))
  return cfg.t_min + (1.0 - cfg.t_min) * u


# ------------------------------------------------------------------------------------------ forward process


def mask_tokens(
  key: jax.Array, x: jax.Array, kinds: jax.Array, t: jax.Array, mask_id: int, cfg: ObjectiveConfig
) -> tuple[jax.Array, jax.Array]:
  """Draws ``z_t ~ q(z_t | x)``: each target token is replaced by ``mask_id`` with probability ``1 - alpha_t``.

  Returns ``(z_t, is_masked)``; prompt and padding tokens are never masked.
  """
  keep_prob = alpha(t, cfg)[:, None]  # [batch, 1]
  is_masked = (jax.random.uniform(key, x.shape) >= keep_prob) & (kinds == K.TARGET)
  return jnp.where(is_masked, mask_id, x), is_masked


def without_mask_class(logits: jax.Array, mask_id: int) -> jax.Array:
  """Float32 logits with the mask class removed (MDLM's zero-masking parameterisation): clean tokens only."""
  vocab = jnp.arange(logits.shape[-1])
  return jnp.where(vocab == mask_id, -jnp.inf, logits.astype(jnp.float32))


def masked_log_probs(logits: jax.Array, mask_id: int) -> jax.Array:
  """Log-probabilities of the clean token with the mask class removed."""
  return jax.nn.log_softmax(without_mask_class(logits, mask_id), axis=-1)


# --------------------------------------------------------------------------------------------------- losses


def loss(
  denoise_fn: DenoiseFn, x: jax.Array, kinds: jax.Array, key: jax.Array, mask_id: int, cfg: ObjectiveConfig
) -> dict[str, jax.Array]:
  """One-sample Monte Carlo estimate of the negative ELBO (MD4 eq. 5) for a batch.

  Args:
    denoise_fn: ``(z_t, t) -> logits``.
    x: clean tokens, [batch, length] int32.
    kinds: token kinds (``mercury_jax.kinds``), [batch, length].
    key: PRNG key for t and the mask.
    mask_id: the ``[MASK]`` token id.
    cfg: the objective config (schedule, antithetic t, t_min).

  Returns:
    ``{"loss_sum": Σ weighted NLL over the batch, "tokens": number of target tokens, "masked": number masked}``.
    ``loss_sum / tokens`` is the negative ELBO in nats per target token.
  """
  t_key, mask_key = jax.random.split(key)
  t = sample_t(t_key, x.shape[0], cfg)
  z_t, is_masked = mask_tokens(mask_key, x, kinds, t, mask_id, cfg)
  nll = token_nll(without_mask_class(denoise_fn(z_t, t), mask_id), x)  # [batch, length]
  nll = jnp.where(is_masked, nll, 0.0)
  per_sequence = elbo_weight(t, cfg) * nll.sum(axis=-1)  # [batch]
  return {
    "loss_sum": per_sequence.sum(),
    "tokens": (kinds == K.TARGET).sum().astype(jnp.float32),
    "masked": is_masked.sum().astype(jnp.float32),
  }
