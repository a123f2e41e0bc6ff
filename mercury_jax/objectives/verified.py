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

Token kinds are ``mercury_jax.kinds``: only ``TARGET`` and ``DISTILLED`` positions are masked and scored in the draft
half, only ``TARGET`` ones in the clean half; ``FIXED`` ones (an SFT prompt) are clean context in both halves; ``PAD``
is segment 0 in both halves and never attended to.

**Self-distillation.** A ``DISTILLED`` token is one the network's own next-token head wrote (a self-distillation
record, :mod:`mercury_jax.distill`: a prompt from the training split, ``FIXED``, continued by the head): the
drafter learns what the verifier will accept, while ``L_AR`` never scores the network's own text, so the verifier
keeps learning from real data only (DistillSpec, Zhou et al. 2023, arXiv 2310.08461; Medusa-2's self-distillation,
Cai et al. 2024, arXiv 2401.10774). With ``objective.draft_kl_weight = λ > 0`` each masked draft position ``i`` also
pays ``λ · KL(p_i || q_i)``, the clean half's own next-token distribution at ``i - 1`` (``p_i = p(· | x_{<i})``, under
a stop-gradient: the teacher is not moved by it) against the drafter's ``q_i`` (mask class removed from both). On a
greedy continuation ``x_{<i}`` is exactly the prefix under which the verifier checks draft ``i``, so ``p_i`` is the
distribution its acceptance is decided by; on real data it is a lower-variance target than the data's token. The
drafter's loss is then ``L_draft + λ · L_KL``, each a mean per draft token; ``draft_loss_sum`` stays the
cross-entropy (comparable with models trained without it) and ``draft_kl_sum`` is the KL.
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
  kinds = jnp.where(kinds == K.DISTILLED, K.TARGET, kinds)  # The drafter's targets: real and distilled alike.
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
    ``{"loss_sum", "tokens", "masked", "ar_loss_sum", "ar_tokens", "draft_loss_sum", "draft_kl_sum",
    "draft_tokens"}``. ``loss_sum`` is the combined mean ``(α · L_AR + L_draft + λ · L_KL) / (1 + α)`` and ``tokens``
    is 1, so the trainer's ``loss_sum / tokens`` is the loss; ``ar_loss_sum / ar_tokens`` is the verifier's exact
    next-token NLL (the twin's tokens, ``autoregressive.scored``), ``draft_loss_sum / draft_tokens`` the drafter's
    cross-entropy per target token of the draft half (``TARGET`` and ``DISTILLED``) and ``draft_kl_sum /
    draft_tokens`` its KL to the clean half (module docstring; computed whatever λ). The ``*_sum`` and ``*_tokens``
    entries add up over batches.
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

  draft_logits = masked_diffusion.without_mask_class(draft_logits, cfg.mask_id)
  nll = token_nll(draft_logits, x)  # [batch, length]
  nll = jnp.where(is_masked, nll, 0.0).reshape(batch, -1, cfg.draft_length)  # [batch, blocks, k]
  draft_sum = (weight * nll.sum(axis=-1)).sum()
  draft_tokens = ((kinds == K.TARGET) | (kinds == K.DISTILLED)).sum().astype(jnp.float32)
  kl = head_kl(clean_logits, draft_logits, cfg.mask_id)  # [batch, length]: 0 at position 0
  has_teacher = jnp.pad(kinds[:, :-1] != K.PAD, ((0, 0), (1, 0)))  # position i - 1 exists and is text
  kl_sum = jnp.where(is_masked & has_teacher, kl, 0.0).sum()

  ar_nll = token_nll(clean_logits[:, :-1].astype(jnp.float32), x[:, 1:])  # [batch, length - 1]: i predicts i + 1
  scored = autoregressive.scored(kinds)[:, 1:]
  ar_sum = jnp.where(scored, ar_nll, 0.0).sum()
  ar_tokens = scored.sum().astype(jnp.float32)

  alpha = cfg.ar_weight
  l_ar, l_draft = ar_sum / jnp.maximum(ar_tokens, 1.0), draft_sum / jnp.maximum(draft_tokens, 1.0)
  l_draft = l_draft + cfg.draft_kl_weight * kl_sum / jnp.maximum(draft_tokens, 1.0)
  return {
    "loss_sum": (alpha * l_ar + l_draft) / (1.0 + alpha),
    "tokens": jnp.ones((), jnp.float32),
    "masked": is_masked.sum().astype(jnp.float32),
    "ar_loss_sum": ar_sum,
    "ar_tokens": ar_tokens,
    "draft_loss_sum": draft_sum,
    "draft_kl_sum": kl_sum,
    "draft_tokens": draft_tokens,
  }


def head_kl(clean_logits: jax.Array, draft_logits: jax.Array, mask_id: int) -> jax.Array:
  """``KL(p_i || q_i)`` per position ``i``: the clean half's next-token distribution at ``i - 1`` (stop-gradient)
  against the drafter's at ``i``, both without the mask class; ``[batch, length]``, 0 at position 0.

  Args:
    clean_logits: the clean half's logits, ``[batch, length, vocab]``.
    draft_logits: the draft half's float32 logits with the mask class at ``-inf``, ``[batch, length, vocab]``.
    mask_id: the mask class.
  """
  teacher = masked_diffusion.masked_log_probs(jax.lax.stop_gradient(clean_logits[:, :-1]), mask_id)
  student = jax.nn.log_softmax(draft_logits[:, 1:], axis=-1)
  # Both are -inf at the mask class only, where the teacher's probability is 0: that term is 0.
  terms = jnp.where(jnp.isfinite(teacher), jnp.exp(teacher) * (teacher - student), 0.0)
  return jnp.pad(terms.sum(axis=-1), ((0, 0), (1, 0)))  # [batch, length]
