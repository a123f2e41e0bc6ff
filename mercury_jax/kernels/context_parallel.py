"""Context parallelism: attention over a sequence whose positions are split across the devices of a mesh axis.

With ``mesh.sequence > 1`` the model's activations are ``[batch, length / shards, ...]`` on each device of the
``sequence`` axis (``sharding.LENGTH`` maps onto it), so no device holds a layer's activations for the whole
sequence. Every layer's MLP, norms and projections are local; attention is not, and runs here, per shard inside a
``jax.shard_map``, in one of two ways (``model.context_parallel``):

* ``all_gather``: each shard gathers the whole sequence's keys and values (one ``all_gather`` per layer; its
  transpose, a reduce-scatter, returns the key/value gradients to their shards) and attends its own queries over
  them with the memory-bounded loops of :mod:`mercury_jax.kernels.blockwise_attention`. MaxText's context
  parallelism works this way; with grouped-query attention the keys and values are the small part of a layer.
* ``ring``: the key/value blocks travel around the shards (``ppermute`` to the next shard, ``shards`` steps), and
  each shard folds the block passing through it into its queries' online softmax (Liu et al. 2023, "Ring Attention
  with Blockwise Transformers for Near-Infinite Context", arXiv:2310.01889). The backward pass sends the blocks
  around again with their ``dk``, ``dv`` accumulators, which arrive home after the last step. No shard ever holds
  more than its own queries and one visiting block.

Masks are functions of global positions (:mod:`mercury_jax.kernels.masks`), so every mask of ``attend`` works: each
shard knows the global position of each of its queries and of every key block it sees.

**Load balance.** Under a causal (or block-causal, or BD3-LM / TiDAR two-halves) mask the query at position ``i``
sees about ``i`` keys, so a shard holding the last ``1 / shards`` of a contiguous split does ``2 - 1 / shards`` times
the average work while the first waits. The ``zigzag`` layout (:class:`SequenceLayout`) cuts the sequence into
``2 * shards`` pieces and gives shard ``s`` pieces ``s`` and ``2 * shards - 1 - s``: an early and a late piece,
whose work sums to the same for every shard (for the two-halves masks, whose work grows along each half, the
pairing also gives every shard equal work). The model permutes its input tokens into this layout once and its
output back once (:meth:`SequenceLayout.to_layout`, :meth:`SequenceLayout.to_natural`); the positions that rotary
embeddings and masks see are the tokens' own. Bidirectional attention needs no balancing and keeps the contiguous
split.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax import lax

from mercury_jax.kernels import blockwise_attention as bw

LAYOUTS = ("contiguous", "zigzag")
STRATEGIES = ("all_gather", "ring")


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
  """Which positions of a sequence each of ``shards`` devices holds.

  ``contiguous``: shard ``s`` holds positions ``[s * L / n, (s + 1) * L / n)``. ``zigzag``: the sequence is cut into
  ``2n`` pieces and shard ``s`` holds pieces ``s`` and ``2n - 1 - s``, in that order (the module docstring).
  """

  shards: int
  kind: str = "zigzag"

  def __post_init__(self):
    if self.kind not in LAYOUTS:
      raise ValueError(f"SequenceLayout.kind={self.kind!r} must be one of {LAYOUTS}")
    if self.shards < 1:
      raise ValueError(f"SequenceLayout.shards={self.shards} must be >= 1")

  @property
  def runs(self) -> int:
    """Contiguous runs of positions per shard."""
    return 2 if self.kind == "zigzag" else 1

  @property
  def pieces(self) -> int:
    return self.shards * self.runs

  def divides(self, length: int) -> bool:
    return length % self.pieces == 0

  def run_starts(self, shard, run_length: int) -> list:
    """The first global position of each of ``shard``'s runs (``shard``: a traced or static int)."""
    if self.kind == "contiguous":
      return [shard * run_length]
    return [shard * run_length, (self.pieces - 1 - shard) * run_length]

  def positions(self, shard, local_length: int) -> jax.Array:
    """``[local_length]`` int32: the global positions of ``shard``'s slots, in its order."""
    run = local_length // self.runs
    offsets = jnp.arange(run, dtype=jnp.int32)
    return jnp.concatenate([start + offsets for start in self.run_starts(jnp.int32(shard), run)])

  def order(self) -> np.ndarray:
    """``[pieces]``: the natural piece held at each piece slot of the layout (shard-major)."""
    if self.kind == "contiguous":
      return np.arange(self.pieces)
    n = self.shards
    return np.stack([np.arange(n), 2 * n - 1 - np.arange(n)], axis=1).reshape(-1)

  def to_layout(self, x: jax.Array, axis: int, logical: tuple[str | None, ...] | None = None) -> jax.Array:
    """``x`` with its ``axis`` (natural order, a multiple of ``pieces``) permuted into the layout's order.

    ``logical``: ``x``'s logical axis names, for an ``x`` split over the sequence shards (``sharding.LENGTH`` at
    ``axis``): the pieces then move between the shards by two collective permutes (:func:`_exchange`), where a
    plain gather would make GSPMD gather the whole of ``x`` on every device."""
    return self._permute(x, axis, logical, natural=False)

  def to_natural(self, x: jax.Array, axis: int, logical: tuple[str | None, ...] | None = None) -> jax.Array:
    """The inverse of :meth:`to_layout`: the layout's order back to the natural one (split contiguously)."""
    return self._permute(x, axis, logical, natural=True)

  def _permute(self, x: jax.Array, axis: int, logical, natural: bool) -> jax.Array:
    if self.kind == "contiguous":
      return x
    axis = axis % x.ndim
    length = x.shape[axis]
    if not self.divides(length):
      raise ValueError(f"{length=} must be a multiple of {self.pieces} pieces ({self.shards} shards, {self.kind})")
    split = _split_spec(x, axis, logical, self.shards)
    if split is not None:
      spec, mesh_axis = split
      fn = functools.partial(_exchange, axis=axis, mesh_axis=mesh_axis, shards=self.shards, natural=natural)
      return jax.shard_map(fn, in_specs=spec, out_specs=spec, check_vma=False)(x)
    pieces = np.argsort(self.order()) if natural else self.order()
    parts = x.reshape(*x.shape[:axis], self.pieces, length // self.pieces, *x.shape[axis + 1 :])
    return jnp.take(parts, jnp.asarray(pieces), axis=axis).reshape(x.shape)


def _split_spec(x: jax.Array, axis: int, logical, shards: int):
  """``(x's partition spec, the mesh axis its ``axis`` is split over)`` when, in the mesh and rules in context,
  ``logical`` splits ``axis`` over exactly ``shards`` devices; else None."""
  if logical is None:
    return None
  from mercury_jax import sharding as sh  # Imported here: the kernels need no mesh machinery otherwise.

  mesh, rules = jax.sharding.get_abstract_mesh(), nn.get_logical_axis_rules()
  if mesh.empty or not rules:
    return None
  spec = sh.mesh_spec(logical, x.shape, mesh, rules)
  names = spec[axis]
  if names is None:
    return None
  size = math.prod(mesh.shape[a] for a in ((names,) if isinstance(names, str) else names))
  return (spec, names) if size == shards else None


def _exchange(x, *, axis: int, mesh_axis, shards: int, natural: bool):
  """One shard's part of the zig-zag permutation, inside a ``shard_map``: two ``ppermute`` calls move its two pieces.

  In the layout shard ``s`` holds pieces ``(s, 2n - 1 - s)``; split naturally, shard ``t`` holds ``(2t, 2t + 1)``.
  Piece ``2t`` comes from shard ``a(t) = 2t`` (its first piece) if ``2t < n``, else ``2n - 1 - 2t`` (its second), and
  ``t -> a(t)`` is a permutation whose sources of even index send their first piece and the others their second;
  piece ``2t + 1`` likewise from ``b(t) = 2t + 1`` or ``2n - 2 - 2t``, the sources of odd index sending their first.
  So every shard sends its piece ``s % 2`` along ``a`` and the other along ``b``.
  """
  n = shards
  a = [(2 * t if 2 * t < n else 2 * n - 1 - 2 * t, t) for t in range(n)]  # (source, destination)
  b = [(2 * t + 1 if 2 * t + 1 < n else 2 * n - 2 - 2 * t, t) for t in range(n)]
  first, second = jnp.split(x, 2, axis=axis)
  even = lax.axis_index(mesh_axis) % 2 == 0
  if natural:  # Layout -> natural.
    along_a, along_b = jnp.where(even, first, second), jnp.where(even, second, first)
    return jnp.concatenate(
      [lax.ppermute(along_a, mesh_axis, a), lax.ppermute(along_b, mesh_axis, b)], axis=axis
    )  # fmt: skip
  back = lambda perm: [(dst, src) for src, dst in perm]  # noqa: E731  Natural -> layout: the same moves reversed.
  from_a, from_b = lax.ppermute(first, mesh_axis, back(a)), lax.ppermute(second, mesh_axis, back(b))
  return jnp.concatenate([jnp.where(even, from_a, from_b), jnp.where(even, from_b, from_a)], axis=axis)


def _plan(mask, diffusion_block, half, scale, blocks: bw.BlockSizes) -> bw.Plan:
  return bw.Plan(mask, diffusion_block, half, blocks.block_q, blocks.block_k, scale)


def attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  segment_ids: jax.Array,
  *,
  mask: str,
  diffusion_block: int | None,
  half: int | None,
  axis,
  layout: SequenceLayout,
  strategy: str = "all_gather",
  block_sizes: bw.BlockSizes | None = None,
) -> jax.Array:
  """One shard's attention output, inside a ``shard_map`` over the mesh axis (or axes) ``axis``.

  Args:
    q: ``[batch, local_length, heads, head_dim]``, this shard's queries in ``layout`` order.
    k: ``[batch, local_length, kv_heads, head_dim]``, this shard's keys; ``v`` likewise.
    segment_ids: ``[batch, local_length]`` int32 (0: padding).
    mask: one of :data:`mercury_jax.kernels.masks.MASKS`, over the whole sequence's positions.
    diffusion_block: the block masks' block.
    half: the two-halves masks' first half of the whole sequence.
    axis: the mesh axis name(s) the sequence is split over.
    layout: which positions each shard holds.
    strategy: ``all_gather`` or ``ring`` (the module docstring).
    block_sizes: the blockwise loops' chunks (default 512 x 512, shrunk to fit).

  Returns:
    ``[batch, local_length, heads, head_dim]`` in ``q.dtype``.
  """
  if strategy not in STRATEGIES:
    raise ValueError(f"context parallelism {strategy=} must be one of {STRATEGIES}")
  batch, local, heads, head_dim = q.shape
  if local % layout.runs:
    raise ValueError(f"a shard's {local=} positions must split into {layout.runs} runs ({layout.kind})")
  kv_heads = k.shape[2]
  run = local // layout.runs
  blocks = (block_sizes or bw.BlockSizes()).fit(run)
  plan = _plan(mask, diffusion_block, half, head_dim**-0.5, blocks)
  shard = lax.axis_index(axis)
  q_t = bw.pad_to(bw.heads_first(q, kv_heads), blocks.block_q, 3)
  q_seg = bw.pad_to(segment_ids, blocks.block_q, 1)
  q_pos = bw.pad_to(layout.positions(shard, local), blocks.block_q, 0, mode="edge")
  k_t, v_t = (x.transpose(0, 2, 1, 3) for x in (k, v))  # [batch, kv_heads, local, head_dim]
  if strategy == "all_gather":
    gather = lambda x, dim: layout.to_natural(lax.all_gather(x, axis, axis=dim, tiled=True), dim)  # noqa: E731
    k_all, v_all = (bw.pad_to(gather(x, 2), blocks.block_k, 2) for x in (k_t, v_t))  # [b, kv, length, d]
    k_seg = bw.pad_to(gather(segment_ids, 1), blocks.block_k, 1)
    out = bw.attention_at(plan, q_t, k_all, v_all, q_seg, k_seg, q_pos, jnp.int32(0))
  else:
    # Each run of keys padded to whole chunks (segment 0: invisible), so a visiting block is `runs` padded runs.
    by_run = lambda x, dim: jnp.concatenate(  # noqa: E731
      [
        bw.pad_to(lax.slice_in_dim(x, r * run, (r + 1) * run, axis=dim), blocks.block_k, dim)
        for r in range(layout.runs)
      ],
      axis=dim,
    )
    ring = _Ring(plan, axis, layout, run)
    out = _ring_attention(ring, q_t, by_run(k_t, 2), by_run(v_t, 2), q_seg, by_run(segment_ids, 1), q_pos)
  return bw.heads_last(out)[:, :local].astype(q.dtype)


