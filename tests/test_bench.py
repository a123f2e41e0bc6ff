"""The speed/quality benchmark: its prompt set, and ``--smoke`` end to end on two tiny trained models."""

import importlib.util
import json
import math
import shutil
import textwrap
from pathlib import Path

import pytest

from mercury_jax.bench import cli as bench, prompts as bench_prompts
from mercury_jax.config import load_config
from mercury_jax.data.corpus import VALIDATION, split_of
from mercury_jax.prepare import main as prepare_main
from mercury_jax.train import train

FIXTURES = Path(__file__).parent / "fixtures"
VALIDATION_FILE = "helpers28.py"  # A name the corpus's hash puts in the validation split (checked below).
SOURCE = textwrap.dedent(
  '''\
  """Module docstring: not a prompt."""


  def no_docstring(x):
      return x


  @cache
  def area(
      r: float,
  ) -> float:
      """Area of a circle.

      Args:
        r: the radius.
      """
      return 3.14159 * r * r


  class Shape:
      def scale(self, k):
          """Scales by k."""  # trailing comment
          self.k = k

      async def fetch(self):
          """Fetches."""
          return await self.k

      def ragged(self):
          """A docstring whose second line is
  less indented than its def: it cannot be dedented."""
          return 1
  '''
)
SMALL = {
  "model.max_length": "64",
  "model.vocab_size": "400",
  "train.steps": "10",
  "train.eval_every": "10",
  "train.eval_batches": "1",
  "train.log_every": "10",
  "checkpoint.async_save": "false",
}
AR_SHAPE = {
  "model.d_model": "64",
  "model.num_layers": "2",
  "model.num_heads": "4",
  "model.num_kv_heads": "2",
  "model.head_dim": "16",
  "model.mlp_dim": "192",
  "data.batch_size": "8",
}


def test_function_prompts_run_from_def_line_through_docstring_in_source_order():
  prompts = bench_prompts.function_prompts(SOURCE, "m.py")
  assert [(p.key, p.line) for p in prompts] == [("m.py", 9), ("m.py", 21), ("m.py", 25)]
  area, scale, fetch = (p.text for p in prompts)
  assert area.startswith("def area(\n") and area.endswith('    """\n') and "@cache" not in area
  assert scale == 'def scale(self, k):\n    """Scales by k."""  # trailing comment\n'  # Dedented from the class.
  assert fetch.startswith("async def fetch(self):")
  assert bench_prompts.function_prompts("def broken(:\n") == []


def test_grid_names_every_diffusion_temperature_and_keeps_the_reference():
  settings = bench.grid(16, (4, 8), (0.9,), (1.0, 0.7), (1.0, 0.0))
  assert [s.name for s in settings] == [
    "confidence steps=4",
    "confidence steps=8",
    "threshold tau=0.9",
    "confidence steps=4 T=0.7",
    "confidence steps=8 T=0.7",
    "threshold tau=0.9 T=0.7",
    "AR T=1",
    "AR greedy",
  ]
  assert len({s.name for s in settings}) == len(settings)  # Rows and plots are keyed by name.


def test_spread_picks_evenly_spaced_items_in_order():
  assert bench_prompts.spread(list(range(10)), 4) == [0, 2, 5, 7]
  assert bench_prompts.spread([1, 2], 5) == [1, 2]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """A prepared corpus with documented functions in its validation split, and tiny diffusion and AR models."""
  root = tmp_path_factory.mktemp("bench")
  corpus = root / "corpus"
  shutil.copytree(FIXTURES / "corpus", corpus)
  assert split_of(VALIDATION_FILE) == VALIDATION
  (corpus / VALIDATION_FILE).write_text(SOURCE)
  data = root / "data"
  prepare_main(["--corpus", str(corpus / "**" / "*"), "--out", str(data), "--vocab-size", "400", "--seq-len", "64"])
  train(load_config("tiny", {**SMALL, "data.path": str(data)}), root / "diffusion", log=False)
  train(load_config("default_ar", {**SMALL, **AR_SHAPE, "data.path": str(data)}), root / "ar", log=False)
  return root


def test_smoke_bench_writes_every_row_with_sane_numbers(models, capsys):
  out = models / "out"
  bench.main(
    [
      "--diffusion",
      str(models / "diffusion"),
      "--autoregressive",
      str(models / "ar"),
      "--data",
      str(models / "data"),
      "--out",
      str(out),
      "--smoke",
    ]
  )
  result = json.loads((out / "results.json").read_text())
  assert result["machine"]["backend"] == "cpu" and result["machine"]["cpu_count"] >= 1
  assert [p["key"] for p in result["prompts"]] == [VALIDATION_FILE] * 2
  names = {(r["name"], r["batch"]) for r in result["rows"]}
  assert names == {(n, b) for n in ("confidence steps=4", "threshold tau=0.9", "AR T=1") for b in (1, 2)}
  for row in result["rows"]:
    assert row["tokens_per_s"] > 0 and row["latency_p95_s"] >= row["latency_p50_s"] > 0 and row["compile_s"] > 0
    assert 1 <= row["nfe"] <= (row["steps"] or 64) and row["tokens_per_forward"] > 0
    assert math.isfinite(row["gen_ppl"]) and row["gen_ppl"] > 1 and 0 <= row["parse_rate"] <= 1
    assert row["same_samples_as_first_batch"]  # Streams = prompt index: batch 1 and batch 2 see the same samples.
    if row["name"] == "confidence steps=4":
      assert row["nfe"] <= 4 and row["tokens_per_forward"] >= 1
  reference = [r for r in result["rows"] if r["name"] == "AR T=1"]
  assert all(r["speedup_vs_ar"] == 1.0 for r in reference)
  assert [h["batch"] for h in result["headline"]] == [1, 2] and "AR twin" in result["matched_quality"]
  table = (out / "results.md").read_text()
  assert "| confidence steps=4 | 1 |" in table and "**Headline** batch 1:" in table
  printed = capsys.readouterr().out
  assert "Headline" in printed
  if importlib.util.find_spec("matplotlib") is None:  # The plots come with the `bench` extra; without it, a note.
    assert "matplotlib is not installed" in printed
  else:
    assert (out / "quality_vs_speed.png").stat().st_size > 0 and (out / "quality_vs_nfe.png").stat().st_size > 0


@pytest.mark.parametrize("swap", ["missing", "swapped", "temperature"])
def test_bad_input_is_one_line_and_exit_2(models, capsys, swap):
  diffusion, ar = (models / "ar", models / "diffusion") if swap == "swapped" else (models / "diffusion", models / "ar")
  diffusion = models / "nowhere" if swap == "missing" else diffusion
  extra = ["--temperatures", "1,-0.5"] if swap == "temperature" else []
  with pytest.raises(SystemExit) as exit_info:
    bench.main(
      ["--diffusion", str(diffusion), "--autoregressive", str(ar), "--data", str(models / "data"), "--smoke", *extra]
    )
  err = capsys.readouterr().err
  assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
  expected = {"missing": "does not exist", "swapped": "pass it as --autoregressive", "temperature": "must be >= 0"}
  assert expected[swap] in err
