"""When ``oneOf`` may be written as ``anyOf``: no value the compiler writes for one branch validates against another.

Without these rules ``oneOf`` is still exact (each branch intersected with the complements of the others,
:mod:`~mercury_jax.constrain.reading`), but the complements multiply: ten branches that differ by a ``const``
discriminator would expand into thousands of alternatives. These rules decide cheaply that two branches cannot
overlap, each way round. They look at what the compiler writes, which is less than a branch allows: an object with
``properties`` gets no other property unless ``additionalProperties`` (or ``patternProperties``) asks for them, so
a branch that requires a property the other never writes excludes it. Where a rule cannot tell, the branches may
overlap.

* their types differ; the first's ``enum``/``const`` values all fail the second, or the second's all fail the first
  (checked by ``jsonschema``);
* the second requires a property the first never writes; the first requires a property the second forbids
  (``false``, or outside its properties under ``additionalProperties: false``); a property both require has values
  that exclude each other, by these same rules;
* their numeric ranges, string lengths or array lengths do not meet; the first's ``pattern``/``format`` shares no
  text with what the second's ``pattern`` finds.
"""

from __future__ import annotations

import json
from typing import Protocol

from mercury_jax.constrain import fsa, numbers, patterns
from mercury_jax.constrain.errors import ConstraintError
from mercury_jax.constrain.formats import FORMATS

_COMBINATORS = ("anyOf", "oneOf", "allOf", "$ref", "not", "if", "nullable")
_ANNOTATIONS = frozenset(["title", "description", "default", "examples", "$comment", "$id", "$anchor", "$defs"])
_SMALL = fsa.Budget(4096)  # Patterns are compared on their automata up to this size; larger ones cannot be.


class Resolver(Protocol):
  """What the rules need from the reader (:class:`~mercury_jax.constrain.reading.Normalizer`)."""

  def resolve(self, sub):
    """``sub`` with its top-level ``$ref`` followed; None when it cannot be."""

  def valid(self, value, sub) -> bool | None:
    """Whether ``value`` validates against ``sub``; None when that cannot be checked."""

  def child(self, sub, schema, *steps):
    """The subschema ``schema`` of ``sub``."""


def exclusive(a, b, resolver: Resolver) -> bool:
  """Whether no value written for ``a`` validates against ``b``, nor one written for ``b`` against ``a``."""
  try:
    return excludes(a, b, resolver) and excludes(b, a, resolver)
  except (ConstraintError, fsa.TooLarge):  # a pattern the automaton cannot read: the branch itself will say so
    return False


def _body(sub, resolver: Resolver):
  sub = resolver.resolve(sub)
  if sub is None:
    return None, None
  schema = sub.schema
  return sub, ({k: v for k, v in schema.items() if k not in _ANNOTATIONS} if isinstance(schema, dict) else schema)


def excludes(a, b, resolver: Resolver, level: int = 0) -> bool:
  """Whether no value the compiler writes for subschema ``a`` validates against subschema ``b`` (False: it may, or
  the rules cannot tell)."""
  a, body_a = _body(a, resolver)
  b, body_b = _body(b, resolver)
  if body_a is False or body_b is False:
    return True
  if not isinstance(body_a, dict) or not isinstance(body_b, dict) or level > 8:
    return False
  kinds_a, kinds_b = _kinds(body_a), _kinds(body_b)
  if kinds_a is not None and kinds_b is not None and not kinds_a & kinds_b:
    return True
  written, accepted = _constants(body_a), _constants(body_b)
  if written is not None and all(resolver.valid(json.loads(v), b) is False for v in written):
    return True
  if accepted is not None and all(resolver.valid(json.loads(v), a) is False for v in accepted):
    return True
  if kinds_a is None or len(kinds_a) != 1 or written is not None:
    return False
  kind = next(iter(kinds_a))
  if kind == "object":
    return _objects_exclude(a, body_a, b, body_b, resolver, level)
  if kind == "number":
    return _disjoint(_range(body_a, "minimum", "maximum"), _range(body_b, "minimum", "maximum"))
  if kind == "array":
    return _disjoint(_range(body_a, "minItems", "maxItems"), _range(body_b, "minItems", "maxItems"))
  if kind == "string":
    if _disjoint(_range(body_a, "minLength", "maxLength"), _range(body_b, "minLength", "maxLength")):
      return True
    if "pattern" not in body_b or not ("format" in body_a and body_a["format"] in FORMATS or "pattern" in body_a):
      return False
    own = patterns.full(FORMATS[body_a["format"]]) if body_a.get("format") in FORMATS else None
    if "pattern" in body_a:
      own = patterns.search(body_a["pattern"], _SMALL) if own is None else own
    return fsa.disjoint(own, patterns.search(body_b["pattern"], _SMALL, wide=True))
  return False


