"""The byte-automaton algebra the schema compiler builds with (mercury_jax.constrain.fsa), the reading of JSON
Schema patterns (patterns), string escaping (strings) and the regex written out of an automaton (render): each
operation accepts exactly the texts it should, checked against Python's ``re`` on every short text over a small
alphabet.
"""

from __future__ import annotations

import itertools
import json
import re

import pytest
from hypothesis import given, settings, strategies as st

from mercury_jax.constrain import chains, fsa, patterns, regexes, render, strings
from mercury_jax.constrain.automaton import regex_text

ALPHABET = "ab,"
TEXTS = ["".join(t) for n in range(6) for t in itertools.product(ALPHABET, repeat=n)]


def _regexes():
  atoms = st.sampled_from(["a", "b", "ab", "[ab]", ",", "(?:)"])

  def extend(inner):
    sequences = st.lists(inner, min_size=2, max_size=3).map("".join)
    choices = st.lists(inner, min_size=2, max_size=3).map(lambda parts: "(?:" + "|".join(parts) + ")")
    counts = st.sampled_from(["?", "*", "+", "{2}", "{1,3}", "{0,2}", "{2,}"])
    repeats = st.tuples(inner, counts).map(lambda pair: f"(?:{pair[0]}){pair[1]}")
    return sequences | choices | repeats

  return st.recursive(atoms, extend, max_leaves=6)


def language(dfa: fsa.Dfa) -> set[str]:
  return {t for t in TEXTS if dfa.accepts(t)}


def matching(regex: str) -> set[str]:
  return {t for t in TEXTS if re.fullmatch(regex, t)}


@settings(max_examples=120, deadline=None, derandomize=True)
@given(_regexes(), _regexes())
def test_union_intersection_difference_concatenation_are_exact(a, b):
  da, db = patterns.full(a), patterns.full(b)
  assert language(da) == matching(a)
  assert language(chains.union([da, db])) == matching(a) | matching(b)
  assert language(fsa.intersect(da, db)) == matching(a) & matching(b)
  assert language(fsa.difference(da, db)) == matching(a) - matching(b)
  assert language(chains.concat([da, db])) == matching(f"(?:{a})(?:{b})")


@settings(max_examples=60, deadline=None, derandomize=True)
@given(_regexes(), st.integers(0, 2), st.one_of(st.none(), st.integers(0, 3)))
def test_repeat_with_a_separator_is_exact_and_minimizing_keeps_the_language(a, low, extra):
  high = None if extra is None else low + extra
  more = f"{{{max(low - 1, 0)},{'' if high is None else max(high - 1, 0)}}}"
  expected = f"(?:{a})(?:,(?:{a})){more}"
  expected = f"(?:{expected})?" if low == 0 else expected
  got = chains.repeat(patterns.full(a), low, high, separator=fsa.literal(","))
  assert language(got) == (matching(expected) if high != 0 else {""})
  assert language(fsa.minimize(got)) == language(got)


def test_graph_skips_optional_steps_and_counts():
  """{a}? then b, at least one step taken, through the graph helper objects and arrays use."""
  a, b = fsa.literal("a"), fsa.literal("b")
  edges = [(0, 1, a), (0, 1, None), (1, 2, b), (1, 2, None)]
  got = chains.graph(0, [2], edges)
  assert language(got) == {"", "a", "b", "ab"}
  assert language(chains.graph(0, [2], edges[:1] + edges[2:])) == {"a", "ab"}


def test_words_is_the_minimal_automaton_of_a_finite_set():
  texts = [f"item {i}" for i in range(1000)]
  dfa = chains.words(texts)
  assert all(dfa.accepts(t) for t in texts) and not dfa.accepts("item 1000") and not dfa.accepts("item ")
  assert dfa.size < 30  # "item " and the numbers below 1000: a handful of states, not one per character


def test_budget_refuses_before_building():
  with pytest.raises(fsa.TooLarge):
    chains.repeat(fsa.ANY_CHAR, 0, 10_000, fsa.Budget(1000))


