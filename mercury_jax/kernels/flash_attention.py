"""Flash attention in Pallas for GPUs (Triton lowering), with its plain-``jnp`` reference.

FlashAttention-2 (Dao, 2023, arXiv:2307.08691). The forward kernel keeps one query tile resident and streams key/value
tiles past it with an online softmax, saving the per-row log-sum-exp. The backward pass recomputes the probabilities
from that residual: after the precompute ``delta = rowsum(dO * O)``, one kernel walks key tiles (dk, dv; for
grouped-query attention it also walks the query heads of the group, so dk and dv are summed in registers) and one walks
query tiles (dq). Scores live in the base-2 domain (``s * sm_scale * log2(e)``) so the kernels use ``exp2``.

Masks are the functions of (query, key) positions in :mod:`mercury_jax.kernels.masks`, the one definition that the
XLA path, the reference, these kernels and TPU splash attention (``masks.splash_mask``) share:

* ``bidirectional``: every key;
* ``causal``: the keys ``j <= i``;
* ``block_causal``: the keys ``j // diffusion_block <= i // diffusion_block`` (a query sees its own diffusion block
  and every earlier one; ``diffusion_block`` is unrelated to the tile sizes);
* ``block_diffusion``: BD3-LM's training mask over ``x_t ⊕ x_0`` (an even length, ``half = length // 2``), blocks of
  ``diffusion_block`` tokens along each half: a noisy query (``i < half``) sees the noisy keys of its own block and
  the clean keys of strictly earlier blocks, a clean query the clean keys of its own and earlier blocks;
* ``verified``: TiDAR's, the same two halves with a causal clean half: a clean query sees the clean keys up to
  itself (its clean blocks are of one token, ``_Plan.clean_block``); the draft half is ``block_diffusion``'s.

For every mask the keys a query sees are at most two intervals (one per half for the two-halves masks, else one) whose
ends never decrease along the queries of a half; the same holds for the queries that see a key. A tile therefore
meets, per interval, a contiguous range of tiles of the other side: the loop bounds come from the intervals of the
tile's first and last positions, no fully masked tile is visited, the tiles seen whole are computed without a mask,
and only the tiles at the interval ends evaluate ``masks.visible`` on the tile's position iotas. Under the
two-halves masks a row can meet such a tile before any key it sees, so the online softmax guards its running max.
``segment_ids`` ``[batch, length]`` (non-negative int32) further restrict a query to the keys of its own segment;
segment 0 is padding. A padding query sees no key at all and its output is defined as **zeros** (its log-sum-exp is
stored as ``+inf``, so it gets and gives no gradient). With segment ids, a pair of tiles whose segment ranges do not
overlap is skipped (through loop bounds computed before the kernels, per half). For the two-halves masks the caller
gives the ids of the first half and then the same ids again for ``x_0``.

Lengths that are not a multiple of the tiles are zero-padded to one; the two-halves masks pad each half on its own, so
that no tile straddles the halves and the padded sequence is again such a layout (of the padded half). The padding
keys get no weight (through the segment ids when given, else through an explicit key bound; always the bound for the
two-halves masks, whose padding queries see nothing) and the padding rows are sliced off. A ``head_dim``
that is not a power of two (Triton tiles must be) is zero-padded too, which changes no score.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from mercury_jax.kernels import common, masks
from mercury_jax.kernels.common import cdiv, dot


@dataclasses.dataclass(frozen=True, slots=True)
class BlockSizes(common.TritonBlockSizes):
  """Tile sizes and Triton launch parameters; every block is a power of two >= 16.

  Attributes:
    block_q: query rows per forward program.
    block_k: key rows per step of the forward loop.
    block_q_dkv: query rows per step of the dk/dv loop.
    block_kv_dkv: key rows per dk/dv program.
    block_q_dq: query rows per dq program.
    block_kv_dq: key rows per step of the dq loop.
    num_warps: warps per program of the (forward, dkv, dq) kernels.
    num_stages: software-pipelining depth of the inner loops of the (forward, dkv, dq) kernels.
  """

  block_q: int
  block_k: int
  block_q_dkv: int
  block_kv_dkv: int
  block_q_dq: int
  block_kv_dq: int
  num_warps: tuple[int, int, int] = (4, 8, 8)
  num_stages: tuple[int, int, int] = (3, 3, 3)

  @classmethod
  def get_default(cls, head_dim: int, dtype=jnp.bfloat16) -> BlockSizes:
    """Tiles for Hopper (H100/H200) chosen so that no kernel spills registers or exceeds 227 KiB shared memory.

    Checked by compiling the kernels' Triton IR for sm_90 (Triton 3.9, ``cuobjdump -res-usage``), not yet timed on a
    GPU: ``bench gpu-attention --sweep`` times alternatives. The forward pass keeps a 128-row query tile;
    the dk/dv kernel holds a key tile and two f32 accumulators, so its key tile shrinks as head_dim grows and it runs
    8 warps; 4-byte inputs double the bytes per tile, so they get smaller tiles and pipeline 2 deep instead of 3.

    Args:
      head_dim: the head dimension (padded internally to a power of two >= 16).
      dtype: the input dtype.
    """
    padded = common.padded_tile(head_dim)
    if padded > 128:
      return cls(64, 32, 32, 32, 32, 32, num_warps=(8, 8, 4), num_stages=(2, 2, 2))
    if jnp.dtype(dtype).itemsize > 2:  # Twice the bytes per tile (and no tensor cores): smaller tiles, 2 stages.
      if padded <= 64:
        return cls(64, 64, 32, 64, 64, 32, num_warps=(4, 8, 4), num_stages=(2, 2, 2))
      return cls(64, 64, 32, 32, 64, 32, num_warps=(8, 8, 4), num_stages=(2, 2, 2))
    if padded <= 64:
      return cls(128, 64, 32, 128, 128, 32, num_warps=(4, 8, 4), num_stages=(3, 3, 3))
    return cls(128, 64, 32, 64, 64, 32, num_warps=(8, 8, 4), num_stages=(3, 3, 3))

  @property
  def largest(self) -> int:
    return max(self.tiles().values())

  def fit(self, length: int) -> BlockSizes:
    """Shrinks every block to at most the padded ``length`` (a short sequence needs no 128-row tile)."""
    return self.capped(**dict.fromkeys(self.tiles(), length))


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Everything static about one call, hashable so that it can be a ``custom_vjp`` non-differentiable argument.

  The padded sequence is one part (``half == 0``) or, for the two-halves masks, two parts of ``half`` positions (the
  padded first half, then the padded ``x_0``); each part holds its real positions first, then padding.
  """

  mask: str
  diffusion_block: int  # 1 for causal (a block of one); unused for bidirectional.
  sm_scale: float
  q_len: int  # Real queries per part: rows at or past this offset in their part are padding, and sliced off.
  kv_len: int  # Real keys per part (the padded length when segment ids mark the padding keys instead).
  length: int  # Padded length: a multiple of every block.
  groups: int  # Query heads per key/value head.
  head_dim: int  # Padded head dimension.
  blocks: BlockSizes
  interpret: bool
  half: int = 0  # The two-halves masks: the padded length of each half, a multiple of every block; else 0.

  @property
  def clean_block(self) -> int:
    """The blocks of the clean half: ``diffusion_block`` for ``block_diffusion``, 1 (causal) for ``verified``."""
    return 1 if self.mask == "verified" else self.diffusion_block

  @property
  def parts(self) -> int:
    return 2 if self.half else 1

  def _part_start(self, pos):
    # Not jnp.where(pos >= half, half, 0): the Triton lowering gives a select of two Python ints the predicate's type.
    return (pos >= self.half).astype(pos.dtype) * self.half

  def real(self, pos, keys: bool):
    """Whether the padded positions ``pos`` (int32, >= 0) hold real keys (``keys``) or real queries."""
    return pos - self._part_start(pos) < (self.kv_len if keys else self.q_len)

  def visible(self, rows, cols):
    """Positional visibility of the keys ``cols`` from the queries ``rows`` (broadcast int32 arrays).

    The padded two-halves layout is the same layout with ``half = self.half`` (a position keeps its half and its offset
    in it), so ``masks.visible`` applies to it directly; its padding queries see nothing.
    For the other masks a padding query (at the end of the sequence) sees what its position sees.
    """
    seen = masks.visible(rows, cols, self.mask, block=self.diffusion_block, half=self.half)
    if self.half:
      return seen & self.real(rows, keys=False) & self.real(cols, keys=True)
    return seen & (cols < self.kv_len)

  def key_intervals(self, rows):
    """Per part, ``(lo, hi)``: the keys ``[lo, hi)`` of that part the query ``rows`` (int32) see; none if lo >= hi.

    What ``tile_ranges`` relies on: along the real queries of a part both ends never decrease and the intervals of
    consecutive queries leave no gap between them (blocks of M_BD abut, the others are prefixes of their half), so
    their union is ``[lo(first), hi(last))``; ``lo`` never decreases over the padding tail of a part either. A
    two-halves padding query sees nothing: ``(length, 0)``.
    """
    if not self.half:
      if self.mask == "bidirectional":
        limit = jnp.full_like(rows, self.kv_len)
      elif self.diffusion_block == 1:
        limit = jnp.minimum(rows + 1, self.kv_len)
      else:
        limit = jnp.minimum((lax.div(rows, self.diffusion_block) + 1) * self.diffusion_block, self.kv_len)
      return ((jnp.zeros_like(rows), limit),)
    clean = rows >= self.half
    index = rows - self._part_start(rows)  # Offset within the row's half.
    start = lax.div(index, self.diffusion_block) * self.diffusion_block  # Block start, in half.
    end = jnp.minimum(start + self.diffusion_block, self.kv_len)
    clean_end = jnp.minimum((lax.div(index, self.clean_block) + 1) * self.clean_block, self.kv_len)
    noisy_keys = (jnp.where(clean, self.length, start), jnp.where(clean, 0, end))  # M_BD: the own noisy block.
    clean_keys = (jnp.full_like(rows, self.half), self.half + jnp.where(clean, clean_end, start))  # M_BC, M_OBC.
    real = self.real(rows, keys=False)
    return tuple((jnp.where(real, lo, self.length), jnp.where(real, hi, 0)) for lo, hi in (noisy_keys, clean_keys))

  def query_intervals(self, cols):
    """Per part, ``(lo, hi)``: the real queries ``[lo, hi)`` of that part that see the key ``cols`` (int32).

    The transpose of ``key_intervals``, with the same properties along the keys (suffixes instead of prefixes); a
    padding key is seen by nobody: ``(length, 0)``.
    """
    real = self.real(cols, keys=True)
    if not self.half:
      if self.mask == "bidirectional":
        first = jnp.zeros_like(cols)
      elif self.diffusion_block == 1:
        first = cols
      else:
        first = lax.div(cols, self.diffusion_block) * self.diffusion_block
      every = jnp.full_like(cols, self.q_len)  # Not a where of two Python ints (see _part_start).
      return ((jnp.where(real, first, self.length), jnp.where(real, every, 0)),)
    clean = cols >= self.half
    index = cols - self._part_start(cols)  # Offset within the key's half.
    start = lax.div(index, self.diffusion_block) * self.diffusion_block
    end = jnp.minimum(start + self.diffusion_block, self.q_len)
    clean_start = lax.div(index, self.clean_block) * self.clean_block
    # A noisy key: the noisy queries of its block (M_BD); a clean key: the noisy queries of later blocks (M_OBC).
    noisy_rows = (jnp.where(clean, end, start), jnp.where(clean, self.q_len, end))
    every = jnp.full_like(cols, self.half + self.q_len)  # Not a where of two Python ints (see _part_start).
    clean_rows = (jnp.where(clean, self.half + clean_start, self.length), jnp.where(clean, every, 0))  # M_BC
    return tuple((jnp.where(real, lo, self.length), jnp.where(real, hi, 0)) for lo, hi in (noisy_rows, clean_rows))

  def tile_ranges(self, tile, size: int, other: int, by_query: bool):
    """The tiles of ``other`` keys that query tile ``tile`` of ``size`` rows meets (``by_query``), or the reverse.

    Per part three ranges ``(part, first, end, positional)``: tiles that need the mask; tiles in which every pair with
    ``tile`` is visible, padding positions included (no mask); tiles that need the mask. The ranges hold exactly the
    tiles with a visible pair of a real query and a real key, from the intervals of the tile's first, last and last
    real position; a tile without a real position meets none.
    """
    intervals = self.key_intervals if by_query else self.query_intervals
    first = tile * size
    last = first + size - 1
    last_real = jnp.minimum(last, self._part_start(first) + (self.q_len if by_query else self.kv_len) - 1)
    empty = ~self.real(first, keys=not by_query)
    ranges = []
    for part, ((lo, hi_first), (lo_last, _), (_, hi)) in enumerate(
      zip(intervals(first), intervals(last), intervals(last_real), strict=True)
    ):
      begin = lax.div(lo, other)
      end = jnp.where(empty | (lo >= hi), begin, cdiv(hi, other))  # The intervals' union: [lo, hi), maybe empty.
      whole_begin = common.clip(cdiv(lo_last, other), begin, end)
      whole_end = common.clip(lax.div(hi_first, other), whole_begin, end)
      ranges += [(part, begin, whole_begin, True), (part, whole_begin, whole_end, False), (part, whole_end, end, True)]
    return ranges

  def compiler_params(self, kernel: int) -> pltriton.CompilerParams:
    """Launch parameters of kernel 0 (forward), 1 (dkv) or 2 (dq)."""
    return pltriton.CompilerParams(num_warps=self.blocks.num_warps[kernel], num_stages=self.blocks.num_stages[kernel])


