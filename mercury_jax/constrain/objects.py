"""JSON objects as byte automata: ``{`` members ``}``, the listed properties first (in the schema's order, the
required ones always), then further members whose names come from a partition of the other names.

Every rule on names (a ``patternProperties`` pattern, the names ``additionalProperties`` and
``unevaluatedProperties`` see as additional, ``propertyNames``) is a regular language of names, so the names that
are not listed are split exactly into parts on which the same rules apply; each part's values satisfy all of them.
A part is written when a rule asks for such members (a pattern, or an explicit schema of additional or unevaluated
properties), or when the object lists nothing (a map). A rule's names are read generously where the rule constrains
values (a name either reading of a pattern finds gets its schema) and strictly where it lets a value be anything.
``minProperties``/``maxProperties`` and the members a complement asks for (a name the pattern finds whose value
fails its schema) are counted along the way: a graph of (listed property, counts) nodes whose edges are members.
Further members may repeat a name; those ``minProperties`` needs have names of distinct lengths.
"""

from __future__ import annotations

import dataclasses
import itertools

from mercury_jax.constrain import chains, fsa, patterns, strings
from mercury_jax.constrain.document import dumps
from mercury_jax.constrain.normal import Conj, Evaluated, KeyRule, Keys, asks_nothing

MAX_NODES = 4096  # (listed property, counts) nodes of an object's graph.
MAX_PARTS = 64  # Parts the names that are not listed may be split into.
MAX_NAME_LENGTH = 64  # Further members counted toward minProperties have names of distinct lengths up to this.
OPEN, CLOSE, COMMA, COLON = (fsa.literal(t) for t in "{},:")


@dataclasses.dataclass(frozen=True)
class _Part:
  names: fsa.Dfa  # value-level names
  lits: tuple
  written: bool


def key_set(keys: Keys, wide: bool, builder) -> fsa.Dfa:
  """The names of ``keys`` (value-level); ``wide``: as either reading of its patterns finds them."""
  found = builder.keys.get((keys, wide))
  if found is None:
    found = builder.keys[keys, wide] = _key_set(keys, wide, builder)
  return found


def _key_set(keys: Keys, wide: bool, builder) -> fsa.Dfa:
  budget = builder.budget
  if keys.negated:
    return fsa.difference(strings.ANY_STRING, key_set(dataclasses.replace(keys, negated=False), not wide, builder))
  if keys.strings:
    return builder.string_values(keys.strings)
  if keys.everything:
    return strings.ANY_STRING
  parts = [chains.words(keys.names, budget)] if keys.names else []
  parts += [patterns.search(p, budget, wide=wide) for p in keys.patterns]
  return chains.union(parts, budget)


def _uneval_rules(c: Conj) -> list[KeyRule]:
  out = []
  for evaluated, lits in c.unevaluated_properties:
    keys = Keys(evaluated.names, evaluated.patterns, evaluated.properties, negated=True)
    (sub, _), *_ = lits
    out.append(KeyRule(keys, lits, sub.schema is not False and not asks_nothing(sub.schema)))
  return out


def _evaluates(evaluated: Evaluated, name: str, builder) -> bool:
  """Whether ``name`` is surely evaluated (by both readings of the patterns)."""
  if evaluated.properties or name in evaluated.names:
    return True
  return any(patterns.search(p, builder.budget).accepts(name) for p in evaluated.patterns)


def language(c: Conj, builder) -> fsa.Dfa:
  """The objects ``c`` allows (module docstring); ``builder`` gives the languages of literals."""
  budget = builder.budget
  listed = dict(c.properties)
  for name in c.required:
    listed.setdefault(name, ())
  rules = list(c.rules) + _uneval_rules(c)
  allowed = strings.ANY_STRING
  for lits in c.names:
    allowed = fsa.intersect(allowed, builder.string_values(lits), budget)
  members = []  # (name, member language, required)
  optional = builder.narrowing.optional
  if optional is not None and len(listed) - len(set(c.required)) > optional:
    kept = [name for name in listed if name not in c.required][:optional]
    listed = {name: lits for name, lits in listed.items() if name in c.required or name in kept}
    where = _path(c)
    builder.narrowed(where, f"only the first {optional} optional properties at {where} are written")
  for name, lits in listed.items():
    lits = lits + tuple(lit for rule in rules if key_set(rule.keys, True, builder).accepts(name) for lit in rule.lits)
    for evaluated, rule_lits in c.unevaluated_properties:
      if not _evaluates(evaluated, name, builder):
        lits += rule_lits
    value = builder.lang(lits) if allowed.accepts(name) else fsa.NOTHING
    required = name in c.required
    if value.empty and required:
      builder.note(f"required property {name!r} can have no value (or its name is not allowed)", ())
      return fsa.NOTHING
    if not value.empty:
      members.append((name, chains.concat([fsa.literal(dumps(name) + ":"), value], budget), required))
  parts = _parts(
    fsa.difference(allowed, chains.words(dict(c.properties) | dict.fromkeys(c.required), budget)), rules, builder
  )
  is_map = not members and not any(rule.written for rule in rules)
  shown = [p for p in parts if p.written or is_map]
  free = chains.union([_member(p.names, p.lits, builder) for p in shown], budget)
  distinct = _distinct(shown, c.min_properties, builder) if not (free.empty or c.exists) else []
  witnesses = []
  for need in c.exists:
    names = key_set(need.keys, False, builder)
    options = [_member(fsa.intersect(p.names, names, budget), p.lits + need.lits, builder) for p in parts]
    witnesses.append(chains.union(options, budget))
  return chains.concat([OPEN, _body(c, members, free, distinct, witnesses, builder), CLOSE], budget)


