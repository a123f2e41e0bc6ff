"""JSON strings as byte automata: the strings a schema allows (patterns searched, formats, lengths in characters,
excluded values: all intersected), then written as JSON text, inside quotes, every character as itself except
those JSON must escape, written in the short form ``json.dumps`` writes (``\\"``, ``\\\\``, ``\\n``, ``\\t``,
``\\r``, ``\\b``, ``\\f``). The other control characters (which only ``\\u00XX`` spells) are never written: each
costs four more states per character of a counted string, for characters a model has no use for.
"""

from __future__ import annotations

import functools

import numpy as np

from mercury_jax.constrain import chains, fsa, patterns
from mercury_jax.constrain.formats import FORMATS

_SHORT = {0x22: ord('"'), 0x5C: ord("\\"), 0x0A: ord("n"), 0x0D: ord("r"), 0x09: ord("t"), 0x08: ord("b")}
_SHORT[0x0C] = ord("f")
_ESCAPED = np.array(sorted(set(range(0x20)) | {0x22, 0x5C}))
ANY_STRING = chains.repeat(fsa.ANY_CHAR, 0, None)  # every string (UTF-8 text)
QUOTE = fsa.literal('"')


def escape(value: fsa.Dfa) -> fsa.Dfa:
  """The JSON text (between the quotes) of the strings ``value`` accepts (module docstring): each state that reads a
  character JSON must escape reads ``\\`` instead, then the escape's letter (one state of its own)."""
  table = value.table
  n = len(table)
  rows = np.flatnonzero((table[:, _ESCAPED] >= 0).any(axis=1))
  plain = table.copy()
  plain[:, _ESCAPED] = -1
  block = np.full((len(rows), fsa.ALPHABET), -1, np.int32)
  for byte, letter in _SHORT.items():
    block[:, letter] = table[rows, byte]
  reached = (block >= 0).any(axis=1)
  plain[rows[reached], ord("\\")] = n + np.arange(len(rows))[reached]
  accepting = np.concatenate([value.accepting, np.zeros(len(rows), bool)])
  out = fsa.minimize(fsa.from_table(np.concatenate([plain, block]), accepting))
  return fsa.sourced(out, ("escape", value))


JSON_CHAR = escape(fsa.ANY_CHAR)  # one character of a JSON string's text


def quoted(text: fsa.Dfa, budget: fsa.Budget = fsa.UNBOUNDED) -> fsa.Dfa:
  return chains.concat([QUOTE, text, QUOTE], budget)


@functools.lru_cache(maxsize=256)
def plain(low: int, high: int | None, budget: fsa.Budget) -> fsa.Dfa:
  """JSON strings of ``low`` to ``high`` characters, quotes included."""
  return quoted(chains.repeat(JSON_CHAR, low, high, budget), budget)


def values(
  low: int,
  high: int | None,
  searched: tuple[str, ...],
  not_searched: tuple[str, ...],
  formats: tuple[str, ...],
  *,
  excluded: tuple[str, ...],
  budget: fsa.Budget,
) -> fsa.Dfa | None:
  """The strings (UTF-8, unescaped) of ``low`` to ``high`` characters in which every pattern of ``searched`` finds
  a match and none of ``not_searched`` does, in every one of ``formats``, and not one of ``excluded``; None for
  every string of those lengths (no pattern, format or exclusion)."""
  if not (searched or not_searched or formats or excluded):
    return None
  parts = [patterns.full(FORMATS[name], budget) for name in formats]
  parts += [patterns.search(pattern, budget) for pattern in searched]
  out = parts[0] if parts else ANY_STRING
  for part in parts[1:]:
    out = fsa.intersect(out, part, budget)
  for pattern in not_searched:
    out = fsa.difference(out, patterns.search(pattern, budget, wide=True), budget)
  if excluded:
    out = fsa.difference(out, chains.union([fsa.literal(v) for v in excluded]), budget)
  if low or high is not None:
    out = fsa.intersect(out, chains.repeat(fsa.ANY_CHAR, low, high, budget), budget)
  return fsa.minimize(out)


def text(value: fsa.Dfa | None, low: int, high: int | None, budget: fsa.Budget) -> fsa.Dfa:
  """The JSON text of strings: ``value`` (from :func:`values`), quoted and escaped."""
  if value is None:
    return plain(low, high, budget)
  return quoted(escape(value), budget)