def _query_tile(i, num_tiles: int, plan: _Plan):
  """Grid index -> query tile; with a causal-type mask the most expensive (last) query tiles are launched first."""
  return i if plan.mask == "bidirectional" else num_tiles - 1 - i


def _mask_scores(s, visible, q_seg, k_seg, transposed: bool = False):
  """Sets invisible scores to -inf.

  Args:
    s: scores ``[rows, cols]``, or ``[cols, rows]`` if ``transposed``.
    visible: the positional mask (``_Plan.visible``), laid out like ``s``, or None on tiles every row sees whole.
    q_seg: segment ids of the rows ``[rows]`` (padding -1), or None.
    k_seg: segment ids of the keys ``[cols]``, or None.
    transposed: the layout of ``s``.
  """
  if q_seg is not None:
    same = q_seg[None, :] == k_seg[:, None] if transposed else q_seg[:, None] == k_seg[None, :]
    visible = same if visible is None else visible & same
  return s if visible is None else jnp.where(visible, s, -jnp.inf)


def _tile_loops(ranges, seg_range_ref, step, carry):
  """Runs ``step(i, carry, positional)`` over each ``(part, first, end, positional)``, in the part's segment range."""
  for part, first, end, positional in ranges:
    if seg_range_ref is not None:
      first, end = jnp.maximum(first, seg_range_ref[2 * part]), jnp.minimum(end, seg_range_ref[2 * part + 1])
    carry = lax.fori_loop(first, end, functools.partial(step, positional=positional), carry)
  return carry


