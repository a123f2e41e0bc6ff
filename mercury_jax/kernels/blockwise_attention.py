"""Memory-bounded attention in plain XLA: loops over query and key chunks with an online softmax.

The dense XLA path materialises the scores ``[batch, heads, length, length]`` (4 GiB per head and row at 32 K tokens
in float32). This module never holds more than one ``[batch, heads, block_q, block_k]`` tile of scores, following
Rabe & Staats (2021), "Self-attention does not need O(n^2) memory" (arXiv:2112.05682). For a query ``q``
and the key chunks ``j`` the forward pass keeps a running maximum ``m``, normaliser ``ell`` and accumulator ``acc``::

    s_j = q k_j^T * scale                    (masked entries: -inf)
    m'  = max(m, rowmax(s_j))
    ell = ell * exp(m - m') + rowsum(exp(s_j - m'))
    acc = acc * exp(m - m') + exp(s_j - m') v_j
    out = acc / ell,  lse = m + log(ell)

so after the last chunk ``out = softmax(q K^T * scale) V`` exactly. A query that sees no key (padding, segment 0)
ends with ``ell = 0``; its output is defined as zeros and its ``lse`` as ``+inf``, so it gets and gives no gradient.

Gradients: a ``jax.custom_vjp`` with the FlashAttention-style backward (Dao 2023, arXiv:2307.08691, Alg. 2), not
autodiff through the loops. The residuals are only ``q, k, v``, the output and the per-query ``lse``; the backward
pass recomputes each tile's probabilities ``p = exp(s - lse)`` and accumulates ``dq`` per query chunk and ``dk, dv``
in full-length float32 buffers, so memory stays ``O(length)`` in both passes. Autodiff through a ``lax.scan`` with
``jax.checkpoint`` on the chunk body would instead save the loop carry of every (query chunk, key chunk) step:
``length / block_k`` copies of each query chunk's accumulator, in all ``length**2 / block_k * heads * head_dim``
floats (1 GiB at 32 K tokens, 2 heads of 64, 512-key chunks), and it cannot differentiate the dynamic loop bounds
that skip masked chunks.

Masks are :func:`mercury_jax.kernels.masks.visible` of the global (query, key) positions, evaluated on each tile,
together with the segment rule (a query sees only keys of its own segment; segment 0 is padding and sees nothing).
Grouped-query attention reads each key/value head once for its ``heads // kv_heads`` query heads (no repeat).

What is skipped, for a query chunk:

* key chunks outside a conservative range of key positions derived from the mask's structure (:func:`_key_range`):
  for ``causal`` and ``block_causal`` the chunks past the diagonal (block), for ``block_diffusion`` and ``verified``
  the noisy keys before the query chunk's diffusion block and the clean keys past it (a clean query chunk starts at
  ``half``). These chunks are not visited at all (dynamic ``fori_loop`` bounds).
* inside that range, every key chunk whose tile has no visible pair (the positional mask and the segments evaluated
  on the tile, e.g. the noisy keys after a noisy query's own block, or other documents of a packed row) is skipped by
  a ``lax.cond``: it costs the tile's mask evaluation, not its two matmuls and exponentials.

Lengths that are not a multiple of the chunks are padded at the end to a multiple of ``lcm(block_q, block_k)``
(chunks larger than the length shrink to it); the padding positions get segment 0, so they see and are seen by
nothing, and are sliced off. The two-halves masks keep ``half = length // 2`` of the unpadded sequence.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from mercury_jax.kernels import masks

_BLOCK_MASKS = ("block_causal", "block_diffusion", "verified")  # The masks that take a diffusion_block.
_TWO_HALVES = ("block_diffusion", "verified")  # The masks over two halves of equal length.


@dataclasses.dataclass(frozen=True, slots=True)
class BlockSizes:
  """Chunk sizes of the blockwise loops.

  Attributes:
    block_q: queries per chunk of the outer loop.
    block_k: keys per chunk of the inner loop; one tile of scores is ``[batch, heads, block_q, block_k]`` float32.
  """

  block_q: int = 512
  block_k: int = 512

  def __post_init__(self):
    for name in ("block_q", "block_k"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"BlockSizes.{name}={value!r} must be a positive int")

  def fit(self, length: int) -> BlockSizes:
    """Shrinks each chunk to at most ``length`` (a short sequence is one chunk)."""
    return BlockSizes(min(self.block_q, length), min(self.block_k, length))


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Everything static about one call; hashable, the ``custom_vjp``'s non-differentiable argument."""

  mask: str
  diffusion_block: int | None
  half: int | None  # The two-halves masks: half of the unpadded length.
  length: int  # Padded length, a multiple of block_q and block_k.
  block_q: int
  block_k: int
  scale: float

  def visible(self, q_pos, k_pos, q_seg, k_seg):
    """``[batch, block_q, block_k]`` bool: which keys of a tile each query sees (positions and segments)."""
    seen = masks.visible(q_pos[:, None], k_pos[None, :], self.mask, block=self.diffusion_block, half=self.half)
    same = (q_seg[:, :, None] == k_seg[:, None, :]) & (q_seg[:, :, None] != 0)  # [batch, block_q, block_k]
    return seen[None] & same


