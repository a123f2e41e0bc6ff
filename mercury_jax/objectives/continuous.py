"""Continuous latent diffusion: Gaussian noise on normalised token latents, denoised by a token classifier.

CDCD (Dieleman et al. 2022, "Continuous diffusion for categorical data", arXiv 2211.15089) and LangFlow (Chen et
al. 2026, arXiv 2604.11748). Every token ``x_i`` has a learned latent ``e_{x_i}`` of ``d = model.latent_dim``
dimensions, normalised to norm ``sqrt(d)`` (``model.normalised_latents``), and the forward process is variance
exploding, ``z = e_x + sigma * eps`` with ``sigma`` in ``[sigma_min, sigma_max]``. The network reads ``z`` (and
``sigma``, and optionally its own previous estimate: self-conditioning) and predicts a distribution ``p`` over the
clean token at every position; it is trained with the cross-entropy ``-log p(x_i)`` (score interpolation: the
denoiser's estimate of ``e`` is ``E_p[e] = sum_v p_v e_v`` and the score ``(E_p[e] - z) / sigma^2``).

**Noise levels** are drawn over ``u = log(sigma / sigma_min) / log(sigma_max / sigma_min)`` in ``[0, 1]`` from
``objective.sigma_schedule``:
- ``fixed``: ``u ~ U[0, 1]`` (log-uniform sigma);
- ``warped``: CDCD's time warping, a monotone piecewise-linear function ``F~(u) = a + s * F(u)`` over ``WARP_BINS``
  equal bins fitted by least squares to the observed cross-entropy; ``u`` is drawn from the normalised ``F``, so
  training spends its samples where the loss changes fastest;
- ``gumbel``: the same fit with a truncated Gumbel CDF over ``u`` (LangFlow's learnable Gumbel schedule; its two
  shape parameters, location and width, are all it learns).

The schedules' parameters (``noise_warp``, ``noise_gumbel``) live in the model's parameters and learn only from the
fit (``aux_loss``); the network never sees them.

**The likelihood bound** (evaluation, ``training=False``) is the continuous-time variational bound of a
variance-exploding Gaussian diffusion (Kingma et al. 2021, VDM, eq. 17 with ``SNR(sigma) = 1 / sigma^2``), per
target token in nats:

    -log p(x) <= KL(q(z_max | x) || N(0, (sigma_max^2 + 1) I))          prior:  (d / 2) log(1 + 1 / sigma_max^2)
               + E[-log p(x | z_min)]                                  reconstruction at sigma_min
               + int_{sigma_min}^{sigma_max} E ||e_x - E_p[e](z_sigma)||^2 / sigma^3 d sigma     diffusion

The reconstruction's decoder is the network itself at ``sigma_min`` (the distribution a sampler's last step draws
its tokens from), and the integral is estimated by importance sampling ``u`` from an even mixture of the training
schedule and ``U[0, 1]``, so the estimate is unbiased for any schedule and its variance bounded. It bounds the NLL of
the model's reverse-time SDE (ancestral) sampler whose denoiser is ``E_p[e]``, stopped at ``sigma_min`` and decoded
by the network, not of the probability-flow ODE; LangFlow's ODE bound is not implemented. The diffusion term weighs
the denoiser's squared error by ``1 / sigma^3``: below ``sigma ~ 1`` a model that is merely 99 % sure of a nearly
clean token pays several nats for it, so ``sigma_min`` sets how tight the bound of a finite model can be. With
self-conditioning the denoiser is the network applied twice (its first estimate fed back), a function of ``z`` like
any other, so the bound holds.

``objective.block_size > 0`` is the block-causal variant: one ``sigma`` per (sequence, block), trained and scored in
one pass over ``z ⊕ x_0`` under the ``block_diffusion`` mask (``objectives.block_diffusion``), so that each block is
its own chain conditioned on the clean blocks before it and the engine's exact key-value cache applies. ``FIXED``
tokens (SFT prompts) are never noised: their inputs are their token embeddings, in both variants.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from mercury_jax import kinds as K
from mercury_jax.config import ObjectiveConfig
from mercury_jax.model import WARP_BINS
from mercury_jax.objectives.masked_diffusion import stratified_uniform
from mercury_jax.objectives.nll import token_nll

# ------------------------------------------------------------------------------------------------ noise levels


def sigma_of(u: jax.Array, cfg: ObjectiveConfig) -> jax.Array:
  """sigma at normalised log-noise ``u`` in [0, 1]: ``sigma_min * (sigma_max / sigma_min) ** u``."""
  return cfg.sigma_min * jnp.exp(u * math.log(cfg.sigma_max / cfg.sigma_min))


def u_of(sigma: jax.Array, cfg: ObjectiveConfig) -> jax.Array:
  """The inverse of :func:`sigma_of`."""
  return jnp.log(sigma / cfg.sigma_min) / math.log(cfg.sigma_max / cfg.sigma_min)


# The schedules' parameters are stored divided by this: Adam moves a parameter by about the learning rate per step,
# so at the network's 1e-3 a fit in natural units (an offset of several nats) would take thousands of steps.
SCHEDULE_SCALE = 10.0


def _warp_masses(params: jax.Array) -> jax.Array:
  return jax.nn.softmax(SCHEDULE_SCALE * params[2:])  # [WARP_BINS]


def _gumbel(params: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Location and width over u, and the Gumbel CDF at u = 0 and u = 1 (the truncation)."""
  loc, width = 0.5 + SCHEDULE_SCALE * params[2], 0.25 * jnp.exp(SCHEDULE_SCALE * params[3])
  lo, hi = (jnp.exp(-jnp.exp(-(u - loc) / width)) for u in (0.0, 1.0))
  return loc, width, lo, hi


