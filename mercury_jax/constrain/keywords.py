"""The JSON Schema keywords the compiler knows, per draft: what it does with each (:data:`COVERAGE`, from which
``docs/schema_coverage.md`` is generated), which positions hold subschemas, and the scan that finds the keywords
it does not know (annotations, by the specification's rule: ignored and reported, or refused when strict).
"""

from __future__ import annotations

import dataclasses

from mercury_jax.constrain.errors import ConstraintError
from mercury_jax.constrain.formats import ANNOTATIONS as FORMAT_ANNOTATIONS, FORMATS

ORDER = ("4", "6", "7", "2019-09", "2020-12")  # drafts, oldest first


@dataclasses.dataclass(frozen=True)
class Keyword:
  """A row of the coverage table.

  Attributes:
    names: The keywords.
    status: ``enforced``, ``enforced (subset)`` (some valid texts are never written), ``enforced with limits``
      (refused past a limit), ``annotation`` (no effect on the texts) or ``refused``.
    notes: What the compiler writes, in a sentence or two.
    since: The first draft that defines them (OpenAPI's ``nullable`` and the like: ``"4"``).
    until: The last draft that defines them, or None.
  """

  names: tuple[str, ...]
  status: str
  notes: str
  since: str = "4"
  until: str | None = None


COVERAGE = (
  Keyword(
    ("type", "enum", "const"),
    "enforced",
    "Enum values that fail the schema's other keywords are dropped. A schema without type, enum or const is written "
    'as the kinds of value its own keywords apply to ({"properties": ...} as an object), where that leaves a value.',
  ),
  Keyword(
    ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
    "enforced",
    "Any decimal bound, in exact decimal arithmetic (draft 4's boolean exclusives too). Bounded numbers have no "
    "exponent.",
  ),
  Keyword(
    ("multipleOf",),
    "enforced with limits",
    "Any decimal step: the digits are read modulo the step p/10^k (about p states per digit place). A step that would "
    "need more than 100000 states needs both bounds, with at most 256 multiples between them.",
  ),
  Keyword(
    ("minLength", "maxLength"),
    "enforced",
    "In characters (code points), together with patterns and formats (the languages are intersected). A "
    "maxLength above 256 is written as at most 256 characters (a subset, named in the warning line) unless the "
    "patterns need longer strings.",
  ),
  Keyword(
    ("pattern",),
    "enforced",
    "Searched, as JSON Schema reads it (anchors at the ends of its alternatives). Characters JSON must escape are "
    "written escaped (the short forms; other control characters are never written). \\d, \\w, \\s and . are read "
    "as both ECMA-262 and Python read them (ASCII digits and word characters). Look-arounds, backreferences and "
    "anchors inside are refused.",
  ),
  Keyword(
    ("format",),
    "enforced (subset)",
    "date, time, date-time, duration, email, hostname, ipv4, ipv6, uri, uri-reference, iri, iri-reference, "
    "uri-template, uuid, json-pointer, relative-json-pointer, byte: one regular language each, within RFC 3339, "
    "1123, 5321, 4291, 3986, 6570, 6901. Other formats are annotations (refused when strict).",
  ),
  Keyword(
    ("properties", "required"),
    "enforced (subset)",
    "Listed properties are written in the schema's order (the required ones always).",
  ),
  Keyword(
    ("additionalProperties", "unevaluatedProperties"),
    "enforced (subset)",
    "Exact for false. A schema (not true) writes further properties with that schema after the listed ones; true "
    "writes none when properties are listed. unevaluatedProperties sees the properties evaluated by the branch "
    "written (allOf, the anyOf/oneOf branch, if/then or else, $ref, dependentSchemas).",
    since="4",
  ),
  Keyword(
    ("patternProperties",),
    "enforced",
    "Keys are split by the patterns they match (exactly, on their automata); each part's values satisfy every "
    "matching pattern's schema. Keys may repeat, as JSON parsers keep the last.",
  ),
  Keyword(
    ("propertyNames",),
    "enforced",
    "The names written (listed and further ones) are intersected with the names it allows.",
    since="6",
  ),
  Keyword(
    ("minProperties", "maxProperties"),
    "enforced",
    "Counted as written. Further properties may repeat a name; where minProperties needs two or more of them, "
    "they are written with names of distinct lengths (up to 64 characters).",
  ),
  Keyword(
    ("dependentRequired", "dependentSchemas"),
    "enforced",
    "Read as anyOf: the property absent, or present with what it needs.",
    since="2019-09",
  ),
  Keyword(("dependencies",), "enforced", "Draft 7's dependentRequired and dependentSchemas.", until="7"),
  Keyword(
    ("items", "prefixItems", "additionalItems", "minItems", "maxItems"),
    "enforced",
    "Per position; tuples may stop early where minItems allows (a false item ends them). A maxItems above 64 "
    "is written as at most 64 items (a subset, named in the warning line).",
  ),
  Keyword(
    ("contains", "minContains", "maxContains"),
    "enforced",
    "Each item is written matching or not matching contains, and the matches are counted.",
    since="6",
  ),
  Keyword(
    ("unevaluatedItems",),
    "enforced (subset)",
    "Items past the evaluated ones (prefixItems, items, contains matches of the branch written) satisfy it.",
    since="2019-09",
  ),
  Keyword(
    ("uniqueItems",),
    "enforced with limits",
    "Items from a finite set of at most 64 values (enum, const, booleans, null, integers with both bounds) are "
    "written distinct. Other arrays are written with at most one item (always unique; named in the warning line), "
    "since an automaton cannot remember an unbounded set; refused where minItems needs two, or with narrow=False.",
  ),
  Keyword(("allOf",), "enforced", "Merged, keyword by keyword; subschemas of the same keyword are intersected."),
  Keyword(("anyOf",), "enforced", "The union of the branches, each merged with its siblings."),
  Keyword(
    ("oneOf",),
    "enforced",
    "Each branch, and not any other: anyOf when the branches exclude each other, else each branch intersected "
    "with the complements of the others.",
  ),
  Keyword(
    ("not",),
    "enforced (subset)",
    "The complement, keyword by keyword (types, enums, bounds, lengths, patterns, items, properties, ...). Where a "
    "complement is not regular (uniqueItems, unevaluated*) that part of it is never written.",
  ),
  Keyword(("if", "then", "else"), "enforced (subset)", "(if and then) or (not if, and else).", since="7"),
  Keyword(
    ("$ref", "$anchor", "$id", "id"),
    "enforced",
    "Any reference within the document (JSON pointers, $anchor, $id base URIs, urn:), resolved by referencing. "
    "Recursion is unrolled recursion_depth levels (default 4, fewer if the limits need it) and cut where it may "
    "stop. References outside the document are refused. Draft 4's id is its $id.",
  ),
  Keyword(("$dynamicRef", "$recursiveRef"), "refused", "Dynamic scopes are not followed.", since="2019-09"),
  Keyword(("nullable",), "enforced", 'OpenAPI 3.0: "this schema, or null".'),
  Keyword(
    ("title", "description", "default", "examples", "$comment", "$defs", "definitions", "deprecated", "readOnly")
    + ("writeOnly", "contentEncoding", "contentMediaType", "contentSchema", "$schema", "$vocabulary")
    + ("$dynamicAnchor", "$recursiveAnchor", "discriminator", "example", "externalDocs", "xml"),
    "annotation",
    "Ignored.",
  ),
)

