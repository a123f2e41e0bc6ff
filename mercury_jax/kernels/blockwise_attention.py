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

Queries need not sit at ``0 .. length-1``, nor keys start at 0: the loops take every query's global position and the
global position of the first key, so one shard of a sequence split over devices (context parallelism,
:mod:`mercury_jax.kernels.context_parallel`) attends its own queries over any contiguous run of keys. The running
state ``(m, ell, acc)`` is a value of its own (:func:`accumulate`, :func:`finalize`, :func:`gradients`), so a caller
can fold several runs of keys into it, as ring attention does with the key blocks that pass through a device.

What is skipped, for a query chunk:

* key chunks outside a conservative range of key positions derived from the mask's structure (:func:`_key_range`)
  and the chunk's lowest and highest query position: for ``causal`` and ``block_causal`` the chunks past the
  diagonal (block), for ``block_diffusion`` and ``verified`` the noisy keys before the query chunk's diffusion block
  and the clean keys past it (a clean query chunk starts at ``half``). These chunks are not visited at all (dynamic
  ``fori_loop`` bounds).
* inside that range, every key chunk whose tile has no visible pair (the positional mask and the segments evaluated
  on the tile, e.g. the noisy keys after a noisy query's own block, or other documents of a packed row) is skipped by
  a ``lax.cond``: it costs the tile's mask evaluation, not its two matmuls and exponentials.

Lengths that are not a multiple of the chunks are padded at the end (chunks larger than the length shrink to it);
padding queries and keys get segment 0, so they see and are seen by nothing, and are sliced off. Padding queries
repeat the last real query's position, so they widen no chunk's key range.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from mercury_jax.kernels import masks

_FAR = 2**30  # A key position past any sequence: the end of a bidirectional query's key range.


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

  def fit(self, q_length: int, k_length: int | None = None) -> BlockSizes:
    """Shrinks each chunk to at most its sequence's length (a short sequence is one chunk)."""
    return BlockSizes(min(self.block_q, q_length), min(self.block_k, q_length if k_length is None else k_length))


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything static about one attention; hashable, the ``custom_vjp``'s non-differentiable argument.

  ``half`` is the first half's length of the whole (unsplit, unpadded) sequence for the two-halves masks, since a
  shard's positions are global.
  """

  mask: str
  diffusion_block: int | None
  half: int | None
  block_q: int
  block_k: int
  scale: float

  def visible(self, q_pos, k_pos, q_seg, k_seg):
    """``[batch, block_q, block_k]`` bool: which keys of a tile each query sees (positions and segments)."""
    seen = masks.visible(q_pos[:, None], k_pos[None, :], self.mask, block=self.diffusion_block, half=self.half)
    same = (q_seg[:, :, None] == k_seg[:, None, :]) & (q_seg[:, :, None] != 0)  # [batch, block_q, block_k]
    return seen[None] & same


def _key_range(plan: Plan, first, last):
  """Key positions ``[lo, hi)`` outside which queries at positions ``first..last`` (traced int32) see nothing.

  Conservative bounds from the structure of each mask in :mod:`masks` (the tile mask decides inside them):
  ``causal``/``block_causal`` see a prefix that ends with the last query's (diffusion) block; under the two-halves
  masks a noisy query sees the noisy keys of its own block and the clean keys before the block's start, a clean query
  (position >= half) only clean keys up to the end of its clean block.
  """
  if plan.mask == "bidirectional":
    return jnp.int32(0), jnp.int32(_FAR)
  if plan.mask in ("causal", "block_causal"):
    block = plan.diffusion_block or 1
    return jnp.int32(0), (last // block + 1) * block
  block, half = plan.diffusion_block, plan.half
  clean_block = 1 if plan.mask == "verified" else block
  noisy_last = jnp.minimum(last, half - 1)
  noisy_hi = half + (noisy_last // block) * block  # Clean keys before the block start; the own noisy block is < half.
  clean_hi = half + ((last - half) // clean_block + 1) * clean_block
  hi = jnp.where(last >= half, jnp.maximum(noisy_hi, clean_hi), noisy_hi)
  lo = jnp.where(first < half, (first // block) * block, half)
  return lo, hi


def _chunk_range(plan: Plan, first, last, k_start, num_chunks: int):
  """The key chunks ``[j_lo, j_hi)`` of a run of ``num_chunks`` chunks starting at position ``k_start`` that queries
  at positions ``first..last`` visit."""
  lo, hi = _key_range(plan, first, last)
  j_lo = jnp.clip((lo - k_start) // plan.block_k, 0, num_chunks)
  j_hi = jnp.clip(-((k_start - hi) // plan.block_k), j_lo, num_chunks)  # ceil((hi - k_start) / block_k)
  return j_lo, j_hi


def _slice(x, start, size: int, axis: int):
  return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _put(x, update, start, axis: int):
  return lax.dynamic_update_slice_in_dim(x, update, start, axis=axis)


def _add_slice(x, update, start, axis: int):
  return _put(x, _slice(x, start, update.shape[axis], axis) + update, start, axis)


def init_state(q: jax.Array):
  """The running ``(m, ell, acc)`` of queries ``q`` ``[batch, kv_heads, groups, length, head_dim]`` before any key."""
  stats = q.shape[:-1]
  return jnp.full(stats, -jnp.inf), jnp.zeros(stats), jnp.zeros(q.shape, jnp.float32)


def _query_chunk(plan: Plan, i, q, q_pos, q_seg):
  """Query chunk ``i``: ``(start, scaled float32 queries [b, kv, g, bq, d], positions [bq], segments [b, bq])``."""
  start = i * plan.block_q
  q_i = _slice(q, start, plan.block_q, 3).astype(jnp.float32) * plan.scale  # [b, kv, g, bq, d]
  return start, q_i, _slice(q_pos, start, plan.block_q, 0), _slice(q_seg, start, plan.block_q, 1)


def _visit_keys(plan: Plan, qp, qs, k, v, k_start, k_seg, step, carry):
  """``step(j, k_j, v_j, seen, carry)`` over the key chunks ``j`` that a query chunk (positions ``qp``, segments
  ``qs``) may see: those in :func:`_chunk_range`, and of them only the ones whose tile ``seen`` (the positional mask
  and the segments) holds a visible pair (a ``lax.cond``); ``k_j``, ``v_j`` are float32 ``[b, kv, bk, d]``."""
  bk = plan.block_k

  def key_chunk(j, carry):
    def update(carry):
      k_j = _slice(k, j * bk, bk, 2).astype(jnp.float32)  # [b, kv, bk, d]
      v_j = _slice(v, j * bk, bk, 2).astype(jnp.float32)
      return step(j, k_j, v_j, seen, carry)

    k_pos = k_start + j * bk + jnp.arange(bk, dtype=jnp.int32)
    seen = plan.visible(qp, k_pos, qs, _slice(k_seg, j * bk, bk, 1))
    return lax.cond(jnp.any(seen), update, lambda carry: carry, carry)

  lo, hi = _chunk_range(plan, jnp.min(qp), jnp.max(qp), k_start, k.shape[2] // bk)
  return lax.fori_loop(lo, hi, key_chunk, carry)


def accumulate(plan: Plan, q, q_pos, q_seg, k, v, k_start, k_seg, state):
  """``state`` with the keys ``k``, ``v`` at positions ``k_start ..`` folded in (module docstring).

  Args:
    plan: The static plan; ``q`` and ``k`` lengths must be multiples of ``block_q`` and ``block_k``.
    q: ``[batch, kv_heads, groups, q_len, head_dim]`` queries.
    q_pos: ``[q_len]`` int32 global positions of the queries.
    q_seg: ``[batch, q_len]`` int32 segments of the queries (0: padding).
    k: ``[batch, kv_heads, k_len, head_dim]`` keys; ``v`` likewise.
    k_start: int32 global position of the first key (the keys are contiguous).
    k_seg: ``[batch, k_len]`` int32 segments of the keys (0: padding).
    state: ``(m, ell, acc)`` from :func:`init_state` or an earlier call.
  """
  bq = plan.block_q

  def query_chunk(i, state):
    m, ell, acc = state
    start, q_i, qp, qs = _query_chunk(plan, i, q, q_pos, q_seg)

    def update(j, k_j, v_j, seen, chunk_state):
      m, ell, acc = chunk_state
      s = jnp.einsum("bhgqd,bhkd->bhgqk", q_i, k_j)  # [b, kv, g, bq, bk]
      s = jnp.where(seen[:, None, None], s, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # A row that has seen nothing yet keeps weight 0.
      p = jnp.exp(s - m_safe[..., None])
      alpha = jnp.exp(m - m_safe)
      acc = acc * alpha[..., None] + jnp.einsum("bhgqk,bhkd->bhgqd", p, v_j)
      return m_new, ell * alpha + jnp.sum(p, axis=-1), acc

    chunk_state = (_slice(m, start, bq, 3), _slice(ell, start, bq, 3), _slice(acc, start, bq, 3))
    m_i, ell_i, acc_i = _visit_keys(plan, qp, qs, k, v, k_start, k_seg, update, chunk_state)
    return _put(m, m_i, start, 3), _put(ell, ell_i, start, 3), _put(acc, acc_i, start, 3)

  return lax.fori_loop(0, q.shape[3] // bq, query_chunk, state)


def finalize(state):
  """``(out, lse)`` from the running state: ``out`` float32 like the queries, ``lse`` ``[batch, kv, g, q_len]``."""
  m, ell, acc = state
  live = ell > 0
  out = jnp.where(live[..., None], acc / jnp.where(live, ell, 1.0)[..., None], 0.0)
  lse = jnp.where(live, m + jnp.log(jnp.where(live, ell, 1.0)), jnp.inf)
  return out, lse


def gradients(plan: Plan, q, q_pos, q_seg, k, v, k_start, k_seg, lse, delta, d_out, grads):
  """``grads = (dq, dk, dv)`` (float32) plus the contributions of the keys ``k``, ``v`` at ``k_start ..``.

  ``lse`` is the queries' final log-sum-exp over every key (:func:`finalize`), ``delta = rowsum(d_out * out)``; each
  visited tile's probabilities are recomputed as ``exp(s - lse)`` (FlashAttention-2, Alg. 2), so the keys may be
  one run of many. ``dk`` and ``dv`` are the run's, like ``k``; ``dq`` is the queries' and includes the scale.
  """
  bq, bk = plan.block_q, plan.block_k

  def query_chunk(i, grads):
    dq, dk, dv = grads
    start, q_i, qp, qs = _query_chunk(plan, i, q, q_pos, q_seg)
    do_i = _slice(d_out, start, bq, 3).astype(jnp.float32)
    lse_i, delta_i = _slice(lse, start, bq, 3)[..., None], _slice(delta, start, bq, 3)[..., None]

    def update(j, k_j, v_j, seen, carry):
      dq_i, dk, dv = carry
      s = jnp.einsum("bhgqd,bhkd->bhgqk", q_i, k_j)  # [b, kv, g, bq, bk]
      p = jnp.where(seen[:, None, None], jnp.exp(s - lse_i), 0.0)
      dv_j = jnp.einsum("bhgqk,bhgqd->bhkd", p, do_i)  # Summed over the group's query heads.
      dp = jnp.einsum("bhgqd,bhkd->bhgqk", do_i, v_j)
      ds = p * (dp - delta_i)
      dq_i = dq_i + jnp.einsum("bhgqk,bhkd->bhgqd", ds, k_j) * plan.scale
      dk_j = jnp.einsum("bhgqk,bhgqd->bhkd", ds, q_i)  # q_i carries the scale already.
      return dq_i, _add_slice(dk, dk_j, j * bk, 2), _add_slice(dv, dv_j, j * bk, 2)

    dq_i, dk, dv = _visit_keys(plan, qp, qs, k, v, k_start, k_seg, update, (_slice(dq, start, bq, 3), dk, dv))
    return _put(dq, dq_i, start, 3), dk, dv

  return lax.fori_loop(0, q.shape[3] // bq, query_chunk, grads)


def zero_grads(q, k):
  """Float32 zeros for :func:`gradients`' ``(dq, dk, dv)``."""
  return jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention_at(plan: Plan, q, k, v, q_seg, k_seg, q_pos, k_start):
  """Attention of queries at positions ``q_pos`` over the contiguous keys from ``k_start``, in the heads-first layout
  of :func:`accumulate`; returns float32 ``[batch, kv_heads, groups, q_len, head_dim]``. Differentiable in ``q, k, v``
  with the memory-bounded backward."""
  return finalize(accumulate(plan, q, q_pos, q_seg, k, v, k_start, k_seg, init_state(q)))[0]


def _attention_at_fwd(plan: Plan, q, k, v, q_seg, k_seg, q_pos, k_start):
  out, lse = finalize(accumulate(plan, q, q_pos, q_seg, k, v, k_start, k_seg, init_state(q)))
  return out, (q, k, v, q_seg, k_seg, q_pos, k_start, out, lse)


def _attention_at_bwd(plan: Plan, residuals, d_out):
  q, k, v, q_seg, k_seg, q_pos, k_start, out, lse = residuals
  delta = jnp.sum(d_out.astype(jnp.float32) * out, axis=-1)  # [b, kv, g, q_len]: rowsum(dO * O)
  dq, dk, dv = gradients(plan, q, q_pos, q_seg, k, v, k_start, k_seg, lse, delta, d_out, zero_grads(q, k))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


attention_at.defvjp(_attention_at_fwd, _attention_at_bwd)


def heads_first(q: jax.Array, kv_heads: int) -> jax.Array:
  """``[batch, length, heads, d] -> [batch, kv_heads, groups, length, d]``: query head ``h = kv_head * groups + g``,
  as ``jax.nn.dot_product_attention`` groups them."""
  batch, length, heads, head_dim = q.shape
  return q.reshape(batch, length, kv_heads, heads // kv_heads, head_dim).transpose(0, 2, 3, 1, 4)


def heads_last(out: jax.Array) -> jax.Array:
  """The inverse of :func:`heads_first`."""
  batch, kv_heads, groups, length, head_dim = out.shape
  return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, kv_heads * groups, head_dim)


def pad_to(x: jax.Array, multiple: int, axis: int, mode: str = "constant") -> jax.Array:
  """``x`` padded at the end of ``axis`` to a multiple of ``multiple`` (zeros, or ``mode="edge"``)."""
  extra = -x.shape[axis] % multiple
  if not extra:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, extra)
  return jnp.pad(x, pad, mode=mode)


