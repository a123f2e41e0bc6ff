"""What the denoiser proposes at every position: a candidate token and the confidence a step rule ranks it by.

The model's logits become the clean-token distribution of the SUBS parameterisation (MDLM, Sahoo et al. 2024):
the mask class gets logit -inf. Candidates are drawn with the Gumbel-max trick in float32 (LLaDA samples its
Gumbel noise in float64 because low-precision noise hurts generation quality; float32 is the widest type JAX uses
by default). Confidence is measured on the untempered, unfiltered model distribution, as LLaDA and Dream do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mercury_jax.sampling.settings import SamplerSettings


def clean_logits(logits: jax.Array, eos_banned: jax.Array, settings: SamplerSettings) -> jax.Array:
  """Float32 logits of the clean token: the mask class removed, EOS removed where ``eos_banned`` [b, l]."""
  logits = logits.astype(jnp.float32).at[..., settings.mask_id].set(-jnp.inf)
  eos = jnp.where(eos_banned, -jnp.inf, logits[..., settings.eos_id])
  return logits.at[..., settings.eos_id].set(eos)


def filter_logits(logits: jax.Array, settings: SamplerSettings) -> jax.Array:
  """Temperature, then top-k, then top-p (nucleus, Holtzman et al. 2020); removed tokens get -inf."""
  logits = logits / settings.temperature
  if settings.top_k:
    top = jax.lax.top_k(logits, min(settings.top_k, logits.shape[-1]))[0]  # [b, l, k], descending
    logits = jnp.where(logits >= top[..., -1:], logits, -jnp.inf)
  if settings.top_p < 1.0:
    ranked = top if settings.top_k else -jnp.sort(-logits, axis=-1)  # [b, l, k or vocab], descending
    probs = jax.nn.softmax(ranked, axis=-1)
    kept = (jnp.cumsum(probs, axis=-1) - probs) < settings.top_p  # The most likely token is always kept.
    cutoff = jnp.min(jnp.where(kept, ranked, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits >= cutoff, logits, -jnp.inf)
  return logits


def propose(
  logits: jax.Array, keys: jax.Array, eos_banned: jax.Array, settings: SamplerSettings
) -> tuple[jax.Array, jax.Array]:
  """Draws a candidate token per position and its confidence.

  Args:
    logits: The denoiser's output, [batch, length, vocab].
    keys: One PRNG key per example, [batch]; only used when ``settings.temperature > 0``.
    eos_banned: [batch, length] bool, positions where EOS may not be proposed.
    settings: Temperature, top-k, top-p and the confidence measure.

  Returns:
    ``(x0, confidence)``: int32 [batch, length] candidates and float32 [batch, length] confidences.
  """
  logits = clean_logits(logits, eos_banned, settings)
  if settings.temperature == 0.0:
    x0 = jnp.argmax(logits, axis=-1)
  else:
    # One stream per example, drawn for that example's own shape: a row's noise does not depend on the batch.
    shape = logits.shape[1:]
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, shape, jnp.float32))(keys)  # [b, l, vocab]
    x0 = jnp.argmax(filter_logits(logits, settings) + gumbel, axis=-1)
  x0 = x0.astype(jnp.int32)
  # Confidences from logits and their log-normaliser, without materialising another [b, l, vocab] array.
  log_z = jax.nn.logsumexp(logits, axis=-1)  # [b, l]
  if settings.confidence == "prob":
    confidence = jnp.exp(jnp.take_along_axis(logits, x0[..., None], axis=-1)[..., 0] - log_z)
  elif settings.confidence == "margin":
    top2 = jnp.exp(jax.lax.top_k(logits, 2)[0] - log_z[..., None])  # [b, l, 2]
    confidence = top2[..., 0] - top2[..., 1]
  else:  # Negative entropy: sum_v p_v log p_v, with 0 log 0 = 0.
    p = jnp.exp(logits - log_z[..., None])
    confidence = jnp.sum(jnp.where(p > 0, p * logits, 0.0), axis=-1) - log_z
  return x0, confidence
