"""Verified drafting (TiDAR): one network drafts a block by diffusion and verifies it autoregressively.

Liu et al. 2025, "TiDAR: Think in Diffusion, Talk in Autoregression" (arXiv 2511.08923). Training runs one forward
pass over ``[draft half ; clean half]`` of ``2n`` tokens, both halves at the positions ``0 .. n-1``, under the
``verified`` attention mask (:mod:`mercury_jax.kernels.masks`):

* the clean half is the sequence ``x`` itself and is strictly causal: a clean token sees the clean tokens up to
  itself, so the clean half's logits are exactly a causal model's, and position ``i`` is scored on ``x_{i+1}`` as
  in :mod:`mercury_jax.objectives.autoregressive` (the verifier, ``L_AR``);
* the draft half is ``x`` cut into blocks of ``k = draft_length`` tokens with its target tokens replaced by
  ``[MASK]``; a draft block sees itself and the clean tokens before its start, and scores its masked positions on
  the clean tokens (the drafter, ``L_draft``).

A clean token never sees a draft one, so the verifier's logits do not depend on the drafts, and each draft block sees
exactly what it sees at inference time: the committed tokens before it and its own masks.

The loss is ``(α · L_AR + L_draft) / (1 + α)`` (``α = objective.ar_weight``), each term a mean per scored token.
With the default ``draft_mask_min = draft_mask_max = 1`` every target token of the draft half is masked (TiDAR's
choice) and ``L_draft`` is the **one-step drafting cross-entropy**: the mean ``-log p(x_i | x_{<block start})`` of a
block predicted from nothing but its context, in parallel and with no mask class. It is not an ELBO: it scores each
token's marginal given the context, not the joint of the block, so it is no bound on the NLL. With a range of mask
rates, the rate ``r`` of each (sequence, block) is drawn from ``U[draft_mask_min, draft_mask_max]`` (stratified as
``masked_diffusion.sample_t``) and the block's masked cross-entropy is weighted by MDLM's ELBO weight at the
schedule's ``t`` of that rate, ``-alpha'_t / (1 - alpha_t)`` (``1 / r`` for the linear schedule; a single rate
below 1 is weighted 1), so the range ``(0, 1]`` is BD3-LM's block ELBO with a causal clean half: :func:`loss` with
``draft="elbo"`` evaluates that bound with ``t ~ U[t_min, 1]``.

Token kinds are ``mercury_jax.kinds``: only ``TARGET`` positions are masked and scored in the draft half; ``FIXED``
ones (an SFT prompt) are clean context in both halves; ``PAD`` is segment 0 in both halves and never attended to.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from mercury_jax import kinds as K
from mercury_jax.config import ObjectiveConfig
from mercury_jax.objectives import autoregressive, block_diffusion, masked_diffusion
from mercury_jax.objectives.nll import token_nll

# How the draft half is noised: "train" draws rates from [draft_mask_min, draft_mask_max]; "all_mask" masks every
# target (the one-step drafting cross-entropy); "elbo" draws t ~ U[t_min, 1] per block (the block NELBO, a bound).
DRAFTS = ("train", "all_mask", "elbo")


def draft_noise(
  key: jax.Array, x: jax.Array, kinds: jax.Array, cfg: ObjectiveConfig, *, draft: str = "train"
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The draft half and its weights: ``(x_draft, is_masked [batch, length], weight [batch, blocks])``.

  Args:
    key: PRNG key of the rates and the mask (unused when every target is masked).
    x: clean tokens, [batch, length] int32; ``length`` a multiple of ``cfg.draft_length``.
    kinds: token kinds, [batch, length].
    cfg: the objective config (``draft_length``, ``draft_mask_min/max``, ``mask_id``, the schedule).
    draft: one of :data:`DRAFTS`.
  """
  batch, length = x.shape
  k = cfg.draft_length
  if draft not in DRAFTS:
    raise ValueError(f"{draft=} must be one of {DRAFTS}")
  if length % k:
    raise ValueError(f"sequence length {length} must be a multiple of objective.draft_length={k}")
  ones = jnp.ones((batch, length // k), jnp.float32)
  if draft == "all_mask" or (draft == "train" and cfg.draft_mask_min == 1.0):
    is_masked = kinds == K.TARGET
    return jnp.where(is_masked, cfg.mask_id, x), is_masked, ones
  if draft == "train" and cfg.draft_mask_min == cfg.draft_mask_max:  # One rate below 1: plain cross-entropy.
    is_masked = (jax.random.uniform(key, x.shape) < cfg.draft_mask_min) & (kinds == K.TARGET)
    return jnp.where(is_masked, cfg.mask_id, x), is_masked, ones
  # A range of rates (train) or the whole schedule (elbo): BD3-LM's per-block noise, clipped to the rate range.
  block_cfg = dataclasses.replace(cfg, block_size=k, mask_rate_min=cfg.draft_mask_min, mask_rate_max=cfg.draft_mask_max)
  x_draft, is_masked, t = block_diffusion.noise(key, x, kinds, cfg.mask_id, block_cfg, training=draft == "train")
  return x_draft, is_masked, masked_diffusion.elbo_weight(t, cfg)


def loss(
  logits_fn: Callable[..., jax.Array],
  x: jax.Array,
  kinds: jax.Array,
  key: jax.Array,
  cfg: ObjectiveConfig,
  *,
  segment_ids: jax.Array | None = None,
  draft: str = "train",
) -> dict[str, jax.Array]:
  """Both halves' losses for a batch, in one pass over ``[draft half ; x]`` (module docstring).

  Args:
    logits_fn: ``(tokens, t, **overrides) -> logits`` (``mercury_jax.objectives.LogitsFn``); called once with
      ``t=None`` and the overrides ``segment_ids``, ``positions``, ``mask="verified"`` and ``diffusion_block`` for
      the ``2 * length`` tokens.
    x: clean tokens, [batch, length] int32.
    kinds: token kinds, [batch, length].
    key: PRNG key of the draft half's noise.
    cfg: the objective config (``draft_length``, ``ar_weight``, ``draft_mask_min/max``, ``mask_id``, schedule).
    segment_ids: [batch, length] attention segments (0 is padding); default ``kinds.segment_ids(kinds)``.
    draft: how the draft half is noised (:data:`DRAFTS`); training uses ``"train"``.

  Returns:
    ``{"loss_sum", "tokens", "masked", "ar_loss_sum", "ar_tokens", "draft_loss_sum", "draft_tokens"}``.
    ``loss_sum`` is the combined mean ``(α · L_AR + L_draft) / (1 + α)`` and ``tokens`` is 1, so the trainer's
    ``loss_sum / tokens`` is the loss; ``ar_loss_sum / ar_tokens`` is the verifier's exact next-token NLL (the
    twin's tokens, ``autoregressive.scored``) and ``draft_loss_sum / draft_tokens`` the drafter's loss per target
    token of the draft half. The ``*_sum`` and ``*_tokens`` entries add up over batches.
  """
  batch, length = x.shape
  x_draft, is_masked, weight = draft_noise(key, x, kinds, cfg, draft=draft)
  segment_ids = K.segment_ids(kinds) if segment_ids is None else segment_ids
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  logits = logits_fn(
    jnp.concatenate([x_draft, x], axis=1),  # [batch, 2 * length]: drafts ⊕ x_0
    None,
    segment_ids=jnp.concatenate([segment_ids, segment_ids], axis=1),
    positions=jnp.concatenate([positions, positions], axis=1),
    mask="verified",
    diffusion_block=cfg.draft_length,
  )  # [batch, 2 * length, vocab]
  draft_logits, clean_logits = logits[:, :length], logits[:, length:]

  nll = token_nll(masked_diffusion.without_mask_class(draft_logits, cfg.mask_id), x)  # [batch, length]
  nll = jnp.where(is_masked, nll, 0.0).reshape(batch, -1, cfg.draft_length)  # [batch, blocks, k]
  draft_sum = (weight * nll.sum(axis=-1)).sum()
  draft_tokens = (kinds == K.TARGET).sum().astype(jnp.float32)

  ar_nll = token_nll(clean_logits[:, :-1].astype(jnp.float32), x[:, 1:])  # [batch, length - 1]: i predicts i + 1
  scored = autoregressive.scored(kinds)[:, 1:]
  ar_sum = jnp.where(scored, ar_nll, 0.0).sum()
  ar_tokens = scored.sum().astype(jnp.float32)

  alpha = cfg.ar_weight
  l_ar, l_draft = ar_sum / jnp.maximum(ar_tokens, 1.0), draft_sum / jnp.maximum(draft_tokens, 1.0)
  return {
    "loss_sum": (alpha * l_ar + l_draft) / (1.0 + alpha),
    "tokens": jnp.ones((), jnp.float32),
    "masked": is_masked.sum().astype(jnp.float32),
    "ar_loss_sum": ar_sum,
    "ar_tokens": ar_tokens,
    "draft_loss_sum": draft_sum,
    "draft_tokens": draft_tokens,
  }
