"""A JSON Schema in disjunctive normal form: alternatives, each a conjunction of what the keywords ask (a
:class:`Conj`), with the subschemas of items and properties kept as literals (a subschema, or its complement) to be
read when their language is built. :mod:`~mercury_jax.constrain.reading` reads schemas into this form.

In-place applicators are expanded: ``allOf`` merges, ``anyOf`` unions, ``if``/``then``/``else`` is
``(if and then) or (not if and else)``, ``dependentRequired``/``dependentSchemas`` (draft 7's ``dependencies``)
are "the property absent, or present with what it needs", ``oneOf`` is ``anyOf`` when its branches exclude each
other (:mod:`~mercury_jax.constrain.oneof`) and else each branch and the complements of the others. ``not`` is
pushed down keyword by keyword (De Morgan): the complement of ``minimum`` is an open ``maximum``, of ``pattern`` the
strings it finds nothing in, of ``properties`` an object with that property present and its value in the
complement, and so on. Where a complement is not a regular language (``uniqueItems``, ``unevaluated*``) that
alternative is left out: every alternative kept is still within the complement, so what is written stays valid
(the same holds for a recursion cut where it is unrolled no further).

Each conjunction also records the properties and items the parts it was made of evaluate (annotations, for
``unevaluatedProperties``/``unevaluatedItems``): only the positive parts of the alternative (the ``anyOf``
branch taken, ``if`` when ``then`` is, never a ``not``), so an unevaluated rule sees no more than a validator does.
"""

from __future__ import annotations

import dataclasses

from mercury_jax.constrain.document import Document, base_of
from mercury_jax.constrain.numbers import NumberSpec, exact

KINDS = frozenset(["null", "boolean", "number", "string", "array", "object"])
_ANNOTATIONS = frozenset(
  ["title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly", "example"]
)


def asks_nothing(schema) -> bool:
  """Whether a subschema is ``true`` or ``{}`` (annotations aside)."""
  return schema is True or (isinstance(schema, dict) and set(schema) <= _ANNOTATIONS)


@dataclasses.dataclass(frozen=True, eq=False)
class Sub:
  """A subschema where it stands.

  Attributes:
    schema: The subschema (a dict or a boolean).
    resolver: The resolver of its scope (its own ``$id`` entered).
    path: Where the compiler reports it: keywords from the root, ``$ref``\\ s followed without a step.
    refs: The references followed to reach it (their targets), to unroll recursion.
  """

  schema: object
  resolver: object
  path: tuple[str, ...]
  refs: tuple = ()

  @property
  def key(self) -> tuple:
    return (id(self.schema), base_of(self.resolver), self.refs)

  def child(self, schema, doc: Document, *steps: str) -> Sub:
    return Sub(schema, doc.enter(schema, self.resolver), self.path + steps, self.refs)


Lit = tuple[Sub, bool]  # a subschema, or (False) its complement


@dataclasses.dataclass(frozen=True)
class Keys:
  """A set of property names: these names, or names in which one of these patterns finds a match, or any name
  (``everything``), or names (strings) that satisfy all ``strings`` literals; ``negated``: the names outside."""

  names: frozenset = frozenset()
  patterns: tuple[str, ...] = ()
  everything: bool = False
  strings: tuple[Lit, ...] = ()
  negated: bool = False


@dataclasses.dataclass(frozen=True)
class KeyRule:
  """Values of the properties whose names are in ``keys`` satisfy ``lits`` (``written``: a schema that asks for
  such properties to be written: a pattern's, or an explicit one of additional or unevaluated properties)."""

  keys: Keys
  lits: tuple[Lit, ...]
  written: bool


@dataclasses.dataclass(frozen=True)
class Exists:
  """At least one property whose name is in ``keys`` and whose value satisfies ``lits``."""

  keys: Keys
  lits: tuple[Lit, ...]


@dataclasses.dataclass(frozen=True)
class Contains:
  """Between ``low`` and ``high`` (None: any number of) items from position ``start`` on satisfy ``lits``."""

  lits: tuple[Lit, ...]
  low: int
  high: int | None
  start: int = 0


@dataclasses.dataclass(frozen=True)
class Evaluated:
  """What the parts of an alternative evaluate: property names and patterns (or every property), item positions
  before ``prefix`` (or every item), and items that satisfy one of ``contains``."""

  names: frozenset = frozenset()
  patterns: tuple[str, ...] = ()
  properties: bool = False
  prefix: int = 0
  items: bool = False
  contains: tuple[tuple[Lit, ...], ...] = ()

  def __or__(self, other: Evaluated) -> Evaluated:
    return Evaluated(
      self.names | other.names,
      self.patterns + other.patterns,
      self.properties or other.properties,
      max(self.prefix, other.prefix),
      self.items or other.items,
      self.contains + other.contains,
    )


