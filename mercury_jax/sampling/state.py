"""The decoding engine's loop state (:class:`State`) and the per-row slicing every part of the engine shares."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from mercury_jax.constrain import device as constrained
from mercury_jax.kvcache import KVCache, PagedKVCache
from mercury_jax.sampling.proposal import Knobs


class Constraint(NamedTuple):
  """Structured output's part of the state (:mod:`mercury_jax.sampling.hooks`)."""

  tables: constrained.Tables  # the rows' automata; ``tables.on`` [b] marks the constrained rows
  dfa: jax.Array  # [b] the automaton state before the row's step block (0 for unconstrained rows)
  end: jax.Array  # [b] the state after the step block's last commit (the next block's ``dfa`` once the row advances)
  passes: jax.Array  # [] steps that ran the constrained proposals or the forced-token walk (a waste counter)
  # [b] the rows of ``tables`` that are this state's rows: a serving engine's batch bucket (take_rows) keeps the
  # whole batch's tables, a few hundred KiB a row, and gathers its rows' only where a row is constrained. None: the
  # same rows.
  rows: jax.Array | None = None

  def view(self) -> constrained.Tables:
    """The automata of the state's rows: ``tables``, or the bucket's rows of it (a gather: the hooks take it behind a
    ``lax.cond`` on :attr:`on`, so a bucket with no constrained row copies none)."""
    return self.tables if self.rows is None else jax.tree.map(lambda a: a[self.rows], self.tables)

  @property
  def on(self) -> jax.Array:
    """[b] bool: the state's constrained rows."""
    return self.tables.on if self.rows is None else self.tables.on[self.rows]


class Healing(NamedTuple):
  """Token healing's part of the state: one position of a row may only take some tokens."""

  allowed: jax.Array  # [b, vocab] bool: the tokens the healed position may take
  slot: jax.Array  # [b] int32: the healed position's slot; -1: the row heals nothing (or has written it)


class Draft(NamedTuple):
  """Verified decoding's part of the state (:mod:`mercury_jax.sampling.verify`): the drafts the next step verifies."""

  tokens: jax.Array  # [b, k - 1] int32: drafts for the slots ``starts .. starts + k - 2`` (the row's next positions)
  probs: jax.Array  # [b, k - 1, vocab] float32: the distributions they were drawn from (q, after the knobs)
  count: jax.Array  # [b] int32: how many of them are drafts (0 before the first step and after an EOS)
  accepted: jax.Array  # [b, k] int32: steps of the row that accepted and committed 0, 1, ..., k - 1 drafts


class Latents(NamedTuple):
  """The continuous family's part of the state (:mod:`mercury_jax.sampling.latents`): the step block's latents."""

  z: jax.Array  # [b, B, d] float32: the open positions' latents at the step's noise level (drawn at the block's start)
  estimate: jax.Array  # [b, B, d] float32: the last estimate of the clean latents (self-conditioning's input)


class State(NamedTuple):
  """The loop state carried between chunks (a pytree; arrays are per row unless noted)."""

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
  proposal: jax.Array  # [b, B] the last step's proposed tokens in its block (a draft's undecided positions)
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


BATCH_COUNTERS = ("forwards", "commit_passes", "iterations")  # [] counters of the whole batch, not of a row


def _row_axis(name: str) -> int:
  return 1 if name == "trace" else 0  # the trace is [frames, b, ...]


def take_rows(st: State, rows_: jax.Array) -> State:
  """The state of the rows ``rows_`` [n] (distinct) alone: a batch bucket of a serving engine. A paged cache keeps
  its whole pool (the rows read their own pages); the batch counters stay ``st``'s."""
  fields = {}
  for name in State._fields:
    value = getattr(st, name)
    if name in BATCH_COUNTERS or value is None:
      continue
    if isinstance(value, PagedKVCache):
      fields[name] = value.take(rows_)
    elif isinstance(value, KVCache):  # [layers, b, ...] keys and values, [b, S] segments
      fields[name] = KVCache(value.keys[:, rows_], value.values[:, rows_], value.segments[rows_])
    elif name == "constraint":
      taken = rows_ if value.rows is None else value.rows[rows_]
      fields[name] = Constraint(value.tables, value.dfa[rows_], value.end[rows_], value.passes, taken)
    else:
      axis = _row_axis(name)
      fields[name] = jax.tree.map(lambda a, axis=axis: jnp.take(a, rows_, axis=axis), value)
  return st._replace(**fields)


def put_rows(st: State, rows_: jax.Array, part: State) -> State:
  """``st`` after a step over :func:`take_rows` ``(st, rows_)``: ``part``'s rows written back, its batch counters
  and its paged pool taken. The constraint's automata and token healing's allowed tokens, which no step changes,
  are not written back (they are the largest per-row arrays)."""
  fields = {name: getattr(part, name) for name in BATCH_COUNTERS}
  for name in State._fields:
    mine, theirs = getattr(st, name), getattr(part, name)
    if name in BATCH_COUNTERS or mine is None:
      continue
    if isinstance(mine, PagedKVCache):
      fields[name] = mine.put(rows_, theirs)
    elif isinstance(mine, KVCache):
      fields[name] = KVCache(
        mine.keys.at[:, rows_].set(theirs.keys),
        mine.values.at[:, rows_].set(theirs.values),
        mine.segments.at[rows_].set(theirs.segments),
      )
    elif name == "constraint":
      dfa, end = (getattr(mine, f).at[rows_].set(getattr(theirs, f)) for f in ("dfa", "end"))
      fields[name] = mine._replace(dfa=dfa, end=end, passes=theirs.passes)
    elif name == "healing":
      fields[name] = Healing(mine.allowed, mine.slot.at[rows_].set(theirs.slot))
    elif name == "trace":
      fields[name] = jax.tree.map(lambda a, b: a.at[:, rows_].set(b), mine, theirs)
    else:
      fields[name] = jax.tree.map(lambda a, b: a.at[rows_].set(b), mine, theirs)
  return st._replace(**fields)


def where_rows(keep: jax.Array, new: State, old: State) -> State:
  """``new`` in the rows ``keep`` [b] marks and ``old`` in the others: a step's result for the rows it was for, the
  others as they went in. The batch counters and a paged pool are ``new``'s (the pool is every row's; a row that
  must stay as it was writes nothing into it)."""

  def pick(axis: int):
    def where(a, b):
      shape = [1] * a.ndim
      shape[axis] = keep.shape[0]
      return jnp.where(keep.reshape(shape), a, b)

    return where

  fields = {}
  for name in State._fields:
    mine, theirs = getattr(new, name), getattr(old, name)
    if name in BATCH_COUNTERS or mine is None or isinstance(mine, PagedKVCache):
      continue
    if isinstance(mine, KVCache):  # [layers, b, ...] keys and values, [b, S] segments
      rows_of = pick(1)
      fields[name] = KVCache(
        rows_of(mine.keys, theirs.keys), rows_of(mine.values, theirs.values), pick(0)(mine.segments, theirs.segments)
      )
    elif name == "constraint":
      fields[name] = mine._replace(dfa=pick(0)(mine.dfa, theirs.dfa), end=pick(0)(mine.end, theirs.end))
    else:
      fields[name] = jax.tree.map(pick(_row_axis(name)), mine, theirs)
  return new._replace(**fields)
