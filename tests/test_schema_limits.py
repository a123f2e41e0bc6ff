"""Size limits hold before anything large is built: constraints whose automaton cannot fit are refused in
milliseconds, naming the keyword and the limit, without outlines-core's index and before the dense token table; a
regex's static estimate never exceeds what outlines-core builds, so it refuses nothing the limits would let through;
the final automata are minimal; and the number regexes are exact.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from fractions import Fraction

import numpy as np
import outlines_core
import pytest
from cpu_clock import cpu_seconds
from hypothesis import given, settings, strategies as st
from test_automaton import TOKENIZER, random_texts
from test_schema_keywords import valid

from mercury_jax.constrain import Compiler, ConstraintError, fsa, numbers, regexes, schema as schema_lib, tokens
from mercury_jax.constrain.suite import EXTENDED, REGEXES, SCHEMAS
from mercury_jax.data.tokenizer import Tokenizer

SERVER = {"max_states": 512, "max_classes": 256, "max_edges": 16384}  # mercury_jax/serve/slots.py DEFAULT_CAPACITY


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
  return Tokenizer.load(TOKENIZER)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> Compiler:
  return Compiler(tokenizer, **SERVER)


@pytest.fixture
def no_index(monkeypatch):
  """Fails the test if anything builds an outlines-core index."""

  def index(*args):
    raise AssertionError("an outlines-core index was built")

  monkeypatch.setattr(outlines_core, "Index", index)


PROPERTIES = {f"p{i}": {"type": "string", "maxLength": 300} for i in range(16)}  # 300 each alone: 16 do not fit
SCATTERED = [hashlib.sha256(str(i).encode()).hexdigest()[:16] for i in range(5000)]  # an enum with a large trie


@pytest.mark.parametrize(
  "kind,constraint,param",
  [
    ("json_schema", {"type": "string", "minLength": 100_000}, "minLength"),
    ("json_schema", {"properties": {"a": {"type": "string", "pattern": "^x{1000000}$"}}}, "properties.a.pattern"),
    ("json_schema", {"type": "object", "maxProperties": 100_000}, "maxProperties"),
    ("json_schema", {"type": "array", "items": {"type": "integer"}, "minItems": 50_000}, "minItems"),
    ("json_schema", {"enum": SCATTERED}, "enum"),
    ("json_schema", {"type": "object", "properties": PROPERTIES}, None),
    ("regex", "a{1000000}", "regex"),
    ("regex", "[a-z]{0,1000000}", "regex"),
    ("regex", "(?:ab|cd){300000}", "regex"),
    ("regex", "x{99999999999}", "regex"),
  ],
  ids=[
    "minLength",
    "pattern",
    "maxProperties",
    "minItems",
    "enum",
    "properties",
    "repeat",
    "range",
    "branches",
    "huge",
  ],
)
def test_constraints_too_big_to_fit_are_refused_in_milliseconds_without_an_index(
  tokenizer, no_index, kind, constraint, param
):
  compiler = Compiler(tokenizer, **SERVER, remedy="raise --constraint-capacity", narrow=False)
  with cpu_seconds() as elapsed, pytest.raises(ConstraintError) as error:
    getattr(compiler, kind)(constraint)
  assert elapsed.seconds < 2.0, elapsed  # milliseconds to a few tenths; a bound for a hang, not for a slow machine
  assert error.value.param == param, (error.value.param, str(error.value))
  message = str(error.value)
  assert "more than max_states=512; the compiler builds at most" in message, message
  assert ("4096 token-level states" in message) or ("8192 byte-level states" in message), message
  assert message.endswith("raise --constraint-capacity") and "\n" not in message


NESTED = {  # 64 optional objects of 24 optional strings of up to 4096 characters each: far past the server's limits
  "type": "object",
  "properties": {
    f"o{i}": {"type": "object", "properties": {f"s{j}": {"type": "string", "maxLength": 4096} for j in range(24)}}
    for i in range(64)
  },
}
BRANCHES = {  # 12 anyOf of 4 overlapping branches each: 4**12 alternatives where allOf multiplies them
  "type": "object",
  "allOf": [{"anyOf": [{"required": [f"{name}{i}"]} for name in "pqrs"]} for i in range(12)],
}


@pytest.mark.parametrize(
  "name,schema,phrases",
  [
    ("nested", NESTED, ["is written as at most", "optional properties at"]),
    ("branches", BRANCHES, ["the alternatives at"]),
  ],
)
def test_schemas_past_the_limits_are_written_as_a_subset_that_validates(tokenizer, name, schema, phrases):
  """What does not fit is narrowed, step by step, within seconds: every text written validates, the warning line
  names each narrowing, and narrow=False refuses the same schema."""
  with cpu_seconds() as elapsed:
    automaton = Compiler(tokenizer, **SERVER).json_schema(schema)
  assert elapsed.seconds < 20.0, elapsed  # a few seconds; a bound for a hang
  assert automaton.num_states <= SERVER["max_states"] and automaton.num_edges <= SERVER["max_edges"]
  (line,) = automaton.warnings
  assert line.startswith("written as a subset of what the schema allows") and all(p in line for p in phrases), line
  for text in random_texts(automaton, tokenizer, seed=3, n=16):
    assert valid(schema, text), text
  again = Compiler(tokenizer, **SERVER).json_schema(schema)  # the module's caches are warm now: the same subset
  assert np.array_equal(again.table, automaton.table) and again.warnings == automaton.warnings
  with pytest.raises(ConstraintError):
    Compiler(tokenizer, **SERVER, narrow=False).json_schema(schema)


def test_a_compile_that_would_take_minutes_is_refused_within_seconds(tokenizer):
  """A pattern of nested alternatives whose searching automaton takes minutes to build: every attempt may build at
  most WORK (2^24) states in all (counted the same on every machine), so the compile ends within seconds, saying
  so, narrowing or not."""
  digits, pattern = "1180591620717411303417", ""
  for k in reversed(range(len(digits))):
    rest = len(digits) - k - 1
    higher = f"|[{int(digits[k]) + 1}-9]" + (f"\\d{{{rest}}}" if rest else "") if digits[k] != "9" else ""
    pattern = f"{digits[k]}(?:{pattern}){higher}"
  for narrow in (True, False):
    with cpu_seconds() as elapsed, pytest.raises(ConstraintError, match="in all") as error:
      Compiler(tokenizer, **SERVER, narrow=narrow).json_schema({"type": "string", "pattern": pattern})
    assert elapsed.seconds < 20.0, elapsed
    assert "\n" not in str(error.value)


def test_one_compile_spends_its_work_in_all_token_level_automata_included(tokenizer, monkeypatch):
  """Every attempt and every token-level automaton of one compile spend one budget (COMPILE_WORK, counted the same
  on every machine): reading token-level states counts, and a compile whose token-level automaton would pass it is
  refused as one that does too much work, within about one batch of states of the budget."""
  roots, children = [], []
  fresh = fsa.Budget.fresh

  def recorded(budget, work):
    made = fresh(budget, work)
    {schema_lib.COMPILE_WORK: roots, schema_lib.WORK: children}.get(work, []).append(made)
    return made

  monkeypatch.setattr(fsa.Budget, "fresh", recorded)
  person = SCHEMAS["person"]
  automaton = Compiler(tokenizer, **SERVER, narrow=False, cache_size=0).json_schema(person)
  attempts = sum(child.spent[0] for child in children if child.parent is roots[-1])
  token_level = roots[-1].spent[0] - attempts
  rows = automaton.num_states - 1  # at least the final states (less DONE) were read, each at vocab // 4
  assert token_level >= rows * (tokenizer.vocab_size // tokens.TOKENS_PER_WORK), (token_level, rows)
  cap = attempts + token_level // 2
  monkeypatch.setattr(schema_lib, "COMPILE_WORK", cap)
  with pytest.raises(ConstraintError, match=f"more than {cap} states in all") as error:
    Compiler(tokenizer, **SERVER, narrow=False, cache_size=0).json_schema(person)
  assert roots[-1].spent[0] <= cap + 256 * tokenizer.vocab_size, roots[-1].spent[0]
  assert "\n" not in str(error.value)


def test_the_unrolled_floor_stands_when_deeper_attempts_run_out_of_work(tokenizer, monkeypatch):
  """A recursive schema whose recursion unrolled once fits (the floor) keeps it when every deeper attempt and every
  narrowing step after it runs out of work, instead of being refused."""
  tree = {
    "$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
    "$ref": "#/$defs/node",
  }
  floor = Compiler(tokenizer, **SERVER, recursion_depth=1).json_schema(tree)
  build, calls = schema_lib._build, []

  def exhausted_but_the_floor(doc, options, budget, narrowing, depth):
    builder, text = build(doc, options, budget, narrowing, depth)
    calls.append(depth)
    return builder, (text if len(calls) == 2 else fsa.Exhausted(schema_lib.WORK))  # the second attempt: depth 1

  monkeypatch.setattr(schema_lib, "_build", exhausted_but_the_floor)
  kept = Compiler(tokenizer, **SERVER).json_schema(tree)
  assert calls[1] == 1 and len(calls) > 3, calls
  assert np.array_equal(kept.table, floor.table) and np.array_equal(kept.classes, floor.classes)


def test_the_state_count_refuses_what_the_estimate_misses_before_the_dense_table(tokenizer, monkeypatch):
  """A repetition of a part that may be empty is estimated at one copy (70 states), but its automaton has a state
  per character up to 70 * 70; the count of states (or the work one compile may do) refuses it before the token
  table is made."""

  def dense(*args):
    raise AssertionError("the dense table was made")

  monkeypatch.setattr(tokens, "_with_done", dense)
  regex = "(?:[ab]{0,70}){0,70}"
  assert regexes.min_states(regex) == 70
  error = pytest.raises(ConstraintError, Compiler(tokenizer, **SERVER).regex, regex).value
  assert error.param == "regex" and ("needs at least" in str(error) or "states in all" in str(error)), str(error)


def test_the_estimate_reads_rust_syntax():
  assert regexes.min_states(r"\p{L}{0,5000}") == regexes.min_states("(?<name>x){5000}") == 5000
  assert regexes.min_states(r"(?:[[:alpha:]]x){300}") == 600
  assert regexes.min_states("(?U)a{0,7000}") == 7000  # a flag Python lacks: the largest count


def outlines_states(regex: str) -> int:
  """The states of outlines-core's automaton of ``regex`` over single bytes."""
  transitions, start, _ = regexes.byte_automaton(regex)
  seen, order = {start}, [start]
  for state in order:
    for target in transitions.get(state, {}).values():
      if target not in seen:
        seen.add(target)
        order.append(target)
  return len(order)


