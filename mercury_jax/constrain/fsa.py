"""Deterministic automata over UTF-8 bytes: the algebra the JSON Schema compiler builds its constraints with.

A :class:`Dfa` reads bytes; its table is kept by byte class (``columns[state, class]``, ``classes[byte]``: bytes
with equal columns share one, so a table is a few dozen columns wide, not 256), and state 0 starts. The compiler
builds the texts of a schema's values from small automata (literal text, characters: :func:`literal`,
:func:`chars`) run one after another (:mod:`~mercury_jax.constrain.chains`: concatenation, union, repetition,
graphs), and takes intersections and differences here (:func:`intersect`, :func:`difference`: products, a level of
states at a time): what a regular expression alone cannot say (a pattern and a length, a string that matches no
pattern). :func:`minimize` trims and merges equivalent states (:mod:`~mercury_jax.constrain.minimize`).

Sizes are checked against a :class:`Budget` before tables are made: past it, :class:`TooLarge` is raised, which the
compiler turns into a refusal naming the keyword.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from mercury_jax.constrain import minimize as minimizing, utf8
from mercury_jax.constrain.utf8 import MAX_CODE_POINT, normalize_ranges

ALPHABET = 256


class TooLarge(Exception):
  """An automaton would have more states than the :class:`Budget` allows (``states`` is a lower bound)."""

  def __init__(self, states: int):
    super().__init__(states)
    self.states = states


class Exhausted(TooLarge):
  """The automata built on the way have more states in all than the :class:`Budget`'s ``work`` allows."""


@dataclasses.dataclass(frozen=True, eq=False)
class Budget:
  """The most states an automaton built on the way may have, and (``work``) all of them together: one compile
  attempt's share of time, counted in states so that it is the same on every machine (None: unbounded). What it
  spends is spent on its ``parent`` too (the whole compile's budget, which its attempts share), and either may run
  out.

  Budgets without ``work`` are equal when their ``states`` are (cached automata are shared between them); a metered
  one is equal only to itself, so a cache never spares it work another compile did: what it spends depends on the
  constraint alone, not on what the process compiled before.
  """

  states: int
  work: int | None = None
  spent: list = dataclasses.field(default_factory=lambda: [0], repr=False)
  parent: Budget | None = dataclasses.field(default=None, repr=False)

  def __eq__(self, other) -> bool:
    if self.work is not None or not isinstance(other, Budget) or other.work is not None:
      return self is other
    return self.states == other.states

  def __hash__(self) -> int:
    return hash(self.states) if self.work is None else id(self)

  def check(self, states: int) -> None:
    if states > self.states:
      raise TooLarge(states)
    self.spend(states)

  def spend(self, work: int) -> None:
    """Counts ``work`` state-sized steps (states built, a subset construction's rows) against ``work``."""
    if self.work is not None:
      self.spent[0] += work
      if self.parent is not None:
        self.parent.spend(work)
      if self.spent[0] > self.work:
        raise Exhausted(self.work)

  def fresh(self, work: int | None) -> Budget:
    """The same bound per automaton, with nothing spent and ``work`` in all (a share of this budget's, when it is
    metered)."""
    return Budget(self.states, work, parent=self if self.work is not None else None)


UNBOUNDED = Budget(1 << 62)


@dataclasses.dataclass(frozen=True, eq=False)
class Dfa:
  """A deterministic automaton over bytes; state 0 starts.

  Attributes:
    columns: int32 [states, classes]: the next state, or -1.
    classes: int32 [256]: the class (column) of each byte.
    accepting: bool [states].
    source: How it was built, for writing it out as a regular expression
      (:func:`~mercury_jax.constrain.render.tree`): ``("text", str)``, ``("chars", ranges)``, ``("seq", parts)``,
      ``("alt", parts)``, ``("rep", part, low, high, separator)``, ``("graph", start, finals, edges)``; None: only
      its table tells (a product, a table made by hand).
  """

  columns: np.ndarray
  classes: np.ndarray
  accepting: np.ndarray
  source: tuple | None = dataclasses.field(default=None, compare=False)

  @functools.cached_property
  def table(self) -> np.ndarray:
    """int32 [states, 256]: the next state after each byte, or -1."""
    out = self.columns[:, self.classes]
    out.flags.writeable = False
    return out

  @property
  def size(self) -> int:
    return len(self.accepting)

  @property
  def empty(self) -> bool:
    """Whether no text is accepted (a trimmed automaton without accepting states)."""
    return not self.accepting.any()

  @property
  def nullable(self) -> bool:
    """Whether the empty text is accepted."""
    return bool(self.accepting[0])

  def accepts(self, data: bytes | str) -> bool:
    state = 0
    for byte in data.encode() if isinstance(data, str) else data:
      state = int(self.columns[state, self.classes[byte]])
      if state < 0:
        return False
    return bool(self.accepting[state])

  def __repr__(self) -> str:
    return f"Dfa(states={self.size}, classes={self.columns.shape[1]}, accepting={int(self.accepting.sum())})"


