"""The host half of structured output: regexes and JSON Schemas compiled into token-level automata.

Random texts of each automaton (walks that finish within a budget using ``distance``) must validate with
``jsonschema`` or match with ``re``; the tokenizer's own tokenisation of valid text must be accepted.
"""

from __future__ import annotations

import datetime
import itertools
import json
import re
import threading
import urllib.parse
import zlib
from pathlib import Path

import jsonschema
import numpy as np
import pytest

import mercury_jax
from mercury_jax.constrain import Automaton, Compiler, ConstraintError, tool_call_schema
from mercury_jax.constrain.suite import EXAMPLES, REGEXES, SCHEMAS
from mercury_jax.data.tokenizer import Tokenizer, train_tokenizer

TOKENIZER = Path(mercury_jax.__file__).parent / "assets" / "default" / "tokenizer.model"
FORMATS = jsonschema.FormatChecker()  # jsonschema's own, plus the RFC 3339 and URI checks it needs packages for


@FORMATS.checks("date-time", raises=ValueError)
def _date_time(text: str) -> bool:
  return "T" in text and datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).tzinfo is not None


@FORMATS.checks("time", raises=ValueError)
def _time(text: str) -> bool:
  return datetime.time.fromisoformat(text.replace("Z", "+00:00")).tzinfo is not None


@FORMATS.checks("uri")
def _uri(text: str) -> bool:
  parts = urllib.parse.urlsplit(text)
  return bool(parts.scheme and parts.netloc)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
  return Tokenizer.load(TOKENIZER)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> Compiler:
  return Compiler(tokenizer)


@pytest.fixture(scope="module")
def every_tokenisation(tokenizer) -> Compiler:
  """Automata that keep every tokenisation of fixed text (no canonical pruning)."""
  return Compiler(tokenizer, canonical=False)


def compact(value) -> str:
  return json.dumps(value, separators=(",", ":"))


def random_texts(automaton: Automaton, tokenizer: Tokenizer, seed: int, n: int = 4, max_tokens: int = 120):
  """``n`` random accepted texts: uniform over the tokens that leave room to finish, hurrying now and then."""
  rng = np.random.default_rng(seed)
  texts = []
  for _ in range(n):
    state, tokens = automaton.start, []
    while True:
      allowed = automaton.allowed(state)
      nxt = automaton.table[state, automaton.classes[allowed]]
      keep = (automaton.distance[nxt] < max_tokens - len(tokens)) | (allowed == automaton.eos_id)
      if rng.random() < 0.3 and (keep & (automaton.distance[nxt] < automaton.distance[state])).any():
        keep &= automaton.distance[nxt] < automaton.distance[state]
      pick = rng.choice(np.flatnonzero(keep))
      if allowed[pick] == automaton.eos_id:
        break
      tokens.append(int(allowed[pick]))
      state = int(nxt[pick])
    assert automaton.accepts(tokens)
    texts.append(tokenizer.decode(tokens))
  return texts


def seed_of(name: str) -> int:
  return zlib.crc32(name.encode())


# ----------------------------------------------------------------------------------------------- the suite


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_random_texts_of_every_suite_schema_are_valid_json_of_it(compiler, tokenizer, name):
  automaton = compiler.json_schema(SCHEMAS[name])
  for text in random_texts(automaton, tokenizer, seed_of(name)):
    jsonschema.validate(json.loads(text), SCHEMAS[name], format_checker=FORMATS)


@pytest.mark.parametrize("name", list(REGEXES))
def test_random_texts_of_every_suite_regex_match_it(compiler, tokenizer, name):
  automaton = compiler.regex(REGEXES[name])
  for text in random_texts(automaton, tokenizer, seed_of(name), n=8):
    assert re.fullmatch(REGEXES[name], text), text


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_suite_examples_are_valid_and_accepted_in_the_tokenizers_own_tokenisation(compiler, tokenizer, name):
  jsonschema.validate(EXAMPLES[name], SCHEMAS[name], format_checker=FORMATS)
  automaton = compiler.json_schema(SCHEMAS[name])
  assert automaton.accepts(tokenizer.encode(compact(EXAMPLES[name])) + [tokenizer.eos_id])
  # The shortest instance must fit the 96 tokens the structured-output tests generate (tests/test_structured.py).
  assert automaton.num_states < 1024 and automaton.distance[automaton.start] <= 88, automaton


# ----------------------------------------------------------------------------------------------- forced text