def _path(c: Conj) -> str:
  """Where the first subschema ``c`` was made of that lists properties stands (for the warning line)."""
  for sub, _ in c.checks:
    if isinstance(sub.schema, dict) and "properties" in sub.schema:
      return ".".join(sub.path + ("properties",))
  return "(root)"


def _distinct(parts: list[_Part], low: int, builder) -> list[fsa.Dfa]:
  """Further members with names of distinct lengths (so surely distinct names), shortest first (the empty name
  last), as many as ``minProperties`` could need (none below two: one further member needs no other). Not used
  with witnesses (their names could repeat one of these)."""
  if low < 2:
    return []
  names = chains.union([p.names for p in parts], builder.budget)
  out = []
  for length in [*range(1, MAX_NAME_LENGTH + 1), 0]:  # the empty name last
    sized = chains.repeat(fsa.ANY_CHAR, length, length, builder.budget)
    if fsa.disjoint(names, sized):
      continue
    out.append(chains.union([_member(fsa.intersect(p.names, sized, builder.budget), p.lits, builder) for p in parts]))
    if out[-1].empty:
      out.pop()
    if len(out) == low:
      break
  return out


def _member(names: fsa.Dfa, lits: tuple, builder) -> fsa.Dfa:
  if names.empty:
    return fsa.NOTHING
  value = builder.lang(lits)
  if value.empty:
    return fsa.NOTHING
  return chains.concat([strings.quoted(strings.escape(names), builder.budget), COLON, value], builder.budget)


def _parts(names: fsa.Dfa, rules: list[KeyRule], builder) -> list[_Part]:
  """The names split by the rules (module docstring)."""
  parts = [_Part(names, (), False)] if not names.empty else []
  for rule in rules:
    inside = key_set(rule.keys, True, builder)
    split = []
    for part in parts:
      within = fsa.intersect(part.names, inside, builder.budget)
      if not within.empty:
        split.append(_Part(within, part.lits + rule.lits, part.written or rule.written))
      outside = fsa.difference(part.names, inside, builder.budget)
      if not outside.empty:
        split.append(_Part(outside, part.lits, part.written))
    parts = split
    if len(parts) > MAX_PARTS:
      raise fsa.TooLarge(len(parts) * 8)
  return parts


def _body(c: Conj, members: list, free: fsa.Dfa, distinct: list[fsa.Dfa], witnesses: list[fsa.Dfa], builder) -> fsa.Dfa:
  """The members between the braces: a graph over (listed member, listed count, further count, witnesses).

  Further members may repeat a name (the last one counts), so they count once toward ``minProperties``, save those
  written from ``distinct`` (the k-th from ``distinct[k]``) while the listed ones and they fall two or more short.
  """
  low, high = c.min_properties, c.max_properties
  if high is not None and high < low:
    builder.note(f"minProperties={low} is above maxProperties={high}", ())
    return fsa.NOTHING
  counting = bool(low) or high is not None
  listed_cap = max(low, 0 if high is None else high + 1) if counting else 1
  free_cap = (max(1, len(distinct)) if high is None else high + 1) if counting else 1
  n = len(members)
  if (n + 1) * (listed_cap + 1) * (free_cap + 1) * 2 ** len(witnesses) > MAX_NODES:
    raise fsa.TooLarge((n + 1) * (listed_cap + 1) * (free_cap + 1))
  comma_free = chains.concat([COMMA, free], builder.budget) if not free.empty else fsa.NOTHING
  comma = {}
  edges = []
  flags_all = list(itertools.product((0, 1), repeat=len(witnesses)))
  for listed_n in range(listed_cap + 1):
    for free_n in range(free_cap + 1):
      for flags in flags_all:
        written = listed_n > 0 or free_n > 0
        for j, (_, member, required) in enumerate(members):
          source = (j, listed_n, free_n, flags)
          if free_n:
            continue  # further members come after the listed ones
          if written and id(member) not in comma:
            comma[id(member)] = chains.concat([COMMA, member], builder.budget)
          text = comma[id(member)] if written else member
          edges.append((source, (j + 1, min(listed_n + 1, listed_cap), 0, flags), text))
          if not required:
            edges.append((source, (j + 1, listed_n, 0, flags), None))
        source = (n, listed_n, free_n, flags)
        after = min(free_n + 1, free_cap)
        if low - listed_n >= 2 and free_n < len(distinct):
          text = chains.concat([COMMA, distinct[free_n]], builder.budget) if written else distinct[free_n]
        else:
          text = comma_free if written else free
        edges.append((source, (n, listed_n, after, flags), text))
        for k, witness in enumerate(witnesses):
          raised = tuple(1 if i == k else f for i, f in enumerate(flags))
          text = chains.concat([COMMA, witness], builder.budget) if written else witness
          edges.append((source, (n, listed_n, after, raised), text))
  finals = []
  for listed_n in range(listed_cap + 1):
    for free_n in range(free_cap + 1):
      named = listed_n + min(free_n, len(distinct) if low - listed_n >= 2 else 1)
      total = listed_n + free_n
      if counting and (named < low or (high is not None and total > high)):
        continue
      finals.append((n, listed_n, free_n, tuple(1 for _ in witnesses)))
  return chains.graph((0, 0, 0, tuple(0 for _ in witnesses)), finals, edges, builder.budget)