def _frozen(columns, classes, accepting) -> Dfa:
  columns = np.ascontiguousarray(columns, np.int32)
  classes, accepting = np.asarray(classes, np.int32), np.asarray(accepting, bool)
  for array in (columns, classes, accepting):
    array.flags.writeable = False
  return Dfa(columns, classes, accepting)


def _compressed(columns, classes):
  return minimizing.compressed(columns, classes)


def from_table(table, accepting) -> Dfa:
  """The automaton of a full ``[states, 256]`` table (not minimized)."""
  table = np.asarray(table, np.int32).reshape(-1, ALPHABET)
  columns, classes = _compressed(table, np.arange(ALPHABET))
  return _frozen(columns, classes, accepting)


NOTHING = from_table(np.full((1, ALPHABET), -1), [False])  # accepts no text
EPSILON = from_table(np.full((1, ALPHABET), -1), [True])  # accepts the empty text only


def only_empty_text(dfa: Dfa) -> bool:
  """Whether the automaton accepts the empty text and nothing else."""
  return dfa.size == 1 and dfa.nullable and bool((dfa.columns < 0).all())


def sourced(dfa: Dfa, source: tuple) -> Dfa:
  """``dfa`` with how it was built (see :attr:`Dfa.source`); the empty and nothing automata stay themselves."""
  if dfa.empty or dfa.source is not None or only_empty_text(dfa):
    return dfa
  return dataclasses.replace(dfa, source=source)


@functools.lru_cache(maxsize=4096)
def literal(data: bytes | str) -> Dfa:
  """The automaton of one text."""
  data = data.encode() if isinstance(data, str) else data
  distinct = sorted(set(data))
  classes = np.zeros(ALPHABET, np.int32)
  classes[distinct] = np.arange(1, len(distinct) + 1)  # class 0: every byte the text does not have
  columns = np.full((len(data) + 1, len(distinct) + 1), -1, np.int32)
  columns[np.arange(len(data)), classes[np.frombuffer(data, np.uint8)]] = np.arange(1, len(data) + 1)
  return sourced(_frozen(columns, classes, [False] * len(data) + [True]), ("text", data.decode()))


def byte_set(values) -> Dfa:
  """The automaton of one byte from ``values``."""
  table = np.full((2, ALPHABET), -1, np.int32)
  table[0, list(values)] = 1
  ascii_ = [v for v in values if v < 0x80]
  out = from_table(table, [False, True])
  return sourced(out, ("chars", tuple((v, v) for v in ascii_))) if len(ascii_) == len(list(values)) else out


# ----------------------------------------------------------------------------------------------- characters


@functools.lru_cache(maxsize=1024)
def chars(ranges: tuple[tuple[int, int], ...]) -> Dfa:
  """The automaton of one character (its UTF-8 bytes) from the code point ranges (normalized first)."""
  ranges = normalize_ranges(ranges)
  if not ranges:
    return NOTHING
  rows: dict[tuple, int] = {}  # (depth, prefix bytes) -> state; a trie over the sequences' byte ranges, merged below
  table = [[-1] * ALPHABET]
  accepting = [False]
  final = None
  for lo, hi in ranges:
    for sequence in utf8.sequences(lo, hi):
      state = 0
      for depth, (first, last) in enumerate(sequence):
        last_step = depth == len(sequence) - 1
        if last_step:
          if final is None:
            final = len(table)
            table.append([-1] * ALPHABET)
            accepting.append(True)
          target = final
        else:
          key = (state, first, last)
          target = rows.get(key)
          if target is None:
            target = rows[key] = len(table)
            table.append([-1] * ALPHABET)
            accepting.append(False)
        row = table[state]
        for byte in range(first, last + 1):
          assert row[byte] in (-1, target), "overlapping UTF-8 sequences"
          row[byte] = target
        state = target
  return sourced(minimize(from_table(table, accepting)), ("chars", ranges))


# ----------------------------------------------------------------------------------------------- blocks


def _joint(parts: list[Dfa]) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
  """``(representative byte of each joint class, joint class of each byte, each part's columns by joint class)``:
  bytes share a joint class when they share a class in every part."""
  distinct = list({id(p): p for p in parts}.values())
  stacked = np.stack([p.classes for p in distinct])
  _, first, inverse = np.unique(stacked, axis=1, return_index=True, return_inverse=True)
  order = np.argsort(first)
  rank = np.empty_like(order)
  rank[order] = np.arange(len(order))
  reps, joint = first[order], rank[inverse.reshape(-1)]
  return reps, joint, [p.columns[:, p.classes[reps]] for p in parts]


# ----------------------------------------------------------------------------------------------- products