def cdf(u: jax.Array, params: dict[str, jax.Array], cfg: ObjectiveConfig) -> jax.Array:
  """The schedule's normalised CDF ``F(u)`` in [0, 1] (``F(0) = 0``, ``F(1) = 1``); ``params`` as the model's
  ``latent_params`` (``warp``, ``gumbel``)."""
  u = jnp.clip(u, 0.0, 1.0)
  if cfg.sigma_schedule == "fixed":
    return u
  if cfg.sigma_schedule == "warped":
    masses = _warp_masses(params["warp"])
    edges = jnp.concatenate([jnp.zeros(1), jnp.cumsum(masses)])  # [WARP_BINS + 1]
    scaled = u * WARP_BINS
    j = jnp.clip(jnp.floor(scaled).astype(jnp.int32), 0, WARP_BINS - 1)
    return edges[j] + masses[j] * (scaled - j)
  loc, width, lo, hi = _gumbel(params["gumbel"])
  return (jnp.exp(-jnp.exp(-(u - loc) / width)) - lo) / (hi - lo)


def inverse_cdf(t: jax.Array, params: dict[str, jax.Array], cfg: ObjectiveConfig) -> jax.Array:
  """``u = F^{-1}(t)`` for ``t`` in [0, 1]: how training turns uniform draws into noise levels."""
  t = jnp.clip(t, 0.0, 1.0)
  if cfg.sigma_schedule == "fixed":
    return t
  if cfg.sigma_schedule == "warped":
    masses = _warp_masses(params["warp"])
    edges = jnp.cumsum(masses)
    j = jnp.clip(jnp.searchsorted(edges, t, side="right"), 0, WARP_BINS - 1)
    start = edges[j] - masses[j]
    return jnp.clip((j + (t - start) / masses[j]) / WARP_BINS, 0.0, 1.0)
  loc, width, lo, hi = _gumbel(params["gumbel"])
  y = jnp.clip(lo + t * (hi - lo), 1e-30, 1.0 - 1e-7)
  return jnp.clip(loc - width * jnp.log(-jnp.log(y)), 0.0, 1.0)


def density(u: jax.Array, params: dict[str, jax.Array], cfg: ObjectiveConfig) -> jax.Array:
  """``F'(u)``: the schedule's probability density over u."""
  u = jnp.clip(u, 0.0, 1.0)
  if cfg.sigma_schedule == "fixed":
    return jnp.ones_like(u)
  if cfg.sigma_schedule == "warped":
    j = jnp.clip(jnp.floor(u * WARP_BINS).astype(jnp.int32), 0, WARP_BINS - 1)
    return _warp_masses(params["warp"])[j] * WARP_BINS
  loc, width, lo, hi = _gumbel(params["gumbel"])
  z = (u - loc) / width
  return jnp.exp(-z - jnp.exp(-z)) / (width * (hi - lo))


