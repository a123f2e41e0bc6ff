"""Regular expressions as the constraint compiler reads and writes them: full matching, the formats and JSON text
pieces the schema rewriter splices in, a cheap size estimate, and questions answered on outlines-core's automaton
over single bytes (does a text match, do two regexes share a text).

The regexes are Rust regex syntax (what outlines-core compiles). :func:`min_states` reads them with Python's parser,
which accepts nearly all of it.
"""

from __future__ import annotations

import functools
import re
import sys
import warnings
from re import _constants as sre, _parser as sre_parse

import outlines_core

SENTINEL = "\x01"  # See full_match.
FREE = r'[^"\\\x00-\x1F\x7F-\x9F]*'  # Characters outlines-core's JSON strings write unescaped, any number.
_HOUR, _MINUTE = "(?:[01][0-9]|2[0-3])", "[0-5][0-9]"
_YEAR = "(?:000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (
  f"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
  f"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)"
)
_TIME = f"{_HOUR}:{_MINUTE}:{_MINUTE}(?:\\.[0-9]{{3}}(?:[0-9]{{3}})?)?(?:Z|[+-]{_HOUR}:{_MINUTE})"
_URL_CHARS = "[a-zA-Z0-9._~%!$&'()*+,;=:@-]"
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
FORMATS = {  # JSON-safe regexes of the string inside the quotes; each is a subset of what RFC 3339 etc. allow.
  "date": _DATE,
  "time": _TIME,
  "date-time": f"{_DATE}T{_TIME}",
  "uuid": "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
  "email": r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9-]+(?:\.[a-zA-Z0-9-]+)*\.[a-zA-Z]{2,}",
  "uri": rf"https?://[a-zA-Z0-9-]+(?:\.[a-zA-Z0-9-]+)*(?::[0-9]{{1,5}})?(?:/{_URL_CHARS}*)*(?:\?(?:{_URL_CHARS}|/)*)?",
  "ipv4": rf"{_OCTET}(?:\.{_OCTET}){{3}}",
}

_REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT)
_ONE_CHARACTER = (sre.LITERAL, sre.NOT_LITERAL, sre.ANY, sre.IN, sre.CATEGORY)


def normalize_regex(pattern: str) -> str:
  """The regex the automaton matches in full: a leading ``^`` and a trailing ``$`` are dropped (both implied)."""
  if pattern.startswith("^"):
    pattern = pattern[1:]
  if pattern.endswith("$") and (len(pattern) - 1 - len(pattern[:-1].rstrip("\\"))) % 2 == 0:
    pattern = pattern[:-1]
  return pattern


def search_regex(pattern: str) -> str:
  """A regex of every text in which JSON Schema's ``pattern`` finds a match (it searches), or of more texts: anchors
  are read as absent, which only widens it."""
  return rf"[\s\S]*(?:{normalize_regex(pattern)})[\s\S]*"


def key_regex(pattern: str, inner: str | None = None) -> str:
  """The texts in which JSON Schema's ``pattern`` finds a match (``inner``: the pattern without its anchors), an
  unanchored side taking any characters JSON strings need not escape: the keys written for ``patternProperties``."""
  inner = normalize_regex(pattern) if inner is None else inner
  anchored_end = inner != (pattern[1:] if pattern.startswith("^") else pattern)
  return ("" if pattern.startswith("^") else FREE) + f"(?:{inner})" + ("" if anchored_end else FREE)


def searches(pattern: str, text: str) -> bool:
  """Whether JSON Schema's ``pattern`` may find a match in ``text`` (read generously: anchors ignored)."""
  return matches(search_regex(pattern), text)


def full_match(regex: str) -> str:
  """The regex to give outlines-core's ``Index`` so that its automaton reads the texts ``regex`` matches in full.

  outlines-core's DFA has leftmost-first semantics, so ``a|ab`` alone never matches ``ab`` in full (nor an anyOf of
  integer and number ``1.5``). An end anchor restores full matching, but then a regex that matches the empty string
  has no universal start state, which outlines-core needs; so the regex also starts with :data:`SENTINEL`, read by a
  sentinel token only: the state after it is the real start.
  """
  return f"\\x{ord(SENTINEL):02x}(?:{regex})$"


def balanced(regex: str) -> bool:
  """Whether the groups of ``regex`` are balanced (escapes and nested character classes read as Rust regex reads
  them), so that it cannot close a group it is wrapped in."""
  depth, classes, i = 0, 0, 0
  while i < len(regex):
    char = regex[i]
    i += 1
    if char == "\\":
      i += 1
    elif char == "[":
      if not classes:  # A class's first character may be a literal "]" (after an optional "^").
        i += regex[i : i + 1] == "^"
        i += regex[i : i + 1] == "]"
      classes += 1
    elif classes:
      classes -= char == "]"
    elif char in "()":
      depth += 1 if char == "(" else -1
      if depth < 0:
        return False
  return depth == 0 and classes == 0


