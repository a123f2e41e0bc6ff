"""The benchmarks' command line (``python -m mercury_jax.bench``: its commands, its usage errors), and the speed/quality
benchmark ``compare``: its prompt set, its speed-up and verdict arithmetic on hand-made records, and ``--smoke`` end
to end on tiny random-weight models (through the command line without a command, as before the bench had commands)."""

import dataclasses
import importlib.util
import json
import math
import re
import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest
from random_models import random_checkpoint

from mercury_jax.bench import cli as bench, prompts as bench_prompts, report as bench_report, rounds
from mercury_jax.checkpoint import export_params, restore_params
from mercury_jax.data.corpus import VALIDATION, split_of
from mercury_jax.export import export
from mercury_jax.prepare import main as prepare_main

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


def test_help_lists_every_command_by_group_and_names_its_module(capsys):
  with pytest.raises(SystemExit) as exit_info:
    bench.main(["--help"])
  out = capsys.readouterr().out
  assert exit_info.value.code == 0
  names = [name for module in bench.MODULES for name in module.COMMANDS]
  assert len(names) == len(set(names)) >= 20
  for title, group in bench.GROUPS:
    assert f"{title}:" in out and all(f"\n  {name} " in out for name in group)
  with pytest.raises(SystemExit):
    bench.main(["needle", "--help"])
  assert "mercury_jax.bench.needle" in capsys.readouterr().out  # where the command's code and details are


