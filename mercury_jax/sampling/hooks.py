"""What structured output and token healing add to a step, as hooks of the engine with named contracts.

Every step rule (:mod:`~mercury_jax.sampling.step`) calls the active hooks at the same points of its step, in this
order, and no code asks a hook for its type:

* ``logits(st, view, logits) -> logits``: before anything reads a window's logits (token healing restricts its one
  position);
* ``allowed(st, slots, tokens, budget) -> [b, n, vocab] bool | None``: the tokens each of ``slots`` may take after
  the ``tokens`` before it (structured output walks its automaton along them; with ``budget``, a token must also
  leave the row's automaton room to accept within its hole); None: no restriction. The verified rule restricts its
  next-token distributions and its drafts with it, the continuous rule its denoiser;
* ``propose(st, view, logits, x0, confidence) -> (x0, confidence, st)``: after the refining rules' unconstrained
  proposals (structured output replaces a constrained row's proposals by the best valid string of its block);
* ``after_commit(st, view, z_w) -> (z_w, forced, st)``: after a refining rule's commits (forced tokens the commits
  exposed are committed without the model);
* ``consume(st, view, z_w, count) -> st``: after a verified step committed the first ``count`` [b] tokens of its
  window (structured output moves its automaton along them);
* ``enter(st, advance, z, score) -> (z, score, st)``: when a refining rule's rows move to their next block (its
  forced tokens go in);
* ``release(st, slot) -> st``: when a serving engine gives a row up (nothing of it runs again).

A hook is active when its part of the state is present (``State.constraint``, ``State.healing``); rows it does not
concern are untouched, and nothing of it runs when no row needs it (each piece sits behind a ``lax.cond``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mercury_jax.sampling import automata as constrained
from mercury_jax.sampling.plan import BlockPlan
from mercury_jax.sampling.proposal import clean_logits, uniform_noise
from mercury_jax.sampling.settings import SamplerSettings
from mercury_jax.sampling.state import Constraint, State, put, rows

CLASS_NOISE = 0x636C  # Folded into a step's key for a constrained row's class scores (``sampling.automata``).


class View(NamedTuple):
  """A step's window of every row, as the rule sees it before it decides."""

  starts: jax.Array  # [b] first slot of the window
  slots: jax.Array  # [b, W] its slots
  z: jax.Array  # [b, W] its tokens
  open: jax.Array  # [b, W] masked positions still to generate
  has_open: jax.Array  # [b]
  keys: jax.Array  # [b] the step's PRNG keys
  noise: jax.Array | None = None  # [b, W, width] the proposals' uniforms (the refining rules)


class Hook:
  """The contract (module docstring), each point a no-op."""

  def __init__(self, plan: BlockPlan, settings: SamplerSettings):
    self.plan, self.settings = plan, settings

  def logits(self, st: State, view: View, logits):
    return logits

  def allowed(self, st: State, slots, tokens, budget: bool):
    return None

  def propose(self, st: State, view: View, logits, x0, confidence):
    return x0, confidence, st

  def after_commit(self, st: State, view: View, z_w):
    return z_w, jnp.zeros(z_w.shape, bool), st

  def consume(self, st: State, view: View, z_w, count) -> State:
    return st

  def enter(self, st: State, advance, z, score):
    return z, score, st

  def release(self, st: State, slot) -> State:
    return st


def _remaining(st: State, slots: jax.Array) -> jax.Array:
  """[b, n] positions of the row's hole after each of ``slots``."""
  end = st.target.shape[1] - jnp.argmax(st.target[:, ::-1], axis=1)  # [b] one past the hole's last slot
  return end[:, None] - slots - 1


