"""JSON Schema keywords (docs/schema_coverage.md): recursive $ref, decimal bounds, multipleOf, nullable,
patternProperties, uniqueItems, oneOf, the deep json_object, and refusals. The complements and the newer keywords
(not, if, contains, unevaluated*, ...) are in test_schema_logic.py.

Each keyword: random texts of its automaton validate (``jsonschema`` in exact decimals, in the draft the compiler
reads the schema in, OpenAPI's ``nullable`` read as "or null"), and texts that break the keyword are rejected. The
compiler has the server's default capacity, which realistic tool schemas must fit.
"""

from __future__ import annotations

import json

import pytest
from test_automaton import TOKENIZER, random_texts, seed_of

from mercury_jax.constrain import Compiler, ConstraintError, conformance
from mercury_jax.constrain.suite import EXTENDED, EXTENDED_EXAMPLES
from mercury_jax.data.tokenizer import Tokenizer

SERVER = {"max_states": 512, "max_classes": 256, "max_edges": 16384}  # mercury_jax/serve/slots.py DEFAULT_CAPACITY


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
  return Tokenizer.load(TOKENIZER)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> Compiler:
  return Compiler(tokenizer, **SERVER)


def valid(schema, text: str) -> bool:
  """Whether ``text`` validates, numbers read exactly (``0.3`` is a multiple of ``0.1``), every number readable."""
  return not conformance.errors(conformance.validator(schema, "auto"), conformance.parse(text))


def text_of(value) -> str:
  """A string is JSON text already (``'"a"'`` is the string a); anything else is a value."""
  return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def accepts(automaton, tokenizer, value) -> bool:
  """Whether the automaton accepts the tokenizer's own tokenisation of ``value`` (a value, or JSON text)."""
  return automaton.accepts(tokenizer.encode(text_of(value)) + [tokenizer.eos_id])


def check(compiler, tokenizer, schema: dict, good: list, bad: list, n: int = 8):
  """Random texts are valid; ``good`` values are valid and accepted; ``bad`` ones are rejected (and, unless they
  are merely never written, invalid)."""
  automaton = compiler.json_schema(schema)
  for text in random_texts(automaton, tokenizer, seed_of(json.dumps(schema)), n=n):
    assert valid(schema, text), text
  for value in good:
    assert valid(schema, text_of(value)) and accepts(automaton, tokenizer, value), value
  for value in bad:
    assert not accepts(automaton, tokenizer, value), value
  return automaton


def refusal(compile_) -> ConstraintError:
  with pytest.raises(ConstraintError) as error:
    compile_()
  assert "\n" not in str(error.value) and len(str(error.value)) < 400
  return error.value


def nested(depth: int, leaf="x"):
  """A tree ``depth`` levels deep: {"name": ..., "children": [...]}."""
  node = {"name": leaf}
  for _ in range(depth - 1):
    node = {"name": leaf, "children": [node]}
  return node