def _forward_kernel(q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, seg_range_ref, o_ref, lse_ref, *, plan: _Plan):
  block_q, block_k = plan.blocks.block_q, plan.blocks.block_k
  i = _query_tile(pl.program_id(0), plan.length // block_q, plan)
  rows = i * block_q + lax.iota(jnp.int32, block_q)  # [block_q]
  q = q_ref[...]  # [block_q, head_dim]
  q_seg = None if q_seg_ref is None else q_seg_ref[...]
  scale = plan.sm_scale * common.LOG2_E
  # Without segment ids and with a one-part mask every row has seen a key before a tile it sees nothing of (the whole
  # tiles come first, and the first tile holds key 0), so m is finite. With segment ids, or with two halves (a
  # masked range may start with tiles some rows see nothing of), a row may have seen only -inf: shift it by 0 then.
  guard = q_seg is not None or plan.half > 0

  def step(t, carry, positional: bool):
    m, ell, acc = carry
    keys = pl.ds(pl.multiple_of(t * block_k, block_k), block_k)
    k_seg = None if k_seg_ref is None else k_seg_ref[keys]
    s = dot(q, k_ref[keys, :], (1, 1)) * scale  # [block_q, block_k]
    visible = plan.visible(rows[:, None], t * block_k + lax.iota(jnp.int32, block_k)[None, :]) if positional else None
    s = _mask_scores(s, visible, q_seg, k_seg)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new) if guard else m_new
    p = jnp.exp2(s - m_shift[:, None])  # [block_q, block_k]
    alpha = jnp.exp2(m - m_shift)
    acc = acc * alpha[:, None] + dot(p.astype(v_ref.dtype), v_ref[keys, :], (1, 0))  # [block_q, head_dim]
    return m_new, ell * alpha + jnp.sum(p, axis=1), acc

  carry = common.softmax_start(block_q, plan.head_dim)
  m, ell, acc = _tile_loops(plan.tile_ranges(i, block_q, block_k, by_query=True), seg_range_ref, step, carry)
  empty = ell == 0.0  # Only padding queries (segment 0, or the padding of a two-halves half) see no key.
  o_ref[...] = (acc * (1.0 / jnp.where(empty, 1.0, ell))[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, ell)))


