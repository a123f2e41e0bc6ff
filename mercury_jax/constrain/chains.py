"""Byte automata run one after another: concatenation, union, repetition (with a separator), graphs of parts (the
items of arrays, the members of objects) and finite sets of texts.

Most of it is the subset construction of a chain of blocks (:func:`_chain`): a set of one state is that state (its
row is the blocks' table, gathered at once); only the sets where blocks meet (an accepting state and the starts that
may follow it) are made one by one. Parts with a single end that reads nothing more (``"..."``, ``{...}``) are
linked directly, end to start, without it. Results are trimmed, not minimized: the compiler minimizes the languages
it keeps (:func:`~mercury_jax.constrain.fsa.minimize`).
"""

from __future__ import annotations

import functools

import numpy as np

from mercury_jax.constrain.fsa import (
  ALPHABET,
  EPSILON,
  NOTHING,
  UNBOUNDED,
  Budget,
  Dfa,
  TooLarge,
  _frozen,
  _joint,
  from_table,
  literal,
  minimize,
  sourced,
  trim,
)


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
    budget.spend(len(members) * compact.shape[1])
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
      budget.spend(len(closure))
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
  if len(unique) > 2 and all(p.source is not None and p.source[0] == "text" for p in unique):
    return words([p.source[1] for p in unique], budget)  # a trie, not a subset construction over many starts
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
  return _words(tuple(sorted({t.encode() if isinstance(t, str) else t for t in texts})), budget)


@functools.lru_cache(maxsize=256)
def _words(texts: tuple[bytes, ...], budget: Budget) -> Dfa:
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
