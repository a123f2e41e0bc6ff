"""Regular expressions of the ``regex`` constraint (Rust syntax, what outlines-core reads): full matching, errors
explained in one line, a cheap size estimate, and outlines-core's automaton over single bytes, from which
:func:`~mercury_jax.constrain.automaton.regex_text` takes the regex's byte automaton. Also the arrangements of
distinct values that ``uniqueItems`` lists.

:func:`min_states` reads the regexes with Python's parser, which accepts nearly all of Rust's syntax.
"""

from __future__ import annotations

import functools
import re
import sys
import warnings
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


_PLAIN = (sre.LITERAL, sre.NOT_LITERAL, sre.BRANCH, sre.SUBPATTERN, sre.MAX_REPEAT, sre.MIN_REPEAT)
_EVERYTHING = [  # a class with both of a pair is every character, in any reading
  {sre.CATEGORY_DIGIT, sre.CATEGORY_NOT_DIGIT},
  {sre.CATEGORY_WORD, sre.CATEGORY_NOT_WORD},
  {sre.CATEGORY_SPACE, sre.CATEGORY_NOT_SPACE},
]


def plain_syntax(regex: str) -> bool:
  """Whether ``regex`` reads the same in Rust's syntax and Python's, with no construct whose meaning differs
  between them or their Unicode tables (no ``.``, class escape, anchor, flag or look-around; ``[\\s\\S]`` is
  every character in both): literals, explicit character classes, groups, alternatives and repeats, as the regexes
  written out of constraints are."""
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      items = sre_parse.parse(regex)
  except (re.error, RecursionError, OverflowError, ValueError):
    return False
  stack = [items]
  while stack:
    for op, value in stack.pop():
      if op is sre.IN:
        categories = {item[1] for item in value if item[0] is sre.CATEGORY}
        if any(item[0] not in (sre.LITERAL, sre.RANGE, sre.NEGATE, sre.CATEGORY) for item in value):
          return False
        if categories and not any(pair <= categories for pair in _EVERYTHING):
          return False
      elif op not in _PLAIN:
        return False
      elif op is sre.BRANCH:
        stack += value[1]
      elif op is sre.SUBPATTERN:
        if value[1] or value[2]:
          return False
        stack.append(value[3])
      elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
        stack.append(value[2])
  return True


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
