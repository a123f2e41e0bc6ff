"""Checks of compiled JSON Schemas against the schemas' meaning, for tests and benchmarks: texts sampled from the
automaton validate (``jsonschema``, numbers read exactly as ``Decimal``, the formats it can check asserted), every
number in them is readable (a finite double, zero only when written as zero), and given instances are accepted or
rejected as they should be.

:func:`official_suite` reads the JSON-Schema-Test-Suite as vendored for the tests (the copy in ``jsonschema``'s
source distribution, :data:`SUITE_FILE`), keeping the schemas that need no other document and no dynamic scope.
"""

from __future__ import annotations

import dataclasses
import decimal
import json
import math
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import jsonschema
import numpy as np
import referencing.exceptions

from mercury_jax.constrain import document
from mercury_jax.constrain.automaton import Automaton
from mercury_jax.constrain.options import Options

SUITE_FILE = Path(__file__).parents[2] / "tests" / "fixtures" / "json_schema_test_suite" / "suite.json"
DRAFTS = {"draft2020-12": "2020-12", "draft7": "7"}


@dataclasses.dataclass(frozen=True)
class Case:
  """One schema of the suite with its instances.

  Attributes:
    draft: The suite's draft directory (``draft2020-12``).
    file: The file (``not.json``).
    description: The schema's description.
    schema: The schema.
    valid: Instances that validate. invalid: Instances that do not.
  """

  draft: str
  file: str
  description: str
  schema: object
  valid: tuple
  invalid: tuple

  @property
  def name(self) -> str:
    return f"{self.draft}/{self.file}: {self.description}"


def _self_contained(schema, draft: str) -> bool:
  """Whether every reference of the schema resolves within it, and it has no dynamic reference."""
  text = json.dumps(schema)
  if "$dynamicRef" in text or "$recursiveRef" in text:
    return False
  named = schema.get("$schema") if isinstance(schema, dict) else None
  if named is not None and jsonschema.validators.validator_for(schema, default=None) is None:
    return False  # a meta-schema of its own, elsewhere
  try:
    doc = document.Document.of(schema, Options(draft=draft))
  except Exception:  # noqa: BLE001  an invalid schema is kept: the compiler's refusal is what is measured
    return True
  stack = [(schema, doc.resolver)]
  while stack:
    node, resolver = stack.pop()
    if isinstance(node, dict):
      resolver = doc.enter(node, resolver)
      ref = node.get("$ref")
      if isinstance(ref, str):
        try:
          resolver.lookup(ref)
        except referencing.exceptions.Unresolvable:
          return False
      stack += [(v, resolver) for v in node.values()]
    elif isinstance(node, list):
      stack += [(v, resolver) for v in node]
  return True


def official_suite(path: Path = SUITE_FILE) -> list[Case]:
  """The suite's schemas of drafts 2020-12 and 7 that need no other document and no dynamic scope."""
  data = json.loads(Path(path).read_text())
  out = []
  for key, groups in data["files"].items():
    draft, file = key.split("/")
    for group in groups:
      if not _self_contained(group["schema"], DRAFTS[draft]):
        continue
      valid = tuple(t["data"] for t in group["tests"] if t["valid"])
      invalid = tuple(t["data"] for t in group["tests"] if not t["valid"])
      out.append(Case(draft, file, group["description"], group["schema"], valid, invalid))
  return out


# ----------------------------------------------------------------------------------------------- checks


class Unreadable(ValueError):
  """A number a parser reads as infinity, as zero when it is not, or cannot read."""


def _number(text: str):
  try:
    exact = Decimal(text)
  except decimal.InvalidOperation:
    raise Unreadable(f"Decimal cannot read {text!r}") from None
  value = float(text)
  if not math.isfinite(value) or (value == 0 and exact != 0):
    raise Unreadable(f"{text!r} reads as {value}")
  return exact


def parse(text: str):
  """The JSON value of ``text``, numbers as ``Decimal``.

  Raises:
    ValueError: It is not JSON, or a number in it is not readable (:class:`Unreadable`).
  """
  return json.loads(text, parse_float=_number, parse_int=lambda t: int(_number(t)))


