"""JSON Schema's regular expressions (``pattern``, ``patternProperties``, string ``format``s) as byte automata of
the strings they accept: :func:`search` (JSON Schema searches: a match anywhere, unless anchored) and
:func:`full` (the whole string, for the compiler's own regexes).

The pattern is parsed by Python's own parser (``re._parser``: what jsonschema checks with), and read so that a
string written matches both as ECMA-262 (what the specification names) and as Python's ``re`` reads it: where the
two differ, the automaton takes what both accept (``\\d`` is ``[0-9]``, ``\\w`` ``[A-Za-z0-9_]``, ``.`` no line
terminator of either, ``$`` the end only). A pattern used as a complement (``not``, keys that match no pattern) is
read the other way, as anything either accepts, so that what the complement writes matches under neither.

Anchors (``^``, ``$``) may begin and end the pattern or each of its top-level alternatives (also inside a group
that is the whole pattern); elsewhere, and look-arounds, backreferences, word boundaries, possessive repeats and
multi-line mode, are refused: one line naming the construct.
"""

from __future__ import annotations

import functools
import re
import sys
import unicodedata
import warnings
from re import _constants as sre, _parser as sre_parse

from mercury_jax.constrain import chains, fsa, utf8
from mercury_jax.constrain.errors import ConstraintError

ALL = ((0, utf8.MAX_CODE_POINT),)
_EVERYTHING = [
  {sre.CATEGORY_DIGIT, sre.CATEGORY_NOT_DIGIT},
  {sre.CATEGORY_WORD, sre.CATEGORY_NOT_WORD},
  {sre.CATEGORY_SPACE, sre.CATEGORY_NOT_SPACE},
]
_LINE_ENDS_NARROW = ((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))  # what ECMA's or Python's . refuses


class PatternError(Exception):
  """A construct the automaton cannot express (the message says which)."""


@functools.cache
def _scan(test) -> tuple[tuple[int, int], ...]:
  ranges: list[list[int]] = []
  for code in range(utf8.MAX_CODE_POINT + 1):
    if 0xD800 <= code <= 0xDFFF:
      continue
    if test(chr(code)):
      if ranges and ranges[-1][1] == code - 1:
        ranges[-1][1] = code
      else:
        ranges.append([code, code])
  return tuple((a, b) for a, b in ranges)


def _python_digit() -> tuple:
  return _scan(str.isdecimal)


def _python_word() -> tuple:
  return _scan(lambda c: c.isalnum() or c == "_")


def _python_space() -> tuple:
  return _scan(str.isspace)


_ECMA_SPACE = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029))
_ECMA_SPACE += ((0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF))


def _category(name, wide: bool) -> tuple:
  """Code point ranges of a class escape, as both readings accept (narrow) or as either does (wide)."""
  if name is sre.CATEGORY_DIGIT:
    return _python_digit() if wide else ((0x30, 0x39),)
  if name is sre.CATEGORY_NOT_DIGIT:
    return utf8.complement_ranges(_category(sre.CATEGORY_DIGIT, not wide))
  if name is sre.CATEGORY_WORD:
    return _python_word() if wide else ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
  if name is sre.CATEGORY_NOT_WORD:
    return utf8.complement_ranges(_category(sre.CATEGORY_WORD, not wide))
  if name is sre.CATEGORY_SPACE:
    python = set(_python_space())
    if wide:
      return utf8.normalize_ranges(python | set(_ECMA_SPACE))
    both = [r for r in _ECMA_SPACE if all(_in(python, c) for c in range(r[0], r[1] + 1))]
    return utf8.normalize_ranges(both)
  if name is sre.CATEGORY_NOT_SPACE:
    return utf8.complement_ranges(_category(sre.CATEGORY_SPACE, not wide))
  raise PatternError(f"the class {name} is not supported")


def _in(ranges, code: int) -> bool:
  return any(a <= code <= b for a, b in ranges)


def _cased(code: int) -> list[int]:
  """An ASCII letter and its other case (what every reading of case-insensitive matching agrees on)."""
  char = chr(code)
  if char.isascii() and char.isalpha():
    return [ord(char.lower()), ord(char.upper())]
  return [code]