TREE = {
  "$defs": {
    "node": {
      "type": "object",
      "properties": {"name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
      "required": ["name"],
    }
  },
  "$ref": "#/$defs/node",
}


# ----------------------------------------------------------------------------------------------- recursion


def test_recursive_ref_is_unrolled_to_the_depth(compiler, tokenizer):
  check(compiler, tokenizer, TREE, [nested(1), nested(4)], [nested(5)])
  shallow = Compiler(tokenizer, **SERVER, recursion_depth=2)
  assert accepts(shallow.json_schema(TREE), tokenizer, nested(2))
  assert not accepts(shallow.json_schema(TREE), tokenizer, nested(3))


@pytest.mark.parametrize(
  "schema,good,bad",
  [
    (  # the recursive branch of an anyOf
      {
        "$defs": {
          "item": {
            "type": "object",
            "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/item"}, {"type": "null"}]}},
            "required": ["v", "next"],
          }
        },
        "$ref": "#/$defs/item",
      },
      [{"v": 1, "next": {"v": 2, "next": {"v": 3, "next": {"v": 4, "next": None}}}}],
      [{"v": 1, "next": {"v": 2, "next": {"v": 3, "next": {"v": 4, "next": {"v": 5, "next": None}}}}}],
    ),
    (  # an optional property, and the root as its own definition
      {"type": "object", "properties": {"up": {"$ref": "#"}, "n": {"type": "boolean"}}, "required": ["n"]},
      [{"up": {"up": {"up": {"n": True}, "n": True}, "n": False}, "n": True}],
      [{"up": {"up": {"up": {"up": {"n": True}, "n": True}, "n": False}, "n": True}, "n": True}],
    ),
    (  # additional properties, nullable, allOf, and two definitions that refer to each other
      {
        "$defs": {
          "a": {"type": "object", "additionalProperties": {"$ref": "#/$defs/b"}},
          "b": {"allOf": [{"$ref": "#/$defs/a"}], "nullable": True},
        },
        "$ref": "#/$defs/a",
      },
      [{"k": {"k": {"k": {"k": None}}}}, {"k": None, "j": {}}],
      [{"k": {"k": {"k": {"k": {}}}}}],
    ),
  ],
  ids=["anyOf", "optional", "mutual"],
)
def test_recursion_is_cut_where_the_schema_allows(compiler, tokenizer, schema, good, bad):
  check(compiler, tokenizer, schema, good, bad)


@pytest.mark.parametrize(
  "schema,param",
  [
    (
      {"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": 1}}, "$ref": "#/$defs/n"},
      "items.$ref",
    ),
    ({"type": "object", "properties": {"again": {"$ref": "#"}}, "required": ["again"]}, "properties.again.$ref"),
    ({"$defs": {"loop": {"$ref": "#/$defs/loop"}}, "$ref": "#/$defs/loop"}, "$ref"),
  ],
)
def test_a_recursion_that_cannot_end_is_refused_naming_where_it_recurs(compiler, schema, param):
  error = refusal(lambda: compiler.json_schema(schema))
  assert error.param == param and "recurses without end" in str(error), (error.param, str(error))


def test_recursion_too_big_for_the_limits_is_unrolled_less(compiler, tokenizer):
  """The search filter (two recursive arrays per level) needs more than 512 states at four levels: three it is.
  A tree of four levels is built and found too big for 50 states, then three levels fit."""
  automaton = compiler.json_schema(EXTENDED["search_filter"])
  level = {"field": "a", "op": "eq", "value": 1}
  for _ in range(2):
    level = {"any": [level]}
  assert accepts(automaton, tokenizer, {"collection": "orders", "filter": level})
  assert not accepts(automaton, tokenizer, {"collection": "orders", "filter": {"all": [level]}})
  small = Compiler(tokenizer, max_states=50, max_classes=256, max_edges=16384).json_schema(TREE)
  assert accepts(small, tokenizer, nested(3)) and not accepts(small, tokenizer, nested(4))


# ----------------------------------------------------------------------------------------------- numbers


GRID = [f"{sign}{whole}{fraction}" for sign in ("", "-") for whole in range(13) for fraction in ("", ".0", ".5")]
GRID = [text for text in GRID if text not in ("-0", "-0.0")]  # valid JSON, never written (0 is written 0)
GRID += ["0.01", "0.1", "0.25", "0.49", "0.499", "0.5000", "2.2", "2.24", "2.249", "2.25", "2.251", "-0.25", "1e1"]