def _dkv_kernel(
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, k_seg_ref, seg_range_ref, dk_ref, dv_ref, *, plan: _Plan
):
  block_q, block_k = plan.blocks.block_q_dkv, plan.blocks.block_kv_dkv
  t = pl.program_id(0)
  cols = t * block_k + lax.iota(jnp.int32, block_k)  # [block_k]
  k = k_ref[...]  # [block_k, head_dim]
  v = v_ref[...]
  k_seg = None if k_seg_ref is None else k_seg_ref[...]
  scale = plan.sm_scale * common.LOG2_E
  # Query tiles of padding only are in no range; padding rows elsewhere have zero do (and lse +inf or a finite lse
  # over exactly the keys they are masked to here): they add nothing.
  ranges = plan.tile_ranges(t, block_k, block_q, by_query=False)

  def head(g, carry):
    def step(s_idx, carry, positional: bool):
      # Transposed scores, [block_k, block_q]: p^T and ds^T feed the dv and dk matmuls without a transpose.
      dk, dv = carry
      rows = pl.ds(pl.multiple_of(s_idx * block_q, block_q), block_q)
      q_seg = None if q_seg_ref is None else q_seg_ref[rows]
      q = q_ref[rows, g, :]  # [block_q, head_dim]
      do = do_ref[rows, g, :]
      s_t = dot(k, q, (1, 1)) * scale  # [block_k, block_q]
      visible = (
        plan.visible(s_idx * block_q + lax.iota(jnp.int32, block_q)[None, :], cols[:, None]) if positional else None
      )
      s_t = _mask_scores(s_t, visible, q_seg, k_seg, transposed=True)
      p_t = jnp.exp2(s_t - lse_ref[g, rows][None, :])
      dv = dv + dot(p_t.astype(do.dtype), do, (1, 0))  # [block_k, head_dim]
      ds_t = p_t * (dot(v, do, (1, 1)) - delta_ref[g, rows][None, :])  # [block_k, block_q]
      dk = dk + dot(ds_t.astype(q.dtype), q, (1, 0))  # [block_k, head_dim]
      return dk, dv

    return _tile_loops(ranges, seg_range_ref, step, carry)

  zeros = jnp.zeros((block_k, plan.head_dim), jnp.float32)
  dk, dv = lax.fori_loop(0, plan.groups, head, (zeros, zeros))
  dk_ref[...] = (dk * plan.sm_scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, k_seg_ref, seg_range_ref, dq_ref, *, plan: _Plan
):
  block_q, block_k = plan.blocks.block_q_dq, plan.blocks.block_kv_dq
  i = _query_tile(pl.program_id(0), plan.length // block_q, plan)
  rows = i * block_q + lax.iota(jnp.int32, block_q)  # [block_q]
  q = q_ref[...]  # [block_q, head_dim]
  do = do_ref[...]
  lse = lse_ref[...]
  delta = delta_ref[...]
  q_seg = None if q_seg_ref is None else q_seg_ref[...]
  scale = plan.sm_scale * common.LOG2_E

  def step(t, dq, positional: bool):
    keys = pl.ds(pl.multiple_of(t * block_k, block_k), block_k)
    k_seg = None if k_seg_ref is None else k_seg_ref[keys]
    k = k_ref[keys, :]  # [block_k, head_dim]
    s = dot(q, k, (1, 1)) * scale  # [block_q, block_k]
    visible = plan.visible(rows[:, None], t * block_k + lax.iota(jnp.int32, block_k)[None, :]) if positional else None
    s = _mask_scores(s, visible, q_seg, k_seg)
    p = jnp.exp2(s - lse[:, None])
    ds = p * (dot(do, v_ref[keys, :], (1, 1)) - delta[:, None])  # [block_q, block_k]
    return dq + dot(ds.astype(k.dtype), k, (1, 0))  # [block_q, head_dim]

  dq = jnp.zeros((block_q, plan.head_dim), jnp.float32)
  dq = _tile_loops(plan.tile_ranges(i, block_q, block_k, by_query=True), seg_range_ref, step, dq)
  dq_ref[...] = (dq * plan.sm_scale).astype(dq_ref.dtype)


def _forward_call(q, k, v, q_seg, k_seg, plan: _Plan):
  batch, length, heads, head_dim = q.shape
  block_q, groups = plan.blocks.block_q, plan.groups
  n = length // block_q
  tile = lambda i: _query_tile(i, n, plan)
  segments = q_seg is not None
  seg_range = common.segment_ranges(q_seg, k_seg, block_q, plan.blocks.block_k, parts=plan.parts) if segments else None
  return pl.pallas_call(
    functools.partial(_forward_kernel, plan=plan),
    grid=(n, batch, heads),
    in_specs=[
      pl.BlockSpec((None, block_q, None, head_dim), lambda i, b, h: (b, tile(i), h, 0)),
      pl.BlockSpec((None, length, None, head_dim), lambda i, b, h: (b, 0, lax.div(h, groups), 0)),
      pl.BlockSpec((None, length, None, head_dim), lambda i, b, h: (b, 0, lax.div(h, groups), 0)),
      pl.BlockSpec((None, block_q), lambda i, b, h: (b, tile(i))) if segments else None,
      pl.BlockSpec((None, length), lambda i, b, h: (b, 0)) if segments else None,
      pl.BlockSpec((None, None, 2 * plan.parts), lambda i, b, h: (b, tile(i), 0)) if segments else None,
    ],
    out_specs=[
      pl.BlockSpec((None, block_q, None, head_dim), lambda i, b, h: (b, tile(i), h, 0)),
      pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, tile(i))),
    ],
    out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((batch, heads, length), jnp.float32)],
    compiler_params=plan.compiler_params(0),
    interpret=plan.interpret,
    name="mercury_flash_forward",
  )(q, k, v, q_seg, k_seg, seg_range)


