"""Training objectives, selected by the config's ``[objective]`` section (``objective.name``).

Each objective is a plain function over the network's ``logits_fn``; the network knows nothing of them.

- ``masked_diffusion``: absorbing-state diffusion trained with the continuous-time ELBO (MDLM / MD4).
- ``autoregressive``: next-token prediction, the twin every diffusion model is compared with.

Both return the same sums, ``{"loss_sum", "tokens", "masked"}``, so the trainer and evaluation treat them alike:
``loss_sum / tokens`` is nats per scored token (an upper bound on the NLL for diffusion, exact for the twin).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from mercury_jax.config import ObjectiveConfig
from mercury_jax.objectives import autoregressive, masked_diffusion

# (tokens [batch, length], t [batch] or None) -> logits [batch, length, vocab]
LogitsFn = Callable[[jax.Array, jax.Array | None], jax.Array]


def loss_terms(
  logits_fn: LogitsFn, tokens: jax.Array, kinds: jax.Array, key: jax.Array, cfg: ObjectiveConfig
) -> dict[str, jax.Array]:
  """The sums of the objective named by ``cfg.name`` for one batch (see the module docstring)."""
  if cfg.name == "autoregressive":
    return autoregressive.loss(lambda x: logits_fn(x, None), tokens, kinds)
  if cfg.name == "masked_diffusion":
    return masked_diffusion.loss(logits_fn, tokens, kinds, key, cfg.mask_id, cfg)
  raise ValueError(f"objective.name={cfg.name!r} is unknown")


__all__ = ["LogitsFn", "autoregressive", "loss_terms", "masked_diffusion"]