@pytest.mark.parametrize(
  ("argv", "message"),
  [
    (["nonsense"], "mercury_jax.bench: error: argument COMMAND: invalid choice: 'nonsense'"),
    (["sampler", "--random", "tiny", "--bogus"], "mercury_jax.bench: error: unrecognized arguments: --bogus"),
    (["serve"], "mercury_jax.bench serve: error: the following arguments are required: --model"),
    (
      ["long-context", "prefill", "--lengths", "x"],
      "mercury_jax.bench long-context prefill: error: argument --lengths",
    ),
    (["needle-recipe", "--scalings", "none,warp"], "mercury_jax.bench needle-recipe: error: argument --scalings"),
  ],
)
def test_a_bad_command_or_flag_is_one_line_and_exit_2(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    bench.main(argv)
  err = capsys.readouterr().err
  assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1 and err.startswith(message), err


def test_function_prompts_run_from_def_line_through_docstring_in_source_order():
  prompts = bench_prompts.function_prompts(SOURCE, "m.py")
  assert [(p.key, p.line) for p in prompts] == [("m.py", 9), ("m.py", 21), ("m.py", 25)]
  area, scale, fetch = (p.text for p in prompts)
  assert area.startswith("def area(\n") and area.endswith('    """\n') and "@cache" not in area
  assert scale == 'def scale(self, k):\n    """Scales by k."""  # trailing comment\n'  # Dedented from the class.
  assert fetch.startswith("async def fetch(self):")
  assert bench_prompts.function_prompts("def broken(:\n") == []


def test_grid_names_every_diffusion_temperature_and_keeps_the_reference():
  settings = rounds.grid(16, (4, 8), (0.9,), (1.0, 0.7), (1.0, 0.0))
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


def _call(round_index: int, wall: float, generated: list[int], nfe: list[int]) -> dict:
  """A timed call's record as ``measure`` keeps it (tokens are unused by ``summarise``)."""
  return {"round": round_index, "wall": wall, "tokens": None, "nfe": np.array(nfe), "generated": np.array(generated)}


def test_speedup_is_the_median_over_rounds_of_the_per_round_tokens_per_s_ratio():
  setting = rounds.Setting("diffusion", "confidence", 8)
  # Three rounds, two examples each: 20, 60 and 4 tokens/s.
  calls = [_call(0, 1.0, [12, 8], [8, 6]), _call(1, 0.5, [20, 10], [8, 8]), _call(2, 2.0, [5, 3], [4, 2])]
  # The reference's calls of the same rounds, out of order: 10, 20 and 8 tokens/s.
  reference = [_call(2, 2.0, [16], [17]), _call(0, 1.0, [10], [11]), _call(1, 0.5, [10], [11])]
  row = rounds.summarise(setting, 2, calls, reference, compile_s=1.5)
  # Per-round ratios 20/10 = 2, 60/20 = 3, 4/8 = 0.5: the median is 2, whereas pooled tokens/s would give
  # (58 / 3.5) / (36 / 3.5) = 1.61.
  assert row["speedup_vs_ar"] == pytest.approx(2.0)
  assert row["tokens_per_s"] == pytest.approx(58 / 3.5) and row["calls"] == 3 and row["batch"] == 2
  assert row["nfe"] == pytest.approx(36 / 6) and row["tokens_per_forward"] == pytest.approx(58 / 36)
  assert row["latency_p50_s"] == pytest.approx(1.0) and row["compile_s"] == 1.5
  assert row["name"] == "confidence steps=8" and row["steps"] == 8


def _row(name: str, batch: int, speedup: float, ppl: float, entropy: float, parse: float, model="diffusion", t=1.0):
  return {
    "name": name,
    "batch": batch,
    "model": model,
    "temperature": t,
    "speedup_vs_ar": speedup,
    "tokens_per_s": 100.0 * speedup,
    "gen_ppl": ppl,
    "unigram_entropy": entropy,
    "parse_rate": parse,
  }


def test_headline_is_the_fastest_diffusion_setting_within_every_quality_tolerance():
  tol = bench_report.Tolerances(ppl=0.10, entropy=0.10, parse=0.05)
  rows = [
    _row("AR T=1", 1, 1.0, 10.0, 4.0, 0.80, model="autoregressive"),
    _row("AR greedy", 1, 1.2, 3.0, 2.0, 0.90, model="autoregressive", t=0.0),  # Not the reference.
    _row("matched slow", 1, 2.0, 10.5, 4.0, 0.80),
    _row("matched fast", 1, 3.0, 10.9, 3.95, 0.76),  # Each quality just within its tolerance.
    _row("repetitive", 1, 5.0, 9.0, 3.8, 0.90),  # Entropy 0.2 nats below the reference's.
    _row("high ppl", 1, 8.0, 11.5, 4.2, 0.90),  # Over 1.1 x the reference's perplexity.
    _row("unparsable", 1, 6.0, 10.0, 4.0, 0.70),  # Parse rate 0.1 below.
    _row("empty", 1, 9.0, math.nan, 4.0, 0.90),  # No completion to score.
    _row("AR T=1", 2, 1.0, 10.0, 4.0, 0.80, model="autoregressive"),
    _row("worse", 2, 4.0, 14.0, 4.0, 0.80),
    _row("worst", 2, 6.0, 20.0, 4.0, 0.80),
  ]
  one, two = bench_report.headlines(rows, tol)
  assert one["batch"] == 1 and one["reference"] == "AR T=1" and one["ar_tokens_per_s"] == 100.0
  assert one["matched"] == ["matched slow", "matched fast"]
  assert one["setting"] == "matched fast" and one["speedup"] == 3.0 and one["diffusion_tokens_per_s"] == 300.0
  assert one["text"].startswith("batch 1: matched fast gives 3.00x the AR twin's tokens/s at matched quality")
  assert two["matched"] == [] and two["setting"] is None and two["speedup"] is None
  assert two["text"] == (
    "batch 2: no diffusion setting matches the AR twin's quality; the lowest generative perplexity, worse "
    "(14.0 vs 10.0), runs at 4.00x its tokens/s"
  )


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """A prepared corpus with documented functions in its validation split, and a whole-sequence diffusion model, its
  autoregressive twin, a block-diffusion and a verified model: random-weight exports (``random_models``) with the
  corpus's tokenizer, cut to a context of 64 so that the prompts fit as they would a model trained on this data. The
  tests check the bench's rows, figures and errors, not how good a model is; training the four (10 steps each) cost
  the fixture 48 s, most of it compiling train and eval steps on the 8 devices."""
  root = tmp_path_factory.mktemp("bench")
  corpus = root / "corpus"
  shutil.copytree(FIXTURES / "corpus", corpus)
  assert split_of(VALIDATION_FILE) == VALIDATION
  (corpus / VALIDATION_FILE).write_text(SOURCE)
  data = root / "data"
  prepare_main(["--corpus", str(corpus / "**" / "*"), "--out", str(data), "--vocab-size", "400", "--seq-len", "64"])
  tokenizer = data / "tokenizer.model"
  kinds = {"diffusion": "whole_sequence", "ar": "autoregressive", "block": "block_diffusion", "verified": "verified"}
  for name, kind in kinds.items():
    params, cfg = restore_params(random_checkpoint(root / "random", kind, tokenizer))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, max_length=64))
    export_params(root / name, params, cfg, tokenizer)
  return root


def test_smoke_bench_of_a_block_diffusion_model_times_the_cache_and_the_loop_overhead(models):
  out = models / "out_block"
  argv = ["--diffusion", str(models / "block"), "--autoregressive", str(models / "ar"), "--data", str(models / "data")]
  bench.main([*argv, "--out", str(out), "--smoke", "--caches", "none"])
  result = json.loads((out / "results.json").read_text())
  rows = {(r["name"], r["batch"]): r for r in result["rows"]}
  assert set(rows) == {
    (n, b)
    for n in (
      "confidence steps=4",
      "threshold tau=0.9",
      "confidence steps=4 cache=none",
      "threshold tau=0.9 cache=none",
    )
    + ("AR T=1",)
    for b in (1, 2)
  }
  for batch in (1, 2):
    cached, uncached = rows[("confidence steps=4", batch)], rows[("confidence steps=4 cache=none", batch)]
    assert cached["speedup_vs_no_cache"] > 0 and "speedup_vs_no_cache" not in uncached
    assert cached["mean_tokens"] == uncached["mean_tokens"]  # Same tokens with and without the cache.
  overhead = result["overhead"]
  assert overhead["cache"] == "exact" and overhead["block"] == 4 and overhead["forwards"] >= 2
  assert overhead["ratio"] > 0 and overhead["predicted_s"] > 0
  assert "**Loop overhead**" in (out / "results.md").read_text()


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
  # Progress on stderr: every compilation and timed call counted, to the end.
  captured = capsys.readouterr()
  assert re.search(r"^mercury_jax\.bench compare: (\d+)/\1 calls \(100%\)", captured.err, re.M)
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
  assert all(r["speedup_vs_ar"] > 0 for r in result["rows"])
  assert [h["batch"] for h in result["headline"]] == [1, 2] and "AR twin" in result["matched_quality"]
  table = (out / "results.md").read_text()
  assert "| confidence steps=4 | 1 |" in table and "**Headline** batch 1:" in table
  printed = captured.out
  assert "Headline" in printed
  if importlib.util.find_spec("matplotlib") is None:  # The plots come with the `bench` extra; without it, a note.
    assert "matplotlib is not installed" in printed
  else:
    assert (out / "quality_vs_speed.png").stat().st_size > 0 and (out / "quality_vs_nfe.png").stat().st_size > 0