def validator(schema, draft: str):
  """A validator of ``schema`` (numbers as ``Decimal``), in the draft the compiler reads it in, that also asserts
  the formats jsonschema can check in that draft (stricter than the specification's default)."""
  exact = json.loads(json.dumps(schema), parse_float=Decimal)
  doc = document.Document.of(exact, Options(draft=draft), check=False)
  checker = doc.validator.FORMAT_CHECKER
  return doc.validator(exact, registry=doc.registry, _resolver=doc.resolver, format_checker=checker)


def errors(check, value) -> list[str]:
  """The validation errors of ``value`` (numbers as ``Decimal``, in a context precise enough that ``multipleOf``
  divides any number the compiler writes: 400 digits)."""
  with decimal.localcontext() as context:
    context.prec = 400
    return [e.message for e in check.iter_errors(value)]


def sample(automaton: Automaton, tokenizer, rng: np.random.Generator, max_tokens: int = 160) -> str:
  """A random accepted text: uniform over the tokens that leave room to finish, hurrying now and then.

  ``max_tokens`` is raised to the fewest tokens the automaton accepts, when they are more: a token of a shortest path
  always leaves room, so some token is always kept."""
  state, tokens = automaton.start, []
  max_tokens = max(max_tokens, int(automaton.distance[automaton.start]))
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
  return tokenizer.decode(tokens)


def schema_order(schema) -> dict[str, int]:
  """Property names in the order they are first listed in the schema (``properties``, ``required``)."""
  order: dict[str, int] = {}
  stack = [schema]
  while stack:
    node = stack.pop(0)
    if isinstance(node, dict):
      for word in ("properties", "required", "dependentRequired"):
        names = node.get(word)
        for name in names if isinstance(names, (dict, list)) else ():
          if isinstance(name, str):
            order.setdefault(name, len(order))
      stack += list(node.values())
    elif isinstance(node, list):
      stack += node
  return order


def written(value, order: dict[str, int]) -> str:
  """``value`` as the compiler writes it: compact, listed properties in the schema's order first."""

  def arrange(v):
    if isinstance(v, dict):
      keys = sorted(v, key=lambda k: (k not in order, order.get(k, 0)))
      return {k: arrange(v[k]) for k in keys}
    if isinstance(v, list):
      return [arrange(x) for x in v]
    return v

  return json.dumps(arrange(value), separators=(",", ":"), ensure_ascii=False)


def compact(value) -> str:
  return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@dataclasses.dataclass
class Report:
  """What :func:`check` found for one compiled schema."""

  samples: int = 0
  invalid_samples: list = dataclasses.field(default_factory=list)
  unreadable: list = dataclasses.field(default_factory=list)
  valid_accepted: int = 0
  valid_total: int = 0
  invalid_accepted: list = dataclasses.field(default_factory=list)

  @property
  def sound(self) -> bool:
    return not (self.invalid_samples or self.unreadable or self.invalid_accepted)


def check(
  automaton: Automaton, tokenizer, schema, draft: str, valid=(), invalid=(), *, samples: int = 8, seed: int = 0
):
  """Samples ``samples`` texts and checks them; checks that the byte automaton rejects every ``invalid``
  instance (compact, in its own key order and in the schema's) and counts the ``valid`` ones it accepts in the
  compiler's form (module docstring)."""
  report = Report()
  check_ = validator(schema, draft)
  rng = np.random.default_rng(seed)
  for _ in range(samples):
    text = sample(automaton, tokenizer, rng)
    report.samples += 1
    try:
      value = parse(text)
    except Unreadable as e:
      report.unreadable.append((text, str(e)))
      continue
    except ValueError as e:
      report.invalid_samples.append((text, f"not JSON: {e}"))
      continue
    found = errors(check_, value)
    if found:
      report.invalid_samples.append((text, found[0][:200]))
  order = schema_order(schema)
  for value in valid:
    report.valid_total += 1
    report.valid_accepted += automaton.text.accepts(written(value, order))
  for value in invalid:
    for text in {written(value, order), compact(value)}:
      if automaton.text.accepts(text):
        report.invalid_accepted.append(text)
  return report


def walk_cases(cases: list[Case], draft: str) -> Iterator[Case]:
  yield from (c for c in cases if c.draft == draft)