def _backward_calls(q, k, v, q_seg, k_seg, do, lse, delta, plan: _Plan):
  batch, length, heads, head_dim = q.shape
  kv_heads, groups, blocks = k.shape[2], plan.groups, plan.blocks
  segments = q_seg is not None
  bq, bk = blocks.block_q_dkv, blocks.block_kv_dkv
  seg_range = common.segment_ranges(q_seg, k_seg, bq, bk, per_query_tile=False, parts=plan.parts) if segments else None
  dk, dv = pl.pallas_call(
    functools.partial(_dkv_kernel, plan=plan),
    grid=(length // bk, batch, kv_heads),
    in_specs=[
      pl.BlockSpec((None, length, groups, head_dim), lambda t, b, j: (b, 0, j, 0)),  # q: the group's heads
      pl.BlockSpec((None, bk, None, head_dim), lambda t, b, j: (b, t, j, 0)),
      pl.BlockSpec((None, bk, None, head_dim), lambda t, b, j: (b, t, j, 0)),
      pl.BlockSpec((None, length, groups, head_dim), lambda t, b, j: (b, 0, j, 0)),  # do
      pl.BlockSpec((None, groups, length), lambda t, b, j: (b, j, 0)),  # lse
      pl.BlockSpec((None, groups, length), lambda t, b, j: (b, j, 0)),  # delta
      pl.BlockSpec((None, length), lambda t, b, j: (b, 0)) if segments else None,
      pl.BlockSpec((None, bk), lambda t, b, j: (b, t)) if segments else None,
      pl.BlockSpec((None, None, 2 * plan.parts), lambda t, b, j: (b, t, 0)) if segments else None,
    ],
    out_specs=[pl.BlockSpec((None, bk, None, head_dim), lambda t, b, j: (b, t, j, 0))] * 2,
    out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
    compiler_params=plan.compiler_params(1),
    interpret=plan.interpret,
    name="mercury_flash_dkv",
  )(q, k, v, do, lse, delta, q_seg, k_seg, seg_range)

  bq, bk = blocks.block_q_dq, blocks.block_kv_dq
  n = length // bq
  tile = lambda i: _query_tile(i, n, plan)
  seg_range = common.segment_ranges(q_seg, k_seg, bq, bk, parts=plan.parts) if segments else None
  dq = pl.pallas_call(
    functools.partial(_dq_kernel, plan=plan),
    grid=(n, batch, heads),
    in_specs=[
      pl.BlockSpec((None, bq, None, head_dim), lambda i, b, h: (b, tile(i), h, 0)),
      pl.BlockSpec((None, length, None, head_dim), lambda i, b, h: (b, 0, lax.div(h, groups), 0)),
      pl.BlockSpec((None, length, None, head_dim), lambda i, b, h: (b, 0, lax.div(h, groups), 0)),
      pl.BlockSpec((None, bq, None, head_dim), lambda i, b, h: (b, tile(i), h, 0)),  # do
      pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, tile(i))),  # lse
      pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, tile(i))),  # delta
      pl.BlockSpec((None, bq), lambda i, b, h: (b, tile(i))) if segments else None,
      pl.BlockSpec((None, length), lambda i, b, h: (b, 0)) if segments else None,
      pl.BlockSpec((None, None, 2 * plan.parts), lambda i, b, h: (b, tile(i), 0)) if segments else None,
    ],
    out_specs=pl.BlockSpec((None, bq, None, head_dim), lambda i, b, h: (b, tile(i), h, 0)),
    out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
    compiler_params=plan.compiler_params(2),
    interpret=plan.interpret,
    name="mercury_flash_dq",
  )(q, k, v, do, lse, delta, q_seg, k_seg, seg_range)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, q_seg, k_seg, plan: _Plan):
  return _forward_call(q, k, v, q_seg, k_seg, plan)[0]


