"""When ``oneOf`` may be written as ``anyOf``: no value the compiler writes for one branch validates against another.

An automaton cannot subtract one branch's texts from another's, so overlapping branches are refused; these rules
decide that two branches cannot overlap, each way round (the rules of :mod:`mercury_jax.constrain.schema`'s module
docstring). They look at what the compiler writes, which is less than a branch allows: an object with
``properties`` never gets other properties, so a branch that requires a property the other never writes excludes
it even without ``additionalProperties: false``. Where a rule cannot tell, it says the branches may overlap.
"""

from __future__ import annotations

import json
from typing import Protocol

from mercury_jax.constrain import numbers, regexes

_COMBINATORS = ("anyOf", "oneOf", "allOf", "$ref")
_PATTERN_STATES = 4096  # Patterns are compared on their automata up to this size (estimated); larger ones cannot be.


class Resolver(Protocol):
  """What the rules need from the schema rewriter."""

  def resolve(self, schema) -> dict | bool | None:
    """``schema`` with its top-level ``$ref`` followed and annotations dropped; None when it cannot be."""

  def valid(self, value, schema: dict) -> bool | None:
    """Whether ``value`` validates against the subschema ``schema``; None when that cannot be checked."""


def exclusive(a, b, resolver: Resolver) -> bool:
  """Whether no value written for ``a`` validates against ``b``, nor one written for ``b`` against ``a``."""
  try:
    return excludes(a, b, resolver) and excludes(b, a, resolver)
  except ValueError:  # a pattern outlines-core cannot compile: the branch itself will say so
    return False


def excludes(a, b, resolver: Resolver, level: int = 0) -> bool:
  """Whether no value the compiler writes for schema ``a`` validates against schema ``b`` (False: it may, or the
  rules cannot tell)."""
  a, b = resolver.resolve(a), resolver.resolve(b)
  if a is False or b is False:
    return True
  if not isinstance(a, dict) or not isinstance(b, dict) or level > 8:
    return False
  kinds_a, kinds_b = _kinds(a), _kinds(b)
  if kinds_a is not None and kinds_b is not None and not kinds_a & kinds_b:
    return True
  written, accepted = _constants(a), _constants(b)
  if written is not None and all(resolver.valid(v, b) is False for v in written):
    return True
  if accepted is not None and all(resolver.valid(v, a) is False for v in accepted):
    return True
  if kinds_a is None or len(kinds_a) != 1 or written is not None:
    return False
  kind = next(iter(kinds_a))
  if kind == "object":
    return _objects_exclude(a, b, resolver, level)
  if kind == "number":
    return _disjoint(_range(a, "minimum", "maximum"), _range(b, "minimum", "maximum"))
  if kind == "array":
    return _disjoint(_range(a, "minItems", "maxItems"), _range(b, "minItems", "maxItems"))
  if kind == "string":
    if _disjoint(_range(a, "minLength", "maxLength"), _range(b, "minLength", "maxLength")):
      return True
    own = regexes.FORMATS.get(a.get("format")) or (regexes.normalize_regex(a["pattern"]) if "pattern" in a else None)
    if own is None or "pattern" not in b or not _small(own, b["pattern"]):
      return False
    try:
      return regexes.disjoint(own, regexes.search_regex(b["pattern"]))
    except ValueError:
      return False
  return False


def _objects_exclude(a: dict, b: dict, resolver: Resolver, level: int) -> bool:
  names = _written_names(a)
  for name in b.get("required", []):
    if names is not None and name not in names[0] and not any(_may_be_key(p, name) for p in names[1]):
      return True  # b requires a property a never writes
  b_properties, b_patterns = b.get("properties", {}), b.get("patternProperties", {})
  readable = _small(*b_patterns)
  for name in a.get("required", []):
    if b_properties.get(name) is False:
      return True
    found = [s for p, s in b_patterns.items() if readable and regexes.searches(p, name)]
    if readable and (
      False in found or (b.get("additionalProperties") is False and name not in b_properties and not found)
    ):
      return True  # a writes a property b forbids
    if name in b_properties and excludes(
      a.get("properties", {}).get(name, True), b_properties[name], resolver, level + 1
    ):
      return True
  return False


def _kinds(schema: dict) -> set[str] | None:
  """The JSON kinds a schema allows, from its explicit ``type``/``enum``/``const``/``nullable`` (None: possibly
  any)."""
  values = _constants(schema)
  if values is not None:
    kinds = {_kind(json.loads(v)) for v in values}
  elif "type" in schema and not any(k in schema for k in _COMBINATORS):
    types = schema["type"]
    kinds = {"number" if t == "integer" else t for t in ([types] if isinstance(types, str) else types)}
  else:
    return None
  return kinds | {"null"} if schema.get("nullable") is True else kinds


def _kind(value) -> str:
  if isinstance(value, bool):
    return "boolean"
  if isinstance(value, (int, float)):
    return "number"
  return {str: "string", list: "array", dict: "object", type(None): "null"}[type(value)]


def _constants(schema: dict) -> set[str] | None:
  """The ``enum``/``const`` values of a schema as compact JSON (None: not a list of values)."""
  if any(k in schema for k in _COMBINATORS):
    return None
  if "const" in schema:
    return {json.dumps(schema["const"], separators=(",", ":"))}
  if "enum" in schema:
    return {json.dumps(v, separators=(",", ":")) for v in schema["enum"]}
  return None


def _written_names(schema: dict) -> tuple[set[str], list[str]] | None:
  """``(names, key patterns)`` that an object written for ``schema`` may have, or None for any names."""
  patterns = [p for p, s in schema.get("patternProperties", {}).items() if s is not False]
  if "properties" in schema or "required" in schema or patterns:
    listed = {n for n, s in schema.get("properties", {}).items() if s is not False}
    return listed | set(schema.get("required", [])), patterns
  if schema.get("additionalProperties") is False or schema.get("maxProperties") == 0:
    return set(), []
  return None


def _may_be_key(pattern: str, name: str) -> bool:
  """Whether a key written for ``pattern`` may be ``name``."""
  if not _small(pattern):
    return True
  try:
    return regexes.matches(regexes.key_regex(pattern), name)
  except ValueError:
    return True


def _small(*patterns: str) -> bool:
  """Whether the automata of ``patterns`` are small enough to build here."""
  return all(regexes.min_states(regexes.normalize_regex(p)) <= _PATTERN_STATES for p in patterns)


def _range(schema: dict, low: str, high: str) -> tuple:
  """``(low, low_open, high, high_open)`` of a schema's numeric bounds (or length bounds), None where absent."""
  if low == "minimum":
    return (
      *numbers.bound(schema, "minimum", "exclusiveMinimum", max),
      *numbers.bound(schema, "maximum", "exclusiveMaximum", min),
    )
  bottom, top = schema.get(low), schema.get(high)
  return (
    (None if bottom is None else numbers.exact(bottom)),
    False,
    (None if top is None else numbers.exact(top)),
    False,
  )


def _disjoint(a: tuple, b: tuple) -> bool:
  """Whether two ranges ``(low, low_open, high, high_open)`` share no value."""

  def below(high, high_open, low, low_open) -> bool:  # the first range ends before the second starts
    return high is not None and low is not None and (high < low or (high == low and (high_open or low_open)))

  return below(a[2], a[3], b[0], b[1]) or below(b[2], b[3], a[0], a[1])