@pytest.mark.parametrize("name", list(REGEXES))
def test_the_estimate_never_exceeds_what_outlines_builds(name):
  assert regexes.min_states(REGEXES[name]) <= outlines_states(regexes.normalize_regex(REGEXES[name]))


CONSTRAINTS = [("json_schema", s) for s in SCHEMAS.values()] + [("regex", r) for r in REGEXES.values()]
CONSTRAINTS += [("json_schema", s) for s in EXTENDED.values()] + [("json_object", None)]


@pytest.mark.parametrize("kind,name", [("json_schema", n) for n in SCHEMAS] + [("regex", n) for n in REGEXES])
def test_suite_constraints_compile_at_limits_equal_to_their_own_size(tokenizer, compiler, kind, name):
  """Nothing before the final check refuses a suite constraint whose automaton fits: not the static estimates, the
  byte-level budget (16 states per final one) or the token-level count (8 per final one)."""
  constraint = SCHEMAS[name] if kind == "json_schema" else REGEXES[name]
  automaton = getattr(Compiler(tokenizer), kind)(constraint)
  limits = {"max_states": automaton.num_states, "max_classes": automaton.num_classes, "max_edges": automaton.num_edges}
  tight = getattr(Compiler(tokenizer, **limits), kind)(constraint)
  assert tight.num_states == automaton.num_states and tight.regex == automaton.regex


