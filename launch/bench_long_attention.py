"""Long-context attention: the blockwise XLA path against the dense one, forward tokens/s and compiled temp memory.

    python launch/bench_long_attention.py --lengths 4096,16384,32768 [--heads 4] [--kv-heads 4] [--head-dim 64]
        [--masks causal,block_diffusion] [--repeats 3] [--dense-limit-gib 4] [--backward]

For each mask and length it compiles ``attend(implementation="xla", blockwise=False)`` (the dense
``[batch, heads, length, length]`` scores) and ``blockwise=True`` (:mod:`mercury_jax.kernels.blockwise_attention`),
reads each program's temp memory from ``compile().memory_analysis()``, then times ``--repeats`` forward passes
(``--backward``: forward and the gradients wrt q, k, v) of each, alternating dense and blockwise so that a drift of
the machine's speed hits both alike, and prints a markdown table of medians. Dense is skipped (``-``) where its
float32 score matrix alone would exceed ``--dense-limit-gib``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from mercury_jax import attention
from mercury_jax.kernels import blockwise_attention as bw

_GIB = 2**30


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


def _time(compiled, inputs) -> float:
  start = time.perf_counter()
  jax.block_until_ready(compiled(*inputs))
  return time.perf_counter() - start


def measure(length: int, args, mask: str) -> dict:
  """``{"dense": (tokens/s, temp bytes) | None, "blockwise": (...)}``, timed interleaved."""
  score_bytes = args.batch * args.heads * length * length * 4
  kinds = ["blockwise"] if score_bytes > args.dense_limit_gib * _GIB else ["dense", "blockwise"]
  programs = {kind: _program(length, args, mask, kind == "blockwise") for kind in kinds}
  for compiled, inputs in programs.values():  # Warm-up: the first call allocates.
    _time(compiled, inputs)
  times = {kind: [] for kind in kinds}
  for repeat in range(args.repeats):
    for kind in kinds if repeat % 2 == 0 else kinds[::-1]:
      times[kind].append(_time(*programs[kind]))
  result = {"dense": None}
  for kind, (compiled, _) in programs.items():
    temp = compiled.memory_analysis().temp_size_in_bytes
    result[kind] = (args.batch * length / statistics.median(times[kind]), temp)
  return result


def _memory(n: int) -> str:
  return f"{n / _GIB:.2f} GiB" if n >= _GIB else f"{n / 2**20:.1f} MiB"


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
  args = parser.parse_args(argv)
  args.kv_heads = args.kv_heads or args.heads
  lengths = [int(x) for x in args.lengths.split(",")]
  masks = args.masks.split(",")
  if args.repeats < 1:
    raise SystemExit(f"--repeats={args.repeats} must be >= 1")

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


if __name__ == "__main__":
  main()
