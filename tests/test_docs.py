"""The documentation: the site builds in strict mode (a broken link, anchor or missing page fails it), and the
structured-output page's keyword table agrees with the keywords the schema compiler enforces."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mercury_jax.constrain import schema

ROOT = Path(__file__).resolve().parent.parent
COVERAGE_PAGE = ROOT / "docs" / "structured-output.md"


def test_site_builds_in_strict_mode(tmp_path):
  pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
  env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
  run = subprocess.run(
    [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=240,
  )
  assert run.returncode == 0, run.stdout + run.stderr
  assert (tmp_path / "site" / "structured-output" / "index.html").exists()
  assert (tmp_path / "site" / "api" / "sampling" / "index.html").exists()


def _coverage_rows() -> list[tuple[set[str], str]]:
  """(the keywords in backticks of a row's first cell, its status) for each keyword row of the JSON Schema coverage
  table."""
  text = COVERAGE_PAGE.read_text()
  table = text.split("## JSON Schema coverage", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
  rows = []
  for line in table.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) < 3 or cells[0] in ("Keyword", "") or set(cells[0]) <= set("-"):
      continue
    if not cells[0].startswith("`"):  # "non-local `$ref`", "titles, ...": a qualified keyword or annotations
      continue
    words = {w for w in re.findall(r"`([^`]+)`", cells[0]) if re.fullmatch(r"\$?[A-Za-z]+", w)} - {"true", "false"}
    rows.append((words, cells[1]))
  return rows


def test_coverage_table_lists_every_enforced_keyword():
  rows = _coverage_rows()
  enforced = set().union(*(words for words, status in rows if status.startswith("enforced")))
  refused = set().union(*(words for words, status in rows if status == "refused"))
  assert schema.KEYWORDS - enforced == set(), "keywords the compiler accepts but the table does not list as enforced"
  assert enforced - schema.KEYWORDS == set(), "keywords the table lists as enforced but the compiler refuses"
  assert refused & (schema.KEYWORDS | schema.ANNOTATIONS) == set(), "keywords listed as refused that the code accepts"
  assert {"not", "if", "contains", "dependentRequired"} <= refused


def test_refused_keywords_are_refused_by_name():
  for words, status in _coverage_rows():
    if status != "refused":
      continue
    for word in words - {"then", "else"}:
      with pytest.raises(schema.ConstraintError) as caught:
        schema.schema_regex({"type": "object", "properties": {"a": {"type": "string", word: {}}}})
      assert caught.value.param is not None and caught.value.param.endswith(word), (word, caught.value.param)
