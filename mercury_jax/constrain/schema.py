"""JSON Schema to regular expression, for the keywords that the regex really enforces.

outlines-core 0.2.14's ``build_regex_from_schema`` accepts far more than it enforces. Random texts of its automata,
validated with ``jsonschema``, and its source show that it ignores ``minimum``/``maximum``/``exclusive*``/
``multipleOf``, ``uniqueItems``, ``maxProperties``, ``minProperties`` above 1, required names missing from
``properties``, and ``pattern``/``format`` next to a length bound; that ``properties`` hides every sibling
(``anyOf``, a ``type`` list); that it reads ``allOf`` as a concatenation and ``oneOf`` as ``anyOf``; that its
``time``, ``email`` and ``uri`` regexes write invalid JSON, ``date`` and ``date-time`` invalid dates, ``{}`` (any
value) a regex without its parentheses, ``enum`` objects unescaped keys and ``pattern`` whatever characters it
matches (a ``"`` ends the string).

So a schema is first rewritten here into the part it handles exactly: ``$ref`` inlined (recursion refused),
``allOf`` merged, ``anyOf``/``oneOf`` siblings pushed into the branches (``oneOf`` only when the branches cannot
overlap), ``type`` lists split, and what outlines gets wrong (numeric ranges, formats, patterns, ``enum``,
``const``, any value) replaced by regexes of our own, spliced in through placeholder constants. Any other keyword
is a :class:`ConstraintError` naming its path. The text is compact JSON: no whitespace between tokens, properties
in the schema's order, the required ones always present.
"""

from __future__ import annotations

import functools
import json
import math
import re
import urllib.parse
from fractions import Fraction

import jsonschema
import outlines_core
from outlines_core.json_schema import build_regex_from_schema
from referencing.exceptions import Unresolvable


class ConstraintError(ValueError):
  """A constraint that cannot be compiled.

  Args:
    message: One line: what is wrong and what would be right.
    param: The offending part, e.g. a schema keyword path like ``"properties.age.multipleOf"``, or None.
  """

  def __init__(self, message: str, param: str | None = None):
    super().__init__(message)
    self.param = param


