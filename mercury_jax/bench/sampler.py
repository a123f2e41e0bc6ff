"""Sampler benchmark: wall time, tokens/s, NFE and loop overhead per (canvas length, steps); prints Markdown.

  python -m mercury_jax.bench sampler --checkpoint runs/tiny1024    # a trained model with max_length >= 1024
  python -m mercury_jax.bench sampler --random [PRESET]              # random params of a preset's shape

Loop overhead = sampler wall time / (NFE x one jitted forward pass of the same shape): 1.0 means the loop costs
nothing beyond the denoiser. Following BUILD_NOTES' advice for these hosts (their CPU capacity changes by 2x for
minutes at a time), each sampler run is followed by forward passes timed right after it, and the table reports
medians over runs of the per-run ratio. The canvas is unconditional: ``length`` positions, all generated. The
sampler runs through ``Sampler.run``, the engine the command line uses (compiled once per settings and shape; a
length that is not a multiple of its ``LENGTH_BUCKET`` is padded, and the forward pass is timed at that length).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import linen as nn

from mercury_jax import sharding as sh, usage
from mercury_jax.bench.throughput import time_call
from mercury_jax.config import MeshConfig, load_config
from mercury_jax.model import Transformer
from mercury_jax.sampling import canvas as cv
from mercury_jax.sampling.mesh import mesh_context
from mercury_jax.sampling.sampler import Sampler
from mercury_jax.sampling.settings import SAMPLERS


def _sampler(args) -> tuple[Sampler, str]:
  mesh = sh.make_mesh(MeshConfig(data=1), jax.devices()[:1])
  if args.checkpoint:
    return Sampler.from_checkpoint(args.checkpoint, mesh=mesh), f"trained checkpoint {args.checkpoint}"
  from mercury_jax.data.tokenizer import train_tokenizer

  cfg = load_config(args.random, {"model.max_length": max(args.lengths)})
  params = Transformer(cfg.model).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  tokenizer = train_tokenizer([Path(__file__).read_text()] * 4, 400)
  return Sampler(nn.meta.unbox(params), cfg, tokenizer, mesh=mesh), f"random params, {args.random} preset shape"


def bench(sampler: Sampler, length: int, steps: int, batch: int, repeats: int, knobs: dict) -> dict:
  settings = sampler.settings(**knobs)
  canvas = cv.make_canvas([[cv.Hole(length)]] * batch)
  out = sampler.run(canvas, steps, 0, settings)[0]  # Compiles once per (settings, shape), then runs once untimed.
  network = sampler.network
  forward = jax.jit(lambda p, z, t, s: network.logits(p, z, t, segments=s, positions=None))
  shape = out.tokens.shape  # [batch, length padded to the sampler's bucket]
  z = jnp.full(shape, settings.mask_id, jnp.int32)
  t, segment_ids = jnp.ones((batch,), jnp.float32), jnp.ones(shape, jnp.int32)
  with mesh_context(sampler.mesh, sampler.rules):
    forward(sampler.params, z, t, segment_ids).block_until_ready()
    walls, ratios, forwards = [], [], []
    for _ in range(repeats):
      wall = sampler.run(canvas, steps, 0, settings)[1]
      fwd = statistics.median(time_call(forward, sampler.params, z, t, segment_ids) for _ in range(3))
      walls.append(wall)
      forwards.append(fwd)
      ratios.append(wall / (int(out.forwards) * fwd))
  wall = statistics.median(walls)
  return {
    "length": length,
    "steps": steps,
    "nfe": int(out.forwards),
    "wall_s": wall,
    "tokens_per_s": batch * length / wall,
    "forward_ms": 1e3 * statistics.median(forwards),
    "overhead": statistics.median(ratios),
  }


def add_arguments(p: argparse.ArgumentParser) -> None:
  source = p.add_mutually_exclusive_group(required=True)
  source.add_argument("--checkpoint", help="a trained checkpoint whose model.max_length covers the longest length")
  source.add_argument("--random", nargs="?", const="tiny", metavar="PRESET", help="random params of a preset's shape")
  p.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 1024])
  p.add_argument("--steps", type=int, nargs="+", default=[4, 8, 16, 32, 64], help="plus steps = length")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--sampler", default="confidence", choices=SAMPLERS)
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--repeats", type=int, default=5, help="timed runs per row (3 at most for steps = length)")


def run_sampler(args: argparse.Namespace) -> None:
  """The sampler's loop: tokens/s, NFE and loop overhead per length and steps.

  Loop overhead = the sampler's wall time / (NFE x one forward pass of the same shape), timed right after it; a
  fully masked canvas, through Sampler.run; prints a markdown table.
  """
  sampler, source_text = _sampler(args)
  if max(args.lengths) > sampler.max_length:
    usage.fail(
      "mercury_jax.bench sampler", f"length {max(args.lengths)} exceeds the model's max_length={sampler.max_length}"
    )
  knobs = {"rule": args.sampler, "temperature": args.temperature}
  print(f"model: {source_text}; {dataclasses.asdict(sampler.cfg.model)}", file=sys.stderr)
  print(f"sampler: {knobs}, batch {args.batch}, {jax.devices()[0].device_kind}", file=sys.stderr)
  print("| length | steps | NFE | wall time (s) | tokens/s | forward (ms) | loop overhead |")
  print("|---:|---:|---:|---:|---:|---:|---:|")
  for length in args.lengths:
    for steps in sorted({*args.steps, length}):
      repeats = min(args.repeats, 3) if steps >= length else args.repeats
      r = bench(sampler, length, steps, args.batch, repeats, knobs)
      print(
        f"| {r['length']} | {r['steps']} | {r['nfe']} | {r['wall_s']:.3f} | {r['tokens_per_s']:,.0f} | "
        f"{r['forward_ms']:.2f} | {r['overhead']:.3f} |",
        flush=True,
      )


COMMANDS = {"sampler": (add_arguments, run_sampler)}
