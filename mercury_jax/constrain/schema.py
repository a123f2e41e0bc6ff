"""JSON Schema to the byte automaton of its compact JSON texts: the keywords the compiler knows, per draft
(:mod:`~mercury_jax.constrain.keywords`, whose table is ``docs/schema_coverage.md``), enforced exactly or on a
subset of the valid texts, and every text accepted valid.

The schema is read into alternatives (:mod:`~mercury_jax.constrain.reading`), and each alternative into the
language of each kind of value it allows: null and booleans as literal text, numbers
(:mod:`~mercury_jax.constrain.numbers`), strings (:mod:`~mercury_jax.constrain.strings`), arrays
(:mod:`~mercury_jax.constrain.arrays`) and objects (:mod:`~mercury_jax.constrain.objects`), whose items and values
are the languages of their literals, built the same way (and cached). ``enum``/``const`` values are checked against
every literal the alternative was made of by ``jsonschema`` and written as they are.

The texts are compact JSON: no whitespace between tokens, properties in the schema's order. "Any value" (``{}``,
``true``, items or further properties without a schema) nests :data:`ANY_VALUE_DEPTH` containers deep inside a
schema (a ``json_object`` nests :data:`JSON_OBJECT_DEPTH` deep). A recursive ``$ref`` is unrolled
``recursion_depth`` levels, or fewer where the automaton would not fit the compiler's limits; past the last level
the recursive branch is left out where the schema lets it be absent (an ``anyOf`` branch, a property that is not
required, an array that may be empty), and a recursion that cannot end there is refused, naming the ``$ref``.
A schema that accepts no value is refused with the first reason found.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from mercury_jax.constrain import arrays, chains, fsa, keywords, meter, numbers, objects, patterns, strings
from mercury_jax.constrain.document import Document, base_of, dumps
from mercury_jax.constrain.errors import ConstraintError
from mercury_jax.constrain.normal import Conj, Sub, value_key
from mercury_jax.constrain.options import Options
from mercury_jax.constrain.reading import Normalizer, TooManyBranches

RECURSION_DEPTH = 4  # Levels a recursive $ref is unrolled to at most (the compiler's default recursion_depth).
LONG_STRING = 256  # A longer maxLength is written as at most this many characters (each is a state of its own).
WORK = 1 << 24  # States (and partition-refinement steps) one compile attempt may build in all: its time, in units
# that are the same on every machine (about three seconds of CPU on a 2-core Xeon).
COMPILE_WORK = 5 * WORK  # The same for one compile in all: its attempts (the whole schema and each narrowing step)
# and their token-level automata.
ANY_VALUE_DEPTH = 1  # Containers "any value" nests inside a schema ({}, true, items without a schema).
JSON_OBJECT_DEPTH = 4  # Containers a json_object nests (the outer object counts).
_KINDS = ("null", "boolean", "number", "string", "array", "object")


class _Located(fsa.TooLarge):
  """An automaton too large for the budget, built for the subschema at ``param``."""

  def __init__(self, states: int, param: str | None):
    super().__init__(states)
    self.param = param


def _located(error: fsa.TooLarge, param: str | None) -> fsa.TooLarge:
  """``error`` with the subschema it was built for (work used up stays that: no one part is too large)."""
  if isinstance(error, fsa.Exhausted):
    return error
  return _Located(error.states, param)


@dataclasses.dataclass(frozen=True)
class Sizes:
  """What the static estimates refuse: a part that needs more than ``states`` states (a lower bound)."""

  states: int
  refusal: object  # (states, what, param) -> ConstraintError


@functools.cache
def any_value(depth: int, exact: bool = False) -> fsa.Dfa:
  """Any JSON value whose containers nest at most ``depth`` deep (0: scalars only)."""
  scalars = [fsa.literal("null"), fsa.literal("true"), fsa.literal("false")]
  scalars += [numbers.language(numbers.NumberSpec(), fsa.UNBOUNDED, exact), strings.plain(0, None, fsa.UNBOUNDED)]
  if depth == 0:
    return fsa.minimize(chains.union(scalars))
  containers = [any_container("array", depth, exact), any_container("object", depth, exact)]
  return fsa.minimize(chains.union(scalars + containers))


@functools.cache
def any_container(kind: str, depth: int, exact: bool = False) -> fsa.Dfa:
  """Any array (``kind``) or object whose containers nest at most ``depth`` deep (itself included)."""
  inner = any_value(depth - 1, exact)
  if kind == "array":
    return chains.concat(
      [fsa.literal("["), chains.repeat(inner, 0, None, separator=fsa.literal(",")), fsa.literal("]")]
    )
  member = chains.concat([strings.plain(0, None, fsa.UNBOUNDED), fsa.literal(":"), inner])
  return chains.concat([fsa.literal("{"), chains.repeat(member, 0, None, separator=fsa.literal(",")), fsa.literal("}")])


def any_object(depth: int, budget: fsa.Budget, exact: bool = False) -> fsa.Dfa:
  """Compact JSON objects whose containers nest at most ``depth`` deep (the object counts)."""
  member = chains.concat([strings.plain(0, None, budget), fsa.literal(":"), any_value(depth - 1, exact)], budget)
  members = chains.repeat(member, 0, None, budget, separator=fsa.literal(","))
  return chains.concat([fsa.literal("{"), members, fsa.literal("}")], budget)


class Builder:
  """The languages of literals of one document (module docstring).

  Args:
    doc: The document.
    options: The settings.
    budget: The most states any automaton built may have.
    narrowing: How much of the language is written (:class:`Narrowing`).
  """

  def __init__(self, doc: Document, options: Options, budget: fsa.Budget, narrowing: Narrowing | None = None):
    self.doc, self.options, self.budget = doc, options, budget
    self.narrowing = narrowing or EXACT
    self.notes: list[tuple[str, tuple]] = []
    self.capped_notes: dict[str, str] = {}  # what is written as a subset (Narrowing), by where
    self.reader = Normalizer(doc, options.recursion_depth, self.note, self.narrowing.branches, self.narrowed)
    self._cache: dict[tuple, fsa.Dfa] = {}
    self._splits: dict[int, tuple] = {}
    self.keys: dict[tuple, fsa.Dfa] = {}  # the names of a Keys (objects.key_set)

  def note(self, message: str, path: tuple) -> None:
    """Records why an alternative accepts nothing."""
    self.notes.append((message, path))

  def narrowed(self, where: str, phrase: str) -> None:
    """Records that what is written at ``where`` is a subset (``phrase`` says which), for the warning line."""
    self.capped_notes.setdefault(where or "(root)", phrase)

  def lang(self, lits: tuple) -> fsa.Dfa:
    """The texts of the values that satisfy every literal (``()``: any value)."""
    key = tuple((sub.key, positive) for sub, positive in lits)
    if key in self._cache:
      return self._cache[key]
    try:
      alternatives = self.reader.literals(lits)
      if len(alternatives) == 1 and alternatives[0].trivial:
        out = any_value(self.narrowing.any_depth, self.options.exact_numbers)
      else:
        out = fsa.minimize(chains.union([self._conj(c) for c in alternatives], self.budget))
    except fsa.TooLarge as e:
      if isinstance(e, _Located):
        raise
      raise _located(e, ".".join(lits[-1][0].path) or None if lits else None) from None
    except ConstraintError as e:
      if e.param is not None or not lits:
        raise
      raise ConstraintError(str(e), param=".".join(lits[-1][0].path) or None) from None
    self._cache[key] = out
    return out

  def valid(self, value, c: Conj) -> bool:
    """Whether ``value`` satisfies every literal ``c`` was made of (checked by jsonschema; an ``enum``/``const`` by
    a set of its values, the rest of its subschema by jsonschema: a long enum is not scanned once per value)."""
    for sub, positive in c.checks:
      listed, rest = self._split(sub)
      ok = (listed is None or value_key(value) in listed) and self.doc.valid(value, rest, sub.resolver) is True
      if ok is not positive:
        return False
    return True

  def _split(self, sub: Sub) -> tuple[set | None, object]:
    """``(the values of sub's enum/const as keys, or None; sub's schema without them)``."""
    key = id(sub.schema)
    if key not in self._splits:
      schema = sub.schema
      if isinstance(schema, dict) and ("enum" in schema or "const" in schema):
        keys = {value_key(v) for v in schema.get("enum", [])} if "enum" in schema else None
        if "const" in schema and self.doc.rank >= 1:
          const = {value_key(schema["const"])}
          keys = const if keys is None else keys & const
        rest = {k: v for k, v in schema.items() if k not in ("enum", "const")}
        self._splits[key] = (keys, rest, schema)
      else:
        self._splits[key] = (None, schema, schema)
    return self._splits[key][:2]

  def _conj(self, c: Conj) -> fsa.Dfa:
    if c.values is not None:
      texts = [dumps(v) for v in arrays.distinct(c.values) if self.valid(v, c)]
      if not texts:
        self.note("no value of 'enum'/'const' satisfies the rest of the schema", ())
      try:
        return chains.words(texts, self.budget)
      except fsa.TooLarge as e:
        raise _located(e, _keyword_path(c, ("enum", "const"))) from None
    kinds = c.written_kinds
    out = chains.union([self._kind(kind, c) for kind in _KINDS if kind in kinds], self.budget)
    if out.empty and kinds != c.kinds:  # what its keywords apply to is impossible: the other kinds it allows
      out = chains.union([self._kind(kind, c) for kind in _KINDS if kind in c.kinds - kinds], self.budget)
    return out

  def _kind(self, kind: str, c: Conj) -> fsa.Dfa:
    excluded = [v for v in c.excluded if _kind_of(v) == kind]
    if kind == "null":
      return fsa.NOTHING if excluded else fsa.literal("null")
    if kind == "boolean":
      return chains.words([t for t in ("true", "false") if value_key(t == "true") not in map(value_key, excluded)])
    if kind == "number":
      spec = dataclasses.replace(c.number, excluded=c.number.excluded + tuple(numbers.exact(v) for v in excluded))
      try:
        out = numbers.language(spec, self.budget, self.options.exact_numbers)
      except numbers.StepTooLarge as e:
        raise ConstraintError(
          f"'multipleOf': {numbers.decimal_text(e.step)} needs at least {e.states} automaton states to be checked "
          "digit by digit (a step p/10^k needs about p per digit place); give it both minimum and maximum, with at "
          f"most {numbers.MAX_ENUMERATED} multiples between them",
          param=_keyword_path(c, ("multipleOf",)),
        ) from None
      if out.empty:
        self.note("no number satisfies the bounds and steps together", ())
      return out
    if kind == "string":
      if c.max_length is not None and c.min_length > c.max_length:
        self.note(f"minLength={c.min_length} is above maxLength={c.max_length}", ())
        return fsa.NOTHING
      names = tuple(name for name, _ in c.formats)
      high = self.capped(c.max_length, c.min_length, self.narrowing.long_string, c, "maxLength")
      try:
        value = strings.values(
          c.min_length, high, c.patterns, c.not_patterns, names, excluded=tuple(excluded), budget=self.budget
        )
        if value is not None and value.empty and high != c.max_length:  # the patterns need the longer strings
          self.capped_notes.pop(_keyword_path(c, ("maxLength",)) or "(root)", None)
          high = c.max_length
          value = strings.values(
            c.min_length, high, c.patterns, c.not_patterns, names, excluded=tuple(excluded), budget=self.budget
          )
        if value is not None and value.empty:
          self.note("no string satisfies the patterns, formats and lengths together", ())
        return strings.text(value, c.min_length, high, self.budget)
      except fsa.TooLarge as e:
        raise _located(e, _keyword_path(c, ("maxLength", "minLength", "pattern", "format"))) from None
      except ConstraintError as e:
        if e.param is not None:
          raise
        raise ConstraintError(str(e), param=_keyword_path(c, ("pattern",))) from None
    if excluded and any(v for v in excluded):
      return fsa.NOTHING  # a complement that excludes a container value: not written (a subset)
    if not _constrains(c, kind) and not excluded:  # any container: as "any value" writes them
      depth = max(1, self.narrowing.any_depth + (c.written_kinds - {"null"} == {kind}))  # the container itself
      return any_container(kind, depth, self.options.exact_numbers)
    if kind == "array":
      c = dataclasses.replace(c, min_items=max(c.min_items, 1)) if excluded else c
      return arrays.language(c, self)
    c = dataclasses.replace(c, min_properties=max(c.min_properties, 1)) if excluded else c
    return objects.language(c, self)

  def capped(self, high: int | None, low: int, cap: int, c: Conj, word: str) -> int | None:
    """``high``, or ``cap`` (``low`` if more) when it is larger: a subset, reported in the warning line."""
    if high is None or high <= max(cap, low):
      return high
    where = _keyword_path(c, (word,)) or "(root)"
    self.narrowed(where, f"{word}={high} at {where} is written as at most {max(cap, low)}")
    return max(cap, low)

  def string_values(self, lits: tuple) -> fsa.Dfa:
    """The strings (unescaped) that satisfy every literal: property names."""
    out = []
    for c in self.reader.literals(lits):
      if "string" not in c.kinds:
        continue
      if c.values is not None:
        out.append(chains.words([v for v in c.values if isinstance(v, str) and self.valid(v, c)]))
        continue
      excluded = tuple(v for v in c.excluded if isinstance(v, str))
      names = tuple(name for name, _ in c.formats)
      value = strings.values(
        c.min_length, c.max_length, c.patterns, c.not_patterns, names, excluded=excluded, budget=self.budget
      )
      out.append(value if value is not None else chains.repeat(fsa.ANY_CHAR, c.min_length, c.max_length, self.budget))
    return chains.union(out, self.budget)

  def domain(self, lits: tuple, most: int) -> list | None:
    """The distinct values the literals allow when they are few (at most ``most``), else None."""
    values = []
    for c in self.reader.literals(lits):
      if c.values is not None:
        values += [v for v in c.values if self.valid(v, c)]
        continue
      candidates = []
      for kind in c.kinds:
        if kind == "null":
          candidates.append(None)
        elif kind == "boolean":
          candidates += [False, True]
        elif kind == "number" and c.number.integer and c.number.low is not None and c.number.high is not None:
          if c.number.high - c.number.low > most:
            return None
          candidates += list(range(math.ceil(c.number.low), math.floor(c.number.high) + 1))
        else:
          return None
      values += [v for v in candidates if self.valid(v, c)]
    values = arrays.distinct(values)
    return values if 0 < len(values) <= most else None


_CONTAINER_FIELDS = {
  "array": ("min_items", "max_items", "items", "contains", "unique", "unevaluated_items"),
  "object": (
    "min_properties", "max_properties", "properties", "required", "rules", "exists", "names",
    "unevaluated_properties",
  ),
}  # fmt: skip


def _constrains(c: Conj, kind: str) -> bool:
  """Whether ``c`` asks anything of arrays (``kind``) or objects."""
  return any(getattr(c, field) != getattr(_NOTHING_ASKED, field) for field in _CONTAINER_FIELDS[kind])


_NOTHING_ASKED = Conj()


def _keyword_path(c: Conj, words: tuple[str, ...]) -> str | None:
  """The path of the first keyword of ``words`` in the subschemas ``c`` was made of."""
  for sub, _ in c.checks:
    if isinstance(sub.schema, dict):
      for word in words:
        if word in sub.schema:
          return ".".join(sub.path + (word,))
  return None


def _kind_of(value) -> str:
  if value is None:
    return "null"
  if isinstance(value, bool):
    return "boolean"
  if isinstance(value, (int, float)):
    return "number"
  return {str: "string", list: "array", dict: "object"}[type(value)]


def _static(doc: Document, sizes: Sizes | None) -> None:
  """Refuses, in milliseconds and naming the keyword, a length, count or repetition that alone needs more states
  than the compiler may build (each character or item of a text up to that length is a state of its own)."""
  if sizes is None:
    return
  caps = {"maxLength": LONG_STRING, "maxItems": arrays.LONG_ARRAY}
  for schema, path in keywords.subschemas(doc.root, doc.draft):
    for word in ("maxLength", "minLength", "maxItems", "minItems", "maxProperties", "minProperties"):
      value = schema.get(word)
      if isinstance(value, int) and min(value, caps.get(word, value)) + 1 > sizes.states:
        raise sizes.refusal(value + 1, f"{word}={value}", ".".join(path + (word,)))
    found = [("pattern", schema["pattern"])] if isinstance(schema.get("pattern"), str) else []
    found += [("patternProperties", p) for p in schema.get("patternProperties", {}) if isinstance(p, str)]
    for word, pattern in found:
      count = patterns.largest_repeat(pattern)
      if count > sizes.states:
        where = path + ((word,) if word == "pattern" else (word, pattern))
        raise sizes.refusal(count, f"pattern {pattern[:60]!r}", ".".join(where))


@dataclasses.dataclass(frozen=True)
class Narrowing:
  """How much of a schema's language one attempt writes. Each setting below its default writes a subset of the
  valid texts (every text written still validates), named in the automaton's warning line.

  Attributes:
    long_string: A larger ``maxLength`` is written as at most this many characters.
    long_array: A larger ``maxItems`` is written as at most this many items.
    branches: Alternatives kept where ``anyOf``, ``oneOf``, ``if``, dependencies and ``not`` multiply past it (the
      first ones, in the schema's order); None refuses a schema with more than
      :data:`~mercury_jax.constrain.reading.MAX_BRANCHES`.
    optional: Optional listed properties written per object (the first ones, in the schema's order); None: all.
    any_depth: Containers "any value" nests (``{}``, ``true``, items or further properties without a schema).
    depth: Recursion levels at most (the compiler's ``recursion_depth`` when lower; None: that).
    unique_one: ``uniqueItems`` over items that are not from a small finite set is written as arrays of at most
      one item (an automaton cannot remember an unbounded set of earlier items); False refuses it.
  """

  long_string: int = LONG_STRING
  long_array: int = arrays.LONG_ARRAY
  branches: int | None = None
  optional: int | None = None
  any_depth: int = ANY_VALUE_DEPTH
  depth: int | None = None
  unique_one: bool = False


EXACT = Narrowing()  # narrow=False: only the fixed caps on long strings and arrays
WHOLE = Narrowing(unique_one=True)  # narrow=True, first attempt
LADDER = (
  Narrowing(long_string=64, long_array=16, branches=64, depth=2, unique_one=True),
  Narrowing(long_string=16, long_array=4, branches=16, optional=8, any_depth=0, depth=2, unique_one=True),
  Narrowing(long_string=8, long_array=2, branches=4, optional=2, any_depth=0, depth=1, unique_one=True),
  Narrowing(long_string=8, long_array=1, branches=1, optional=0, any_depth=0, depth=1, unique_one=True),
)  # narrow=True: tried in turn when the whole language does not fit the limits


def compile_schema(schema, options: Options, budget: fsa.Budget, sizes: Sizes | None = None):
  """Yields ``(byte automaton of the schema's texts, warnings, role)`` to try in turn (module docstring).

  First the whole language (:data:`WHOLE`; :data:`EXACT` with ``narrow=False``), with recursion unrolled
  ``options.recursion_depth`` levels; then, if the schema recursed, one level (role ``"floor"``: kept in case no
  deeper one fits; with ``narrow=False``, if it does not fit the compiler's limits nothing will), then every depth
  between, deepest first (``"try"``). With ``narrow=True``, then each step of :data:`LADDER` (role ``"narrow"``:
  not tried once a floor fits), the last one ``"last"``. Without the ladder, the only automaton of a schema that
  does not recurse is ``"last"``.

  Raises:
    ConstraintError: The schema is invalid, uses what the compiler cannot enforce, or accepts no value.
    fsa.TooLarge: Its automaton does not fit ``budget`` even at the last attempt (``param`` on it where known).
  """
  doc = Document.of(schema, options)
  names, formats = keywords.unknown(doc.root, doc.draft)
  keywords.report(names, formats, options.strict)  # strict: refused before anything is built
  _static(doc, sizes)
  ladder = LADDER if options.narrow else ()
  for text, builder, role in _attempts(doc, options, budget, WHOLE if options.narrow else EXACT, ladder):
    yield text, keywords.report(names, formats, options.strict, list(builder.capped_notes.values())), role


def _attempts(doc: Document, options: Options, budget: fsa.Budget, whole: Narrowing, ladder: tuple):
  """``(text, builder, role)`` of each attempt (:func:`compile_schema`)."""
  deepest = options.recursion_depth
  depths = [deepest] + ([1] if deepest > 1 else []) + list(range(deepest - 1, 1, -1))
  tried = []  # the texts yielded: a narrowing step that changes nothing is not tried again
  for i, depth in enumerate(depths):
    builder, text = _build(doc, options, budget, whole, depth)
    recursed = builder.reader.recursed
    final = not ladder and (i + 1 == len(depths) or not recursed)
    if isinstance(text, fsa.TooLarge):
      if final:
        raise text
      if not recursed or i == 1:  # too large unrolled once: deeper ones are larger
        break
      continue
    if text.empty:
      raise _refusal(builder, depth)
    tried.append(text)
    yield text, builder, "last" if final else ("floor" if i == 1 else "try")
    if not recursed:
      break
  for j, narrowing in enumerate(ladder):
    final = j + 1 == len(ladder)
    builder, text = _build(doc, options, budget, narrowing, min(deepest, narrowing.depth or deepest))
    if isinstance(text, fsa.TooLarge) or text.empty:
      if not final:
        continue
      if isinstance(text, fsa.TooLarge):
        raise text
      raise _refusal(builder, builder.reader.depth)
    if not final and any(_same(text, other) for other in tried):
      continue
    tried.append(text)
    yield text, builder, "last" if final else "narrow"


def _same(a: fsa.Dfa, b: fsa.Dfa) -> bool:
  """Whether two automata are the same table (built the same way, so the same texts)."""
  return (
    a.columns.shape == b.columns.shape
    and np.array_equal(a.columns, b.columns)
    and np.array_equal(a.classes, b.classes)
    and np.array_equal(a.accepting, b.accepting)
  )


def _build(doc: Document, options: Options, budget: fsa.Budget, narrowing: Narrowing, depth: int):
  """``(builder, the byte automaton of the schema's texts or the fsa.TooLarge that stopped it)``."""
  budget = budget.fresh(WORK)
  builder = Builder(doc, dataclasses.replace(options, recursion_depth=depth), budget, narrowing)
  root = Sub(doc.root, doc.resolver, (), ((id(doc.root), base_of(doc.resolver)),))  # "#" counts as followed
  try:
    with meter.active(budget):
      return builder, builder.lang(((root, True),))
  except fsa.TooLarge as e:
    return builder, e
  except TooManyBranches:
    if not options.narrow:
      raise
    return builder, fsa.TooLarge(0)  # fewer alternatives are tried next


def _refusal(builder: Builder, depth: int) -> ConstraintError:
  """Why the schema accepts no value: a recursion that cannot end, else the first reason noted."""
  cuts = builder.reader.cuts
  if cuts:
    ref, where = next(iter(cuts.items()))
    return ConstraintError(
      f"$ref {ref!r} recurses without end: each level needs the next, and the compiler unrolls {depth} levels; let "
      "the recursion stop (an anyOf branch without it, a property that is not required, an array that may be empty)",
      param=".".join(where),
    )
  message, where = builder.notes[0] if builder.notes else ("its keywords contradict each other", ())
  return ConstraintError(f"the schema accepts no value: {message}", param=".".join(where) or None)


def tool_call_schema(tools: list, name: str | None = None) -> dict:
  """The JSON Schema of one call of OpenAI-style ``tools``: ``{"name": <name>, "arguments": <parameters>}``.

  Args:
    tools: ``[{"type": "function", "function": {"name", "description", "parameters"}}, ...]``; a function without
      ``parameters`` takes none (its arguments are ``{}``).
    name: Only this tool (``tool_choice``); None: any of them.

  Raises:
    ConstraintError: The tools are malformed, a name repeats, or ``name`` is not among them.
  """
  if not isinstance(tools, list) or not tools:
    raise ConstraintError('tools must be a non-empty list of {"type": "function", "function": {...}}', param="tools")
  calls = {}
  for i, tool in enumerate(tools):
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
      raise ConstraintError(
        f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}',
        param=f"tools.{i}",
      )
    if function["name"] in calls:
      raise ConstraintError(f"two tools are named {function['name']!r}; give each a distinct name", param="tools")
    parameters = function.get("parameters")
    calls[function["name"]] = {"type": "object", "properties": {}} if parameters is None else parameters
  if name is not None and name not in calls:
    raise ConstraintError(f"no tool is named {name!r}; the tools are {sorted(calls)}", param="tool_choice")
  chosen = [name] if name is not None else list(calls)

  def call(tool: str, pointer: str) -> dict:
    return {
      "type": "object",
      "properties": {"name": {"const": tool}, "arguments": _moved_refs(calls[tool], pointer + "/properties/arguments")},
      "required": ["name", "arguments"],
      "additionalProperties": False,
    }

  if len(chosen) == 1:
    return call(chosen[0], "")
  return {"anyOf": [call(tool, f"/anyOf/{i}") for i, tool in enumerate(chosen)]}


def _moved_refs(schema, prefix: str):
  """``schema`` with its local ``$ref`` pointers rebased under ``prefix`` (it moves into a bigger schema)."""
  if isinstance(schema, list):
    return [_moved_refs(s, prefix) for s in schema]
  if not isinstance(schema, dict):
    return schema
  moved = {k: _moved_refs(v, prefix) for k, v in schema.items()}
  ref = schema.get("$ref")
  if isinstance(ref, str) and ref.startswith("#"):
    moved["$ref"] = "#" + prefix + ref[1:]
  return moved
