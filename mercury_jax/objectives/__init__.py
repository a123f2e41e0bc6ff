"""Training objectives, selected by the config's ``[objective]`` section (``objective.name``).

Each objective is a plain function over the network's ``logits_fn``; the network knows nothing of them.

- ``masked_diffusion``: absorbing-state diffusion trained with the continuous-time ELBO (MDLM / MD4).
- ``block_diffusion``: ``masked_diffusion`` with ``objective.block_size > 0``: diffusion within blocks,
  autoregressive across them (BD3-LM), trained in one pass over ``x_t ⊕ x_0``.
- ``autoregressive``: next-token prediction, the twin every diffusion model is compared with.
- ``continuous``: Gaussian diffusion on normalised token latents (CDCD / LangFlow), trained with the cross-entropy
  and scored with a variational bound; ``objective.block_size > 0`` is its block-causal variant.
- ``verified``: TiDAR's drafter and autoregressive verifier in one network, trained in one pass over
  ``drafts ⊕ x_0``; it also returns each half's sums (``ar_loss_sum``, ``ar_tokens``, ``draft_loss_sum``,
  ``draft_tokens``) and its ``loss_sum / tokens`` is the weighted mean of the two halves' losses.

All return the same sums, ``{"loss_sum", "tokens", "masked"}``, so the trainer and evaluation treat them alike:
``loss_sum / tokens`` is nats per scored token (an upper bound on the NLL for diffusion, exact for the twin).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from mercury_jax.config import ObjectiveConfig
from mercury_jax.objectives import autoregressive, block_diffusion, continuous, masked_diffusion, verified

# (tokens [batch, length], t [batch] or None, **overrides) -> logits [batch, length, vocab]. Keyword overrides
# (segment_ids, positions, mask, diffusion_block) go to the network in place of the batch's own segment ids, the
# positions 0 .. length-1 and the model's default mask; the block objective passes them for its 2n-token pass.
LogitsFn = Callable[..., jax.Array]


def loss_terms(
  logits_fn: LogitsFn,
  tokens: jax.Array,
  kinds: jax.Array,
  key: jax.Array,
  cfg: ObjectiveConfig,
  *,
  segment_ids: jax.Array | None = None,
  training: bool = False,
  draft: str | None = None,
) -> dict[str, jax.Array]:
  """The sums of the objective named by ``cfg.name`` for one batch (see the module docstring).

  Args:
    logits_fn: the network (:data:`LogitsFn`).
    tokens: clean tokens, [batch, length] int32.
    kinds: token kinds (``mercury_jax.kinds``), [batch, length].
    key: PRNG key of the objective's noise.
    cfg: the objective config.
    segment_ids: the batch's attention segments, [batch, length], as ``logits_fn`` uses them by default (the block
      objective repeats them for ``x_t ⊕ x_0``); default ``kinds.segment_ids(kinds)``.
    training: True in the train step: the clipped schedule (``objective.mask_rate_min/max``) applies. Evaluation
      passes False, so the diffusion estimate stays a bound on the NLL.
    draft: ``verified`` only, how its draft half is noised (``verified.DRAFTS``); default ``"train"`` in training,
      else ``"all_mask"`` for an all-mask config (the drafting cross-entropy it trains on) and ``"elbo"`` otherwise.
  """
  if cfg.name == "autoregressive":
    return autoregressive.loss(lambda x: logits_fn(x, None), tokens, kinds)
  if cfg.name == "verified":
    if draft is None:
      draft = "train" if training else "all_mask" if cfg.draft_mask_min == 1.0 else "elbo"
    return verified.loss(logits_fn, tokens, kinds, key, cfg, segment_ids=segment_ids, draft=draft)
  if cfg.name == "continuous":
    return continuous.loss(logits_fn, tokens, kinds, key, cfg, segment_ids=segment_ids, training=training)
  if cfg.name == "masked_diffusion" and cfg.block_size:
    return block_diffusion.loss(
      logits_fn, tokens, kinds, key, cfg.mask_id, cfg, segment_ids=segment_ids, training=training
    )
  if cfg.name == "masked_diffusion":
    return masked_diffusion.loss(logits_fn, tokens, kinds, key, cfg.mask_id, cfg, training=training)
  raise ValueError(f"objective.name={cfg.name!r} is unknown")


__all__ = ["LogitsFn", "autoregressive", "block_diffusion", "continuous", "loss_terms", "masked_diffusion", "verified"]