def _flash_fwd(q, k, v, q_seg, k_seg, plan: _Plan):
  out, lse = _forward_call(q, k, v, q_seg, k_seg, plan)
  return out, (q, k, v, q_seg, k_seg, out, lse)


def _flash_bwd(plan: _Plan, residuals, do):
  q, k, v, q_seg, k_seg, out, lse = residuals
  delta = jnp.einsum("blhd,blhd->bhl", out.astype(jnp.float32), do.astype(jnp.float32))  # [batch, heads, length]
  dq, dk, dv = _backward_calls(q, k, v, q_seg, k_seg, do.astype(q.dtype), lse, delta, plan)
  return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _check_args(q, k, v, segment_ids, mask, diffusion_block):
  if q.ndim != 4 or k.ndim != 4:
    raise ValueError(f"{q.shape=} and {k.shape=} must be [batch, length, heads, head_dim]")
  if k.shape != v.shape:
    raise ValueError(f"{k.shape=} must equal {v.shape=}")
  batch, length, heads, head_dim = q.shape
  if k.shape[:2] != (batch, length) or k.shape[3] != head_dim:
    raise ValueError(f"{k.shape=} must be (batch, length, kv_heads, head_dim) matching {q.shape=}")
  if heads % k.shape[2]:
    raise ValueError(f"heads={heads} must be a multiple of kv_heads={k.shape[2]}")
  if not (q.dtype == k.dtype == v.dtype) or not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f"q, k, v must share one floating dtype, got {q.dtype=}, {k.dtype=}, {v.dtype=}")
  masks.check(mask, diffusion_block, length=length)
  if segment_ids is not None and (
    segment_ids.shape != (batch, length) or not jnp.issubdtype(segment_ids.dtype, jnp.integer)
  ):
    raise ValueError(f"{segment_ids.shape=} ({segment_ids.dtype}) must be int32 [batch, length]={batch, length}")


