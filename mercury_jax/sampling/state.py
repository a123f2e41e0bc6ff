"""The decoding engine's loop state (:class:`State`), each field's batch axis declared once (:data:`AXES`), and the
row moves every program shares: :func:`take_rows`, :func:`put_rows`, :func:`select_rows`, :func:`insert_row`,
:func:`repeat_rows` and :func:`constrain_rows`, one ``tree_map`` over :data:`AXES` each.

A field is a plain array (or a pytree of them) with its rows on one axis, or an object that moves its own rows
(the key-value caches, structured output's automata): it has the methods ``take_rows``, ``put_rows``,
``select_rows``, ``insert_row`` and ``repeat_rows``. A state of the hooks declares its own fields' axes the same way
(``AXES`` as a class attribute), so adding a field means adding one line here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from mercury_jax import sharding as sh
from mercury_jax.sampling.automata import Tables
from mercury_jax.sampling.proposal import Knobs


class Axis:
  """Where a field keeps its rows.

  Attributes:
    index: The batch axis of its arrays; None: a counter of the whole batch (a step's result).
    stepped: A step may change it; False: set when a row is laid out and never changed by a step, so a bucket's
      step does not write it back (:func:`put_rows`).
  """

  def __init__(self, index: int | None, stepped: bool = True, name: str = ""):
    self.index, self.stepped, self.name = index, stepped, name

  def __repr__(self) -> str:
    return self.name


ROW = Axis(0, name="ROW")
FIXED = Axis(0, stepped=False, name="FIXED")
FRAMES = Axis(1, name="FRAMES")  # the trace: [frames, b, ...]
COUNTER = Axis(None, name="COUNTER")


class Constraint(NamedTuple):
  """Structured output's part of the state (:mod:`mercury_jax.sampling.hooks`).

  A batch bucket (:func:`take_rows`) keeps the whole batch's automata (a few hundred KiB a row) and the bucket's
  ``rows`` of them: the hooks gather a row's tables (:meth:`view`) only where some row is constrained.
  """

  tables: Tables  # the rows' automata; ``tables.on`` [b] marks the constrained rows
  dfa: jax.Array  # [b] the automaton state before the row's step block (0 for unconstrained rows)
  end: jax.Array  # [b] the state after the step block's last commit (the next block's ``dfa`` once the row advances)
  passes: jax.Array  # [] steps that ran the constrained proposals or the forced-token walk (a waste counter)
  rows: jax.Array | None = None  # [b] the rows of ``tables`` that are this state's; None: the same rows

  def view(self) -> Tables:
    """The automata of the state's rows (a gather for a bucket: take it behind a ``lax.cond`` on :attr:`on`)."""
    return self.tables if self.rows is None else jax.tree.map(lambda a: a[self.rows], self.tables)

  @property
  def on(self) -> jax.Array:
    """[b] bool: the state's constrained rows."""
    return self.tables.on if self.rows is None else self.tables.on[self.rows]

  def take_rows(self, rows: jax.Array) -> Constraint:
    taken = rows if self.rows is None else self.rows[rows]
    return Constraint(self.tables, self.dfa[rows], self.end[rows], self.passes, taken)

  def put_rows(self, rows: jax.Array, part: Constraint) -> Constraint:
    """The automata stay (no step changes them); the states and the counter are the part's."""
    return self._replace(dfa=self.dfa.at[rows].set(part.dfa), end=self.end.at[rows].set(part.end), passes=part.passes)

  def select_rows(self, keep: jax.Array, other: Constraint) -> Constraint:
    return self._replace(dfa=jnp.where(keep, self.dfa, other.dfa), end=jnp.where(keep, self.end, other.end))

  def insert_row(self, slot: jax.Array, row: Constraint, table: jax.Array | None) -> Constraint:
    at = lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r.astype(a.dtype), slot, axis=0)  # noqa: E731
    return Constraint(jax.tree.map(at, self.tables, row.tables), at(self.dfa, row.dfa), at(self.end, row.end),
                      self.passes)  # fmt: skip

  def repeat_rows(self, n: int) -> Constraint:
    repeat = lambda a: jnp.repeat(a, n, axis=0)  # noqa: E731
    return Constraint(jax.tree.map(repeat, self.tables), repeat(self.dfa), repeat(self.end), self.passes)


