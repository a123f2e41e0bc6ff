"""Recipes: measurements made of package commands run one after another, each whose numbers BUILD_NOTES quotes.

``targets``: the default model's targets (issue 15), in one run: the bundled block-diffusion model against its
bundled autoregressive twin::

    python -m mercury_jax.bench targets --data DATA_DIR --out docs/bench/default_v2 [--eval-batches 64]

1. Held-out likelihood: ``python -m mercury_jax.evaluate`` of both models on the same first ``--eval-batches``
   validation batches (the same characters scored): bits per character and their ratio.
2. ``python -m mercury_jax.bench compare`` at batch 1 on ``--prompts`` prompts, ``--length`` new tokens: the
   diffusion model at the CLI's default (one token per step: ``--steps`` = the length) and at fewer steps (more
   tokens per forward pass), the twin at T = 1 and greedy. Parse rate, generative perplexity, entropy, tokens/s (x
   the twin's, measured interleaved), tokens per forward pass, and the bench's matched-quality headline.
3. Time from the command to the first printed text (:func:`first_text_seconds`) with an empty compilation cache (a
   fresh install), then again with the cache it filled.

Writes ``OUT/targets.json`` and ``OUT/targets.md`` and prints the table.

``first-text``: seconds from a ``python -m mercury_jax.sample --stream`` command's start to its first generated
byte, for each of ``--models``::

    python -m mercury_jax.bench first-text [--models default,default_bd] [--runs 3]

Each run starts with an empty compilation cache (a fresh ``XDG_CACHE_HOME``); the models alternate run by run, so a
change of the machine's capacity hits them alike. After the first cold run of each model the same command runs again
on its filled cache ("warm").

``block-size-sweep``: the tiny preset trained as block diffusion with blocks of 4, 8, 16 and 32 tokens, and its
autoregressive twin, on the same data for the same tokens; then the held-out ELBO and the bench at equal tokens per
forward pass, to pick the default model's block::

    python -m mercury_jax.bench block-size-sweep --data DATA_DIR --runs RUNS/sweep [--blocks 4,8,16,32] [--out DIR]

Training (skipped where ``RUNS/sweep/bdB`` already holds the last step; the trainer resumes a cut run):
``python -m mercury_jax.train --config tiny_bd --set objective.block_size=B`` with BD3-LM's clipped schedule
U[0.45, 0.95] for every block, ``--train-steps`` steps of 8 x seq_len tokens; the twin is ``default_ar`` cut to the
tiny shape. Then ``python -m mercury_jax.evaluate`` (``--t-samples`` t draws, the first ``--eval-batches``
batches: the same characters for every model) and ``python -m mercury_jax.bench compare`` per block against the
twin, generating ``--length`` tokens with the confidence rule at ``--bench-steps`` step budgets (16 steps for 64
tokens is 4 tokens per forward pass whatever the block: blocks of 4 get 1 step each, blocks of 32 get 8), batch 1,
T = 1. Each bench times the twin in the same run, so the x AR column is a ratio measured interleaved. Writes
``DIR/results.json`` and ``DIR/results.md`` (the table BUILD_NOTES quotes) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mercury_jax.bench.throughput import timed
from mercury_jax.sampling.registry import default_checkpoint

PROMPT = "def fibonacci(n):"

TINY = {
  "model.d_model": 64,
  "model.num_layers": 2,
  "model.num_heads": 4,
  "model.num_kv_heads": 2,
  "model.head_dim": 16,
  "model.mlp_dim": 192,
  "data.batch_size": 8,
  "optim.warmup_steps": 20,
  "optim.learning_rate": 1e-3,
}


def run_module(args: list[str], log: Path, *, append: bool = False) -> float:
  """Runs ``python -m ARGS`` with its output in ``log`` (appended to with ``append``); returns its wall seconds.

  Raises:
    SystemExit: The command failed (its log says why).
  """
  print("$ python -m " + " ".join(args), flush=True)
  with log.open("a" if append else "w") as out:
    done, seconds = timed(subprocess.run, [sys.executable, "-m", *args], stdout=out, stderr=subprocess.STDOUT)
  if done.returncode:
    raise SystemExit(f"`python -m {' '.join(args)}` failed (exit {done.returncode}); see {log}")
  return seconds


def first_text_seconds(cache: Path, model: str | None = None) -> float:
  """Seconds from starting ``python -m mercury_jax.sample --stream`` (on ``model``, default the command's own) with
  compilation cache ``cache`` to the first generated text on its stdout (the prompt is printed first)."""
  env = {**os.environ, "XDG_CACHE_HOME": str(cache), "PYTHONUNBUFFERED": "1"}
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  env.pop("XLA_FLAGS", None)
  command = [sys.executable, "-m", "mercury_jax.sample", "--prompt", PROMPT, "--stream"]
  command += ["--model", model] if model else []

  def first_text():
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    seen = b""
    while len(seen) <= len(PROMPT.encode()):  # The prompt, then the clock stops at the first generated byte.
      chunk = process.stdout.read1(64)
      if not chunk:
        raise SystemExit("the sample command printed no generated text")
      seen += chunk
    return process

  process, seconds = timed(first_text)
  process.communicate()
  return seconds


# ---------------------------------------------------------------------------------------------------- targets


def likelihood(out: Path, data: str, batches: int, t_samples: int) -> dict:
  scores = {}
  for name in ("default", "default_ar"):
    path = out / f"{name}.eval.json"
    args = ["mercury_jax.evaluate", "--checkpoint", str(default_checkpoint(name)), "--data", data]
    args += ["--max-batches", str(batches), "--t-samples", str(t_samples if name == "default" else 1)]
    run_module([*args, "--json", str(path)], out / f"{name}.eval.log")
    scores[name] = json.loads(path.read_text())
  return scores


def bench(out: Path, data: str, prompts: int, length: int, steps: str) -> dict:
  flags = {
    "--data": data, "--out": out / "bench", "--prompts": prompts, "--length": length, "--steps": steps,
    "--taus": "0.9,0.7", "--temperatures": 1, "--ar-temperatures": "1,0", "--batch-sizes": 1,
    "--entropy-tolerance": 0.2,
  }  # fmt: skip
  run_module(
    ["mercury_jax.bench", "compare", *(str(part) for pair in flags.items() for part in pair)], out / "bench.log"
  )
  return json.loads((out / "bench" / "results.json").read_text())


def add_targets_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--data", required=True, help="the prepared data both bundled models were trained on")
  p.add_argument("--out", required=True)
  p.add_argument("--eval-batches", type=int, default=64)
  p.add_argument("--t-samples", type=int, default=4)
  p.add_argument("--prompts", type=int, default=128)
  p.add_argument("--length", type=int, default=64)
  p.add_argument("--steps", default="8,16,21,32,64", help="diffusion step budgets for --length tokens")
  p.add_argument("--first-text-runs", type=int, default=3)


def run_targets(args: argparse.Namespace) -> None:
  """The default model's targets (issue 15), measured in one run.

  evaluate both bundled models, compare them at batch 1, time the sample command to its first text (cold and warm
  compilation cache); writes OUT/targets.json and targets.md.
  """
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  for name in ("default", "default_ar"):
    if default_checkpoint(name) is None:
      raise SystemExit(f"the bundled model {name!r} is missing from mercury_jax/assets/{name}/")
  scores = likelihood(out, args.data, args.eval_batches, args.t_samples)
  result = bench(out, args.data, args.prompts, args.length, args.steps)
  cold, warm = [], []
  for _ in range(args.first_text_runs):
    with tempfile.TemporaryDirectory() as cache:
      cold.append(first_text_seconds(Path(cache)))
      warm.append(first_text_seconds(Path(cache)))
  rows = result["rows"]
  twin = next(r for r in rows if r["model"] == "autoregressive" and r["temperature"] == 1.0)
  diffusion = [r for r in rows if r["model"] == "diffusion" and r["rule"] == "confidence"]
  default = next(r for r in diffusion if r["steps"] == args.length)  # the CLI's default: one token per step
  headline = result["headline"][0]
  matched = next((r for r in rows if r["name"] == headline["setting"] and r["batch"] == 1), None)
  targets = {
    "bits_per_char": {name: s["bits_per_char"] for name, s in scores.items()},
    "bits_per_char_ratio": scores["default"]["bits_per_char"] / scores["default_ar"]["bits_per_char"],
    "parse_rate_default": default["parse_rate"],
    "parse_rate_twin": twin["parse_rate"],
    "matched_setting": headline["setting"],
    "matched_speedup": headline["speedup"],
    "matched_tokens_per_forward": matched["tokens_per_forward"] if matched else None,
    "first_text_cold_s": sorted(cold)[len(cold) // 2],
    "first_text_warm_s": sorted(warm)[len(warm) // 2],
    "first_text_runs": {"cold": cold, "warm": warm},
    "headline": headline["text"],
  }
  lines = [
    "| figure | target | measured |",
    "|---|---|---|",
    f"| held-out bits/char ÷ twin (same characters) | ≤ 1.15 | {targets['bits_per_char_ratio']:.3f} "
    f"({scores['default']['bits_per_char']:.3f} vs {scores['default_ar']['bits_per_char']:.3f}) |",
    f"| parse rate, default setting, {len(result['prompts'])} prompts, {args.length} tokens | ≥ 0.60 and ≥ the twin's "
    f"at T = 1 | {default['parse_rate']:.3f} (twin {twin['parse_rate']:.3f}) |",
    f"| tokens/s ÷ twin at matched quality, batch 1 | ≥ 2× | {headline['text']} |",
    "| tokens per forward pass at that setting | ≥ 3 | "
    + (f"{targets['matched_tokens_per_forward']:.2f} |" if matched else "no setting matched |"),
    f"| command to first printed text | ≤ 3 s | {targets['first_text_cold_s']:.2f} s with an empty compilation cache, "
    f"{targets['first_text_warm_s']:.2f} s with it filled (medians of {args.first_text_runs}) |",
  ]
  table = "\n".join(lines) + "\n"
  (out / "targets.json").write_text(json.dumps(targets, indent=2) + "\n")
  (out / "targets.md").write_text(table)
  print(table)


# ------------------------------------------------------------------------------------------------- first text


def add_first_text_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--models", default="default,default_bd")
  p.add_argument("--runs", type=int, default=3)


def run_first_text(args: argparse.Namespace) -> None:
  """Seconds from the sample command's start to its first generated text.

  Each cold run starts with an empty compilation cache; the models alternate run by run.
  """
  models = args.models.split(",")
  cold, warm = {m: [] for m in models}, {}
  for run in range(args.runs):
    for model in models:
      with tempfile.TemporaryDirectory() as folder:
        cold[model].append(first_text_seconds(Path(folder), model))
        if run == 0:
          warm[model] = first_text_seconds(Path(folder), model)
  for model in models:
    shown = ", ".join(f"{t:.2f}" for t in cold[model])
    print(f"{model}: cold {statistics.median(cold[model]):.2f} s ({shown}), warm {warm[model]:.2f} s")


# -------------------------------------------------------------------------------------------- block-size sweep


def _sets(values: dict) -> list[str]:
  return [part for key, value in values.items() for part in ("--set", f"{key}={value}")]


def _last_step(workdir: Path) -> int:
  metrics = workdir / "metrics.jsonl"
  if not metrics.exists():
    return 0
  steps = [json.loads(line).get("step", 0) for line in metrics.read_text().splitlines() if line.strip()]
  return max(steps, default=0)


def _train(runs: Path, data: str, blocks: list[int], steps: int) -> None:
  common = {"data.path": data, "train.steps": steps, "checkpoint.every": steps // 2, "train.eval_every": steps // 2}
  jobs = [("ar", "default_ar", {**TINY, **common, "train.log_every": 50})]
  clipped = {"objective.mask_rate_min": 0.45, "objective.mask_rate_max": 0.95, "train.log_every": 50}
  jobs += [(f"bd{b}", "tiny_bd", {**common, **clipped, "objective.block_size": b}) for b in blocks]
  for name, config, values in jobs:
    workdir = runs / name
    if _last_step(workdir) >= steps:
      continue
    args = ["mercury_jax.train", "--config", config, "--workdir", str(workdir), *_sets(values)]
    run_module(args, runs / f"{name}.log", append=True)


def _evaluate(runs: Path, data: str, name: str, t_samples: int, batches: int) -> dict:
  out = runs / f"{name}.eval.json"
  if not out.exists():
    args = ["mercury_jax.evaluate", "--checkpoint", str(runs / name), "--data", data, "--t-samples", str(t_samples)]
    run_module([*args, "--max-batches", str(batches), "--json", str(out)], runs / f"{name}.eval.log", append=True)
  return json.loads(out.read_text())


def _bench(runs: Path, data: str, block: int, args) -> dict:
  out = runs / f"bench_bd{block}"
  if not (out / "results.json").exists():
    flags = {
      "--diffusion": runs / f"bd{block}", "--autoregressive": runs / "ar", "--data": data, "--out": out,
      "--prompts": args.prompts, "--length": args.length, "--steps": args.bench_steps, "--taus": "",
      "--temperatures": 1, "--ar-temperatures": 1, "--batch-sizes": 1, "--entropy-tolerance": 0.2,
    }  # fmt: skip
    command = ["mercury_jax.bench", "compare", *(str(part) for pair in flags.items() for part in pair)]
    run_module(command, runs / f"bench_bd{block}.log", append=True)
  return json.loads((out / "results.json").read_text())


def _table(results: dict) -> str:
  twin = results["twin"]
  lines = [
    f"Twin (AR, same network): {twin['bits_per_char']:.3f} bits/char; its samples: gen ppl {twin['gen_ppl']:.1f}, "
    f"entropy {twin['entropy']:.2f}, parse {twin['parse_rate']:.2f}, {twin['tokens_per_s']:,.0f} tokens/s (median "
    "over the benches).",
    "",
    "| block | ELBO bits/char | ÷ twin | steps | TPF | tokens/s | × AR | gen ppl | entropy | parse |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for row in results["blocks"]:
    for i, s in enumerate(row["settings"]):
      head = (
        f"| {row['block']} | {row['bits_per_char']:.3f} ± {row['bits_per_char_stderr']:.3f} | {row['ratio']:.3f} "
        if i == 0
        else "| | | "
      )
      lines.append(
        f"{head}| {s['steps']} | {s['tokens_per_forward']:.2f} | {s['tokens_per_s']:,.0f} | {s['speedup_vs_ar']:.2f} "
        f"| {s['gen_ppl']:.1f} | {s['unigram_entropy']:.2f} | {s['parse_rate']:.2f} |"
      )
  return "\n".join(lines) + "\n"


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--data", required=True, help="a prepared data directory (python -m mercury_jax.prepare)")
  p.add_argument("--runs", required=True, help="where the runs, evaluations and benches go (resumable)")
  p.add_argument("--blocks", default="4,8,16,32")
  p.add_argument("--train-steps", type=int, default=800)
  p.add_argument("--t-samples", type=int, default=4)
  p.add_argument("--eval-batches", type=int, default=32)
  p.add_argument("--prompts", type=int, default=32)
  p.add_argument("--length", type=int, default=64)
  p.add_argument("--bench-steps", default="16,32,64")
  p.add_argument("--out", help="also write results.json and results.md here")


def run_sweep(args: argparse.Namespace) -> None:
  """The block-size sweep: block diffusion at blocks of 4 to 32 against the twin.

  Trains each block and the twin on the same data (resumable), evaluates them on the same characters and benches
  each block against the twin; writes DIR/results.json and results.md.
  """
  runs, blocks = Path(args.runs), [int(b) for b in args.blocks.split(",")]
  runs.mkdir(parents=True, exist_ok=True)
  _train(runs, args.data, blocks, args.train_steps)
  twin_eval = _evaluate(runs, args.data, "ar", 1, args.eval_batches)
  rows, twin_rows = [], []
  for block in blocks:
    scores = _evaluate(runs, args.data, f"bd{block}", args.t_samples, args.eval_batches)
    result = _bench(runs, args.data, block, args)
    settings = [r for r in result["rows"] if r["model"] == "diffusion"]
    twin_rows += [r for r in result["rows"] if r["model"] == "autoregressive"]
    rows.append(
      {
        "block": block,
        "bits_per_char": scores["bits_per_char"],
        "bits_per_char_stderr": scores.get("bits_per_char_stderr", 0.0),
        "ratio": scores["bits_per_char"] / twin_eval["bits_per_char"],
        "settings": settings,
        "machine": result.get("machine"),
      }
    )
  median = lambda key: sorted(r[key] for r in twin_rows)[len(twin_rows) // 2]  # noqa: E731
  twin = {
    "bits_per_char": twin_eval["bits_per_char"],
    "gen_ppl": median("gen_ppl"),
    "entropy": median("unigram_entropy"),
    "parse_rate": median("parse_rate"),
    "tokens_per_s": median("tokens_per_s"),
  }
  results = {"args": vars(args), "twin": twin, "blocks": rows}
  text = _table(results)
  print(text)
  if args.out:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(text)


COMMANDS = {
  "targets": (add_targets_arguments, run_targets),
  "first-text": (add_first_text_arguments, run_first_text),
  "block-size-sweep": (add_sweep_arguments, run_sweep),
}
