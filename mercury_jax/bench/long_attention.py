"""Attention over long sequences: the blockwise XLA path against the dense one, and context parallelism.

``long-attention``::

    python -m mercury_jax.bench long-attention --lengths 4096,16384,32768 [--heads 4] [--kv-heads 4] [--head-dim 64]
        [--masks causal,block_diffusion] [--repeats 3] [--dense-limit-gib 4] [--backward]

For each mask and length it compiles ``attend(implementation="xla", blockwise=False)`` (the dense
``[batch, heads, length, length]`` scores) and ``blockwise=True`` (:mod:`mercury_jax.kernels.blockwise_attention`),
reads each program's temp memory from ``compile().memory_analysis()``, then times ``--repeats`` forward passes
(``--backward``: forward and the gradients wrt q, k, v) of each, alternating dense and blockwise so that a drift of
the machine's speed hits both alike, and prints a markdown table of medians. Dense is skipped (``-``) where its
float32 score matrix alone would exceed ``--dense-limit-gib``.

``context-parallel``: ring against all-gather attention, and the sequence-sharded prefill, on a simulated mesh::

    python -m mercury_jax.bench context-parallel attention --lengths 4096,16384,32768 [--shards 8] [--repeats 3]
    python -m mercury_jax.bench context-parallel prefill --lengths 4096,16384,32768 [--shards 8] [--repeats 3]

``attention``: the forward and backward pass of one attention layer (gradients wrt q, k, v; the training step's
attention) over a sequence in the zig-zag layout split over ``--shards`` devices of a ``sequence`` axis, with
``all_gather`` and ``ring`` (:mod:`mercury_jax.kernels.context_parallel`), against the same attention on one
device (the blockwise loops). ``prefill``: the exact cache's prefill of a prompt of each length through the engine
(:meth:`BlockEngine.init`), on one device and on a ``sequence`` mesh: the default-shape causal model (6 layers, d
256, 4 heads), random weights, its context extended to the length.

Both print a markdown table: tokens/s (median of ``--repeats``, the programs of one length run in turn so that a
drift of the machine's speed hits them alike) and per-device memory from ``compile().memory_analysis()``. The
devices are simulated on the host's cores (``--xla_force_host_platform_device_count``, set before JAX starts its
backend: the command must be the first thing of its process to use JAX): their collectives are memory copies and
they share the same cores, so the times show the split's overhead, not a speed-up; the memory per device is what the
split buys.
"""

from __future__ import annotations

import argparse
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from mercury_jax import attention, sharding as sh, usage
from mercury_jax.bench.throughput import interleaved
from mercury_jax.config import MeshConfig, ModelConfig
from mercury_jax.kernels import blockwise_attention as bw, masks
from mercury_jax.kernels.context_parallel import SequenceLayout

_GIB, _MIB = 2**30, 2**20


def _medians(programs: dict, repeats: int) -> dict:
  """``{name: median seconds}`` of ``{name: (compiled, args)}``, run in turn (every other round in reverse)."""
  return {name: statistics.median(t) for name, t in interleaved(programs, repeats, order="alternate").items()}


def _program(length: int, args, mask: str, blockwise: bool):
  """The compiled forward pass and its inputs."""
  diffusion_block = args.diffusion_block if mask in ("block_causal", "block_diffusion", "verified") else None
  blocks = bw.BlockSizes(args.block_q, args.block_k)

  def forward(q, k, v):
    if blockwise:
      return bw.blockwise_attention(q, k, v, mask=mask, diffusion_block=diffusion_block, block_sizes=blocks)
    return attention.attend(q, k, v, mask=mask, diffusion_block=diffusion_block, implementation="xla", blockwise=False)

  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (args.batch, length, args.heads, args.head_dim), jnp.float32)
  k, v = (jax.random.normal(key, (args.batch, length, args.kv_heads, args.head_dim), jnp.float32) for key in keys[1:])
  if args.backward:  # The training step's attention: forward and the gradients of all three inputs.
    step = jax.grad(lambda q, k, v: jnp.sum(forward(q, k, v)), argnums=(0, 1, 2))
  else:
    step = forward
  compiled = jax.jit(step).lower(q, k, v).compile()
  return compiled, (q, k, v)


def measure(length: int, args, mask: str) -> dict:
  """``{"dense": (tokens/s, temp bytes) | None, "blockwise": (...)}``, timed interleaved."""
  score_bytes = args.batch * args.heads * length * length * 4
  kinds = ["blockwise"] if score_bytes > args.dense_limit_gib * _GIB else ["dense", "blockwise"]
  programs = {kind: _program(length, args, mask, kind == "blockwise") for kind in kinds}
  seconds = _medians(programs, args.repeats)
  result = {"dense": None}
  for kind, (compiled, _) in programs.items():
    temp = compiled.memory_analysis().temp_size_in_bytes
    result[kind] = (args.batch * length / seconds[kind], temp)
  return result


