"""Training throughput benchmark: tokens/s and MFU of a preset's jitted train step on this machine.

    python launch/bench_train.py --config default [--steps 20] [--set key=value ...]

MFU's denominator is measured in the same run: after every timed step, one jitted f32 matmul (n = 2048) is timed,
and each step's FLOP/s is divided by the peak measured right after it (the capacity of shared CPU hosts drifts
between levels for minutes at a time, so a peak measured once would be off). FLOPs per step are the model's matmul
FLOPs, 6·N·tokens + 12·layers·length·heads·head_dim·tokens, with N excluding the embedding gather.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from mercury_jax import sharding as sh
from mercury_jax.config import load_config, parse_set_args
from mercury_jax.model import count_params, flops_per_token
from mercury_jax.trainer import Trainer


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="default")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  args = parser.parse_args()
  cfg = load_config(args.config, parse_set_args(args.set))
  mesh = sh.make_mesh(cfg.mesh)
  trainer = Trainer(cfg, mesh)
  state = trainer.init_state(cfg.train.seed)
  b, length = cfg.data.batch_size, cfg.model.max_length
  rng = np.random.default_rng(0)
  batches = [
    jax.device_put(
      {
        "tokens": jnp.asarray(rng.integers(5, cfg.model.vocab_size, (b, length)), jnp.int32),
        "kinds": jnp.full((b, length), 2, jnp.int32),
      },
      trainer.batch_sharding,
    )
    for _ in range(4)
  ]
  step_flops = flops_per_token(cfg.model, count_params(state["params"])) * b * length
  n = 2048
  a = jnp.ones((n, n), jnp.float32)
  matmul = jax.jit(lambda x: x @ x)
  for i in range(3):  # Compile and warm up both programs.
    state, _ = trainer.train_step(state, batches[i % 4])
    jax.block_until_ready(matmul(a))
  jax.block_until_ready(state)

  step_times, ratios, peaks = [], [], []
  for i in range(args.steps):
    start = time.perf_counter()
    state, metrics = trainer.train_step(state, batches[i % 4])
    jax.block_until_ready(metrics)
    step_time = time.perf_counter() - start
    jax.block_until_ready(matmul(a))  # One untimed matmul, then the timed one.
    start = time.perf_counter()
    jax.block_until_ready(matmul(a))
    peak = 2 * n**3 / (time.perf_counter() - start)
    step_times.append(step_time)
    peaks.append(peak)
    ratios.append(step_flops / step_time / peak)

  median_step = statistics.median(step_times)
  print(
    f"config {cfg.name}: {count_params(state['params']) / 1e6:.2f} M parameters, batch {b} x {length}, "
    f"{jax.device_count()} {jax.default_backend()} device(s), {step_flops / 1e9:.1f} GFLOP/step"
  )
  print(
    f"median step {median_step * 1e3:.1f} ms | {b * length / median_step:,.0f} tokens/s | "
    f"{step_flops / median_step / 1e9:.1f} GFLOP/s | matmul peak median {statistics.median(peaks) / 1e9:.1f} "
    f"GFLOP/s | MFU median {100 * statistics.median(ratios):.1f}% (min {100 * min(ratios):.1f}%, "
    f"max {100 * max(ratios):.1f}%) over {args.steps} steps"
  )


if __name__ == "__main__":
  main()
