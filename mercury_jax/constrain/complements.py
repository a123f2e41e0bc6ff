"""What the complement of a subschema asks (``not``, the other branches of ``oneOf``, ``if`` that fails), keyword
by keyword: the complement of a conjunction is the union of its keywords' complements (De Morgan), each asking only
of the kind of value the keyword applies to (the complement of ``minimum`` is the numbers below it; a string passes
``minimum``). Where a complement is not regular (``uniqueItems``: two equal items; ``unevaluated*``: what other
keywords evaluate) or is empty (``format``, an annotation), it adds no alternative: every alternative kept is within
the complement, so what is written stays valid.
"""

from __future__ import annotations

from mercury_jax.constrain import numbers
from mercury_jax.constrain.normal import KINDS, Conj, Contains, Evaluated, Exists, Keys, Sub, bounds_negated
from mercury_jax.constrain.numbers import NumberSpec, exact

_TRIVIAL = Conj()


def _only(*kinds: str) -> frozenset:
  return frozenset(kinds)


def atoms(reader, sub: Sub) -> list[Conj]:
  s, rank = sub.schema, reader.doc.rank
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
  out += _items(reader, sub)
  if "contains" in s and rank >= 1:
    low = int(s.get("minContains", 1)) if rank >= 3 else 1
    high = None if rank < 3 or "maxContains" not in s else int(s["maxContains"])
    lits = ((reader.child(sub, s["contains"], "contains"), True),)
    if low:
      out.append(Conj(kinds=_only("array"), contains=(Contains(lits, 0, low - 1),)))
    if high is not None:
      out.append(Conj(kinds=_only("array"), contains=(Contains(lits, high + 1, None),)))
  if int(s.get("minProperties", 0)) > 0:
    out.append(Conj(kinds=_only("object"), max_properties=int(s["minProperties"]) - 1))
  if "maxProperties" in s:
    out.append(Conj(kinds=_only("object"), min_properties=int(s["maxProperties"]) + 1))
  for name in dict.fromkeys(s.get("required", [])):
    out.append(Conj(kinds=_only("object"), properties=((name, ((reader.false(sub, "required"), True),)),)))
  properties = s.get("properties", {})
  patterns = s.get("patternProperties", {})
  for name, value in properties.items():
    if value is not True:
      lits = ((reader.child(sub, value, "properties", name), False),)
      out.append(Conj(kinds=_only("object"), required=(name,), properties=((name, lits),)))
  for pattern, value in patterns.items():
    if value is not True:
      lits = ((reader.child(sub, value, "patternProperties", pattern), False),)
      out.append(Conj(kinds=_only("object"), exists=(Exists(Keys(patterns=(pattern,)), lits),)))
  extra = s.get("additionalProperties", True)
  if extra is not True:
    keys = Keys(names=frozenset(properties), patterns=tuple(patterns), negated=True)
    lits = ((reader.child(sub, extra, "additionalProperties"), False),)
    out.append(Conj(kinds=_only("object"), exists=(Exists(keys, lits),)))
  if rank >= 1 and s.get("propertyNames", True) is not True:
    keys = Keys(strings=((reader.child(sub, s["propertyNames"], "propertyNames"), False),))
    out.append(Conj(kinds=_only("object"), exists=(Exists(keys, ()),)))
  return out


def _items(reader, sub: Sub) -> list[Conj]:
  """Arrays with an item that fails its position's schema."""
  out = []
  for start, end, lits in reader.items(sub, Evaluated())[0]:
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


def applicators(reader, sub: Sub) -> list[Conj]:
  s, rank = sub.schema, reader.doc.rank
  out = []
  for i, part in enumerate(s.get("allOf", ())):
    out += reader.negative(reader.child(sub, part, "allOf", str(i)))
  if "anyOf" in s:
    every = [_TRIVIAL]
    for i, part in enumerate(s["anyOf"]):
      every = reader.product(every, reader.negative(reader.child(sub, part, "anyOf", str(i))), sub.path + ("anyOf",))
    out += every
  if "oneOf" in s:
    parts = [reader.child(sub, part, "oneOf", str(i)) for i, part in enumerate(s["oneOf"])]
    none = [_TRIVIAL]
    for part in parts:
      none = reader.product(none, reader.negative(part), sub.path + ("oneOf",))
    out += none
    for i, a in enumerate(parts):
      for b in parts[:i]:
        out += reader.product(reader.positive(a), reader.positive(b), sub.path + ("oneOf",))
  if "not" in s:
    out += reader.positive(reader.child(sub, s["not"], "not"))
  if rank >= 2 and "if" in s:
    condition = reader.child(sub, s["if"], "if")
    if "then" in s:
      out += reader.product(reader.positive(condition), reader.negative(reader.child(sub, s["then"], "then")), sub.path)
    if "else" in s:
      out += reader.product(reader.negative(condition), reader.negative(reader.child(sub, s["else"], "else")), sub.path)
  for word, name, need in reader._dependencies(sub):
    present = Conj(kinds=_only("object"), required=(name,))
    if isinstance(need, list):
      false = ((reader.false(sub, word, name), True),)
      out += [Conj(kinds=_only("object"), required=(name,), properties=((n, false),)) for n in need]
    else:
      out += reader.product([present], reader.negative(reader.child(sub, need, word, name)), sub.path)
  return out