@pytest.mark.parametrize(
  "schema",
  [
    {"type": "number", "minimum": 0.5, "exclusiveMaximum": 2.25},
    {"type": "number", "exclusiveMinimum": -0.25, "maximum": 10.5},
    {"type": "number", "minimum": -3.5, "maximum": -0.25},
    {"type": "number", "minimum": 0.249, "maximum": 0.5},
    {"type": "integer", "exclusiveMinimum": 0.5, "maximum": 7.5},
    {"type": "number", "multipleOf": 0.01, "minimum": 0, "maximum": 10},
    {"type": "number", "multipleOf": 0.1},
    {"type": "number", "multipleOf": 1, "exclusiveMaximum": 5},
    {"type": "number", "multipleOf": 10},
    {"type": "number", "multipleOf": 0.5, "minimum": -1, "maximum": 3},
    {"type": "number", "multipleOf": 0.25, "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    {"type": "integer", "multipleOf": 1.5, "minimum": -5, "maximum": 12},
    {"type": "integer", "multipleOf": 0.5},
    {"type": "integer", "multipleOf": 100},
  ],
  ids=lambda schema: ",".join(f"{k}={v}" for k, v in schema.items() if k != "type"),
)
def test_decimal_bounds_and_steps_accept_exactly_the_valid_numbers(compiler, tokenizer, schema):
  automaton = check(compiler, tokenizer, schema, [], [])
  for text in GRID:
    assert accepts(automaton, tokenizer, text) == (valid(schema, text) and "e" not in text), text


@pytest.mark.parametrize(
  "schema,good,bad",
  [
    ({"type": "number", "multipleOf": 0.3}, ["0", "0.3", "-0.9", "3", "1.50", "300.00"], ["0.1", "1", "0.31"]),
    ({"type": "integer", "multipleOf": 7}, ["0", "-14", "700"], ["1", "-15", "7.5"]),
    ({"type": "number", "multipleOf": 1.5, "exclusiveMinimum": 0}, ["1.5", "3", "4.50"], ["0", "-1.5", "2"]),
    ({"type": "number", "multipleOf": 0.0075, "maximum": 0.02}, ["0.0075", "0.015", "-0.03"], ["0.0225", "0.01"]),
    ({"type": "integer", "multipleOf": 123456789, "minimum": 0, "maximum": 10**9}, ["0", "246913578"], ["1"]),
  ],
)
def test_any_decimal_step_is_read_digit_by_digit(compiler, tokenizer, schema, good, bad):
  """The digits are read modulo the step (as p / 10**k); a step too large for that is listed between both bounds."""
  check(compiler, tokenizer, schema, good, bad)


def test_a_step_too_large_to_read_without_bounds_is_refused_naming_multiple_of(compiler):
  for schema in ({"type": "integer", "multipleOf": 123456789}, {"type": "number", "multipleOf": 0.123456789}):
    error = refusal(lambda schema=schema: compiler.json_schema({"properties": {"x": schema}}))
    assert error.param == "properties.x.multipleOf" and "give it both minimum and maximum" in str(error), str(error)


# ----------------------------------------------------------------------------------------------- nullable


def test_nullable_adds_null(compiler, tokenizer):
  check(compiler, tokenizer, {"type": "string", "nullable": True, "maxLength": 3}, [None, '"abc"'], ['"abcd"', 1])
  check(compiler, tokenizer, {"type": "integer", "nullable": False}, [3], [None])
  check(compiler, tokenizer, {"enum": ["a", "b"], "nullable": True}, ['"a"', None], ['"c"'])
  defs = {"$defs": {"id": {"type": "integer", "minimum": 1}}}
  parent = {**defs, "properties": {"id": {"$ref": "#/$defs/id", "nullable": True}}, "required": ["id"]}
  check(compiler, tokenizer, parent, [{"id": 1}, {"id": None}], [{"id": 0}])
  # Every part of an allOf must let null through for the whole to.
  check(compiler, tokenizer, {"allOf": [{"type": "string", "nullable": True}, {"maxLength": 2}]}, [None, '"ab"'], [])
  check(compiler, tokenizer, {"allOf": [{"type": "string", "nullable": True}, {"type": "string"}]}, ['"a"'], [None])


def test_nullable_branches_of_one_of_overlap_on_null_which_is_left_out(compiler, tokenizer):
  schema = {"oneOf": [{"type": "string", "nullable": True}, {"type": "integer", "nullable": True}]}
  check(compiler, tokenizer, schema, ['"a"', 3], [None])


# ----------------------------------------------------------------------------------------------- patternProperties


def test_pattern_properties_write_keys_matching_a_pattern(compiler, tokenizer):
  headers = {
    "type": "object",
    "patternProperties": {"^[A-Za-z][A-Za-z-]*$": {"type": "string"}},
    "additionalProperties": False,
  }
  check(compiler, tokenizer, headers, [{}, {"Accept": "x", "X-Id": "7"}], [{"1a": "x"}, {"Accept": 1}])
  extensions = {
    "type": "object",
    "properties": {"id": {"type": "integer"}},
    "required": ["id"],
    "patternProperties": {"^x-[a-z]+$": {"type": "string"}},
    "maxProperties": 3,
  }
  good = [{"id": 1}, {"id": 1, "x-a": "b", "x-c": "d"}]
  check(compiler, tokenizer, extensions, good, [{"x-a": "b"}, {"id": 1, "x-a": 2}, {"id": 1, "y": "b"}])
  assert not accepts(compiler.json_schema(extensions), tokenizer, {"id": 1, "x-a": "b", "x-c": "d", "x-e": "f"})


def test_pattern_properties_also_satisfy_the_patterns_and_properties_that_match(compiler, tokenizer):
  overlapping = {
    "type": "object",
    "patternProperties": {"^a": {"type": "integer", "minimum": 0}, "b$": {"type": "integer", "maximum": 9}},
  }  # keys that start with a and end with b must hold both, so every value written for either does
  good = [{"ab": 5, "a": 1, "cb": 2}, {"a": 10}, {"cb": -3}]  # a key either pattern alone finds needs its schema only
  check(compiler, tokenizer, overlapping, good, [{"ab": 10}, {"ab": -1}, {"a": -1}, {"b": 10}], n=16)
  named = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 2}},
    "patternProperties": {"^[a-z]+$": {"type": "string"}},
  }  # "name" is also found by the pattern: its value is a string of at most 2; other names any string
  check(compiler, tokenizer, named, [{"name": "ab", "x": "cde"}], [{"name": "abc"}, {"x": 1}, {"name": 1}], n=16)