# Keywords whose values are subschemas: one, a list of them, or a map of names to them (the walk below).
ONE = frozenset(["additionalItems", "additionalProperties", "contains", "contentSchema", "else", "if", "not"]) | {
  "propertyNames",
  "then",
  "unevaluatedItems",
  "unevaluatedProperties",
}
MANY = frozenset(["allOf", "anyOf", "oneOf", "prefixItems"])
MAP = frozenset(["$defs", "definitions", "dependentSchemas", "patternProperties", "properties"])
_SINCE = {
  "6": {"const", "contains", "propertyNames", "examples", "$id"},
  "7": {"if", "then", "else", "$comment", "readOnly", "writeOnly", "contentEncoding", "contentMediaType"},
  "2019-09": {"$defs", "$anchor", "dependentRequired", "dependentSchemas", "unevaluatedItems"}
  | {"unevaluatedProperties", "minContains", "maxContains", "deprecated", "contentSchema", "$vocabulary"}
  | {"$recursiveRef", "$recursiveAnchor"},
  "2020-12": {"prefixItems", "$dynamicRef", "$dynamicAnchor"},
}
_UNTIL = {"4": {"id"}, "7": {"dependencies"}, "2019-09": {"additionalItems", "$recursiveRef", "$recursiveAnchor"}}