def _memory(n: int) -> str:
  return f"{n / _GIB:.2f} GiB" if n >= _GIB else f"{n / 2**20:.1f} MiB"


def add_long_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--lengths", default="4096,16384,32768", help="comma-separated sequence lengths")
  parser.add_argument("--masks", default="causal,block_diffusion", help="comma-separated masks of attend")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--diffusion-block", type=int, default=32, help="the block of the block masks")
  parser.add_argument("--block-q", type=int, default=bw.BlockSizes().block_q)
  parser.add_argument("--block-k", type=int, default=bw.BlockSizes().block_k)
  parser.add_argument("--repeats", type=int, default=3, help="timed forward passes per path (after one warm-up)")
  parser.add_argument("--backward", action="store_true", help="time forward + backward (dq, dk, dv) instead")
  parser.add_argument("--dense-limit-gib", type=float, default=4.0, help="skip dense above this score-matrix size")


def run_long_attention(args: argparse.Namespace) -> None:
  """Attention over long sequences: blockwise against dense.

  Each mask and length, forward (or --backward) passes of both paths alternated; dense skipped where its scores
  alone would exceed --dense-limit-gib; prints a markdown table of medians.
  """
  args.kv_heads = args.kv_heads or args.heads
  lengths = [int(x) for x in args.lengths.split(",")]
  masks = args.masks.split(",")
  if args.repeats < 1:
    usage.fail("mercury_jax.bench long-attention", f"--repeats={args.repeats} must be >= 1")

  print(f"batch {args.batch}, heads {args.heads}/{args.kv_heads} kv, head_dim {args.head_dim}, float32, ", end="")
  print(f"chunks {args.block_q}x{args.block_k}, {args.repeats} repeats, backend {jax.default_backend()}\n")
  what = "fwd+bwd" if args.backward else "fwd"
  print(
    f"| mask | length | dense {what} tok/s | blockwise {what} tok/s | blockwise/dense | dense temp | blockwise temp |"
  )
  print("|---|---:|---:|---:|---:|---:|---:|")
  for mask in masks:
    for length in lengths:
      result = measure(length, args, mask)
      fast, small = result["blockwise"]
      if result["dense"] is None:
        dense_rate = ratio = dense_temp = "-"
      else:
        rate, temp = result["dense"]
        dense_rate, ratio, dense_temp = f"{rate:,.0f}", f"{fast / rate:.2f}x", _memory(temp)
      print(
        f"| {mask} | {length} | {dense_rate} | {fast:,.0f} | {ratio} | {dense_temp} | {_memory(small)} |", flush=True
      )


def _mesh(shards: int):
  return sh.make_mesh(MeshConfig(data=1, sequence=shards), jax.devices()[:shards])


def _attention_grads(mask: str, block, strategy: str, layout):
  """``(q, k, v) -> the gradients of sum(attention)``: the training step's attention, forward and backward."""

  def loss(q, k, v):
    out = attention.attend(
      q, k, v, mask=mask, diffusion_block=block, layout=layout, context_parallel=strategy, implementation="xla",
      blockwise=None if layout else True,
    )  # fmt: skip
    return jnp.sum(out)

  return jax.grad(loss, argnums=(0, 1, 2))


def attention_rows(args) -> list[str]:
  rows = []
  for mask in args.masks.split(","):
    block = args.diffusion_block if mask in masks.BLOCK_MASKS else None
    for length in (int(n) for n in args.lengths.split(",")):
      keys = jax.random.split(jax.random.key(0), 3)
      q = jax.random.normal(keys[0], (1, length, args.heads, args.head_dim), jnp.float32)
      k, v = (jax.random.normal(key, (1, length, args.kv_heads, args.head_dim), jnp.float32) for key in keys[1:])
      layout = SequenceLayout(args.shards, "zigzag")
      mesh = _mesh(args.shards)

      step = lambda strategy, layout, mask=mask, block=block: _attention_grads(mask, block, strategy, layout)  # noqa: E731
      programs = {"one device": (jax.jit(step("all_gather", None)).lower(q, k, v).compile(), (q, k, v))}
      with sh.context(mesh, sh.RULES):
        split = jax.sharding.NamedSharding(mesh, jax.P(None, "sequence"))
        placed = tuple(jax.device_put(x, split) for x in (q, k, v))
        for strategy in ("all_gather", "ring"):
          compiled = jax.jit(step(strategy, layout)).lower(*placed).compile()
          programs[strategy] = (compiled, placed)
      for name, seconds in _medians(programs, args.repeats).items():
        temp = programs[name][0].memory_analysis().temp_size_in_bytes
        devices = 1 if name == "one device" else args.shards
        rows.append(f"| {mask} | {length} | {name} | {devices} | {length / seconds:,.0f} | {temp / _MIB:.1f} MiB |")
        print(rows[-1], flush=True)
  return rows


