"""Attention masks as functions of (query, key) positions: one definition for XLA, Pallas and splash attention.

Each mask is a pure elementwise function ``visible(q, k) -> bool`` of integer position arrays (NumPy or ``jnp``,
broadcast against each other), so the XLA path builds its dense boolean mask from it, the Pallas kernel masks the
tiles that straddle a boundary with it, and TPU splash attention gets it as a ``NumpyMask``.

``block_diffusion`` is BD3-LM's vectorised training mask (Arriola et al. 2025, "Block Diffusion: Interpolating
Between Autoregressive and Diffusion Language Models", arXiv 2503.09573, Sec. 3.2 and Fig. 2). The sequence of
``2 * half`` positions is the noisy sequence ``x_t`` (positions ``[0, half)``) followed by the clean sequence ``x_0``
(positions ``[half, 2 * half)``), both cut into blocks of ``block`` tokens along their own half. The mask is the
union of three parts:

* block-diagonal ``M_BD``: a noisy token sees the noisy tokens of its own block;
* offset block-causal ``M_OBC``: a noisy token sees the clean tokens of strictly earlier blocks;
* block-causal ``M_BC``: a clean token sees the clean tokens of its own and earlier blocks.

A clean token never sees a noisy one, so the clean half computes exactly the keys and values a key-value cache of
committed blocks holds at sampling time, and each noisy block sees exactly what it sees while it is being refined.

``verified`` is the same layout with a strictly causal clean half (TiDAR, Liu et al. 2025, "TiDAR: Think in Diffusion,
Talk in Autoregression", arXiv 2511.08923): the first half holds draft blocks of ``block`` tokens, each seeing
itself and the clean tokens before its start, and a clean token sees the clean tokens up to itself, so the clean half
is an autoregressive model's pass and the draft half a one-pass drafter conditioned on it. Both are one function,
:func:`block_diffusion` with ``clean_block`` (``block`` for BD3-LM, 1 for ``verified``).

``verify_chunk`` is the inference-time counterpart of ``verified`` (:func:`verify_chunk`): a chunk of draft-tree
nodes (the last committed token and the candidates after it, each seeing its ancestors: a chain of ``k`` tokens
when the tree is the drafter's chain) followed by pre-draft blocks of ``k`` masks, each after one outcome node
(:class:`Tree`), under the same rule. It is a chunk mask (``CHUNK_MASKS``), used over a key-value cache through
:func:`cached`, not a training mask; its ``block`` is its :class:`Tree` (an int ``k``: the chain of ``k`` tokens
with a pre-draft block after each, TiDAR's chunk).

What each attention path needs to know of a mask besides its visibility (whether it takes a block, runs over two
halves, works over a cache, has a Pallas kernel there, ...) is one row of :data:`KINDS`; every list of masks that
the paths check against (``MASKS``, ``CACHE_MASKS``, ``BOUNDED``, ...) is read from it, and :func:`check` is the one
argument check of a mask and its block.
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np


@dataclasses.dataclass(frozen=True)
class Kind:
  """What the attention paths need to know of one mask besides :func:`visible`.

  Attributes:
    block: takes a block, a positive int (``diffusion_block``).
    tree: its block is a draft tree (:class:`Tree`, or a positive int ``k``: the chain of ``k`` tokens).
    halves: runs over two halves of equal length, ``drafts ⊕ x_0`` (an even length).
    sequence: a mask over a whole sequence (``attention.attend``); False for a chunk mask, over a cache only.
    cache: a mask over a key-value cache (``attention.attend_cached``), in slot space.
    cache_kernel: the cached Pallas kernel (``cached_attention``) implements it over a cache.
    bounded: over a cache, the slots a chunk sees end with the chunk, so the cache is read in tiles up to there
      (``blockwise_cached_attention``).
  """

  block: bool
  tree: bool = False
  halves: bool = False
  sequence: bool = True
  cache: bool = False
  cache_kernel: bool = False
  bounded: bool = False


KINDS = {
  "bidirectional": Kind(block=False, cache=True, cache_kernel=True),
  "causal": Kind(block=False, cache=True, cache_kernel=True, bounded=True),
  "block_causal": Kind(block=True, cache=True, cache_kernel=True, bounded=True),
  "block_diffusion": Kind(block=True, halves=True),
  "verified": Kind(block=True, halves=True),
  "verify_chunk": Kind(block=False, tree=True, sequence=False, cache=True, bounded=True),
}


def _masks(prop: str) -> tuple[str, ...]:
  return tuple(name for name, kind in KINDS.items() if getattr(kind, prop))


MASKS = _masks("sequence")  # ``attend``'s masks, over a whole sequence.
CHUNK_MASKS = tuple(name for name in KINDS if name not in MASKS)  # Over a cache only (``cached``).
CACHE_MASKS = _masks("cache")  # ``attend_cached``'s masks.
CACHE_KERNEL_MASKS = _masks("cache_kernel")  # Those the cached Pallas kernel implements.
BOUNDED = _masks("bounded")  # Over a cache, read in tiles up to the chunk's last visible slot.
BLOCK_MASKS = _masks("block")  # The masks that take a block.
TREE_MASKS = _masks("tree")  # The masks whose block is a draft tree.
TWO_HALVES = _masks("halves")  # Over ``drafts ⊕ x_0``.


def check(mask: str, block: int | None, among: tuple[str, ...] = MASKS, *, length: int | None = None) -> None:
  """Raises a ``ValueError`` that names the value unless ``mask`` is one of ``among``, ``block`` (the
  ``diffusion_block``) is a positive int exactly when the mask takes one, and ``length`` (when given) is even for the
  two-halves masks."""
  if mask not in among:
    raise ValueError(f"{mask=} must be one of {among}")
  kind = KINDS[mask]
  if kind.tree and not isinstance(block, Tree) and (not isinstance(block, numbers.Integral) or block < 1):
    raise ValueError(f"diffusion_block={block!r} must be a masks.Tree or a positive int (a chain) for {mask=}")
  if kind.block and (not isinstance(block, numbers.Integral) or block < 1):
    raise ValueError(f"diffusion_block={block!r} must be a positive int for {mask=}")
  if not (kind.block or kind.tree) and block is not None:
    raise ValueError(f"diffusion_block={block!r} must be None for {mask=}, which takes no block")
  if kind.halves and length is not None and length % 2:
    raise ValueError(f"{length=} must be even for {mask=}: two halves (drafts ⊕ x_0) need an even length")


def block_causal(q, k, *, block: int):
  """A position sees its own block of ``block`` positions and every earlier one (``block=1``: causal)."""
  return k // block <= q // block


def drafts_over_clean(q_draft, k_draft, q_block, k_block, q_start, q_clean, k_clean, *, clean_block: int):
  """The one rule of the two-halves masks: drafts (noisy blocks) over a clean sequence.

  A draft query sees the draft keys of its own block (``M_BD``) and the clean keys before its block's start
  (``M_OBC``); a clean query sees the clean keys of its own and earlier blocks of ``clean_block`` tokens (``M_BC``;
  ``clean_block=1``: causal). Every argument is a broadcast array: whether the query / key is a draft token, its draft
  block, the query's block start as a clean index, and the clean index of a clean query / key.
  """
  diagonal = q_draft & k_draft & (k_block == q_block)  # M_BD
  offset_causal = q_draft & ~k_draft & (k_clean < q_start)  # M_OBC
  causal = ~q_draft & ~k_draft & (k_clean // clean_block <= q_clean // clean_block)  # M_BC
  return diagonal | offset_causal | causal


def block_diffusion(q, k, *, half: int, block: int, clean_block: int | None = None):
  """BD3-LM's mask over ``x_t ⊕ x_0`` of ``2 * half`` positions (module docstring): ``M_BD | M_OBC | M_BC``.

  ``clean_block`` (default ``block``) is the clean half's block; 1 gives ``verified``'s causal clean half.
  """
  q_noisy, k_noisy = q < half, k < half
  q_index, k_index = q - half * (1 - q_noisy), k - half * (1 - k_noisy)  # Index within the position's own half.
  q_block = q_index // block
  clean_block = block if clean_block is None else clean_block
  return drafts_over_clean(
    q_noisy, k_noisy, q_block, k_index // block, q_block * block, q_index, k_index, clean_block=clean_block
  )


def verified(q, k, *, half: int, block: int):
  """TiDAR's training mask over ``drafts ⊕ x_0``: ``block_diffusion`` with a causal clean half (module docstring)."""
  return block_diffusion(q, k, half=half, block=block, clean_block=1)