def explain_regex_error(regex: str) -> str:
  """One line on why outlines-core (Rust regex syntax) refused ``regex``."""
  shown = regex if len(regex) <= 80 else regex[:77] + "..."
  try:
    re.compile(regex)
  except re.error as e:
    return f"invalid regex {shown!r}: {e.msg} at position {e.pos}"
  except (OverflowError, RecursionError):
    return f"regex {shown!r} repeats or nests too much to compile"
  features = [
    (r"\(\?<?[=!]", "look-ahead or look-behind"),
    (r"\\[1-9]|\(\?P=", "a backreference"),
    (r"\\[bBAZz]|(?<![\[\\])\^|(?<!\\)\$.", r"an anchor (^ or $ inside it, \b, \A, \Z)"),
    (r"[*+?}]\+|\(\?>", "a possessive quantifier or an atomic group"),
  ]
  for pattern, feature in features:
    if re.search(pattern, regex):
      return f"regex {shown!r} uses {feature}, which a finite automaton cannot express; rewrite it without"
  return f"regex {shown!r} is not valid Rust regex syntax (what the automaton compiler reads); use plain syntax"


def escape(text: str) -> str:
  """``text`` as a regex literal (escapes that Python's and Rust's regex syntax both read)."""
  return re.sub(r"([\\.+*?()|\[\]{}^$#&~-])", r"\\\1", text)


# ----------------------------------------------------------------------------------------------- JSON text


def object_regex(listed: list[tuple[str, bool]], entries: list[str], room: int | None) -> str:
  """Regex of a compact object: the ``listed`` ``(member regex, required)`` in order (the required ones always),
  then up to ``room`` (None: any number of) members of the ``entries`` alternatives."""
  entry = alternation(entries, optional=False) if entries and room != 0 else None

  def more(used: int) -> str:
    if entry is None:
      return ""
    return f"(?:,{entry})" + ("*" if room is None else f"{{0,{room - used}}}")

  required = [i for i, (_, needed) in enumerate(listed) if needed]
  if required:
    first = required[0]
    members = "".join(f"(?:{m},)?" for m, _ in listed[:first]) + listed[first][0]
    members += "".join(f",{m}" if needed else f"(?:,{m})?" for m, needed in listed[first + 1 :])
    return rf"\{{{members}{more(0)}\}}"
  starts = [listed[i][0] + "".join(f"(?:,{m})?" for m, _ in listed[i + 1 :]) + more(0) for i in range(len(listed))]
  if entry is not None:
    starts.append(entry + more(1))
  return r"\{" + (alternation(starts, optional=True) if starts else "") + r"\}"


def arrangements(texts: list[str], low: int, high: int, ordered: bool) -> str:
  """Regex of the lists of ``low`` to ``high`` distinct ``texts`` (comma-separated), in any order or in theirs."""

  def rest(used: tuple[int, ...]) -> str | None:  # None: minItems cannot be reached from here
    options = []
    if len(used) < high:
      for i in range(used[-1] + 1 if ordered and used else 0, len(texts)):
        more = rest((*used, i)) if i not in used else None
        if more is not None:
          options.append(("," if used else "") + texts[i] + more)
    if not options:
      return "" if len(used) >= low else None
    return alternation(options, optional=len(used) >= low)

  return rest(()) or ""


def alternation(options: list[str], optional: bool) -> str:
  """``(?:a|b)``, or ``(?:a|b)?`` when ``optional``."""
  return "(?:" + "|".join(options) + ")" + ("?" if optional else "")


# ----------------------------------------------------------------------------------------------- size


def min_states(regex: str) -> int:
  """How many states outlines-core's automaton of ``regex`` has at least, from the regex's text alone (milliseconds).

  outlines-core does not minimize its automaton, so the positions of a text that the regex reads in sequence are
  states of their own: characters in sequence add up; ``X{m,n}`` counts ``n`` times the shortest text of ``X`` (the
  states after each character of the shortest texts differ in how much is left to read), or ``X`` once if that is
  more; ``X{m,}`` counts ``m`` times so (its last copy loops), ``X*`` its one copy of ``X`` less a state;
  alternatives count their longest branch, except that branches beginning with different characters add up (they
  share no state after that character but the last). Random regexes check that it never exceeds outlines-core's
  count (tests/test_schema_limits.py). Where Python's parser cannot read the regex, even with Rust's ``\\p{..}``
  classes and ``(?<name>`` groups translated, it is the largest repetition count written in it; a count Python
  cannot hold (above 2**32 - 1) is :data:`sys.maxsize`.
  """
  try:
    with warnings.catch_warnings():  # "Possible nested set" for Rust's [[:alpha:]]
      warnings.simplefilter("ignore")
      return _measure(sre_parse.parse(_python_syntax(regex)))[0]
  except OverflowError:
    return sys.maxsize
  except (re.error, RecursionError, ValueError, TypeError):
    counts = [int(n) for pair in re.findall(r"\{(\d+)(?:,(\d*))?\}", regex) for n in pair if n]
    return max(counts, default=0)  # Each repetition of a part that is not empty is a state at least.


