"""JSON Schema to regular expression, for the keywords that the regex really enforces.

outlines-core 0.2.14's ``build_regex_from_schema`` accepts far more than it enforces. Random texts of its automata,
validated with ``jsonschema``, and its source show that it ignores ``minimum``/``maximum``/``exclusive*``/
``multipleOf``, ``uniqueItems``, ``maxProperties``, ``minProperties`` above 1, required names missing from
``properties``, and ``pattern``/``format`` next to a length bound; that ``properties`` hides every sibling
(``anyOf``, a ``type`` list); that it reads ``allOf`` as a concatenation and ``oneOf`` as ``anyOf``; that its
``time``, ``email`` and ``uri`` regexes write invalid JSON, ``date`` and ``date-time`` invalid dates, ``{}`` (any
value) a regex without its parentheses, ``enum`` objects unescaped keys and ``pattern`` whatever characters it
matches (a ``"`` ends the string).

So a schema is first rewritten here into the part it handles exactly, and what outlines gets wrong (numbers,
formats, patterns, ``enum``, ``const``, any value, objects with ``patternProperties``, unique arrays) is replaced by
regexes of our own, spliced in through placeholder constants. The text is compact JSON: no whitespace between
tokens, properties in the schema's order, the required ones always present. Every text the automaton accepts
validates against the schema; some valid texts are never written (the subsets below). Keyword by keyword
(docs/schema_coverage.md has the same as a table):

* Enforced exactly: ``type`` (also lists), ``enum``, ``const``, ``required``, ``properties``, ``items``,
  ``prefixItems`` (and draft-7 ``items`` lists), ``minItems``/``maxItems``, ``minLength``/``maxLength``,
  ``minimum``/``maximum``/``exclusiveMinimum``/``exclusiveMaximum`` with any decimal bounds (exact decimal
  arithmetic, no binary rounding), ``allOf`` (merged), ``anyOf``, local ``$ref``, ``nullable: true`` (OpenAPI 3.0,
  read as "this schema, or null"; in ``allOf`` null passes only if every part lets it), ``additionalProperties:
  false``. Annotations (``title``, ``description``, ``default``, ``examples``, ``$defs`` ...) are ignored.
* Enforced on a subset of the valid values: an object with ``properties`` writes only those, never additional
  ones; ``pattern`` matches in full (JSON Schema searches); ``format`` writes the common spelling of
  :data:`FORMATS`; bounded numbers have no exponent; "any value" (``{}``, ``true``, items or additional properties
  without a schema) nests :data:`ANY_VALUE_DEPTH` container deep inside a schema (a ``json_object`` nests
  :data:`JSON_OBJECT_DEPTH` deep).
* ``$ref`` recursion: unrolled ``recursion_depth`` levels (:data:`RECURSION_DEPTH`, a compiler argument), or fewer
  where the automaton would not fit the compiler's limits. At the last level the recursive branch is cut where the
  schema lets it be absent: an ``anyOf``/``oneOf`` branch (or ``type`` list entry), a property that is not
  required, the items of an array that may be empty, additional properties, a ``patternProperties`` entry, the
  non-null side of ``nullable``. A recursion that cannot end there (each level requires the next) is refused,
  naming the ``$ref`` where it first recurs.
* ``multipleOf``: for integers, a step that divides 1 needs nothing (and p/q is p). A power of ten up to 1
  (``0.01``, ``1``) is enforced with any bounds (no nonzero digit past its place); a larger one (``10``) without
  bounds. Any other step, or a larger power of ten with bounds, lists its multiples between ``minimum`` and
  ``maximum`` (at most :data:`MAX_ENUMERATED`, each with any trailing zeros); without both bounds it is refused.
* ``uniqueItems``: items from a finite set of at most :data:`MAX_UNIQUE` values (``enum``, ``const``, booleans,
  null, integers with both bounds) are written distinct: in any order while the distinct arrays number at most
  :data:`MAX_ENUMERATED`, otherwise in the set's order (the enum's). Other items are refused: an automaton cannot
  remember an unbounded set of earlier items. An array of at most one item needs nothing; tuples are refused.
* ``patternProperties``: after the listed properties (each also satisfies every pattern that finds it), entries
  whose key contains a match of a pattern, as JSON Schema reads it (``^x-`` writes keys that start with ``x-``),
  and whose value satisfies that pattern's schema, the schema of every other pattern whose keys may overlap
  (decided exactly on the patterns' automata) and that of every listed property whose name such a key may be.
  Keys that match no pattern are never written, so ``additionalProperties`` only shapes required names missing
  from ``properties``. Keys may repeat, as with additional properties.
* ``oneOf`` is ``anyOf`` when no value written for one branch validates against another; otherwise it is refused,
  naming the two branches (an automaton cannot subtract one branch from another). Two branches exclude each other
  when, each way round, the values written for the first fail the second: their types differ; the first's
  ``enum``/``const`` values all fail the second, or the second's all fail the first (checked by ``jsonschema``);
  the second requires a property the first never writes (one outside its ``properties``, with no pattern matching
  it); the first requires a property the second forbids (``false``, or outside its properties under
  ``additionalProperties: false``); a property both require has values that exclude each other, by these same
  rules; their numeric ranges, string lengths or array lengths do not meet; the first's ``pattern``/``format``
  shares no text with what the second's ``pattern`` finds.
* ``minProperties``: at most the number of required properties (or 1 for objects without ``properties``);
  ``maxProperties``: at least the number of listed properties (it also bounds ``patternProperties`` entries).
* Refused, naming the keyword path: ``not`` and ``if``/``then``/``else`` (they need the complement of a schema),
  ``contains``, ``unevaluatedProperties``/``unevaluatedItems`` (the intersection of two schemas' texts),
  ``dependentRequired``, ``dependentSchemas``, ``propertyNames`` (not implemented), ``$dynamicRef``; non-local
  ``$ref``; formats outside :data:`FORMATS`; ``pattern`` or ``format`` together with a length; a ``pattern`` that
  can match a character JSON strings must escape; property names that need escaping; a schema whose automaton needs
  more states than the compiler builds (:class:`Budget`). ``maxLength``, ``minItems``/``maxItems``, ``pattern``
  and ``enum`` are checked on their own, the whole regex after them, in milliseconds and before outlines-core runs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import urllib.parse
from fractions import Fraction

import jsonschema
from outlines_core.json_schema import build_regex_from_schema
from referencing.exceptions import Unresolvable

from mercury_jax.constrain import numbers, oneof, regexes
from mercury_jax.constrain.numbers import exact
from mercury_jax.constrain.regexes import FORMATS


class ConstraintError(ValueError):
  """A constraint that cannot be compiled.

  Args:
    message: One line: what is wrong and what would be right.
    param: The offending part, e.g. a schema keyword path like ``"properties.age.multipleOf"``, or None.
  """

  def __init__(self, message: str, param: str | None = None):
    super().__init__(message)
    self.param = param


@dataclasses.dataclass(frozen=True)
class Budget:
  """The most states the compiler lets outlines-core build for one constraint (its automaton is not minimized yet):
  ``factor`` times ``max_states``.

  Attributes:
    max_states: The compiler's limit on the final automaton.
    factor: How many states may be built per final state.
    remedy: What the user can do, e.g. ``"raise the compiler's max_states"``.
  """

  max_states: int
  factor: int
  remedy: str = "raise the compiler's max_states"

  @property
  def states(self) -> int:
    return self.factor * self.max_states

  def check(self, states: int, what: str, param: str | None) -> None:
    """Raises :class:`ConstraintError` (naming ``param``) when ``what`` needs more than :attr:`states` states."""
    if states > self.states:
      raise ConstraintError(
        f"{what} needs at least {states} automaton states, more than max_states={self.max_states}; the compiler "
        f"builds at most {self.factor} times that ({self.states}) before minimizing; make it smaller or {self.remedy}",
        param=param,
      )


WHITESPACE = ""  # Between JSON tokens: compact text, so fixed keys and punctuation are fixed text.
RECURSION_DEPTH = 4  # Levels a recursive $ref is unrolled to at most (the compiler's default recursion_depth).
ANY_VALUE_DEPTH = 1  # Containers "any value" nests inside a schema ({}, true, items without a schema).
JSON_OBJECT_DEPTH = 4  # Containers a json_object nests (the outer object counts): the deepest that fits 512 states.
MAX_ENUMERATED = 256  # Values (or unique arrays) a regex lists one by one.
MAX_UNIQUE = 64  # Distinct values the items of a uniqueItems array may take.
MAX_SUBSCHEMAS = 10_000  # Subschemas a schema may unroll into (recursion multiplies them).
ANNOTATIONS = frozenset(
  ["title", "description", "default", "examples", "$schema", "$id", "$comment", "$anchor", "$defs", "definitions"]
  + ["deprecated", "readOnly", "writeOnly", "contentEncoding", "contentMediaType", "discriminator", "example"]
  + ["externalDocs", "xml"]
)
NUMERIC = frozenset(["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"])
TYPE_KEYWORDS = {
  "string": frozenset(["minLength", "maxLength", "pattern", "format"]),
  "integer": NUMERIC,
  "number": NUMERIC,
  "array": frozenset(["items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems"]),
  "object": frozenset(
    ["properties", "patternProperties", "required", "additionalProperties", "minProperties", "maxProperties"]
  ),
  "boolean": frozenset(),
  "null": frozenset(),
}
KEYWORDS = frozenset(["type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "nullable"]).union(
  *TYPE_KEYWORDS.values()
)
SUPPORTED = ", ".join(
  ["type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "nullable", "properties", "patternProperties"]
  + ["required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems", "uniqueItems", "minLength"]
  + ["maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"]
)

_SCALARS = [{"type": "string"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"}]
_UNSAFE_IN_STRINGS = frozenset([ord('"'), ord("\\"), *range(0x20)])  # What JSON strings must escape.


def any_value(depth: int) -> dict:
  """The schema of any JSON value whose containers nest at most ``depth`` deep (0: scalars only), in the form the
  rewriter passes to outlines-core as it is (outlines' own ``{}`` is 8 times larger and misses parentheses)."""
  if depth == 0:
    return {"anyOf": _SCALARS}
  inner = any_value(depth - 1)
  return {"anyOf": [*_SCALARS, {"type": "array", "items": inner}, {"type": "object", "additionalProperties": inner}]}


ANY_VALUE = any_value(ANY_VALUE_DEPTH)


def schema_regex(schema: dict, budget: Budget | None = None, recursion_depth: int = RECURSION_DEPTH) -> str:
  """The regex of compact JSON texts that validate against ``schema``.

  Args:
    schema: A JSON Schema.
    budget: Refuse keywords that alone need more automaton states (None: no check).
    recursion_depth: Levels a recursive ``$ref`` is unrolled to.

  Raises:
    ConstraintError: The schema is not valid JSON Schema, or uses a keyword (or a combination) whose regex would
      not enforce it, or one too large for ``budget``; ``param`` is the keyword's path.
  """
  return _rewrite(schema, budget, recursion_depth)[0]


def schema_regexes(schema: dict, budget: Budget | None = None, recursion_depth: int = RECURSION_DEPTH):
  """:func:`schema_regex` with recursion unrolled ``recursion_depth`` levels, then one level fewer, and so on down
  to 1: the regexes to try in turn until one fits the compiler's limits (just one when the schema does not
  recurse). Raises as :func:`schema_regex` does, when the next regex is asked for."""
  for depth in range(recursion_depth, 0, -1):
    regex, recursive = _rewrite(schema, budget, depth)
    yield regex
    if not recursive:
      return


def _rewrite(schema: dict, budget: Budget | None, recursion_depth: int) -> tuple[str, bool]:
  """``(regex, whether a recursive $ref was unrolled)``."""
  if not isinstance(schema, dict):
    raise ConstraintError(f'a JSON Schema must be a JSON object like {{"type": "object"}}, not {type(schema).__name__}')
  validator = _with_nullable(jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator))
  try:
    validator.check_schema(schema)
  except jsonschema.SchemaError as e:
    where = ".".join(str(p) for p in e.path)
    raise ConstraintError(f"not a valid JSON Schema: {_one_line(e.message)}", param=where or None) from None
  rewriter = _Rewriter(schema, validator, budget, recursion_depth)
  try:
    ready = rewriter.node(schema, (), ("#",))
  except _Cut as cut:
    where = rewriter.recursions.get(cut.ref, cut.path)
    raise ConstraintError(
      f"$ref {cut.ref!r} recurses without end: each level needs the next, and the compiler unrolls "
      f"{recursion_depth} levels; let the recursion stop (an anyOf branch without it, a property that is not "
      "required, an array that may be empty)",
      param=".".join(where),
    ) from None
  return rewriter.regex_of(ready), bool(rewriter.recursions)


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