def test_names_whose_schemas_cannot_hold_together_are_never_written(compiler, tokenizer):
  """A listed property whose name a pattern finds must satisfy both schemas: integer and string cannot, so "id" is
  never written; keys both patterns find, likewise. Names that need escaping are written escaped."""
  named = {
    "type": "object",
    "properties": {"id": {"type": "integer"}},
    "patternProperties": {"^[a-z]+$": {"type": "string"}},
  }
  check(compiler, tokenizer, named, [{}, {"ab": "x"}], [{"id": 1}, {"id": "x"}, {"ab": 1}])
  overlapping = {"type": "object", "patternProperties": {"^a": {"type": "integer"}, "b$": {"type": "string"}}}
  check(compiler, tokenizer, overlapping, [{"a": 1, "b": "x"}], [{"ab": 1}, {"ab": "x"}])
  escaped = {"type": "object", "patternProperties": {"^.+$": {"type": "string"}}, "minProperties": 1}
  check(compiler, tokenizer, escaped, ['{"a\\"b":"c"}', {"x": "y"}], [{"x": 1}, {}])


def test_min_properties_over_further_members_writes_names_that_cannot_repeat(compiler, tokenizer):
  """Further members may repeat a name (the last one counts), so where minProperties needs two or more of them
  they are written with names of distinct lengths: {"a": .., "bb": ..}, never {"a": .., "a": ..}."""
  free = {"type": "object", "additionalProperties": True, "minProperties": 3}
  automaton = check(compiler, tokenizer, free, [{"a": 1, "bb": [], "ccc": None}], [{"a": 1, "b": 2, "c": 3}], n=16)
  assert not accepts(automaton, tokenizer, '{"a":1,"a":2,"a":3}') and not accepts(automaton, tokenizer, {"a": 1})
  listed = {"properties": {"id": {"type": "integer"}}, "additionalProperties": {"type": "string"}, "minProperties": 3}
  check(compiler, tokenizer, listed, [{"id": 1, "a": "x", "bb": "y"}, {"a": "x", "bb": "y", "ccc": "z"}], [])
  assert not accepts(compiler.json_schema(listed), tokenizer, '{"id":1,"a":"x","a":"y"}')
  bounded = {"type": "object", "patternProperties": {"^x-": {"type": "string"}}, "additionalProperties": False}
  check(compiler, tokenizer, {**bounded, "minProperties": 2, "maxProperties": 3}, [{"x-": "", "x-a": ""}], [{}])