SENTINEL = "\x01"  # See full_match.
WHITESPACE = ""  # Between JSON tokens: compact text, so fixed keys and punctuation are fixed text.
ANNOTATIONS = frozenset(
  ["title", "description", "default", "examples", "$schema", "$id", "$comment", "$anchor", "$defs", "definitions"]
  + ["deprecated", "readOnly", "writeOnly", "contentEncoding", "contentMediaType"]
)
NUMERIC = frozenset(["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"])
TYPE_KEYWORDS = {
  "string": frozenset(["minLength", "maxLength", "pattern", "format"]),
  "integer": NUMERIC,
  "number": NUMERIC,
  "array": frozenset(["items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems"]),
  "object": frozenset(["properties", "required", "additionalProperties", "minProperties", "maxProperties"]),
  "boolean": frozenset(),
  "null": frozenset(),
}
KEYWORDS = frozenset(["type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref"]).union(*TYPE_KEYWORDS.values())
SUPPORTED = ", ".join(
  ["type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "properties", "required", "additionalProperties"]
  + ["items", "prefixItems", "minItems", "maxItems", "minLength", "maxLength", "pattern", "format", "minimum"]
  + ["maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"]
)

_FRACTION, _NONZERO_FRACTION, _ZERO_FRACTION = r"(?:\.[0-9]+)?", r"\.[0-9]*[1-9][0-9]*", r"(?:\.0+)?"
_HOUR, _MINUTE = "(?:[01][0-9]|2[0-3])", "[0-5][0-9]"
_YEAR = "(?:000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (
  f"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
  f"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)"
)
_TIME = f"{_HOUR}:{_MINUTE}:{_MINUTE}(?:\\.[0-9]{{3}}(?:[0-9]{{3}})?)?(?:Z|[+-]{_HOUR}:{_MINUTE})"
_URL_CHARS = "[a-zA-Z0-9._~%!$&'()*+,;=:@-]"
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
FORMATS = {  # JSON-safe regexes of the string inside the quotes; each is a subset of what RFC 3339 etc. allow.
  "date": _DATE,
  "time": _TIME,
  "date-time": f"{_DATE}T{_TIME}",
  "uuid": "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
  "email": r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9-]+(?:\.[a-zA-Z0-9-]+)*\.[a-zA-Z]{2,}",
  "uri": rf"https?://[a-zA-Z0-9-]+(?:\.[a-zA-Z0-9-]+)*(?::[0-9]{{1,5}})?(?:/{_URL_CHARS}*)*(?:\?(?:{_URL_CHARS}|/)*)?",
  "ipv4": rf"{_OCTET}(?:\.{_OCTET}){{3}}",
}
_SCALAR = {"anyOf": [{"type": "string"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"}]}
# Any JSON value, nesting at most 2 deep (outlines' own ``{}`` is 8 times larger and misses parentheses).
ANY_VALUE = {
  "anyOf": [*_SCALAR["anyOf"], {"type": "array", "items": _SCALAR}, {"type": "object", "additionalProperties": _SCALAR}]
}
MAX_ENUMERATED = 256  # Integer ranges with multipleOf are written as alternations of at most this many values.
_UNSAFE_IN_STRINGS = frozenset([ord('"'), ord("\\"), *range(0x20)])  # What JSON strings must escape.


def schema_regex(schema: dict) -> str:
  """The regex of compact JSON texts that validate against ``schema``.

  Raises:
    ConstraintError: The schema is not valid JSON Schema, or uses a keyword (or a combination) whose regex would
      not enforce it; ``param`` is the keyword's path.
  """
  if not isinstance(schema, dict):
    raise ConstraintError(f'a JSON Schema must be a JSON object like {{"type": "object"}}, not {type(schema).__name__}')
  validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
  try:
    validator.check_schema(schema)
  except jsonschema.SchemaError as e:
    where = ".".join(str(p) for p in e.path)
    raise ConstraintError(f"not a valid JSON Schema: {_one_line(e.message)}", param=where or None) from None
  rewriter = _Rewriter(schema, validator)
  ready = rewriter.node(schema, (), ("#",))
  try:
    regex = build_regex_from_schema(json.dumps(ready), WHITESPACE)
  except (ValueError, TypeError) as e:
    raise ConstraintError(f"outlines-core cannot compile the schema: {_one_line(str(e))}") from None
  return rewriter.splice(regex)


def normalize_regex(pattern: str) -> str:
  """The regex the automaton matches in full: a leading ``^`` and a trailing ``$`` are dropped (both implied)."""
  if pattern.startswith("^"):
    pattern = pattern[1:]
  if pattern.endswith("$") and (len(pattern) - 1 - len(pattern[:-1].rstrip("\\"))) % 2 == 0:
    pattern = pattern[:-1]
  return pattern


def full_match(regex: str) -> str:
  """The regex to give outlines-core's ``Index`` so that its automaton reads the texts ``regex`` matches in full.

  outlines-core's DFA has leftmost-first semantics, so ``a|ab`` alone never matches ``ab`` in full (nor an anyOf of
  integer and number ``1.5``). An end anchor restores full matching, but then a regex that matches the empty string
  has no universal start state, which outlines-core needs; so the regex also starts with :data:`SENTINEL`, read by a
  sentinel token only: the state after it is the real start.
  """
  return f"\\x{ord(SENTINEL):02x}(?:{regex})$"


def balanced(regex: str) -> bool:
  """Whether the groups of ``regex`` are balanced (escapes and nested character classes read as Rust regex reads
  them), so that it cannot close a group it is wrapped in."""
  depth, classes, i = 0, 0, 0
  while i < len(regex):
    char = regex[i]
    i += 1
    if char == "\\":
      i += 1
    elif char == "[":
      if not classes:  # A class's first character may be a literal "]" (after an optional "^").
        i += regex[i : i + 1] == "^"
        i += regex[i : i + 1] == "]"
      classes += 1
    elif classes:
      classes -= char == "]"
    elif char in "()":
      depth += 1 if char == "(" else -1
      if depth < 0:
        return False
  return depth == 0 and classes == 0


def explain_regex_error(regex: str) -> str:
  """One line on why outlines-core (Rust regex syntax) refused ``regex``."""
  shown = regex if len(regex) <= 80 else regex[:77] + "..."
  try:
    re.compile(regex)
  except re.error as e:
    return f"invalid regex {shown!r}: {e.msg} at position {e.pos}"
  features = [
    (r"\(\?<?[=!]", "look-ahead or look-behind"),
    (r"\\[1-9]|\(\?P=", "a backreference"),
    (r"\\[bBAZz]|(?<![\[\\])\^|(?<!\\)\$.", r"an anchor (^ or $ inside it, \b, \A, \Z)"),
    (r"[*+?}]\+|\(\?>", "a possessive quantifier or an atomic group"),
  ]
  for pattern, feature in features:
    if re.search(pattern, regex):
      return f"regex {shown!r} uses {feature}, which a finite automaton cannot express; rewrite it without"
  return f"regex {shown!r} is not valid Rust regex syntax (what the automaton compiler reads); use plain syntax"


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


def _one_line(text: str, limit: int = 200) -> str:
  text = " ".join(text.split())
  return text if len(text) <= limit else text[: limit - 3] + "..."


def _dumps(value) -> str:
  return json.dumps(value, separators=(",", ":"))


def escape(text: str) -> str:
  """``text`` as a regex literal (escapes that Python's and Rust's regex syntax both read)."""
  return re.sub(r"([\\.+*?()|\[\]{}^$#&~-])", r"\\\1", text)


def _group(parts: list[str]) -> str:
  return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


class _Rewriter:
  """Turns a schema into one whose outlines-core regex enforces it exactly (see the module docstring)."""

  def __init__(self, root: dict, validator):
    self.root, self.validator = root, validator
    self.regexes: list[str] = []
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

  def fail(self, message: str, path: tuple, *keyword: str):
    raise ConstraintError(message, param=".".join(path + keyword) or None)

  # ------------------------------------------------------------------------------------------ structure

  def deref(self, schema, path: tuple, refs: tuple) -> tuple[dict, tuple]:
    """``schema`` with its top-level ``$ref`` followed (siblings merged in) and the refs on the way."""
    while isinstance(schema, dict) and "$ref" in schema:
      ref = schema["$ref"]
      if not ref.startswith("#"):
        self.fail(f"$ref {ref!r} is not local; only '#/...' pointers into the schema are supported", path, "$ref")
      if ref in refs:
        self.fail(f"$ref {ref!r} is recursive; a finite automaton needs it unrolled to a fixed depth", path, "$ref")
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
        if key not in out or _dumps(out[key]) == _dumps(value):
          out[key] = value
        elif key == "required":
          out[key] = out[key] + [r for r in value if r not in out[key]]
        elif key == "properties":
          out[key] = {**out[key], **{n: {"allOf": [out[key][n], s]} if n in out[key] else s for n, s in value.items()}}
        elif key == "type":
          out[key] = _common_types(out[key], value) or self.fail(f"types {out[key]} and {value} share no value", path)
        elif key in ("minimum", "minLength", "minItems", "minProperties") and not isinstance(value, bool):
          out[key] = max(out[key], value)
        elif key in ("maximum", "maxLength", "maxItems", "maxProperties") and not isinstance(value, bool):
          out[key] = min(out[key], value)
        else:
          self.fail(f"{key!r} differs between schemas that must all hold (allOf, $ref siblings); state it once", path)
    for part in parts:
      if part.get("additionalProperties", True) is not True:
        own = set(part.get("properties", {}))
        if not set(out.get("properties", {})) | set(out.get("required", [])) <= own:
          self.fail("additionalProperties in one of several combined schemas hides the others' properties", path)
    return out

  def node(self, schema, path: tuple, refs: tuple) -> dict:
    """The outlines-ready form of the subschema at ``path``."""
    schema, refs = self.deref(schema, path, refs)
    if schema is True:
      return ANY_VALUE
    if schema is False:
      self.fail("the schema `false` accepts nothing; remove what uses it", path)
    body = _body(schema)
    if "enum" in body or "const" in body:
      return self.values(schema, path)
    for key in body:
      if key not in KEYWORDS:
        self.fail(f"{key!r} is not enforced by the constraint compiler; remove it (supported: {SUPPORTED})", path, key)
    if "allOf" in body:
      rest = {k: v for k, v in body.items() if k != "allOf"}
      parts = [self.deref(p, path + ("allOf", str(i)), refs)[0] for i, p in enumerate(body["allOf"])]
      return self.node(self.merge([rest, *parts], path), path, refs)
    if "anyOf" in body and "oneOf" in body:
      self.fail("anyOf and oneOf in one schema are not supported; nest one inside the other", path, "oneOf")
    for word in ("anyOf", "oneOf"):
      if word in body:
        rest = {k: v for k, v in body.items() if k != word}
        where = [path + (word, str(i)) for i, b in enumerate(body[word]) if b is not False]
        if not where:
          self.fail(f"every branch of {word} is `false`; nothing matches", path, word)
        given = [self.deref(b, path + (word, str(i)), refs)[0] for i, b in enumerate(body[word]) if b is not False]
        branches = [self.merge([rest, b], p) for b, p in zip(given, where, strict=True)]
        if word == "oneOf":
          self.check_exclusive(branches, path)
        ready = [self.node(b, p, refs) for b, p in zip(branches, where, strict=True)]
        return ready[0] if len(ready) == 1 else {"anyOf": ready}
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
      ready = [self.typed(t, body, path, refs) for t in names]
      return ready[0] if len(ready) == 1 else {"anyOf": ready}
    return self.typed(types, body, path, refs)

  def values(self, schema: dict, path: tuple) -> dict:
    """``enum``/``const``: the values that satisfy every keyword of the schema (checked by jsonschema), as a regex."""
    body = _body(schema)
    options = [body["const"]] if "const" in body else list(body["enum"])
    defs = {k: self.root[k] for k in ("$defs", "definitions") if k in self.root and k not in schema}
    try:
      check = self.validator({**schema, **defs})
      options = [v for v in options if check.is_valid(v)]
    except Unresolvable as e:
      self.fail(f"cannot check the enum values against their schema: {_one_line(str(e))}", path)
    if not options:
      self.fail(
        "no value of 'enum'/'const' satisfies the schema's other keywords", path, "const" if "const" in body else "enum"
      )
    return self.placeholder("|".join(escape(t) for t in dict.fromkeys(_dumps(v) for v in options)))

  def check_exclusive(self, branches: list[dict], path: tuple) -> None:
    """``oneOf`` is ``anyOf`` only when no value can match two branches: distinct types, or a discriminator (a
    property every branch requires with disjoint ``const``/``enum`` values)."""
    kinds = [_kinds(b) for b in branches]
    if all(k is not None for k in kinds) and all(
      not (kinds[i] & kinds[j]) for i in range(len(kinds)) for j in range(i)
    ):
      return
    shared = set.intersection(*(set(b.get("required", [])) for b in branches))
    for name in sorted(shared):
      options = [_constants(self.deref(b.get("properties", {}).get(name, {}), path, ())[0]) for b in branches]
      if all(o is not None for o in options) and all(
        not (options[i] & options[j]) for i in range(len(options)) for j in range(i)
      ):
        return
    self.fail(
      "oneOf branches may overlap (a value could match two); give them distinct types or a required property with "
      "distinct 'const' values, or use anyOf",
      path,
      "oneOf",
    )

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
      return self.placeholder(f'"(?:{self.string_pattern(body["pattern"], path)})"')
    if not lengths:
      return {"type": "string"}
    low, high = int(body.get("minLength", 0)), body.get("maxLength")
    if high is not None and low > int(high):
      self.fail(f"minLength={low} is above maxLength={high}", path, "minLength")
    return {"type": "string", "minLength": low, **({} if high is None else {"maxLength": int(high)})}

  def string_pattern(self, pattern: str, path: tuple) -> str:
    """``pattern`` anchored (jsonschema searches; matching in full is stricter) and checked to never need an escape
    in JSON: an automaton over single bytes finds any character it can match that JSON strings must escape."""
    inner = normalize_regex(pattern)
    try:
      if not balanced(inner):
        raise ValueError(inner)
      index = outlines_core.Index(full_match(inner), _byte_vocabulary())
    except ValueError:
      self.fail(explain_regex_error(inner), path, "pattern")
    transitions = index.get_transitions()
    transitions.pop(index.get_initial_state())  # Only reads the sentinel.
    for row in transitions.values():
      unsafe = sorted((t - 1 for t in row if t - 1 in _UNSAFE_IN_STRINGS), key=lambda b: (b < 0x20, b))
      if unsafe:
        self.fail(
          f"pattern {pattern!r} can match {chr(unsafe[0])!r}, which JSON strings must escape; exclude it (e.g. "
          r"[^\"\\] instead of .)",
          path,
          "pattern",
        )
    return inner

  def number(self, body: dict, path: tuple, integer: bool) -> dict:
    low, low_open = _bound(body, "minimum", "exclusiveMinimum", max)
    high, high_open = _bound(body, "maximum", "exclusiveMaximum", min)
    step = body.get("multipleOf")
    if integer:
      first = None if low is None else (math.floor(low) + 1 if low_open else math.ceil(low))
      last = None if high is None else (math.ceil(high) - 1 if high_open else math.floor(high))
      if first is not None and last is not None and first > last:
        self.fail(f"no integer lies within the bounds ({low}, {high})", path, "minimum")
      if step is None:
        return {"type": "integer"} if low is None and high is None else self.placeholder(_integers(first, last))
      if first is None or last is None or last - first > 16 * MAX_ENUMERATED:
        self.fail("'multipleOf' needs 'minimum' and 'maximum' close enough to enumerate the values", path, "multipleOf")
      values = [v for v in range(first, last + 1) if Fraction(v) % Fraction(str(step)) == 0]
      if not values or len(values) > MAX_ENUMERATED:
        self.fail(f"'multipleOf' leaves {len(values)} values; allowed are 1 to {MAX_ENUMERATED}", path, "multipleOf")
      return self.placeholder("|".join(str(v) for v in values))
    if step is not None:
      self.fail("'multipleOf' is enforced for integers only; use type integer or drop it", path, "multipleOf")
    for value, word in ((low, "minimum"), (high, "maximum")):
      if value is not None and value != math.floor(value):
        self.fail(f"{word}={value}: number bounds must be whole numbers (or use type integer)", path, word)
    if low is None and high is None:
      return {"type": "number"}
    regex = _decimals(None if low is None else int(low), low_open, None if high is None else int(high), high_open)
    if not regex:
      self.fail(f"no number lies within the bounds ({low}, {high})", path, "minimum")
    return self.placeholder(regex)

  def array(self, body: dict, path: tuple, refs: tuple) -> dict:
    low, high = int(body.get("minItems", 0)), body.get("maxItems")
    if high is not None and low > int(high):
      self.fail(f"minItems={low} is above maxItems={high}", path, "minItems")
    if body.get("uniqueItems"):
      self.fail("'uniqueItems': true is not enforced; use an enum of whole arrays or drop it", path, "uniqueItems")
    items, prefix = body.get("items"), body.get("prefixItems")
    if isinstance(items, list):  # Before draft 2020-12, a list of items is a tuple.
      prefix, items = items, None
    if prefix is not None:
      n = len(prefix)
      if n < low or (high is not None and n > int(high)):
        self.fail(f"a tuple of {n} items (always written in full) must fit minItems/maxItems", path, "prefixItems")
      return {"prefixItems": [self.node(p, path + ("prefixItems", str(i)), refs) for i, p in enumerate(prefix)]}
    if items is False:
      if low:
        self.fail("'items': false allows only [], but minItems is above 0", path, "items")
      high = 0
    items = self.node(items, path + ("items",), refs) if isinstance(items, dict) else ANY_VALUE
    return {"type": "array", "items": items, "minItems": low, **({} if high is None else {"maxItems": int(high)})}

  def object(self, body: dict, path: tuple, refs: tuple) -> dict:
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
      values = self.node(extra, path + ("additionalProperties",), refs) if isinstance(extra, dict) else ANY_VALUE
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
      if _dumps(name) != f'"{name}"':
        self.fail(f"property name {name!r} needs escaping in JSON; use plain ASCII names", path, "properties", name)
      if sub is False and name not in required:
        continue
      ready[name] = self.node(sub, path + ("properties", name), refs)
    if low > len(required):
      self.fail(
        f"minProperties={low} is above the {len(required)} required properties; require more", path, "minProperties"
      )
    if high is not None and int(high) < len(ready):
      self.fail(f"maxProperties={high} is below the {len(ready)} properties; drop some", path, "maxProperties")
    return {"type": "object", "properties": ready, **({"required": required} if required else {})}


def _body(schema) -> dict:
  return {k: v for k, v in schema.items() if k not in ANNOTATIONS} if isinstance(schema, dict) else {}


def _common_types(a, b) -> list[str] | str | None:
  wide = lambda t: {"integer", "number"} if t == "number" else {t}  # noqa: E731
  left = set().union(*(wide(t) for t in ([a] if isinstance(a, str) else a)))
  right = set().union(*(wide(t) for t in ([b] if isinstance(b, str) else b)))
  common = sorted(left & right)
  if "number" in common:
    common.remove("integer")
  return None if not common else common[0] if len(common) == 1 else common


def _kinds(schema: dict) -> set[str] | None:
  """The JSON kinds a schema allows, from its explicit ``type``/``enum``/``const`` (None: possibly any)."""
  values = _constants(schema)
  if values is not None:
    return {_kind(json.loads(v)) for v in values}
  types = schema.get("type")
  if types is None:
    return None
  return {"number" if t == "integer" else t for t in ([types] if isinstance(types, str) else types)}


def _kind(value) -> str:
  if isinstance(value, bool):
    return "boolean"
  if isinstance(value, (int, float)):
    return "number"
  return {str: "string", list: "array", dict: "object", type(None): "null"}[type(value)]


def _constants(schema) -> set[str] | None:
  if not isinstance(schema, dict):
    return None
  if "const" in schema:
    return {_dumps(schema["const"])}
  if "enum" in schema:
    return {_dumps(v) for v in schema["enum"]}
  return None


def _bound(body: dict, inclusive: str, exclusive: str, tighter) -> tuple[float | None, bool]:
  """``(value, open)`` of a lower (``tighter=max``) or upper (``min``) bound, from either draft's spelling."""
  value, other = body.get(inclusive), body.get(exclusive)
  if isinstance(other, bool):  # Draft 4: a flag on minimum/maximum.
    return value, other and value is not None
  if other is None:
    return value, False
  if value is not None and value != other and tighter(value, other) == value:
    return value, False
  return other, True


def _same_length(low: str, high: str) -> str:
  """Regex of the digit strings of one length between ``low`` and ``high``."""
  if low == high:
    return low
  if low[0] == high[0]:
    return low[0] + _same_length(low[1:], high[1:])
  rest = len(low) - 1
  tail = f"[0-9]{{{rest}}}" if rest > 1 else "[0-9]" if rest else ""
  if low[1:] == "0" * rest and high[1:] == "9" * rest:
    return f"[{low[0]}-{high[0]}]{tail}"
  parts = [low[0] + _group([_same_length(low[1:], "9" * rest)])]
  if int(high[0]) - int(low[0]) > 1:
    parts.append(f"[{int(low[0]) + 1}-{int(high[0]) - 1}]{tail}")
  parts.append(high[0] + _group([_same_length("0" * rest, high[1:])]))
  return _group(parts)


def _naturals(low: int, high: int | None) -> str:
  """Regex of the decimal numbers (no leading zeros) from ``low`` to ``high`` (None: no end)."""
  parts = []
  widths = range(len(str(low)), (len(str(high)) if high is not None else len(str(low))) + 1)
  for width in widths:
    first = max(low, 10 ** (width - 1) if width > 1 else 0)
    last = 10**width - 1 if high is None else min(high, 10**width - 1)
    if first <= last:
      parts.append(_same_length(str(first), str(last)))
  if high is None:
    parts.append(f"[1-9][0-9]{{{len(str(low))},}}")
  return _group(parts)


def _integers(first: int | None, last: int | None) -> str:
  """Regex of the JSON integers from ``first`` to ``last`` (None: unbounded)."""
  parts = []
  if last is None or last >= 0:
    parts.append(_naturals(max(first or 0, 0), last))
  if first is None or first < 0:
    parts.append("-" + _group([_naturals(max(-last, 1) if last is not None else 1, None if first is None else -first)]))
  return _group(parts)


def _magnitudes(low: int, low_open: bool, high: int | None, high_open: bool) -> list[str]:
  """Regexes of the unsigned decimals (integer part, optional fraction) between whole ``low`` and ``high``."""
  if high is not None and high == low:
    return [] if low_open or high_open else [f"{low}{_ZERO_FRACTION}"]
  if high is not None and high < low:
    return []
  parts = [f"{low}{_NONZERO_FRACTION if low_open else _FRACTION}"]
  if high is None or high - 1 >= low + 1:
    parts.append(_naturals(low + 1, None if high is None else high - 1) + _FRACTION)
  if high is not None and not high_open:
    parts.append(f"{high}{_ZERO_FRACTION}")
  return parts


def _decimals(low: int | None, low_open: bool, high: int | None, high_open: bool) -> str:
  """Regex of JSON numbers without exponent between whole bounds (None: unbounded); empty when there are none."""
  parts = []
  if high is None or high > 0 or (high == 0 and not high_open):
    from_zero = low is None or low < 0
    parts += _magnitudes(0 if from_zero else low, False if from_zero else low_open, high, high_open)
  if low is None or low < 0:
    to_zero = high is None or high >= 0
    # A negative number's magnitude is above 0 (-0 is written 0) and at most -low.
    negative = _magnitudes(
      0 if to_zero else -high, True if to_zero else high_open, None if low is None else -low, low_open
    )
    if negative:
      parts.append("-" + _group(negative))
  return _group(parts) if parts else ""


@functools.cache
def _byte_vocabulary() -> outlines_core.Vocabulary:
  """Every single byte as a token (id = byte + 1; EOS is 0), to read a regex's character transitions."""
  return outlines_core.Vocabulary(0, {bytes([b]): [b + 1] for b in range(256)})