def _python_syntax(regex: str) -> str:
  """``regex`` with the Rust syntax Python's parser lacks replaced by what counts the same: a Unicode class
  (``\\p{L}``) by ``.``, a POSIX class ``[:alpha:]`` by a character, a named group ``(?<name>`` by
  ``(?P<name>``."""
  regex = re.sub(r"(?<!\\)((?:\\\\)*)\\[pP](?:\{[^}]*\}|[A-Za-z])", r"\1.", regex)
  regex = re.sub(r"\[:\^?[a-z]+:\]", "a", regex)  # [[:alpha:]] is [a]: one character
  return re.sub(r"\(\?<(?![=!])", "(?P<", regex)


def _measure(items) -> tuple[int, int]:
  """``(states, shortest text)`` of a parsed regex."""
  states = shortest = 0
  for op, value in items:
    if op in _ONE_CHARACTER:
      states, shortest = states + 1, shortest + 1
    elif op is sre.BRANCH:
      branches = [list(branch) for branch in value[1]]
      states += _branch_states(branches)
      shortest += min(_measure(b)[1] for b in branches)
    elif op is sre.SUBPATTERN:
      inner = _measure(value[-1])
      states, shortest = states + inner[0], shortest + inner[1]
    elif op in _REPEATS:
      low, high, body = value
      once, short = _measure(body)
      count, loop = (high, 0) if high != sre.MAXREPEAT else (low, 0 if low else max(once - 1, 0))
      states += max(count * short, once if count else 0) + loop
      shortest += low * short
  return states, shortest


def _branch_states(branches: list[list]) -> int:
  groups: dict[int, list[list]] = {}
  others = []
  for branch in branches:
    while branch and branch[0][0] is sre.SUBPATTERN and branch[0][1][1:3] == (0, 0):  # (?:...) of one branch
      branch = list(branch[0][1][-1]) + branch[1:]
    if branch and branch[0][0] is sre.LITERAL:
      groups.setdefault(branch[0][1], []).append(branch[1:])
    else:
      others.append(branch)
  grouped = sum(1 + _branch_states(rests) for rests in groups.values()) - max(len(groups) - 1, 0)
  return max([grouped, *(_measure(b)[0] for b in others)])


# ----------------------------------------------------------------------------------------------- byte automata


@functools.cache
def _byte_vocabulary() -> outlines_core.Vocabulary:
  """Every single byte as a token (id = byte + 1; EOS is 0), to read a regex's character transitions."""
  return outlines_core.Vocabulary(0, {bytes([b]): [b + 1] for b in range(256)})


@functools.lru_cache(maxsize=256)
def byte_automaton(regex: str) -> tuple[dict[int, dict[int, int]], int, frozenset[int]]:
  """``(transitions, start, finals)`` of the texts ``regex`` matches in full, over bytes: ``transitions[state]`` maps
  a byte to the next state.

  Raises:
    ValueError: outlines-core cannot compile ``regex``.
  """
  if not balanced(regex):
    raise ValueError(explain_regex_error(regex))
  index = outlines_core.Index(full_match(regex), _byte_vocabulary())
  rows = index.get_transitions()
  start = rows.pop(index.get_initial_state())[ord(SENTINEL) + 1]  # The initial state only reads the sentinel.
  transitions = {state: {token - 1: nxt for token, nxt in row.items() if token} for state, row in rows.items()}
  return transitions, start, frozenset(index.get_final_states())


def matches(regex: str, text: str) -> bool:
  """Whether ``regex`` matches ``text`` in full, as the automaton reads it."""
  transitions, state, finals = byte_automaton(regex)
  for byte in text.encode():
    state = transitions.get(state, {}).get(byte)
    if state is None:
      return False
  return state in finals


@functools.lru_cache(maxsize=1024)
def disjoint(a: str, b: str) -> bool:
  """Whether no text matches both ``a`` and ``b`` in full (a walk over the pairs of their states)."""
  rows_a, start_a, finals_a = byte_automaton(a)
  rows_b, start_b, finals_b = byte_automaton(b)
  seen, frontier = {(start_a, start_b)}, [(start_a, start_b)]
  while frontier:
    state_a, state_b = frontier.pop()
    if state_a in finals_a and state_b in finals_b:
      return False
    row_b = rows_b.get(state_b, {})
    for byte, next_a in rows_a.get(state_a, {}).items():
      pair = (next_a, row_b.get(byte))
      if pair[1] is not None and pair not in seen:
        seen.add(pair)
        frontier.append(pair)
  return True
