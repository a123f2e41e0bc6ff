"""The host half of structured output: a constraint compiled into a token-level automaton of plain arrays.

outlines-core's ``Index`` turns a regular expression and the tokenizer's vocabulary into token transitions; this module
renumbers them into the dense int32 arrays that :mod:`mercury_jax.sampling.automata` runs over inside the jitted loop:

* State 0 is ``DONE`` (after EOS), where every token goes to ``DONE``. EOS is allowed exactly in accepting states.
* Equivalent states (the same token sequences lead from them to acceptance) are merged: outlines-core does not
  minimize, and a regex that repeats a part (``X(,X)*``, nested values, unrolled recursion) has a copy of the part's
  states per repetition.
* Tokens whose columns of the transition table are equal share a class, so the table is ``[states, classes]``.
* Text that every continuation of a state begins with (a JSON Schema's keys and punctuation) gets exactly one
  tokenisation, the tokenizer's own: such states allow a single token (``forced``), which the engine commits without
  spending model confidence, and which is what the tokenizer would write, so canonical text stays accepted.
* ``distance`` counts the fewest tokens to acceptance, so a block never runs out of room mid-structure.

Only the tokenizer's text pieces are used: its special ids (``special_mask``) and the tokens whose bytes
(``token_bytes``) are not whole UTF-8 text (a byte piece >= 0x80, a byte-level BPE piece that holds part of a
character) are forbidden everywhere but in ``DONE``. :class:`Compiler` is the front door: regexes,
JSON Schemas (:mod:`mercury_jax.constrain.schema`) and "any JSON object", compiled once per tokenizer and cached.

Size limits hold before anything large is built: outlines-core's automaton (before minimizing) may have at most
:data:`PRE_PRUNING_FACTOR` times ``max_states`` states. A static estimate of the regex
(:func:`~mercury_jax.constrain.regexes.min_states`, and per keyword in the schema rewriter) refuses larger
constraints in milliseconds; the count of outlines-core's states refuses them again before the dense
``[states, vocab]`` table; the final automaton is held to ``max_states``, ``max_classes`` and ``max_edges``.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import re
import threading
from collections.abc import Iterable
from typing import ClassVar

import numpy as np
import outlines_core

from mercury_jax.constrain import regexes, schema as schema_lib
from mercury_jax.constrain.schema import Budget, ConstraintError
from mercury_jax.data.tokenizer import TextTokenizer

__all__ = ["Automaton", "Compiler", "ConstraintError"]

FORCED_TEXT_LIMIT = 64  # Characters of fixed text looked ahead per state (a shorter look-ahead is still correct).
# outlines-core states (reachable through the tokens the automaton allows) per final state that a compile may build
# before minimizing and pruning; more is refused before the dense table (from a static estimate, before outlines-core
# runs too). A json_object 4 deep (JSON_OBJECT_DEPTH) builds 4001 states for 335 final ones: within 8 * 512.
PRE_PRUNING_FACTOR = 8


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Automaton:
  """A constraint as a deterministic automaton over token ids (read-only arrays).

  Attributes:
    kind: ``"regex"``, ``"json_schema"`` or ``"json_object"``.
    source: The constraint text (the regex, or the schema as compact JSON in its own key order); ``kind`` and
      ``source`` compile to this automaton again with the same tokenizer.
    regex: The regular expression the automaton was built from.
    key: Hex sha256 of the kind, the source, the tokenizer and the compiler's options: the cache key.
    classes: int32 [vocab]: token id -> class (tokens with identical transitions share one).
    table: int32 [states, classes]: the next state, or -1 for a forbidden token.
    accepting: bool [states].
    distance: int32 [states]: the fewest tokens from a state to an accepting one (0 when accepting).
    forced: int32 [states]: the one token allowed in a state (EOS counted), or -1.
    start: The initial state.
    eos_id: The end-of-sequence id: allowed in accepting states, where it leads to ``DONE``.
    mask_id: The tokenizer's mask id, allowed nowhere but in ``DONE`` (ids past the vocabulary take its class).
  """

  kind: str
  source: str
  regex: str
  key: str
  classes: np.ndarray
  table: np.ndarray
  accepting: np.ndarray
  distance: np.ndarray
  forced: np.ndarray
  start: int
  eos_id: int
  mask_id: int
  DONE: ClassVar[int] = 0  # The state after EOS: accepting, and every token stays there.

  @property
  def num_states(self) -> int:
    return self.table.shape[0]

  @property
  def num_classes(self) -> int:
    return self.table.shape[1]

  @property
  def num_edges(self) -> int:
    """Allowed ``(state, class)`` pairs: the transitions the device's program runs over."""
    return int(np.count_nonzero(self.table >= 0))

  @property
  def nbytes(self) -> int:
    return sum(a.nbytes for a in (self.classes, self.table, self.accepting, self.distance, self.forced))

  def next_state(self, state: int, token: int) -> int:
    """The state after ``token`` from ``state``; -1 when the token is forbidden there."""
    return int(self.table[state, self.classes[token]])

  def walk(self, tokens: Iterable[int], state: int | None = None) -> int:
    """The state after ``tokens`` from ``state`` (default: the start); -1 as soon as one is forbidden."""
    state = self.start if state is None else state
    for token in tokens:
      state = self.next_state(state, token)
      if state < 0:
        return -1
    return state

  def accepts(self, tokens: Iterable[int]) -> bool:
    """Whether ``tokens`` from the start end in an accepting state (``DONE``, after EOS, is one)."""
    state = self.walk(tokens)
    return state >= 0 and bool(self.accepting[state])

  def allowed(self, state: int) -> np.ndarray:
    """The token ids allowed in ``state`` (ascending)."""
    return np.flatnonzero(self.table[state, self.classes] >= 0)

  def __repr__(self) -> str:
    return (
      f"Automaton(kind={self.kind!r}, states={self.num_states}, classes={self.num_classes}, edges={self.num_edges}, "
      f"key={self.key[:12]}...)"
    )


