"""Token-level automata: a byte automaton of the constraint's texts (:mod:`~mercury_jax.constrain.fsa`) read
through the tokenizer's vocabulary, as the dense arrays :mod:`mercury_jax.sampling.automata` runs over.

* State 0 is ``DONE`` (after EOS), where every token goes to ``DONE``. EOS is allowed exactly in accepting states.
* A token is allowed in a state when its bytes lead the byte automaton somewhere: every state of the byte automaton
  reached at a token boundary from the start (breadth-first, all the vocabulary at once per state: a gather per byte
  position of the tokens) is a state here, until :data:`PRE_PRUNING_FACTOR` times ``max_states`` of them (or the
  memory limit) refuse the constraint, before the dense ``[states, vocab]`` table grows past it.
* Equivalent states (the same token sequences lead from them to acceptance) are merged, and tokens whose columns of
  the transition table are equal share a class, so the table is ``[states, classes]``.
* Text that every continuation of a state begins with (a JSON Schema's keys and punctuation) gets exactly one
  tokenisation, the tokenizer's own: such states allow a single token (``forced``), which the engine commits without
  spending model confidence, and which is what the tokenizer would write, so canonical text stays accepted.
* ``distance`` counts the fewest tokens to acceptance, so a block never runs out of room mid-structure.

Only the tokenizer's text pieces are used: its special ids (``special_mask``) and the tokens whose bytes
(``token_bytes``) are not whole UTF-8 text (a byte piece >= 0x80, a byte-level BPE piece that holds part of a
character) are forbidden everywhere but in ``DONE``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os

import numpy as np
from scipy.sparse import csgraph, csr_matrix

from mercury_jax.constrain import fsa
from mercury_jax.constrain.errors import ConstraintError
from mercury_jax.data.tokenizer import TextTokenizer

DONE = 0  # The state after EOS: accepting, and every token stays there.
FORCED_TEXT_LIMIT = 64  # Characters of fixed text looked ahead per state (a shorter look-ahead is still correct).
# Token-level states (byte-automaton states reached at token boundaries) per final state that a compile may build
# before minimizing and pruning; more is refused before the dense table grows.
PRE_PRUNING_FACTOR = 8
TABLE_COPIES = 4  # Dense [states, vocab] int32 tables alive at once while an automaton is built (memory estimate).
# Tokens of the vocabulary per unit of a compile's work (fsa.Budget.spend) that reading a token-level state costs:
# measured on a 4096-token vocabulary, a state's row (a walk of the vocabulary's trie) takes about 0.2 ms, as long as
# about 1000 byte-level states of a subset construction.
TOKENS_PER_WORK = 4


@dataclasses.dataclass(frozen=True)
class Vocab:
  """The tokenizer as the automaton builder sees it.

  Attributes:
    tokenizer: The tokenizer.
    texts: Each id's text, None for ids the automaton never allows outside DONE.
    first: int32 [vocab]: the code point a token's text starts with, -1 for None texts.
    lengths: int32 [vocab]: characters of each token's text.
    ids: int64 [n]: the ids of text pieces.
    parents: int64 [nodes]: the trie of their bytes, by depth (each node's parent comes first; -1: the root's
      children), so a walk advances each shared prefix once (a vocabulary's pieces share most of their prefixes).
    edges: uint8 [nodes]: the byte from each node's parent to it.
    levels: int64 [depth + 1]: where each depth's nodes begin.
    ends: int64 [n]: the node each piece of ``ids`` ends at.
    digest: sha256 of the serialized tokenizer.
    spells_ascii: Every ASCII character is a token (so a text of n characters can take n tokens).
  """

  tokenizer: TextTokenizer
  texts: tuple[str | None, ...]
  first: np.ndarray
  lengths: np.ndarray
  ids: np.ndarray
  parents: np.ndarray
  edges: np.ndarray
  levels: np.ndarray
  ends: np.ndarray
  digest: bytes
  spells_ascii: bool

  @classmethod
  def of(cls, tokenizer: TextTokenizer) -> Vocab:
    texts: list[str | None] = [None] * tokenizer.vocab_size
    raw: dict[int, bytes] = {}
    for token_id in np.flatnonzero(~tokenizer.special_mask).tolist():
      data = tokenizer.token_bytes(token_id)
      if not data:
        continue
      try:
        texts[token_id] = data.decode("utf-8")
      except UnicodeDecodeError:
        continue  # Part of a character: forbidden.
      raw[token_id] = data
    ids = np.array(sorted(raw), np.int64)
    prefixes = sorted(
      {data[:end] for data in raw.values() for end in range(1, len(data) + 1)}, key=lambda p: (len(p), p)
    )
    node = {prefix: n for n, prefix in enumerate(prefixes)}
    longest = max(map(len, prefixes), default=1)
    return cls(
      tokenizer=tokenizer,
      texts=tuple(texts),
      first=np.array([ord(t[0]) if t else -1 for t in texts], np.int32),
      lengths=np.array([len(t) if t else 0 for t in texts], np.int32),
      ids=ids,
      parents=np.array([node.get(p[:-1], -1) for p in prefixes], np.int64),
      edges=np.array([p[-1] for p in prefixes], np.uint8),
      levels=np.searchsorted([len(p) for p in prefixes], np.arange(1, longest + 2)),
      ends=np.array([node[raw[i]] for i in ids.tolist()], np.int64),
      digest=hashlib.sha256(tokenizer.to_bytes()).digest(),
      spells_ascii=set(map(chr, range(128))) <= set(texts),
    )


@dataclasses.dataclass(frozen=True)
class Limits:
  """What a compile may build.

  Attributes:
    max_states, max_classes, max_edges: The final automaton's limits.
    max_memory: Bytes the tables built on the way may take (estimated before they are made).
    remedy: How a user raises a limit (``{name}``: states, ...).
  """

  max_states: int
  max_classes: int
  max_edges: int
  max_memory: int
  remedy: str = "raise the compiler's max_{name}"

  def rows(self, vocab: Vocab) -> int:
    """Token-level states that may be built before minimizing."""
    memory = self.max_memory // (TABLE_COPIES * 4 * vocab.tokenizer.vocab_size)
    return max(1, min(PRE_PRUNING_FACTOR * self.max_states, memory))

  def refusal(self, states: int, what: str, param: str | None, built: int, stage: str = "") -> ConstraintError:
    """The refusal of ``what``, which needs at least ``states`` states where at most ``built`` may be built
    (``stage``: which automaton, e.g. "byte-level")."""
    return ConstraintError(
      f"{what} needs at least {states} automaton states, more than max_states={self.max_states}; the compiler "
      f"builds at most {built}{' ' + stage if stage else ''} states before minimizing (within "
      f"{self.max_memory >> 20} MiB); make it smaller or {self.remedy.format(name='states')}",
      param=param,
    )


def _token_rows(text: fsa.Dfa, vocab: Vocab, most: int, budget: fsa.Budget):
  """``(columns [states, classes], classes [vocab], accepting)``: the byte automaton's states reached at token
  boundaries from its start (breadth-first; state i is the i-th reached), and where each token leads from each (-1:
  forbidden), with tokens whose columns are equal sharing a class; or the number of states found once it passes
  ``most``. Each state read is spent on ``budget`` (:data:`TOKENS_PER_WORK`).

  States are read up to 256 at a time (those found and not yet read), all the vocabulary at once (a gather per
  node of the vocabulary's trie); every 256 states read, the token classes are refined: tokens that went alike so
  far and go alike from the new states stay together (their earlier columns are equal, so a class's earlier column
  is any member's).
  """
  n = text.size
  table = np.concatenate([text.columns, np.full((1, text.columns.shape[1]), n, np.int32)])  # row n: dead, stays dead
  table[:n][text.columns < 0] = n
  edges = text.classes[vocab.edges]  # the trie's bytes, as the automaton's byte classes
  vocab_size = vocab.tokenizer.vocab_size
  number = np.full(n + 1, -1, np.int32)  # each byte state's number here, -1 until reached (the dead row n never is)
  number[0] = 0
  order = np.zeros(min(n, most + 1), np.int64)  # the byte state of each number
  found, read = 1, 0
  classes = np.zeros(vocab_size, np.int64)  # every token alike before any state is read
  blocks: list[tuple[np.ndarray, np.ndarray]] = []  # columns of 256 states read, by the classes after them
  pending: list[np.ndarray] = []
  while read < found:
    batch = order[read : min(found, read + 256)]
    read += len(batch)
    budget.spend(len(batch) * max(1, vocab_size // TOKENS_PER_WORK))
    walked = np.empty((len(batch), len(edges)), np.int32)
    top = vocab.levels[1]
    walked[:, :top] = table[batch[:, None], edges[None, :top]]
    for lo, hi in itertools.pairwise(vocab.levels[1:].tolist()):
      walked[:, lo:hi] = table[walked[:, vocab.parents[lo:hi]], edges[lo:hi]]
    reached = walked[:, vocab.ends]
    new = np.unique(reached[reached < n])
    new = new[number[new] < 0]
    if found + len(new) > most:
      return found + len(new)
    number[new] = np.arange(found, found + len(new), dtype=np.int32)
    order[found : found + len(new)] = new
    found += len(new)
    rows = np.full((len(batch), vocab_size), -1, np.int32)
    rows[:, vocab.ids] = number[reached]
    pending.append(rows)
    if read == found or sum(map(len, pending)) >= 256:
      rows = np.vstack(pending)
      pending.clear()
      first, classes = _refined(classes, rows)
      blocks.append((rows[:, first], classes))
  first = np.unique(classes, return_index=True)[1]  # a token of each final class: its column in every batch
  columns = np.vstack([block[:, then[first]] for block, then in blocks])
  return columns, classes, text.accepting[order[:found]]


def _refined(classes: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """``(a token of each new class, the new class of each token)``: tokens of one class whose ``rows`` columns are
  equal stay together (a hash of each column, checked exactly)."""
  weights = np.random.default_rng(len(rows)).integers(1, 2**63, size=len(rows) + 1, dtype=np.uint64)
  hashes = classes.astype(np.uint64) * weights[0] + weights[1:] @ (rows.astype(np.int64) + 1).astype(np.uint64)
  _, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
  inverse = inverse.reshape(-1)
  if not (np.array_equal(rows[:, first[inverse]], rows) and np.array_equal(classes[first[inverse]], classes)):
    _, first, inverse = np.unique(np.vstack([classes[None, :], rows]), axis=1, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
  return first, inverse


def _with_done(columns: np.ndarray, classes: np.ndarray, accepting: np.ndarray, eos: int):
  """``(columns, classes, accepting)`` with DONE prepended (states shift by one) and EOS given a class of its own,
  allowed in accepting states, where it leads to DONE."""
  columns = np.where(columns >= 0, columns + 1, -1)
  columns = np.concatenate([np.zeros((1, columns.shape[1]), columns.dtype), columns])
  accepting = np.concatenate([[True], accepting])
  eos_column = np.where(accepting, DONE, -1)[:, None]
  classes = classes.copy()
  classes[eos] = columns.shape[1]
  return np.hstack([columns, eos_column]).astype(np.int32), classes, accepting


def _distance(table: np.ndarray, accepting: np.ndarray) -> np.ndarray:
  """Fewest tokens from each state to an accepting one (breadth-first on the reversed graph, from a virtual state
  before every accepting one); -1 where none."""
  n = len(table)
  src, cls = np.nonzero(table >= 0)
  finals = np.flatnonzero(accepting)
  rows = np.concatenate([table[src, cls], np.full(len(finals), n)])
  cols = np.concatenate([src, finals])
  graph = csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(n + 1, n + 1))
  found = csgraph.dijkstra(graph, indices=n, unweighted=True)[:n]
  return np.where(np.isfinite(found), found - 1, -1).astype(np.int32)


def _reachable(table: np.ndarray, start: int) -> np.ndarray:
  """States reachable from ``start``, in breadth-first order (ascending within a level)."""
  seen = np.zeros(table.shape[0], bool)
  seen[start] = True
  levels = [np.array([start])]
  while levels[-1].size:
    targets = np.unique(table[levels[-1]])
    new = targets[(targets >= 0) & ~seen[np.maximum(targets, 0)]]
    seen[new] = True
    levels.append(new)
  return np.concatenate(levels)


def _classes(columns: np.ndarray, classes: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
  """``(columns, classes [vocab])`` with equal columns merged, numbered by first token (``classes``: the token ->
  column map of ``columns``; None: one column per token). Columns are compared by a hash, checked exactly (and
  compared exactly if two collided): sorting whole columns costs seconds on a table of ten thousand states."""
  if classes is None:
    classes = np.arange(columns.shape[1])
  weights = np.random.default_rng(2).integers(1, 2**63, size=columns.shape[0], dtype=np.uint64)
  hashes = weights @ (columns.astype(np.int64) + 1).astype(np.uint64)
  _, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
  inverse = inverse.reshape(-1)
  if not np.array_equal(columns[:, first[inverse]], columns):
    _, first, inverse = np.unique(columns, axis=1, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
  order = np.argsort(first)
  rank = np.empty_like(order)
  rank[order] = np.arange(len(order))
  return np.ascontiguousarray(columns[:, first[order]], np.int32), rank[inverse][classes].astype(np.int32)


def _equivalent(columns: np.ndarray, accepting: np.ndarray, most: int) -> np.ndarray | int:
  """int32 [states]: the class of equivalent states each state belongs to, numbered in order of first member; or
  the number of classes found once it passes ``most`` (refinement only splits, so the final count is larger still).

  Moore's partition refinement: states split by acceptance (DONE, where every token is allowed, alone), then by the
  classes their successors are in, until nothing splits. Rows are compared by a hash first (a round costs one pass
  over the table; a chain of states takes a round per few states, as tokens span several characters), checked
  exactly at the end, and compared exactly if a hash collided. A colliding hash only merges blocks, so its count is
  never above the exact one: stopping on it is safe.
  """
  missing, targets = columns < 0, np.maximum(columns, 0)
  weights = np.random.default_rng(1).integers(1, 2**63, size=columns.shape[1] + 1, dtype=np.uint64)

  def hashed(block):
    rows = np.where(missing, 0, block[targets] + 1).astype(np.uint64)
    return np.unique((rows * weights[1:]).sum(axis=1) + block.astype(np.uint64) * weights[0], return_inverse=True)

  def exact(block):
    return np.unique(np.column_stack([block, np.where(missing, -1, block[targets])]), axis=0, return_inverse=True)

  initial = accepting.astype(np.int64) + 2 * (np.arange(len(accepting)) == DONE)
  for signature in (hashed, exact):
    block, count = initial, len(np.unique(initial))
    while True:
      _, inverse = signature(block)
      inverse = inverse.reshape(-1)
      _, first = np.unique(inverse, return_index=True)
      rank = np.empty_like(first)
      rank[np.argsort(first)] = np.arange(len(first))
      block, grew = rank[inverse], len(first) > count
      count = len(first)
      if count > most:
        return count
      if not grew:
        break
    members = np.unique(block, return_index=True)[1]
    rows = np.where(missing, -1, block[targets])
    if np.array_equal(rows, rows[members][block]) and np.array_equal(accepting, accepting[members][block]):
      return block.astype(np.int32)
  raise AssertionError("partition refinement did not converge")


def _minimized(columns: np.ndarray, classes: np.ndarray, accepting: np.ndarray, most: int):
  """``(columns, classes, accepting)`` with equivalent states merged; a class is numbered by its first member, so
  DONE stays 0 and the start 1. Or the number of states found once it passes ``most``."""
  block = _equivalent(columns, accepting, most)
  if isinstance(block, int):
    return block
  first = np.unique(block, return_index=True)[1]
  quotient = np.where(columns[first] >= 0, block[np.maximum(columns[first], 0)], -1)
  quotient, classes = _classes(quotient, classes)
  return quotient, classes, accepting[first]


def _members(classes: np.ndarray) -> list[np.ndarray]:
  """The tokens of each class."""
  order = np.argsort(classes, kind="stable")
  cuts = np.flatnonzero(np.diff(classes[order])) + 1
  return np.split(order, cuts)


def _forced_text(columns: np.ndarray, classes: np.ndarray, accepting: np.ndarray, vocab: Vocab) -> dict[int, str]:
  """The longest text every continuation of a state begins with, for states where it is not empty.

  F(s) is the longest common prefix over the allowed tokens t of text(t) + F(next(s, t)), and empty in accepting
  states. It is the least fixed point reached from all-empty by iterating that rule (each round can only lengthen
  F, capped at ``FORCED_TEXT_LIMIT`` characters); every round's F is a prefix of the true one, so it is always safe.
  """
  eos = vocab.tokenizer.eos_id
  members = _members(classes)
  first_of = np.full(len(members), np.iinfo(np.int32).max, np.int64)
  last_of = np.full(len(members), -1, np.int64)
  for c, tokens in enumerate(members):
    firsts = vocab.first[tokens[tokens != eos]]
    if len(firsts):
      first_of[c], last_of[c] = firsts.min(), firsts.max()
  allowed = columns >= 0
  allowed[:, classes[eos]] = False
  first = np.where(allowed, first_of[None, :], np.iinfo(np.int32).max).min(axis=1)
  last = np.where(allowed, last_of[None, :], -1).max(axis=1)
  candidates = np.flatnonzero((first == last) & ~accepting & (first >= 0))
  edges = {}
  for s in candidates.tolist():
    tokens = np.concatenate([members[c] for c in np.flatnonzero(allowed[s])])
    edges[s] = [(vocab.texts[t], int(columns[s, classes[t]])) for t in tokens.tolist() if t != eos]
  text = dict.fromkeys(edges, "")
  changed = True
  while changed:
    changed = False
    for s in reversed(edges):  # Deeper states first: most chains settle in one round.
      common = None
      for piece, nxt in edges[s]:
        option = (piece + text.get(nxt, ""))[:FORCED_TEXT_LIMIT]
        common = option if common is None else os.path.commonprefix([common, option])
      if common != text[s]:
        text[s], changed = common, True
  return {s: t for s, t in text.items() if t}


def _walk(columns: np.ndarray, classes: np.ndarray, state: int, tokens: list[int]) -> int:
  for token in tokens:
    state = int(columns[state, classes[token]])
    if state < 0:
      return -1
  return state


def _canonicalize(columns: np.ndarray, classes: np.ndarray, accepting: np.ndarray, vocab: Vocab):
  """``(columns, classes)`` where a state with fixed text allows only the tokenizer's own first token of it (which
  gets a class of its own where its class-mates are then forbidden).

  The tokenizer's first token of the fixed text F is kept only when it is also its first token of F followed by
  anything that may come next (each character that may follow, and the longest token starting with it): BPE merges
  across the end of F would otherwise make the canonical encoding of a whole valid text take another path.
  """
  eos = vocab.tokenizer.eos_id
  encode = vocab.tokenizer.encode
  probes: dict[int, list[str]] = {}  # What may follow a divergence state: "" when it accepts, then per first
  # character that character alone and the longest token starting with it.
  kept: list[tuple[int, int]] = []
  first_tokens: dict[str, int] = {}

  def first_token(text: str) -> int:
    if text not in first_tokens:
      first_tokens[text] = encode(text)[0]
    return first_tokens[text]

  for s, fixed in _forced_text(columns, classes, accepting, vocab).items():
    ids = encode(fixed)
    token = ids[0]
    if columns[s, classes[token]] < 0:
      continue
    if len(fixed) < FORCED_TEXT_LIMIT:
      after = _walk(columns, classes, s, ids)
      if after < 0:
        continue
      if after not in probes:
        ids = np.flatnonzero(columns[after, classes] >= 0)
        ids = ids[ids != eos]
        ids = ids[np.lexsort((-vocab.lengths[ids], vocab.first[ids]))]  # by first character, longest first
        longest = ids[np.unique(vocab.first[ids], return_index=True)[1]].tolist()
        probes[after] = [""] * bool(accepting[after]) + [vocab.texts[t][0] for t in longest]
        probes[after] += [vocab.texts[t] for t in longest]
      if any(first_token(fixed + probe) != token for probe in probes[after]):
        continue
    kept.append((s, token))
  classes = classes.copy()
  own = {}
  for token in dict.fromkeys(t for _, t in kept):
    own[token] = columns.shape[1] + len(own)
  if own:
    columns = np.hstack([columns, columns[:, [classes[t] for t in own]]])
    for token, column in own.items():
      classes[token] = column
  for s, token in kept:
    keep = columns[s, classes[token]]
    columns[s] = -1
    columns[s, classes[token]] = keep
  return columns, classes


def _over(size: int, name: str, most: int, limits: Limits, at_least: bool = False) -> ConstraintError:
  return ConstraintError(
    f"the constraint compiles to {'at least ' * at_least}{size} automaton {name}, more than max_{name}={most}; "
    f"simplify it (shorter maxLength, fewer optional properties or alternatives) or {limits.remedy.format(name=name)}"
  )


@dataclasses.dataclass(frozen=True)
class Tables:
  """A constraint's token-level automaton (:class:`~mercury_jax.constrain.automaton.Automaton`'s arrays)."""

  classes: np.ndarray
  table: np.ndarray
  accepting: np.ndarray
  distance: np.ndarray
  forced: np.ndarray
  start: int


def build(
  text: fsa.Dfa,
  vocab: Vocab,
  limits: Limits,
  what: str,
  param: str | None,
  *,
  canonical: bool,
  budget: fsa.Budget = fsa.UNBOUNDED,
) -> Tables:
  """The token-level automaton of the byte automaton ``text`` (module docstring), its work spent on ``budget``.

  Raises:
    ConstraintError: No token sequence is accepted, or the automaton passes the limits (``what`` and ``param``
      name the constraint).
    fsa.Exhausted: ``budget``'s work ran out.
  """
  impossible = ConstraintError(
    "no token sequence satisfies the constraint with this tokenizer (it can only write the text pieces it has); "
    "change the constraint"
  )
  if text.empty:
    raise impossible
  most = limits.rows(vocab)
  found = _token_rows(text, vocab, most, budget)
  if isinstance(found, int):
    raise limits.refusal(found, what, param, most, "token-level")
  columns, classes, accepting = _with_done(*found, vocab.tokenizer.eos_id)
  start = 1
  live = _distance(columns, accepting) >= 0
  if not live[start]:
    raise impossible
  columns = np.where(live[np.maximum(columns, 0)], columns, -1).astype(np.int32)
  if canonical:
    columns, classes = _canonicalize(columns, classes, accepting, vocab)
  reachable = _reachable(columns, start)
  keep = np.concatenate([[DONE], reachable[reachable != DONE]])
  renumber = np.full(columns.shape[0], -1, np.int32)
  renumber[keep] = np.arange(len(keep), dtype=np.int32)
  columns = np.where(columns >= 0, renumber[np.maximum(columns, 0)], -1)[keep]
  columns, classes = _classes(columns, classes)
  minimized = _minimized(columns, classes, accepting[keep], limits.max_states)
  if isinstance(minimized, int):
    raise _over(minimized, "states", limits.max_states, limits, at_least=True)
  table, classes, accepting = minimized
  distance = _distance(table, accepting)
  assert (distance >= 0).all(), "pruning left a state that cannot reach acceptance"
  allowed_count = (table >= 0).astype(np.int64) @ np.bincount(classes, minlength=table.shape[1])
  member = np.zeros(table.shape[1], np.int32)
  member[classes] = np.arange(len(classes), dtype=np.int32)  # Some token of each class: the token of a singleton.
  forced = np.where(allowed_count == 1, member[np.argmax(table >= 0, axis=1)], -1).astype(np.int32)
  for name, size, most in (
    ("states", table.shape[0], limits.max_states),
    ("classes", table.shape[1], limits.max_classes),
    ("edges", int(np.count_nonzero(table >= 0)), limits.max_edges),
  ):
    if size > most:
      raise _over(size, name, most, limits)
  for array in (classes, table, accepting, distance, forced):
    array.flags.writeable = False
  return Tables(classes, table, accepting, distance, forced, start)