def _pad_parts(x, parts: int, padded: int, value=0):
  """``[batch, parts * real, ...]`` -> ``[batch, parts * padded, ...]``: each part padded at its end with ``value``."""
  batch, length = x.shape[:2]
  x = x.reshape(batch, parts, length // parts, *x.shape[2:])  # [batch, parts, real, ...]
  pad = [(0, 0)] * x.ndim
  pad[2] = (0, padded - length // parts)
  return jnp.pad(x, pad, constant_values=value).reshape(batch, parts * padded, *x.shape[3:])


def flash_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  segment_ids: jax.Array | None = None,
  mask: str = "bidirectional",
  diffusion_block: int | None = None,
  sm_scale: float | None = None,
  block_sizes: BlockSizes | None = None,
  interpret: bool = False,
) -> jax.Array:
  """Flash attention with a custom VJP; the layout is that of ``jax.nn.dot_product_attention``.

  Args:
    q: queries ``[batch, length, heads, head_dim]``.
    k: keys ``[batch, length, kv_heads, head_dim]``; ``heads`` must be a multiple of ``kv_heads``.
    v: values, shaped like ``k``.
    segment_ids: optional int32 ``[batch, length]``, non-negative: a query sees only keys of its own segment; 0 marks
      padding, whose queries see nothing and output zeros. For the two-halves masks the ids of the first half
      followed by the same ids for ``x_0``.
    mask: ``"bidirectional"``, ``"causal"``, ``"block_causal"``, ``"block_diffusion"`` or ``"verified"`` (module
      docstring; the last two need an even ``length``: ``x_t`` or the drafts, then ``x_0``).
    diffusion_block: block size of ``"block_causal"``, ``"block_diffusion"`` and ``"verified"``; must be None for
      the other masks.
    sm_scale: multiplies the scores; defaults to ``head_dim ** -0.5``.
    block_sizes: tiles; defaults to ``BlockSizes.get_default(head_dim, q.dtype)``. Blocks longer than the padded
      length (of a half, for the two-halves masks) shrink to it.
    interpret: run the kernels with the Pallas interpreter (any backend; slow).

  Returns:
    ``[batch, length, heads, head_dim]`` in ``q.dtype``; all accumulation is float32.
  """
  _check_args(q, k, v, segment_ids, mask, diffusion_block)
  batch, length, heads, head_dim = q.shape
  parts = 2 if mask in masks.TWO_HALVES else 1
  real = length // parts  # Real positions per part.
  blocks = (block_sizes or BlockSizes.get_default(head_dim, q.dtype)).fit(real)
  padded = -(-real // blocks.largest) * blocks.largest  # Padded positions per part.
  padded_dim = common.padded_tile(head_dim)
  q_seg = k_seg = None
  if segment_ids is not None:
    segment_ids = segment_ids.astype(jnp.int32)
    k_seg = _pad_parts(segment_ids, parts, padded)  # Padding keys get segment 0,
    q_seg = _pad_parts(jnp.where(segment_ids == 0, -1, segment_ids), parts, padded, -1)  # which no query matches.
  plan = _Plan(
    mask=mask,
    diffusion_block=diffusion_block if masks.KINDS[mask].block else 1,
    sm_scale=float(head_dim**-0.5 if sm_scale is None else sm_scale),
    q_len=real,
    kv_len=padded if segment_ids is not None and parts == 1 else real,
    length=parts * padded,
    groups=heads // k.shape[2],
    head_dim=padded_dim,
    blocks=blocks,
    interpret=interpret,
    half=padded if parts == 2 else 0,
  )
  if (padded, padded_dim) != (real, head_dim):
    pad_dim = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, padded_dim - head_dim)))
    q, k, v = (_pad_parts(pad_dim(x), parts, padded) for x in (q, k, v))
  out = _flash(q, k, v, q_seg, k_seg, plan)  # [batch, parts * padded, heads, padded_dim]
  out = out.reshape(batch, parts, padded, heads, padded_dim)[:, :, :real, :, :head_dim]
  return out.reshape(batch, length, heads, head_dim)


