"""Reads a document's subschemas, keyword by keyword, into alternatives (:mod:`~mercury_jax.constrain.normal`):
what each keyword asks, and what its complement asks (``not`` pushed down), per draft.
"""

from __future__ import annotations

import dataclasses

from mercury_jax.constrain import complements, formats, numbers, oneof
from mercury_jax.constrain.document import Document, base_of
from mercury_jax.constrain.errors import ConstraintError
from mercury_jax.constrain.normal import (
  KINDS,
  Conj,
  Contains,
  Evaluated,
  KeyRule,
  Keys,
  Sub,
  asks_nothing,
  merge,
  value_key,
)
from mercury_jax.constrain.numbers import NumberSpec, exact

MAX_BRANCHES = 1024  # Alternatives one subschema may expand into.
_TRIVIAL = Conj()
# The kind of value each keyword applies to: a schema without type, enum or const writes the kinds its own keywords
# apply to (a subset of what it allows: {"properties": ...} is written as an object, not as 3).
_FAMILIES = {
  "object": (
    "properties", "patternProperties", "additionalProperties", "required", "minProperties", "maxProperties",
    "propertyNames", "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties",
  ),
  "array": (
    "items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems", "contains", "minContains",
    "maxContains", "unevaluatedItems",
  ),
  "string": ("minLength", "maxLength", "pattern", "format"),
  "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
}  # fmt: skip


def _only(*kinds: str) -> frozenset:
  return frozenset(kinds)


class TooManyBranches(ConstraintError):
  """The alternatives multiply past :data:`MAX_BRANCHES` (a narrowing compiler writes fewer of them instead)."""


