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

import math
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


def t_of_mask_rate(rate: jax.Array, cfg: ObjectiveConfig) -> jax.Array:
  """The inverse of the schedule's mask rate: the t in [0, 1] at which ``1 - alpha_t = rate``."""
  if cfg.schedule == "linear":
    return rate
  if cfg.schedule == "cosine":  # cos(pi/2 (1 - t)) = rate
    return 1.0 - 2.0 / jnp.pi * jnp.arccos(rate)
  if cfg.schedule == "polynomial":  # t**exponent = rate
    return rate ** (1.0 / cfg.exponent)
  raise ValueError(f"objective.schedule={cfg.schedule!r} must be one of linear, cosine, polynomial")


def t_range(cfg: ObjectiveConfig, *, training: bool = False) -> tuple[float, float]:
  """The interval t is drawn from: ``[t_min, 1]``, clipped in training to the mask rates ``[β, ω]``.

  The clipped schedule (BD3-LM, Arriola et al. 2025, arXiv 2503.09573, Sec. 5.2) trains only on mask rates
  ``1 - alpha_t`` in ``[objective.mask_rate_min, objective.mask_rate_max]``: t is drawn uniformly between the
  schedule's t of those two rates (:func:`t_of_mask_rate`), so with the linear schedule the mask rate is
  ``U[β, ω]`` exactly as in the paper, and with the others it keeps the schedule's density inside the clip. The
  estimate is then the ELBO's integrand averaged over that part of [0, 1] only: a training signal with lower
  variance, not a bound, so evaluation (``training=False``) always integrates the whole ``[t_min, 1]``. The clip
  applies to both the whole-sequence and the block objective.
  """
  if not training:
    return cfg.t_min, 1.0
  with jax.ensure_compile_time_eval():  # Constants of the config, also when called while tracing.
    low = cfg.t_min if cfg.mask_rate_min == 0.0 else float(t_of_mask_rate(jnp.float32(cfg.mask_rate_min), cfg))
    high = 1.0 if cfg.mask_rate_max == 1.0 else float(t_of_mask_rate(jnp.float32(cfg.mask_rate_max), cfg))
  low = max(low, cfg.t_min)
  if high <= low:
    raise ValueError(
      f"objective.mask_rate_max={cfg.mask_rate_max} lies below the mask rate at objective.t_min={cfg.t_min} "
      f"(schedule {cfg.schedule!r}): no t is left to train on; raise mask_rate_max or lower t_min"
    )
  return low, high


def sample_t(
  key: jax.Array, shape: int | tuple[int, ...], cfg: ObjectiveConfig, *, training: bool = False
) -> jax.Array:
  """Draws t uniformly in :func:`t_range` for every cell of ``shape``; stratified when ``cfg.antithetic``.

  The stratified draw ``u_i = (u + i / N) mod 1`` over the ``N`` cells puts exactly one t in each of ``N`` equal
  strata, which lowers the variance of the ELBO estimate (Kingma et al. 2021, VDM, appendix on low-discrepancy
  sampling); each ``u_i`` alone is still ``U[0, 1]``. For a grid of more than one axis (sequences × blocks) the
  strata are dealt to the cells in a random order, so t is not tied to a cell's place (a block's index).

  Args:
    key: PRNG key.
    shape: ``batch`` (one t per sequence) or a grid such as ``(batch, blocks)``.
    cfg: the objective config (``antithetic``, ``t_min`` and the training clip).
    training: apply the clipped schedule (:func:`t_range`).

  Returns:
    float32 t of ``shape``.
  """
  low, high = t_range(cfg, training=training)
  return low + (high - low) * stratified_uniform(key, shape, cfg.antithetic)


def stratified_uniform(key: jax.Array, shape: int | tuple[int, ...], stratified: bool = True) -> jax.Array:
  """``U[0, 1]`` draws for every cell of ``shape``, one per stratum when ``stratified`` (see :func:`sample_t`)."""
  shape = (shape,) if isinstance(shape, int) else tuple(shape)
  if not stratified:
    return jax.random.uniform(key, shape)
  n = math.prod(shape)
  strata = jnp.arange(n) / n
  if len(shape) > 1:
    strata = jax.random.permutation(jax.random.fold_in(key, 1), strata)
  return jnp.mod(jax.random.uniform(key, ()) + strata, 1.0).reshape(shape)


# ------------------------------------------------------------------------------------------ forward process


def mask_tokens(
  key: jax.Array, x: jax.Array, kinds: jax.Array, t: jax.Array, mask_id: int, cfg: ObjectiveConfig
) -> tuple[jax.Array, jax.Array]:
  """Draws ``z_t ~ q(z_t | x)``: each target token is replaced by ``mask_id`` with probability ``1 - alpha_t``.

  ``t`` is one time per sequence, ``[batch]``, or one per token, ``[batch, length]`` (the block objective's).
  Returns ``(z_t, is_masked)``; prompt and padding tokens are never masked.
  """
  keep_prob = alpha(t, cfg) if t.ndim == x.ndim else alpha(t, cfg)[:, None]  # [batch, length] or [batch, 1]
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
  denoise_fn: DenoiseFn,
  x: jax.Array,
  kinds: jax.Array,
  key: jax.Array,
  mask_id: int,
  cfg: ObjectiveConfig,
  *,
  training: bool = False,
) -> dict[str, jax.Array]:
  """One-sample Monte Carlo estimate of the negative ELBO (MD4 eq. 5) for a batch.

  Args:
    denoise_fn: ``(z_t, t) -> logits``.
    x: clean tokens, [batch, length] int32.
    kinds: token kinds (``mercury_jax.kinds``), [batch, length].
    key: PRNG key for t and the mask.
    mask_id: the ``[MASK]`` token id.
    cfg: the objective config (schedule, antithetic t, t_min, the training clip).
    training: draw t from the clipped schedule (:func:`t_range`); evaluation leaves it False.

  Returns:
    ``{"loss_sum": Σ weighted NLL over the batch, "tokens": number of target tokens, "masked": number masked}``.
    ``loss_sum / tokens`` is the negative ELBO in nats per target token.
  """
  t_key, mask_key = jax.random.split(key)
  t = sample_t(t_key, x.shape[0], cfg, training=training)
  z_t, is_masked = mask_tokens(mask_key, x, kinds, t, mask_id, cfg)
  nll = token_nll(without_mask_class(denoise_fn(z_t, t), mask_id), x)  # [batch, length]
  nll = jnp.where(is_masked, nll, 0.0)
  per_sequence = elbo_weight(t, cfg) * nll.sum(axis=-1)  # [batch]
  return {
    "loss_sum": per_sequence.sum(),
    "tokens": (kinds == K.TARGET).sum().astype(jnp.float32),
    "masked": is_masked.sum().astype(jnp.float32),
  }