class Structured(Hook):
  """Structured output: each constrained row's automaton state is carried from block to block
  (``Constraint.dfa``, the state before the row's step window), a refining rule's proposals are the most probable
  valid string of its block (a dynamic program over positions x states, :func:`mercury_jax.sampling.automata.propose`),
  and tokens that are the only one their state allows are committed without the model, when the row enters a block
  and after every commit, so a block of fixed text costs no step of the model."""

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

  def _walk(self, st: State, slots, tokens) -> jax.Array:
    """[b, n + 1] the automaton states before each of ``slots`` and after the last, along ``tokens`` (positions
    outside the hole leave the state alone)."""
    tables, hole = st.constraint.view(), jnp.take_along_axis(st.target, slots, axis=1)
    states = [st.constraint.dfa]
    for i in range(slots.shape[1]):
      states.append(jnp.where(hole[:, i], constrained.step(tables, states[-1], tokens[:, i]), states[-1]))
    return jnp.stack(states, axis=1)

  def allowed(self, st: State, slots, tokens, budget: bool):
    tables, c = st.constraint.view(), st.constraint
    hole = jnp.take_along_axis(st.target, slots, axis=1)
    states = self._walk(st, slots[:, :-1], tokens[:, :-1])  # [b, n]: the state before each slot
    remaining = _remaining(st, slots)

    def at(state, hole_i, remaining_i):  # [b] -> [b, vocab]
      nxt = jnp.take_along_axis(_state_rows(tables.table, jnp.maximum(state, 0)), tables.classes, axis=1)
      ok = nxt >= 0
      if budget:
        far = jnp.take_along_axis(tables.distance, jnp.maximum(nxt, 0), axis=1)
        ok &= ~tables.budgeted[:, None] | (far <= remaining_i[:, None])
      return ok | ~(c.on & hole_i & (state >= 0))[:, None]

    return jax.vmap(at, in_axes=1, out_axes=1)(states, hole, remaining)

  def propose(self, st: State, view: View, logits, x0, confidence):
    settings, block, c = self.settings, self.plan.block, st.constraint
    hole = rows(st.target, view.starts, block)
    remaining = _remaining(st, view.slots)

    def run():
      clean = clean_logits(logits, rows(st.eos_banned, view.starts, block), settings)
      class_keys = jax.vmap(lambda k: jax.random.fold_in(k, CLASS_NOISE))(view.keys)
      # Drawn [classes, B]: a draw is a prefix of a longer one along its first axis, so a row's noise does not
      # depend on the capacity its batch pads the classes to.
      class_noise = jnp.swapaxes(uniform_noise(class_keys, (c.tables.table.shape[2], block)), 1, 2)
      walk = constrained.Block(c.dfa, view.z, hole, remaining, settings.mask_id)
      y, found = constrained.propose(c.view(), walk, clean, st.knobs, view.noise, class_noise)
      use = found[:, None] & hole
      conf = confidence
      if settings.confidence == "prob":
        log_z = jax.nn.logsumexp(clean, axis=-1)
        conf = jnp.where(use, jnp.exp(jnp.take_along_axis(clean, y[..., None], axis=-1)[..., 0] - log_z), conf)
      return jnp.where(use, y, x0), conf

    active = jnp.any(c.on & view.has_open)
    x0, confidence = jax.lax.cond(active, run, lambda: (x0, confidence))
    return x0, confidence, st._replace(constraint=c._replace(passes=c.passes + active.astype(jnp.int32)))

  def after_commit(self, st: State, view: View, z_w):
    c = st.constraint
    active = jnp.any(c.on)
    hole = rows(st.target, view.starts, self.plan.block)
    z_w, forced, end = jax.lax.cond(
      active,
      lambda: constrained.force(c.view(), c.dfa, z_w, hole, self.settings.mask_id),
      lambda: (z_w, jnp.zeros(z_w.shape, bool), c.dfa),
    )
    return z_w, forced, st._replace(constraint=c._replace(end=end, passes=c.passes + active.astype(jnp.int32)))

  def consume(self, st: State, view: View, z_w, count) -> State:
    c = st.constraint
    after = jnp.take_along_axis(self._walk(st, view.slots, z_w), count[:, None], axis=1)[:, 0]
    dfa = jnp.where((count > 0) & c.on, after, c.dfa)
    return st._replace(constraint=c._replace(dfa=dfa, end=dfa, passes=c.passes + 1))

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


class Healed(Hook):
  """Token healing: the position of a prompt's backed-off last token may only take the tokens whose text starts with
  that token's characters (``Healing.allowed``, :func:`mercury_jax.sampling.healing.allowed_tokens`); a
  one-position token mask, no automaton."""

  def logits(self, st: State, view: View, logits):
    h = st.healing
    here = view.slots == h.slot[:, None]  # [b, W]

    def restrict():
      return jnp.where(here[..., None] & ~h.allowed[:, None, :], -jnp.inf, logits)

    return jax.lax.cond(jnp.any(here & view.open), restrict, lambda: logits)

  def release(self, st: State, slot) -> State:
    h = st.healing
    return st._replace(healing=h._replace(slot=h.slot.at[slot].set(-1)))


def _state_rows(table: jax.Array, state: jax.Array) -> jax.Array:
  """``table[r, state[r]]`` for every row: [b, S, C], [b] -> [b, C]."""
  return jnp.take_along_axis(table, state[:, None, None], axis=1)[:, 0]


class Hooks:
  """The hooks whose part of ``st`` is present, in the order a step calls them, behind one interface: each point
  runs every hook in turn (``allowed``: the intersection of what they allow)."""

  def __init__(self, st: State, plan: BlockPlan, settings: SamplerSettings):
    self.hooks = []
    if st.healing is not None:
      self.hooks.append(Healed(plan, settings))
    if st.constraint is not None:
      self.hooks.append(Structured(plan, settings))

  def logits(self, st: State, view: View, logits):
    for hook in self.hooks:
      logits = hook.logits(st, view, logits)
    return logits

  def allowed(self, st: State, slots, tokens, budget: bool):
    allowed = None
    for hook in self.hooks:
      mine = hook.allowed(st, slots, tokens, budget)
      allowed = mine if allowed is None else allowed if mine is None else allowed & mine
    return allowed

  def propose(self, st: State, view: View, logits, x0, confidence):
    for hook in self.hooks:
      x0, confidence, st = hook.propose(st, view, logits, x0, confidence)
    return x0, confidence, st

  def after_commit(self, st: State, view: View, z_w):
    forced = jnp.zeros(z_w.shape, bool)
    for hook in self.hooks:
      z_w, more, st = hook.after_commit(st, view, z_w)
      forced |= more
    return z_w, forced, st

  def consume(self, st: State, view: View, z_w, count) -> State:
    for hook in self.hooks:
      st = hook.consume(st, view, z_w, count)
    return st

  def enter(self, st: State, advance, z, score):
    for hook in self.hooks:
      z, score, st = hook.enter(st, advance, z, score)
    return z, score, st

  def release(self, st: State, slot) -> State:
    for hook in self.hooks:
      st = hook.release(st, slot)
    return st
