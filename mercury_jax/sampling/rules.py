"""Step rules: small pure functions that decide, in one refinement step, which masked positions to commit.

Every rule has the signature ``rule(StepInputs) -> StepOutput`` and is plugged into the one decoding loop
(``mercury_jax.sampling.engine``). The loop computes everything a rule may need (proposals, confidences, the
schedule's commit count and times) and enforces the invariants afterwards: only open positions are committed, only
positions committed at earlier steps of the open block are re-masked, and at a block's last step everything open is
committed and nothing re-masked. A rule therefore cannot break termination, touch fixed tokens or reopen a finished
block.

Revision (``settings.revision = eta > 0``) is ReMDM's re-masking posterior inside :func:`ancestral`, and a
deterministic low-confidence re-masking (:func:`low_confidence_remasking`) around the confidence and threshold rules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mercury_jax.config import ObjectiveConfig
from mercury_jax.objectives import masked_diffusion
from mercury_jax.sampling.settings import SamplerSettings


class StepInputs(NamedTuple):
  """What the loop hands a rule at one step; every array is per example.

  Attributes:
    x0: Proposed token at every position, int32 [batch, length].
    confidence: Its confidence (probability, margin or negative entropy), float32 [batch, length].
    open: Masked positions inside the current block: the only ones a rule may commit, bool [batch, length].
    committed: Generated positions of the open block (while it has a masked position left) committed
      at earlier steps: the only ones a rule may re-mask, bool [batch, length].
    score: The confidence each committed position had when it was committed, float32 [batch, length].
    k: The confidence schedule's commit count, ``ceil(open / steps_left)``, int32 [batch].
    steps_left: Steps left for the block, this one included (>= 1), int32 [batch].
    block_steps: Steps the block has in all, int32 [batch].
    t: The block's diffusion time now, in (0, 1], float32 [batch].
    s: Its time after this step, ``0 <= s < t``, float32 [batch].
    u: Uniform noise in [0, 1) for the rule's own random decisions, float32 [batch, length].
    threshold: The threshold rule's bar per example, float32 [batch] (the block engine's per-row knob); None: the
      settings' ``threshold``.
  """

  x0: jax.Array
  confidence: jax.Array
  open: jax.Array
  committed: jax.Array
  score: jax.Array
  k: jax.Array
  steps_left: jax.Array
  block_steps: jax.Array
  t: jax.Array
  s: jax.Array
  u: jax.Array
  threshold: jax.Array | None = None


class StepOutput(NamedTuple):
  """A rule's decision: ``commit`` open positions to their proposals, ``remask`` committed ones ([b, l] bool)."""

  commit: jax.Array
  remask: jax.Array


Rule = Callable[[StepInputs], StepOutput]


def top_k_mask(values: jax.Array, k: jax.Array) -> jax.Array:
  """Marks the ``k[b]`` largest entries of each row of ``values`` [b, l]; ties go to the lower index."""
  order = jnp.argsort(values, axis=-1, descending=True, stable=True)
  ranks = jnp.argsort(order, axis=-1)  # [b, l], 0 for the largest
  return ranks < k[:, None]


def _no_remask(inputs: StepInputs) -> jax.Array:
  return jnp.zeros_like(inputs.open)


def ancestral(schedule: ObjectiveConfig, eta: float = 0.0) -> Rule:
  """The reverse step of absorbing-state diffusion from time t to s < t, with ReMDM re-masking when ``eta > 0``.

  With ``eta = 0`` this is the exact MDLM/MD4 posterior step (Sahoo et al. 2024): under the SUBS parameterisation a
  masked position is unmasked with probability ``(alpha_s - alpha_t) / (1 - alpha_t)``, its token drawn from the
  model's clean-token distribution (the loop's proposal at temperature 1), and committed tokens stay.

  With ``eta > 0`` it samples ReMDM's re-masking posterior (Wang et al. 2025, "Remasking Discrete Diffusion Models
  with Inference-Time Scaling", arXiv 2503.00307, Eq. 6), with ``x`` the proposal and ``m`` the mask::

    q_sigma(z_s | z_t = x, x) = (1 - sigma_t) x + sigma_t m
    q_sigma(z_s | z_t = m, x) = (alpha_s - (1 - sigma_t) alpha_t) / (1 - alpha_t) x
                                + (1 - alpha_s - sigma_t alpha_t) / (1 - alpha_t) m

  A committed token is re-masked with probability ``sigma_t``; a masked one is unmasked with probability
  ``(alpha_s - (1 - sigma_t) alpha_t) / (1 - alpha_t)``, more than MDLM's by ``sigma_t alpha_t / (1 - alpha_t)``:
  this keeps the expected masked fraction after the step at
  ``1 - alpha_s`` (the marginals of MDLM, so the trained denoiser applies) and spreads re-masked tokens over the
  remaining steps instead of leaving them for the last. ``sigma_t`` is bounded by
  ``sigma_t^max = min(1, (1 - alpha_s) / alpha_t)`` (Eq. 7) and set by ReMDM-rescale (Sec. 4.1):
  ``sigma_t = eta * sigma_t^max``. At the block's last step ``s = 0``, so ``alpha_s = 1``, ``sigma_t = 0`` and
  everything still masked is unmasked. The loop restricts ``committed`` to unfinished blocks: a block whose
  positions are all committed is finished, and its chain stops there.
  """

  def rule(inputs: StepInputs) -> StepOutput:
    alpha_t = masked_diffusion.alpha(inputs.t, schedule)  # [batch]
    alpha_s = masked_diffusion.alpha(inputs.s, schedule)
    # sigma_t^max, with the bound taken as 1 where alpha_t = 0 (nothing is committed at t = 1 anyway).
    sigma_max = jnp.where(alpha_t > 0, jnp.minimum(1.0, (1.0 - alpha_s) / jnp.maximum(alpha_t, 1e-30)), 1.0)
    sigma = eta * sigma_max
    p_unmask = (alpha_s - (1.0 - sigma) * alpha_t) / (1.0 - alpha_t)
    # One uniform per position: a position is either open (masked) or committed, never both.
    commit = inputs.open & (inputs.u < p_unmask[:, None])
    remask = inputs.committed & (inputs.u < sigma[:, None]) if eta else _no_remask(inputs)
    return StepOutput(commit, remask)

  return rule


