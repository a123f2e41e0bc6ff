"""JSON Schema's logic and the newer keywords (docs/schema_coverage.md): not, if/then/else, oneOf's complements,
contains, propertyNames, the dependencies, unevaluated*, references ($anchor, $id, urn:, empty keys), boolean schemas,
tuples that stop early, the draft a schema is read in, keywords and formats the compiler does not know, formats with
lengths, patterns that match characters JSON escapes, and numbers a parser can read.

Each case: random texts of the automaton validate (``jsonschema``, numbers as ``Decimal``), the ``good`` values are
accepted and the ``bad`` ones rejected (test_schema_keywords.check).
"""

from __future__ import annotations

import ipaddress
import json
import re
import urllib.parse
import warnings
from pathlib import Path

import pytest
from cpu_clock import cpu_seconds
from test_automaton import random_texts, seed_of
from test_schema_keywords import SERVER, accepts, check, refusal, tokenizer, valid  # noqa: F401  (fixture)

from mercury_jax.constrain import Compiler, ConstraintError, conformance
from mercury_jax.constrain.automaton import SchemaWarning


@pytest.fixture(scope="module")
def compiler(tokenizer) -> Compiler:  # noqa: F811
  return Compiler(tokenizer, **SERVER)


# ----------------------------------------------------------------------------------------------- not, if, oneOf


@pytest.mark.parametrize(
  "schema,good,bad",
  [
    ({"not": {"type": ["string", "object", "array"]}}, [1, None, True], ['"a"', {}, []]),
    ({"type": "integer", "not": {"enum": [1, 2]}}, [0, 3, -1], [1, 2]),
    ({"type": "string", "not": {"enum": ["a", "b"]}, "maxLength": 1}, ['"c"', '""'], ['"a"', '"b"']),
    ({"type": "number", "not": {"minimum": 3}}, ["2.5", "-7"], ["3", "3.5"]),
    ({"type": "string", "not": {"pattern": "^a"}}, ['"ba"', '""'], ['"a"', '"abc"']),
    ({"type": "string", "not": {"maxLength": 2}, "maxLength": 4}, ['"abc"'], ['"ab"', '"abcde"']),
    ({"type": "integer", "not": {"type": "integer", "multipleOf": 2}}, [1, -3], [0, 4]),
    ({"type": "number", "not": {"type": "integer"}}, ["0.5", "-1.25"], ["1", "0"]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "not": {"required": ["a"]}}, [{}], [{"a": 1}]),
    ({"not": {"not": {"type": "boolean"}}}, [True, False], [1, None]),
  ],
)
def test_not_is_the_complement_keyword_by_keyword(compiler, tokenizer, schema, good, bad):  # noqa: F811
  check(compiler, tokenizer, schema, good, bad)


def test_if_then_else(compiler, tokenizer):  # noqa: F811
  schema = {
    "type": "object",
    "properties": {"country": {"enum": ["US", "CA"]}, "code": {"type": "string"}},
    "required": ["country", "code"],
    "if": {"properties": {"country": {"const": "US"}}},
    "then": {"properties": {"code": {"pattern": "^[0-9]{5}$"}}},
    "else": {"properties": {"code": {"pattern": "^[A-Z][0-9][A-Z]$"}}},
  }
  good = [{"country": "US", "code": "12345"}, {"country": "CA", "code": "K1A"}]
  check(compiler, tokenizer, schema, good, [{"country": "US", "code": "K1A"}, {"country": "CA", "code": "12345"}])


# ----------------------------------------------------------------------------------------------- arrays