def test_a_bundle_exported_with_its_data_needs_no_data_flag(models, capsys):
  """``export --data`` ships the corpus metadata and the tokenizer, so ``bench`` reads its prompts and tokenizer from
  the diffusion checkpoint (the bundled models run with no flag at all); one without them is a one-line error."""
  bundle = export(models / "diffusion", models / "bundle", data=models / "data")
  glob = str(models / "corpus" / "**" / "*")  # The fixture's corpus is a glob: its metadata keeps only its name.
  assert json.loads((bundle / "metadata.json").read_text())["corpus"] == "*"
  out = models / "out_bundle"
  # Where the prompts come from is under test, not the grid: one setting at one batch size instead of --smoke's grid.
  grid = ["--prompts", "2", "--length", "16", "--steps", "4", "--taus", "", "--batch-sizes", "1"]
  grid += ["--ar-temperatures", "1"]
  bench.main(["--diffusion", str(bundle), "--autoregressive", str(models / "ar"), "--corpus", glob, "--out", str(out),
              *grid])  # fmt: skip
  assert [p["key"] for p in json.loads((out / "results.json").read_text())["prompts"]] == [VALIDATION_FILE] * 2
  with pytest.raises(SystemExit) as exit_info:
    bench.main(["--diffusion", str(models / "diffusion"), "--autoregressive", str(models / "ar"), "--smoke"])
  err = capsys.readouterr().err
  assert exit_info.value.code == 2 and "carries no corpus metadata; pass --data DATA_DIR" in err


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


def test_smoke_bench_of_a_verified_model_reports_acceptance_and_the_forward_cost_ratio(models):
  out = models / "out_verified"
  argv = ["--verified", str(models / "verified"), "--autoregressive", str(models / "ar"), "--no-diffusion"]
  argv += ["--prompts", "2", "--length", "16", "--batch-sizes", "2", "--ar-temperatures", "1,0"]  # batched, both T
  argv += ["--levers", "chain,all"]  # today's chain, and every engine lever together
  bench.main([*argv, "--data", str(models / "data"), "--out", str(out)])
  result = json.loads((out / "results.json").read_text())
  rows = {(r["name"], r["batch"]): r for r in result["rows"]}
  names = ("AR T=1", "AR greedy", *(f"verified {lever} {t}" for lever in ("chain", "all") for t in ("T=1", "greedy")))
  assert set(rows) == {(n, 2) for n in names}
  for batch in (2,):  # greedy verified decoding is the network's own greedy decoding: at most one pass per token
    for lever, most in (("chain", 4.0), ("all", 9.0)):  # k = 4; the lookup chain of 8
      row = rows[(f"verified {lever} greedy", batch)]
      assert 1.0 <= row["tokens_per_forward"] <= most and row["speedup_vs_ar"] > 0
  summary = result["verified"]
  for row in summary["rows"]:
    shares = row["accepted_by_position"]
    depth = 3 if row["lever"] == "chain" else 8  # the chain's 3 drafts; the lookup chain's 8 nodes
    assert len(shares) == depth and all(0 <= a <= 1 for a in shares) and shares == sorted(shares, reverse=True)
    # A step commits its accepted drafts and at most one token of its own (none past the hole's end).
    assert row["mean_accepted_per_step"] <= row["tokens_per_forward"] <= 1 + row["mean_accepted_per_step"] + 1e-9
  assert [(c["batch"], c["lever"]) for c in summary["costs"]] == [(2, "chain"), (2, "all")]
  assert all(c["cost_ratio"] > 0 and c["verified_overhead"] > 0 for c in summary["costs"])
  chunks = {c["lever"]: c["chunk_positions"] for c in summary["costs"]}
  assert chunks == {"chain": 20, "all": 16 + 8}  # k + k²; wide's 8 nodes, 8 lookups, two blocks of 4
  text = (out / "results.md").read_text()
  assert "## Verified decoding" in text and "| all | tree=wide, lookup=8, blocks=0,1, confidence=0.1 | 2 |" in text
