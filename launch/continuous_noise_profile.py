"""Where a continuous checkpoint's denoiser is good: its cross-entropy by noise level, and its schedule's draws.

    python launch/continuous_noise_profile.py --checkpoint runs/default_continuous --data data/code

For each sigma of ``--sigmas``, every block of ``--batches`` held-out batches is noised to that one level (clean
blocks before it, as the block-causal variant trains and samples) and the training cross-entropy of the clean tokens
is averaged over target tokens (no self-conditioning: half the training steps run without it). Near ``sigma_min`` it
says how well the model reads a block's own latents; at ``sigma_max``, where the latents carry nothing, how well it
reads the context (compare the whole validation split's unigram entropy, printed first, and the twin's NLL). Then
the fraction of the learned schedule's training draws above each sigma (its inverse CDF at 2,000 even quantiles).
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from mercury_jax import kinds as K
from mercury_jax.checkpoint import restore_params
from mercury_jax.data import pipeline
from mercury_jax.model import Transformer
from mercury_jax.objectives import continuous


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--checkpoint", required=True)
  parser.add_argument("--data", required=True)
  parser.add_argument("--batches", type=int, default=2)
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--sigmas", default="1,2,4,8,16,32,64,100")
  args = parser.parse_args(argv)
  params, cfg = restore_params(args.checkpoint)
  if cfg.objective.name != "continuous":
    parser.error(f"--checkpoint {args.checkpoint}: objective {cfg.objective.name!r}, not a continuous checkpoint")
  objective = dataclasses.replace(cfg.objective, self_conditioning=0.0)
  model = Transformer(cfg.model)
  split = pipeline.eval_batches(
    args.data, "validation", seq_len=cfg.model.max_length, global_batch_size=args.batch_size, num_batches=None
  )
  batches = split[: args.batches]
  blocks = cfg.model.max_length // (objective.block_size or cfg.model.max_length)

  @jax.jit
  def cross_entropy(params, tokens, kinds, u, key):
    segments = K.segment_ids(kinds)

    def logits_fn(x, t, **overrides):
      return model.apply({"params": params}, x, None, **{"segment_ids": segments, **overrides})

    out = continuous.loss(logits_fn, tokens, kinds, key, objective, training=True, u=u)
    return out["loss_sum"] / out["tokens"]

  targets = np.concatenate([b["tokens"][b["kinds"] == K.TARGET] for b in split])
  counts = np.bincount(targets, minlength=cfg.model.vocab_size).astype(np.float64)
  freq = counts[counts > 0] / counts.sum()
  print(f"{args.checkpoint}: the validation split's unigram entropy {-(freq * np.log(freq)).sum():.3f} nats/token")
  sigmas = [float(s) for s in args.sigmas.split(",")]
  for sigma in sigmas:
    u = math.log(sigma / objective.sigma_min) / math.log(objective.sigma_max / objective.sigma_min)
    levels = jnp.full((args.batch_size, blocks), min(max(u, 0.0), 1.0), jnp.float32)
    values = [
      float(cross_entropy(params, jnp.asarray(b["tokens"]), jnp.asarray(b["kinds"]), levels, jax.random.key(i)))
      for i, b in enumerate(batches)
    ]
    print(f"sigma {sigma:7.2f}: cross-entropy {np.mean(values):.3f} nats/token")
  schedules = model.apply({"params": params}, split[0]["tokens"], latent_params=True)  # as the objective reads them
  drawn = np.asarray(
    continuous.sigma_of(continuous.inverse_cdf(jnp.linspace(5e-4, 1 - 5e-4, 2000), schedules, objective), objective)
  )
  print(f"the {objective.sigma_schedule} schedule's training draws: " + ", ".join(
    f"P(sigma > {s:g}) = {np.mean(drawn > s):.3f}" for s in sigmas[1:]
  ))  # fmt: skip
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