def _product(a: Dfa, b: Dfa, keep_b_dead: bool, accept, budget: Budget) -> Dfa:
  """Pairs of states of ``a`` and ``b`` reachable together (``b`` may have died when ``keep_b_dead``), found a
  breadth-first level at a time: the level's successors are gathered at once, and only new pairs are numbered."""
  reps, joint, (ta, tb) = _joint([a, b])
  nb = b.size + 1  # a pair (x, y) is the key x * nb + y + 1; y = -1: b has died
  ids: dict[int, int] = {1: 0}
  keys = [1]
  rows = []
  frontier = np.array([1], np.int64)
  while frontier.size:
    xs, ys = frontier // nb, frontier % nb - 1
    nx = ta[xs].astype(np.int64)
    ny = np.where(ys[:, None] >= 0, tb[np.maximum(ys, 0)], -1).astype(np.int64)
    alive = (nx >= 0) & ((ny >= 0) | keep_b_dead)
    nxt = np.where(alive, nx * nb + ny + 1, -1)
    found = np.unique(nxt[alive])
    new = [k for k in found.tolist() if k not in ids]
    for k in new:
      ids[k] = len(keys)
      keys.append(k)
    budget.check(len(keys))
    if found.size:
      numbers = np.array([ids[k] for k in found.tolist()], np.int64)
      rows.append(np.where(alive, numbers[np.searchsorted(found, np.maximum(nxt, found[0]))], -1))
    else:
      rows.append(np.full(nxt.shape, -1, np.int64))
    frontier = np.array(new, np.int64)
  pairs = np.array(keys, np.int64)
  xs, ys = pairs // nb, pairs % nb - 1
  final = accept(a.accepting[xs], np.where(ys >= 0, b.accepting[np.maximum(ys, 0)], False))
  return trim(_frozen(np.concatenate(rows), joint, final))


def intersect(a: Dfa, b: Dfa, budget: Budget = UNBOUNDED) -> Dfa:
  """The texts of both."""
  if a.empty or b.empty:
    return NOTHING
  if a is b:
    return a
  return _product(a, b, False, np.logical_and, budget)


def difference(a: Dfa, b: Dfa, budget: Budget = UNBOUNDED) -> Dfa:
  """The texts of ``a`` that are not texts of ``b``."""
  if a.empty or b.empty:
    return a
  if a is b:
    return NOTHING
  return _product(a, b, True, lambda x, y: x & ~y, budget)


def disjoint(a: Dfa, b: Dfa) -> bool:
  return intersect(a, b).empty


def subset(a: Dfa, b: Dfa) -> bool:
  """Whether every text of ``a`` is one of ``b``."""
  return difference(a, b).empty


# ----------------------------------------------------------------------------------------------- minimizing


def trim(dfa: Dfa) -> Dfa:
  """The automaton without the states it cannot reach or that cannot reach acceptance."""
  found = minimizing.trimmed(dfa.columns, dfa.accepting)
  if found is None or not found[1].any():
    return NOTHING
  return _keep_source(_frozen(*_compressed(found[0], dfa.classes), found[1]), dfa)


def _keep_source(out: Dfa, dfa: Dfa) -> Dfa:
  return sourced(out, dfa.source) if dfa.source is not None else out


def minimize(dfa: Dfa) -> Dfa:
  """The automaton trimmed, with equivalent states merged (:mod:`~mercury_jax.constrain.minimize`)."""
  found = minimizing.trimmed(dfa.columns, dfa.accepting)
  if found is None or not found[1].any():
    return NOTHING
  columns, accepting = found
  columns, classes = _compressed(columns, dfa.classes)
  block = minimizing.blocks(columns, accepting)
  if block is None or len(np.unique(block)) == len(block):
    return _keep_source(_frozen(columns, classes, accepting), dfa)
  first = np.unique(block, return_index=True)[1]
  order = np.argsort(first)  # classes of states numbered by first member: the start stays 0
  rank = np.empty_like(order)
  rank[order] = np.arange(len(order))
  block = rank[block]
  members = first[order]
  quotient = np.where(columns[members] >= 0, block[np.maximum(columns[members], 0)], -1)
  quotient, classes = _compressed(quotient, classes)
  return _keep_source(_frozen(quotient, classes, accepting[members]), dfa)


# ----------------------------------------------------------------------------------------------- inspection


def shortest(dfa: Dfa) -> bytes | None:
  """A shortest accepted text (breadth-first), or None."""
  if dfa.empty:
    return None
  previous = {0: None}
  frontier = [0]
  while frontier:
    nxt = []
    for state in frontier:
      if dfa.accepting[state]:
        out = []
        while previous[state] is not None:
          state, byte = previous[state]
          out.append(byte)
        return bytes(reversed(out))
      for byte, target in enumerate(dfa.table[state].tolist()):
        if target >= 0 and target not in previous:
          previous[target] = (state, byte)
          nxt.append(target)
    frontier = nxt
  return None


ANY_CHAR = chars(((0, MAX_CODE_POINT),))  # one Unicode scalar value
