"""JSON arrays as byte automata: ``[`` items ``]``, each item's language set by its position (``prefixItems``,
``items``, ``additionalItems``), split into the items that match each ``contains`` and those that do not (counted
between ``minContains`` and ``maxContains``), with the unevaluated items satisfying ``unevaluatedItems``; a graph
whose nodes are (position, counts) and whose edges are items. ``uniqueItems`` over a finite set of values lists
the arrangements (an automaton cannot remember an unbounded set of earlier items).
"""

from __future__ import annotations

import itertools
import math

from mercury_jax.constrain import chains, fsa, patterns, regexes
from mercury_jax.constrain.document import dumps
from mercury_jax.constrain.errors import ConstraintError
from mercury_jax.constrain.normal import Conj, Evaluated, value_key

MAX_ENUMERATED = 256  # Values (or unique arrays) a regex lists one by one.
MAX_UNIQUE = 64  # Distinct values the items of a uniqueItems array may take.
MAX_NODES = 4096  # (position, counts) nodes of an array's graph.
LONG_ARRAY = 64  # A larger maxItems is written as at most this many items (each position is a copy of the item).
OPEN, CLOSE, COMMA = fsa.literal("["), fsa.literal("]"), fsa.literal(",")


def _applies(evaluated: Evaluated, position: int, matched: tuple) -> bool:
  """Whether the item at ``position``, matching the ``contains`` literals ``matched``, is evaluated."""
  return evaluated.items or position < evaluated.prefix or any(lits in evaluated.contains for lits in matched)


def language(c: Conj, builder) -> fsa.Dfa:
  """The arrays ``c`` allows (module docstring); ``builder`` gives the languages of literals."""
  low, high = c.min_items, c.max_items
  if high is not None and high < low:
    builder.note(f"minItems={low} is above maxItems={high}", ())
    return fsa.NOTHING
  high = builder.capped(high, low, builder.narrowing.long_array, c, "maxItems")
  if c.unique and (high is None or high > 1):
    try:
      return _unique(c, builder)
    except ConstraintError:
      if not builder.narrowing.unique_one or low > 1:
        raise
      where = ".".join(c.unique[0]) or "(root)"
      builder.narrowed(where, f"uniqueItems at {where} is written as arrays of at most one item")
      high = 1  # one item is always unique
  ends = {0, low} | {e for s, e, _ in c.items if e is not None} | {s for s, _, _ in c.items}
  ends |= {k.start for k in c.contains} | {e.prefix for e, _ in c.unevaluated_items}
  last = max(ends) + 1 if high is None else high  # positions before ``last`` are their own node
  caps = [max(k.low, 0 if k.high is None else k.high + 1) for k in c.contains]
  if (last + 1) * math.prod(cap + 1 for cap in caps) > MAX_NODES:
    raise fsa.TooLarge((last + 1) * math.prod(cap + 1 for cap in caps))
  edges = []
  for position in range(last if high is not None else last + 1):
    base = tuple(lit for s, e, lits in c.items if s <= position and (e is None or position < e) for lit in lits)
    node_next = position + 1 if high is not None or position < last else last
    active = [i for i, k in enumerate(c.contains) if position >= k.start]
    for matches in itertools.product((True, False), repeat=len(active)):
      lits = list(base)
      matched = []
      for i, hit in zip(active, matches, strict=True):
        lits += [(sub, positive if hit else not positive) for sub, positive in c.contains[i].lits]
        if hit:
          matched.append(c.contains[i].lits)
      for evaluated, rule in c.unevaluated_items:
        if not _applies(evaluated, position, tuple(matched)):
          lits += list(rule)
      item = builder.lang(tuple(lits))
      if item.empty:
        continue
      item = chains.concat([COMMA, item], builder.budget) if position else item
      for counts in itertools.product(*(range(cap + 1) for cap in caps)):
        after = list(counts)
        for i, hit in zip(active, matches, strict=True):
          after[i] = min(after[i] + hit, caps[i])
        edges.append(((position, counts), (node_next, tuple(after)), item))
  finals = [
    (position, counts)
    for position in range(low, (last if high is None else high) + 1)
    for counts in itertools.product(*(range(cap + 1) for cap in caps))
    if all(k.low <= n and (k.high is None or n <= k.high) for k, n in zip(c.contains, counts, strict=True))
  ]
  start = (0, tuple(0 for _ in caps))
  body = chains.graph(start, finals, edges, builder.budget)
  if body.empty:
    builder.note("no array satisfies items, minItems, maxItems and contains together", ())
  return chains.concat([OPEN, body, CLOSE], builder.budget)


def _unique(c: Conj, builder) -> fsa.Dfa:
  """``uniqueItems`` over items from a finite set (module docstring)."""
  where = ".".join(c.unique[0]) or None
  if any(s != 0 or e is not None for s, e, _ in c.items) or c.contains or c.unevaluated_items:
    raise ConstraintError(
      "'uniqueItems' is enforced only with one schema for every item (no prefixItems, contains or "
      "unevaluatedItems): drop one",
      param=where,
    )
  lits = tuple(lit for _, _, lits in c.items for lit in lits)
  domain = builder.domain(lits, MAX_UNIQUE)
  if domain is None:
    raise ConstraintError(
      f"'uniqueItems' is enforced only for items from a finite set of at most {MAX_UNIQUE} values (enum, const, "
      "boolean, null, integers with minimum and maximum): an automaton cannot remember an unbounded set of earlier "
      "items; restrict the items or drop uniqueItems",
      param=where,
    )
  low, high = c.min_items, c.max_items
  n = len(domain)
  high = n if high is None else min(high, n)
  if low > n:
    builder.note(f"minItems={low} is above the {n} distinct values the items can take", c.unique[0])
    return fsa.NOTHING
  texts = [regexes.escape(dumps(v)) for v in domain]
  if sum(math.perm(n, k) for k in range(low, high + 1)) <= MAX_ENUMERATED:
    regex = regexes.arrangements(texts, low, high, ordered=False)
  elif low <= 1 and high == n:
    firsts = [texts[i] + "".join(f"(?:,{t})?" for t in texts[i + 1 :]) for i in range(n)]
    regex = regexes.alternation(firsts, optional=low == 0)
  elif sum(math.comb(n, k) for k in range(low, high + 1)) <= MAX_ENUMERATED:
    regex = regexes.arrangements(texts, low, high, ordered=True)
  else:
    raise ConstraintError(
      f"'uniqueItems' over {n} values with minItems={low} and maxItems={high} leaves more than {MAX_ENUMERATED} "
      "arrays to list; widen minItems/maxItems to 0 or 1 and the number of values, or drop uniqueItems",
      param=where,
    )
  return patterns.full(r"\[" + regex + r"\]", builder.budget)


def distinct(values) -> list:
  """The values, the first of each group of equal ones (``1`` and ``1.0``)."""
  out = {}
  for value in values:
    out.setdefault(value_key(value), value)
  return list(out.values())
