"""Step rules: small pure functions that decide, in one refinement step, which masked positions to commit.

Every rule has the signature ``rule(StepInputs) -> StepOutput`` and is plugged into the one sampling loop
(``mercury_jax.sampling.loop``). The loop computes everything a rule may need (proposals, confidences, the
schedule's commit count and times) and enforces the invariants afterwards: only open positions are committed, only
previously committed generated positions are re-masked, and at the last step of a block everything open is
committed. A rule therefore cannot break termination or touch fixed tokens.
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
    open: Masked positions inside the current block window: the only ones a rule may commit, bool [batch, length].
    committed: Generated positions inside the window committed at earlier steps: the only ones a rule may re-mask.
    score: The confidence each committed position had when it was committed, float32 [batch, length].
    k: The confidence schedule's commit count, ``ceil(open / steps_left)``, int32 [batch].
    steps_left: Steps left for the window, this one included (>= 1), int32 [batch].
    window_steps: Steps the window has in all, int32 [batch].
    t: The window's diffusion time now, in (0, 1], float32 [batch].
    s: Its time after this step, ``0 <= s < t``, float32 [batch].
    u: Uniform noise in [0, 1) for the rule's own random decisions, float32 [batch, length].
  """

  x0: jax.Array
  confidence: jax.Array
  open: jax.Array
  committed: jax.Array
  score: jax.Array
  k: jax.Array
  steps_left: jax.Array
  window_steps: jax.Array
  t: jax.Array
  s: jax.Array
  u: jax.Array


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


def ancestral(schedule: ObjectiveConfig) -> Rule:
  """The exact reverse step of absorbing-state diffusion from time t to s < t (MDLM, Sahoo et al. 2024; MD4).

  Under the SUBS parameterisation a masked position is unmasked with probability
  ``(alpha_s - alpha_t) / (1 - alpha_t)``, its token drawn from the model's clean-token distribution (the loop's
  proposal at temperature 1); committed tokens stay. At the window's last step ``s = 0``, so ``alpha_s = 1``.
  """

  def rule(inputs: StepInputs) -> StepOutput:
    alpha_t = masked_diffusion.alpha(inputs.t, schedule)
    alpha_s = masked_diffusion.alpha(inputs.s, schedule)
    p_unmask = (alpha_s - alpha_t) / (1.0 - alpha_t)  # [batch]
    return StepOutput(inputs.open & (inputs.u < p_unmask[:, None]), _no_remask(inputs))

  return rule


def most_confident(inputs: StepInputs) -> StepOutput:
  """LLaDA's low-confidence remasking: commit the ``k`` most confident open positions (Nie et al. 2025)."""
  ranked = jnp.where(inputs.open, inputs.confidence, -jnp.inf)
  return StepOutput(top_k_mask(ranked, inputs.k) & inputs.open, _no_remask(inputs))


def above_threshold(tau: float) -> Rule:
  """Fast-dLLM's parallel decoding (Wu et al. 2025): commit every open position with confidence >= tau.

  Never fewer than the schedule's ``k`` (>= 1 while anything is open), so easy spans finish in few steps and the
  step budget still suffices.
  """

  def rule(inputs: StepInputs) -> StepOutput:
    above = (inputs.open & (inputs.confidence >= tau)).sum(axis=-1)
    ranked = jnp.where(inputs.open, inputs.confidence, -jnp.inf)
    return StepOutput(top_k_mask(ranked, jnp.maximum(above, inputs.k)) & inputs.open, _no_remask(inputs))

  return rule


def with_revision(rule: Rule, eta: float) -> Rule:
  """Adds ReMDM-style revision (Wang et al. 2025, "Remasking Discrete Diffusion Models") to ``rule``.

  Each step re-masks ``floor(eta * committed * (steps_left - 1) / window_steps)`` committed tokens, those with the
  lowest commit-time confidence (ReMDM's confidence strategy: a SUBS-trained denoiser is not trained to predict
  at unmasked positions, so the score recorded when a token was committed is the signal). The count decays to 0 at
  the window's last step. The schedule's ``k`` grows by the re-masked count, so the window still finishes on time.
  """

  def revised(inputs: StepInputs) -> StepOutput:
    num_committed = inputs.committed.sum(axis=-1)
    fraction = eta * (inputs.steps_left - 1) / inputs.window_steps
    n = jnp.floor(fraction * num_committed).astype(jnp.int32)  # [batch]
    num_open = inputs.open.sum(axis=-1)
    k = jnp.minimum((num_open + n + inputs.steps_left - 1) // inputs.steps_left, num_open)
    out = rule(inputs._replace(k=k))
    lowest = top_k_mask(jnp.where(inputs.committed, -inputs.score, -jnp.inf), n) & inputs.committed
    return StepOutput(out.commit, out.remask | lowest)

  return revised


def make_rule(settings: SamplerSettings) -> Rule:
  """The step rule named by ``settings.rule``, with revision when ``settings.revision > 0``."""
  if settings.rule == "ancestral":
    rule = ancestral(settings.objective)
  elif settings.rule == "confidence":
    rule = most_confident
  elif settings.rule == "threshold":
    rule = above_threshold(settings.threshold)
  else:
    raise ValueError(f"sampler {settings.rule!r} is unknown")
  return with_revision(rule, settings.revision) if settings.revision > 0 else rule