@dataclasses.dataclass(frozen=True)
class _Vocab:
  """The tokenizer as the automaton builder sees it."""

  tokenizer: TextTokenizer
  index_vocabulary: outlines_core.Vocabulary  # Every non-special token's bytes, and the sentinel.
  texts: tuple[str | None, ...]  # Each id's text, None for ids the automaton never allows outside DONE.
  first: np.ndarray  # int32 [vocab]: the code point a token's text starts with, -1 for None texts
  lengths: np.ndarray  # int32 [vocab]: characters of each token's text
  excluded: np.ndarray  # int64: ids outlines may use (part of a UTF-8 character) that the automaton forbids
  digest: bytes  # sha256 of the serialized tokenizer
  spells_ascii: bool  # Every ASCII character is a token: outlines' states are the regex's, as min_states counts.

  @classmethod
  def of(cls, tokenizer: TextTokenizer) -> _Vocab:
    texts: list[str | None] = [None] * tokenizer.vocab_size
    raw: dict[bytes, list[int]] = collections.defaultdict(list)
    excluded = []
    for token_id in np.flatnonzero(~tokenizer.special_mask).tolist():
      data = tokenizer.token_bytes(token_id)
      if not data:
        continue
      raw[data].append(token_id)
      try:
        texts[token_id] = data.decode("utf-8")
      except UnicodeDecodeError:
        excluded.append(token_id)  # Part of a character: outlines may walk it, the automaton forbids it.
    raw[regexes.SENTINEL.encode()].append(tokenizer.vocab_size)  # An id past the vocabulary (see full_match).
    first = np.array([ord(t[0]) if t else -1 for t in texts], np.int32)
    return cls(
      tokenizer=tokenizer,
      index_vocabulary=outlines_core.Vocabulary(tokenizer.eos_id, dict(raw)),
      texts=tuple(texts),
      first=first,
      lengths=np.array([len(t) if t else 0 for t in texts], np.int32),
      excluded=np.asarray(excluded, np.int64),
      digest=hashlib.sha256(tokenizer.to_bytes()).digest(),
      spells_ascii=set(map(chr, range(128))) <= set(texts),
    )


@dataclasses.dataclass(frozen=True)
class _Limits:
  max_states: int
  max_classes: int
  max_edges: int
  remedy: str = "raise the compiler's max_{name}"  # how a user raises a limit (``{name}``: states, ...)

  @property
  def budget(self) -> Budget:
    """What outlines-core may build before minimizing (:data:`PRE_PRUNING_FACTOR`)."""
    return Budget(self.max_states, PRE_PRUNING_FACTOR, self.remedy.format(name="states"))


