"""Verified models head to head: the same prompts at batch 1, each call of one model followed by the same call of the
other (in alternating order), so a host's drift in speed falls on both alike.

    python launch/verified_ab.py mercury_jax/assets/default runs/export_d480 --data DATA_DIR \
      [--lever chain] [--prompts 32] [--length 64] [--rounds 3] [--temperatures 1,0] [--zero-draft-mlp] [--json OUT]

Two runs of ``python -m mercury_jax.bench compare`` on a shared host differ by 10-20 % in their × twin figures
(each is a ratio to the twin within its own run, but the runs see different minutes of the host), which hides a
difference of that size between two drafters. This measures it directly: for each temperature, the tokens per
second of model B ÷ model A (the median over rounds of the per-round ratio of summed tokens ÷ summed wall time),
and each model's tokens per forward. The prompts and canvases are the bench's (``tpf_curve.bench_canvases``).

``--zero-draft-mlp`` zeroes model B's draft-only MLPs (``model.draft_mlp``; their down projections): B then drafts
exactly what a model without them drafts, through the same program as B, so B ÷ A is those MLPs' cost alone.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from tpf_curve import bench_canvases  # launch/, first on sys.path when this script runs

from mercury_jax.bench import verified as bench_verified
from mercury_jax.bench.rounds import generated
from mercury_jax.data import pipeline
from mercury_jax.sampling.sampler import Sampler


def _call(sampler: Sampler, canvas, settings, seed: int) -> tuple[int, int, float]:
  """``(generated tokens, forwards, wall seconds)`` of one decode of a one-row canvas."""
  out, wall, _ = sampler.run(canvas, None, seed, settings)
  return int(generated(canvas, out.tokens, sampler.tokenizer.pad_id).sum()), int(np.asarray(out.nfe).sum()), wall


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("models", nargs=2, help="model A (the baseline) and model B: exported checkpoints")
  parser.add_argument("--data", required=True, help="a prepared directory with the models' tokenizer")
  parser.add_argument("--corpus", default="python-stdlib", help="the prompts' corpus (as the bench's --corpus)")
  parser.add_argument("--lever", default="chain", choices=sorted(bench_verified.LEVERS), help="the bench's lever")
  parser.add_argument("--prompts", type=int, default=32)
  parser.add_argument("--length", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--temperatures", default="1,0")
  parser.add_argument("--zero-draft-mlp", action="store_true", help="zero model B's draft-only MLPs: their cost alone")
  parser.add_argument("--json", help="write the results here")
  args = parser.parse_args()
  tokenizer = pipeline.load_data_tokenizer(args.data)
  samplers = [Sampler.from_checkpoint(m) for m in args.models]
  if args.zero_draft_mlp:
    if "draft_mlp" not in samplers[1].params["blocks"]:
      parser.error(f"--zero-draft-mlp: {args.models[1]} has no draft-only MLPs (model.draft_mlp = 0)")
    mlp = samplers[1].params["blocks"]["draft_mlp"]
    samplers[1].params["blocks"]["draft_mlp"] = {**mlp, "down": jnp.zeros_like(mlp["down"])}
  canvases, count = bench_canvases(samplers[0], tokenizer, args.data, args.corpus, args.prompts, args.length, 1)
  knobs = bench_verified.LEVERS[args.lever]
  results = {"models": args.models, "zero_draft_mlp": args.zero_draft_mlp, "lever": args.lever}
  results |= {"prompts": count, "length": args.length, "rows": {}}
  for t in (float(v) for v in args.temperatures.split(",")):
    label = "greedy" if t == 0 else f"T={t:g}"
    settings = [
      s.settings(temperature=t, top_p=1.0, top_k=0, decode="verified", draft_length=0, **knobs) for s in samplers
    ]
    for sampler, s in zip(samplers, settings, strict=True):  # Compile outside the timed rounds.
      _call(sampler, canvases[0], s, args.seed)
    totals = np.zeros((args.rounds, 2, 3))  # [round, model, (tokens, forwards, seconds)]
    for r in range(args.rounds):
      for i, canvas in enumerate(canvases):
        order = (0, 1) if (r + i) % 2 == 0 else (1, 0)
        for m in order:
          totals[r, m] += _call(samplers[m], canvas, settings[m], args.seed + i)
    speed = totals[:, :, 0] / totals[:, :, 2]  # [round, model] tokens/s
    row = {
      "tokens_per_second": np.median(speed, axis=0).tolist(),
      "b_over_a": float(np.median(speed[:, 1] / speed[:, 0])),
      "b_over_a_by_round": (speed[:, 1] / speed[:, 0]).tolist(),
      "tokens_per_forward": (totals[0, :, 0] / totals[0, :, 1]).tolist(),
    }
    results["rows"][label] = row
    print(
      f"{args.lever} {label}: TPF A {row['tokens_per_forward'][0]:.2f}, B {row['tokens_per_forward'][1]:.2f}; "
      f"tokens/s A {row['tokens_per_second'][0]:.1f}, B {row['tokens_per_second'][1]:.1f}; "
      f"B ÷ A {row['b_over_a']:.3f} (rounds {', '.join(f'{x:.3f}' for x in row['b_over_a_by_round'])})",
      flush=True,
    )
  if args.json:
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
  main()