@pytest.mark.parametrize(
  "schema,good,bad",
  [
    (
      {"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}, "maxItems": 3},
      [[1], [0, 1], [1, 1, 2]],
      [[], [0, 2], [1, 1, 1, 1]],
    ),
    (
      {"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}, "minContains": 2, "maxContains": 2},
      [[1, 1], [1, 0, 1]],
      [[1], [1, 1, 1]],
    ),
    (
      {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
      [[], [1], [1, "a"], [1, "a", 2]],
      [["a"]],
    ),
    ({"type": "array", "prefixItems": [True, False]}, [[], [1]], [[1, 2]]),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False, "minItems": 1}, [[1]], [[], [1, 2]]),
  ],
  ids=["contains", "min-max-contains", "prefix-stops-early", "false-item", "closed-tuple"],
)
def test_arrays_by_position_and_contains(compiler, tokenizer, schema, good, bad):  # noqa: F811
  check(compiler, tokenizer, schema, good, bad)


def test_unevaluated_items_see_the_branch_written(compiler, tokenizer):  # noqa: F811
  schema = {
    "prefixItems": [{"type": "string"}],
    "anyOf": [{"prefixItems": [True, {"type": "integer"}]}, {"prefixItems": [True, True, {"type": "boolean"}]}],
    "unevaluatedItems": False,
  }
  check(compiler, tokenizer, schema, [["a"], ["a", 1], ["a", 1, True]], [["a", 1, True, 2]])


# ----------------------------------------------------------------------------------------------- objects


@pytest.mark.parametrize(
  "schema,good,bad",
  [
    (
      {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}, "additionalProperties": {"type": "integer"}},
      [{}, {"ab": 1}],
      [{"Ab": 1}, {"a1": 2}],
    ),
    (
      {"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}},
      [{}, {"b": 1}, {"a": 1, "b": 2}],
      [{"a": 1}],
    ),
    (
      {
        "type": "object",
        "properties": {"card": {"type": "string"}, "zip": {"type": "string"}},
        "dependentSchemas": {"card": {"required": ["zip"], "properties": {"zip": {"maxLength": 5}}}},
      },
      [{}, {"card": "x", "zip": "12345"}],
      [{"card": "x"}, {"card": "x", "zip": "123456"}],
    ),
    (  # draft 7's dependencies, read as draft 7 (without $schema: dependencies is a draft 7 keyword)
      {"type": "object", "properties": {"a": {}, "b": {}}, "dependencies": {"a": ["b"]}},
      [{}, {"a": 1, "b": 2}],
      [{"a": 1}],
    ),
    (  # a schema and a list side by side: referencing 0.37's crawl took the list for a schema (a crash before)
      {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "dependencies": {"a": {"required": ["b"]}, "b": ["a"]},
      },
      [{}, {"a": 1, "b": 2}],
      [{"a": 1}, {"b": 2}],
    ),
  ],
  ids=["propertyNames", "dependentRequired", "dependentSchemas", "dependencies", "dependencies-mixed"],
)
def test_names_and_dependencies(compiler, tokenizer, schema, good, bad):  # noqa: F811
  check(compiler, tokenizer, schema, good, bad)


def test_unevaluated_properties_see_the_properties_of_the_branch_written(compiler, tokenizer):  # noqa: F811
  schema = {
    "type": "object",
    "properties": {"kind": {"enum": ["a", "b"]}},
    "required": ["kind"],
    "oneOf": [
      {"properties": {"kind": {"const": "a"}, "x": {"type": "integer"}}},
      {"properties": {"kind": {"const": "b"}, "y": {"type": "string"}}},
    ],
    "unevaluatedProperties": False,
  }
  check(compiler, tokenizer, schema, [{"kind": "a", "x": 1}, {"kind": "b", "y": "z"}], [{"kind": "a", "y": "z"}])
  through_not = {"type": "object", "not": {"not": {"properties": {"x": True}}}, "unevaluatedProperties": False}
  check(compiler, tokenizer, through_not, [{}], [{"x": 1}])  # annotations inside `not` are dropped


# ----------------------------------------------------------------------------------------------- references


@pytest.mark.parametrize(
  "schema,good,bad",
  [
    ({"$defs": {"x": {"$anchor": "pos", "type": "integer", "minimum": 1}}, "$ref": "#pos"}, [1], [0]),
    (
      {
        "$id": "http://example.com/root.json",
        "$defs": {"b": {"$id": "other.json", "$defs": {"n": {"type": "integer"}}}},
        "$ref": "other.json#/$defs/n",
      },
      [3],
      ['"3"'],
    ),
    (
      {
        "$id": "urn:uuid:deadbeef-1234-0000-0000-4321feebdaed",
        "$defs": {"s": {"type": "string"}},
        "$ref": "urn:uuid:deadbeef-1234-0000-0000-4321feebdaed#/$defs/s",
      },
      ['"a"'],
      [1],
    ),
    ({"$defs": {"": {"$defs": {"": {"type": "null"}}}}, "$ref": "#/$defs//$defs/"}, [None], [1]),
    (
      {
        "$schema": "http://json-schema.org/draft-04/schema#",
        "id": "http://x/y.json",
        "definitions": {"a": {"id": "#n", "type": "null"}},
        "$ref": "#n",
      },
      [None],
      [1],
    ),
  ],
  ids=["anchor", "id-base", "urn", "empty-keys", "draft4-id"],
)
def test_references_within_the_document(compiler, tokenizer, schema, good, bad):  # noqa: F811
  check(compiler, tokenizer, schema, good, bad)


def test_references_outside_the_document_and_dynamic_ones_are_refused(compiler):
  error = refusal(lambda: compiler.json_schema({"properties": {"a": {"$ref": "http://example.com/x.json"}}}))
  assert error.param == "properties.a.$ref" and "outside the schema" in str(error)
  error = refusal(lambda: compiler.json_schema({"$dynamicRef": "#meta"}))
  assert error.param == "$dynamicRef" and "not supported" in str(error)


def test_boolean_schemas_anywhere(compiler, tokenizer):  # noqa: F811
  check(compiler, tokenizer, True, [1, "a" and '"a"', None, {}], [])
  check(compiler, tokenizer, {"type": "object", "properties": {"a": True, "b": False}}, [{}, {"a": 1}], [{"b": 1}])
  assert "accepts no value" in str(refusal(lambda: compiler.json_schema(False)))


# ----------------------------------------------------------------------------------------------- drafts


def test_the_draft_is_the_one_dollar_schema_names_else_2020_12_unless_draft_7_forms(compiler, tokenizer):  # noqa: F811
  tuple_ = {"type": "array", "items": [{"type": "integer"}, {"type": "string"}], "additionalItems": False}
  check(compiler, tokenizer, tuple_, [[1, "a"], [1]], [["a"], [1, "a", 2]])  # auto: the list of items is draft 7's
  siblings = {"$defs": {"n": {"type": "integer"}}, "properties": {"a": {"$ref": "#/$defs/n", "maximum": 3}}}
  check(compiler, tokenizer, {"type": "object", **siblings}, [{"a": 3}], [{"a": 4}])  # 2020-12: siblings apply
  draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", **siblings}
  check(compiler, tokenizer, draft7, [{"a": 4}], [])  # draft 7 ignores a $ref's siblings
  with pytest.raises(ValueError, match="draft='5'"):
    Compiler(tokenizer, draft="5")


# ----------------------------------------------------------------------------------------------- unknown keywords


def test_unknown_keywords_are_annotations_listed_in_one_warning_line_and_strict_refuses(compiler, tokenizer):  # noqa: F811
  schema = {"type": "object", "self": {"href": "x"}, "properties": {"a": {"type": "string", "_format": "uri"}}}
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    automaton = check(compiler, tokenizer, schema, [{"a": "x"}], [{"a": 1}])
  (line,) = automaton.warnings
  assert "'self' at (root)" in line and "'_format' at properties.a" in line and "\n" not in line
  assert [str(w.message) for w in caught if issubclass(w.category, SchemaWarning)] == [line]
  strict = Compiler(tokenizer, **SERVER, strict=True)
  error = refusal(lambda: strict.json_schema(schema))
  assert error.param == "properties.a._format" or error.param == "self", error.param
  assert "strict" in str(error)
  formats = {"type": "string", "format": "x-custom"}
  assert "format 'x-custom'" in compiler.json_schema(formats).warnings[0]
  assert refusal(lambda: strict.json_schema(formats)).param == "format"


# ----------------------------------------------------------------------------------------------- strings


def _uri(text: str) -> bool:
  parts = urllib.parse.urlsplit(text)
  return parts.scheme in ("http", "https") and bool(parts.netloc)


CHECKS = {
  "ipv6": lambda t: bool(ipaddress.IPv6Address(t)),
  "ipv4": lambda t: bool(ipaddress.IPv4Address(t)),
  "hostname": lambda t: len(t) <= 253 and all(0 < len(p) <= 63 and not p.startswith("-") for p in t.split(".")),
  "duration": lambda t: re.fullmatch(r"P(?!$)(\d+Y)?(\d+M)?(\d+W)?(\d+D)?(T(?=\d)(\d+H)?(\d+M)?(\d+S)?)?", t),
  "uri": _uri,
  "uri-reference": lambda t: _uri(t) or not urllib.parse.urlsplit(t).scheme,
  "email": lambda t: t.count("@") == 1 and ".." not in t,
  "json-pointer": lambda t: t == "" or t.startswith("/"),
}


@pytest.mark.parametrize("name", list(CHECKS))
def test_formats_write_what_their_rfc_allows(compiler, tokenizer, name):  # noqa: F811
  automaton = Compiler(tokenizer).json_schema({"type": "string", "format": name})
  assert not automaton.warnings
  for text in random_texts(automaton, tokenizer, seed_of(name), n=12):
    assert CHECKS[name](json.loads(text)), text


def test_formats_and_patterns_with_lengths_intersect(compiler, tokenizer):  # noqa: F811
  check(compiler, tokenizer, {"type": "string", "format": "date", "maxLength": 10}, ['"2024-02-29"'], ['"2023-02-29"'])
  check(
    compiler,
    tokenizer,
    {"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 3},
    ['"ab"'],
    ['"a"', '"abcd"'],
  )
  assert "accepts no value" in str(
    refusal(lambda: compiler.json_schema({"type": "string", "format": "date", "maxLength": 9}))
  )


def test_patterns_that_match_characters_json_escapes_write_them_escaped(compiler, tokenizer):  # noqa: F811
  schema = {"type": "string", "pattern": "^f.*o$", "maxLength": 6}
  check(compiler, tokenizer, schema, ['"fo"', '"f\\"o"', '"f\\\\o"', '"f\\to"'], ['"f\\no"', '"fxo!"'])


# ----------------------------------------------------------------------------------------------- numbers


def test_numbers_without_bounds_are_readable_and_exact_numbers_lifts_the_bounds(compiler, tokenizer):  # noqa: F811
  automaton = compiler.json_schema({"type": "array", "items": {"type": "number"}, "minItems": 3, "maxItems": 3})
  for text in random_texts(automaton, tokenizer, seed=11, n=24):
    conformance.parse(text)  # raises on a number read as infinity, or as 0 when it is not
  for text in ("1e100", "1" * 13, "0.0000001", "1e-100"):
    assert not accepts(Compiler(tokenizer).json_schema({"type": "number"}), tokenizer, text), text
    assert accepts(Compiler(tokenizer, exact_numbers=True).json_schema({"type": "number"}), tokenizer, text), text
  assert accepts(compiler.json_schema({"type": "number"}), tokenizer, "1e-7")


# ----------------------------------------------------------------------------------------------- limits


def _resident_peak_after(compile_) -> int:
  """Bytes the process's resident high-water mark grows by while ``compile_`` runs (Linux: /proc/self/clear_refs)."""

  def field(name: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(name + ":"))
    return int(line.split()[1]) * 1024

  Path("/proc/self/clear_refs").write_text("5")
  before = field("VmRSS")
  compile_()
  return field("VmHWM") - before


def test_the_schema_that_passed_the_memory_limit_is_narrowed_or_refused_within_megabytes(tokenizer):  # noqa: F811
  """The schema that once grew Sampler.constraint to 24 GB over minutes: 17 optional strings of up to 8192
  characters. Its whole language does not fit the limits: the library's compiler (Sampler.constraint's, and so the
  command line's) writes a subset within a few megabytes, named in the warning line, whose texts validate; with
  narrow=False it is refused as cheaply. The clock is this thread's CPU time, the collector off
  (:mod:`cpu_clock`), bounded at about ten times the 2-core figures (0.35 s to refuse, 1.6 s to narrow): it catches
  a return to minutes, not a slow machine."""
  schema = {
    "type": "object",
    "properties": {f"p{i}": {"type": "string", "maxLength": 8192} for i in range(17)},
    "additionalProperties": True,
  }
  with cpu_seconds() as elapsed:
    grown = _resident_peak_after(lambda: refusal(lambda: Compiler(tokenizer, narrow=False).json_schema(schema)))
  assert elapsed.seconds < 4.0 and grown < 200 << 20, (elapsed, grown >> 20)
  error = refusal(lambda: Compiler(tokenizer, narrow=False).json_schema(schema))
  assert "byte-level states" in str(error) and "MiB" in str(error), str(error)
  narrowed = []
  with cpu_seconds() as elapsed:
    grown = _resident_peak_after(lambda: narrowed.append(Compiler(tokenizer).json_schema(schema)))
  assert elapsed.seconds < 16.0 and grown < 200 << 20, (elapsed, grown >> 20)
  (automaton,) = narrowed
  assert (
    "is written as at most" in automaton.warnings[0] and "optional properties at properties" in automaton.warnings[0]
  )
  for text in random_texts(automaton, tokenizer, seed=5, n=16):
    assert valid(schema, text), text
  assert accepts(automaton, tokenizer, {"p0": "x" * 8}) and not accepts(automaton, tokenizer, {"p0": "x" * 300})
  one = Compiler(tokenizer).json_schema({"type": "object", "properties": {"p": {"type": "string", "maxLength": 8192}}})
  assert "maxLength=8192 at properties.p.maxLength is written as at most 256" in one.warnings[0]
  assert accepts(one, tokenizer, {"p": "x" * 256}) and not accepts(one, tokenizer, {"p": "x" * 257})
  needs = Compiler(tokenizer).json_schema({"type": "string", "pattern": "^x{300}$", "maxLength": 1000})
  assert not needs.warnings and accepts(
    needs, tokenizer, json.dumps("x" * 300)
  )  # the cap lifts where the pattern needs


def test_the_refusal_of_a_keyword_names_it_and_its_path(tokenizer):  # noqa: F811
  unique = {"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}
  error = refusal(lambda: Compiler(tokenizer, **SERVER, narrow=False).json_schema(unique))
  assert error.param == "properties.xs.uniqueItems" and "finite set" in str(error)
  assert isinstance(error, ConstraintError)