def _objects_exclude(a, body_a: dict, b, body_b: dict, resolver: Resolver, level: int) -> bool:
  names = _written_names(body_a)
  for name in body_b.get("required", []):
    if names is not None and name not in names[0] and not any(_may_be_key(p, name) for p in names[1]):
      return True  # b requires a property a never writes
  b_properties, b_patterns = body_b.get("properties", {}), body_b.get("patternProperties", {})
  for name in body_a.get("required", []):
    if b_properties.get(name) is False:
      return True
    if name not in b_properties:
      if False in [s for p, s in b_patterns.items() if _surely_key(p, name)]:
        return True  # a pattern of b that surely finds the name forbids it
      if body_b.get("additionalProperties") is False and not any(_may_be_key(p, name) for p in b_patterns):
        return True  # b forbids every name it does not list
    elif name in body_a.get("properties", {}):
      first = resolver.child(a, body_a["properties"][name], "properties", name)
      second = resolver.child(b, b_properties[name], "properties", name)
      if excludes(first, second, resolver, level + 1):
        return True
  return False


def _kinds(schema: dict) -> set[str] | None:
  """The JSON kinds a schema allows, from its explicit ``type``/``enum``/``const`` (None: possibly any)."""
  if any(k in schema for k in _COMBINATORS):
    return None
  values = _constants(schema)
  if values is not None:
    return {_kind(json.loads(v)) for v in values}
  if "type" in schema:
    types = schema["type"]
    return {"number" if t == "integer" else t for t in ([types] if isinstance(types, str) else types)}
  return None


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
  for word in ("additionalProperties", "unevaluatedProperties"):
    extra = schema.get(word, True)
    if isinstance(extra, dict) and set(extra) - _ANNOTATIONS - {"title", "description"}:
      return None  # further properties of any name are written
  key_patterns = [p for p, s in schema.get("patternProperties", {}).items() if s is not False]
  if "properties" in schema or "required" in schema or key_patterns:
    listed = {n for n, s in schema.get("properties", {}).items() if s is not False}
    return listed | set(schema.get("required", [])), key_patterns
  if schema.get("additionalProperties") is False or schema.get("maxProperties") == 0:
    return set(), []
  return None


def _may_be_key(pattern: str, name: str) -> bool:
  """Whether ``pattern`` may find ``name`` (by either reading; True when that cannot be told)."""
  try:
    return patterns.search(pattern, _SMALL, wide=True).accepts(name)
  except (ConstraintError, fsa.TooLarge):
    return True


def _surely_key(pattern: str, name: str) -> bool:
  """Whether ``pattern`` finds ``name`` by every reading (False when that cannot be told)."""
  try:
    return patterns.search(pattern, _SMALL).accepts(name)
  except (ConstraintError, fsa.TooLarge):
    return False


def _range(schema: dict, low: str, high: str) -> tuple:
  """``(low, low_open, high, high_open)`` of a schema's numeric bounds (or length bounds), None where absent."""
  if low == "minimum":
    return (
      *numbers.bound(schema, "minimum", "exclusiveMinimum", max),
      *numbers.bound(schema, "maximum", "exclusiveMaximum", min),
    )
  bottom, top = schema.get(low), schema.get(high)
  return (None if bottom is None else numbers.exact(bottom), False, None if top is None else numbers.exact(top), False)


def _disjoint(a: tuple, b: tuple) -> bool:
  """Whether two ranges ``(low, low_open, high, high_open)`` share no value."""

  def below(high, high_open, low, low_open) -> bool:  # the first range ends before the second starts
    return high is not None and low is not None and (high < low or (high == low and (high_open or low_open)))

  return below(a[2], a[3], b[0], b[1]) or below(b[2], b[3], a[0], a[1])