def fitted_loss(u: jax.Array, params: dict[str, jax.Array], cfg: ObjectiveConfig, vocab: int) -> jax.Array:
  """The learned schedule's unnormalised CDF ``F~(u) = a + s * F(u)``, fitted to the cross-entropy; at
  initialisation ``a = 0`` and ``s = log(vocab)``, the range of a cross-entropy from a clean input to no input."""
  p = SCHEDULE_SCALE * (params["warp"] if cfg.sigma_schedule == "warped" else params["gumbel"])
  return p[0] + math.log(vocab) * jnp.exp(p[1]) * cdf(u, params, cfg)


# ------------------------------------------------------------------------------------------------ score


def estimate(logits: jax.Array, table: jax.Array) -> jax.Array:
  """The denoiser's estimate of the clean latents, ``E_p[e] = softmax(logits) @ table``: [..., vocab] -> [..., d]."""
  return jax.nn.softmax(logits.astype(jnp.float32), axis=-1) @ table


def score(z: jax.Array, sigma: jax.Array, logits: jax.Array, table: jax.Array) -> jax.Array:
  """Score interpolation (CDCD eq. 6): ``grad_z log p(z) ~ (E_p[e] - z) / sigma^2``; ``sigma`` broadcasts over
  ``z``'s last axis ([..., d])."""
  sigma = jnp.asarray(sigma, jnp.float32)[..., None]
  return (estimate(logits, table) - z) / (sigma * sigma)


def prior_kl(cfg: ObjectiveConfig, dim: int) -> float:
  """``KL(N(e, sigma_max^2 I) || N(0, (sigma_max^2 + 1) I))`` for a latent of norm ``sqrt(dim)``, in nats."""
  return 0.5 * dim * math.log1p(1.0 / cfg.sigma_max**2)


# ------------------------------------------------------------------------------------------------ the objective