def _regexes():
  atoms = st.sampled_from(["a", "b", "ab", "[ab]", "[a-c]", "x", "(?:)"])

  def extend(inner):
    sequences = st.lists(inner, min_size=2, max_size=3).map("".join)
    choices = st.lists(inner, min_size=2, max_size=3).map(lambda parts: "(?:" + "|".join(parts) + ")")
    counts = st.sampled_from(["?", "*", "+", "{2}", "{1,3}", "{0,4}", "{2,}", "{3,5}"])
    repeats = st.tuples(inner, counts).map(lambda pair: f"(?:{pair[0]}){pair[1]}")
    return sequences | choices | repeats

  return st.recursive(atoms, extend, max_leaves=6)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(_regexes())
def test_the_estimate_never_exceeds_the_states_of_random_regexes(regex):
  assert regexes.min_states(regex) <= outlines_states(regex), regex


@pytest.mark.parametrize("kind,constraint", [("json_object", None), ("json_schema", SCHEMAS["invoice"])])
def test_final_automata_are_minimal(tokenizer, kind, constraint):
  """No two states accept the same token sequences."""
  automaton = getattr(Compiler(tokenizer), kind)(*([] if constraint is None else [constraint]))
  classes = tokens._equivalent(automaton.table, automaton.accepting, most=automaton.num_states)
  assert len(np.unique(classes)) == automaton.num_states


# ----------------------------------------------------------------------------------------------- numbers


TEXTS = sorted(
  (
    {str(i) for i in range(-30, 31)}
    | {f"{sign}{whole}.{digits}" for sign in ("", "-") for whole in range(13) for digits in ("0", "05", "1", "25", "5")}
    | {"0.049", "0.0500", "2.7499", "2.75", "2.7501", "7.0009", "12.3", "12.30", "-12.05", "-12.050001"}
  )
  - {"-0.0"}  # valid JSON, never written (0 is written 0)
)
BOUNDS = [None, *map(Fraction, ["0", "-2", "3", "0.5", "-0.25", "2.75", "12.3", "-12.05", "0.05", "7", "7.001"])]


@pytest.mark.parametrize("digits", [None, 0, 1, 2])
def test_decimal_regexes_match_exactly_the_numbers_within_the_bounds(digits):
  for low, high, low_open, high_open in itertools.product(BOUNDS, BOUNDS, [False, True], [False, True]):
    if (low is None and low_open) or (high is None and high_open):
      continue
    regex = numbers.decimals(low, low_open, high, high_open, digits)
    for text in TEXTS:
      value = Fraction(text)
      inside = (low is None or (value > low if low_open else value >= low)) and (
        high is None or (value < high if high_open else value <= high)
      )
      inside &= digits is None or (value * 10**digits).denominator == 1
      assert bool(regex and re.fullmatch(regex, text)) == inside, (low, low_open, high, high_open, digits, text)
