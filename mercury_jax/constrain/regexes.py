"""Regular expressions as the constraint compiler reads them: full matching, a cheap size estimate, and questions
answered on outlines-core's automaton over single bytes (does a text match, do two regexes share a text).

The regexes are Rust regex syntax (what outlines-core compiles). :func:`min_states` reads them with Python's parser,
which accepts nearly all of it; where it does not, the estimate says 0 (nothing is refused on its word).
"""

from __future__ import annotations

import functools
import re
import sys
from re import _constants as sre, _parser as sre_parse

import outlines_core

SENTINEL = "\x01"  # See full_match.
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


# ----------------------------------------------------------------------------------------------- size


def min_states(regex: str) -> int:
  """How many states outlines-core's automaton of ``regex`` has at least, from the regex's text alone (milliseconds).

  outlines-core does not minimize its automaton, so the positions of a text that the regex reads in sequence are
  states of their own: characters in sequence add up; ``X{m,n}`` counts ``n`` times the shortest text of ``X`` (the
  states after each character of the shortest texts differ in how much is left to read), or ``X`` once if that is
  more; ``X{m,}`` counts ``m`` times so (its last copy loops), ``X*`` its one copy of ``X`` less a state;
  alternatives count their longest branch, except that branches beginning with different characters add up (they
  share no state after that character but the last). Random regexes check that it never exceeds outlines-core's
  count (tests/test_schema_limits.py). 0 when Python's parser cannot read the regex; :data:`sys.maxsize` for a
  count Python's parser cannot hold (above 2**32 - 1).
  """
  try:
    return _measure(sre_parse.parse(regex))[0]
  except OverflowError:
    return sys.maxsize
  except (re.error, RecursionError, ValueError, TypeError):
    return 0


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