@dataclasses.dataclass(frozen=True)
class _Ring:
  """The static part of a ring attention: the blockwise plan, the mesh axis, the layout and a run's real length."""

  plan: bw.Plan
  axis: object
  layout: SequenceLayout
  run: int

  def rotate(self, *xs):
    """Each array moved to the next shard along the axis (shard ``s`` receives shard ``s - 1``'s)."""
    n = self.layout.shards
    return tuple(lax.ppermute(x, self.axis, [(s, (s + 1) % n) for s in range(n)]) for x in xs)

  def runs_of(self, block_owner, padded_run: int):
    """``(slice start in the padded block, global position of its first key)`` of each run of a block."""
    starts = self.layout.run_starts(block_owner, self.run)
    return [(r * padded_run, start) for r, start in enumerate(starts)]


def _cut(x, offset: int, size: int, dim: int):
  return lax.slice_in_dim(x, offset, offset + size, axis=dim)


def _ring_steps(ring: _Ring, k):
  n = ring.layout.shards
  shard = lax.axis_index(ring.axis)
  padded_run = k.shape[2] // ring.layout.runs
  return n, shard, padded_run


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(ring: _Ring, q, k, v, q_seg, k_seg, q_pos):
  return _ring_forward(ring, q, k, v, q_seg, k_seg, q_pos)[0]


