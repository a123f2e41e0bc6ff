"""How repetitive a model's greedy text is: distinct-n and unigram entropy over the bench's prompts.

    python launch/greedy_diversity.py --data DATA_DIR MODEL [MODEL ...] [--prompts 128] [--length 64] [--json OUT]

MODEL is an exported checkpoint or ``WORKDIR@STEP``. Each model continues the same documented-function prompts as
``launch/tpf_curve.py`` and the bench (``tpf_curve.bench_canvases``) greedily with
its next-token head (``--decode ar``: for a verified model, the text its verified decoding writes at T = 0), and the
generated tokens are scored with the bench's ``distinct_n`` (pooled over prompts) and ``unigram_entropy``. A drafter
trained on the model's own greedy text can make that text more repetitive (docs/results/verified.md, stage B), which
by itself raises what prompt lookup accepts: this measures it on more prompts than a bench run's quality columns.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from tpf_curve import bench_canvases  # launch/, first on sys.path when this script runs

from mercury_jax.bench import quality
from mercury_jax.bench.rounds import generated
from mercury_jax.data import pipeline
from mercury_jax.sampling.sampler import Sampler


def greedy_samples(sampler: Sampler, canvases, count: int, pad_id: int) -> list[list[int]]:
  """Each of the first ``count`` rows' greedy continuation (its generated tokens, padding dropped)."""
  settings = sampler.settings(temperature=0.0, top_p=1.0, top_k=0, decode="ar")
  samples, left = [], count
  for canvas in canvases:
    out, _, _ = sampler.run(canvas, None, 0, settings)
    real = min(left, canvas.tokens.shape[0])
    left -= real
    tokens = np.asarray(out.tokens)[:real, : canvas.tokens.shape[1]]
    made = generated(canvas, tokens, pad_id, real)
    samples += [row[keep].tolist() for row, keep in zip(tokens, made, strict=True)]
  return samples


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("models", nargs="+", help="exported checkpoints or WORKDIR@STEP")
  parser.add_argument("--data", required=True, help="a prepared directory with the models' tokenizer")
  parser.add_argument("--corpus", default="python-stdlib", help="the prompts' corpus (as the bench's --corpus)")
  parser.add_argument("--prompts", type=int, default=128)
  parser.add_argument("--length", type=int, default=64)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--json", help="write the rows here")
  args = parser.parse_args()
  tokenizer = pipeline.load_data_tokenizer(args.data)
  rows = []
  for name in args.models:
    path, _, step = name.partition("@")
    sampler = Sampler.from_checkpoint(path, step=int(step) if step else None)
    canvases, count = bench_canvases(sampler, tokenizer, args.data, args.corpus, args.prompts, args.length, args.batch)
    samples = greedy_samples(sampler, canvases, count, tokenizer.pad_id)
    row = {
      "model": name,
      "prompts": len(samples),
      "tokens": sum(map(len, samples)),
      "distinct_2": quality.distinct_n(samples, 2),
      "distinct_3": quality.distinct_n(samples, 3),
      "entropy": quality.unigram_entropy(samples),
    }
    rows.append(row)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
  if args.json:
    Path(args.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
  main()