class Healing(NamedTuple):
  """Token healing's part of the state: one position of a row may only take some tokens."""

  allowed: jax.Array  # [b, vocab] bool: the tokens the healed position may take
  slot: jax.Array  # [b] int32: the healed position's slot; -1: the row heals nothing (or has written it)


Healing.AXES = Healing(FIXED, ROW)  # its fields' row axes (state.py's row moves read them)


class Draft(NamedTuple):
  """Verified decoding's part of the state (:mod:`mercury_jax.sampling.verify`): the drafts the next step verifies
  (the drafter's; the lookup candidates come from the row's text at the step, :mod:`mercury_jax.sampling.drafts`)."""

  tokens: jax.Array  # [b, k - 1] int32: drafts for the slots ``starts .. starts + k - 2`` (the row's next positions)
  probs: jax.Array  # [b, k - 1, vocab] float32: the distributions they were drawn from (q, after the knobs)
  count: jax.Array  # [b] int32: how many of them are drafts (0 before the first step, after an EOS or an outcome
  # without a pre-draft block)
  accepted: jax.Array  # [b, W] int32: steps of the row that accepted and committed 0, 1, ..., W - 1 candidates
  alternatives: jax.Array  # [b, k - 1, R] int32: each draft position's R likeliest other tokens (the tree's ranks)
  confidence: jax.Array  # [b, k - 1, 1 + R] float32: the drafter's top probability there, then each alternative's
  sources: jax.Array  # [b, 3] int32: accepted candidates taken from the chain, an alternative, the lookup chain


class Latents(NamedTuple):
  """The continuous family's part of the state (:mod:`mercury_jax.sampling.latents`): the step block's latents."""

  z: jax.Array  # [b, B, d] float32: the open positions' latents at the step's noise level (drawn at the block's start)
  estimate: jax.Array  # [b, B, d] float32: the last estimate of the clean latents (self-conditioning's input)


class State(NamedTuple):
  """The loop state carried between chunks (a pytree; its fields' row axes are :data:`AXES`)."""

  z: jax.Array  # [b, S] tokens in slots (the mask id at open positions)
  target: jax.Array  # [b, S] the canvas's TARGET slots (holes)
  generate: jax.Array  # [b, S] TARGET slots still to generate (not after an EOS of their hole)
  segments: jax.Array  # [b, S] 1 for live slots, 0 for padding and positions after an EOS
  positions: jax.Array  # [b, S] rotary positions (canvas positions)
  eos_banned: jax.Array  # [b, S] min_length
  score: jax.Array  # [b, S] confidence of each generated token when it was committed
  first: jax.Array  # [b] the row's first block with a position to generate
  last: jax.Array  # [b] its last one
  example_keys: jax.Array  # [b] PRNG keys
  block: jax.Array  # [b] the row's step block index ``j`` (it works on block ``min(first + j, last)``)
  step: jax.Array  # [b] step within the block
  fresh: jax.Array  # [b] bool: the block's first step is next
  changed: jax.Array  # [b] bool: the block changed since its last forward pass
  logits: jax.Array  # [b, B, vocab] the last forward pass's logits of the block
  proposal: jax.Array  # [b, P] the last step's proposed tokens in its window (a draft's undecided positions)
  cache: Any  # the key-value cache (``mercury_jax.kvcache``: dense or paged; ``()`` without one)
  num_steps: jax.Array  # [b] steps per block
  extra_steps: jax.Array  # [b] the row's first ``extra_steps`` step blocks take one step more (a total budget's rest)
  knobs: Knobs  # [b] each: temperature, top-k, top-p, threshold
  nfe: jax.Array  # [b] steps in which the row needed a forward pass (a pass it ran while it had a masked position)
  forwards: jax.Array  # [] steps that ran the network (prefill not included)
  commit_passes: jax.Array  # [] of which ran the exact cache's commit pass of a finished block
  iterations: jax.Array  # [] loop iterations (steps, forward or not)
  recorded: jax.Array  # [b] steps in which the row had an open position (frames of its trace)
  trace: tuple[jax.Array, ...]  # (canvases, commits, remasks) in slot space, or ()
  constraint: Constraint | None  # structured output, or None: no row is constrained
  healing: Healing | None  # token healing, or None: no row heals
  draft: Draft | None = None  # verified decoding, or None
  latent: Latents | None = None  # continuous latent diffusion, or None


