"""Regular expressions of JSON numbers within bounds: integers, and decimals with any decimal bounds and at most a
number of fraction digits (``multipleOf`` a power of ten).

Bounds and texts are exact decimals: a bound is the decimal the schema wrote (``0.1`` is 1/10, not the binary
float nearest it), and ``0.30`` lies within ``maximum: 0.3`` while ``0.3000000000000000001`` does not, although a
parser that rounds to binary floats reads both as 0.3. Bounded numbers are written without an exponent.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

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