def _index(regex: str, vocab: _Vocab) -> tuple[dict, set, int]:
  """outlines-core's token transitions of the texts ``regex`` matches in full: ``(transitions, finals, start)``, the
  start being the state after the sentinel token (see :func:`~mercury_jax.constrain.regexes.full_match`).

  Raises:
    ConstraintError: The regex is invalid, or some prefix of it has no token that continues it.
  """
  if not regexes.balanced(regex):
    raise ConstraintError(regexes.explain_regex_error(regex), param="regex")
  try:
    index = outlines_core.Index(regexes.full_match(regex), vocab.index_vocabulary)
  except ValueError as e:
    message = str(e)
    if "incompatible with the regex" not in message:
      raise ConstraintError(regexes.explain_regex_error(regex), param="regex") from None
    chars = re.search(r"characters: \[(.*)\]", message)
    raise ConstraintError(
      f"no token can continue some prefix of the constraint (it needs one of {chars.group(1) if chars else '?'}); "
      "write it with characters the tokenizer has"
    ) from None
  transitions = index.get_transitions()
  start = transitions.get(index.get_initial_state(), {}).get(vocab.tokenizer.vocab_size)
  return transitions, index.get_final_states(), start


def _rows(transitions: dict, start: int, vocab: _Vocab) -> dict[int, tuple[np.ndarray, np.ndarray]]:
  """outlines-core's states reachable from ``start`` through tokens the automaton allows, in breadth-first order,
  each with the ``(tokens, next states)`` it allows (outlines also lists states no token reaches, and states inside
  UTF-8 characters that only byte pieces reach)."""
  allowed = np.ones(vocab.tokenizer.vocab_size + 1, bool)  # The last entry stands for every id past the vocabulary.
  allowed[vocab.excluded] = allowed[-1] = False
  rows, order, seen = {}, [start], {start}
  for state in order:
    row = transitions.get(state, {})
    tokens = np.fromiter(row.keys(), np.int64, len(row))
    targets = np.fromiter(row.values(), np.int64, len(row))
    keep = allowed[np.minimum(tokens, len(allowed) - 1)]
    rows[state] = tokens[keep], targets[keep]
    for target in np.unique(targets[keep]).tolist():
      if target not in seen:
        seen.add(target)
        order.append(target)
  return rows


def _dense(rows: dict, finals: set, vocab: _Vocab) -> tuple[np.ndarray, np.ndarray]:
  """``(table [states, vocab], accepting)`` of the states of ``rows`` (numbered 1 on, in their order; 0 is DONE), with
  EOS wired in."""
  order = np.fromiter(rows, np.int64, len(rows))
  ranks = np.argsort(order)
  table = np.full((len(order) + 1, vocab.tokenizer.vocab_size), -1, np.int32)
  table[Automaton.DONE] = Automaton.DONE
  for number, (tokens, targets) in enumerate(rows.values(), start=1):
    table[number, tokens] = ranks[np.searchsorted(order, targets, sorter=ranks)] + 1
  accepting = np.array([True] + [s in finals for s in rows])
  table[1:, vocab.tokenizer.eos_id] = np.where(accepting[1:], Automaton.DONE, -1)
  return table, accepting


def _distance(table: np.ndarray, accepting: np.ndarray) -> np.ndarray:
  """Fewest tokens from each state to an accepting one (breadth-first on the reversed graph); -1 where none."""
  distance = np.where(accepting, 0, -1).astype(np.int32)
  frontier = accepting.copy()
  step = 0
  while frontier.any():
    step += 1
    hit = ((table >= 0) & frontier[np.maximum(table, 0)]).any(axis=1) & (distance < 0)
    distance[hit] = step
    frontier = hit
  return distance


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