class Normalizer:
  """Reads subschemas of one document into alternatives (:mod:`~mercury_jax.constrain.normal`).

  Args:
    doc: The document.
    depth: Times a reference may be followed on one path (recursion is cut past it).
    note: Called with ``(message, path)`` when an alternative is found to accept nothing (the first such note
      explains a schema that accepts no value).
    branches: Where alternatives multiply past this, keep the first ones (every alternative is a subset of the
      schema's texts, so fewer of them still write valid texts); None: refuse past :data:`MAX_BRANCHES`.
    narrowed: Called with ``(where, phrase)`` when alternatives are left out.
  """

  def __init__(self, doc: Document, depth: int, note, branches: int | None = None, narrowed=None):
    self.doc, self.depth, self.note = doc, depth, note
    self.branches, self.narrowed = branches, narrowed
    self.cuts: dict[str, tuple] = {}  # $ref -> the path where it first recurs
    self.recursed = False
    self._cache: dict[tuple, list[Conj]] = {}

  # ----------------------------------------------------------------------------------------- combining

  def product(self, left: list[Conj], right: list[Conj], path: tuple) -> list[Conj]:
    """Every alternative of ``left`` with every one of ``right`` (those that share a kind of value)."""
    out = []
    most = MAX_BRANCHES if self.branches is None else self.branches
    for a in left:
      for b in right:
        c = merge(a, b)
        if c.kinds:
          out.append(c)
        if len(out) > most:
          break
      if len(out) > most:
        break
    if not out and left and right:
      self.note("its parts share no kind of value (their types exclude each other)", path)
    if len(out) > most and self.branches is not None:
      where = ".".join(path) or "(root)"
      self.narrowed(where, f"the alternatives at {where} are written as the first {most} of more")
      return out[:most]
    if len(out) > MAX_BRANCHES:
      raise TooManyBranches(
        f"the schema expands into more than {MAX_BRANCHES} alternatives (anyOf, oneOf, if, dependencies and not "
        "multiply them); simplify it",
        param=".".join(path) or None,
      )
    return out

  def lookup(self, sub: Sub, ref: str):
    try:
      return self.doc.lookup(ref, sub.resolver)
    except ConstraintError as e:
      raise ConstraintError(str(e), param=".".join(sub.path + ("$ref",))) from None

  def follow(self, sub: Sub, ref: str) -> Sub | None:
    """The subschema ``ref`` points to (None: a recursion cut here)."""
    target, resolver = self.lookup(sub, ref)
    key = (id(target), base_of(resolver))
    seen = sub.refs.count(key)
    if seen:
      self.recursed = True
      self.cuts.setdefault(ref, sub.path + ("$ref",))
    if seen >= self.depth:
      self.note(f"$ref {ref!r} recurses past the {self.depth} levels unrolled", sub.path + ("$ref",))
      return None
    return Sub(target, resolver, sub.path, sub.refs + (key,))

  def child(self, sub: Sub, schema, *steps: str) -> Sub:
    return sub.child(schema, self.doc, *steps)

  def false(self, sub: Sub, *steps: str) -> Sub:
    return Sub(False, sub.resolver, sub.path + steps, sub.refs)

  def positive(self, sub: Sub) -> list[Conj]:
    """The alternatives of ``sub``."""
    key = ("+",) + sub.key
    if key not in self._cache:
      self._cache[key] = self._positive(sub)
    return self._cache[key]

  def negative(self, sub: Sub) -> list[Conj]:
    """Alternatives within the complement of ``sub`` (all of it where it is regular)."""
    key = ("-",) + sub.key
    if key not in self._cache:  # a complement evaluates nothing (annotations of a failed schema are dropped)
      mark = Conj(checks=((sub, False),))
      self._cache[key] = [merge(dataclasses.replace(c, evaluated=Evaluated()), mark) for c in self._negative(sub)]
    return self._cache[key]

  def literals(self, lits) -> list[Conj]:
    """The alternatives of the conjunction of literals."""
    out = [_TRIVIAL]
    for sub, positive in lits:
      out = self.product(out, self.positive(sub) if positive else self.negative(sub), sub.path)
      if not out:
        break
    return out

  def one_of(self, sub: Sub, parts: list[Sub]) -> list[Conj]:
    """``oneOf``: ``anyOf`` when the branches exclude each other, else each branch and not the others."""
    if all(oneof.exclusive(a, b, self) for i, a in enumerate(parts) for b in parts[:i]):
      return [c for part in parts for c in self.positive(part)]
    out = []
    for i, part in enumerate(parts):
      branch = self.positive(part)
      for j, other in enumerate(parts):
        if j != i and branch:
          branch = self.product(branch, self.negative(other), sub.path + ("oneOf", str(i)))
      out += branch
    return out

  def resolve(self, sub: Sub) -> Sub | None:
    """``sub`` with its top-level ``$ref`` followed, or None when that cannot be read alone (oneof's rules)."""
    for _ in range(8):
      if not (isinstance(sub.schema, dict) and "$ref" in sub.schema):
        return sub
      if len(sub.schema) > 1 and self.doc.rank >= 3:
        return None
      try:
        target, resolver = self.doc.lookup(sub.schema["$ref"], sub.resolver)
      except ConstraintError:
        return None
      sub = Sub(target, resolver, sub.path, sub.refs)
    return None

  def valid(self, value, sub: Sub) -> bool | None:
    return self.doc.valid(value, sub.schema, sub.resolver)

  # ----------------------------------------------------------------------------------------- positive

  def _positive(self, sub: Sub) -> list[Conj]:
    schema, doc = sub.schema, self.doc
    if schema is True:
      return [Conj(checks=((sub, True),))]
    if schema is False:
      self.note("the schema `false` accepts no value", sub.path)
      return []
    for word in ("$dynamicRef", "$recursiveRef"):
      if word in schema and doc.rank >= 3:
        raise ConstraintError(
          f"{word} is not supported (dynamic scopes are not followed); use $ref", param=".".join(sub.path + (word,))
        )
    if "$ref" in schema and doc.rank <= 2:  # before 2019-09, a $ref's siblings are ignored
      target = self.follow(sub, schema["$ref"])
      return [] if target is None else self.positive(target)
    branches = [self._atoms(sub)]
    if "$ref" in schema:
      target = self.follow(sub, schema["$ref"])
      branches = self.product(branches, [] if target is None else self.positive(target), sub.path)
    for word, alternatives in self._applicators(sub):
      if not branches:
        break
      branches = self.product(branches, alternatives, sub.path + (word,))
    if schema.get("nullable") is True:
      branches = branches + [Conj(kinds=_only("null"), checks=((sub, True),))]
    return self._unevaluated(sub, branches)

  def _atoms(self, sub: Sub) -> Conj:
    """What the keywords of ``sub`` that are not in-place applicators ask, as one conjunction."""
    s, rank = sub.schema, self.doc.rank
    out: dict = {"checks": ((sub, True),)}
    if "type" in s:
      types = [s["type"]] if isinstance(s["type"], str) else list(s["type"])
      kinds = {"number" if t == "integer" else t for t in types}
      out["kinds"] = frozenset(kinds) & KINDS
      if "integer" in types and "number" not in types:
        out["number"] = NumberSpec(integer=True)
    elif "enum" not in s and "const" not in s:
      implied = frozenset(kind for kind, words in _FAMILIES.items() if any(w in s for w in words))
      out["implied"] = implied
    values = None
    if "enum" in s:
      values = tuple(s["enum"])
    if "const" in s and rank >= 1:
      same = value_key(s["const"])
      values = (s["const"],) if values is None else tuple(v for v in values if value_key(v) == same)
    out["values"] = values
    low, low_open = numbers.bound(s, "minimum", "exclusiveMinimum", max)
    high, high_open = numbers.bound(s, "maximum", "exclusiveMaximum", min)
    number = out.get("number", NumberSpec())
    steps = (exact(s["multipleOf"]),) if "multipleOf" in s else ()
    out["number"] = dataclasses.replace(number, low=low, low_open=low_open, high=high, high_open=high_open, steps=steps)
    out["min_length"] = int(s.get("minLength", 0))
    out["max_length"] = None if "maxLength" not in s else int(s["maxLength"])
    out["patterns"] = (s["pattern"],) if "pattern" in s else ()
    if s.get("format") in formats.FORMATS:
      out["formats"] = ((s["format"], sub.path),)
    evaluated = Evaluated()
    items, evaluated = self.items(sub, evaluated)
    out["items"] = items
    out["min_items"] = int(s.get("minItems", 0))
    out["max_items"] = None if "maxItems" not in s else int(s["maxItems"])
    if s.get("uniqueItems") is True:
      out["unique"] = (sub.path + ("uniqueItems",),)
    if "contains" in s and rank >= 1:
      low = int(s.get("minContains", 1)) if rank >= 3 else 1
      high = None if rank < 3 or "maxContains" not in s else int(s["maxContains"])
      lits = ((self.child(sub, s["contains"], "contains"), True),)
      if low or high is not None:
        out["contains"] = (Contains(lits, low, high),)
      if rank >= 4:
        evaluated = evaluated | Evaluated(contains=(lits,))
    properties = s.get("properties", {})
    patterns = s.get("patternProperties", {})
    out["properties"] = tuple((n, ((self.child(sub, v, "properties", n), True),)) for n, v in properties.items())
    rules = [
      KeyRule(Keys(patterns=(p,)), ((self.child(sub, v, "patternProperties", p), True),), True)
      for p, v in patterns.items()
    ]
    if "additionalProperties" in s:
      extra = s["additionalProperties"]
      keys = Keys(names=frozenset(properties), patterns=tuple(patterns), negated=True)
      written = extra is not False and not asks_nothing(extra)
      rules.append(KeyRule(keys, ((self.child(sub, extra, "additionalProperties"), True),), written))
    out["rules"] = tuple(rules)
    evaluated = evaluated | Evaluated(
      names=frozenset(properties), patterns=tuple(patterns), properties="additionalProperties" in s
    )
    out["required"] = tuple(dict.fromkeys(s.get("required", [])))
    out["min_properties"] = int(s.get("minProperties", 0))
    out["max_properties"] = None if "maxProperties" not in s else int(s["maxProperties"])
    if "propertyNames" in s and rank >= 1:
      out["names"] = (((self.child(sub, s["propertyNames"], "propertyNames"), True),),)
    out["evaluated"] = evaluated
    return Conj(**out)

  def items(self, sub: Sub, evaluated: Evaluated):
    """``(items rules, evaluated)``: per position, what the items of an array must satisfy."""
    s, rank = sub.schema, self.doc.rank
    rules = []
    prefix = s.get("prefixItems") if rank >= 4 else s.get("items") if isinstance(s.get("items"), list) else None
    word = "prefixItems" if rank >= 4 else "items"
    if prefix is not None:
      for i, item in enumerate(prefix):
        rules.append((i, i + 1, ((self.child(sub, item, word, str(i)), True),)))
      evaluated = evaluated | Evaluated(prefix=len(prefix))
    rest, rest_word = (s.get("items"), "items") if rank >= 4 or prefix is None else (None, None)
    if prefix is not None and rank < 4:
      rest, rest_word = s.get("additionalItems"), "additionalItems"
    if rest is not None and not isinstance(rest, list):
      rules.append((len(prefix or ()), None, ((self.child(sub, rest, rest_word), True),)))
      evaluated = evaluated | Evaluated(items=True)
    return tuple(rules), evaluated

  def _applicators(self, sub: Sub):
    """``(keyword, alternatives)`` of each in-place applicator of ``sub``."""
    s, rank = sub.schema, self.doc.rank
    for i, part in enumerate(s.get("allOf", ())):
      yield "allOf", self.positive(self.child(sub, part, "allOf", str(i)))
    if "anyOf" in s:
      parts = [self.child(sub, part, "anyOf", str(i)) for i, part in enumerate(s["anyOf"])]
      yield "anyOf", [c for part in parts for c in self.positive(part)]
    if "oneOf" in s:
      parts = [self.child(sub, part, "oneOf", str(i)) for i, part in enumerate(s["oneOf"])]
      yield "oneOf", self.one_of(sub, parts)
    if "not" in s:
      yield "not", self.negative(self.child(sub, s["not"], "not"))
    if rank >= 2 and "if" in s and ("then" in s or "else" in s or self.doc.unevaluated):
      condition = self.child(sub, s["if"], "if")
      then = self.positive(self.child(sub, s["then"], "then")) if "then" in s else [_TRIVIAL]
      otherwise = self.positive(self.child(sub, s["else"], "else")) if "else" in s else [_TRIVIAL]
      yield (
        "if",
        (
          self.product(self.positive(condition), then, sub.path + ("then",))
          + self.product(self.negative(condition), otherwise, sub.path + ("else",))
        ),
      )
    for word, name, need in self._dependencies(sub):
      absent = Conj(properties=((name, ((self.false(sub, word, name), True),)),))
      present = Conj(required=(name,))
      if isinstance(need, list):
        yield word, [absent, Conj(required=(name, *need))]
      else:
        yield word, [absent] + self.product([present], self.positive(self.child(sub, need, word, name)), sub.path)

  def _dependencies(self, sub: Sub):
    """``(keyword, property, names it requires or a subschema)`` of the draft's dependency keywords."""
    s, rank = sub.schema, self.doc.rank
    if rank <= 2:
      for name, need in s.get("dependencies", {}).items():
        yield "dependencies", name, need
    else:
      for name, need in s.get("dependentRequired", {}).items():
        yield "dependentRequired", name, list(need)
      for name, need in s.get("dependentSchemas", {}).items():
        yield "dependentSchemas", name, need

  def _unevaluated(self, sub: Sub, branches: list[Conj]) -> list[Conj]:
    """Each alternative with ``sub``'s unevaluated rules, over what that alternative evaluates."""
    s = sub.schema
    if self.doc.rank < 3:
      return branches
    for word, flag in (("unevaluatedProperties", "properties"), ("unevaluatedItems", "items")):
      if word in s:
        lits = ((self.child(sub, s[word], word), True),)
        field = "unevaluated_" + flag
        branches = [
          dataclasses.replace(
            b,
            **{field: getattr(b, field) + ((b.evaluated, lits),)},
            evaluated=b.evaluated | Evaluated(**{flag: True}),
          )
          for b in branches
        ]
    return branches

  # ----------------------------------------------------------------------------------------- negative

  def _negative(self, sub: Sub) -> list[Conj]:
    schema, rank = sub.schema, self.doc.rank
    if schema is True:
      return []
    if schema is False:
      return [_TRIVIAL]
    if "$ref" in schema and rank <= 2:
      target = self.follow(sub, schema["$ref"])
      return [] if target is None else self.negative(target)
    out = complements.atoms(self, sub)
    if "$ref" in schema:
      target = self.follow(sub, schema["$ref"])
      out += [] if target is None else self.negative(target)
    out += complements.applicators(self, sub)
    if schema.get("nullable") is True:  # not (S or null) = not S and not null
      out = self.product(out, [Conj(kinds=KINDS - {"null"})], sub.path) if out else []
    return out