def reference_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  segment_ids: jax.Array | None = None,
  mask: str = "bidirectional",
  diffusion_block: int | None = None,
  sm_scale: float | None = None,
) -> jax.Array:
  """The same function as ``flash_attention`` in plain ``jnp`` with float32 math (O(length^2) memory)."""
  _check_args(q, k, v, segment_ids, mask, diffusion_block)
  batch, length, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  scale = head_dim**-0.5 if sm_scale is None else sm_scale
  q5 = q.astype(jnp.float32).reshape(batch, length, kv_heads, heads // kv_heads, head_dim)  # [b, q, kv, group, d]
  exact = lax.Precision.HIGHEST  # No TF32 on GPUs: the reference is the float32 truth.
  logits = jnp.einsum("bqkgd,bskd->bkgqs", q5, k.astype(jnp.float32), precision=exact) * scale  # [b, kv, group, q, s]
  visible = masks.dense(length, mask, block=diffusion_block, xp=jnp)[None]  # [1, q, s]
  if segment_ids is not None:
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    visible = visible & same & (segment_ids != 0)[:, :, None]  # [b, q, s]
  logits = jnp.where(visible[:, None, None], logits, -jnp.inf)
  peak = lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  weights = jnp.exp(logits - jnp.where(peak == -jnp.inf, 0.0, peak))
  total = jnp.sum(weights, axis=-1, keepdims=True)
  weights = weights / jnp.where(total == 0.0, 1.0, total)  # Rows that see nothing (padding) output zeros.
  out = jnp.einsum("bkgqs,bskd->bqkgd", weights, v.astype(jnp.float32), precision=exact)  # [b, q, kv, group, d]
  return out.reshape(batch, length, heads, head_dim).astype(q.dtype)