AXES = State(
  z=ROW, target=FIXED, generate=ROW, segments=ROW, positions=FIXED, eos_banned=FIXED, score=ROW, first=FIXED,
  last=FIXED, example_keys=FIXED, block=ROW, step=ROW, fresh=ROW, changed=ROW, logits=ROW, proposal=ROW, cache=ROW,
  num_steps=FIXED, extra_steps=FIXED, knobs=FIXED, nfe=ROW, forwards=COUNTER, commit_passes=COUNTER,
  iterations=COUNTER, recorded=ROW, trace=FRAMES, constraint=ROW, healing=ROW, draft=ROW, latent=ROW,
)  # fmt: skip
"""Each :class:`State` field's row axis: written once, read by every row move."""


def _absent(value) -> bool:
  return value is None or (isinstance(value, tuple) and not value)


def _each(axis: Axis, value, objects, arrays):
  """One field's move: ``objects(value)`` for an object that moves its own rows, a recursion into a hook state's own
  :data:`AXES`, or ``arrays(array, axis index)`` on every array of a plain pytree."""
  if _absent(value):
    return value
  if hasattr(value, "take_rows"):
    return objects(value)
  if hasattr(value, "AXES"):
    return jax.tree.map(lambda a, v: _each(a, v, objects, arrays), value.AXES, value)
  return jax.tree.map(lambda a: arrays(a, axis.index), value)


def constrain_rows(st: State) -> State:
  """``st`` with every array's row axis split over the mesh's data axes (:func:`mercury_jax.sharding.constrain`; a
  no-op outside a mesh). A state laid out from constants (``jnp.zeros``) has nothing that ties it to the rows' devices,
  and GSPMD would replicate it: every device holding the whole batch's logits."""

  def rows(a: jax.Array, axis: int) -> jax.Array:
    if a.ndim <= axis:
      return a
    return sh.constrain(a, (None,) * axis + (sh.BATCH,) + (None,) * (a.ndim - axis - 1))

  def one(axis: Axis, value):
    return value if axis is COUNTER else _each(axis, value, lambda o: o, rows)

  return jax.tree.map(one, AXES, st)


def take_rows(st: State, rows: jax.Array) -> State:
  """The rows ``rows`` [n] (distinct) of ``st`` alone: a serving engine's batch bucket (a paged cache keeps its pool,
  structured output its automata; the batch counters are ``st``'s)."""

  def take(axis: Axis, value):
    if axis is COUNTER:
      return value
    return _each(axis, value, lambda o: o.take_rows(rows), lambda a, i: jnp.take(a, rows, axis=i))

  return jax.tree.map(take, AXES, st)


def put_rows(st: State, rows: jax.Array, part: State) -> State:
  """``st`` after a step over :func:`take_rows` ``(st, rows)``: ``part``'s rows written back (not the fields no step
  changes), its batch counters and its paged pool taken."""

  def put(axis: Axis, mine, theirs):
    if axis is COUNTER:
      return theirs
    if not axis.stepped:
      return mine
    if _absent(mine) or hasattr(mine, "take_rows"):
      return mine if _absent(mine) else mine.put_rows(rows, theirs)
    if hasattr(mine, "AXES"):
      return jax.tree.map(put, mine.AXES, mine, theirs)
    return jax.tree.map(lambda a, b: _at(a, rows, axis.index).set(b), mine, theirs)

  return jax.tree.map(put, AXES, st, part)


