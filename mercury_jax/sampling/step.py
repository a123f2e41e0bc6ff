"""The step rule protocol: what a rule is given (:class:`~mercury_jax.sampling.hooks.View`, the cache strategy's
:class:`~mercury_jax.sampling.caches.Forward`) and what it returns (:class:`Decision`), and the rule a plan decodes
with (:func:`step_rule`).

A step of the engine reads: the rule says what it needs of the network (:meth:`StepRule.needs`), the cache strategy
runs it, the rule decides what to commit (:meth:`StepRule.decide`), and the engine's one tail writes the window,
ends holes at EOS, records the trace, counts the passes and moves rows on
(:meth:`~mercury_jax.sampling.engine.BlockEngine.step`). The rules:

* :class:`~mercury_jax.sampling.refine.Refine`: the discrete family's refinement of a block (confidence, threshold,
  ancestral, revision; :mod:`~mercury_jax.sampling.rules` picks the positions);
* :class:`~mercury_jax.sampling.latents.Flow`: the continuous family's probability-flow ODE over a block's latents;
* :class:`~mercury_jax.sampling.verify.Verify`: verified decoding's speculative acceptance of drafts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from mercury_jax.sampling.hooks import Hooks, View
from mercury_jax.sampling.state import State

if TYPE_CHECKING:
  from mercury_jax.sampling.caches import Forward, Needs


class Decision(NamedTuple):
  """What a rule's step did to its window ``[starts, starts + W)`` of every row (the engine writes it).

  Attributes:
    st: The state with the rule's own fields moved (its hooks' state, ``logits``, drafts, latents).
    z: [b, W] the window's tokens after the step.
    commit: [b, W] bool: positions committed this step (the trace counts them; their ``score`` is written).
    remask: [b, W] bool: positions masked again.
    confidence: [b, W] the score of each committed position.
    finished: [b] int32: the blocks of the window the row is done with (final tokens, their EOS ends the hole): 0 or
      1 for a block, the committed tokens for a rule over blocks of one token.
    worked: [b] bool: the row had a position to work on (its trace records a frame).
    proposal: [b, P] what the step proposes at the undecided positions (a stream's draft).
    preview: [b, W] what a trace frame shows at the window's still-masked positions, or None (masks).
    extra: [b] int32 forward passes beyond the cache strategy's (classifier-free guidance, Heun's correction).
    cache: The key-value cache after the rule's own writes (verified decoding writes the accepted path's keys and
      values), or None: the cache strategy's.
  """

  st: State
  z: jax.Array
  commit: jax.Array
  remask: jax.Array
  confidence: jax.Array
  finished: jax.Array
  worked: jax.Array
  proposal: jax.Array
  preview: jax.Array | None = None
  extra: jax.Array | int = 0
  cache: object = None


class StepRule:
  """A rule of the one step (module docstring).

  Attributes:
    width: W, the slots of a row's window.
  """

  width: int

  def empty(self, batch: int) -> dict:
    """The rule's own fields of the initial state (``proposal``, and ``draft`` or ``latent``)."""
    raise NotImplementedError

  def key_position(self, starts: jax.Array) -> jax.Array:
    """[b] what a step's key folds in (its randomness is a function of the row's key and this position)."""
    raise NotImplementedError

  def needs(self, st: State, view: View) -> tuple[Needs, State]:
    """What the step needs of the network, and the state with what the rule draws before the pass."""
    raise NotImplementedError

  def decide(self, params, st: State, view: View, needs: Needs, forward: Forward, hooks: Hooks) -> Decision:
    raise NotImplementedError

  def enter(self, st: State, hooks: Hooks, advance: jax.Array, z: jax.Array, score: jax.Array):
    """``(z, score, st)`` once rows moved on (``advance`` [b] bool): the hooks' ``enter`` for a block rule."""
    return z, score, st


def no_tokens(batch: int, width: int) -> jax.Array:
  return jnp.zeros((batch, width), jnp.int32)