@dataclasses.dataclass(frozen=True)
class Tree:
  """The static topology of a verify-and-draft chunk (hashable: part of a compilation key).

  The chunk holds the tree's nodes, then one pre-draft block of ``block`` masks after each outcome node. Node 0 is the
  last committed token; every other node is a candidate for the position after its parent's (its depth says which:
  the root's next position is depth 1). A node sees its ancestors and itself; a pre-draft block sees the path to its
  outcome node and itself, the positions ``depth + 1 .. depth + block`` of that node (the block the drafter fills
  when the verifier accepts the path to it).

  Attributes:
    parents: Each node's parent (node 0's is -1; a parent comes before its children).
    outcomes: The nodes that have a pre-draft block after them, in the chunk's order.
    block: The pre-draft blocks' length ``k``.
  """

  parents: tuple[int, ...]
  outcomes: tuple[int, ...]
  block: int

  def __post_init__(self):
    parents, n = self.parents, len(self.parents)
    if not n or parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parents) if i):
      raise ValueError(f"parents={parents} must start with -1 (the root) and name an earlier node for every other")
    if self.block < 1 or any(not 0 <= o < n for o in self.outcomes) or len(set(self.outcomes)) < len(self.outcomes):
      raise ValueError(f"block={self.block} must be >= 1 and outcomes={self.outcomes} distinct nodes of {n}")

  @classmethod
  def chain(cls, k: int) -> Tree:
    """TiDAR's chunk: the committed token and ``k - 1`` drafts in a chain, a pre-draft block after each."""
    return cls((-1, *range(k - 1)), tuple(range(k)), k)

  @property
  def nodes(self) -> int:
    return len(self.parents)

  @property
  def size(self) -> int:
    """Positions of the chunk: the nodes and the pre-draft blocks."""
    return self.nodes + len(self.outcomes) * self.block

  @property
  def depths(self) -> tuple[int, ...]:
    depths = [0]
    for p in self.parents[1:]:
      depths.append(depths[p] + 1)
    return tuple(depths)

  def ancestry(self) -> np.ndarray:
    """``[nodes, nodes]`` bool: node ``j`` is node ``i``'s ancestor or ``i`` itself."""
    out = np.eye(self.nodes, dtype=bool)
    for i, p in enumerate(self.parents):
      if i:
        out[i] |= out[p]
    return out


