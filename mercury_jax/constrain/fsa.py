"""Deterministic automata over UTF-8 bytes: the algebra the JSON Schema compiler builds its constraints with.

A :class:`Dfa` reads bytes; its table is kept by byte class (``columns[state, class]``, ``classes[byte]``: bytes
with equal columns share one, so a table is a few dozen columns wide, not 256), and state 0 starts. The compiler
builds the texts of a schema's values from small automata (literal text, characters, regular expressions) with
concatenation, union and repetition (:func:`concat`, :func:`union`, :func:`repeat`, :func:`graph`, which determinize
a chain of blocks), and takes intersections and differences (:func:`intersect`, :func:`difference`, products): what
a regular expression alone cannot say (a pattern and a length, a string that matches no pattern).

Every automaton returned is trimmed (each state is reachable and can reach acceptance, the start aside) and
minimized: one pass from the last states back when it has no cycle, else Moore's partition refinement within a work
budget (past it, equivalent states may stay apart: the language is the same). Sizes are checked against a
:class:`Budget` before tables are made: past it, :class:`TooLarge` is raised, which the compiler turns into a
refusal naming the keyword.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
from scipy.sparse import csgraph, csr_matrix

ALPHABET = 256
MOORE_WORK = 20_000_000  # Table cells Moore's refinement may visit (rounds * states * byte classes) before it stops.
MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)


class TooLarge(Exception):
  """An automaton would have more states than the :class:`Budget` allows (``states`` is a lower bound)."""

  def __init__(self, states: int):
    super().__init__(states)
    self.states = states


@dataclasses.dataclass(frozen=True)
class Budget:
  """The most states an automaton built on the way may have."""

  states: int

  def check(self, states: int) -> None:
    if states > self.states:
      raise TooLarge(states)


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


def _compressed(columns: np.ndarray, classes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The table with equal columns merged, numbered by first byte: ``(columns, classes)``."""
  k = columns.shape[1]
  if k <= 1:
    return columns, classes
  weights = np.random.default_rng(3).integers(1, 2**62, size=len(columns), dtype=np.int64)
  hashes = weights @ (columns.astype(np.int64) + 1)  # wraps around: a hash of each column
  _, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
  if len(first) == k:
    kept, inverse = np.arange(k), np.arange(k)
  elif np.array_equal(columns[:, first[inverse.reshape(-1)]], columns):
    kept, inverse = first, inverse.reshape(-1)
  else:  # a collision: compare exactly
    _, kept, inverse = np.unique(columns, axis=1, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
  order = np.argsort(kept, kind="stable")
  rank = np.empty_like(order)
  rank[order] = np.arange(len(order))
  return columns[:, kept[order]], rank[inverse][classes]


def from_table(table, accepting) -> Dfa:
  """The automaton of a full ``[states, 256]`` table (not minimized)."""
  table = np.asarray(table, np.int32).reshape(-1, ALPHABET)
  columns, classes = _compressed(table, np.arange(ALPHABET))
  return _frozen(columns, classes, accepting)


NOTHING = from_table(np.full((1, ALPHABET), -1), [False])  # accepts no text
EPSILON = from_table(np.full((1, ALPHABET), -1), [True])  # accepts the empty text only


def sourced(dfa: Dfa, source: tuple) -> Dfa:
  """``dfa`` with how it was built (see :attr:`Dfa.source`); the empty and nothing automata stay themselves."""
  if dfa.empty or dfa.source is not None or (dfa.size == 1 and dfa.nullable):
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


def _utf8(c: int) -> bytes:
  return chr(c).encode("utf-8", "surrogatepass")


def _sequences(lo: int, hi: int):
  """Byte-range sequences whose UTF-8 texts are exactly the code points ``lo..hi`` (no surrogates inside): as
  regex-syntax's ``Utf8Sequences`` splits them, each a list of ``(first byte, last byte)``."""
  stack = [(lo, hi)]
  while stack:
    lo, hi = stack.pop()
    split = False
    for boundary in (0x7F, 0x7FF, 0xFFFF):
      if lo <= boundary < hi:
        stack += [(boundary + 1, hi), (lo, boundary)]
        split = True
        break
    if split:
      continue
    if hi <= 0x7F:
      yield [(lo, hi)]
      continue
    for i in range(1, 4):
      mask = (1 << (6 * i)) - 1
      if lo & ~mask != hi & ~mask:
        if lo & mask:
          stack += [((lo | mask) + 1, hi), (lo, lo | mask)]
          split = True
          break
        if hi & mask != mask:
          stack += [(hi & ~mask, hi), (lo, (hi & ~mask) - 1)]
          split = True
          break
    if not split:
      yield list(zip(_utf8(lo), _utf8(hi), strict=True))


def normalize_ranges(ranges) -> tuple[tuple[int, int], ...]:
  """Sorted, merged code point ranges without the surrogates (which UTF-8 cannot hold)."""
  out: list[list[int]] = []
  for lo, hi in sorted(ranges):
    for a, b in ((lo, min(hi, SURROGATES[0] - 1)), (max(lo, SURROGATES[1] + 1), hi)):
      if a <= b:
        if out and a <= out[-1][1] + 1:
          out[-1][1] = max(out[-1][1], b)
        else:
          out.append([a, b])
  return tuple((a, b) for a, b in out)


def complement_ranges(ranges) -> tuple[tuple[int, int], ...]:
  """Every code point outside ``ranges``."""
  out, start = [], 0
  for lo, hi in normalize_ranges(ranges):
    if lo > start:
      out.append((start, lo - 1))
    start = hi + 1
  if start <= MAX_CODE_POINT:
    out.append((start, MAX_CODE_POINT))
  return normalize_ranges(out)


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
    for sequence in _sequences(lo, hi):
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


def _chain(blocks: list[Dfa], initial: list[int], follow: list[list[int]], budget: Budget) -> Dfa:
  """The subset construction of automata run one after another: the text starts in a block of ``initial`` and,
  where a block accepts, may go on in any block of ``follow[block]`` (``len(blocks)`` stands for the end).

  A set of one state is that state (its row is the blocks' table, gathered at once); only the sets where blocks
  meet (an accepting state and the starts that may follow it) are made one by one.
  """
  end = len(blocks)
  sizes = np.array([b.size for b in blocks], np.int64)
  offsets = np.concatenate([[0], np.cumsum(sizes)])
  total = int(offsets[-1])  # the end's own state: it reads nothing and accepts
  budget.check(total)
  reps, joint, columns = _joint(blocks)
  compact = np.full((total + 1, len(reps)), -1, np.int64)
  for b, local in enumerate(columns):
    compact[offsets[b] : offsets[b + 1]] = np.where(local >= 0, local.astype(np.int64) + offsets[b], -1)
  accepting = np.concatenate([b.accepting for b in blocks] + [np.array([False])])
  block_of = np.repeat(np.arange(len(blocks)), sizes)

  entry = {b: {int(offsets[b])} for b in range(len(blocks))}  # states entered when a block starts
  entry[end] = {total}
  changed = True
  while changed:  # blocks that accept the empty text also enter what follows them
    changed = False
    for b, block in enumerate(blocks):
      if block.nullable:
        for f in follow[b]:
          if not entry[f] <= entry[b]:
            entry[b] |= entry[f]
            changed = True
  after = [frozenset().union(*(entry[f] for f in follow[b])) for b in range(len(blocks))]
  ids: dict[frozenset, int] = {}
  sets: list[frozenset] = []

  def number(members: frozenset) -> int:
    if len(members) == 1:
      return next(iter(members))
    found = ids.get(members)
    if found is None:
      found = ids[members] = total + 1 + len(sets)
      sets.append(members)
      budget.check(total + 1 + len(sets))
    return found

  remap = np.arange(total + 1, dtype=np.int64)
  for state in np.flatnonzero(accepting[:total]).tolist():
    remap[state] = number(frozenset((state,)) | after[block_of[state]])
  rows = [np.where(compact >= 0, remap[np.maximum(compact, 0)], -1)]
  start = number(frozenset().union(*(entry[b] for b in initial)) if initial else frozenset((total,)))
  done = 0
  while done < len(sets):
    members = sorted(sets[done])
    done += 1
    row = []
    for column in compact[members].T.tolist():
      targets = {t for t in column if t >= 0}
      if not targets:
        row.append(-1)
        continue
      closure = set()
      for t in targets:
        closure.add(t)
        if t < total and accepting[t]:
          closure |= after[block_of[t]]
      row.append(number(frozenset(closure)))
    rows.append(np.array([row], np.int64))
  out = np.concatenate(rows)
  final = np.zeros(len(out), bool)
  final[total] = True
  final[total + 1 :] = [total in members for members in sets]
  order = np.arange(len(out))
  order[[0, start]] = order[[start, 0]]  # the start becomes state 0
  inverse = np.argsort(order)
  out = np.where(out >= 0, inverse[np.maximum(out, 0)], -1)[order]
  return trim(_frozen(out, joint, final[order]))


def _delimited(dfa: Dfa) -> bool:
  """Whether the automaton has one accepting state, which reads nothing more, and a start no transition enters:
  its texts are a prefix code, and it chains with others by merging its end with the next start."""
  if dfa.nullable or int(dfa.accepting.sum()) != 1:
    return False
  final = int(np.flatnonzero(dfa.accepting)[0])
  return bool((dfa.columns[final] < 0).all() and not (dfa.columns == 0).any())


def _linked(parts: list[Dfa], loop: bool, accepting_after: list[bool], budget: Budget) -> Dfa:
  """Delimited automata one after another, each one's end merged with the next one's start (the last one's end with
  its own start when ``loop``); the state after ``i`` parts accepts when ``accepting_after[i]``."""
  finals = [int(np.flatnonzero(p.accepting)[0]) for p in parts]
  sizes = [p.size - 1 for p in parts]  # each part's end is the next one's start
  total = sum(sizes) + (0 if loop else 1)
  budget.check(total)
  reps, joint, columns = _joint(parts)
  table = np.full((total, len(reps)), -1, np.int32)
  accepting = np.zeros(total, bool)
  at = 0
  for i, (part, final, local) in enumerate(zip(parts, finals, columns, strict=True)):
    last = i == len(parts) - 1
    end = at if (loop and last) else at + sizes[i]
    ids = np.empty(part.size, np.int64)
    others = np.concatenate([np.arange(final), np.arange(final + 1, part.size)])
    ids[others] = at + np.arange(len(others))
    ids[final] = end
    rows = local[others]
    table[ids[others]] = np.where(rows >= 0, ids[np.maximum(rows, 0)], -1)
    accepting[at] = accepting_after[i]
    at += sizes[i]
  if not loop:
    accepting[at] = accepting_after[len(parts)]
  return _frozen(table, joint, accepting)


def concat(parts: list[Dfa], budget: Budget = UNBOUNDED) -> Dfa:
  """The texts made of one text of each part, in order."""
  parts = [p for p in parts if p is not EPSILON]
  if any(p.empty for p in parts):
    return NOTHING
  if not parts:
    return EPSILON
  if len(parts) == 1:
    return parts[0]
  if all(_delimited(p) for p in parts):
    out = _linked(parts, False, [False] * len(parts) + [True], budget)
  else:
    out = _chain(parts, [0], [[i + 1] for i in range(len(parts))], budget)
  return sourced(out, ("seq", tuple(parts)))


def union(parts: list[Dfa], budget: Budget = UNBOUNDED) -> Dfa:
  """The texts of any part."""
  parts = [p for p in parts if not p.empty]
  unique = list({id(p): p for p in parts}.values())
  if not unique:
    return NOTHING
  if len(unique) == 1:
    return unique[0]
  out = _chain(unique, list(range(len(unique))), [[len(unique)]] * len(unique), budget)
  return sourced(out, ("alt", tuple(unique)))


def repeat(part: Dfa, low: int, high: int | None, budget: Budget = UNBOUNDED, separator: Dfa | None = None) -> Dfa:
  """``low`` to ``high`` (None: any number of) texts of ``part``, with ``separator`` between them."""
  if high is not None and high < low:
    return NOTHING
  if part.empty:
    return EPSILON if low == 0 else NOTHING
  if high == 0:
    return EPSILON
  later = concat([separator, part]) if separator is not None else part
  copies = max(low, 1) if high is None else high  # the last one loops when there is no high
  budget.check(part.size + (copies - 1) * later.size)
  blocks = [part] + [later] * (copies - 1)
  source = ("rep", part, low, high, separator)
  if _delimited(part) and _delimited(later):
    after = [i >= low for i in range(copies + 1)]
    return sourced(_linked(blocks + ([later] if high is None else []), high is None, after, budget), source)
  end = copies + (high is None)
  follow = [[i + 1] + ([end] if i + 1 >= low else []) for i in range(copies)]
  if high is None:
    blocks.append(later)
    follow.append([copies, end])
  else:
    follow[-1] = [end]
  return sourced(_chain(blocks, [0] + ([end] if low == 0 else []), follow, budget), source)


def optional(part: Dfa) -> Dfa:
  return union([part, EPSILON])


def graph(start, finals, edges, budget: Budget = UNBOUNDED) -> Dfa:
  """The texts along paths of a graph from ``start`` to a node of ``finals``: ``edges`` are ``(node, node, Dfa)``,
  or ``(node, node, None)`` for a move that reads nothing."""
  moves: dict = {}
  blocks, sources, targets = [], [], []
  for source, target, dfa in edges:
    if dfa is None:
      moves.setdefault(source, []).append(target)
    elif not dfa.empty:
      blocks.append(dfa)
      sources.append(source)
      targets.append(target)
  if not blocks:
    return EPSILON if _closure(start, moves) & set(finals) else NOTHING
  leaving: dict = {}
  for i, source in enumerate(sources):
    leaving.setdefault(source, []).append(i)
  end = len(blocks)

  def after(node) -> list[int]:
    reach = _closure(node, moves)
    out = [i for n in reach for i in leaving.get(n, [])]
    return out + ([end] if reach & set(finals) else [])

  follow = [after(t) for t in targets]
  source = ("graph", start, tuple(finals), tuple((a, b, d) for a, b, d in edges if d is None or not d.empty))
  return sourced(_chain(blocks, after(start), follow, budget), source)


def _closure(node, moves: dict) -> set:
  seen, stack = {node}, [node]
  while stack:
    for nxt in moves.get(stack.pop(), ()):
      if nxt not in seen:
        seen.add(nxt)
        stack.append(nxt)
  return seen


def words(texts, budget: Budget = UNBOUNDED) -> Dfa:
  """The minimal automaton of a finite set of texts (Daciuk et al.'s incremental construction from sorted words:
  each finished branch is merged with an equal one already built, so the size stays near the minimal one)."""
  texts = sorted({t.encode() if isinstance(t, str) else t for t in texts})
  if not texts:
    return NOTHING
  children: list[dict[int, int]] = [{}]
  final = [False]
  register: dict[tuple, int] = {}

  def settle(state: int) -> None:
    """Merges the last-added branch below ``state`` with equal states already registered (deepest first)."""
    path = [state]
    while children[path[-1]]:
      path.append(children[path[-1]][max(children[path[-1]])])
    for parent, child in zip(reversed(path[:-1]), reversed(path[1:]), strict=True):
      key = (final[child], tuple(sorted(children[child].items())))
      found = register.setdefault(key, child)
      if found != child:
        children[parent][max(children[parent])] = found

  previous = b""
  for text in texts:
    common = 0
    while common < min(len(text), len(previous)) and text[common] == previous[common]:
      common += 1
    state = 0
    for byte in text[:common]:
      state = children[state][byte]
    settle(state)
    for byte in text[common:]:
      children.append({})
      final.append(False)
      children[state][byte] = len(children) - 1
      state = len(children) - 1
      if len(children) > 2 * budget.states:
        raise TooLarge(len(children) // 2)
    final[state] = True
    previous = text
  settle(0)
  table = np.full((len(children), ALPHABET), -1, np.int32)
  for state, row in enumerate(children):
    if row:
      table[state, list(row)] = list(row.values())
  return sourced(minimize(from_table(table, final)), ("alt", tuple(literal(t) for t in texts)))


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


def _trim(columns: np.ndarray, accepting: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Only the states reachable from the start that can reach acceptance (and the start), numbered by first visit."""
  n = len(columns)
  src, cls = np.nonzero(columns >= 0)
  dst = columns[src, cls]
  graph = csr_matrix((np.ones(len(src), np.int8), (src, dst)), shape=(n, n))
  forward = csgraph.breadth_first_order(graph, 0, directed=True, return_predecessors=False)
  finals = np.flatnonzero(accepting)
  back = csr_matrix(
    (
      np.ones(len(src) + len(finals), np.int8),
      (np.concatenate([dst, np.full(len(finals), n)]), np.concatenate([src, finals])),
    ),
    shape=(n + 1, n + 1),
  )  # reversed edges, and a virtual state n before every accepting one
  live = np.zeros(n + 1, bool)
  live[csgraph.breadth_first_order(back, n, directed=True, return_predecessors=False)] = True
  keep = np.zeros(n, bool)
  keep[forward] = True
  keep &= live[:n]
  if not keep[0]:
    return NOTHING.columns, NOTHING.accepting
  order = forward[keep[forward]]  # breadth-first from the start: the start stays 0
  renumber = np.full(n + 1, -1, np.int64)
  renumber[order] = np.arange(len(order))
  out = renumber[np.where(columns[order] >= 0, columns[order], n)]
  return out.astype(np.int32), accepting[order]


def _acyclic_blocks(columns: np.ndarray, accepting: np.ndarray) -> np.ndarray | None:
  """Equivalence classes of the states of an automaton without cycles, classed from the last states back (a state
  once all its successors are: same acceptance and same successors' classes); None if it has a cycle."""
  rows = columns.tolist()
  final = accepting.tolist()
  n = len(rows)
  block = [-1] * n
  state_of: dict[tuple, int] = {}
  color = [0] * n  # 0 new, 1 on the stack, 2 classed
  for root in range(n):
    if color[root]:
      continue
    stack = [(root, iter(set(rows[root]) - {-1}))]
    color[root] = 1
    while stack:
      state, successors = stack[-1]
      for nxt in successors:
        if color[nxt] == 1:
          return None
        if color[nxt] == 0:
          color[nxt] = 1
          stack.append((nxt, iter(set(rows[nxt]) - {-1})))
          break
      else:
        stack.pop()
        key = (final[state], *[block[t] if t >= 0 else -1 for t in rows[state]])
        block[state] = state_of.setdefault(key, len(state_of))
        color[state] = 2
  return np.asarray(block, np.int64)


def _moore(columns: np.ndarray, accepting: np.ndarray) -> np.ndarray | None:
  """Moore's partition refinement (hashed, checked exactly at the end); None when it would take more than
  :data:`MOORE_WORK`, or a hash collision merged states that differ (rare: they are then left apart)."""
  n, k = columns.shape
  missing, targets = columns < 0, np.maximum(columns, 0)
  weights = np.random.default_rng(1).integers(1, 2**63, size=k + 1, dtype=np.uint64)
  block, count, work = accepting.astype(np.int64), len(np.unique(accepting)), 0
  while True:
    work += n * max(k, 1)
    if work > MOORE_WORK:
      return None
    rows = np.where(missing, 0, block[targets] + 1).astype(np.uint64)
    _, inverse = np.unique((rows * weights[1:]).sum(axis=1) + block.astype(np.uint64) * weights[0], return_inverse=True)
    inverse = inverse.reshape(-1)
    grown = len(np.unique(inverse))
    block, grew, count = inverse.astype(np.int64), grown > count, grown
    if not grew:
      break
  members = np.unique(block, return_index=True)[1]
  rows = np.where(missing, -1, block[targets])
  if np.array_equal(rows, rows[members][block]) and np.array_equal(accepting, accepting[members][block]):
    return block
  return None


def trim(dfa: Dfa) -> Dfa:
  """The automaton without the states it cannot reach or that cannot reach acceptance."""
  columns, accepting = _trim(dfa.columns, dfa.accepting)
  if not accepting.any():
    return NOTHING
  return _keep_source(_frozen(*_compressed(columns, dfa.classes), accepting), dfa)


def _keep_source(out: Dfa, dfa: Dfa) -> Dfa:
  return sourced(out, dfa.source) if dfa.source is not None else out


def minimize(dfa: Dfa) -> Dfa:
  """The automaton trimmed, with equivalent states merged (see the module docstring)."""
  columns, accepting = _trim(dfa.columns, dfa.accepting)
  if not accepting.any():
    return NOTHING
  columns, classes = _compressed(columns, dfa.classes)
  block = _acyclic_blocks(columns, accepting)
  if block is None:
    block = _moore(columns, accepting)
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
