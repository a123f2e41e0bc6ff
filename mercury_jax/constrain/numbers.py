"""JSON numbers as regular languages: integers and decimals within any decimal bounds (regexes), multiples of any
decimal step (an automaton that reads the digits modulo the step), and their intersections and differences.

Bounds and texts are exact decimals: a bound is the decimal the schema wrote (``0.1`` is 1/10, not the binary
float nearest it), and ``0.30`` lies within ``maximum: 0.3`` while ``0.3000000000000000001`` does not, although a
parser that rounds to binary floats reads both as 0.3. Bounded numbers are written without an exponent.

Unless ``exact_numbers``, every number written parses to a finite IEEE double that is zero only when its text is:
a number without bounds has at most :data:`WHOLE` digits before the point, fewer than :data:`ZEROS` zeros after
it before a nonzero digit, and an exponent of at most two digits; a number with a bound on one side only has at
most :data:`DIGITS` digits before the point (more where the bound needs them); one whose range comes near zero,
fewer than :data:`DIGITS` zeros after the point before a nonzero digit (more where a bound or step needs them).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from fractions import Fraction

import numpy as np

from mercury_jax.constrain import fsa, patterns, regexes

MAX_ENUMERATED = 256  # Multiples of a step too large to read digit by digit that may be listed one by one.
DIGITS = 15  # Digits before the point, and zeros after it, of a bounded number (unless a bound needs more).
WHOLE, ZEROS = 12, 6  # The same for a number without bounds, which may also have an exponent of two digits.
MAX_STEP_STATES = 100_000  # States of a multipleOf automaton (about p * (k + 2) for a step p / 10**k).

_FRACTION_DIGITS_LIMIT = 400  # A decimal bound has at most this many fraction digits (floats have at most ~330).


def exact(value) -> Fraction:
  """The decimal a JSON number stands for: a float is read from its shortest repr (``0.1`` is 1/10)."""
  if isinstance(value, Fraction):
    return value
  return Fraction(repr(value)) if isinstance(value, float) else Fraction(value)


def bound(body: dict, inclusive: str, exclusive: str, tighter) -> tuple[Fraction | None, bool]:
  """``(value, open)`` of a schema's lower (``tighter=max``) or upper (``min``) bound, from either draft's spelling
  (draft 4: ``exclusiveMinimum: true`` next to ``minimum``)."""
  value, other = body.get(inclusive), body.get(exclusive)
  value = None if value is None else exact(value)
  if isinstance(other, bool):
    return value, other and value is not None
  if other is None:
    return value, False
  other = exact(other)
  if value is not None and value != other and tighter(value, other) == value:
    return value, False
  return other, True


def power_of_ten(step: Fraction | None) -> int | None:
  """``p`` when ``step`` is ``10**p``, else None."""
  if step is None or step <= 0:
    return None
  power = round(math.log10(step))
  return power if Fraction(10) ** power == step else None


def decimal_text(value: Fraction) -> str:
  """The shortest JSON text of a decimal: ``1``, ``-0.25``."""
  whole, digits = _split(abs(value))
  sign = "-" if value < 0 else ""
  return f"{sign}{whole}" + (f".{digits}" if digits else "")


def group(parts: list[str]) -> str:
  """The alternation of ``parts`` (one part stays as it is)."""
  return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def integers(first: int | None, last: int | None) -> str:
  """Regex of the JSON integers from ``first`` to ``last`` (None: unbounded)."""
  parts = []
  if last is None or last >= 0:
    parts.append(_naturals(max(first or 0, 0), last))
  if first is None or first < 0:
    parts.append("-" + group([_naturals(max(-last, 1) if last is not None else 1, None if first is None else -first)]))
  return group(parts)


def multiples_of_ten(power: int, fraction: bool) -> str:
  """Regex of every JSON integer that is a multiple of ``10**power`` (``power`` >= 1), with an optional all-zero
  fraction when ``fraction`` (a number, not an integer)."""
  whole = f"(?:0|-?[1-9][0-9]*0{{{power}}})"
  return whole + (r"(?:\.0+)?" if fraction else "")


def decimals(
  low: Fraction | None, low_open: bool, high: Fraction | None, high_open: bool, digits: int | None = None
) -> str:
  """Regex of JSON numbers without exponent between the bounds (None: unbounded; ``*_open``: the bound itself is
  out), with no nonzero digit past ``digits`` fraction digits (None: any); "" when no such number exists."""
  parts = []
  if high is None or high > 0 or (high == 0 and not high_open):
    bottom, bottom_open = (low, low_open) if low is not None and low >= 0 else (Fraction(0), False)
    parts += _magnitudes(bottom, bottom_open, high, high_open, digits)
  if low is None or low < 0:
    # A negative number's magnitude is above 0 (-0 is written 0) and at most -low.
    bottom, bottom_open = (-high, high_open) if high is not None and high < 0 else (Fraction(0), True)
    negative = _magnitudes(bottom, bottom_open, None if low is None else -low, low_open, digits)
    if negative:
      parts.append("-" + group(negative))
  return group(parts) if parts else ""


def _split(value: Fraction) -> tuple[int, str]:
  """``(whole part, fraction digits without trailing zeros)`` of a non-negative finite decimal."""
  whole = math.floor(value)
  rest, places = value - whole, 0
  while (rest * 10**places).denominator != 1:
    places += 1
    if places > _FRACTION_DIGITS_LIMIT:
      raise ValueError(f"{value} is not a finite decimal")
  return whole, str(int(rest * 10**places)).zfill(places).rstrip("0")


def _magnitudes(low: Fraction, low_open: bool, high: Fraction | None, high_open: bool, digits: int | None) -> list:
  """Regexes of the unsigned decimals (integer part, optional fraction) between ``low`` >= 0 and ``high``."""
  if high is not None and (low > high or (low == high and (low_open or high_open))):
    return []
  low_whole, low_digits = _split(low)
  if high is not None:
    high_whole, high_digits = _split(high)
    if high_whole == low_whole:
      return _with_fraction(str(low_whole), _fractions(low_digits, low_open, high_digits, high_open, digits))
  parts = _with_fraction(str(low_whole), _fractions(low_digits, low_open, None, False, digits))
  if high is None or high_whole - low_whole >= 2:
    middle = _naturals(low_whole + 1, None if high is None else high_whole - 1)
    parts += _with_fraction(middle, _fractions("", False, None, False, digits))
  if high is not None:
    parts += _with_fraction(str(high_whole), _fractions("", False, high_digits, high_open, digits))
  return parts


def _with_fraction(whole: str, fraction: tuple[bool, str | None]) -> list[str]:
  bare, digits = fraction
  if digits is None:
    return [whole] if bare else []
  return [f"{whole}(?:\\.(?:{digits}))?" if bare else f"{whole}\\.(?:{digits})"]


@functools.lru_cache(maxsize=4096)
def _fractions(low: str, low_open: bool, high: str | None, high_open: bool, digits: int | None):
  """The fraction digit strings T (possibly empty) with ``0.low <= 0.T <= 0.high`` (``<`` where open; ``high`` None:
  no upper bound) and no nonzero digit past ``digits``: ``(whether T may be empty, regex of the non-empty T or
  None)``. ``low`` and ``high`` have no trailing zeros, so "" is 0.
  """
  zero = low == "" and not low_open and (high != "" or not high_open)  # T is 0: empty, or zeros only.
  if digits == 0 or high == "":
    return zero, "0+" if zero else None
  if low == "" and high is None:
    if not low_open:
      return True, "[0-9]+" if digits is None else f"[0-9]{{1,{digits}}}0*"
    return False, "[0-9]*[1-9][0-9]*" if digits is None else f"[0-9]{{0,{digits - 1}}}[1-9]0*"
  tails: dict[tuple, list[str]] = {}
  for char in "0123456789":
    if low == "":
      lower = ("", low_open and char == "0")
    elif char < low[0]:
      continue
    else:
      lower = (low[1:], low_open) if char == low[0] else ("", False)
    if high is None or char < high[0]:
      upper = (None, False)
    elif char == high[0]:
      upper = (high[1:], high_open)
    else:
      continue
    tail = _fractions(*lower, *upper, None if digits is None else digits - 1)
    if tail[0] or tail[1] is not None:
      tails.setdefault(tail, []).append(char)
  options = []
  for (bare, rest), chars in tails.items():
    head = chars[0] if len(chars) == 1 else f"[{chars[0]}-{chars[-1]}]" if _contiguous(chars) else f"[{''.join(chars)}]"
    options.append(head if rest is None else f"{head}(?:{rest})?" if bare else f"{head}(?:{rest})")
  return zero, "|".join(options) if options else None


def _contiguous(chars: list[str]) -> bool:
  return ord(chars[-1]) - ord(chars[0]) == len(chars) - 1


def _same_length(low: str, high: str) -> str:
  """Regex of the digit strings of one length between ``low`` and ``high``."""
  if low == high:
    return low
  if low[0] == high[0]:
    return low[0] + _same_length(low[1:], high[1:])
  rest = len(low) - 1
  tail = f"[0-9]{{{rest}}}" if rest > 1 else "[0-9]" if rest else ""
  if low[1:] == "0" * rest and high[1:] == "9" * rest:
    return f"[{low[0]}-{high[0]}]{tail}"
  parts = [low[0] + group([_same_length(low[1:], "9" * rest)])]
  if int(high[0]) - int(low[0]) > 1:
    parts.append(f"[{int(low[0]) + 1}-{int(high[0]) - 1}]{tail}")
  parts.append(high[0] + group([_same_length("0" * rest, high[1:])]))
  return group(parts)


def _naturals(low: int, high: int | None) -> str:
  """Regex of the decimal numbers (no leading zeros) from ``low`` to ``high`` (None: no end)."""
  parts = []
  widths = range(len(str(low)), (len(str(high)) if high is not None else len(str(low))) + 1)
  for width in widths:
    first = max(low, 10 ** (width - 1) if width > 1 else 0)
    last = 10**width - 1 if high is None else min(high, 10**width - 1)
    if first <= last:
      parts.append(_same_length(str(first), str(last)))
  if high is None:
    parts.append(f"[1-9][0-9]{{{len(str(low))},}}")
  return group(parts)


# ----------------------------------------------------------------------------------------------- languages


@dataclasses.dataclass(frozen=True)
class NumberSpec:
  """What a number must be.

  Attributes:
    low, low_open, high, high_open: The bounds (None: unbounded; ``*_open``: the bound itself is out).
    integer: No nonzero fraction. fractional: A nonzero fraction.
    steps: Steps it is a multiple of. not_steps: Steps it is not a multiple of.
    excluded: Values it is not.
  """

  low: Fraction | None = None
  low_open: bool = False
  high: Fraction | None = None
  high_open: bool = False
  integer: bool = False
  fractional: bool = False
  steps: tuple[Fraction, ...] = ()
  not_steps: tuple[Fraction, ...] = ()
  excluded: tuple[Fraction, ...] = ()


def _fraction_digits(value: Fraction) -> int:
  return len(_split(abs(value))[1])


def _whole_digits(value: Fraction) -> int:
  return len(str(math.floor(abs(value))))


def _decimal_step(step: Fraction) -> tuple[int, int]:
  """``(p, k)`` such that the finite decimals that are multiples of ``step`` are exactly the multiples of
  ``p / 10**k``: m * a/b is a finite decimal only when m is a multiple of the factor q of b prime to 10, so the
  decimal multiples of a/b are those of a/(b/q), whose denominator 2**t * 5**f divides 10**max(t, f)."""
  a, b = step.numerator, step.denominator
  twos = fives = 0
  while b % 2 == 0:
    b, twos = b // 2, twos + 1
  while b % 5 == 0:
    b, fives = b // 5, fives + 1
  k = max(twos, fives)
  return a * 2 ** (k - twos) * 5 ** (k - fives), k


class StepTooLarge(fsa.TooLarge):
  """A ``multipleOf`` step whose automaton (or list of multiples) would be too large."""

  def __init__(self, states: int, step: Fraction):
    super().__init__(states)
    self.step = step


def multiples(step: Fraction, budget: fsa.Budget) -> fsa.Dfa:
  """The exponent-free JSON number texts whose value is a multiple of ``step`` (the digits read modulo ``p`` of the
  step ``p / 10**k``; after ``k`` fraction digits only zeros).

  Raises:
    fsa.TooLarge: It needs more states than ``budget`` (or :data:`MAX_STEP_STATES`).
  """
  p, k = _decimal_step(step)
  size = 3 + p * (k + 3)
  if size > min(MAX_STEP_STATES, budget.states):
    raise StepTooLarge(size, step)
  # states: 0 start, 1 after "-", 2 after a leading "0", then per remainder r: whole(r), dot(r), fraction(r, 1..k)
  whole = 3 + np.arange(p)
  dot = whole + p
  frac = lambda r, i: 3 + 2 * p + (i - 1) * p + r  # noqa: E731  fraction digit i (1..k) read, remainder r
  table = np.full((size, fsa.ALPHABET), -1, np.int32)
  accepting = np.zeros(size, bool)
  digits = np.arange(10)
  for start in (0, 1):
    table[start, ord("0")] = 2
    table[start, ord("1") : ord("9") + 1] = whole[digits[1:] % p]
  table[0, ord("-")] = 1
  accepting[2] = True  # 0
  table[2, ord(".")] = dot[0]
  r = np.arange(p)
  for d in range(10):
    table[whole, ord("0") + d] = whole[(10 * r + d) % p]
  accepting[whole] = (r * 10**k) % p == 0
  table[whole, ord(".")] = dot
  if k == 0:
    zeros = dot + p  # after the point, zeros only
    table[dot, ord("0")] = zeros
    table[zeros, ord("0")] = zeros
    accepting[zeros] = r == 0
  else:
    for d in range(10):
      table[dot, ord("0") + d] = [frac((10 * x + d) % p, 1) for x in range(p)]
    for i in range(1, k + 1):
      states = [frac(x, i) for x in range(p)]
      accepting[states] = (r * 10 ** (k - i)) % p == 0
      for d in range(10):
        if i < k:
          table[states, ord("0") + d] = [frac((10 * x + d) % p, i + 1) for x in range(p)]
        elif d == 0:
          table[states, ord("0")] = states
  return fsa.minimize(fsa.from_table(table, accepting))


def _texts_of(values: tuple[Fraction, ...]) -> fsa.Dfa:
  """The exponent-free texts of the values (``1``, ``1.0``, ``1.00``; ``0`` also ``-0``)."""
  parts = []
  for value in values:
    whole, digits = _split(abs(value))
    sign = "-?" if value == 0 else "-" if value < 0 else ""
    fraction = rf"\.{digits}0*" if digits else r"(?:\.0+)?"
    parts.append(f"{sign}{whole}{fraction}")
  return patterns.full("|".join(parts)) if parts else fsa.NOTHING


def _listed(step: Fraction, spec: NumberSpec, states: int) -> fsa.Dfa:
  """The multiples of ``step`` between both bounds, listed (with any trailing zeros), for a step whose automaton
  would need ``states`` states.

  Raises:
    StepTooLarge: A bound is missing, or there are more than :data:`MAX_ENUMERATED` of them.
  """
  low, high = spec.low, spec.high
  if low is None or high is None:
    raise StepTooLarge(states, step)
  first = math.floor(low / step) + 1 if spec.low_open and low % step == 0 else math.ceil(low / step)
  last = math.ceil(high / step) - 1 if spec.high_open and high % step == 0 else math.floor(high / step)
  if last - first + 1 > MAX_ENUMERATED:
    raise StepTooLarge(states, step)
  texts = [regexes.escape(decimal_text(m * step)) for m in range(first, last + 1)]
  texts = [rf"{t}(?:\.0+)?" if "." not in t else rf"{t}0*" for t in texts]
  return patterns.full("|".join(texts)) if texts else fsa.NOTHING


def _readable(whole: int | None, zeros: int) -> str:
  """Regex of the exponent-free numbers with at most ``whole`` digits before the point (None: any number) and, when
  that part is 0, fewer than ``zeros`` zeros after the point before a nonzero digit: none is read as infinity, and
  none but a zero as zero."""
  digits = "[0-9]*" if whole is None else f"[0-9]{{0,{whole - 1}}}"
  return f"-?(?:[1-9]{digits}(?:\\.[0-9]+)?|0(?:\\.(?:0{{0,{zeros - 1}}}[1-9][0-9]*|0+))?)"


def language(spec: NumberSpec, budget: fsa.Budget, exact: bool) -> fsa.Dfa:
  """The texts of the numbers ``spec`` allows, written as the module docstring says.

  Raises:
    fsa.TooLarge: A part needs more states than ``budget``.
  """
  low, high = spec.low, spec.high
  bounded = low is not None or high is not None
  if spec.integer:
    first = None if low is None else (math.floor(low) + 1 if spec.low_open else math.ceil(low))
    last = None if high is None else (math.ceil(high) - 1 if spec.high_open else math.floor(high))
    if first is not None and last is not None and first > last:
      return fsa.NOTHING
    text = patterns.full(integers(first, last), budget)
  elif not bounded and not (spec.steps or spec.not_steps or spec.excluded or spec.fractional):
    if exact:
      return patterns.full(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?", budget)
    return patterns.full(_readable(WHOLE, ZEROS) + r"(?:[eE][+-]?[0-9]{1,2})?", budget)
  else:
    regex = decimals(low, spec.low_open, high, spec.high_open)
    if not regex:
      return fsa.NOTHING
    text = patterns.full(regex, budget)
  if spec.fractional:
    text = fsa.intersect(text, patterns.full(r"-?(?:0|[1-9][0-9]*)\.[0-9]*[1-9][0-9]*"), budget)
  for step in spec.steps:
    try:
      text = fsa.intersect(text, multiples(step, budget), budget)
    except StepTooLarge as e:
      text = fsa.intersect(text, _listed(step, spec, e.states), budget)
  for step in spec.not_steps:
    text = fsa.difference(text, multiples(step, budget), budget)
  if spec.excluded:
    text = fsa.difference(text, _texts_of(spec.excluded), budget)
  if exact:
    return fsa.minimize(text)
  ends = [v for v in (low, high) if v is not None]
  whole = None if low is not None and high is not None else max([DIGITS] + [_whole_digits(v) + 1 for v in ends])
  near_zero = not spec.integer and not ((low is not None and low >= 1) or (high is not None and high <= -1))
  if whole is None and not near_zero:
    return fsa.minimize(text)
  zeros = max([DIGITS] + [_fraction_digits(v) + 1 for v in ends + [*spec.steps, *spec.not_steps]])
  return fsa.minimize(fsa.intersect(text, patterns.full(_readable(whole, zeros)), budget))