@pytest.mark.parametrize(
  "ranges",
  [((0x41, 0x5A),), ((0x80, 0x7FF),), ((0x7F, 0x800),), ((0xFFF0, 0x10010),), ((0, 0x10FFFF),), ((0xE9, 0xE9),)],
)
def test_characters_are_their_utf8_bytes(ranges):
  dfa = fsa.chars(ranges)
  probes = {c for lo, hi in ranges for c in (lo, hi, (lo + hi) // 2)} | {0x40, 0x7FF, 0x800, 0xFFFF, 0x10000}
  for code in probes - set(range(0xD800, 0xE000)):
    inside = any(lo <= code <= hi for lo, hi in ranges)
    assert dfa.accepts(chr(code)) == inside, hex(code)
  assert not dfa.accepts(b"\xed\xa0\x80")  # a surrogate is not UTF-8


# ----------------------------------------------------------------------------------------------- patterns


@pytest.mark.parametrize(
  "pattern,found,missed",
  [
    ("b", ["b", "abc"], ["", "a"]),
    ("^a", ["a", "ab"], ["ba"]),
    ("b$", ["ab"], ["ba", "b\n"]),  # Python's $ also matches before a final newline: ECMA's does not
    ("^a$|^b$", ["a", "b"], ["ab"]),
    ("^(?:a|bc)+$", ["a", "bca"], ["b", "ab c"]),
    (r"^\d{2}$", ["12"], ["1", "١٢"]),  # ECMA's \d: ASCII digits
    (r"\w", ["_"], ["é", " "]),
    ("^.$", ["x", '"'], ["\n", "\r", "\u2028"]),  # ECMA's . refuses every line terminator
  ],
)
def test_patterns_are_searched_as_both_readings_agree(pattern, found, missed):
  dfa = patterns.search(pattern, fsa.UNBOUNDED)
  for text in found:
    assert dfa.accepts(text) and re.search(pattern, text), text
  for text in missed:
    assert not dfa.accepts(text), text


@pytest.mark.parametrize("pattern", [r"^\d+$", r"\w", "^.$", "a$", r"^\s*$", "[^a-z]"])
def test_the_wide_reading_holds_every_match_of_python(pattern):
  """Complements use the wide reading: a string Python's re finds the pattern in is never in the complement."""
  wide = patterns.search(pattern, fsa.UNBOUNDED, wide=True)
  for text in ["1", "١٢", "é", "_", "\n", "a\n", "\r", " ", "\x1c", "A", "Z"]:
    if re.search(pattern, text):
      assert wide.accepts(text), (pattern, text)


@pytest.mark.parametrize(
  "pattern,construct",
  [("a(?=b)", "look-ahead"), (r"(a)\1", "backreference"), (r"a\bb", "anchor inside"), ("a^b", "anchor inside")],
)
def test_patterns_an_automaton_cannot_read_are_refused_in_one_line(pattern, construct):
  with pytest.raises(Exception) as error:
    patterns.search(pattern, fsa.UNBOUNDED)
  assert construct in str(error.value) and "\n" not in str(error.value)


def test_strings_are_written_escaped_as_json_dumps_writes_them():
  """In the short form; the control characters only ``\\u00XX`` spells are never written."""
  value = patterns.search('^[a"\\\\\n\x01]{2}$', fsa.UNBOUNDED)
  text = strings.quoted(strings.escape(value))
  for chars in itertools.product('a"\\\n\x01', repeat=2):
    s = "".join(chars)
    assert text.accepts(json.dumps(s, ensure_ascii=False)) == ("\x01" not in s), s
  assert not text.accepts('"a\\u000a"') and not text.accepts('""')  # one spelling: \n, not \u000a


# ----------------------------------------------------------------------------------------------- render


@settings(max_examples=60, deadline=None, derandomize=True)
@given(_regexes())
def test_the_regex_written_out_of_an_automaton_has_its_language(regex):
  dfa = patterns.full(regex)
  written = render.regex(render.tree(dfa))
  assert language(regex_text(written, fsa.UNBOUNDED)) == language(dfa), written
  assert render.Ranges.of(dfa).accepts("ab") == dfa.accepts("ab")


def test_the_regex_of_non_ascii_text_round_trips():
  dfa = chains.union([fsa.literal("é"), fsa.literal("☃x"), fsa.literal("\U0001f600")])
  written = render.regex(render.tree(dfa))
  assert all(regex_text(written, fsa.UNBOUNDED).accepts(t) for t in ["é", "☃x", "\U0001f600"])
  assert regexes.min_states(written) >= 1