@dataclasses.dataclass(frozen=True)
class Conj:
  """One alternative: everything it asks, by kind of value (fields left at their defaults ask nothing)."""

  kinds: frozenset = KINDS
  implied: frozenset = frozenset()  # kinds its schemas' own keywords apply to (written when ``kinds`` says nothing)
  values: tuple | None = None  # enum/const: the only values allowed (also checked against ``checks``)
  excluded: tuple = ()  # values not allowed
  checks: tuple[Lit, ...] = ()  # the literals it was made from
  number: NumberSpec = NumberSpec()
  min_length: int = 0
  max_length: int | None = None
  patterns: tuple[str, ...] = ()
  not_patterns: tuple[str, ...] = ()
  formats: tuple[tuple[str, tuple], ...] = ()  # (format, path)
  min_items: int = 0
  max_items: int | None = None
  items: tuple[tuple[int, int | None, tuple[Lit, ...]], ...] = ()  # positions [start, end) satisfy the literals
  contains: tuple[Contains, ...] = ()
  unique: tuple[tuple, ...] = ()  # paths of uniqueItems: true
  min_properties: int = 0
  max_properties: int | None = None
  properties: tuple[tuple[str, tuple[Lit, ...]], ...] = ()  # listed names (in order) and their literals
  required: tuple[str, ...] = ()
  rules: tuple[KeyRule, ...] = ()
  exists: tuple[Exists, ...] = ()
  names: tuple[tuple[Lit, ...], ...] = ()  # propertyNames
  evaluated: Evaluated = Evaluated()
  unevaluated_properties: tuple[tuple[Evaluated, tuple[Lit, ...]], ...] = ()
  unevaluated_items: tuple[tuple[Evaluated, tuple[Lit, ...]], ...] = ()

  @property
  def trivial(self) -> bool:
    """Whether it asks nothing at all."""
    return dataclasses.replace(self, checks=(), evaluated=Evaluated(), implied=frozenset()) == _TRIVIAL

  @property
  def written_kinds(self) -> frozenset:
    """The kinds of value written: those its keywords apply to when no type narrows it (a subset: a schema of
    ``properties`` alone is written as an object)."""
    return self.kinds & self.implied if self.kinds == KINDS and self.kinds & self.implied else self.kinds


_TRIVIAL = Conj()


def value_key(value):
  """A key under which values equal in JSON Schema's sense (``1 == 1.0``, ``true != 1``) are equal."""
  if isinstance(value, bool) or value is None:
    return ("atom", value)
  if isinstance(value, (int, float)):
    return ("number", exact(value))
  if isinstance(value, list):
    return ("array", tuple(value_key(v) for v in value))
  if isinstance(value, dict):
    return ("object", tuple(sorted((k, value_key(v)) for k, v in value.items())))
  return ("string", value)


def merge(a: Conj, b: Conj) -> Conj:
  """The conjunction of both."""
  if b is _TRIVIAL or (not b.checks and b == _TRIVIAL):
    return a
  values = a.values if b.values is None else b.values if a.values is None else None
  if a.values is not None and b.values is not None:
    keys = {value_key(v) for v in b.values}
    values = tuple(v for v in a.values if value_key(v) in keys)
  na, nb = a.number, b.number
  low, low_open = _tighter(na.low, na.low_open, nb.low, nb.low_open, max)
  high, high_open = _tighter(na.high, na.high_open, nb.high, nb.high_open, min)
  number = NumberSpec(
    low,
    low_open,
    high,
    high_open,
    na.integer or nb.integer,
    na.fractional or nb.fractional,
    na.steps + nb.steps,
    na.not_steps + nb.not_steps,
    na.excluded + nb.excluded,
  )
  properties = dict(a.properties)
  for name, lits in b.properties:
    properties[name] = properties.get(name, ()) + lits
  return Conj(
    kinds=a.kinds & b.kinds,
    implied=a.implied | b.implied,
    values=values,
    excluded=a.excluded + b.excluded,
    checks=a.checks + b.checks,
    number=number,
    min_length=max(a.min_length, b.min_length),
    max_length=_least(a.max_length, b.max_length),
    patterns=a.patterns + b.patterns,
    not_patterns=a.not_patterns + b.not_patterns,
    formats=a.formats + b.formats,
    min_items=max(a.min_items, b.min_items),
    max_items=_least(a.max_items, b.max_items),
    items=a.items + b.items,
    contains=a.contains + b.contains,
    unique=a.unique + b.unique,
    min_properties=max(a.min_properties, b.min_properties),
    max_properties=_least(a.max_properties, b.max_properties),
    properties=tuple(properties.items()),
    required=a.required + tuple(r for r in b.required if r not in a.required),
    rules=a.rules + b.rules,
    exists=a.exists + b.exists,
    names=a.names + b.names,
    evaluated=a.evaluated | b.evaluated,
    unevaluated_properties=a.unevaluated_properties + b.unevaluated_properties,
    unevaluated_items=a.unevaluated_items + b.unevaluated_items,
  )


def _least(a, b):
  return b if a is None else a if b is None else min(a, b)


def _tighter(a, a_open, b, b_open, pick):
  if a is None:
    return b, b_open
  if b is None or a != b:
    return (a, a_open) if b is None or pick(a, b) == a else (b, b_open)
  return a, a_open or b_open


def bounds_negated(low, low_open, high, high_open) -> list[NumberSpec]:
  """Numbers outside the bounds: below ``low`` or above ``high``."""
  out = []
  if low is not None:
    out.append(NumberSpec(high=low, high_open=not low_open))
  if high is not None:
    out.append(NumberSpec(low=high, low_open=not high_open))
  return out
