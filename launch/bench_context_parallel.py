"""Context parallelism on a simulated mesh: ring against all-gather attention, and the sequence-sharded prefill.

    python launch/bench_context_parallel.py attention --lengths 4096,16384,32768 [--shards 8] [--repeats 3]
    python launch/bench_context_parallel.py prefill --lengths 4096,16384,32768 [--shards 8] [--repeats 3]

``attention``: the forward and backward pass of one attention layer (gradients wrt q, k, v; the training step's
attention) over a sequence in the zig-zag layout split over ``--shards`` devices of a ``sequence`` axis, with
``all_gather`` and ``ring`` (:mod:`mercury_jax.kernels.context_parallel`), against the same attention on one
device (the blockwise loops). ``prefill``: the exact cache's prefill of a prompt of each length through the engine
(:meth:`BlockEngine.init`), on one device and on a ``sequence`` mesh: the default-shape causal model (6 layers, d
256, 4 heads), random weights, its context extended to the length.

Both print a markdown table: tokens/s (median of ``--repeats``, the programs of one length run in turn so that a
drift of the machine's speed hits them alike) and per-device memory from ``compile().memory_analysis()``. The
devices are simulated on the host's cores (``--xla_force_host_platform_device_count``): their collectives are
memory copies and they share the same cores, so the times show the split's overhead, not a speed-up; the memory per
device is what the split buys.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _devices_flag(argv) -> None:
  shards = 8
  if "--shards" in argv:
    shards = int(argv[argv.index("--shards") + 1])
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={shards}"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


_devices_flag(sys.argv)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mercury_jax import attention, sharding as sh  # noqa: E402
from mercury_jax.config import MeshConfig, ModelConfig  # noqa: E402
from mercury_jax.kernels import masks  # noqa: E402
from mercury_jax.kernels.context_parallel import SequenceLayout  # noqa: E402

_MIB = 2**20


def _time(fn, *args) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - start


def _measure(programs: dict, repeats: int) -> dict:
  """``{name: (median seconds, compiled)}`` for ``{name: (compiled, args)}``, run in turn."""
  for compiled, args in programs.values():
    _time(compiled, *args)  # Warm-up: the first call allocates.
  times = {name: [] for name in programs}
  names = list(programs)
  for repeat in range(repeats):
    for name in names if repeat % 2 == 0 else names[::-1]:
      times[name].append(_time(programs[name][0], *programs[name][1]))
  return {name: (statistics.median(times[name]), programs[name][0]) for name in names}


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
      for name, (seconds, compiled) in _measure(programs, args.repeats).items():
        temp = compiled.memory_analysis().temp_size_in_bytes
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
    for name, (seconds, compiled) in _measure(programs, args.repeats).items():
      memory = compiled.memory_analysis()
      rows.append(
        f"| {length} | {size} | {name} | {size / seconds:,.0f} | {memory.temp_size_in_bytes / _MIB:.1f} MiB | "
        f"{memory.output_size_in_bytes / _MIB:.1f} MiB |"
      )
      print(rows[-1], flush=True)
  return rows


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
  args = parser.parse_args(argv)
  print(f"machine: {os.cpu_count()} CPU cores, {len(jax.devices())} simulated devices; jax {jax.__version__}")
  if args.mode == "attention":
    print("| mask | length | attention | devices | fwd+bwd tok/s | temp per device |")
    print("|---|---|---|---|---|---|")
    attention_rows(args)
  else:
    print("| prompt | prefill slots | where | prefill tok/s | temp per device | cache per device |")
    print("|---|---|---|---|---|---|")
    prefill_rows(args)


if __name__ == "__main__":
  main()
