"""Next-token prediction: the autoregressive twin's objective, an exact negative log-likelihood."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from mercury_jax import kinds as K
from mercury_jax.objectives.nll import token_nll


def scored(kinds: jax.Array) -> jax.Array:
  """Which positions the twin scores, ``[batch, length]`` bool: targets that have a target or fixed token before them.

  Position ``i`` is predicted from positions ``< i``, so the first token of a record (and a target right after
  padding) has no context and is not scored. Evaluation counts characters of exactly these tokens.
  """
  has_context = jnp.pad(kinds[:, :-1] != K.PAD, ((0, 0), (1, 0)))
  return (kinds == K.TARGET) & has_context


def loss(logits_fn: Callable[[jax.Array], jax.Array], x: jax.Array, kinds: jax.Array) -> dict[str, jax.Array]:
  """Exact next-token negative log-likelihood of the scored target tokens.

  Args:
    logits_fn: ``tokens [batch, length] -> logits [batch, length, vocab]`` of a causal model.
    x: tokens, ``[batch, length]`` int32.
    kinds: token kinds (``mercury_jax.kinds``); with SFT data only the response is scored, padding never.

  Returns:
    ``{"loss_sum", "tokens", "masked"}``: the NLL summed over scored tokens, and their count (twice, so the keys
    match the diffusion objective's).
  """
  logits = logits_fn(x)  # [batch, length, vocab]
  nll = token_nll(logits[:, :-1].astype(jnp.float32), x[:, 1:])  # [batch, length - 1]: position i predicts i + 1
  mask = scored(kinds)[:, 1:]
  count = mask.sum().astype(jnp.float32)
  return {"loss_sum": jnp.where(mask, nll, 0.0).sum(), "tokens": count, "masked": count}