# ----------------------------------------------------------------------------------------------- uniqueItems


def test_unique_items_from_a_small_set_in_any_order(compiler, tokenizer):
  scopes = {"type": "array", "items": {"enum": ["read", "write", "admin"]}, "uniqueItems": True}
  good = [[], ["admin"], ["write", "read"], ["admin", "read", "write"]]
  check(compiler, tokenizer, scopes, good, [["read", "read"], ["read", "write", "read"], ["root"]])
  flags = {"type": "array", "items": {"type": ["boolean", "null"]}, "uniqueItems": True, "minItems": 2}
  check(compiler, tokenizer, flags, [[True, None], [None, False, True]], [[True], [True, True], [None, None]])
  ints = {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 4}, "uniqueItems": True}
  check(compiler, tokenizer, ints, [[4, 1, 3]], [[1, 1], [0], [5]])
  numbers = {"type": "array", "items": {"enum": [1, 1.0, 2, True]}, "uniqueItems": True}  # 1 == 1.0, true != 1
  check(compiler, tokenizer, numbers, [[1, True], [2, 1]], [[1, 1.0], [1.0]])


def test_unique_items_from_a_larger_set_in_its_order(compiler, tokenizer):
  letters = {"type": "array", "items": {"enum": list("abcdefghij")}, "uniqueItems": True}
  check(compiler, tokenizer, letters, [["a", "c", "j"], list("abcdefghij")], [["c", "a"], ["a", "a"]])
  few = {**letters, "minItems": 2, "maxItems": 3}  # 165 arrays in the set's order
  check(compiler, tokenizer, few, [["b", "d"], ["a", "b", "c"]], [["a"], ["a", "b", "c", "d"], ["d", "b"]])


