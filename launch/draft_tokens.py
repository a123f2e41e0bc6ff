"""Tokens a verified run's drafter was trained on, step by step: the x axis of the tokens-per-forward curve.

    python launch/draft_tokens.py --config v4_distill --set data.path=... [--set ...] --steps 60,120,180 [--json OUT]

Replays the run's training stream (the same config and ``--set`` values as its ``train`` command: the batches are a
function of the data and the shuffle seed, `mercury_jax.data.pipeline`) without training, and counts at each step the
drafter's targets: ``TARGET`` tokens of the real rows and ``DISTILLED`` tokens of the self-distillation rows
(``mercury_jax.kinds``), and the verifier's scored tokens.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from mercury_jax import kinds as K
from mercury_jax.config import load_config, parse_set_args
from mercury_jax.data import pipeline


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", required=True)
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  parser.add_argument("--steps", required=True, help="comma-separated steps to report (cumulative counts)")
  parser.add_argument("--json", help="also write the table here")
  args = parser.parse_args()
  cfg = load_config(args.config, parse_set_args(args.set))
  steps = sorted(int(s) for s in args.steps.split(","))
  stream = iter(
    pipeline.train_dataset(
      cfg.data.path,
      seq_len=cfg.model.max_length,
      global_batch_size=cfg.data.batch_size,
      seed=cfg.data.shuffle_seed,
      process_index=0,
      process_count=1,
      mix=cfg.data.weighted("mix"),
      distill=cfg.data.weighted("distill"),
      distill_batch_size=cfg.data.distill_batch_size,
    )
  )
  totals = {"real_draft": 0, "distilled": 0, "verifier": 0}
  rows = []
  for step in range(1, steps[-1] + 1):
    kinds = next(stream)["kinds"]
    real, drafts = kinds[: cfg.data.batch_size], kinds[cfg.data.batch_size :]
    totals["real_draft"] += int((real == K.TARGET).sum())
    totals["distilled"] += int((drafts == K.DISTILLED).sum())
    has_context = np.pad(real[:, :-1] != K.PAD, ((0, 0), (1, 0)))
    totals["verifier"] += int(((real == K.TARGET) & has_context).sum())
    if step in steps:
      rows.append({"step": step, **totals, "drafter": totals["real_draft"] + totals["distilled"]})
      print(json.dumps(rows[-1]), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"config": args.config, "set": args.set, "rows": rows}, f, indent=2)


if __name__ == "__main__":
  main()