def _classes(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """``(columns [states, classes], classes [vocab])``: equal columns share a class, numbered by first token."""
  weights = np.random.default_rng(0).integers(1, 2**63, size=table.shape[0], dtype=np.uint64)
  hashes = (table.T.astype(np.uint64) * weights).sum(axis=1)  # wraps around: a hash of each column
  _, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
  rank = np.empty_like(first)
  rank[np.argsort(first)] = np.arange(len(first))
  columns, classes = table[:, np.sort(first)], rank[inverse.reshape(-1)]
  if not np.array_equal(columns[:, classes], table):  # A hash collision: the slow exact way.
    columns, classes = np.unique(table, axis=1, return_inverse=True)
  return np.ascontiguousarray(columns, np.int32), classes.reshape(-1).astype(np.int32)


def _equivalent(columns: np.ndarray, accepting: np.ndarray) -> np.ndarray:
  """int32 [states]: the class of equivalent states each state belongs to, numbered in order of first member.

  Moore's partition refinement: states split by acceptance (DONE, where every token is allowed, alone), then by the
  classes their successors are in, until nothing splits. Rows are compared by a hash first (a round costs one pass
  over the table; a chain of states takes a round per few states, as tokens span several characters), checked
  exactly at the end, and compared exactly if a hash collided.
  """
  missing, targets = columns < 0, np.maximum(columns, 0)
  weights = np.random.default_rng(1).integers(1, 2**63, size=columns.shape[1] + 1, dtype=np.uint64)

  def hashed(block):
    rows = np.where(missing, 0, block[targets] + 1).astype(np.uint64)
    return np.unique((rows * weights[1:]).sum(axis=1) + block.astype(np.uint64) * weights[0], return_inverse=True)

  def exact(block):
    return np.unique(np.column_stack([block, np.where(missing, -1, block[targets])]), axis=0, return_inverse=True)

  initial = accepting.astype(np.int64) + 2 * (np.arange(len(accepting)) == Automaton.DONE)
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
      if not grew:
        break
    members = np.unique(block, return_index=True)[1]
    rows = np.where(missing, -1, block[targets])
    if np.array_equal(rows, rows[members][block]) and np.array_equal(accepting, accepting[members][block]):
      return block.astype(np.int32)
  raise AssertionError("partition refinement did not converge")


def _minimized(table: np.ndarray, accepting: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """``(table, accepting)`` with equivalent states merged; a class is numbered by its first member, so DONE stays 0
  and the start 1."""
  columns, classes = _classes(table)
  block = _equivalent(columns, accepting)
  first = np.unique(block, return_index=True)[1]
  quotient = np.where(columns[first] >= 0, block[np.maximum(columns[first], 0)], -1)
  return quotient[:, classes].astype(np.int32), accepting[first]


def _forced_text(table: np.ndarray, accepting: np.ndarray, vocab: _Vocab, eos: int) -> dict[int, str]:
  """The longest text every continuation of a state begins with, for states where it is not empty.

  F(s) is the longest common prefix over the allowed tokens t of text(t) + F(next(s, t)), and empty in accepting
  states. It is the least fixed point reached from all-empty by iterating that rule (each round can only lengthen
  F, capped at ``FORCED_TEXT_LIMIT`` characters); every round's F is a prefix of the true one, so it is always safe.
  """
  allowed = table >= 0
  allowed[:, eos] = False
  first = np.where(allowed, vocab.first[None, :], np.iinfo(np.int32).max).min(axis=1)
  last = np.where(allowed, vocab.first[None, :], -1).max(axis=1)
  candidates = np.flatnonzero((first == last) & ~accepting & (first >= 0))
  edges = {}
  for s in candidates.tolist():
    tokens = np.flatnonzero(allowed[s])
    edges[s] = [(vocab.texts[t], int(table[s, t])) for t in tokens.tolist()]
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


def _walk_dense(table: np.ndarray, state: int, tokens: list[int]) -> int:
  for token in tokens:
    state = int(table[state, token])
    if state < 0:
      return -1
  return state


def _canonicalize(table: np.ndarray, accepting: np.ndarray, vocab: _Vocab) -> np.ndarray:
  """Forbids every token but the tokenizer's own first token of a state's fixed text (in place).

  The tokenizer's first token of the fixed text F is kept only when it is also its first token of F followed by
  anything that may come next (each character that may follow, and the longest token starting with it): BPE merges
  across the end of F would otherwise make the canonical encoding of a whole valid text take another path.
  """
  eos = vocab.tokenizer.eos_id
  encode = vocab.tokenizer.encode
  probes: dict[int, list[str]] = {}  # What may follow a divergence state: "" when it accepts, then per first
  # character that character alone and the longest token starting with it.
  for s, fixed in _forced_text(table, accepting, vocab, eos).items():
    ids = encode(fixed)
    token = ids[0]
    if table[s, token] < 0:
      continue
    if len(fixed) < FORCED_TEXT_LIMIT:
      after = _walk_dense(table, s, ids)
      if after < 0:
        continue
      if after not in probes:
        ids = np.flatnonzero(table[after] >= 0)
        ids = ids[ids != eos]
        ids = ids[np.lexsort((-vocab.lengths[ids], vocab.first[ids]))]  # by first character, longest first
        longest = ids[np.unique(vocab.first[ids], return_index=True)[1]].tolist()
        probes[after] = [""] * bool(accepting[after]) + [vocab.texts[t][0] for t in longest]
        probes[after] += [vocab.texts[t] for t in longest]
      if any(encode(fixed + probe)[0] != token for probe in probes[after]):
        continue
    keep = table[s, token]
    table[s] = -1
    table[s, token] = keep
  return table


def build(
  kind: str, source: str, regex: str, key: str, vocab: _Vocab, limits: _Limits, *, canonical: bool
) -> Automaton:
  """Compiles ``regex`` into an :class:`Automaton` (see the module docstring for the construction)."""
  what, param = ("the regex", "regex") if kind == "regex" else ("the constraint", None)
  if vocab.spells_ascii:
    limits.budget.check(regexes.min_states(regex), what, param)
  transitions, finals, start = _index(regex, vocab)
  impossible = ConstraintError(
    "no token sequence satisfies the constraint with this tokenizer (it can only write ASCII characters and the "
    "text pieces it has); change the constraint"
  )
  if start is None:
    raise impossible
  rows = _rows(transitions, start, vocab)
  limits.budget.check(len(rows), what, param)
  table, accepting = _dense(rows, finals, vocab)
  start = 1
  live = _distance(_classes(table)[0], accepting) >= 0
  if not live[start]:
    raise impossible
  table = np.where(live[np.maximum(table, 0)], table, -1).astype(np.int32)
  if canonical:
    table = _canonicalize(table, accepting, vocab)
  reachable = _reachable(table, start)
  keep = np.concatenate([[Automaton.DONE], reachable[reachable != Automaton.DONE]])
  renumber = np.full(table.shape[0], -1, np.int32)
  renumber[keep] = np.arange(len(keep), dtype=np.int32)
  table = np.where(table >= 0, renumber[np.maximum(table, 0)], -1)[keep]
  table, accepting = _minimized(table, accepting[keep])
  table, classes = _classes(table)
  distance = _distance(table, accepting)
  assert (distance >= 0).all(), "pruning left a state that cannot reach acceptance"
  allowed_count = (table >= 0).astype(np.int64) @ np.bincount(classes, minlength=table.shape[1])
  member = np.zeros(table.shape[1], np.int32)
  member[classes] = np.arange(len(classes), dtype=np.int32)  # Some token of each class: the token of a singleton.
  forced = np.where(allowed_count == 1, member[np.argmax(table >= 0, axis=1)], -1).astype(np.int32)
  automaton = Automaton(
    kind=kind,
    source=source,
    regex=regex,
    key=key,
    classes=classes,
    table=table,
    accepting=accepting,
    distance=distance,
    forced=forced,
    start=start,
    eos_id=vocab.tokenizer.eos_id,
    mask_id=vocab.tokenizer.mask_id,
  )
  for name, size, most in (
    ("states", automaton.num_states, limits.max_states),
    ("classes", automaton.num_classes, limits.max_classes),
    ("edges", automaton.num_edges, limits.max_edges),
  ):
    if size > most:
      raise ConstraintError(
        f"the constraint compiles to {size} automaton {name}, more than max_{name}={most}; simplify it (shorter "
        f"maxLength, fewer optional properties or alternatives) or {limits.remedy.format(name=name)}"
      )
  for array in (classes, table, accepting, distance, forced):
    array.flags.writeable = False
  return automaton


class Compiler:
  """Compiles constraints for one tokenizer, once: an LRU cache of automata (and of refusals) keyed by
  :attr:`Automaton.key`. Thread-safe; two threads compiling the same constraint get the same object.

  Args:
    tokenizer: The model's tokenizer.
    max_states: Refuse automata with more states (the device tables are padded to the largest one).
    max_classes: Refuse automata with more token classes.
    max_edges: Refuse automata with more allowed ``(state, class)`` pairs.
    cache_size: Automata (and refused constraints) kept.
    remedy: What the refusal of a constraint above a limit tells the user to do, ``{name}`` being ``states``,
      ``classes`` or ``edges`` (a server names its own flag).
    canonical: Give fixed text the tokenizer's own tokenisation only (see the module docstring); False keeps every
      tokenisation, for tests and comparisons.
    recursion_depth: Levels a recursive ``$ref`` of a JSON Schema is unrolled to
      (:data:`~mercury_jax.constrain.schema.RECURSION_DEPTH`).
  """

  def __init__(
    self,
    tokenizer: TextTokenizer,
    *,
    max_states: int = 4096,
    max_classes: int = 1024,
    max_edges: int = 65536,
    cache_size: int = 64,
    remedy: str = "raise the compiler's max_{name}",
    canonical: bool = True,
    recursion_depth: int = schema_lib.RECURSION_DEPTH,
  ):
    for name, value in (
      ("max_states", max_states),
      ("max_classes", max_classes),
      ("max_edges", max_edges),
      ("recursion_depth", recursion_depth),
    ):
      if value < 1:
        raise ValueError(f"{name}={value} must be >= 1")
    if cache_size < 0:
      raise ValueError(f"cache_size={cache_size} must be >= 0")
    self._vocab = _Vocab.of(tokenizer)
    self._limits = _Limits(max_states, max_classes, max_edges, remedy)
    self._budget = self._limits.budget if self._vocab.spells_ascii else None  # for the schema's own estimates
    self._canonical = canonical
    self._recursion_depth = recursion_depth
    self._cache: collections.OrderedDict[str, Automaton | ConstraintError] = collections.OrderedDict()
    self._cache_size = cache_size
    self._lock = threading.Lock()

  def regex(self, pattern: str) -> Automaton:
    """The automaton of texts that ``pattern`` matches in full (a leading ``^`` and trailing ``$`` are optional).

    Raises:
      ConstraintError: The regex is invalid, uses a feature the automaton cannot express, no token sequence matches
        it, or its automaton exceeds the limits.
    """
    if not isinstance(pattern, str) or not pattern:
      raise ConstraintError("the regex must be a non-empty string", param="regex")
    return self._compile("regex", pattern, lambda: regexes.normalize_regex(pattern))

  def json_schema(self, schema: dict | str) -> Automaton:
    """The automaton of compact JSON texts (no whitespace between tokens) that validate against ``schema``.

    Args:
      schema: A JSON Schema, as a dict or as JSON text.

    Raises:
      ConstraintError: The schema is invalid JSON Schema, uses a keyword the compiler does not enforce (``param``
        names it), or its automaton exceeds the limits.
    """
    if isinstance(schema, str):
      try:
        schema = json.loads(schema)
      except json.JSONDecodeError as e:
        raise ConstraintError(f"the JSON Schema is not valid JSON: {e.msg} at character {e.pos}") from None
    try:
      source = json.dumps(schema, separators=(",", ":"))
    except (TypeError, ValueError) as e:
      raise ConstraintError(f"the JSON Schema must be JSON data (dicts, lists, strings, numbers): {e}") from None
    return self._compile(
      "json_schema", source, lambda: schema_lib.schema_regexes(schema, self._budget, self._recursion_depth)
    )

  def json_object(self) -> Automaton:
    """The automaton of compact JSON objects (OpenAI's ``response_format`` ``json_object``): containers nest up to
    :data:`~mercury_jax.constrain.schema.JSON_OBJECT_DEPTH` deep, the object included (values inside it 3 deep), or
    as deep as this compiler's limits allow."""

    def regexes_deepest_first():
      for depth in range(schema_lib.JSON_OBJECT_DEPTH, 0, -1):
        schema = {"type": "object", "additionalProperties": schema_lib.any_value(depth - 1)}
        yield schema_lib.schema_regex(schema, self._budget)

    return self._compile("json_object", "", regexes_deepest_first)

  def _compile(self, kind: str, source: str, regex_of, canonical: bool | None = None) -> Automaton:
    """The cached automaton of ``kind`` and ``source``; ``regex_of()`` gives its regex, or regexes to try in turn
    until one fits the limits."""
    canonical = self._canonical if canonical is None else canonical
    key = _key(kind, source, self._vocab.digest, canonical, self._recursion_depth)
    with self._lock:
      found = self._cache.get(key)
      if found is not None:
        self._cache.move_to_end(key)
    if found is None:
      try:
        candidates = regex_of()
        for regex in [candidates] if isinstance(candidates, str) else candidates:
          try:
            found = build(kind, source, regex, key, self._vocab, self._limits, canonical=canonical)
            break
          except ConstraintError as e:
            found = e
      except ConstraintError as e:
        found = e
      with self._lock:
        found = self._cache.setdefault(key, found)
        self._cache.move_to_end(key)
        while len(self._cache) > self._cache_size:
          self._cache.popitem(last=False)
    if isinstance(found, ConstraintError):
      raise ConstraintError(str(found), param=found.param)
    return found


def _key(kind: str, source: str, tokenizer_digest: bytes, canonical: bool, recursion_depth: int) -> str:
  """Hex sha256 of the length-prefixed parts."""
  digest = hashlib.sha256()
  options = f"{'canonical' if canonical else 'every'} recursion_depth={recursion_depth}".encode()
  for part in (kind.encode(), source.encode(), tokenizer_digest, options):
    digest.update(len(part).to_bytes(8, "little") + part)
  return digest.hexdigest()