def prefill_rows(args) -> list[str]:
  from flax import linen as nn

  from mercury_jax.model import Transformer, param_shardings
  from mercury_jax.sampling import canvas as cv
  from mercury_jax.sampling.engine import BlockEngine, prefill_slots
  from mercury_jax.sampling.plan import plan_blocks
  from mercury_jax.sampling.settings import SamplerSettings

  rows = []
  for length in (int(n) for n in args.lengths.split(",")):
    cfg = ModelConfig(max_length=length + 64, causal=True, attention="xla", context_parallel=args.strategy)
    params = nn.meta.unbox(Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"]
    prompt = np.random.default_rng(0).integers(5, cfg.vocab_size, length).tolist()
    canvas = cv.make_canvas([cv.prefix(prompt, 64)])
    settings = SamplerSettings(eos_id=3, num_tokens=cfg.vocab_size, temperature=0.0).validate()
    plan = plan_blocks(canvas.kinds, 1, cache="exact", autoregressive=True)
    engine = BlockEngine(cfg, settings, plan)
    size = prefill_slots(canvas.kinds, plan)

    def start(p, engine=engine, canvas=canvas, size=size):
      return engine.init(p, canvas, jax.random.key(0), jnp.int32(1), prefill=size).cache

    programs = {"one device": (jax.jit(start).lower(params).compile(), (params,))}
    mesh = _mesh(args.shards)
    sharded = jax.device_put(params, param_shardings(Transformer(cfg), mesh, sh.RULES))
    programs[f"sequence {args.shards}"] = (sh.MeshJit(start, mesh, sh.RULES).lower(sharded).compile(), (sharded,))
    for name, seconds in _medians(programs, args.repeats).items():
      memory = programs[name][0].memory_analysis()
      rows.append(
        f"| {length} | {size} | {name} | {size / seconds:,.0f} | {memory.temp_size_in_bytes / _MIB:.1f} MiB | "
        f"{memory.output_size_in_bytes / _MIB:.1f} MiB |"
      )
      print(rows[-1], flush=True)
  return rows


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("mode", choices=("attention", "prefill"))
  parser.add_argument("--lengths", default="4096,16384,32768", help="comma-separated sequence lengths")
  parser.add_argument("--shards", type=int, default=8, help="devices on the sequence axis (simulated)")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--masks", default="causal,block_diffusion", help="attention: comma-separated masks")
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--kv-heads", type=int, default=2)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--diffusion-block", type=int, default=32)
  parser.add_argument("--strategy", default="all_gather", choices=("all_gather", "ring"), help="prefill: how")


def _simulate_devices(count: int) -> None:
  """``count`` host devices (and the CPU backend, unless JAX_PLATFORMS names one), set before JAX's backend starts."""
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"
  if "JAX_PLATFORMS" not in os.environ:
    jax.config.update("jax_platforms", "cpu")
  if jax.device_count() < count:
    usage.fail(
      "mercury_jax.bench context-parallel",
      f"--shards {count} needs {count} devices and JAX has {jax.device_count()}: run the command in a fresh process",
    )


def run_context_parallel(args: argparse.Namespace) -> None:
  """Context parallelism on a simulated mesh: ring against all-gather.

  attention: one layer's forward and backward over --shards devices of a sequence axis against one device; prefill:
  the exact cache's prefill through the engine on one device and on a sequence mesh; tokens/s and memory per device.
  """
  _simulate_devices(args.shards)
  print(f"machine: {os.cpu_count()} CPU cores, {len(jax.devices())} simulated devices; jax {jax.__version__}")
  if args.mode == "attention":
    print("| mask | length | attention | devices | fwd+bwd tok/s | temp per device |")
    print("|---|---|---|---|---|---|")
    attention_rows(args)
  else:
    print("| prompt | prefill slots | where | prefill tok/s | temp per device | cache per device |")
    print("|---|---|---|---|---|---|")
    prefill_rows(args)


COMMANDS = {
  "long-attention": (add_long_arguments, run_long_attention),
  "context-parallel": (add_parallel_arguments, run_context_parallel),
}