def check_args(q, k, v, segment_ids, mask: str, diffusion_block: int | None):
  """One-line ``ValueError``s for arguments no attention path accepts."""
  batch, length, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  if k.shape != (batch, k.shape[1], kv_heads, head_dim) or v.shape != k.shape:
    raise ValueError(f"k {k.shape} and v {v.shape} must both be [batch, length, kv_heads, head_dim] for q {q.shape}")
  if heads % kv_heads:
    raise ValueError(f"{heads=} must be a multiple of {kv_heads=} (grouped-query attention)")
  masks.check(mask, diffusion_block, length=length)
  if segment_ids is not None and segment_ids.shape != (batch, length):
    raise ValueError(f"segment_ids {segment_ids.shape} must be [batch, length] = {(batch, length)}")


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
  check_args(q, k, v, segment_ids, mask, diffusion_block)
  if k.shape[1] != length:
    raise ValueError(f"k {k.shape} must have q's length {length} (self-attention)")
  blocks = (block_sizes or BlockSizes()).fit(length)
  plan = Plan(
    mask=mask,
    diffusion_block=diffusion_block,
    half=length // 2 if mask in masks.TWO_HALVES else None,
    block_q=blocks.block_q,
    block_k=blocks.block_k,
    scale=head_dim**-0.5,
  )
  seg = jnp.ones((batch, length), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  positions = jnp.arange(length, dtype=jnp.int32)
  q_t = pad_to(heads_first(q, k.shape[2]), blocks.block_q, 3)
  k_t, v_t = (pad_to(x.transpose(0, 2, 1, 3), blocks.block_k, 2) for x in (k, v))  # [batch, kv_heads, length, d]
  out = attention_at(
    plan,
    q_t,
    k_t,
    v_t,
    pad_to(seg, blocks.block_q, 1),  # Padding positions: segment 0, invisible.
    pad_to(seg, blocks.block_k, 1),
    pad_to(positions, blocks.block_q, 0, mode="edge"),
    jnp.int32(0),
  )
  return heads_last(out)[:, :length].astype(q.dtype)
