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
"""

from __future__ import annotations

import numpy as np

MASKS = ("bidirectional", "causal", "block_causal", "block_diffusion")


def block_causal(q, k, *, block: int):
  """A position sees its own block of ``block`` positions and every earlier one (``block=1``: causal)."""
  return k // block <= q // block


def block_diffusion(q, k, *, half: int, block: int):
  """BD3-LM's mask over ``x_t ⊕ x_0`` of ``2 * half`` positions (module docstring): ``M_BD | M_OBC | M_BC``."""
  q_noisy, k_noisy = q < half, k < half
  q_block = (q - half * (1 - q_noisy)) // block  # Block index within the position's own half.
  k_block = (k - half * (1 - k_noisy)) // block
  diagonal = q_noisy & k_noisy & (k_block == q_block)  # M_BD
  offset_causal = q_noisy & ~k_noisy & (k_block < q_block)  # M_OBC
  causal = ~q_noisy & ~k_noisy & (k_block <= q_block)  # M_BC
  return diagonal | offset_causal | causal


def visible(q, k, mask: str, *, block: int | None = None, half: int | None = None):
  """``mask``'s visibility of key ``k`` from query ``q`` (broadcast integer arrays); ``block`` for the block masks,
  ``half`` (the length of ``x_t``) for ``block_diffusion``."""
  if mask == "bidirectional":
    return (q >= 0) & (k >= 0)  # Positions are non-negative: everything is visible.
  if mask == "causal":
    return k <= q
  if mask == "block_causal":
    return block_causal(q, k, block=block)
  if mask == "block_diffusion":
    return block_diffusion(q, k, half=half, block=block)
  raise ValueError(f"{mask=} must be one of {MASKS}")


def cached(segments, cache_segments, starts, mask: str, *, block: int | None = None, xp=np):
  """What each query of a chunk sees when it attends over a key-value cache and its own keys and values:
  ``(cache part [batch, chunk, slots], chunk part [batch, chunk, chunk])`` bool.

  The query ``i`` of row ``b`` sits at slot ``p = starts[b] + i``. It sees the cached key at slot ``s`` when ``mask``
  allows ``(p, s)`` in slot space, ``s`` is not one of the chunk's own slots (the cache holds stale values there; the
  chunk brings those keys itself) and the key shares its segment; and the chunk's key ``j`` when ``mask`` allows
  ``(p, starts[b] + j)`` and it shares its segment. A padding query (segment 0) sees nothing.
  """
  chunk, slots = segments.shape[1], cache_segments.shape[1]
  query_slots = starts[:, None] + xp.arange(chunk)  # [b, chunk]
  cache_slots = xp.arange(slots)
  own = (cache_slots[None] >= starts[:, None]) & (cache_slots[None] < starts[:, None] + chunk)  # [b, slots]
  live = (segments != 0)[:, :, None]
  in_cache = visible(query_slots[:, :, None], cache_slots[None, None], mask, block=block)
  in_cache = in_cache & ~own[:, None, :] & (cache_segments[:, None, :] == segments[:, :, None]) & live
  in_chunk = visible(query_slots[:, :, None], query_slots[:, None, :], mask, block=block)
  in_chunk = in_chunk & (segments[:, None, :] == segments[:, :, None]) & live
  return in_cache, in_chunk


def dense(length: int, mask: str, *, block: int | None = None, half: int | None = None, xp=np):
  """``[length, length]`` bool, True where query ``i`` (row) may see key ``j`` (column); ``xp`` is numpy or jnp."""
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
