"""Training throughput benchmark: tokens/s and MFU of a preset's jitted train step on this machine.

    python -m mercury_jax.bench train --config default [--steps 20] [--set key=value ...]

On a CPU, MFU's denominator is measured in the same run: after every timed step, one jitted f32 matmul (n = 2048) is
timed, and each step's FLOP/s is divided by the peak measured right after it (the capacity of shared CPU hosts drifts
between levels for minutes at a time, so a peak measured once would be off). On an accelerator it is the chip's
datasheet peak for the compute dtype (``bench.throughput.peak_flops``, what the training command's MFU divides by).
FLOPs per step are the model's matmul FLOPs, 6·N·tokens + 12·layers·length·heads·head_dim·tokens, with N excluding
the embedding gather. ``--json`` appends the result as one JSON line.

    JAX_PLATFORMS=cuda python -m mercury_jax.bench train --config gpu8_125m --set mesh.fsdp=1 --set data.batch_size=16
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mercury_jax import sharding as sh
from mercury_jax.bench.throughput import best_seconds, peak_flops, timed
from mercury_jax.config import load_config, parse_set_args
from mercury_jax.model import count_params, flops_per_token
from mercury_jax.trainer import Trainer


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--config", default="default")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  parser.add_argument("--json", type=Path, help="append the result here as one JSON line")


def run_train(args: argparse.Namespace) -> None:
  """Training throughput: tokens/s and MFU of a preset's train step.

  Random tokens, --steps timed steps after 3 warm-up steps; on a CPU each step's FLOP/s is divided by a matmul's
  measured right after it, on an accelerator by the chip's datasheet peak.
  """
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
  device = jax.devices()[0]
  accelerator = device.platform != "cpu"
  datasheet, source = peak_flops(device, cfg.model.dtype) if accelerator else (None, "measured f32 matmul")
  n = 2048
  a = jnp.ones((n, n), jnp.float32)
  matmul = jax.jit(lambda x: x @ x)
  for i in range(3):  # Compile and warm up the step (and, on a CPU, the probe).
    state, _ = trainer.train_step(state, batches[i % 4])
    if not accelerator:
      jax.block_until_ready(matmul(a))
  jax.block_until_ready(state)

  step_times, ratios, peaks = [], [], []
  for i in range(args.steps):
    (state, _), step_time = timed(trainer.train_step, state, batches[i % 4])
    # On a CPU: one untimed matmul, then the timed one.
    peak = (datasheet or float("nan")) if accelerator else 2 * n**3 / best_seconds(matmul, a, repeats=1)
    step_times.append(step_time)
    peaks.append(peak)
    ratios.append(step_flops / step_time / peak)

  median_step = statistics.median(step_times)
  params = count_params(state["params"])
  print(
    f"config {cfg.name}: {params / 1e6:.2f} M parameters, batch {b} x {length}, {cfg.model.dtype}, attention "
    f"{cfg.model.attention}, {jax.device_count()} {jax.default_backend()} device(s) ({device.device_kind}), "
    f"{step_flops / 1e9:.1f} GFLOP/step"
  )
  print(
    f"median step {median_step * 1e3:.2f} ms | {b * length / median_step:,.0f} tokens/s | "
    f"{step_flops / median_step / 1e12:.2f} TFLOP/s | peak ({source}) {statistics.median(peaks) / 1e12:.2f} "
    f"TFLOP/s | MFU median {100 * statistics.median(ratios):.1f}% (min {100 * min(ratios):.1f}%, "
    f"max {100 * max(ratios):.1f}%) over {args.steps} steps"
  )
  if args.json:
    result = {
      "config": cfg.name, "sets": args.set, "device": device.device_kind, "devices": jax.device_count(),
      "dtype": cfg.model.dtype, "attention": cfg.model.attention, "params": params, "batch": b, "length": length,
      "step_ms": median_step * 1e3, "tokens_per_s": b * length / median_step, "mfu": statistics.median(ratios),
      "peak_source": source,
    }  # fmt: skip
    with args.json.open("a") as f:
      f.write(json.dumps(result) + "\n")


COMMANDS = {"train": (add_arguments, run_train)}
