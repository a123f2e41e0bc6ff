"""Block-size sweep: the tiny preset trained as block diffusion with blocks of 4, 8, 16 and 32 tokens, and its
autoregressive twin, on the same data for the same tokens; then the held-out ELBO and the bench at equal tokens per
forward pass, to pick the default model's block.

    python launch/sweep_block_size.py --data DATA_DIR --runs RUNS/sweep [--blocks 4,8,16,32] [--out DIR]

Training (skipped where ``RUNS/sweep/bdB`` already holds the last step; the trainer resumes a cut run):
``python -m mercury_jax.train --config tiny_bd --set objective.block_size=B`` with BD3-LM's clipped schedule
U[0.45, 0.95] for every block, ``--train-steps`` steps of 8 x seq_len tokens; the twin is ``default_ar`` cut to the
tiny shape. Then ``python -m mercury_jax.evaluate`` (``--t-samples`` t draws, the first ``--eval-batches``
batches: the same characters for every model) and ``python -m mercury_jax.bench`` per block against the twin,
generating ``--length`` tokens with the confidence rule at ``--bench-steps`` step budgets (16 steps for 64 tokens
is 4 tokens per forward pass whatever the block: blocks of 4 get 1 step each, blocks of 32 get 8), batch 1, T = 1.
Each bench times the twin in the same run, so the x AR column is a ratio measured interleaved.

Writes ``DIR/results.json`` and ``DIR/results.md`` (the table BUILD_NOTES quotes) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

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


def _run(args: list[str], log: Path) -> None:
  print("$", " ".join(args), flush=True)
  with log.open("a") as out:
    done = subprocess.run([sys.executable, "-m", *args], stdout=out, stderr=subprocess.STDOUT, check=False)
  if done.returncode:
    raise SystemExit(f"{args[0]} failed (exit {done.returncode}); see {log}")


def _sets(values: dict) -> list[str]:
  return [part for key, value in values.items() for part in ("--set", f"{key}={value}")]


def _last_step(workdir: Path) -> int:
  metrics = workdir / "metrics.jsonl"
  if not metrics.exists():
    return 0
  steps = [json.loads(line).get("step", 0) for line in metrics.read_text().splitlines() if line.strip()]
  return max(steps, default=0)


def train(runs: Path, data: str, blocks: list[int], steps: int) -> None:
  common = {"data.path": data, "train.steps": steps, "checkpoint.every": steps // 2, "train.eval_every": steps // 2}
  jobs = [("ar", "default_ar", {**TINY, **common, "train.log_every": 50})]
  clipped = {"objective.mask_rate_min": 0.45, "objective.mask_rate_max": 0.95, "train.log_every": 50}
  jobs += [(f"bd{b}", "tiny_bd", {**common, **clipped, "objective.block_size": b}) for b in blocks]
  for name, config, values in jobs:
    workdir = runs / name
    if _last_step(workdir) >= steps:
      continue
    _run(["mercury_jax.train", "--config", config, "--workdir", str(workdir), *_sets(values)], runs / f"{name}.log")


def evaluate(runs: Path, data: str, name: str, t_samples: int, batches: int) -> dict:
  out = runs / f"{name}.eval.json"
  if not out.exists():
    args = ["mercury_jax.evaluate", "--checkpoint", str(runs / name), "--data", data, "--t-samples", str(t_samples)]
    _run([*args, "--max-batches", str(batches), "--json", str(out)], runs / f"{name}.eval.log")
  return json.loads(out.read_text())


def bench(runs: Path, data: str, block: int, args) -> dict:
  out = runs / f"bench_bd{block}"
  if not (out / "results.json").exists():
    flags = {
      "--diffusion": runs / f"bd{block}", "--autoregressive": runs / "ar", "--data": data, "--out": out,
      "--prompts": args.prompts, "--length": args.length, "--steps": args.bench_steps, "--taus": "",
      "--temperatures": 1, "--ar-temperatures": 1, "--batch-sizes": 1, "--entropy-tolerance": 0.2,
    }  # fmt: skip
    _run(
      ["mercury_jax.bench", *(str(part) for pair in flags.items() for part in pair)],
      runs / f"bench_bd{block}.log",
    )
  return json.loads((out / "results.json").read_text())


def table(results: dict) -> str:
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


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
  args = p.parse_args()
  runs, blocks = Path(args.runs), [int(b) for b in args.blocks.split(",")]
  runs.mkdir(parents=True, exist_ok=True)
  train(runs, args.data, blocks, args.train_steps)
  twin_eval = evaluate(runs, args.data, "ar", 1, args.eval_batches)
  rows, twin_rows = [], []
  for block in blocks:
    scores = evaluate(runs, args.data, f"bd{block}", args.t_samples, args.eval_batches)
    result = bench(runs, args.data, block, args)
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
  text = table(results)
  print(text)
  if args.out:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(text)


if __name__ == "__main__":
  main()