def most_confident(inputs: StepInputs) -> StepOutput:
  """LLaDA's low-confidence remasking: commit the ``k`` most confident open positions (Nie et al. 2025)."""
  ranked = jnp.where(inputs.open, inputs.confidence, -jnp.inf)
  return StepOutput(top_k_mask(ranked, inputs.k) & inputs.open, _no_remask(inputs))


def above_threshold(tau: float) -> Rule:
  """Fast-dLLM's parallel decoding (Wu et al. 2025): commit every open position with confidence >= tau.

  Never fewer than the schedule's ``k`` (>= 1 while anything is open), so easy spans finish in few steps and the
  step budget still suffices. ``inputs.threshold``, when given, is each example's own tau.
  """

  def rule(inputs: StepInputs) -> StepOutput:
    bar = tau if inputs.threshold is None else inputs.threshold[:, None]
    above = (inputs.open & (inputs.confidence >= bar)).sum(axis=-1)
    ranked = jnp.where(inputs.open, inputs.confidence, -jnp.inf)
    return StepOutput(top_k_mask(ranked, jnp.maximum(above, inputs.k)) & inputs.open, _no_remask(inputs))

  return rule


def low_confidence_remasking(rule: Rule, eta: float) -> Rule:
  """Adds a deterministic low-confidence re-masking of strength ``eta`` to a confidence or threshold ``rule``.

  This is not ReMDM's randomised confidence schedule (ReMDM-conf); it is a deterministic cousin: each step re-masks
  ``eta * committed * (steps_left - 1) / block_steps`` (rounded to the nearest whole number) of the committed tokens
  of the unfinished blocks, those with the lowest commit-time confidence (a SUBS-trained denoiser is not trained to
  predict at unmasked positions, so the score recorded when a token was committed is the signal). The count decays
  to 0 at the block's last step. The schedule's ``k`` grows by the re-masked count, so the block still finishes on
  time.
  """

  def revised(inputs: StepInputs) -> StepOutput:
    num_committed = inputs.committed.sum(axis=-1)
    fraction = eta * (inputs.steps_left - 1) / inputs.block_steps
    n = jnp.floor(fraction * num_committed + 0.5).astype(jnp.int32)  # [batch]
    num_open = inputs.open.sum(axis=-1)
    k = jnp.minimum((num_open + n + inputs.steps_left - 1) // inputs.steps_left, num_open)
    out = rule(inputs._replace(k=k))
    lowest = top_k_mask(jnp.where(inputs.committed, -inputs.score, -jnp.inf), n) & inputs.committed
    return StepOutput(out.commit, out.remask | lowest)

  return revised


DREAM_EPS = 1e-3  # The last time of Dream's grid, linspace(1, eps, steps + 1) (Ye et al. 2025, generation_utils).


def timestep_counts(rule: Rule, eps: float = DREAM_EPS) -> Rule:
  """``rule`` with Dream's commit count: ``floor(open * (1 - s' / t'))`` on the grid ``t' = eps + (1 - eps) t``.

  The engine's times run ``t = 1 - step / steps``, so ``t'`` is Dream's ``linspace(1, eps, steps + 1)[step]``. The
  count may be 0 (an early step of a long block commits nothing); the loop commits whatever is open at the block's
  last step, as Dream's last step does.
  """

  def counted(inputs: StepInputs) -> StepOutput:
    t = eps + (1.0 - eps) * inputs.t
    s = eps + (1.0 - eps) * inputs.s
    num_open = inputs.open.sum(axis=-1).astype(jnp.float32)
    return rule(inputs._replace(k=jnp.floor(num_open * (1.0 - s / t)).astype(jnp.int32)))

  return counted


def at_block_end(inputs: StepInputs) -> StepOutput:
  """The ``ode`` rule of the continuous family: nothing is committed before the block's last step, where the loop
  commits every open position (the latents move instead, :mod:`~mercury_jax.sampling.latents`)."""
  return StepOutput(jnp.zeros_like(inputs.open), _no_remask(inputs))


def make_rule(settings: SamplerSettings) -> Rule:
  """The step rule named by ``settings.rule``, with revision when ``settings.revision > 0``.

  Revision is ReMDM inside the ancestral rule and :func:`low_confidence_remasking` around the others.
  """
  if settings.rule == "ode":
    return at_block_end
  if settings.rule == "ancestral":
    return ancestral(settings.objective, settings.revision)
  if settings.rule == "confidence":
    rule = most_confident
  elif settings.rule == "threshold":
    rule = above_threshold(settings.threshold)
  else:
    raise ValueError(f"sampler {settings.rule!r} is unknown")
  if settings.commit_counts == "timesteps":
    rule = timestep_counts(rule)
  return low_confidence_remasking(rule, settings.revision) if settings.revision > 0 else rule
