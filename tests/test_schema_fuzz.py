"""Random schemas (hypothesis): whatever the compiler accepts, every text it writes validates. The schemas mix the
keywords whose interplay is easiest to get wrong: not, if/then/else, oneOf, allOf, anyOf, contains, prefixItems,
unevaluated*, dependentSchemas, propertyNames, patternProperties, bounds, steps, lengths and enums. A few dozen by
default; a thousand with ``-m slow``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from test_automaton import TOKENIZER

from mercury_jax.constrain import Compiler, ConstraintError, conformance
from mercury_jax.data.tokenizer import Tokenizer

TOKENS = Tokenizer.load(TOKENIZER)
COMPILER = Compiler(TOKENS, max_states=2048)
NAMES = st.sampled_from(["a", "b", "c"])


def _leaf():
  number = st.fixed_dictionaries(
    {"type": st.sampled_from(["integer", "number"])},
    optional={
      "minimum": st.integers(-5, 5),
      "exclusiveMaximum": st.integers(-5, 10),
      "multipleOf": st.sampled_from([2, 3, 0.5, 0.25]),
    },
  )
  string = st.fixed_dictionaries(
    {"type": st.just("string")},
    optional={
      "maxLength": st.integers(0, 4),
      "minLength": st.integers(0, 3),
      "pattern": st.sampled_from(["^a", "b$", "[0-9]", "^[ab]*$", "x|y"]),
    },
  )
  constants = st.one_of(
    st.fixed_dictionaries({"enum": st.lists(st.sampled_from([0, 1, "a", "b", None, True, [1], {"a": 1}]), min_size=1)}),
    st.fixed_dictionaries({"const": st.sampled_from([0, "a", False, {"b": 2}])}),
  )
  kinds = st.fixed_dictionaries({"type": st.sampled_from(["null", "boolean", "object", "array", "string"])})
  return st.one_of(number, string, constants, kinds, st.booleans())


def _schemas():
  def extend(inner):
    objects = st.fixed_dictionaries(
      {"type": st.just("object")},
      optional={
        "properties": st.dictionaries(NAMES, inner, max_size=2),
        "required": st.lists(NAMES, max_size=2, unique=True),
        "additionalProperties": inner,
        "patternProperties": st.dictionaries(st.sampled_from(["^a", "b"]), inner, max_size=1),
        "propertyNames": st.sampled_from([{"maxLength": 1}, {"pattern": "^[ab]"}, {"enum": ["a", "c"]}]),
        "dependentSchemas": st.dictionaries(NAMES, inner, max_size=1),
        "unevaluatedProperties": st.booleans(),
        "maxProperties": st.integers(0, 3),
      },
    )
    arrays = st.fixed_dictionaries(
      {"type": st.just("array")},
      optional={
        "prefixItems": st.lists(inner, max_size=2),
        "items": inner,
        "contains": inner,
        "maxContains": st.integers(0, 2),
        "minItems": st.integers(0, 2),
        "maxItems": st.integers(0, 3),
        "unevaluatedItems": st.booleans(),
      },
    )
    logic = st.one_of(
      st.fixed_dictionaries({"not": inner}),
      st.fixed_dictionaries({"if": inner, "then": inner}, optional={"else": inner}),
      st.fixed_dictionaries({"oneOf": st.lists(inner, min_size=2, max_size=3)}),
      st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=1, max_size=3)}),
      st.fixed_dictionaries({"allOf": st.lists(inner, min_size=1, max_size=2)}),
    )
    return objects | arrays | logic

  return st.recursive(_leaf(), extend, max_leaves=6)


def _check(schema):
  try:
    automaton = COMPILER.json_schema(schema)
  except ConstraintError as e:
    assert "\n" not in str(e), str(e)
    return
  check = conformance.validator(schema, "2020-12")
  rng = np.random.default_rng(len(json.dumps(schema)))
  for _ in range(4):
    text = conformance.sample(automaton, TOKENS, rng, max_tokens=60)
    assert not conformance.errors(check, conformance.parse(text)), (json.dumps(schema), text)


SETTINGS = {"deadline": None, "derandomize": True, "suppress_health_check": [HealthCheck.too_slow]}


@settings(max_examples=40, **SETTINGS)
@given(_schemas())
def test_every_text_of_a_random_schema_validates(schema):
  _check(schema)


@pytest.mark.slow
@settings(max_examples=1000, **SETTINGS)
@given(_schemas())
def test_every_text_of_a_thousand_random_schemas_validates(schema):
  _check(schema)
