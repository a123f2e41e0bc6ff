"""JSON Schema keywords beyond the core (mercury_jax.constrain.schema's module docstring): recursive $ref, decimal
bounds, multipleOf, nullable, patternProperties, uniqueItems, oneOf, the deep json_object, and refusals.

Each keyword: random texts of its automaton validate (``jsonschema`` in exact decimals, with OpenAPI's ``nullable``
read as "or null"), and texts that break the keyword are rejected. The compiler has the server's default capacity,
which realistic tool schemas must fit.
"""

from __future__ import annotations

import json
from decimal import Decimal

import jsonschema
import pytest
from test_automaton import TOKENIZER, random_texts, seed_of

from mercury_jax.constrain import Compiler, ConstraintError
from mercury_jax.constrain.suite import EXTENDED, EXTENDED_EXAMPLES
from mercury_jax.data.tokenizer import Tokenizer

SERVER = {"max_states": 512, "max_classes": 256, "max_edges": 16384}  # mercury_jax/serve/slots.py DEFAULT_CAPACITY


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
  return Tokenizer.load(TOKENIZER)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> Compiler:
  return Compiler(tokenizer, **SERVER)


def openapi(schema):
  """``schema`` with ``nullable: true`` spelled as JSON Schema: ``anyOf`` of the schema and null."""
  if isinstance(schema, list):
    return [openapi(s) for s in schema]
  if not isinstance(schema, dict):
    return schema
  out = {k: openapi(v) for k, v in schema.items() if k != "nullable"}
  return {"anyOf": [out, {"type": "null"}]} if schema.get("nullable") is True else out


def valid(schema: dict, text: str) -> bool:
  """Whether ``text`` validates, in exact decimals (``0.3`` is a multiple of ``0.1``)."""
  exact = json.loads(json.dumps(openapi(schema)), parse_float=Decimal)
  return jsonschema.validators.validator_for(exact)(exact).is_valid(json.loads(text, parse_float=Decimal))


def text_of(value) -> str:
  """A string is JSON text already (``'"a"'`` is the string a); anything else is a value."""
  return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


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
    ({"properties": {"again": {"$ref": "#"}}, "required": ["again"]}, "properties.again.$ref"),
    ({"$defs": {"loop": {"$ref": "#/$defs/loop"}}, "$ref": "#/$defs/loop"}, "$ref"),
  ],
)
def test_a_recursion_that_cannot_end_is_refused_naming_where_it_recurs(compiler, schema, param):
  error = refusal(lambda: compiler.json_schema(schema))
  assert error.param == param and "recurses without end" in str(error), (error.param, str(error))


