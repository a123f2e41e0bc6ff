"""Unicode code points as UTF-8 bytes: ranges of code points (sorted, merged, without the surrogates UTF-8 cannot
hold), their complements, and the byte-range sequences whose UTF-8 texts are exactly a range (as regex-syntax's
``Utf8Sequences`` splits them), from which :func:`mercury_jax.constrain.fsa.chars` builds the automaton of a
character class.
"""

from __future__ import annotations

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)


def _utf8(c: int) -> bytes:
  return chr(c).encode("utf-8", "surrogatepass")


def sequences(lo: int, hi: int):
  """Byte-range sequences whose UTF-8 texts are exactly the code points ``lo..hi`` (no surrogates inside): as
  regex-syntax's ``Utf8Sequences`` splits them, each a list of ``(first byte, last byte)``."""
  stack = [(lo, hi)]
  while stack:
    lo, hi = stack.pop()
    split = False
    for boundary in (0x7F, 0x7FF, 0xFFFF):
      if lo <= boundary < hi:
        stack += [(boundary + 1, hi), (lo, boundary)]
        split = True
        break
    if split:
      continue
    if hi <= 0x7F:
      yield [(lo, hi)]
      continue
    for i in range(1, 4):
      mask = (1 << (6 * i)) - 1
      if lo & ~mask != hi & ~mask:
        if lo & mask:
          stack += [((lo | mask) + 1, hi), (lo, lo | mask)]
          split = True
          break
        if hi & mask != mask:
          stack += [(hi & ~mask, hi), (lo, (hi & ~mask) - 1)]
          split = True
          break
    if not split:
      yield list(zip(_utf8(lo), _utf8(hi), strict=True))


def normalize_ranges(ranges) -> tuple[tuple[int, int], ...]:
  """Sorted, merged code point ranges without the surrogates (which UTF-8 cannot hold)."""
  out: list[list[int]] = []
  for lo, hi in sorted(ranges):
    for a, b in ((lo, min(hi, SURROGATES[0] - 1)), (max(lo, SURROGATES[1] + 1), hi)):
      if a <= b:
        if out and a <= out[-1][1] + 1:
          out[-1][1] = max(out[-1][1], b)
        else:
          out.append([a, b])
  return tuple((a, b) for a, b in out)


def complement_ranges(ranges) -> tuple[tuple[int, int], ...]:
  """Every code point outside ``ranges``."""
  out, start = [], 0
  for lo, hi in normalize_ranges(ranges):
    if lo > start:
      out.append((start, lo - 1))
    start = hi + 1
  if start <= MAX_CODE_POINT:
    out.append((start, MAX_CODE_POINT))
  return normalize_ranges(out)