class _Reader:
  """Builds automata from Python's parse tree (module docstring)."""

  def __init__(self, budget: fsa.Budget, wide: bool):
    self.budget, self.wide = budget, wide

  def ranges(self, op, value, ignore_case: bool, dot_all: bool, wide: bool) -> tuple:
    if op is sre.LITERAL:
      codes = _cased(value) if ignore_case else [value]
      if ignore_case and wide and len(codes) == 1 and chr(value).lower() != chr(value).upper():
        raise PatternError("a case-insensitive non-ASCII letter cannot be complemented exactly")
      return utf8.normalize_ranges((c, c) for c in codes)
    if op is sre.NOT_LITERAL:
      return utf8.complement_ranges(self.ranges(sre.LITERAL, value, ignore_case, dot_all, not wide))
    if op is sre.ANY:
      if dot_all:
        return ALL
      return utf8.complement_ranges(((0x0A, 0x0A),) if wide else _LINE_ENDS_NARROW)
    if op is sre.RANGE:
      low, high = value
      out = [(low, high)]
      if ignore_case:
        for code in range(max(low, 0x41), min(high, 0x7A) + 1):
          out += [(c, c) for c in _cased(code)]
        if wide and any(chr(c).lower() != chr(c).upper() and not chr(c).isascii() for c in range(low, high + 1)):
          raise PatternError("a case-insensitive non-ASCII range cannot be complemented exactly")
      return utf8.normalize_ranges(out)
    if op is sre.CATEGORY:
      return _category(value, wide)
    if op is sre.IN:
      items = list(value)
      negate = bool(items) and items[0][0] is sre.NEGATE
      if negate:
        items = items[1:]
      inner = wide != negate  # a negated class reads its members the other way
      categories = {v for o, v in items if o is sre.CATEGORY}
      if any(pair <= categories for pair in _EVERYTHING):
        return () if negate else ALL  # [\s\S]: every character, in any reading
      out = []
      for item_op, item_value in items:
        out += self.ranges(item_op, item_value, ignore_case, dot_all, inner)
      return utf8.complement_ranges(out) if negate else utf8.normalize_ranges(out)
    raise PatternError(f"{op} inside a character class is not supported")

  def sequence(self, items, ignore_case: bool = False, dot_all: bool = False) -> fsa.Dfa:
    parts = [self.item(op, value, ignore_case, dot_all) for op, value in items]
    return chains.concat(parts, self.budget)

  def item(self, op, value, ignore_case: bool, dot_all: bool) -> fsa.Dfa:
    if op in (sre.LITERAL, sre.NOT_LITERAL, sre.ANY, sre.IN, sre.CATEGORY):
      return fsa.chars(self.ranges(op, value, ignore_case, dot_all, self.wide))
    if op is sre.BRANCH:
      return fsa.minimize(chains.union([self.sequence(b, ignore_case, dot_all) for b in value[1]], self.budget))
    if op is sre.SUBPATTERN:
      _, add, remove, items = value
      if (add | remove) & ~(sre.SRE_FLAG_IGNORECASE | sre.SRE_FLAG_DOTALL | sre.SRE_FLAG_UNICODE):
        raise PatternError("inline flags other than i and s are not supported")
      ignore_case = (ignore_case or bool(add & sre.SRE_FLAG_IGNORECASE)) and not remove & sre.SRE_FLAG_IGNORECASE
      dot_all = (dot_all or bool(add & sre.SRE_FLAG_DOTALL)) and not remove & sre.SRE_FLAG_DOTALL
      return self.sequence(items, ignore_case, dot_all)
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
      low, high, items = value
      body = self.sequence(items, ignore_case, dot_all)
      return chains.repeat(body, low, None if high is sre.MAXREPEAT else high, self.budget)
    names = {
      sre.AT: "an anchor inside the pattern (^ or $ only begin and end it or its alternatives; \\b, \\A, \\Z)",
      sre.ASSERT: "a look-ahead or look-behind",
      sre.ASSERT_NOT: "a look-ahead or look-behind",
      sre.GROUPREF: "a backreference",
      sre.GROUPREF_EXISTS: "a conditional group",
      sre.POSSESSIVE_REPEAT: "a possessive repeat",
      sre.ATOMIC_GROUP: "an atomic group",
    }
    raise PatternError(f"{names.get(op, str(op))}, which a finite automaton cannot express here")