@pytest.mark.parametrize("kind,name", [("schema", n) for n in SCHEMAS] + [("regex", n) for n in REGEXES])
def test_canonical_pruning_accepts_the_same_texts(compiler, every_tokenisation, tokenizer, kind, name):
  """Pruning keeps one tokenisation of fixed text, never a text: the tokenizer's encoding of any text of the
  unpruned automaton is accepted, and every text of the pruned one is a text of the unpruned one."""
  compile_ = (lambda c: c.json_schema(SCHEMAS[name])) if kind == "schema" else (lambda c: c.regex(REGEXES[name]))
  pruned, free = compile_(compiler), compile_(every_tokenisation)
  assert pruned.num_states <= free.num_states
  for text in random_texts(free, tokenizer, seed_of(name), n=6):
    assert pruned.accepts(tokenizer.encode(text)), text
  for text in random_texts(pruned, tokenizer, seed_of(name), n=6):
    assert free.accepts(tokenizer.encode(text)), text


def test_long_fixed_keys_are_forced_in_the_tokenizers_own_tokenisation(compiler, every_tokenisation, tokenizer):
  schema = SCHEMAS["shipping_label"]
  automaton = compiler.json_schema(schema)
  state, forced = automaton.start, []
  while automaton.forced[state] >= 0:
    forced.append(int(automaton.forced[state]))
    state = automaton.next_state(state, forced[-1])
  assert tokenizer.decode(forced) == '{"customer_shipping_address_line":'
  assert forced == tokenizer.encode('{"customer_shipping_address_line":')

  ids = tokenizer.encode(compact(EXAMPLES["shipping_label"]))
  for a, least, most in ((automaton, 0.6 * len(ids), len(ids)), (every_tokenisation.json_schema(schema), 0, 5)):
    state, count = a.start, 0
    for token in ids:
      count += int(a.forced[state] == token)
      state = a.next_state(state, token)
    assert least <= count <= most, (count, len(ids))


# ------------------------------------------------------------------------------------------ EOS, DONE, distance


@pytest.mark.parametrize("constraint", [("schema", "person"), ("regex", "semver")])
def test_eos_done_specials_and_forced_are_wired_as_documented(compiler, tokenizer, constraint):
  kind, name = constraint
  a = compiler.json_schema(SCHEMAS[name]) if kind == "schema" else compiler.regex(REGEXES[name])
  done, eos = Automaton.DONE, tokenizer.eos_id
  after_eos = a.table[:, a.classes[eos]]
  np.testing.assert_array_equal(after_eos == done, a.accepting)
  np.testing.assert_array_equal(after_eos == -1, ~a.accepting)
  assert a.accepting[done] and a.distance[done] == 0 and (a.table[done] == done).all()
  assert len(a.allowed(done)) == tokenizer.vocab_size
  pieces = [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]
  high_bytes = [i for i, piece in enumerate(pieces) if re.fullmatch(r"<0x[89A-F][0-9A-F]>", piece)]
  never = [tokenizer.pad_id, tokenizer.unk_id, tokenizer.bos_id, tokenizer.mask_id, *high_bytes]
  assert (a.table[1:][:, a.classes[never]] == -1).all()
  for state in range(a.num_states):
    allowed = a.allowed(state)
    assert (a.forced[state] >= 0) == (len(allowed) == 1)
    if len(allowed) == 1:
      assert allowed[0] == a.forced[state]
    if not a.accepting[state]:  # distance is the shortest way to acceptance
      assert a.distance[state] == 1 + a.distance[a.table[state, a.classes[allowed]]].min()
  text = compact(EXAMPLES[name]) if kind == "schema" else "1.0.0"
  assert a.accepts(tokenizer.encode(text) + [eos, 7, eos, 99])
  assert not a.accepts(tokenizer.encode(text)[:-1] + [eos])
  assert a.walk([eos]) == -1 and a.next_state(a.start, tokenizer.pad_id) == -1


def test_distance_is_the_shortest_accepted_length(every_tokenisation, tokenizer):
  regex = "(ab|b){1,3}c|xyzzy"
  texts = ["".join(p) + "c" for n in (1, 2, 3) for p in itertools.product(["ab", "b"], repeat=n)] + ["xyzzy"]
  assert all(re.fullmatch(regex, t) for t in texts)
  pieces = {tokenizer.decode([i]) for i in range(5, tokenizer.vocab_size)}

  def fewest_tokens(text: str) -> int:
    best = [0] + [10**9] * len(text)
    for end in range(1, len(text) + 1):
      best[end] = min(best[start] + 1 for start in range(end) if text[start:end] in pieces)
    return best[-1]

  automaton = every_tokenisation.regex(regex)
  assert automaton.distance[automaton.start] == min(fewest_tokens(t) for t in texts)


# ----------------------------------------------------------------------------------------------- keywords