def _ring_forward(ring: _Ring, q, k, v, q_seg, k_seg, q_pos):
  n, shard, padded_run = _ring_steps(ring, k)

  def step(s, carry):
    state, k, v, k_seg = carry
    for offset, start in ring.runs_of((shard - s) % n, padded_run):  # The block that reached this shard after s hops.
      k_r, v_r, seg_r = (_cut(x, offset, padded_run, dim) for x, dim in ((k, 2), (v, 2), (k_seg, 1)))
      state = bw.accumulate(ring.plan, q, q_pos, q_seg, k_r, v_r, start, seg_r, state)
    return (state, *ring.rotate(k, v, k_seg))

  state, *_ = lax.fori_loop(0, n, step, (bw.init_state(q), k, v, k_seg))
  return bw.finalize(state)


def _ring_fwd(ring: _Ring, q, k, v, q_seg, k_seg, q_pos):
  out, lse = _ring_forward(ring, q, k, v, q_seg, k_seg, q_pos)
  return out, (q, k, v, q_seg, k_seg, q_pos, out, lse)


def _ring_bwd(ring: _Ring, residuals, d_out):
  q, k, v, q_seg, k_seg, q_pos, out, lse = residuals
  n, shard, padded_run = _ring_steps(ring, k)
  delta = jnp.sum(d_out.astype(jnp.float32) * out, axis=-1)  # [b, kv, g, local]: rowsum(dO * O)

  def step(s, carry):
    dq, k, v, k_seg, dk, dv = carry
    for offset, start in ring.runs_of((shard - s) % n, padded_run):
      k_r, v_r, seg_r, dk_r, dv_r = (
        _cut(x, offset, padded_run, dim) for x, dim in ((k, 2), (v, 2), (k_seg, 1), (dk, 2), (dv, 2))
      )
      dq, dk_run, dv_run = bw.gradients(
        ring.plan, q, q_pos, q_seg, k_r, v_r, start, seg_r, lse, delta, d_out, (dq, dk_r, dv_r)
      )
      dk = lax.dynamic_update_slice_in_dim(dk, dk_run, offset, axis=2)
      dv = lax.dynamic_update_slice_in_dim(dv, dv_run, offset, axis=2)
    # The block moves on with its gradient accumulators; after n hops both are back at their own shard.
    return (dq, *ring.rotate(k, v, k_seg, dk, dv))

  dq, dk, dv = bw.zero_grads(q, k)
  dq, _, _, _, dk, dv = lax.fori_loop(0, n, step, (dq, k, v, k_seg, dk, dv))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_ring_attention.defvjp(_ring_fwd, _ring_bwd)