def loss(
  logits_fn: Callable[..., jax.Array],
  x: jax.Array,
  kinds: jax.Array,
  key: jax.Array,
  cfg: ObjectiveConfig,
  *,
  segment_ids: jax.Array | None = None,
  training: bool = False,
  u: jax.Array | None = None,
) -> dict[str, jax.Array]:
  """The training cross-entropy (``training``) or the likelihood bound (module docstring) for one batch.

  Args:
    logits_fn: the network (``objectives.LogitsFn``); called with ``latent_params=True`` for the latents and the
      schedules, then with ``latents``, ``noise_level`` and ``self_cond`` (and the 2n-layout overrides of the
      block-causal variant).
    x: clean tokens, [batch, length] int32.
    kinds: token kinds, [batch, length]; only ``TARGET`` positions are noised and scored.
    key: PRNG key of the noise.
    cfg: the objective config.
    segment_ids: [batch, length] attention segments (0 is padding); default ``kinds.segment_ids(kinds)``.
    training: the cross-entropy at noise levels drawn from the schedule, and the schedule's fit as ``aux_loss``;
      otherwise the bound.
    u: [batch, blocks] noise levels to use instead of drawing them (tests); the bound's proposal density still
      weighs them.

  Returns:
    ``{"loss_sum", "tokens", "masked"}`` as every objective (``loss_sum / tokens``: cross-entropy per target token in
    training, the bound in nats per target token in evaluation), plus ``aux_loss`` (the schedule's least-squares fit,
    added to the training loss) and ``schedule_fit`` (the same, for the logs) in training.
  """
  batch, length = x.shape
  block = cfg.block_size or length
  if length % block:
    raise ValueError(f"sequence length {length} must be a multiple of objective.block_size={block}")
  blocks = length // block
  params = logits_fn(x, None, latent_params=True)
  table, schedules = params["table"], jax.lax.stop_gradient({"warp": params["warp"], "gumbel": params["gumbel"]})
  t_key, mix_key, eps_key, sc_key, rec_key = jax.random.split(key, 5)
  target = kinds == K.TARGET
  if u is None:
    t = stratified_uniform(t_key, (batch, blocks), cfg.antithetic)
    if training:
      u = inverse_cdf(t, schedules, cfg)
    else:  # The bound's proposal: an even mixture of the schedule and U[0, 1] (defensive importance sampling).
      u = jnp.where(jax.random.bernoulli(mix_key, 0.5, t.shape), inverse_cdf(t, schedules, cfg), t)
  sigma = jnp.repeat(sigma_of(u, cfg), block, axis=1)  # [batch, length]
  noise_level = jnp.where(target, sigma, 0.0)
  e = table[x]
  diffusion_block = block if cfg.block_size else 0

  def denoised_logits(noise_level: jax.Array, eps: jax.Array) -> jax.Array:
    z = e + noise_level[..., None] * eps
    forward = _forward(logits_fn, x, z, noise_level, block=diffusion_block, segment_ids=segment_ids, kinds=kinds)
    if training and cfg.self_conditioning > 0:
      use = jax.random.bernoulli(sc_key, cfg.self_conditioning)
      sc = jax.lax.cond(use, lambda: jax.lax.stop_gradient(estimate(forward(None), table)), lambda: jnp.zeros_like(z))
      return forward(sc)
    if cfg.self_conditioning > 0:  # The bound scores the denoiser the sampler runs: always self-conditioned.
      return forward(estimate(forward(None), table))
    return forward(None)

  logits = denoised_logits(noise_level, jax.random.normal(eps_key, e.shape))

  tokens = target.sum().astype(jnp.float32)
  if training:
    ce = jnp.where(target, token_nll(logits, x), 0.0)
    terms = {"loss_sum": ce.sum(), "tokens": tokens, "masked": tokens}
    if cfg.sigma_schedule == "fixed":
      return terms
    counts = target.reshape(batch, blocks, block).sum(-1)
    per_cell = ce.reshape(batch, blocks, block).sum(-1) / jnp.maximum(counts, 1)
    learned = {"warp": params["warp"], "gumbel": params["gumbel"]}
    residual = fitted_loss(u, learned, cfg, table.shape[0]) - jax.lax.stop_gradient(per_cell)
    fit = jnp.sum(jnp.where(counts > 0, residual**2, 0.0)) / jnp.maximum(jnp.sum(counts > 0), 1)
    return {**terms, "aux_loss": fit, "schedule_fit": fit}

  proposal = 0.5 * density(u, schedules, cfg) + 0.5  # [batch, blocks]
  weight = math.log(cfg.sigma_max / cfg.sigma_min) / (jnp.repeat(proposal, block, axis=1) * sigma * sigma)
  error = jnp.sum((e - estimate(logits, table)) ** 2, axis=-1)  # [batch, length]
  # The decoder at sigma_min is the network itself: the sampler's last step draws the tokens from this distribution.
  at_min = jnp.where(target, cfg.sigma_min, 0.0)
  reconstruction = token_nll(denoised_logits(at_min, jax.random.normal(rec_key, e.shape)), x)
  per_token = weight * error + reconstruction + prior_kl(cfg, table.shape[-1])
  return {"loss_sum": jnp.where(target, per_token, 0.0).sum(), "tokens": tokens, "masked": tokens}


def _forward(logits_fn, x, z, noise_level, *, block: int, segment_ids, kinds):
  """``self_cond -> logits [batch, length, vocab]`` of the noisy latents: one pass over them (whole sequence) or
  over ``z ⊕ x_0`` under the ``block_diffusion`` mask (block-causal)."""
  if not block:
    return lambda sc: logits_fn(x, None, latents=z, noise_level=noise_level, self_cond=sc)
  batch, length = x.shape
  segment_ids = K.segment_ids(kinds) if segment_ids is None else segment_ids
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  zeros = jnp.zeros_like(z)

  def run(sc):
    return logits_fn(
      jnp.concatenate([x, x], axis=1),  # the noisy half's tokens are never read (its noise level is > 0)
      None,
      segment_ids=jnp.concatenate([segment_ids, segment_ids], axis=1),
      positions=jnp.concatenate([positions, positions], axis=1),
      mask="block_diffusion",
      diffusion_block=block,
      logits_length=length,
      latents=jnp.concatenate([z, zeros], axis=1),
      noise_level=jnp.concatenate([noise_level, jnp.zeros_like(noise_level)], axis=1),
      self_cond=None if sc is None else jnp.concatenate([sc, zeros], axis=1),
    )

  return run