@functools.cache
def _with_nullable(validator):
  """``validator``'s class, reading ``nullable: true`` as OpenAPI 3.0 does here: null is also valid."""

  def or_null(check):
    def run(validator, value, instance, schema):
      if instance is None and schema.get("nullable") is True:
        return
      yield from check(validator, value, instance, schema) or ()

    return run

  return jsonschema.validators.extend(validator, {k: or_null(f) for k, f in validator.VALIDATORS.items()})


def _one_line(text: str, limit: int = 200) -> str:
  text = " ".join(text.split())
  return text if len(text) <= limit else text[: limit - 3] + "..."


def _dumps(value) -> str:
  return json.dumps(value, separators=(",", ":"))


class _Cut(Exception):
  """A recursive ``$ref`` past the unrolling depth: the branch it is in is left out, where the schema allows."""

  def __init__(self, ref: str, path: tuple):
    super().__init__(ref)
    self.ref, self.path = ref, path


class _Rewriter:
  """Turns a schema into one whose outlines-core regex enforces it exactly (see the module docstring)."""

  def __init__(self, root: dict, validator, budget: Budget | None, depth: int):
    self.root, self.validator, self.budget, self.depth = root, validator, budget, depth
    self.regexes: list[str] = []
    self.recursions: dict[str, tuple] = {}  # $ref -> the path where it first recurs
    self.subschemas = 0
    text, n = _dumps(root), 0
    while f"zq{n}x" in text:
      n += 1
    self.tag = f"zq{n}x"  # Never in the schema's text, so never a key or a value of it.

  def placeholder(self, regex: str) -> dict:
    self.regexes.append(regex)
    return {"const": f"{self.tag}{len(self.regexes) - 1}"}

  def splice(self, regex: str) -> str:
    for i, sub in enumerate(self.regexes):
      regex = regex.replace(f'"{self.tag}{i}"', f"(?:{sub})")
    return regex

  def regex_of(self, ready: dict) -> str:
    """The regex of an outlines-ready schema, placeholders spliced in."""
    try:
      return self.splice(build_regex_from_schema(json.dumps(ready), WHITESPACE))
    except (ValueError, TypeError) as e:
      raise ConstraintError(f"outlines-core cannot compile the schema: {_one_line(str(e))}") from None

  def fail(self, message: str, path: tuple, *keyword: str):
    raise ConstraintError(message, param=".".join(path + keyword) or None)

  def check_size(self, states: int, what: str, path: tuple, *keyword: str) -> None:
    if self.budget is not None:
      self.budget.check(states, what, ".".join(path + keyword) or None)

  def validates(self, schema: dict):
    """A validator of the subschema ``schema`` (the root's definitions added so that its references resolve)."""
    defs = {k: self.root[k] for k in ("$defs", "definitions") if k in self.root and k not in schema}
    return self.validator({**schema, **defs})

  # ------------------------------------------------------------------------------------------ structure

  def deref(self, schema, path: tuple, refs: tuple) -> tuple[dict, tuple]:
    """``schema`` with its top-level ``$ref`` followed (siblings merged in) and the refs on the way.

    Raises:
      _Cut: A ``$ref`` already followed ``depth`` times on the way here.
    """
    while isinstance(schema, dict) and "$ref" in schema:
      ref = schema["$ref"]
      if not ref.startswith("#"):
        self.fail(f"$ref {ref!r} is not local; only '#/...' pointers into the schema are supported", path, "$ref")
      seen = refs.count(ref)
      if seen >= self.depth:
        raise _Cut(ref, path + ("$ref",))
      if seen:
        self.recursions.setdefault(ref, path + ("$ref",))
      target = self.root
      for part in filter(None, urllib.parse.unquote(ref[1:]).split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, list) and part.isdigit() and int(part) < len(target):
          target = target[int(part)]
        elif isinstance(target, dict) and part in target:
          target = target[part]
        else:
          self.fail(f"$ref {ref!r} points nowhere in the schema", path, "$ref")
      rest = {k: v for k, v in schema.items() if k != "$ref"}
      schema, refs = self.merge([target, rest], path) if _body(rest) else target, refs + (ref,)
    return schema, refs

  def merge(self, parts: list, path: tuple) -> dict:
    """One schema that holds exactly when all ``parts`` hold (``allOf``), or a :class:`ConstraintError`."""
    if any(p is False for p in parts):
      self.fail("a `false` schema in allOf accepts nothing; remove it", path)
    parts = [_body(p) for p in parts if isinstance(p, dict)]
    out: dict = {}
    for part in parts:
      for key, value in part.items():
        if key == "nullable":
          continue
        if key not in out or _dumps(out[key]) == _dumps(value):
          out[key] = value
        elif key == "required":
          out[key] = out[key] + [r for r in value if r not in out[key]]
        elif key in ("properties", "patternProperties"):
          out[key] = {**out[key], **{n: {"allOf": [out[key][n], s]} if n in out[key] else s for n, s in value.items()}}
        elif key == "type":
          out[key] = _common_types(out[key], value) or self.fail(f"types {out[key]} and {value} share no value", path)
        elif key in ("minimum", "minLength", "minItems", "minProperties") and not isinstance(value, bool):
          out[key] = max(out[key], value)
        elif key in ("maximum", "maxLength", "maxItems", "maxProperties") and not isinstance(value, bool):
          out[key] = min(out[key], value)
        else:
          self.fail(f"{key!r} differs between schemas that must all hold (allOf, $ref siblings); state it once", path)
    if any("nullable" in part for part in parts) and all(_allows_null(part) for part in parts):
      out["nullable"] = True
    for part in parts:
      if part.get("additionalProperties", True) is not True:
        own = set(part.get("properties", {}))
        hidden = (set(out.get("properties", {})) | set(out.get("required", []))) - own
        if hidden or not set(out.get("patternProperties", {})) <= set(part.get("patternProperties", {})):
          self.fail("additionalProperties in one of several combined schemas hides the others' properties", path)
    return out

  def node(self, schema, path: tuple, refs: tuple) -> dict:
    """The outlines-ready form of the subschema at ``path``.

    Raises:
      _Cut: A recursion reached its depth on a path the schema requires.
    """
    self.subschemas += 1
    if self.subschemas > MAX_SUBSCHEMAS:
      self.fail(
        f"the schema unrolls into more than {MAX_SUBSCHEMAS} subschemas (recursive $ref multiplies them); simplify it",
        path,
      )
    for step in ("as written", "dereferenced"):  # nullable next to a $ref, or in what it points to
      if isinstance(schema, dict) and schema.get("nullable") is True:
        try:
          value = self.node({k: v for k, v in schema.items() if k != "nullable"}, path, refs)
        except _Cut:
          return {"type": "null"}
        return {"anyOf": [value, {"type": "null"}]}
      if step == "as written":
        schema, refs = self.deref(schema, path, refs)
    if schema is True:
      return ANY_VALUE
    if schema is False:
      self.fail("the schema `false` accepts nothing; remove what uses it", path)
    body = _body(schema)
    body.pop("nullable", None)
    if "enum" in body or "const" in body:
      return self.values(schema, path)
    for key in body:
      if key not in KEYWORDS:
        self.fail(f"{key!r} is not enforced by the constraint compiler; remove it (supported: {SUPPORTED})", path, key)
    if "allOf" in body:
      rest = {k: v for k, v in body.items() if k != "allOf"}
      parts = []
      for i, part in enumerate(body["allOf"]):
        part, more = self.deref(part, path + ("allOf", str(i)), refs)
        parts.append(part)
        refs += more[len(refs) :]
      return self.node(self.merge([rest, *parts], path), path, refs)
    if "anyOf" in body and "oneOf" in body:
      self.fail("anyOf and oneOf in one schema are not supported; nest one inside the other", path, "oneOf")
    for word in ("anyOf", "oneOf"):
      if word in body:
        return self.alternatives(word, body, path, refs)
    types = body.get("type")
    if types is None:
      families = {t for t, words in TYPE_KEYWORDS.items() if words & body.keys()} - {"integer"}
      if len(families) > 1:
        self.fail(f"keywords of several types ({', '.join(sorted(families))}) without 'type'; add 'type'", path)
      if not families:
        return ANY_VALUE
      types = families.pop()
    if isinstance(types, list):
      names = [t for t in dict.fromkeys(types) if not (t == "integer" and "number" in types)]
      return _either(functools.partial(self.typed, t, body, path, refs) for t in names)
    return self.typed(types, body, path, refs)

  def alternatives(self, word: str, body: dict, path: tuple, refs: tuple) -> dict:
    """``anyOf``/``oneOf``: the siblings pushed into each branch; branches cut by recursion are left out."""
    rest = {k: v for k, v in body.items() if k != word}
    branches, cuts = [], []
    for i, branch in enumerate(body[word]):
      if branch is False:
        continue
      where = path + (word, str(i))
      try:
        branch, more = self.deref(branch, where, refs)
      except _Cut as cut:
        cuts.append(cut)
        continue
      branches.append((self.merge([rest, branch], where), where, refs + more[len(refs) :]))
    if not branches and not cuts:
      self.fail(f"every branch of {word} is `false`; nothing matches", path, word)
    if word == "oneOf":
      self.check_exclusive([(b, where) for b, where, _ in branches], path)
    if not branches:
      raise cuts[0]
    return _either(functools.partial(self.node, branch, where, more) for branch, where, more in branches)

  def values(self, schema: dict, path: tuple) -> dict:
    """``enum``/``const``: the values that satisfy every keyword of the schema (checked by jsonschema), as a regex."""
    body = _body(schema)
    keyword = "const" if "const" in body else "enum"
    options = [body["const"]] if keyword == "const" else list(body["enum"])
    try:
      # Every option is a member of its own keyword; checking it again would compare each of n values with all n
      # (jsonschema's enum is a linear scan): 5000 values took 3 s of a server's CPU to refuse.
      check = self.validates({k: v for k, v in schema.items() if k != keyword})
      options = [v for v in options if check.is_valid(v)]
    except (Unresolvable, re.error) as e:
      self.fail(f"cannot check the enum values against their schema: {_one_line(str(e))}", path)
    if not options:
      self.fail("no value of 'enum'/'const' satisfies the schema's other keywords", path, keyword)
    texts = list(dict.fromkeys(_dumps(v) for v in options))
    prefixes = {text[:i] for text in texts for i in range(1, len(text) + 1)}  # The states of their trie.
    self.check_size(len(prefixes), f"{keyword} ({len(texts)} values)", path, keyword)
    return self.placeholder("|".join(regexes.escape(t) for t in texts))

  def check_exclusive(self, branches: list[tuple[dict, tuple]], path: tuple) -> None:
    """``oneOf`` is ``anyOf`` only when no value written for a branch validates against another
    (:mod:`~mercury_jax.constrain.oneof`)."""
    for j, (second, second_path) in enumerate(branches):
      for first, first_path in branches[:j]:
        if not oneof.exclusive(first, second, self):
          self.fail(
            f"oneOf branches {first_path[-1]} and {second_path[-1]} may both match one value; give them distinct "
            "types, a required property with distinct 'const' values, or required properties the other never has "
            "(or use anyOf)",
            path,
            "oneOf",
          )

  def resolve(self, schema) -> dict | bool | None:
    """``schema`` with its top-level ``$ref`` followed and annotations dropped; None when it cannot be."""
    try:
      schema = self.deref(schema, (), ())[0]
    except (_Cut, ConstraintError):
      return None
    return _body(schema) if isinstance(schema, dict) else schema

  def valid(self, value, schema: dict) -> bool | None:
    """Whether ``value`` validates against the subschema ``schema``; None when that cannot be checked."""
    try:
      return self.validates(schema).is_valid(value)
    except (Unresolvable, re.error):
      return None

  # ------------------------------------------------------------------------------------------ types

  def typed(self, kind: str, body: dict, path: tuple, refs: tuple) -> dict:
    if kind not in TYPE_KEYWORDS:
      self.fail(f"unknown type {kind!r}; use one of {sorted(TYPE_KEYWORDS)}", path, "type")
    own = {k: v for k, v in body.items() if k in TYPE_KEYWORDS[kind]}
    if kind == "string":
      return self.string(own, path)
    if kind in ("integer", "number"):
      return self.number(own, path, integer=kind == "integer")
    if kind == "array":
      return self.array(own, path, refs)
    if kind == "object":
      return self.object(own, path, refs)
    return {"type": kind}

  def string(self, body: dict, path: tuple) -> dict:
    lengths = [k for k in ("minLength", "maxLength") if k in body]
    if "format" in body:
      fmt = body["format"]
      if fmt not in FORMATS:
        self.fail(f"format {fmt!r} is not enforced; use one of {', '.join(FORMATS)} or a 'pattern'", path, "format")
      if "pattern" in body or lengths:
        self.fail("'format' with 'pattern', 'minLength' or 'maxLength' is not supported; keep one", path, "format")
      return self.placeholder(f'"{FORMATS[fmt]}"')
    if "pattern" in body:
      if lengths:
        self.fail(
          "'pattern' with 'minLength'/'maxLength' is not supported; put the length into the pattern", path, lengths[0]
        )
      return self.placeholder(f'"(?:{self.string_pattern(body["pattern"], path + ("pattern",))})"')
    if not lengths:
      return {"type": "string"}
    low, high = int(body.get("minLength", 0)), body.get("maxLength")
    if high is not None and low > int(high):
      self.fail(f"minLength={low} is above maxLength={high}", path, "minLength")
    longest = max(lengths, key=lambda k: int(body[k]))
    self.check_size(2 * int(body[longest]), f"{longest}={body[longest]}", path, longest)  # A state per character
    # and one per character after a backslash.
    return {"type": "string", "minLength": low, **({} if high is None else {"maxLength": int(high)})}

  def string_pattern(self, pattern: str, where: tuple) -> str:
    """``pattern`` anchored (jsonschema searches; matching in full is stricter) and checked to never need an escape
    in JSON: an automaton over single bytes finds any character it can match that JSON strings must escape."""
    inner = regexes.normalize_regex(pattern)
    self.check_size(regexes.min_states(inner), f"pattern {_one_line(pattern, 60)!r}", where)
    try:
      transitions = regexes.byte_automaton(inner)[0]
    except ValueError:
      self.fail(regexes.explain_regex_error(inner), where)
    for row in transitions.values():
      unsafe = sorted((b for b in row if b in _UNSAFE_IN_STRINGS), key=lambda b: (b < 0x20, b))
      if unsafe:
        self.fail(
          f"pattern {pattern!r} can match {chr(unsafe[0])!r}, which JSON strings must escape; exclude it (e.g. "
          r"[^\"\\] instead of .)",
          where,
        )
    return inner

  def number(self, body: dict, path: tuple, integer: bool) -> dict:
    low, low_open = numbers.bound(body, "minimum", "exclusiveMinimum", max)
    high, high_open = numbers.bound(body, "maximum", "exclusiveMaximum", min)
    step = None if "multipleOf" not in body else exact(body["multipleOf"])
    if integer:
      first = None if low is None else (math.floor(low) + 1 if low_open else math.ceil(low))
      last = None if high is None else (math.ceil(high) - 1 if high_open else math.floor(high))
      if first is not None and last is not None and first > last:
        self.fail(f"no integer lies within the bounds ({_show(low)}, {_show(high)})", path, "minimum")
      if step is not None and 1 % step == 0:  # Every integer is a multiple.
        step = None
      elif step is not None:  # The integer multiples of p/q (in lowest terms) are the multiples of p.
        step = Fraction(step.numerator)
      if step is None:
        return {"type": "integer"} if low is None and high is None else self.placeholder(numbers.integers(first, last))
      low, low_open, high, high_open = first, False, last, False
    power = numbers.power_of_ten(step)
    if step is None or (power is not None and power <= 0):
      digits = None if step is None else -power
      if not integer and step is None and low is None and high is None:
        return {"type": "number"}
      regex = numbers.decimals(low, low_open, high, high_open, digits)
      if not regex:
        self.fail(f"no number lies within the bounds ({_show(low)}, {_show(high)})", path, "minimum")
      return self.placeholder(regex)
    if power is not None and low is None and high is None:
      return self.placeholder(numbers.multiples_of_ten(power, fraction=not integer))
    if low is None or high is None:
      self.fail(
        f"'multipleOf': {_show(step)} needs 'minimum' and 'maximum' to enumerate its multiples (or a power of ten "
        "such as 0.01 or 10)",
        path,
        "multipleOf",
      )
    first = math.floor(low / step) + 1 if low_open and low % step == 0 else math.ceil(low / step)
    last = math.ceil(high / step) - 1 if high_open and high % step == 0 else math.floor(high / step)
    if not 0 < last - first + 1 <= MAX_ENUMERATED:
      self.fail(
        f"'multipleOf': {_show(step)} leaves {max(last - first + 1, 0)} values within the bounds; allowed are 1 to "
        f"{MAX_ENUMERATED}",
        path,
        "multipleOf",
      )
    texts = [numbers.decimal_text(m * step) for m in range(first, last + 1)]
    if not integer:  # Trailing zeros are the same number: 1.5 is 1.50, 2 is 2.0.
      texts = [rf"{t}(?:\.0+)?" if "." not in t else rf"{t}0*" for t in map(regexes.escape, texts)]
    return self.placeholder("|".join(texts))

  def array(self, body: dict, path: tuple, refs: tuple) -> dict:
    low, high = int(body.get("minItems", 0)), body.get("maxItems")
    if high is not None and low > int(high):
      self.fail(f"minItems={low} is above maxItems={high}", path, "minItems")
    for word in ("minItems", "maxItems"):
      if word in body:  # Each item and comma is at least a state.
        self.check_size(2 * int(body[word]) - 2, f"{word}={body[word]}", path, word)
    items, prefix = body.get("items"), body.get("prefixItems")
    if isinstance(items, list):  # Before draft 2020-12, a list of items is a tuple.
      prefix, items = items, None
    unique = body.get("uniqueItems") is True and (high is None or int(high) > 1)  # 0 or 1 item are always unique.
    if prefix is not None:
      n = len(prefix)
      if unique:
        self.fail("'uniqueItems' with a tuple (prefixItems) is not enforced; drop one", path, "uniqueItems")
      if n < low or (high is not None and n > int(high)):
        self.fail(f"a tuple of {n} items (always written in full) must fit minItems/maxItems", path, "prefixItems")
      return {"prefixItems": [self.node(p, path + ("prefixItems", str(i)), refs) for i, p in enumerate(prefix)]}
    if items is False:
      if low:
        self.fail("'items': false allows only [], but minItems is above 0", path, "items")
      high = 0
    if unique:
      return self.unique_array(items, low, high, path, refs)
    try:
      items = self.node(items, path + ("items",), refs) if isinstance(items, dict) else ANY_VALUE
    except _Cut:
      if low:
        raise
      return self.placeholder(r"\[\]")
    return {"type": "array", "items": items, "minItems": low, **({} if high is None else {"maxItems": int(high)})}

  def unique_array(self, items, low: int, high, path: tuple, refs: tuple) -> dict:
    """``uniqueItems`` over items from a finite set (module docstring)."""
    domain = self.domain(items, path + ("items",), refs) if isinstance(items, dict) else None
    if domain is None:
      self.fail(
        f"'uniqueItems' is enforced only for items from a finite set of at most {MAX_UNIQUE} values (enum, const, "
        "boolean, null, integers with minimum and maximum): an automaton cannot remember an unbounded set of earlier "
        "items; restrict the items or drop uniqueItems",
        path,
        "uniqueItems",
      )
    n = len(domain)
    high = n if high is None else min(int(high), n)
    if low > n:
      self.fail(f"minItems={low} is above the {n} distinct values the items can take", path, "minItems")
    texts = [regexes.escape(_dumps(v)) for v in domain]
    if sum(math.perm(n, k) for k in range(low, high + 1)) <= MAX_ENUMERATED:
      return self.placeholder(r"\[" + regexes.arrangements(texts, low, high, ordered=False) + r"\]")
    if low <= 1 and high == n:
      firsts = [texts[i] + "".join(f"(?:,{t})?" for t in texts[i + 1 :]) for i in range(n)]
      return self.placeholder(r"\[" + regexes.alternation(firsts, optional=low == 0) + r"\]")
    if sum(math.comb(n, k) for k in range(low, high + 1)) <= MAX_ENUMERATED:
      return self.placeholder(r"\[" + regexes.arrangements(texts, low, high, ordered=True) + r"\]")
    self.fail(
      f"'uniqueItems' over {n} values with minItems={low} and maxItems={high} leaves more than {MAX_ENUMERATED} "
      "arrays to list; widen minItems/maxItems to 0 or 1 and the number of values, or drop uniqueItems",
      path,
      "uniqueItems",
    )

  def domain(self, schema, path: tuple, refs: tuple) -> list | None:
    """The distinct values ``schema`` allows when they are few (at most :data:`MAX_UNIQUE`), else None."""
    schema, _ = self.deref(schema, path, refs)
    if not isinstance(schema, dict):
      return None
    body = _body(schema)
    if "const" in body or "enum" in body:
      candidates = [body["const"]] if "const" in body else list(body["enum"])
    else:
      types = body.get("type")
      types = [types] if isinstance(types, str) else list(types or [])
      if body.get("nullable") is True:
        types.append("null")
      if not types or not set(body) <= {"type", "nullable"} | NUMERIC:
        return None
      candidates = []
      for kind in types:
        if kind in ("boolean", "null"):
          candidates += [False, True] if kind == "boolean" else [None]
        elif kind == "integer" and "multipleOf" not in body:
          low, high = body.get("minimum"), body.get("maximum")
          if low is None or high is None or high - low >= MAX_UNIQUE:
            return None
          candidates += list(range(math.ceil(low), math.floor(high) + 1))
        else:
          return None
    values = {}
    try:
      check = self.validates(schema)
      for value in candidates:
        if check.is_valid(value):
          values.setdefault(_value_key(value), value)  # The first of equal values (1 and 1.0).
    except (Unresolvable, re.error):
      return None
    return list(values.values()) if 0 < len(values) <= MAX_UNIQUE else None

  def object(self, body: dict, path: tuple, refs: tuple) -> dict:
    if body.get("patternProperties"):
      return self.pattern_object(body, path, refs)
    properties = body.get("properties")
    required = list(body.get("required", []))
    extra = body.get("additionalProperties", True)
    low, high = int(body.get("minProperties", 0)), body.get("maxProperties")
    if properties is None and not required:
      if extra is False or high == 0:
        if low:
          self.fail("minProperties is above 0 but no property is allowed", path, "minProperties")
        return {"type": "object", "properties": {}}
      if low > 1 or high is not None:
        word = "maxProperties" if high is not None else "minProperties"
        self.fail("minProperties above 1 or maxProperties need 'properties' to be enforced", path, word)
      try:
        values = self.node(extra, path + ("additionalProperties",), refs) if isinstance(extra, dict) else ANY_VALUE
      except _Cut:
        if low:
          raise
        return {"type": "object", "properties": {}}
      return {"type": "object", "additionalProperties": values, **({"minProperties": 1} if low else {})}
    properties = dict(properties or {})
    for name in required:
      if name not in properties:
        if extra is False:
          self.fail(
            f"required property {name!r} is not in properties and additionalProperties is false", path, "required"
          )
        properties[name] = extra if isinstance(extra, dict) else {}
    ready = {}
    for name, sub in properties.items():
      self.check_name(name, path)
      if sub is False and name not in required:
        continue
      try:
        ready[name] = self.node(sub, path + ("properties", name), refs)
      except _Cut:
        if name in required:
          raise
    self.check_counts(low, high, len(required), len(ready), path)
    return {"type": "object", "properties": ready, **({"required": required} if required else {})}

  def pattern_object(self, body: dict, path: tuple, refs: tuple) -> dict:
    """An object with ``patternProperties`` (module docstring), as a regex of our own."""
    patterns: dict = body["patternProperties"]
    properties = dict(body.get("properties") or {})
    required = list(body.get("required", []))
    extra = body.get("additionalProperties", True)
    low, high = int(body.get("minProperties", 0)), body.get("maxProperties")
    keys = {p: regexes.key_regex(p, self.string_pattern(p, path + ("patternProperties", p))) for p in patterns}
    found = {n: [p for p in patterns if regexes.searches(p, n)] for n in [*properties, *required]}
    for name in required:
      if name not in properties:
        if not found[name] and extra is False:
          self.fail(
            f"required property {name!r} is in neither properties nor patternProperties, and additionalProperties "
            "is false",
            path,
            "required",
          )
        properties[name] = {} if found[name] or not isinstance(extra, dict) else extra
    listed = []
    for name, sub in properties.items():
      self.check_name(name, path)
      parts = [sub, *(patterns[p] for p in found[name])]
      if False in parts and name not in required:
        continue
      try:
        value = self.node({"allOf": parts} if len(parts) > 1 else sub, path + ("properties", name), refs)
      except _Cut:
        if name in required:
          raise
        continue
      except ConstraintError as e:
        if len(parts) == 1:
          raise
        raise ConstraintError(
          f"property {name!r} matches patternProperties {', '.join(map(repr, found[name]))} too, so it must satisfy "
          f"their schemas as well, and cannot ({e}); make the patterns exclude it",
          param=e.param,
        ) from None
      listed.append((f'"{regexes.escape(name)}":(?:{self.regex_of(value)})', name in required))
    self.check_counts(low, high, len(required), len(listed), path)
    entries = []
    for pattern, schema in patterns.items():
      where = path + ("patternProperties", pattern)
      overlapping = [
        q for q in patterns if q != pattern and not regexes.disjoint(keys[pattern], regexes.search_regex(q))
      ]
      named = [n for n in properties if regexes.matches(keys[pattern], n)]
      parts = [schema, *(patterns[q] for q in overlapping), *(properties[n] for n in named)]
      if False in parts:
        continue  # Some of its keys are forbidden elsewhere, and the regex cannot carve them out: none is written.
      try:
        value = self.node({"allOf": parts} if len(parts) > 1 else schema, where, refs)
      except _Cut:
        continue
      except ConstraintError as e:
        others = [f"pattern {q!r}" for q in overlapping] + [f"property {n!r}" for n in named]
        raise ConstraintError(
          f"keys matching {pattern!r} may also match {', '.join(others)}, so their values must satisfy all those "
          f"schemas, and they cannot ({e}); make the patterns exclude each other",
          param=".".join(where),
        ) from None
      entries.append(f'"(?:{keys[pattern]})":(?:{self.regex_of(value)})')
    room = None if high is None else int(high) - len(listed)
    return self.placeholder(regexes.object_regex(listed, entries, room))

  def check_name(self, name: str, path: tuple) -> None:
    if _dumps(name) != f'"{name}"':
      self.fail(f"property name {name!r} needs escaping in JSON; use plain ASCII names", path, "properties", name)

  def check_counts(self, low: int, high, required: int, listed: int, path: tuple) -> None:
    if low > required:
      self.fail(f"minProperties={low} is above the {required} required properties; require more", path, "minProperties")
    if high is not None and int(high) < listed:
      self.fail(f"maxProperties={high} is below the {listed} properties; drop some", path, "maxProperties")


