"""The per-position negative log-likelihood that every objective scores with."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """``-log softmax(logits)[target]`` per position, without materialising the full log-softmax.

  Args:
    logits: ``[..., vocab]`` float32.
    targets: ``[...]`` int32.
  """
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return jax.nn.logsumexp(logits, axis=-1) - target_logit
