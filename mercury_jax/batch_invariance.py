"""Batch-invariant execution: a row's outputs bitwise the same whatever rows share its batch.

A batched pass is row-independent only up to rounding. XLA:CPU picks other matmul kernels (another order of the
contraction) as a product's rows grow, and reduces a ``[1, ...]`` array in another order than a ``[4, ...]`` one; one
ulp then flips a sampled token a few steps later. The serving engine runs a step over a batch bucket that changes
with the load, so it cannot let a request's tokens depend on the bucket (``docs/results/serving.md``, "Batch buckets
over a paged KV cache").

Under a :class:`Tiling` every operation that reduces runs over operands of one fixed shape, as the same program in
every batch:

- :func:`tiled`: a matmul or a normalisation over a fixed tile of ``tokens`` positions (the last one padded), the
  tiles unrolled (their number is static). The weights stay in cache from one tile to the next, so this keeps most
  of a batched matmul's weight reuse, which a whole network run row by row (each row reading every weight again)
  gives up.
- :func:`by_rows`: attention and the proposals' softmax, one row at a time (there is no weight to share).

Elementwise work runs batched: it rounds the same at any shape. Each tile's and each row's program is fenced with
``lax.optimization_barrier``, so that XLA cannot fuse it with its neighbours (a bucket of one tile, or a loop of one
trip inlined): it compiles to the program it is among many.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Tiling(NamedTuple):
  """Batch-invariant execution of the model (:class:`~mercury_jax.model.Transformer`'s ``tiling``).

  Attributes:
    tokens: Positions per tile of a matmul or normalisation.
    shards: The data-parallel size of the mesh: a tile holds ``tokens`` positions of every shard's rows (each device
      works on its own), and a row pass takes one row of every shard. The rows of a batch split over the shards in
      contiguous runs, so every leading axis given here must be a multiple of ``shards``.
  """

  tokens: int
  shards: int = 1


def _fenced(fn: Callable) -> Callable:
  return lambda args: jax.lax.optimization_barrier(fn(*jax.lax.optimization_barrier(args)))


def tiled(fn: Callable[..., Any], tiling: Tiling | None, *xs: jax.Array) -> Any:
  """``fn(*xs)`` for a function that works on each row of its ``[n, ...]`` operands alone (a matmul by a weight, a
  normalisation over the last axis), run over tiles of ``tiling.tokens`` rows of every shard; batched when
  ``tiling`` is None.

  Returns:
    ``fn``'s outputs (a pytree of ``[n, ...]`` arrays).
  """
  if tiling is None:
    return fn(*xs)
  n, shards, size = xs[0].shape[0], tiling.shards, tiling.tokens
  if n % shards:
    raise ValueError(f"{n=} rows must split evenly over the {shards} data shards")
  per = n // shards
  count = -(-per // size)
  if count == 0:  # no row: nothing rounds
    return fn(*xs)
  # [n, ...] -> [shards, count * size, ...]: each shard's rows, padded to whole tiles.
  padded = [
    jnp.pad(a.reshape(shards, per, *a.shape[1:]), [(0, 0), (0, count * size - per)] + [(0, 0)] * (a.ndim - 1))
    for a in xs
  ]
  tile = lambda a, i: a[:, i * size : (i + 1) * size].reshape(shards * size, *a.shape[2:])  # noqa: E731
  # The tiles unrolled (their number is static): a loop over them costs a copy of every tile in and out.
  outs = [_fenced(fn)(tuple(tile(a, i) for a in padded)) for i in range(count)]

  def merge(*tiles: jax.Array) -> jax.Array:  # [shards * size, ...] per tile -> [n, ...]
    rest = tiles[0].shape[1:]
    a = jnp.stack([t.reshape(shards, size, *rest) for t in tiles], axis=1).reshape(shards, count * size, *rest)
    return a[:, :per].reshape(n, *rest)

  return jax.tree.map(merge, *outs)


def positionwise(fn: Callable[[jax.Array], Any], tiling: Tiling | None, x: jax.Array) -> Any:
  """``fn(x)`` for a function of each position of ``x`` ``[..., features]`` alone (a norm, a projection), under a
  tiling over tiles of positions (:func:`tiled`); its outputs keep ``x``'s leading axes."""
  if tiling is None:
    return fn(x)
  out = tiled(fn, tiling, x.reshape(-1, x.shape[-1]))  # [positions, ...]
  return jax.tree.map(lambda a: a.reshape(*x.shape[:-1], *a.shape[1:]), out)


def by_rows(fn: Callable[..., Any], shards: int, *args: Any) -> Any:
  """``fn(*args)`` for a function of batched pytrees (``[b, ...]`` leaves; None allowed) that works on each row
  alone, run one row of every shard at a time (row ``r`` of a batch of ``b`` goes with rows ``r + b / shards``,
  ``r + 2 b / shards``, ...), so that every batch runs the same program on each row."""
  batch = jax.tree.leaves(args)[0].shape[0]
  group = math.gcd(shards, batch)  # a smaller batch (a prefill's one row) than the shards: what divides it

  def rows(a: jax.Array) -> jax.Array:  # [b, ...] -> [b / group, group, ...]
    return jnp.swapaxes(a.reshape(group, a.shape[0] // group, *a.shape[1:]), 0, 1)

  def batched(a: jax.Array) -> jax.Array:
    return jnp.swapaxes(a, 0, 1).reshape(a.shape[0] * a.shape[1], *a.shape[2:])

  return jax.tree.map(batched, jax.lax.map(_fenced(fn), jax.tree.map(rows, args)))