def tree_chunk(tree: Tree) -> np.ndarray:
  """``[size, size]`` bool: what each query of a verify-and-draft chunk sees of the chunk (:class:`Tree`): a node its
  ancestors and itself, a pre-draft block the path to its outcome node and its own block."""
  n, k = tree.nodes, tree.block
  index = np.arange(tree.size)
  is_draft = index >= n
  block = np.where(is_draft, (index - n) // k, -1)  # The pre-draft block; -1 among the nodes.
  ancestry = tree.ancestry()
  # A node sees its ancestry; a block the ancestry of its outcome node (its own block: the same-block rule below).
  reach = np.zeros((tree.size, n), bool)
  reach[:n] = ancestry
  for b, outcome in enumerate(tree.outcomes):
    reach[n + b * k : n + (b + 1) * k] = ancestry[outcome]
  own_block = is_draft[:, None] & is_draft[None, :] & (block[:, None] == block[None, :])
  return np.concatenate([reach, np.zeros((tree.size, tree.size - n), bool)], axis=1) | own_block


def verify_chunk(tree: Tree | int, xp=np):
  """``[size, size]`` bool: what each query of a verify-and-draft chunk sees of the chunk (:func:`tree_chunk`); an
  int ``k`` is TiDAR's chunk (:meth:`Tree.chain`): ``k`` causal tokens (the last committed token, then ``k - 1``
  drafts at the next positions), then ``k`` pre-draft blocks ``a = 0 .. k-1`` of ``k`` tokens each, block ``a``
  seeing the causal keys ``0 .. a`` and itself: ``verified``'s rule, with the causal part as the clean half."""
  tree = Tree.chain(tree) if isinstance(tree, numbers.Integral) else tree
  return xp.asarray(tree_chunk(tree))


def visible(q, k, mask: str, *, block: int | None = None, half: int | None = None):
  """``mask``'s visibility of key ``k`` from query ``q`` (broadcast integer arrays); ``block`` for the block masks,
  ``half`` (the length of the first half) for ``block_diffusion`` and ``verified``."""
  if mask == "bidirectional":
    return (q >= 0) & (k >= 0)  # Positions are non-negative: everything is visible.
  if mask == "causal":
    return k <= q
  if mask == "block_causal":
    return block_causal(q, k, block=block)
  if mask == "block_diffusion":
    return block_diffusion(q, k, half=half, block=block)
  if mask == "verified":
    return verified(q, k, half=half, block=block)
  raise ValueError(f"{mask=} must be one of {MASKS}")


def cached(segments, cache_segments, starts, mask: str, *, block: int | None = None, xp=np, offset=0):
  """What each query of a chunk sees when it attends over a key-value cache and its own keys and values:
  ``(cache part [batch, chunk, slots], chunk part [batch, chunk, chunk])`` bool.

  The query ``i`` of row ``b`` sits at slot ``p = starts[b] + i``. It sees the cached key at slot ``s`` when ``mask``
  allows ``(p, s)`` in slot space, ``s`` is not one of the chunk's own slots (the cache holds stale values there; the
  chunk brings those keys itself) and the key shares its segment; and the chunk's key ``j`` when ``mask`` allows
  ``(p, starts[b] + j)`` and it shares its segment. A padding query (segment 0) sees nothing.

  ``verify_chunk`` (``block`` its :class:`Tree`, or ``k``: the chain, a chunk of ``k + k*k``): every query sees the
  cached slots before ``starts[b]`` (the committed context) and the chunk's keys that :func:`verify_chunk` allows,
  within its segment.

  ``offset`` is the slot of ``cache_segments``' first column: one shard's part of a cache whose slots are split over
  devices.
  """
  chunk, slots = segments.shape[1], cache_segments.shape[1]
  live = (segments != 0)[:, :, None]
  same_chunk = segments[:, None, :] == segments[:, :, None]  # [b, chunk, chunk]
  cache_slots = offset + xp.arange(slots)
  same_cache = cache_segments[:, None, :] == segments[:, :, None]  # [b, chunk, slots]
  if mask == "verify_chunk":
    tree = Tree.chain(block) if isinstance(block, numbers.Integral) else block
    if not isinstance(tree, Tree) or chunk != tree.size:
      raise ValueError(
        f"mask='verify_chunk' needs a chunk of its tree's size (k + k*k for block=k): {block=}, {chunk=}"
      )
    before = (cache_slots[None] < starts[:, None])[:, None, :]  # [b, 1, slots]
    return before & same_cache & live, verify_chunk(tree, xp=xp)[None] & same_chunk & live
  query_slots = starts[:, None] + xp.arange(chunk)  # [b, chunk]
  own = (cache_slots[None] >= starts[:, None]) & (cache_slots[None] < starts[:, None] + chunk)  # [b, slots]
  in_cache = visible(query_slots[:, :, None], cache_slots[None, None], mask, block=block)
  in_cache = in_cache & ~own[:, None, :] & same_cache & live
  in_chunk = visible(query_slots[:, :, None], query_slots[:, None, :], mask, block=block) & same_chunk & live
  return in_cache, in_chunk


def dense(length: int, mask: str, *, block: int | None = None, half: int | None = None, xp=np):
  """``[length, length]`` bool, True where query ``i`` (row) may see key ``j`` (column); ``xp`` is numpy or jnp.

  ``half`` (the two-halves masks' first half) defaults to ``length // 2``: the sequence is both halves.
  """
  half = length // 2 if half is None else half
  rows = xp.arange(length)[:, None]
  cols = xp.arange(length)[None, :]
  return xp.broadcast_to(visible(rows, cols, mask, block=block, half=half), (length, length))


def splash_mask(length: int, mask: str, *, block: int | None = None, half: int | None = None, heads: int = 1):
  """TPU splash attention's mask: ``sm.MultiHeadMask`` of ``heads`` copies of ``sm.NumpyMask(dense(...))``.

  For ``jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel.make_splash_mha``, whose kernel takes
  ``[heads, length, head_dim]`` and does not scale ``q`` (pre-multiply it by ``head_dim ** -0.5``). The splash module
  is imported on the first call, so that the XLA and GPU paths never load the TPU kernels.
  """
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

  visible = np.array(dense(length, mask, block=block, half=half))  # A writable copy of the broadcast view.
  return sm.MultiHeadMask([sm.NumpyMask(visible) for _ in range(heads)])