def known(draft: str) -> frozenset[str]:
  """The keywords the compiler knows in ``draft`` (any other is an annotation it does not read)."""
  rank = ORDER.index(draft)
  names = {name for row in COVERAGE for name in row.names}
  for since, words in _SINCE.items():
    if ORDER.index(since) > rank:
      names -= words
  for until, words in _UNTIL.items():
    if ORDER.index(until) < rank:
      names -= words
  return frozenset(names | {"definitions"})


def subschemas(schema, draft: str, path: tuple = ()):
  """``(subschema, path)`` of ``schema`` and every subschema in it that ``draft`` reads (dicts only), the path in
  the compiler's notation (``properties.a``; empty for the root)."""
  words = known(draft)
  stack = [(schema, path)]
  while stack:
    node, where = stack.pop()
    if not isinstance(node, dict):
      continue
    yield node, where
    for key, value in node.items():
      if key not in words:
        continue
      if key in ONE or (key == "items" and not isinstance(value, list)):
        stack.append((value, where + (key,)))
      elif (key in MANY or key == "items") and isinstance(value, list):
        stack += [(v, where + (key, str(i))) for i, v in enumerate(value)]
      elif (key in MAP or key == "dependencies") and isinstance(value, dict):
        stack += [(v, where + (key, k)) for k, v in value.items()]


