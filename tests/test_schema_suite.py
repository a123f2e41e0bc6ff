"""The official JSON-Schema-Test-Suite (drafts 2020-12 and 7, as vendored in jsonschema's source distribution:
tests/fixtures/json_schema_test_suite, MIT licence), compiled as a library user would: every accepted schema's
sampled texts validate (numbers read exactly, and readable), its automaton rejects every invalid instance of the
suite, and every refusal is one line. By default a schema from each keyword file; the whole suite (with the issue's
targets: 85 % of each draft accepted) runs with ``-m slow``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_automaton import TOKENIZER

from mercury_jax.constrain import Compiler, ConstraintError, conformance
from mercury_jax.data.tokenizer import Tokenizer

CASES = conformance.official_suite()
FIRST = {}  # the first schema of each file: the quick run
for _case in CASES:
  FIRST.setdefault((_case.draft, _case.file), _case)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
  return Tokenizer.load(TOKENIZER)


@pytest.fixture(scope="module")
def compilers(tokenizer) -> dict[str, Compiler]:
  """One compiler per draft of the suite, reading schemas without $schema in it."""
  return {name: Compiler(tokenizer, draft=draft) for name, draft in conformance.DRAFTS.items()}


def _checked(case: conformance.Case, compilers, tokenizer, samples: int) -> conformance.Report | None:
  """The report of an accepted schema (None when refused, in one line)."""
  try:
    automaton = compilers[case.draft].json_schema(case.schema)
  except ConstraintError as e:
    assert "\n" not in str(e) and len(str(e)) < 600, str(e)
    return None
  report = conformance.check(
    automaton, tokenizer, case.schema, conformance.DRAFTS[case.draft], case.valid, case.invalid, samples=samples
  )
  assert not report.invalid_samples, (case.name, report.invalid_samples)
  assert not report.unreadable, (case.name, report.unreadable)
  assert not report.invalid_accepted, (case.name, report.invalid_accepted)
  return report


def test_the_vendored_suite_is_whole():
  """Both drafts, most of their keyword files; what the filter left out: remote documents and dynamic scopes."""
  drafts = {c.draft for c in CASES}
  files = {(c.draft, c.file) for c in CASES}
  assert drafts == set(conformance.DRAFTS) and len(files) > 70 and len(CASES) > 500, (len(files), len(CASES))
  assert not any("$dynamicRef" in str(c.schema) for c in CASES)


@pytest.mark.parametrize("key", list(FIRST), ids=lambda key: f"{key[0]}/{key[1]}")
def test_the_first_schema_of_each_suite_file_is_sound(compilers, tokenizer, key):
  _checked(FIRST[key], compilers, tokenizer, samples=3)


@pytest.mark.slow
def test_the_whole_suite_is_sound_and_mostly_accepted(compilers, tokenizer):
  accepted = {draft: 0 for draft in conformance.DRAFTS}
  total = dict(accepted)
  for case in CASES:
    total[case.draft] += 1
    accepted[case.draft] += _checked(case, compilers, tokenizer, samples=4) is not None
  for draft in conformance.DRAFTS:
    assert accepted[draft] >= 0.85 * total[draft], (draft, accepted[draft], total[draft])


def test_a_schema_whose_shortest_text_passes_the_sampling_budget_is_still_sampled(tokenizer):
  """conformance.sample writes up to 160 tokens unless the automaton's shortest text needs more (two JSONSchemaBench
  schemas did: no token was left to choose)."""
  names = [f"field_number_{i:02d}" for i in range(24)]
  schema = {"type": "object", "properties": {n: {"const": n} for n in names}, "required": names}
  automaton = Compiler(tokenizer).json_schema(schema)
  assert automaton.distance[automaton.start] > 160
  text = conformance.sample(automaton, tokenizer, np.random.default_rng(0))
  assert json.loads(text) == {n: n for n in names}