def test_numeric_ranges_are_exact(compiler, tokenizer):
  def accepted(schema, texts):
    a = compiler.json_schema(schema)
    return {t for t in texts if a.accepts(tokenizer.encode(t) + [tokenizer.eos_id])}

  numbers = range(-40, 160)
  integers = {"type": "integer", "minimum": -15, "maximum": 123}
  assert accepted(integers, map(str, numbers)) == {str(n) for n in numbers if -15 <= n <= 123}
  exclusive = {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 7.5}
  assert accepted(exclusive, map(str, numbers)) == {str(n) for n in range(-2, 8)}
  steps = {"type": "integer", "minimum": 0, "maximum": 50, "multipleOf": 7}
  assert accepted(steps, map(str, numbers)) == {str(n) for n in range(0, 50, 7)}
  above = {"type": "integer", "minimum": 100}
  assert accepted(above, ["-5", "99", "100", "999", "1000", "123456", "0100"]) == {"100", "999", "1000", "123456"}
  decimals = ["-3", "-2", "-2.0", "-1.999", "-1", "-0.5", "0", "0.25", "2.9", "3", "3.0", "3.00", "3.001", "4", "12"]
  number = {"type": "number", "exclusiveMinimum": -2, "maximum": 3}
  assert accepted(number, decimals) == {t for t in decimals if -2 < float(t) <= 3}