def test_unique_items_without_a_small_set_is_written_as_one_item_or_refused_without_narrowing(compiler, tokenizer):
  """An automaton cannot remember an unbounded set of earlier items: such arrays are written with at most one item
  (always unique; named in the warning line), or refused with narrow=False and where minItems needs two."""
  exact = Compiler(tokenizer, **SERVER, narrow=False)
  for items in ({"type": "string"}, {"type": "integer", "minimum": 0}, {"type": "object"}):
    schema = {"properties": {"tags": {"type": "array", "items": items, "uniqueItems": True}}}
    error = refusal(lambda schema=schema: exact.json_schema(schema))
    assert error.param == "properties.tags.uniqueItems" and "finite set" in str(error), str(error)
    narrowed = compiler.json_schema(schema)
    assert "uniqueItems at properties.tags.uniqueItems is written as arrays of at most one item" in narrowed.warnings[0]
  tags = {"properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}
  check(compiler, tokenizer, tags, [{"tags": []}, {"tags": ["a"]}], [{"tags": ["a", "a"]}, {"tags": ["a", "b"]}])
  two = {"type": "array", "items": {"type": "string"}, "uniqueItems": True, "minItems": 2}
  assert refusal(lambda: compiler.json_schema(two)).param == "uniqueItems"
  wide = {"type": "array", "items": {"enum": list("abcdefghij")}, "uniqueItems": True, "minItems": 3, "maxItems": 5}
  assert refusal(lambda: exact.json_schema(wide)).param == "uniqueItems"
  one = {"type": "array", "items": {"type": "string"}, "uniqueItems": True, "maxItems": 1}  # always unique
  check(compiler, tokenizer, one, [[], ["a"]], [["a", "b"]])


# ----------------------------------------------------------------------------------------------- oneOf


@pytest.mark.parametrize(
  "branches,good",
  [
    (  # each requires a property the other never writes
      [
        {"type": "object", "properties": {"card": {"type": "string"}}, "required": ["card"]},
        {"type": "object", "properties": {"iban": {"type": "string"}}, "required": ["iban"]},
      ],
      [{"card": "1"}, {"iban": "2"}],
    ),
    (  # a property both require, with values of different types
      [
        {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
        {"type": "object", "properties": {"id": {"type": "string"}, "x": {}}, "required": ["id"]},
      ],
      [{"id": 1}, {"id": "1", "x": 2}],
    ),
    (  # ranges that do not meet
      [{"type": "number", "maximum": 1.5}, {"type": "integer", "exclusiveMinimum": 1.5}],
      ["1.5", "2", "-7.25"],
    ),
    (  # patterns that share no text, and an enum none of whose values the other allows
      [{"type": "string", "pattern": "^[0-9]+$"}, {"type": "string", "pattern": "^[a-z]+$"}, {"enum": ["AUTO"]}],
      ['"12"', '"ab"', '"AUTO"'],
    ),
  ],
  ids=["required", "property", "ranges", "patterns"],
)
def test_one_of_is_enforced_when_the_branches_exclude_each_other(compiler, tokenizer, branches, good):
  check(compiler, tokenizer, {"oneOf": branches}, good, [])


@pytest.mark.parametrize(
  "branches,good,bad",
  [
    (  # an object with a but not b, or b but not a
      [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]},
      ],
      [{"a": 1}, {"b": 2}],
      [{"a": 1, "b": 2}],
    ),
    ([{"type": "string"}, {"type": "integer"}, {"type": "string", "pattern": "^a"}], ['"bc"', 3], ['"ab"']),
    ([{"type": "number", "minimum": 0}, {"type": "integer", "maximum": 0}], ["0.5", "-1", "7"], ["0"]),
  ],
)
def test_one_of_with_branches_that_overlap_writes_each_branch_without_the_others(
  compiler, tokenizer, branches, good, bad
):
  check(compiler, tokenizer, {"oneOf": branches}, good, bad)


def test_one_of_that_no_value_satisfies_is_refused(compiler):
  """Every object satisfies both branches (properties alone constrain nothing present), so none satisfies just one."""
  both = [{"type": "object", "properties": {"a": {}}}, {"type": "object", "properties": {"b": {}}}]
  assert "accepts no value" in str(refusal(lambda: compiler.json_schema({"oneOf": both})))


# ----------------------------------------------------------------------------------------------- json_object


def deep(depth: int):
  value = 1
  for level in range(depth):
    value = {"k": value} if level % 2 else [value, "x"]
  return {"top": value}


def test_json_object_nests_as_deep_as_the_capacity_allows(compiler, tokenizer):
  """Four containers deep with the library's limits; three in the server's default capacity (numbers have bounded
  digits, which costs states at every depth); two in 200 states."""
  automaton = Compiler(tokenizer).json_object()
  assert accepts(automaton, tokenizer, deep(3)) and not accepts(automaton, tokenizer, deep(4))
  served = compiler.json_object()
  assert served.num_states <= SERVER["max_states"]
  assert accepts(served, tokenizer, deep(2)) and not accepts(served, tokenizer, deep(3))
  for text in random_texts(served, tokenizer, seed=5, n=8):
    assert isinstance(conformance.parse(text), dict)
  small = Compiler(tokenizer, max_states=200, max_classes=256, max_edges=16384).json_object()
  assert accepts(small, tokenizer, deep(1)) and not accepts(small, tokenizer, deep(2))


# ----------------------------------------------------------------------------------------------- the suite


@pytest.mark.parametrize("name", list(EXTENDED))
def test_extended_suite_schemas_fit_the_server_capacity(compiler, tokenizer, name):
  automaton = check(compiler, tokenizer, EXTENDED[name], [EXTENDED_EXAMPLES[name]], [], n=4)
  assert automaton.distance[automaton.start] <= 88
