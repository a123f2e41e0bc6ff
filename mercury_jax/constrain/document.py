"""A JSON Schema as one document: its draft, its references (resolved by ``referencing`` within the document only),
and a validator (``jsonschema``) of any of its subschemas in their scope.

The draft is the one ``$schema`` names; without it, :class:`~mercury_jax.constrain.options.Options`' ``draft``
(``"auto"``: 2020-12, unless the schema uses what only earlier drafts define). References are looked up in a
registry that holds this document alone (its ``$id``s, ``$anchor``s, draft 4's ``id``s and ``urn:`` names,
JSON pointers with empty keys): a reference outside it (another file, a meta-schema) is refused, since the
compiler fetches nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re

import jsonschema
import referencing
import referencing.exceptions
import referencing.jsonschema

from mercury_jax.constrain.errors import ConstraintError
from mercury_jax.constrain.options import Options

_VALIDATORS = {
  "4": jsonschema.Draft4Validator,
  "6": jsonschema.Draft6Validator,
  "7": jsonschema.Draft7Validator,
  "2019-09": jsonschema.Draft201909Validator,
  "2020-12": jsonschema.Draft202012Validator,
}
_SPECIFICATIONS = {
  "4": referencing.jsonschema.DRAFT4,
  "6": referencing.jsonschema.DRAFT6,
  "7": referencing.jsonschema.DRAFT7,
  "2019-09": referencing.jsonschema.DRAFT201909,
  "2020-12": referencing.jsonschema.DRAFT202012,
}
_EARLIER_FORMS = ("additionalItems", "dependencies")
_DRAFT6_ON = ("const", "contains", "propertyNames", "examples", "if", "then", "else", "$id")


def _walk(schema):
  """Every dict in the schema document (subschemas and other objects alike)."""
  stack = [schema]
  while stack:
    node = stack.pop()
    if isinstance(node, dict):
      yield node
      stack.extend(node.values())
    elif isinstance(node, list):
      stack.extend(node)


def auto_draft(schema) -> str:
  """The draft of a schema without ``$schema`` under ``draft="auto"`` (see :class:`Options`)."""
  if not isinstance(schema, dict):
    return "2020-12"
  nodes = list(_walk(schema))
  later = any(k in node for node in nodes for k in _DRAFT6_ON)
  boolean_bounds = any(
    isinstance(node.get(k), bool) for node in nodes for k in ("exclusiveMinimum", "exclusiveMaximum")
  )
  if boolean_bounds or (not later and isinstance(schema.get("id"), str) and "$id" not in schema):
    return "4"
  fragment_ids = any(isinstance(n.get("$id"), str) and "#" in n["$id"].rstrip("#") for n in nodes)
  if fragment_ids or any(isinstance(node.get("items"), list) for node in nodes):
    return "7"  # an $id with a fragment (a plain name), or a list of items: only draft 7 and earlier have them
  if any(k in node for node in nodes for k in _EARLIER_FORMS):
    return "7"
  return "2020-12"


def _draft_of(schema, options: Options) -> str:
  if isinstance(schema, dict) and isinstance(schema.get("$schema"), str):
    named = jsonschema.validators.validator_for(schema, default=None)
    for draft, cls in _VALIDATORS.items():
      if named is cls:
        return draft
  return auto_draft(schema) if options.draft == "auto" else options.draft


@functools.cache
def _with_nullable(validator):
  """``validator``'s class, reading OpenAPI's ``nullable: true`` as "this schema, or null"."""

  def or_null(check):
    def run(validator, value, instance, schema):
      if instance is None and schema.get("nullable") is True:
        return
      yield from check(validator, value, instance, schema) or ()

    return run

  return jsonschema.validators.extend(validator, {k: or_null(f) for k, f in validator.VALIDATORS.items()})


def one_line(text: str, limit: int = 200) -> str:
  text = " ".join(text.split())
  return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclasses.dataclass(frozen=True, eq=False)
class Document:
  """A schema document (module docstring).

  Attributes:
    root: The schema.
    draft: Its draft (``"4"`` ... ``"2020-12"``).
    resolver: The resolver of the root's scope.
    validator: The validator class (``nullable`` read as OpenAPI does).
    registry: The registry of this document alone.
  """

  root: object
  draft: str
  resolver: referencing.Resolver
  validator: type
  registry: referencing.Registry

  @classmethod
  def of(cls, schema, options: Options, check: bool = True) -> Document:
    """The document of ``schema`` (``check``: against its draft's meta-schema).

    Raises:
      ConstraintError: It is not a valid JSON Schema of its draft.
    """
    if not isinstance(schema, (dict, bool)):
      raise ConstraintError(
        f'a JSON Schema must be a JSON object like {{"type": "object"}} (or a boolean), not {type(schema).__name__}'
      )
    draft = _draft_of(schema, options)
    validator = _with_nullable(_VALIDATORS[draft])
    try:
      if check:
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
      where = ".".join(str(p) for p in e.path)
      raise ConstraintError(
        f"not a valid JSON Schema (draft {draft}): {one_line(e.message)}", param=where or None
      ) from None
    except (re.error, RecursionError) as e:
      raise ConstraintError(f"not a valid JSON Schema (draft {draft}): {one_line(str(e))}") from None
    specification = _SPECIFICATIONS[draft]
    resource = specification.create_resource(schema)
    uri = resource.id() or ""
    registry = referencing.Registry().with_resource(uri, resource)
    # referencing 0.37 takes a list of draft 7's dependencies for a schema when a schema is beside it, and fails: then
    # the root alone (pointers resolve; an $id or $anchor inside is found when a lookup enters its resource).
    with contextlib.suppress(AttributeError, TypeError):
      registry = registry.crawl()
    return cls(schema, draft, registry.resolver(base_uri=uri), validator, registry)

  @functools.cached_property
  def unevaluated(self) -> bool:
    """Whether an unevaluated keyword appears anywhere (annotations of ``if`` alone then matter)."""
    return any("unevaluatedProperties" in node or "unevaluatedItems" in node for node in _walk(self.root))

  @property
  def rank(self) -> int:
    """The draft's place in time (4: 0 ... 2020-12: 4), to compare drafts."""
    return list(_VALIDATORS).index(self.draft)

  def enter(self, schema, resolver: referencing.Resolver) -> referencing.Resolver:
    """The resolver inside ``schema`` (its own ``$id``, or draft 4's ``id``, sets a new base)."""
    if isinstance(schema, dict) and isinstance(schema.get("$id" if self.rank else "id"), str):
      resource = _SPECIFICATIONS[self.draft].create_resource(schema)
      return resolver.in_subresource(resource)
    return resolver

  def lookup(self, ref: str, resolver: referencing.Resolver) -> tuple[object, referencing.Resolver]:
    """The subschema ``ref`` points to from ``resolver``'s scope, and the resolver of its scope.

    Raises:
      ConstraintError: It points outside the document, or nowhere in it.
    """
    try:
      resolved = resolver.lookup(ref)
    except referencing.exceptions.PointerToNowhere:
      raise ConstraintError(f"$ref {ref!r} points nowhere in the schema") from None
    except referencing.exceptions.NoSuchAnchor:
      raise ConstraintError(f"$ref {ref!r} names an anchor the schema does not have") from None
    except referencing.exceptions.Unresolvable:
      raise ConstraintError(
        f"$ref {ref!r} points outside the schema (the compiler fetches nothing); put what it names under $defs "
        "and point there"
      ) from None
    return resolved.contents, self.enter(resolved.contents, resolved.resolver)

  def valid(self, value, schema, resolver: referencing.Resolver) -> bool | None:
    """Whether ``value`` validates against the subschema ``schema`` in ``resolver``'s scope (None: cannot tell)."""
    try:
      return self.validator(schema, registry=self.registry, _resolver=resolver).is_valid(value)
    except (referencing.exceptions.Unresolvable, re.error, RecursionError, TypeError):
      return None


def base_of(resolver: referencing.Resolver) -> str:
  """The base URI of a resolver's scope (a key for caches: the same subschema in the same scope)."""
  return resolver._base_uri  # noqa: SLF001  referencing has no public name for it


def dumps(value) -> str:
  """Compact JSON, as the compiler writes it (non-ASCII characters as they are)."""
  return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