def _anchored(items, start: bool = False, end: bool = False) -> list[tuple[bool, list, bool]]:
  """The pattern as ``(anchored at the start, items, anchored at the end)`` alternatives."""
  items = list(items)
  if items and items[0] == (sre.AT, sre.AT_BEGINNING):
    start, items = True, items[1:]
  if items and items[-1] == (sre.AT, sre.AT_END):
    end, items = True, items[:-1]
  if len(items) == 1 and items[0][0] is sre.BRANCH:
    return [alt for branch in items[0][1][1] for alt in _anchored(branch, start, end)]
  if len(items) == 1 and items[0][0] is sre.SUBPATTERN and not (items[0][1][1] | items[0][1][2]):
    inner = list(items[0][1][3])
    if any(op is sre.AT for op, _ in inner) or any(op is sre.BRANCH for op, _ in inner):
      return _anchored(inner, start, end)
  return [(start, items, end)]


def _parse(pattern: str):
  if "(?<" in pattern and "(?<=" not in pattern and "(?<!" not in pattern:
    pattern = re.sub(r"\(\?<(?![=!])", "(?P<", pattern)  # ECMA's named groups
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
      return sre_parse.parse(pattern)
    except re.error as e:
      raise ConstraintError(f"invalid pattern {_shown(pattern)}: {e.msg} at position {e.pos}") from None
    except (OverflowError, RecursionError):
      raise ConstraintError(f"pattern {_shown(pattern)} repeats or nests too much") from None


def _shown(pattern: str) -> str:
  return repr(pattern if len(pattern) <= 60 else pattern[:57] + "...")


def _refused(pattern: str, error: PatternError) -> ConstraintError:
  return ConstraintError(f"pattern {_shown(pattern)} uses {error}; rewrite it without")


@functools.lru_cache(maxsize=512)
def _search(pattern: str, wide: bool, budget: fsa.Budget) -> fsa.Dfa:
  reader = _Reader(budget, wide)
  anything = chains.repeat(fsa.ANY_CHAR, 0, None)
  trailing_newline = chains.union([fsa.EPSILON, fsa.literal("\n")]) if wide else fsa.EPSILON
  try:
    options = []
    for start, items, end in _anchored(_parse(pattern)):
      body = reader.sequence(items)
      parts = [fsa.EPSILON if start else anything, body, trailing_newline if end else anything]
      options.append(chains.concat(parts, budget))
    return fsa.minimize(chains.union(options, budget))
  except PatternError as e:
    raise _refused(pattern, e) from None


def search(pattern: str, budget: fsa.Budget, wide: bool = False) -> fsa.Dfa:
  """The UTF-8 strings in which ``pattern`` finds a match as both readings do (``wide``: as either does).

  Raises:
    ConstraintError: The pattern is invalid, or uses what an automaton cannot express.
    fsa.TooLarge: Its automaton needs more states than ``budget``.
  """
  return _search(pattern, wide, budget)


@functools.lru_cache(maxsize=512)
def full(regex: str, budget: fsa.Budget = fsa.UNBOUNDED) -> fsa.Dfa:
  """The strings the compiler's own ``regex`` (Python syntax, no anchors) matches in full."""
  try:
    return fsa.minimize(_Reader(budget, False).sequence(_parse(regex)))
  except PatternError as e:
    raise _refused(regex, e) from None


def largest_repeat(pattern: str) -> int:
  """The largest repetition count written in ``pattern`` (0 if none): a quick lower bound on its states."""
  counts = [int(n) for pair in re.findall(r"\{(\d+)(?:,(\d*))?\}", pattern) for n in pair if n]
  return min(max(counts, default=0), sys.maxsize)


def is_valid_name(name: str) -> bool:
  """Whether ``name`` is a string that contains no lone surrogate (what UTF-8 text can hold)."""
  return not any(unicodedata.category(c) == "Cs" for c in name)
