"""Reads a document's subschemas, keyword by keyword, into alternatives (:mod:`~mercury_jax.constrain.normal`):
what each keyword asks, and what its complement asks (``not`` pushed down), per draft.
"""

from __future__ import annotations

import dataclasses

from mercury_jax.constrain import formats, numbers, oneof
from mercury_jax.constrain.document import Document, base_of
from mercury_jax.constrain.errors import ConstraintError
from mercury_jax.constrain.normal import (
  KINDS,
  Conj,
  Contains,
  Evaluated,
  Exists,
  KeyRule,
  Keys,
  Sub,
  asks_nothing,
  bounds_negated,
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


class Normalizer:
  """Reads subschemas of one document into alternatives (:mod:`~mercury_jax.constrain.normal`).

  Args:
    doc: The document.
    depth: Times a reference may be followed on one path (recursion is cut past it).
    note: Called with ``(message, path)`` when an alternative is found to accept nothing (the first such note
      explains a schema that accepts no value).
  """

  def __init__(self, doc: Document, depth: int, note):
    self.doc, self.depth, self.note = doc, depth, note
    self.cuts: dict[str, tuple] = {}  # $ref -> the path where it first recurs
    self.recursed = False
    self._cache: dict[tuple, list[Conj]] = {}

  # ----------------------------------------------------------------------------------------- combining

  def product(self, left: list[Conj], right: list[Conj], path: tuple) -> list[Conj]:
    """Every alternative of ``left`` with every one of ``right`` (those that share a kind of value)."""
    out = []
    for a in left:
      for b in right:
        c = merge(a, b)
        if c.kinds:
          out.append(c)
    if not out and left and right:
      self.note("its parts share no kind of value (their types exclude each other)", path)
    if len(out) > MAX_BRANCHES:
      raise ConstraintError(
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
    items, evaluated = self._items(sub, evaluated)
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

  def _items(self, sub: Sub, evaluated: Evaluated):
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
    out = self._negated_atoms(sub)
    if "$ref" in schema:
      target = self.follow(sub, schema["$ref"])
      out += [] if target is None else self.negative(target)
    out += self._negated_applicators(sub)
    if schema.get("nullable") is True:  # not (S or null) = not S and not null
      out = self.product(out, [Conj(kinds=KINDS - {"null"})], sub.path) if out else []
    return out

  def _negated_atoms(self, sub: Sub) -> list[Conj]:
    s, rank = sub.schema, self.doc.rank
    out = []
    if "type" in s:
      types = [s["type"]] if isinstance(s["type"], str) else list(s["type"])
      kinds = {"number" if t == "integer" else t for t in types}
      out.append(Conj(kinds=KINDS - kinds))
      if "integer" in types and "number" not in types:
        out.append(Conj(kinds=_only("number"), number=NumberSpec(fractional=True)))
    if "enum" in s:
      out.append(Conj(excluded=tuple(s["enum"])))
    if "const" in s and rank >= 1:
      out.append(Conj(excluded=(s["const"],)))
    low = numbers.bound(s, "minimum", "exclusiveMinimum", max)
    high = numbers.bound(s, "maximum", "exclusiveMaximum", min)
    for spec in bounds_negated(*low, *high):
      out.append(Conj(kinds=_only("number"), number=spec))
    if "multipleOf" in s:
      out.append(Conj(kinds=_only("number"), number=NumberSpec(not_steps=(exact(s["multipleOf"]),))))
    if int(s.get("minLength", 0)) > 0:
      out.append(Conj(kinds=_only("string"), max_length=int(s["minLength"]) - 1))
    if "maxLength" in s:
      out.append(Conj(kinds=_only("string"), min_length=int(s["maxLength"]) + 1))
    if "pattern" in s:
      out.append(Conj(kinds=_only("string"), not_patterns=(s["pattern"],)))
    if int(s.get("minItems", 0)) > 0:
      out.append(Conj(kinds=_only("array"), max_items=int(s["minItems"]) - 1))
    if "maxItems" in s:
      out.append(Conj(kinds=_only("array"), min_items=int(s["maxItems"]) + 1))
    out += self._negated_items(sub)
    if "contains" in s and rank >= 1:
      low = int(s.get("minContains", 1)) if rank >= 3 else 1
      high = None if rank < 3 or "maxContains" not in s else int(s["maxContains"])
      lits = ((self.child(sub, s["contains"], "contains"), True),)
      if low:
        out.append(Conj(kinds=_only("array"), contains=(Contains(lits, 0, low - 1),)))
      if high is not None:
        out.append(Conj(kinds=_only("array"), contains=(Contains(lits, high + 1, None),)))
    if int(s.get("minProperties", 0)) > 0:
      out.append(Conj(kinds=_only("object"), max_properties=int(s["minProperties"]) - 1))
    if "maxProperties" in s:
      out.append(Conj(kinds=_only("object"), min_properties=int(s["maxProperties"]) + 1))
    for name in dict.fromkeys(s.get("required", [])):
      out.append(Conj(kinds=_only("object"), properties=((name, ((self.false(sub, "required"), True),)),)))
    properties = s.get("properties", {})
    patterns = s.get("patternProperties", {})
    for name, value in properties.items():
      if value is not True:
        lits = ((self.child(sub, value, "properties", name), False),)
        out.append(Conj(kinds=_only("object"), required=(name,), properties=((name, lits),)))
    for pattern, value in patterns.items():
      if value is not True:
        lits = ((self.child(sub, value, "patternProperties", pattern), False),)
        out.append(Conj(kinds=_only("object"), exists=(Exists(Keys(patterns=(pattern,)), lits),)))
    extra = s.get("additionalProperties", True)
    if extra is not True:
      keys = Keys(names=frozenset(properties), patterns=tuple(patterns), negated=True)
      lits = ((self.child(sub, extra, "additionalProperties"), False),)
      out.append(Conj(kinds=_only("object"), exists=(Exists(keys, lits),)))
    if rank >= 1 and s.get("propertyNames", True) is not True:
      keys = Keys(strings=((self.child(sub, s["propertyNames"], "propertyNames"), False),))
      out.append(Conj(kinds=_only("object"), exists=(Exists(keys, ()),)))
    return out

  def _negated_items(self, sub: Sub) -> list[Conj]:
    """Arrays with an item that fails its position's schema."""
    out = []
    for start, end, lits in self._items(sub, Evaluated())[0]:
      ((item, _),) = lits
      if item.schema is True:
        continue
      if item.schema is False:
        out.append(Conj(kinds=_only("array"), min_items=start + 1))
      elif end is not None:
        rule = ((start, end, ((item, False),)),)
        out.append(Conj(kinds=_only("array"), min_items=end, items=rule))
      else:
        out.append(Conj(kinds=_only("array"), contains=(Contains(((item, False),), 1, None, start),)))
    return out

  def _negated_applicators(self, sub: Sub) -> list[Conj]:
    s, rank = sub.schema, self.doc.rank
    out = []
    for i, part in enumerate(s.get("allOf", ())):
      out += self.negative(self.child(sub, part, "allOf", str(i)))
    if "anyOf" in s:
      every = [_TRIVIAL]
      for i, part in enumerate(s["anyOf"]):
        every = self.product(every, self.negative(self.child(sub, part, "anyOf", str(i))), sub.path + ("anyOf",))
      out += every
    if "oneOf" in s:
      parts = [self.child(sub, part, "oneOf", str(i)) for i, part in enumerate(s["oneOf"])]
      none = [_TRIVIAL]
      for part in parts:
        none = self.product(none, self.negative(part), sub.path + ("oneOf",))
      out += none
      for i, a in enumerate(parts):
        for b in parts[:i]:
          out += self.product(self.positive(a), self.positive(b), sub.path + ("oneOf",))
    if "not" in s:
      out += self.positive(self.child(sub, s["not"], "not"))
    if rank >= 2 and "if" in s:
      condition = self.child(sub, s["if"], "if")
      if "then" in s:
        out += self.product(self.positive(condition), self.negative(self.child(sub, s["then"], "then")), sub.path)
      if "else" in s:
        out += self.product(self.negative(condition), self.negative(self.child(sub, s["else"], "else")), sub.path)
    for word, name, need in self._dependencies(sub):
      present = Conj(kinds=_only("object"), required=(name,))
      if isinstance(need, list):
        false = ((self.false(sub, word, name), True),)
        out += [Conj(kinds=_only("object"), required=(name,), properties=((n, false),)) for n in need]
      else:
        out += self.product([present], self.negative(self.child(sub, need, word, name)), sub.path)
    return out
