"""A constraint's texts written out as a regular expression (Rust syntax, matched in full), for constraints built
from it: the server's ``tool_choice: "auto"`` reply is a call or text, ``(?:CALL)|TEXT``.

An automaton remembers how it was built (:attr:`~mercury_jax.constrain.fsa.Dfa.source`): literal text, characters,
sequences, alternatives, repetitions, and graphs of parts (arrays and objects). :func:`tree` keeps that as a small
tree whose leaves are text, character ranges, or (for an automaton only its table tells: an intersection, a
difference) its transitions as byte ranges (:class:`Ranges`); :func:`regex` writes the tree out. A graph, and an
automaton of ranges (read back at character boundaries: a UTF-8 character's bytes become code point ranges), are
written by eliminating their states one by one (Brzozowski and McCluskey's method), fewest paths through a state
first.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from mercury_jax.constrain import fsa, utf8
from mercury_jax.constrain.errors import ConstraintError

MAX_LENGTH = 2_000_000  # Characters a regex written out may have.
_META = set("\\.+*?()|[]{}^$#&~-")


@dataclasses.dataclass(frozen=True, eq=False)
class Ranges:
  """A byte automaton's transitions as ranges: state ``s`` goes to ``target[i]`` on bytes ``low[i]..high[i]`` for
  ``i`` in ``offsets[s]:offsets[s + 1]``; state 0 starts."""

  offsets: np.ndarray
  low: np.ndarray
  high: np.ndarray
  target: np.ndarray
  accepting: np.ndarray

  @classmethod
  def of(cls, dfa: fsa.Dfa) -> Ranges:
    table = dfa.table
    n = len(table)
    change = np.ones((n, fsa.ALPHABET), bool)
    change[:, 1:] = table[:, 1:] != table[:, :-1]
    states, starts = np.nonzero(change)
    ends = np.empty_like(starts)
    ends[:-1] = np.where(states[1:] == states[:-1], starts[1:] - 1, fsa.ALPHABET - 1)
    ends[-1:] = fsa.ALPHABET - 1
    targets = table[states, starts]
    keep = targets >= 0
    states, starts, ends, targets = states[keep], starts[keep], ends[keep], targets[keep]
    offsets = np.searchsorted(states, np.arange(n + 1))
    return cls(
      offsets.astype(np.int32),
      starts.astype(np.uint8),
      ends.astype(np.uint8),
      targets.astype(np.int32),
      dfa.accepting.copy(),
    )

  def accepts(self, text: str | bytes) -> bool:
    """Whether the automaton accepts ``text`` (its UTF-8 bytes)."""
    state = 0
    for byte in text.encode() if isinstance(text, str) else text:
      a, b = self.offsets[state], self.offsets[state + 1]
      i = a + int(np.searchsorted(self.high[a:b], byte))
      if i >= b or self.low[i] > byte:
        return False
      state = int(self.target[i])
    return bool(self.accepting[state])

  def row(self, state: int) -> list[tuple[int, int, int]]:
    a, b = self.offsets[state], self.offsets[state + 1]
    return list(zip(self.low[a:b].tolist(), self.high[a:b].tolist(), self.target[a:b].tolist(), strict=True))


def _code_points(ranges: Ranges, state: int) -> list[tuple[int, int, int]]:
  """``(first, last, target)``: the characters read from a boundary state, as code point ranges."""

  @functools.cache
  def tails(state: int, count: int) -> tuple[tuple[int, int, int], ...]:
    """``(low, high, target)`` over the value of ``count`` continuation bytes read from ``state``."""
    out = []
    for low, high, target in ranges.row(state):
      low, high = max(low, 0x80), min(high, 0xBF)
      if low > high:
        continue
      if count == 1:
        out.append((low - 0x80, high - 0x80, target))
        continue
      shift = 6 * (count - 1)
      for byte in range(low, high + 1):
        out += [((byte - 0x80) << shift | a, (byte - 0x80) << shift | b, t) for a, b, t in tails(target, count - 1)]
    return tuple(out)

  out = []
  for low, high, target in ranges.row(state):
    for lead in range(low, high + 1) if high >= 0x80 else [None]:
      if lead is None:
        out.append((low, high, target))
        break
      if lead < 0x80:
        out.append((lead, lead, target))
      elif 0xC2 <= lead <= 0xF4:
        count = 1 if lead < 0xE0 else 2 if lead < 0xF0 else 3
        base = (lead & (0x3F >> count)) << (6 * count)
        out += [(base | a, base | b, t) for a, b, t in tails(target, count)]
  out.sort()
  merged: list[list[int]] = []
  for a, b, t in out:
    if merged and merged[-1][2] == t and merged[-1][1] + 1 == a:
      merged[-1][1] = b
    else:
      merged.append([a, b, t])
  return [tuple(m) for m in merged]


def _char(c: int) -> str:
  """A character as a regex literal both Rust's and Python's syntax read (``\\u00e9``, ``\\U0001f600``)."""
  if 0x20 < c < 0x7F:
    return "\\" + chr(c) if chr(c) in _META else chr(c)
  return f"\\u{c:04x}" if c <= 0xFFFF else f"\\U{c:08x}"


def _class(ranges: list[tuple[int, int]]) -> str:
  if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
    return _char(ranges[0][0])
  parts = [_char(a) if a == b else f"{_char(a)}-{_char(b)}" for a, b in ranges]
  return "[" + "".join(parts) + "]"


@dataclasses.dataclass(frozen=True)
class _Label:
  """A regex with how tightly it binds: 0 an alternation, 1 a sequence, 2 an atom; ``text`` None is the empty
  text."""

  text: str | None
  level: int = 2

  def at(self, level: int) -> str:
    text = self.text or ""
    return f"(?:{text})" if self.level < level else text


_EMPTY = _Label(None)
_NOTHING = _Label("[^\\u0000-\\U0010ffff]")  # no text (never in a constraint's regex: its parts all have texts)


def _then(a: _Label, b: _Label) -> _Label:
  if a.text is None:
    return b
  if b.text is None:
    return a
  return _Label(a.at(1) + b.at(1), 1)


def _either(a: _Label | None, b: _Label) -> _Label:
  if a is None:
    return b
  if a.text is None and b.text is None:
    return a
  if a.text is None or b.text is None:
    other = b if a.text is None else a
    return _Label(other.at(2) + "?", 2)
  return _Label(a.at(0) + "|" + b.at(0), 0)


def _star(a: _Label) -> _Label:
  return _EMPTY if a.text is None else _Label(a.at(2) + "*", 2)


def _too_long() -> ConstraintError:
  return ConstraintError(
    f"the constraint's regex would be longer than {MAX_LENGTH} characters; simplify it (tool_choice 'auto' needs "
    "the call's regex: 'required' does not)"
  )


def _eliminate(edges: dict, start, finals) -> _Label | None:
  """The label of the paths from ``start`` to ``finals`` of a graph (``edges[a][b]``: the label of a to b)."""
  edges = {a: dict(row) for a, row in edges.items()}
  begin, end = object(), object()
  edges[begin] = {start: _EMPTY}
  for node in finals:
    edges.setdefault(node, {})[end] = _either(edges.get(node, {}).get(end), _EMPTY)
  incoming: dict = {}
  for source, row in edges.items():
    for target in row:
      incoming.setdefault(target, set()).add(source)
  remaining = [n for n in edges if n is not begin]
  remaining += [n for n in incoming if n not in edges and n is not end]
  for node in remaining:
    edges.setdefault(node, {})
  alive = set(remaining)
  while alive:
    node = min(alive, key=lambda n: len(incoming.get(n, ())) * len(edges[n]))
    alive.discard(node)
    row = edges.pop(node)
    loop = row.pop(node, None)
    sources = incoming.pop(node, set()) - {node}
    middle = _star(loop) if loop is not None else _EMPTY
    for source in sources:
      into = edges[source].pop(node)
      for target, out in row.items():
        label = _either(edges[source].get(target), _then(_then(into, middle), out))
        if len(label.text or "") > MAX_LENGTH:
          raise _too_long()
        edges[source][target] = label
        incoming.setdefault(target, set()).add(source)
    for target in row:
      incoming[target].discard(node)
  return edges[begin].get(end)


def _ranges_label(ranges: Ranges) -> _Label | None:
  edges = {}
  order, seen = [0], {0}
  for state in order:
    by_target: dict[int, list[tuple[int, int]]] = {}
    for a, b, t in _code_points(ranges, state):
      by_target.setdefault(t, []).append((a, b))
      if t not in seen:
        seen.add(t)
        order.append(t)
    edges[state] = {t: _Label(_class(r)) for t, r in by_target.items()}
  return _eliminate(edges, 0, [s for s in order if ranges.accepting[s]])


def tree(dfa: fsa.Dfa) -> tuple:
  """How ``dfa`` was built, with the automata in it replaced by what their regex needs (module docstring)."""
  memo: dict[int, tuple] = {}

  def node(d: fsa.Dfa | None) -> tuple | None:
    if d is None:
      return None
    if id(d) not in memo:
      source = d.source
      if d.empty:
        out = ("nothing",)
      elif fsa.only_empty_text(d):
        out = ("text", "")
      elif source is None:
        out = ("ranges", Ranges.of(d))
      elif source[0] in ("seq", "alt"):
        out = (source[0], tuple(node(p) for p in source[1]))
      elif source[0] == "rep":
        out = ("rep", node(source[1]), source[2], source[3], node(source[4]))
      elif source[0] == "graph":
        out = ("graph", source[1], source[2], tuple((a, b, node(e)) for a, b, e in source[3]))
      elif source[0] == "escape":
        inner = node(source[1])
        out = ("escape", inner) if _structural(inner) else ("ranges", Ranges.of(d))
      else:
        out = source
      memo[id(d)] = (out, d)  # keep d alive while ids are compared
    return memo[id(d)][0]

  return node(dfa)


def _structural(n) -> bool:
  """Whether a tree has no automaton of ranges in it (an escaped tree is written by escaping its leaves)."""
  if n is None or not isinstance(n, tuple):
    return True
  if n[0] == "ranges":
    return False
  if n[0] in ("seq", "alt"):
    return all(_structural(p) for p in n[1])
  if n[0] == "rep":
    return _structural(n[1]) and _structural(n[4])
  if n[0] == "graph":
    return all(_structural(e) for _, _, e in n[3])
  if n[0] == "escape":
    return _structural(n[1])
  return True


_ESCAPES = {0x22: '\\"', 0x5C: "\\\\", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t", 0x08: "\\b", 0x0C: "\\f"}
_MUST_ESCAPE = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C))


def _escaped(n: tuple, memo: dict) -> tuple:
  """The tree of the JSON text of the strings a tree spells (as strings.escape writes them)."""
  if id(n) in memo:
    return memo[id(n)][0]
  kind = n[0]
  if kind == "text":
    out = ("text", "".join(_ESCAPES.get(c, chr(c)) for c in map(ord, n[1])))
  elif kind == "chars":
    allowed = utf8.complement_ranges(_MUST_ESCAPE)
    plain = utf8.normalize_ranges((max(a, c), min(b, d)) for a, b in n[1] for c, d in allowed if max(a, c) <= min(b, d))
    escaped = [("text", text) for code, text in sorted(_ESCAPES.items()) if any(a <= code <= b for a, b in n[1])]
    options = ([("chars", plain)] if plain else []) + escaped
    out = options[0] if len(options) == 1 else ("alt", tuple(options))
  elif kind in ("seq", "alt"):
    out = (kind, tuple(_escaped(p, memo) for p in n[1]))
  elif kind == "rep":
    out = ("rep", _escaped(n[1], memo), n[2], n[3], None if n[4] is None else _escaped(n[4], memo))
  elif kind == "graph":
    out = ("graph", n[1], n[2], tuple((a, b, None if e is None else _escaped(e, memo)) for a, b, e in n[3]))
  elif kind == "escape":
    out = _escaped(_escaped(n[1], memo), memo)
  else:
    out = n
  memo[id(n)] = (out, n)
  return out


def regex(text: tuple) -> str:
  """The regex of a :func:`tree` (module docstring).

  Raises:
    ConstraintError: It would be longer than :data:`MAX_LENGTH` characters.
  """
  memo: dict[int, _Label] = {}
  escapes: dict = {}
  keep: list = []  # the nodes labelled, alive while their ids are keys

  def label(n: tuple) -> _Label:
    if id(n) in memo:
      return memo[id(n)]
    kind = n[0]
    if kind == "text":
      out = _Label("".join(_char(ord(c)) for c in n[1]) or None, 1 if len(n[1]) > 1 else 2)
    elif kind == "chars":
      out = _Label(_class(list(n[1])))
    elif kind == "nothing":
      out = _NOTHING
    elif kind == "seq":
      out = _EMPTY
      for part in n[1]:
        out = _then(out, label(part))
    elif kind == "alt":
      out = None
      for part in n[1]:
        out = _either(out, label(part)) if out is not None else label(part)
    elif kind == "rep":
      out = _repeat(label(n[1]), n[2], n[3], None if n[4] is None else label(n[4]))
    elif kind == "escape":
      out = label(_escaped(n[1], escapes))
    elif kind == "graph":
      edges: dict = {}
      for a, b, e in n[3]:
        step = _EMPTY if e is None else label(e)
        edges.setdefault(a, {})[b] = _either(edges.get(a, {}).get(b), step)
      out = _eliminate(edges, n[1], n[2]) or _NOTHING
    else:
      out = _ranges_label(n[1]) or _NOTHING
    if len(out.text or "") > MAX_LENGTH:
      raise _too_long()
    memo[id(n)] = out
    keep.append(n)
    return out

  found = label(text)
  return "" if found.text is None else found.at(0)


def _repeat(part: _Label, low: int, high: int | None, separator: _Label | None) -> _Label:
  """``low`` to ``high`` (None: any) of ``part``, with ``separator`` between them."""
  if part.text is None:
    return _EMPTY
  if separator is None:
    counts = (
      "*"
      if (low, high) == (0, None)
      else "+"
      if (low, high) == (1, None)
      else f"{{{low},{'' if high is None else high}}}"
    )
    return _Label(part.at(2) + counts, 2)
  later = _then(separator, part)
  rest_low, rest_high = max(low - 1, 0), None if high is None else high - 1
  if rest_high == 0:
    body = part
  else:
    counts = f"{{{rest_low},{'' if rest_high is None else rest_high}}}"
    body = _Label(part.at(1) + later.at(2) + counts, 1)
  return _Label(body.at(2) + "?", 2) if low == 0 else body