def test_strings_enums_and_combinators_are_enforced(compiler, tokenizer):
  def accepts(schema, value) -> bool:
    return compiler.json_schema(schema).accepts(tokenizer.encode(compact(value)) + [tokenizer.eos_id])

  assert accepts({"type": "string", "format": "date"}, "2024-02-29")
  assert not accepts({"type": "string", "format": "date"}, "2023-02-29")
  assert accepts({"type": "string", "pattern": "^a|b$"}, "b")
  assert accepts({"type": "string", "pattern": "a|b"}, "xbx")  # searched, as JSON Schema reads it
  assert not accepts({"type": "string", "pattern": "^a|b$"}, "ba")
  assert accepts({"enum": [{"a.b": [1, "x"]}, None]}, {"a.b": [1, "x"]})
  assert not accepts({"type": "string", "enum": ["a", 3]}, 3)  # enum values failing the type are dropped
  merged = {"allOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]}, {"required": ["b"]}]}
  assert accepts(merged, {"a": 1, "b": True}) and not accepts(merged, {"a": 1})
  assert accepts({"type": "object", "required": ["id"]}, {"id": [1, "two"]})
  assert accepts({"type": ["integer", "null"], "maximum": 3}, None)
  assert not accepts({"type": ["integer", "null"], "maximum": 3}, 4)


def test_alternatives_match_in_full_whatever_their_order(compiler, tokenizer):
  """outlines-core's DFA alone is leftmost-first: "a|ab" would never accept "ab", nor integer|number "1.5"."""
  for regex, texts in (("a|ab", ["a", "ab"]), ("1|1\\.5", ["1", "1.5"]), ("(ab)?", ["", "ab"])):
    automaton = compiler.regex(regex)
    assert all(automaton.accepts(tokenizer.encode(t) + [tokenizer.eos_id]) for t in texts), regex
  numbers = compiler.json_schema({"anyOf": [{"type": "integer"}, {"type": "number"}]})
  assert all(numbers.accepts(tokenizer.encode(t)) for t in ["1", "1.5", "-2e+7"])


def test_json_object_is_any_compact_object(compiler, tokenizer):
  automaton = compiler.json_object()
  for value in ({}, {"a": 1, "b": [True, None, "x"], "c": {"d": -2.5e3}}):
    assert automaton.accepts(tokenizer.encode(compact(value)) + [tokenizer.eos_id])
  assert not automaton.accepts(tokenizer.encode("[1]") + [tokenizer.eos_id])
  for text in random_texts(automaton, tokenizer, seed=3):
    assert isinstance(json.loads(text), dict)


def test_tool_call_schema(compiler, tokenizer):
  tools = [
    {"type": "function", "function": {"name": "now"}},
    {"type": "function", "function": {"name": "add", "parameters": {"$ref": "#/$defs/pair", "$defs": {"pair": {
      "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}}}}},
  ]  # fmt: skip
  both, add = compiler.json_schema(tool_call_schema(tools)), compiler.json_schema(tool_call_schema(tools, "add"))
  calls = [{"name": "now", "arguments": {}}, {"name": "add", "arguments": {"x": 1, "y": 2}}]
  for call in calls:
    jsonschema.validate(call, tool_call_schema(tools))
    assert both.accepts(tokenizer.encode(compact(call)) + [tokenizer.eos_id])
    assert add.accepts(tokenizer.encode(compact(call)) + [tokenizer.eos_id]) == (call["name"] == "add")
  assert not both.accepts(tokenizer.encode(compact({"name": "sub", "arguments": {}})))
  with pytest.raises(ConstraintError, match="no tool is named 'sub'") as error:
    tool_call_schema(tools, "sub")
  assert error.value.param == "tool_choice"


# ----------------------------------------------------------------------------------------------- errors


def refusal(compile_) -> ConstraintError:
  with pytest.raises(ConstraintError) as error:
    compile_()
  assert isinstance(error.value, ValueError) and "\n" not in str(error.value) and len(str(error.value)) < 400
  return error.value


def test_invalid_and_unsupported_regexes_say_what_and_where(compiler):
  assert "missing ), unterminated subpattern at position 1" in str(refusal(lambda: compiler.regex("a(b")))
  assert "look-ahead" in str(refusal(lambda: compiler.regex("(?=a)b")))
  assert refusal(lambda: compiler.regex("[z-a]")).param == "regex"
  assert compiler.regex("^[0-9]+$").regex == "[0-9]+"


def test_impossible_constraints_are_refused(compiler):
  assert "no token" in str(refusal(lambda: compiler.regex("é+")))
  assert "no token sequence satisfies" in str(refusal(lambda: compiler.regex("[a-z]*é")))
  error = refusal(lambda: compiler.json_schema({"type": "integer", "minimum": 3, "maximum": 2}))
  assert "accepts no value: no number" in str(error)


@pytest.mark.parametrize(
  "schema,param,words",
  [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "minItems": 2}, "uniqueItems", "unique"),
    ({"properties": {"p": {"type": "number", "multipleOf": 0.123456789}}}, "properties.p.multipleOf", "minimum"),
    ({"type": "string", "pattern": "a(?=b)"}, "pattern", "look-ahead"),
    ({"properties": {"p": {"type": "string", "pattern": "(a)\\1"}}}, "properties.p.pattern", "backreference"),
    ({"properties": {"a": {"$ref": "other.json"}}}, "properties.a.$ref", "outside the schema"),
    (
      {"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": 1}}, "$ref": "#/$defs/n"},
      "items.$ref",
      "without end",
    ),
    ({"type": "objekt"}, "type", "not a valid JSON Schema"),
  ],
)
def test_schemas_the_compiler_would_not_enforce_are_refused_naming_the_keyword(compiler, schema, param, words):
  error = refusal(lambda: compiler.json_schema(schema))
  assert error.param == param and words in str(error), (error.param, str(error))


def test_size_limits_name_the_size_and_the_limit(compiler, tokenizer):
  schema = SCHEMAS["person"]
  a = compiler.json_schema(schema)
  for limit, size in (("max_states", a.num_states), ("max_classes", a.num_classes), ("max_edges", a.num_edges)):
    exact = Compiler(tokenizer, narrow=False, **{limit: size - 1})
    message = str(refusal(lambda exact=exact: exact.json_schema(schema)))
    found = re.search(r"compiles to (at least )?(\d+) automaton", message)  # states: counted until it passes
    assert found and size - 1 < int(found[2]) <= size and (found[1] is None or limit == "max_states"), message
    assert f"{limit}={size - 1}" in message and "raise" in message
  narrowed = Compiler(tokenizer, max_states=a.num_states - 1).json_schema(schema)  # a subset that fits instead
  assert narrowed.num_states < a.num_states and "written as a subset" in narrowed.warnings[0], narrowed.warnings
  tiny = refusal(lambda: Compiler(tokenizer, max_states=4).json_schema(schema))  # refused before anything is built
  assert "max_states=4" in str(tiny) and tiny.param == "properties.name.maxLength"
  assert "not valid JSON" in str(refusal(lambda: Compiler(tokenizer).json_schema('{"type": ')))


# ----------------------------------------------------------------------------------------------- the cache


def test_the_cache_returns_one_object_per_constraint_and_tokenizer(tokenizer):
  compiler = Compiler(tokenizer, cache_size=2)
  schema = SCHEMAS["rgb_color"]
  first = compiler.json_schema(schema)
  assert compiler.json_schema(json.dumps(schema, indent=2)) is first and first.source == compact(schema)
  reordered = dict(reversed(schema["properties"].items()))
  other = compiler.json_schema({**schema, "properties": reordered})  # key order is the output's order
  assert other.key != first.key and not other.accepts(tokenizer.encode(compact(EXAMPLES["rgb_color"])) + [3])
  results = []
  threads = [threading.Thread(target=lambda: results.append(compiler.regex(REGEXES["hex_color"]))) for _ in range(4)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert len({id(r) for r in results}) == 1
  assert compiler.json_schema(schema) is not first  # evicted: cache_size=2
  assert str(refusal(lambda: compiler.regex("a("))) == str(refusal(lambda: compiler.regex("a(")))

  texts = ["def f(x):\n  return {'a': [x, 2.5, None]}\n" * 3, "the quick brown fox jumps over the lazy dog " * 9]
  small = Compiler(train_tokenizer(texts, 400)).json_schema(schema)
  assert small.key != first.key and small.source == first.source and len(small.classes) != len(first.classes)
