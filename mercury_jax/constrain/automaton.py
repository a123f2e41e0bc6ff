"""The host half of structured output: a constraint compiled into a token-level automaton of plain arrays.

A constraint is first the byte automaton of its texts (:mod:`~mercury_jax.constrain.fsa`): a JSON Schema's, built
by :mod:`~mercury_jax.constrain.schema`; a regex's, read bottom-up by
:mod:`~mercury_jax.constrain.patterns` when its syntax means the same in Rust and Python (literals, explicit
classes, groups, repeats: every regex written out of a schema), else parsed by outlines-core over single bytes (Rust
syntax, its Unicode tables). Then the tokenizer's vocabulary is read through it (:mod:`~mercury_jax.constrain.tokens`)
into the dense int32 arrays that :mod:`mercury_jax.sampling.automata` runs over inside the jitted loop.
:class:`Compiler` is the front door: regexes, JSON Schemas and "any JSON object", compiled once per tokenizer and
cached.

outlines-core's JSON Schema compiler and its token index are no longer used for schemas: the compiler writes a regex,
and a regex cannot say what half of JSON Schema needs (``not``, ``if``, a pattern and a length together, keys that
match no pattern, ``unevaluatedProperties``), so those were refused; and its index builds the automaton of the
regex unminimized, token by token, before anything can count it (17 optional strings of up to 8192 characters grew
a process to 24 GB). Byte automata minimized as they are built, with their sizes checked before each table is made,
hold every path to the same limits.

Limits hold on every path (library, command line, server) before anything large is built: a static estimate
refuses in milliseconds what cannot fit (a regex's :func:`~mercury_jax.constrain.regexes.min_states`, a schema's
lengths, counts and enums); every byte automaton built on the way has at most :data:`BYTE_FACTOR` times
``max_states`` states (refused as soon as one would have more); the token-level states before minimizing are held
to :data:`~mercury_jax.constrain.tokens.PRE_PRUNING_FACTOR` times ``max_states``, and all of it to ``max_memory``
bytes of tables; the final automaton to ``max_states``, ``max_classes`` and ``max_edges``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import threading
import warnings
from collections.abc import Iterable
from typing import ClassVar

import numpy as np

from mercury_jax.constrain import fsa, meter, patterns, regexes, render, schema as schema_lib, tokens
from mercury_jax.constrain.errors import ConstraintError
from mercury_jax.constrain.options import Options
from mercury_jax.data.tokenizer import TextTokenizer

__all__ = ["Automaton", "Compiler", "ConstraintError"]

BYTE_FACTOR = 16  # Byte-automaton states per final state that any automaton built on the way may have.
BYTE_TABLE_COPIES = 8  # [states, 256] int32 tables alive at once while byte automata are built (memory estimate).
MAX_MEMORY = 1 << 30  # Bytes of tables a compile may build (the server's compiling processes have the same cap).


class SchemaWarning(UserWarning):
  """A JSON Schema compiled with keywords the compiler read as annotations (ignored): :attr:`Automaton.warnings`."""


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Automaton:
  """A constraint as a deterministic automaton over token ids (read-only arrays).

  Attributes:
    kind: ``"regex"``, ``"json_schema"`` or ``"json_object"``.
    source: The constraint text (the regex, or the schema as compact JSON in its own key order); ``kind`` and
      ``source`` compile to this automaton again with the same tokenizer and compiler options.
    key: Hex sha256 of the kind, the source, the tokenizer and the compiler's options: the cache key.
    classes: int32 [vocab]: token id -> class (tokens with identical transitions share one).
    table: int32 [states, classes]: the next state, or -1 for a forbidden token.
    accepting: bool [states].
    distance: int32 [states]: the fewest tokens from a state to an accepting one (0 when accepting).
    forced: int32 [states]: the one token allowed in a state (EOS counted), or -1.
    start: The initial state.
    eos_id: The end-of-sequence id: allowed in accepting states, where it leads to ``DONE``.
    mask_id: The tokenizer's mask id, allowed nowhere but in ``DONE`` (ids past the vocabulary take its class).
    text: The texts the automaton accepts, as byte ranges (:class:`~mercury_jax.constrain.render.Ranges`).
    built: How those texts were built (:func:`~mercury_jax.constrain.render.tree`), to write them out as a regex.
    written: The regex of a ``"regex"`` constraint (anchors dropped); None for JSON Schemas.
    warnings: The compiler's warning line, if any: what it read as an annotation and ignored (unknown keywords
      and formats) and the lengths it writes shorter than the schema allows; empty when there is none.
  """

  kind: str
  source: str
  key: str
  classes: np.ndarray
  table: np.ndarray
  accepting: np.ndarray
  distance: np.ndarray
  forced: np.ndarray
  start: int
  eos_id: int
  mask_id: int
  text: render.Ranges
  built: tuple = ()
  written: str | None = None
  warnings: tuple[str, ...] = ()
  DONE: ClassVar[int] = tokens.DONE  # The state after EOS: accepting, and every token stays there.

  @functools.cached_property
  def regex(self) -> str:
    """A regular expression (Rust syntax, matched in full) of exactly the texts the automaton accepts: the regex
    of a ``"regex"`` constraint; a JSON Schema's, written out from its byte automaton on first use.

    Raises:
      ConstraintError: The regex would be longer than :data:`~mercury_jax.constrain.render.MAX_LENGTH`.
    """
    return self.written if self.written is not None else render.regex(self.built)

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


def regex_text(regex: str, budget: fsa.Budget) -> fsa.Dfa:
  """The byte automaton of the texts ``regex`` (Rust syntax, outlines-core's) matches in full.

  Raises:
    ConstraintError: The regex is invalid, or uses what an automaton cannot express.
    fsa.TooLarge: outlines-core's automaton has more states than ``budget``.
  """
  if not regexes.balanced(regex):
    raise ConstraintError(regexes.explain_regex_error(regex), param="regex")
  try:
    transitions, start, finals = regexes.byte_automaton(regex)
  except ValueError:
    raise ConstraintError(regexes.explain_regex_error(regex), param="regex") from None
  budget.check(len(transitions))
  number = {start: 0}
  order = [start]
  for state in order:
    for target in transitions.get(state, {}).values():
      if target not in number:
        number[target] = len(order)
        order.append(target)
  table = np.full((len(order), fsa.ALPHABET), -1, np.int32)
  for state in order:
    row = transitions.get(state, {})
    if row:
      table[number[state], list(row)] = [number[t] for t in row.values()]
  return fsa.minimize(fsa.from_table(table, np.array([s in finals for s in order])))


class Compiler:
  """Compiles constraints for one tokenizer, once: an LRU cache of automata (and of refusals) keyed by
  :attr:`Automaton.key`. Thread-safe; two threads compiling the same constraint get the same object.

  Args:
    tokenizer: The model's tokenizer.
    max_states: Refuse automata with more states (the device tables are padded to the largest one).
    max_classes: Refuse automata with more token classes.
    max_edges: Refuse automata with more allowed ``(state, class)`` pairs.
    max_memory: Bytes of tables one compile may build (estimated before each is made): past it, the constraint is
      refused, so a hostile schema cannot take the process's memory.
    cache_size: Automata (and refused constraints) kept.
    remedy: What the refusal of a constraint above a limit tells the user to do, ``{name}`` being ``states``,
      ``classes`` or ``edges`` (a server names its own flag).
    canonical: Give fixed text the tokenizer's own tokenisation only (see :mod:`~mercury_jax.constrain.tokens`);
      False keeps every tokenisation, for tests and comparisons.
    recursion_depth: Levels a recursive ``$ref`` of a JSON Schema is unrolled to.
    **options: The JSON Schema settings of :class:`~mercury_jax.constrain.options.Options` (``draft``,
      ``strict``, ``exact_numbers``).
  """

  def __init__(
    self,
    tokenizer: TextTokenizer,
    *,
    max_states: int = 4096,
    max_classes: int = 1024,
    max_edges: int = 65536,
    max_memory: int = MAX_MEMORY,
    cache_size: int = 64,
    remedy: str = "raise the compiler's max_{name}",
    canonical: bool = True,
    recursion_depth: int = schema_lib.RECURSION_DEPTH,
    **options,
  ):
    for name, value in (
      ("max_states", max_states),
      ("max_classes", max_classes),
      ("max_edges", max_edges),
      ("max_memory", max_memory),
      ("recursion_depth", recursion_depth),
    ):
      if value < 1:
        raise ValueError(f"{name}={value} must be >= 1")
    if cache_size < 0:
      raise ValueError(f"cache_size={cache_size} must be >= 0")
    self._vocab = tokens.Vocab.of(tokenizer)
    self._limits = tokens.Limits(max_states, max_classes, max_edges, max_memory, remedy)
    self._options = Options(recursion_depth=recursion_depth, **options)
    memory_states = max_memory // (BYTE_TABLE_COPIES * 4 * fsa.ALPHABET)
    self._budget = fsa.Budget(max(1, min(BYTE_FACTOR * max_states, memory_states)))
    self._canonical = canonical
    self._cache: collections.OrderedDict[str, Automaton | ConstraintError] = collections.OrderedDict()
    self._cache_size = cache_size
    self._lock = threading.Lock()

  @property
  def options(self) -> Options:
    """The JSON Schema settings."""
    return self._options

  def regex(self, pattern: str) -> Automaton:
    """The automaton of texts that ``pattern`` matches in full (a leading ``^`` and trailing ``$`` are optional).

    Raises:
      ConstraintError: The regex is invalid, uses a feature the automaton cannot express, no token sequence matches
        it, or its automaton exceeds the limits.
    """
    if not isinstance(pattern, str) or not pattern:
      raise ConstraintError("the regex must be a non-empty string", param="regex")
    regex = regexes.normalize_regex(pattern)

    def texts(work: fsa.Budget):
      if regexes.plain_syntax(regex):  # read bottom-up, minimized as it goes: no large unminimized automaton
        try:
          with meter.active(work.fresh(schema_lib.WORK)) as budget:
            text = patterns.full(regex, budget)
        except fsa.TooLarge as e:
          raise self._too_large(e, "the regex", "regex") from None
        yield text, (), "last"
        return
      if self._vocab.spells_ascii and regexes.min_states(regex) > self._limits.rows(self._vocab):
        rows = self._limits.rows(self._vocab)
        raise self._limits.refusal(regexes.min_states(regex), "the regex", "regex", rows, "token-level")
      try:
        with meter.active(work.fresh(schema_lib.WORK)) as budget:
          text = regex_text(regex, budget)
      except fsa.TooLarge as e:
        raise self._too_large(e, "the regex", "regex") from None
      yield text, (), "last"

    return self._compile("regex", pattern, texts, written=regex)

  def json_schema(self, schema: dict | bool | str) -> Automaton:
    """The automaton of compact JSON texts (no whitespace between tokens) that validate against ``schema``.

    Keywords the compiler does not know are annotations: ignored, and listed in :attr:`Automaton.warnings` (and a
    :class:`SchemaWarning` when compiled); with ``strict=True`` they are refused.

    Args:
      schema: A JSON Schema, as a dict (or boolean) or as JSON text.

    Raises:
      ConstraintError: The schema is invalid JSON Schema, uses a keyword the compiler cannot enforce (``param``
        names it), accepts no value, or its automaton exceeds the limits.
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

    def texts(work: fsa.Budget):
      try:
        yield from schema_lib.compile_schema(schema, self._options, work, self._sizes())
      except fsa.TooLarge as e:
        raise self._too_large(e, "the schema", None) from None

    return self._compile("json_schema", source, texts)

  def json_object(self) -> Automaton:
    """The automaton of compact JSON objects (OpenAI's ``response_format`` ``json_object``): containers nest up to
    :data:`~mercury_jax.constrain.schema.JSON_OBJECT_DEPTH` deep, the object included (values inside it 3 deep), or
    as deep as this compiler's limits allow."""

    def texts(work: fsa.Budget):
      for depth in range(schema_lib.JSON_OBJECT_DEPTH, 1, -1):
        try:
          yield schema_lib.any_object(depth, self._budget, self._options.exact_numbers), (), "try"
        except fsa.TooLarge:
          continue
      try:
        yield schema_lib.any_object(1, self._budget, self._options.exact_numbers), (), "last"
      except fsa.TooLarge as e:
        raise self._too_large(e, "a JSON object", None) from None

    return self._compile("json_object", "", texts)

  def _sizes(self) -> schema_lib.Sizes | None:
    """The static estimates' limit: states a final automaton may have (None when the tokenizer cannot spell every
    ASCII character, so a text of n characters may take fewer than n tokens and states)."""
    if not self._vocab.spells_ascii:
      return None
    rows = self._limits.rows(self._vocab)
    return schema_lib.Sizes(
      rows, lambda states, what, param: self._limits.refusal(states, what, param, rows, "token-level")
    )

  def _tokens(self, text: fsa.Dfa, what: str, param: str | None, work: fsa.Budget, kind: str) -> tokens.Tables:
    """The token-level automaton of ``text``, its work spent on ``work``."""
    try:
      return tokens.build(text, self._vocab, self._limits, what, param, canonical=self._canonical, budget=work)
    except fsa.Exhausted as e:
      raise self._too_large(e, "the schema" if kind == "json_schema" else what, param) from None

  def _too_large(self, error: fsa.TooLarge, what: str, param: str | None) -> ConstraintError:
    if isinstance(error, fsa.Exhausted):
      narrowed = ", even written as the smallest subset the compiler narrows it to" if what == "the schema" else ""
      return ConstraintError(
        f"{what} builds automata of more than {error.states} states in all{narrowed} (the work one compile may do; "
        f"max_states={self._limits.max_states}); make it smaller or {self._limits.remedy.format(name='states')}",
        param=getattr(error, "param", param),
      )
    return self._limits.refusal(error.states, what, getattr(error, "param", param), self._budget.states, "byte-level")

  def _compile(self, kind: str, source: str, texts_of, written: str | None = None) -> Automaton:
    """The cached automaton of ``kind`` and ``source``; ``texts_of(work)`` yields ``(byte automaton, warnings,
    role)`` to try in turn until one fits the limits, building them and their token-level automata within ``work``
    (:data:`~mercury_jax.constrain.schema.COMPILE_WORK`, each attempt at most
    :data:`~mercury_jax.constrain.schema.WORK`): ``"try"``, or ``"last"`` (refused if it does not fit), or ``"floor"``
    (kept while the next ones are tried if it fits; else refused, unless the compiler narrows), or ``"narrow"``
    (a subset of the language: not tried once a floor fits)."""
    key = _key(kind, source, self._vocab.digest, self._canonical, self._options)
    with self._lock:
      found = self._cache.get(key)
      if found is not None:
        self._cache.move_to_end(key)
    if found is None:
      try:
        what, param = ("the regex", "regex") if kind == "regex" else ("the constraint", None)
        chosen = floor = None
        work = self._budget.fresh(schema_lib.COMPILE_WORK)
        try:
          for text, notes, role in texts_of(work):
            if role == "narrow" and floor is not None:
              break  # the whole language, recursion unrolled once, fits: no subset of it is needed
            try:
              arrays = self._tokens(text, what, param, work, kind)
            except ConstraintError as e:
              if role == "last" or (role == "floor" and not self._options.narrow):
                raise
              found = e
              continue
            if role == "floor":  # it fits: a deeper one may too
              floor = (arrays, text, notes)
              continue
            chosen = (arrays, text, notes)
            break
        except ConstraintError:
          if floor is None:
            raise  # else the deeper attempts after the floor, or the compile's work, ran out: the floor stands
        chosen = chosen or floor
        if chosen is None:
          raise found
        arrays, text, notes = chosen
        found = Automaton(
          kind=kind,
          source=source,
          key=key,
          classes=arrays.classes,
          table=arrays.table,
          accepting=arrays.accepting,
          distance=arrays.distance,
          forced=arrays.forced,
          start=arrays.start,
          eos_id=self._vocab.tokenizer.eos_id,
          mask_id=self._vocab.tokenizer.mask_id,
          text=render.Ranges.of(text),
          built=() if written is not None else render.tree(text),
          written=written,
          warnings=tuple(notes),
        )
        for note in found.warnings:
          warnings.warn(note, SchemaWarning, stacklevel=3)
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


def _key(kind: str, source: str, tokenizer_digest: bytes, canonical: bool, options: Options) -> str:
  """Hex sha256 of the length-prefixed parts."""
  digest = hashlib.sha256()
  settings = f"{'canonical' if canonical else 'every'} {options.key}".encode()
  for part in (kind.encode(), source.encode(), tokenizer_digest, settings):
    digest.update(len(part).to_bytes(8, "little") + part)
  return digest.hexdigest()