def _key_range(plan: _Plan, first, last):
  """Key positions ``[lo, hi)`` outside which the queries ``first..last`` (traced int32) see nothing.

  Conservative bounds from the structure of each mask in :mod:`masks` (the tile mask decides inside them):
  ``causal``/``block_causal`` see a prefix that ends with the last query's (diffusion) block; under the two-halves
  masks a noisy query sees the noisy keys of its own block and the clean keys before the block's start, a clean query
  (position >= half) only clean keys up to the end of its clean block.
  """
  if plan.mask == "bidirectional":
    return jnp.int32(0), jnp.int32(plan.length)
  if plan.mask in ("causal", "block_causal"):
    block = plan.diffusion_block or 1
    return jnp.int32(0), jnp.minimum((last // block + 1) * block, plan.length)
  block, half = plan.diffusion_block, plan.half
  clean_block = 1 if plan.mask == "verified" else block
  noisy_last = jnp.minimum(last, half - 1)
  noisy_hi = half + (noisy_last // block) * block  # Clean keys before the block start; the own noisy block is < half.
  clean_hi = half + ((last - half) // clean_block + 1) * clean_block
  hi = jnp.where(last >= half, jnp.maximum(noisy_hi, clean_hi), noisy_hi)
  lo = jnp.where(first < half, (first // block) * block, half)
  return lo, jnp.minimum(hi, plan.length)


def _chunk_range(plan: _Plan, i):
  """The key chunks ``[j_lo, j_hi)`` that query chunk ``i`` visits."""
  first = i * plan.block_q
  lo, hi = _key_range(plan, first, first + plan.block_q - 1)
  j_lo = lo // plan.block_k
  j_hi = jnp.maximum(j_lo, (hi + plan.block_k - 1) // plan.block_k)
  return j_lo, j_hi


def _slice(x, start, size: int, axis: int):
  return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _add_slice(x, update, start, axis: int):
  return lax.dynamic_update_slice_in_dim(x, _slice(x, start, update.shape[axis], axis) + update, start, axis=axis)


def _forward(plan: _Plan, q, k, v, seg):
  """``(out, lse)``: ``out`` like ``q`` in float32, ``lse`` ``[batch, kv_heads, groups, length]`` (module docstring).

  ``q`` is ``[batch, kv_heads, groups, length, head_dim]``, ``k`` and ``v`` ``[batch, kv_heads, length, head_dim]``,
  ``seg`` ``[batch, length]`` (0: padding).
  """
  bq, bk = plan.block_q, plan.block_k
  positions = jnp.arange(plan.length, dtype=jnp.int32)

  def query_chunk(i, carry):
    out, lse = carry
    start = i * bq
    q_i = _slice(q, start, bq, 3).astype(jnp.float32) * plan.scale  # [b, kv, g, bq, d]
    q_pos, q_seg = _slice(positions, start, bq, 0), _slice(seg, start, bq, 1)
    stats = q_i.shape[:-1]

    def key_chunk(j, state):
      def update(state):
        m, ell, acc = state
        k_j = _slice(k, j * bk, bk, 2).astype(jnp.float32)  # [b, kv, bk, d]
        v_j = _slice(v, j * bk, bk, 2).astype(jnp.float32)
        s = jnp.einsum("bhgqd,bhkd->bhgqk", q_i, k_j)  # [b, kv, g, bq, bk]
        s = jnp.where(seen[:, None, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # A row that has seen nothing yet keeps weight 0.
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        acc = acc * alpha[..., None] + jnp.einsum("bhgqk,bhkd->bhgqd", p, v_j)
        return m_new, ell * alpha + jnp.sum(p, axis=-1), acc

      seen = plan.visible(q_pos, _slice(positions, j * bk, bk, 0), q_seg, _slice(seg, j * bk, bk, 1))
      return lax.cond(jnp.any(seen), update, lambda state: state, state)

    init = (jnp.full(stats, -jnp.inf), jnp.zeros(stats), jnp.zeros(q_i.shape))
    m, ell, acc = lax.fori_loop(*_chunk_range(plan, i), key_chunk, init)
    live = ell > 0
    out_i = jnp.where(live[..., None], acc / jnp.where(live, ell, 1.0)[..., None], 0.0)
    lse_i = jnp.where(live, m + jnp.log(jnp.where(live, ell, 1.0)), jnp.inf)
    out = lax.dynamic_update_slice_in_dim(out, out_i, start, axis=3)
    return out, lax.dynamic_update_slice_in_dim(lse, lse_i, start, axis=3)

  init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(q.shape[:-1], jnp.float32))
  return lax.fori_loop(0, plan.length // bq, query_chunk, init)


def _backward(plan: _Plan, q, k, v, seg, out, lse, d_out):
  """``(dq, dk, dv)`` in float32 by recomputing each visited tile's probabilities (FlashAttention-2, Alg. 2)."""
  bq, bk = plan.block_q, plan.block_k
  positions = jnp.arange(plan.length, dtype=jnp.int32)
  delta = jnp.sum(d_out.astype(jnp.float32) * out, axis=-1)  # [b, kv, g, length]: rowsum(dO * O)

  def query_chunk(i, grads):
    dq, dk, dv = grads
    start = i * bq
    q_i = _slice(q, start, bq, 3).astype(jnp.float32) * plan.scale  # [b, kv, g, bq, d]
    do_i = _slice(d_out, start, bq, 3).astype(jnp.float32)
    lse_i, delta_i = _slice(lse, start, bq, 3)[..., None], _slice(delta, start, bq, 3)[..., None]
    q_pos, q_seg = _slice(positions, start, bq, 0), _slice(seg, start, bq, 1)

    def key_chunk(j, carry):
      def update(carry):
        dq_i, dk, dv = carry
        k_j = _slice(k, j * bk, bk, 2).astype(jnp.float32)  # [b, kv, bk, d]
        v_j = _slice(v, j * bk, bk, 2).astype(jnp.float32)
        s = jnp.einsum("bhgqd,bhkd->bhgqk", q_i, k_j)  # [b, kv, g, bq, bk]
        p = jnp.where(seen[:, None, None], jnp.exp(s - lse_i), 0.0)
        dv_j = jnp.einsum("bhgqk,bhgqd->bhkd", p, do_i)  # Summed over the group's query heads.
        dp = jnp.einsum("bhgqd,bhkd->bhgqk", do_i, v_j)
        ds = p * (dp - delta_i)
        dq_i = dq_i + jnp.einsum("bhgqk,bhkd->bhgqd", ds, k_j)
        dk_j = jnp.einsum("bhgqk,bhgqd->bhkd", ds, q_i)  # q_i carries the scale already.
        return dq_i, _add_slice(dk, dk_j, j * bk, 2), _add_slice(dv, dv_j, j * bk, 2)

      seen = plan.visible(q_pos, _slice(positions, j * bk, bk, 0), q_seg, _slice(seg, j * bk, bk, 1))
      return lax.cond(jnp.any(seen), update, lambda carry: carry, carry)

    dq_i, dk, dv = lax.fori_loop(*_chunk_range(plan, i), key_chunk, (jnp.zeros(q_i.shape), dk, dv))
    return lax.dynamic_update_slice_in_dim(dq, dq_i * plan.scale, start, axis=3), dk, dv

  init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  return lax.fori_loop(0, plan.length // bq, query_chunk, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(plan: _Plan, q, k, v, seg):
  return _forward(plan, q, k, v, seg)[0].astype(q.dtype)


def _attention_fwd(plan: _Plan, q, k, v, seg):
  out, lse = _forward(plan, q, k, v, seg)
  return out.astype(q.dtype), (q, k, v, seg, out, lse)


def _attention_bwd(plan: _Plan, residuals, d_out):
  q, k, v, seg, out, lse = residuals
  dq, dk, dv = _backward(plan, q, k, v, seg, out, lse, d_out)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  segment_ids: jax.Array | None = None,
  mask: str = "bidirectional",
  diffusion_block: int | None = None,
  block_sizes: BlockSizes | None = None,
) -> jax.Array:
  """Scaled dot-product attention that never materialises the ``[length, length]`` scores (module docstring).

  Args:
    q: ``[batch, length, heads, head_dim]``.
    k: ``[batch, length, kv_heads, head_dim]``; ``heads`` must be a multiple of ``kv_heads``.
    v: like ``k``.
    segment_ids: optional int32 ``[batch, length]``, non-negative; 0 marks padding (those queries output zeros).
    mask: one of :data:`mercury_jax.kernels.masks.MASKS`.
    diffusion_block: the block of ``block_causal``, ``block_diffusion`` and ``verified`` (given exactly for those).
    block_sizes: the chunk sizes; default ``BlockSizes()`` (512 x 512).

  Returns:
    ``[batch, length, heads, head_dim]`` in ``q.dtype``.
  """
  batch, length, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  if k.shape != (batch, length, kv_heads, head_dim) or v.shape != k.shape:
    raise ValueError(f"k {k.shape} and v {v.shape} must both be [batch, length, kv_heads, head_dim] for q {q.shape}")
  if heads % kv_heads:
    raise ValueError(f"{heads=} must be a multiple of {kv_heads=} (grouped-query attention)")
  if mask not in masks.MASKS:
    raise ValueError(f"{mask=} must be one of {masks.MASKS}")
  if (mask in _BLOCK_MASKS) != (diffusion_block is not None):
    raise ValueError(f"{diffusion_block=} must be given exactly for the block masks {_BLOCK_MASKS} (got {mask=})")
  if diffusion_block is not None and diffusion_block < 1:
    raise ValueError(f"{diffusion_block=} must be a positive int")
  if mask in _TWO_HALVES and length % 2:
    raise ValueError(f"{mask=} runs over two halves (drafts ⊕ x_0) and needs an even length, got {length=}")
  if segment_ids is not None and segment_ids.shape != (batch, length):
    raise ValueError(f"segment_ids {segment_ids.shape} must be [batch, length] = {(batch, length)}")

  blocks = (block_sizes or BlockSizes()).fit(length)
  multiple = math.lcm(blocks.block_q, blocks.block_k)
  padded = -(-length // multiple) * multiple
  seg = jnp.ones((batch, length), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  seg = jnp.pad(seg, ((0, 0), (0, padded - length)))  # Padding positions: segment 0, invisible.
  plan = _Plan(
    mask=mask,
    diffusion_block=diffusion_block,
    half=length // 2 if mask in _TWO_HALVES else None,
    length=padded,
    block_q=blocks.block_q,
    block_k=blocks.block_k,
    scale=head_dim**-0.5,
  )
  groups = heads // kv_heads
  pad = ((0, 0), (0, padded - length), (0, 0), (0, 0))
  # [batch, kv_heads, groups, length, head_dim]: query head h = kv_head * groups + g, as jax.nn.dot_product_attention.
  q_t = jnp.pad(q, pad).reshape(batch, padded, kv_heads, groups, head_dim).transpose(0, 2, 3, 1, 4)
  k_t, v_t = (jnp.pad(x, pad).transpose(0, 2, 1, 3) for x in (k, v))  # [batch, kv_heads, length, head_dim]
  out = _attention(plan, q_t, k_t, v_t, seg)
  return out.transpose(0, 3, 1, 2, 4).reshape(batch, padded, heads, head_dim)[:, :length]