def _either(options) -> dict:
  """``anyOf`` of the options (callables that make a schema) that are not cut by recursion; raises the first cut
  when every option is."""
  ready, cut = [], None
  for option in options:
    try:
      ready.append(option())
    except _Cut as e:
      cut = cut or e
  if not ready:
    raise cut
  return ready[0] if len(ready) == 1 else {"anyOf": ready}


def _body(schema) -> dict:
  return {k: v for k, v in schema.items() if k not in ANNOTATIONS} if isinstance(schema, dict) else {}


def _allows_null(schema: dict) -> bool:
  """Whether a schema (without its ``$ref`` or combinators, else False) lets null through."""
  if schema.get("nullable") is True:
    return True
  if any(k in schema for k in ("enum", "const", "anyOf", "oneOf", "allOf", "$ref")):
    return False
  types = schema.get("type")
  return types is None or "null" in ([types] if isinstance(types, str) else types)


def _common_types(a, b) -> list[str] | str | None:
  wide = lambda t: {"integer", "number"} if t == "number" else {t}  # noqa: E731
  left = set().union(*(wide(t) for t in ([a] if isinstance(a, str) else a)))
  right = set().union(*(wide(t) for t in ([b] if isinstance(b, str) else b)))
  common = sorted(left & right)
  if "number" in common:
    common.remove("integer")
  return None if not common else common[0] if len(common) == 1 else common


def _value_key(value):
  """A key under which values equal in JSON Schema's sense (``1 == 1.0``, ``true != 1``) are equal."""
  if isinstance(value, bool) or value is None:
    return ("atom", value)
  if isinstance(value, (int, float)):
    return ("number", exact(value))
  if isinstance(value, list):
    return ("array", tuple(_value_key(v) for v in value))
  if isinstance(value, dict):
    return ("object", tuple(sorted((k, _value_key(v)) for k, v in value.items())))
  return ("string", value)


def _show(value) -> str:
  return "unbounded" if value is None else numbers.decimal_text(exact(value))
