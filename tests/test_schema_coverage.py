"""docs/schema_coverage.md is the compiler's own keyword table (mercury_jax.constrain.keywords.COVERAGE)."""

from __future__ import annotations

import json
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


def test_the_real_world_bench_command_checks_each_schema_and_writes_its_record(tmp_path, capsys):
  """``python -m mercury_jax.bench schema-bench`` on a collection of three schemas: one accepted with its instances,
  one refused, one that accepts nothing."""
  from mercury_jax.bench import cli

  collection, tests = tmp_path / "data" / "Mini", tmp_path / "tests"
  collection.mkdir(parents=True)
  tests.mkdir()
  person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
  schemas = {"a.json": person, "b.json": {"$ref": "https://example.com/elsewhere.json"}, "c.json": False}
  for name, schema in schemas.items():
    (collection / name).write_text(json.dumps(schema))
  instances = [{"data": {"name": "Ada"}, "valid": True}, {"data": {"name": 3}, "valid": False}]
  (tests / "Mini---a.json").write_text(json.dumps({"schema": person, "tests": instances}))
  out = tmp_path / "out"
  argv = ["schema-bench", "--data", str(tmp_path / "data"), "--tests", str(tests), "--collections", "Mini"]
  cli.main([*argv, "--per", "3", "--samples", "2", "--out", str(out)])
  record = json.loads((out / "bench.json").read_text())
  assert record["command"].startswith("python -m mercury_jax.bench") and "cpu_count" in record["machine"]
  rows = {row["file"]: row for row in record["rows"]}
  a = rows["a.json"]
  assert a["samples"] == 2 and not a["invalid_samples"] and not a["unreadable"]
  assert (a["valid_accepted"], a["valid_total"], a["invalid_total"], a["invalid_accepted"]) == (1, 1, 1, [])
  assert "refused" in rows["b.json"] and "refused" in rows["c.json"]
  summary = capsys.readouterr().out
  assert "### all collections" in summary and "schemas: 3; accepted: 1 (33.3 %)" in summary