def unknown(schema, draft: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
  """``(keywords, formats)``: ``(name, path)`` of every keyword ``draft`` does not define and every format the
  compiler does not write, in ``schema`` and its subschemas."""
  words = known(draft)
  names, formats = [], []
  for node, where in subschemas(schema, draft):
    names += [(key, ".".join(where)) for key in node if key not in words]
    name = node.get("format")
    if isinstance(name, str) and name not in FORMATS and name not in FORMAT_ANNOTATIONS:
      formats.append((name, ".".join(where)))
  order = lambda item: (item[1], item[0])  # noqa: E731
  return sorted(names, key=order), sorted(formats, key=order)


def report(names: list[tuple[str, str]], formats: list[tuple[str, str]], strict: bool, capped=()) -> list[str]:
  """The warning line for the unknown keywords and formats, and what is written as a subset of what the schema
  allows (``capped``: a phrase each, :class:`~mercury_jax.constrain.schema.Narrowing`); none when there are none.

  Raises:
    ConstraintError: ``strict``, naming the first.
  """
  if strict and names:
    keyword, where = names[0]
    raise ConstraintError(
      f"{keyword!r} is not a keyword the compiler knows (strict=True refuses it); remove it, or compile without "
      "strict to read it as an annotation",
      param=".".join(p for p in (where, keyword) if p),
    )
  if strict and formats:
    name, where = formats[0]
    raise ConstraintError(
      f"format {name!r} is not one the compiler writes (strict=True refuses it); use a 'pattern', or compile "
      "without strict to read it as an annotation",
      param=".".join(p for p in (where, "format") if p),
    )
  parts = [f"{k!r} at {w or '(root)'}" for k, w in names] + [f"format {f!r} at {w or '(root)'}" for f, w in formats]
  lines = []
  if parts:
    shown = parts[:12] + ([f"and {len(parts) - 12} more"] if len(parts) > 12 else [])
    lines.append(f"read as annotations and ignored (the compiler does not know them): {', '.join(shown)}")
  if capped:
    shown = list(capped)[:6] + ([f"and {len(capped) - 6} more"] if len(capped) > 6 else [])
    lines.append(
      "written as a subset of what the schema allows (each character, item, property and alternative costs "
      f"automaton states): {'; '.join(shown)}"
    )
  return ["; ".join(lines)] if lines else []


def coverage_markdown() -> str:
  """``docs/schema_coverage.md``, from :data:`COVERAGE` (a test checks that the file is this text)."""
  lines = [
    "# JSON Schema coverage of structured output",
    "",
    "Generated from `mercury_jax/constrain/keywords.py` (`COVERAGE`); `tests/test_schema_coverage.py` checks that",
    "this file is what the code says. Every text the automaton accepts validates against the schema; the compiler",
    "writes compact JSON (no whitespace, properties in the schema's order), so some valid texts are never written",
    '("subset"). A keyword it cannot enforce is refused with one line naming it and its path (the server answers',
    "400 with that path in `param`). Keywords and formats it does not know are annotations, as the specification",
    "says: ignored, and listed in one line in the automaton's `warnings` (a `SchemaWarning` when compiled);",
    "`strict=True` refuses them.",
    "",
    "The draft is the one `$schema` names. Without it (`draft=\"auto\"`, the library's and the server's default):",
    "2020-12, unless the schema uses a form that only earlier drafts define: `items` as a list, `additionalItems`,",
    "`dependencies` or an `$id` with a fragment (draft 7), or a root `id` and boolean `exclusiveMinimum` (draft 4).",
    "",
    "| Keyword | Status | Drafts | Notes |",
    "|---|---|---|---|",
  ]
  for row in COVERAGE:
    drafts = row.since + ("+" if row.until is None else f" to {row.until}")
    names = ", ".join(f"`{n}`" for n in row.names)
    lines.append(f"| {names} | {row.status} | {drafts} | {row.notes} |")
  lines += [
    "",
    "## Numbers",
    "",
    "Every number written parses to a finite IEEE double that is zero only when its text is (`exact_numbers=True`",
    "lifts this). A number without bounds has at most 12 digits before the point, fewer than 6 zeros after it",
    "before a nonzero digit, and an exponent of at most two digits; with a bound on one side only, at most 15",
    "digits before the point (more where the bound needs them); near zero, fewer than 15 zeros after the point.",
    "Bounded numbers and integers are written without an exponent.",
    "",
    "## Size limits",
    "",
    "Every path (library, command line, server) refuses a constraint that would pass its limits before building",
    "it: static estimates refuse `minLength: 100000` or `{1000000}` in a pattern in about a millisecond; every",
    "byte automaton built on the way is held to 16 times `max_states` states (refused as soon as one would pass it),",
    "and the token-level automaton before minimizing to 8 times, all within `max_memory` (1 GiB) of tables. The",
    "measured distribution over the official test suite and JSONSchemaBench's collections is on the structured",
    "output results page ([JSON Schema coverage](results/structured.md#json-schema-coverage-the-compiler-measured)).",
    "",
    "## Narrowing",
    "",
    "Where a schema's whole language does not fit the limits, the compiler writes a subset of it instead of refusing",
    "(`narrow=True`, the default; `Compiler(tokenizer, narrow=False)` refuses). It tries, in turn: the whole language",
    "(strings above 256 characters and arrays above 64 items written shorter, recursion unrolled 4 levels or fewer);",
    "then strings of at most 64 characters, arrays of 16 items, 64 of the alternatives where `anyOf`, `oneOf`, `if`,",
    "dependencies and `not` multiply, recursion 2 levels; then 16 characters, 4 items, 16 alternatives, the first 8",
    'optional properties of each object, "any value" as scalars only; then 8 characters, 2 items, 4 alternatives, 2',
    "optional properties, recursion 1 level; last, 1 item, 1 alternative and the required properties only. Each",
    "attempt may build at most 2^24 states, and one compile 5 x 2^24 in all, its token-level automata included",
    "(reading a token-level state counts as many states as a quarter of the vocabulary: 1,024 for 4,096 tokens),",
    "counted the same on every machine (2^24 is about three seconds of CPU on a 2-core Xeon), so a compile ends",
    "within seconds and never past about 20 of them there. Every text written still validates: only what is left out",
    "differs, and the warning line (`Automaton.warnings`, the server's `x-schema-warnings` header) names each",
    "place, e.g.",
    "`maxLength=4096 at properties.coupon.maxLength is written as at most 64` or",
    "`only the first 8 optional properties at properties.event.properties are written`.",
    "",
  ]
  return "\n".join(lines)


if __name__ == "__main__":
  print(coverage_markdown(), end="")
