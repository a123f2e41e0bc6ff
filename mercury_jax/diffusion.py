"""Absorbing-state (masked) discrete diffusion: schedules, the forward process and the continuous-time ELBO.

Notation follows MD4 (Shi et al. 2024, "Simplified and Generalized Masked Diffusion for Discrete Data") and MDLM
(Sahoo et al. 2024): ``alpha_t`` is the probability that a token is still clean at time t in [0, 1]
(``alpha_0 = 1``, ``alpha_1 = 0``), ``z_t`` the partially masked sequence. The negative ELBO is (MD4 eq. 5)

    -ELBO(x) = ∫_0^1  -alpha'_t / (1 - alpha_t)  ·  E_{z_t ~ q(z_t|x)} [ Σ_{n: z_t^n = m} -log p_θ(x^n | z_t) ] dt,

estimated with one t per sequence. Everything here is a plain function over ``denoise_fn(z_t, t) -> logits``;
the network knows nothing of this.

Token kinds (see ``mercury_jax.data.records``): 0 = padding (never masked, never in the loss, never attended to),
1 = prompt (conditioning: never masked, no loss), 2 = target (noised and scored).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from mercury_jax.config import DiffusionConfig

PAD, PROMPT, TARGET = 0, 1, 2

DenoiseFn = Callable[[jax.Array, jax.Array], jax.Array]  # (z_t [batch, length], t [batch]) -> logits [b, l, vocab]


# ---------------------------------------------------------------------------------------------- schedules


def alpha(t: jax.Array, cfg: DiffusionConfig) -> jax.Array:
  """Probability that a token is unmasked at time ``t``."""
  if cfg.schedule == "linear":
    return 1.0 - t
  if cfg.schedule == "cosine":
    return 1.0 - jnp.cos(0.5 * jnp.pi * (1.0 - t))
  if cfg.schedule == "polynomial":
    return 1.0 - t**cfg.exponent
  raise ValueError(f"diffusion.schedule={cfg.schedule!r} must be one of linear, cosine, polynomial")


def dalpha(t: jax.Array, cfg: DiffusionConfig) -> jax.Array:
  """Time derivative ``alpha'_t`` of the schedule."""
  if cfg.schedule == "linear":
    return -jnp.ones_like(t)
  if cfg.schedule == "cosine":
    return -0.5 * jnp.pi * jnp.sin(0.5 * jnp.pi * (1.0 - t))
  if cfg.schedule == "polynomial":
    return -cfg.exponent * t ** (cfg.exponent - 1.0)
  raise ValueError(f"diffusion.schedule={cfg.schedule!r} must be one of linear, cosine, polynomial")


def elbo_weight(t: jax.Array, cfg: DiffusionConfig) -> jax.Array:
  """The ELBO weight ``-alpha'_t / (1 - alpha_t)``, written in closed form for numerical stability."""
  if cfg.schedule == "linear":
    return 1.0 / t
  if cfg.schedule == "cosine":
    return 0.5 * jnp.pi * jnp.tan(0.5 * jnp.pi * (1.0 - t))
  if cfg.schedule == "polynomial":
    return cfg.exponent / t
  raise ValueError(f"diffusion.schedule={cfg.schedule!r} must be one of linear, cosine, polynomial")


def sample_t(key: jax.Array, batch: int, cfg: DiffusionConfig) -> jax.Array:
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
  key: jax.Array, x: jax.Array, kinds: jax.Array, t: jax.Array, mask_id: int, cfg: DiffusionConfig
) -> tuple[jax.Array, jax.Array]:
  """Draws ``z_t ~ q(z_t | x)``: each target token is replaced by ``mask_id`` with probability ``1 - alpha_t``.

  Returns ``(z_t, is_masked)``; prompt and padding tokens are never masked.
  """
  keep_prob = alpha(t, cfg)[:, None]  # [batch, 1]
  is_masked = (jax.random.uniform(key, x.shape) >= keep_prob) & (kinds == TARGET)
  return jnp.where(is_masked, mask_id, x), is_masked


def without_mask_class(logits: jax.Array, mask_id: int) -> jax.Array:
  """Float32 logits with the mask class removed (MDLM's zero-masking parameterisation): clean tokens only."""
  vocab = jnp.arange(logits.shape[-1])
  return jnp.where(vocab == mask_id, -jnp.inf, logits.astype(jnp.float32))


def masked_log_probs(logits: jax.Array, mask_id: int) -> jax.Array:
  """Log-probabilities of the clean token with the mask class removed."""
  return jax.nn.log_softmax(without_mask_class(logits, mask_id), axis=-1)


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """``-log softmax(logits)[target]`` per position, without materialising the full log-softmax."""
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return jax.nn.logsumexp(logits, axis=-1) - target_logit


# --------------------------------------------------------------------------------------------------- losses


def diffusion_loss(
  denoise_fn: DenoiseFn, x: jax.Array, kinds: jax.Array, key: jax.Array, mask_id: int, cfg: DiffusionConfig
) -> dict[str, jax.Array]:
  """One-sample Monte Carlo estimate of the negative ELBO (MD4 eq. 5) for a batch.

  Args:
    denoise_fn: ``(z_t, t) -> logits``.
    x: clean tokens, [batch, length] int32.
    kinds: token kinds, [batch, length] (0 padding, 1 prompt, 2 target).
    key: PRNG key for t and the mask.
    mask_id: the ``[MASK]`` token id.
    cfg: the diffusion config (schedule, antithetic t).

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
    "tokens": (kinds == TARGET).sum().astype(jnp.float32),
    "masked": is_masked.sum().astype(jnp.float32),
  }


def autoregressive_loss(
  logits_fn: Callable[[jax.Array], jax.Array], x: jax.Array, kinds: jax.Array
) -> dict[str, jax.Array]:
  """Exact next-token negative log-likelihood of the target tokens (the autoregressive twin's objective).

  Position i predicts token i + 1; a token counts when it is a target, so with SFT data only the response is scored
  and padding never is. The first token of each sequence has no context and is not scored.
  """
  logits = logits_fn(x)  # [batch, length, vocab]
  nll = token_nll(logits[:, :-1].astype(jnp.float32), x[:, 1:])  # [batch, length - 1]
  scored = kinds[:, 1:] == TARGET
  return {
    "loss_sum": jnp.where(scored, nll, 0.0).sum(),
    "tokens": scored.sum().astype(jnp.float32),
    "masked": scored.sum().astype(jnp.float32),
  }
