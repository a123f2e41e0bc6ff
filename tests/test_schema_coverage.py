"""docs/schema_coverage.md is the compiler's own keyword table (mercury_jax.constrain.keywords.COVERAGE)."""

from __future__ import annotations

from pathlib import Path

from mercury_jax.constrain import keywords

DOC = Path(__file__).resolve().parents[1] / "docs" / "schema_coverage.md"


def test_the_coverage_table_is_generated_from_the_code():
  """Regenerate it with ``python -m mercury_jax.constrain.keywords > docs/schema_coverage.md``."""
  assert DOC.read_text() == keywords.coverage_markdown()


def test_every_keyword_the_compiler_reads_has_a_row():
  names = {name for row in keywords.COVERAGE for name in row.names}
  for draft in keywords.ORDER:
    assert keywords.known(draft) - {"definitions"} <= names, draft
  assert {"not", "if", "contains", "unevaluatedProperties", "$anchor", "format"} <= names