def _at(a: jax.Array, rows: jax.Array, axis: int):
  return a.at[(slice(None),) * axis + (rows,)]


def select_rows(keep: jax.Array, new, old):
  """``new`` in the rows ``keep`` [b] marks and ``old`` in the others: a whole state, or a chunk's logits or keys and
  values. A state's batch counters and the fields no step changes are ``new``'s."""

  def pick(a: jax.Array, b: jax.Array, axis: int) -> jax.Array:
    shape = [1] * a.ndim
    shape[axis] = keep.shape[0]
    return jnp.where(keep.reshape(shape), a, b)

  def select(axis: Axis, mine, theirs):
    if axis is COUNTER or not axis.stepped or _absent(mine):
      return mine
    if hasattr(mine, "select_rows"):
      return mine.select_rows(keep, theirs)
    if hasattr(mine, "AXES"):
      return jax.tree.map(select, mine.AXES, mine, theirs)
    return jax.tree.map(lambda a, b: pick(a, b, axis.index), mine, theirs)

  if isinstance(new, State):
    return jax.tree.map(select, AXES, new, old)
  return select(ROW, new, old)


def insert_row(st: State, row: State, slot: jax.Array, table: jax.Array | None = None) -> State:
  """``st`` with the one-row state ``row`` in row ``slot`` (JetStream's insert: a request prefilled alone, then put
  into a free row); the batch counters stay ``st``'s; a paged cache puts the row's keys and values on ``table``."""

  def insert(axis: Axis, mine, theirs):
    if axis is COUNTER or _absent(mine):
      return mine
    if hasattr(mine, "insert_row"):
      return mine.insert_row(slot, theirs, table)
    if hasattr(mine, "AXES"):
      return jax.tree.map(insert, mine.AXES, mine, theirs)
    at = lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r.astype(a.dtype), slot, axis=axis.index)  # noqa: E731
    return jax.tree.map(at, mine, theirs)

  return jax.tree.map(insert, AXES, st, row)


def repeat_rows(row: State, n: int, cache: Any) -> State:
  """A state of ``n`` copies of the one-row state ``row`` over ``cache`` (a serving engine's empty batch)."""

  def repeat(axis: Axis, value):
    if axis is COUNTER:
      return value
    return _each(axis, value, lambda o: o.repeat_rows(n), lambda a, i: jnp.repeat(a, n, axis=i))

  return jax.tree.map(repeat, AXES, row._replace(cache=()))._replace(cache=cache)


def rows(a: jax.Array, starts: jax.Array, size: int) -> jax.Array:
  """``a[r, starts[r] : starts[r] + size]`` for every row ``r`` of ``a`` [b, S, ...]."""
  return jax.vmap(lambda x, s: jax.lax.dynamic_slice_in_dim(x, s, size, axis=0))(a, starts)


def put(a: jax.Array, starts: jax.Array, piece: jax.Array) -> jax.Array:
  """``a`` with ``piece[r]`` written at ``starts[r]`` of every row ``r``."""
  return jax.vmap(lambda x, s, p: jax.lax.dynamic_update_slice_in_dim(x, p, s, axis=0))(a, starts, piece)


def chunk(st: State, starts: jax.Array, size: int, pad: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(tokens, positions, segments)`` of slots ``[starts[r], starts[r] + size)`` of each row; ``pad`` padding slots
  are appended first (a chunk that runs past the last slot reads padding there)."""
  arrays = (st.z, st.positions, st.segments)
  if pad:
    arrays = tuple(jnp.pad(a, ((0, 0), (0, pad))) for a in arrays)
  return tuple(rows(a, starts, size) for a in arrays)