def test_recursion_too_big_for_the_limits_is_unrolled_less(compiler, tokenizer):
  """The search filter (two recursive arrays per level) needs more than 4 × 512 states at four levels: three it is.
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


def test_multiple_of_that_cannot_be_enumerated_is_refused(compiler):
  for schema, words in (
    ({"type": "number", "multipleOf": 0.3, "minimum": 0}, "needs 'minimum' and 'maximum'"),
    ({"type": "number", "multipleOf": 0.3, "minimum": 0, "maximum": 1000}, "leaves 3334 values"),
    ({"type": "number", "multipleOf": 0.3, "minimum": 0.1, "maximum": 0.2}, "leaves 0 values"),
  ):
    error = refusal(lambda schema=schema: compiler.json_schema({"properties": {"x": schema}}))
    assert error.param == "properties.x.multipleOf" and words in str(error), str(error)


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


def test_nullable_branches_of_one_of_overlap_on_null(compiler):
  schema = {"oneOf": [{"type": "string", "nullable": True}, {"type": "integer", "nullable": True}]}
  assert "may both match" in str(refusal(lambda: compiler.json_schema(schema)))


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
  check(compiler, tokenizer, overlapping, [{"ab": 5, "a": 1, "cb": 2}], [{"ab": 10}, {"ab": -1}, {"a": 10}], n=16)
  named = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 2}},
    "patternProperties": {"^[a-z]+$": {"type": "string"}},
  }  # a written key may be "name": every pattern value is at most 2 long
  check(compiler, tokenizer, named, [{"name": "ab", "x": "cd"}], [{"name": "abc"}, {"x": "abc"}], n=16)


def test_pattern_properties_that_cannot_hold_together_are_refused(compiler):
  named = {
    "type": "object",
    "properties": {"id": {"type": "integer"}},
    "patternProperties": {"^[a-z]+$": {"type": "string"}},
  }
  error = refusal(lambda: compiler.json_schema(named))
  assert error.param == "properties.id" and "matches patternProperties '^[a-z]+$'" in str(error), str(error)
  overlapping = {"type": "object", "patternProperties": {"^a": {"type": "integer"}, "b$": {"type": "string"}}}
  error = refusal(lambda: compiler.json_schema(overlapping))
  assert error.param == "patternProperties.^a" and "may also match pattern 'b$'" in str(error), str(error)
  unsafe = {"type": "object", "patternProperties": {"^.+$": {"type": "string"}}}
  error = refusal(lambda: compiler.json_schema(unsafe))
  assert error.param == "patternProperties.^.+$" and "must escape" in str(error), str(error)


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


def test_unique_items_without_a_small_set_is_refused(compiler, tokenizer):
  for items in ({"type": "string"}, {"type": "integer", "minimum": 0}, {"type": "object"}):
    schema = {"properties": {"tags": {"type": "array", "items": items, "uniqueItems": True}}}
    error = refusal(lambda schema=schema: compiler.json_schema(schema))
    assert error.param == "properties.tags.uniqueItems" and "finite set" in str(error), str(error)
  wide = {"type": "array", "items": {"enum": list("abcdefghij")}, "uniqueItems": True, "minItems": 3, "maxItems": 5}
  assert refusal(lambda: compiler.json_schema(wide)).param == "uniqueItems"
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
  "branches,pair",
  [
    ([{"type": "object", "properties": {"a": {}}}, {"type": "object", "properties": {"b": {}}}], "0 and 1"),
    ([{"type": "string"}, {"type": "integer"}, {"type": "string", "pattern": "^a"}], "0 and 2"),
    ([{"type": "number", "minimum": 0}, {"type": "integer", "maximum": 0}], "0 and 1"),
  ],
)
def test_one_of_with_branches_that_may_overlap_is_refused_naming_them(compiler, branches, pair):
  error = refusal(lambda: compiler.json_schema({"oneOf": branches}))
  assert error.param == "oneOf" and f"branches {pair} may both match" in str(error), str(error)


# ----------------------------------------------------------------------------------------------- json_object


def deep(depth: int):
  value = 1
  for level in range(depth):
    value = {"k": value} if level % 2 else [value, "x"]
  return {"top": value}


def test_json_object_nests_four_deep_in_the_server_capacity(compiler, tokenizer):
  automaton = compiler.json_object()
  assert automaton.num_states <= SERVER["max_states"]
  assert accepts(automaton, tokenizer, deep(3)) and not accepts(automaton, tokenizer, deep(4))
  for text in random_texts(automaton, tokenizer, seed=5, n=8):
    assert isinstance(json.loads(text), dict)
  small = Compiler(tokenizer, max_states=200, max_classes=256, max_edges=16384).json_object()  # as deep as fits
  assert accepts(small, tokenizer, deep(2)) and not accepts(small, tokenizer, deep(3))


# ----------------------------------------------------------------------------------------------- the suite


@pytest.mark.parametrize("name", list(EXTENDED))
def test_extended_suite_schemas_fit_the_server_capacity(compiler, tokenizer, name):
  automaton = check(compiler, tokenizer, EXTENDED[name], [EXTENDED_EXAMPLES[name]], [], n=4)
  assert automaton.distance[automaton.start] <= 88


@pytest.mark.parametrize(
  "keyword,schema",
  [
    ("not", {"not": {"type": "string"}}),
    ("if", {"if": {"type": "string"}, "then": {"maxLength": 2}}),
    ("propertyNames", {"type": "object", "propertyNames": {"maxLength": 3}}),
    ("dependentRequired", {"type": "object", "dependentRequired": {"a": ["b"]}}),
    ("contains", {"type": "array", "contains": {"const": 1}}),
    ("unevaluatedProperties", {"type": "object", "unevaluatedProperties": False}),
  ],
)
def test_unsupported_keywords_are_refused_naming_their_path(compiler, keyword, schema):
  error = refusal(lambda: compiler.json_schema({"type": "object", "properties": {"p": schema}}))
  assert error.param == f"properties.p.{keyword}" and "not enforced" in str(error), (error.param, str(error))
