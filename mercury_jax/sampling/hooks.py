"""What structured output and token healing add to a step, as hooks of the engine with named contracts.

The step body calls every active hook at the same points, in this order:

* ``logits(st, view, logits) -> logits``: before the proposals (token healing restricts its one position);
* ``propose(st, view, logits, x0, confidence) -> (x0, confidence, st)``: after the unconstrained proposals
  (structured output replaces a constrained row's proposals by the best valid string of its block);
* ``after_commit(st, view, z_b) -> (z_b, forced, st)``: after the rule's commits (forced tokens the commits
  exposed are committed without the model);
* ``enter(st, advance, z, score) -> (z, score, st)``: when rows move to their next block (its forced tokens go in);
* ``release(st, slot) -> st``: when a serving engine gives a row up (the row's constraint is cleared, so nothing of
  it runs again).

A hook is active when its part of the state is present (``State.constraint``, ``State.healing``); rows it does not
concern are untouched, and nothing of it runs when no row needs it (each piece sits behind a ``lax.cond``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mercury_jax.constrain import device as constrained
from mercury_jax.sampling.plan import BlockPlan
from mercury_jax.sampling.proposal import clean_logits, uniform_noise
from mercury_jax.sampling.settings import SamplerSettings
from mercury_jax.sampling.state import Constraint, State, put, rows

CLASS_NOISE = 0x636C  # Folded into a step's key for a constrained row's class scores (``constrain.device``).


class View(NamedTuple):
  """The step block of every row, as the body sees it before the rule."""

  starts: jax.Array  # [b] first slot of the block
  z: jax.Array  # [b, B] its tokens
  open: jax.Array  # [b, B] masked positions still to generate
  has_open: jax.Array  # [b]
  keys: jax.Array  # [b] the step's PRNG keys
  noise: jax.Array  # [b, B, width] the proposals' uniforms


class Structured:
  """Structured output: each constrained row's automaton state is carried from block to block
  (``Constraint.dfa``, the state before the row's step block), its proposals are the most probable valid string of
  its block (a dynamic program over positions x states, :func:`mercury_jax.constrain.device.propose`), and tokens
  that are the only one their state allows are committed without the model, when the row enters a block and after
  every commit, so a block of fixed text costs no step of the model."""

  def __init__(self, plan: BlockPlan, settings: SamplerSettings):
    self.plan, self.settings = plan, settings

  def start(self, tables: constrained.Tables, target, eos_banned, z, first_block):
    """The constraint part of the initial state, and the canvas with the first block's forced tokens:
    ``(constraint, z, eos_banned)``. A row's budget is whether its automaton can accept within its hole."""
    tables = jax.tree.map(jnp.asarray, tables)
    room = target.sum(axis=1, dtype=jnp.int32)
    least = jnp.take_along_axis(tables.distance, tables.start[:, None], axis=1)[:, 0]
    tables = tables._replace(budgeted=tables.on & (least <= room))
    eos_banned &= ~tables.on[:, None]  # The automaton says where text ends.
    dfa = jnp.where(tables.on, tables.start, 0)
    z = self._force(tables, dfa, z, target, first_block * self.plan.block)[0]
    return Constraint(tables, dfa, dfa, jnp.zeros((), jnp.int32)), z, eos_banned

  def _force(self, tables, dfa, z, target, starts):
    """``(z, forced, end)``: the forced tokens of every row's block at ``starts`` committed."""
    block = self.plan.block
    z_b, forced, end = constrained.force(
      tables, dfa, rows(z, starts, block), rows(target, starts, block), self.settings.mask_id
    )
    return put(z, starts, z_b), forced, end

  def logits(self, st: State, view: View, logits):
    return logits

  def propose(self, st: State, view: View, logits, x0, confidence):
    settings, block, c = self.settings, self.plan.block, st.constraint
    hole = rows(st.target, view.starts, block)
    end = self.plan.slots - jnp.argmax(st.target[:, ::-1], axis=1)  # [b] one past the hole's last slot
    remaining = end[:, None] - (view.starts[:, None] + jnp.arange(block)[None, :]) - 1

    def run():
      clean = clean_logits(logits, rows(st.eos_banned, view.starts, block), settings)
      class_keys = jax.vmap(lambda k: jax.random.fold_in(k, CLASS_NOISE))(view.keys)
      # Drawn [classes, B]: a draw is a prefix of a longer one along its first axis, so a row's noise does not
      # depend on the capacity its batch pads the classes to.
      class_noise = jnp.swapaxes(uniform_noise(class_keys, (c.tables.table.shape[2], block)), 1, 2)
      y, found = constrained.propose(
        c.view(), c.dfa, clean, st.knobs, view.z, hole, remaining, view.noise, class_noise, settings.mask_id
      )
      use = found[:, None] & hole
      conf = confidence
      if settings.confidence == "prob":
        log_z = jax.nn.logsumexp(clean, axis=-1)
        conf = jnp.where(use, jnp.exp(jnp.take_along_axis(clean, y[..., None], axis=-1)[..., 0] - log_z), conf)
      return jnp.where(use, y, x0), conf

    active = jnp.any(c.on & view.has_open)
    x0, confidence = jax.lax.cond(active, run, lambda: (x0, confidence))
    return x0, confidence, st._replace(constraint=c._replace(passes=c.passes + active.astype(jnp.int32)))

  def allowed_along(self, st: State, view: View, x0):
    """[b, B, vocab] bool: the tokens each position's automaton state allows after the block's earlier tokens and
    proposals ``x0`` (the continuous rule's restriction of its denoiser, :mod:`~mercury_jax.sampling.latents`); every
    token where the row is unconstrained, the position lies outside the hole or the path has left the automaton."""
    tables, block = st.constraint.view(), self.plan.block
    hole = rows(st.target, view.starts, block)
    tokens = jnp.where(view.open, x0, view.z)

    def visit(s, inputs):
      token, hole_i = inputs
      known = tables.on & hole_i & (s >= 0)
      after = jnp.take_along_axis(_state_rows(tables.table, jnp.maximum(s, 0)), tables.classes, axis=1)  # [b, V]
      allowed = (after >= 0) | ~known[:, None]
      return jnp.where(hole_i, constrained.step(tables, s, token), s), allowed

    _, allowed = jax.lax.scan(visit, st.constraint.dfa, (tokens.T, hole.T))
    return jnp.swapaxes(allowed, 0, 1)

  def after_commit(self, st: State, view: View, z_b):
    c = st.constraint
    active = jnp.any(c.on)
    hole = rows(st.target, view.starts, self.plan.block)
    z_b, forced, end = jax.lax.cond(
      active,
      lambda: constrained.force(c.view(), c.dfa, z_b, hole, self.settings.mask_id),
      lambda: (z_b, jnp.zeros(z_b.shape, bool), c.dfa),
    )
    return z_b, forced, st._replace(constraint=c._replace(end=end, passes=c.passes + active.astype(jnp.int32)))

  def enter(self, st: State, advance, z, score):
    c = st.constraint
    dfa = jnp.where(advance & c.on, c.end, c.dfa)
    upcoming = jnp.minimum(st.first + st.block + advance.astype(jnp.int32), st.last) * self.plan.block
    forced_z = jax.lax.cond(
      jnp.any(c.on & advance), lambda: self._force(c.view(), dfa, z, st.target, upcoming)[0], lambda: z
    )
    score = jnp.where(advance[:, None] & (forced_z != z), 1.0, score)
    z = jnp.where(advance[:, None], forced_z, z)
    return z, score, st._replace(constraint=c._replace(dfa=dfa))

  def release(self, st: State, slot) -> State:
    c = st.constraint
    return st._replace(
      constraint=c._replace(tables=c.tables._replace(on=c.tables.on.at[slot].set(False)), dfa=c.dfa.at[slot].set(0))
    )


class Healed:
  """Token healing: the position of a prompt's backed-off last token may only take the tokens whose text starts
  with that token's characters (``Healing.allowed``, :func:`mercury_jax.sampling.healing.allowed_tokens`); a
  one-position token mask, no automaton."""

  def __init__(self, plan: BlockPlan, settings: SamplerSettings):
    self.plan, self.settings = plan, settings

  def logits(self, st: State, view: View, logits):
    h = st.healing
    here = (view.starts[:, None] + jnp.arange(self.plan.block)[None, :]) == h.slot[:, None]  # [b, B]

    def restrict():
      return jnp.where(here[..., None] & ~h.allowed[:, None, :], -jnp.inf, logits)

    return jax.lax.cond(jnp.any(here & view.open), restrict, lambda: logits)

  def propose(self, st: State, view: View, logits, x0, confidence):
    return x0, confidence, st

  def after_commit(self, st: State, view: View, z_b):
    return z_b, jnp.zeros(z_b.shape, bool), st

  def enter(self, st: State, advance, z, score):
    return z, score, st

  def release(self, st: State, slot) -> State:
    h = st.healing
    return st._replace(healing=h._replace(slot=h.slot.at[slot].set(-1)))


def _state_rows(table: jax.Array, state: jax.Array) -> jax.Array:
  """``table[r, state[r]]`` for every row: [b, S, C], [b] -> [b, C]."""
  return jnp.take_along_axis(table, state[:, None, None], axis=1)[:, 0]


def active_hooks(st: State, plan: BlockPlan, settings: SamplerSettings) -> list:
  """The hooks whose part of ``st`` is present, in the order the body calls them."""
  hooks = []
  if st.healing is not None:
    hooks.append(Healed(plan, settings))
  if st.constraint is not None:
    hooks.append(Structured(plan, settings))
  return hooks
