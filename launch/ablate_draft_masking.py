"""All-mask drafting against a mask-rate range, at the tiny size: which should a verified model train with?

    python launch/ablate_draft_masking.py --data DATA_DIR --runs RUNS_DIR [--steps 800] [--prompts 32] [--json OUT]

Trains ``configs/tiny_verified.toml`` twice on the same data, steps and seed: every draft target masked (TiDAR's
choice, ``draft_mask_min = draft_mask_max = 1``) and mask rates drawn from U[0.1, 1] per (sequence, block). Then, for
each: the next-token head's and the drafter's held-out figures (``evaluate``'s, on the first 16 validation batches),
verified decoding's tokens per forward (greedy and T = 1) on documented-function prompts, and ``--decode diffusion``
at one and at two tokens per step, judged by a fixed twin (``--judge``, default the bundled ``default_ar``: generative
perplexity).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mercury_jax import files
from mercury_jax.bench import prompts as bench_prompts, quality
from mercury_jax.config import load_config
from mercury_jax.data import pipeline
from mercury_jax.evaluate import main as evaluate_main
from mercury_jax.sampling.sampler import Sampler, default_checkpoint
from mercury_jax.train import train

VARIANTS = {"all-mask": ("1.0", "1.0"), "range 0.1-1": ("0.1", "1.0")}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--data", required=True)
  p.add_argument("--runs", required=True)
  p.add_argument("--corpus", default="python-stdlib", help="where the prompts come from")
  p.add_argument("--steps", type=int, default=800)
  p.add_argument("--prompts", type=int, default=32)
  p.add_argument("--length", type=int, default=64)
  p.add_argument("--judge", help="an autoregressive checkpoint with the data's tokenizer (default: default_ar)")
  p.add_argument("--json")
  args = p.parse_args()
  judge = Sampler.from_checkpoint(args.judge or default_checkpoint("default_ar"))
  tokenizer = pipeline.load_data_tokenizer(args.data)
  prompts, _ = bench_prompts.select_prompts(
    args.data, args.prompts, lambda text: len(tokenizer.encode(text)) <= 256 - args.length, args.corpus
  )
  texts = [x.text for x in prompts]
  ids = [tokenizer.encode(t) for t in texts]
  rows = []
  for name, (low, high) in VARIANTS.items():
    workdir = Path(args.runs) / name.replace(" ", "_")
    overrides = {
      "data.path": args.data, "model.max_length": "256", "train.steps": str(args.steps), "train.eval_every": "0",
      "objective.draft_mask_min": low, "objective.draft_mask_max": high, "checkpoint.every": str(args.steps),
    }  # fmt: skip
    if not (workdir / files.CHECKPOINTS).exists():
      train(load_config("tiny_verified", overrides), workdir, log=False)
    out = workdir / "eval.json"
    evaluate_main(["--checkpoint", str(workdir), "--data", args.data, "--max-batches", "16", "--json", str(out)])
    held_out = json.loads(out.read_text())
    sampler = Sampler.from_checkpoint(workdir)
    row = {
      "variant": name,
      "ar_bits_per_char": held_out["bits_per_char"],
      "draft_all_mask_bits_per_char": held_out["draft"]["all_mask_bits_per_char"],
      "draft_elbo_bits_per_char": held_out["draft"]["elbo_bits_per_char"],
    }
    for temperature in (0.0, 1.0):
      samples = sampler.generate(texts, length=args.length, temperature=temperature, seed=0, token_healing=False)
      row[f"verified_tpf_T{temperature:g}"] = sum(len(s.tokens) for s in samples) / sum(s.nfe for s in samples)
    for per_step in (1, 2):
      steps = args.length // per_step + 1
      samples = sampler.generate(
        texts, length=args.length, temperature=1.0, seed=0, decode="diffusion", steps=steps, token_healing=False
      )
      eos = tokenizer.eos_id
      done = [s.tokens[: s.tokens.index(eos)] if eos in s.tokens else s.tokens for s in samples]
      row[f"diffusion_gen_ppl_{per_step}_per_step"] = quality.generative_perplexity(judge.params, judge.cfg, ids, done)
    rows.append(row)
    print(json.dumps(row), flush=True)
  if args.json:
    Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
  main()
