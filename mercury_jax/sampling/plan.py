"""What is static about one engine run: the block size, the slot layout and the cache (:class:`BlockPlan`).

Canvases (``mercury_jax.sampling.canvas``) are laid into *slots*: slot ``p + B`` holds canvas position ``p``, one
block of padding in front so that every block has a block before it, and blocks are the slot ranges
``[k B, (k + 1) B)``. A plan depends on the canvas length only, so it is a compilation key.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from mercury_jax import kinds as K

# The engine's key-value caches (``mercury_jax.sampling.caches``): exact for block-diffusion and autoregressive
# models, none (every pass over the whole context), and Fast-dLLM's approximate dual and prefix caches.
CACHES = ("exact", "none", "dual", "prefix")


@dataclasses.dataclass(frozen=True)
class BlockPlan:
  """Everything static about one engine run (hashable: a compilation key).

  Attributes:
    block: Block size B (1 for the autoregressive twin; the whole canvas for whole-sequence decoding in one block).
    slots: Slots per row: one block of padding, then the canvas rounded up to the block.
    cache: One of :data:`CACHES`.
    autoregressive: Decode a causal model: the distribution of block ``k`` comes from block ``k - 1``.
    whole_sequence: A bidirectional checkpoint trained on whole sequences (no block mask): its caches are
      approximate (``dual``, ``prefix``) and ``none`` runs the whole canvas bidirectionally at every step.
    draft: Verified decoding's draft length k (0: off; :mod:`~mercury_jax.sampling.verify`): an autoregressive plan
      of a verified checkpoint whose every step verifies the last step's k - 1 drafts with the network's own
      next-token distribution and drafts the next ones, in one forward pass. The slots end with a tail of ``2 k``
      padding slots, so the step's window never runs past them.
    causal_context: The cache's clean keys and values are computed causally (a verified checkpoint's clean half),
      not block-causally (a block-diffusion checkpoint's): the exact cache's prefill and commit pass use the causal
      mask.
    prefill_chunk: The exact cache's prefill runs in chunks of this many slots (a multiple of ``block``), each against
      the keys and values of the chunks before it, so its activations and scores are bounded by the chunk, not the
      prompt; 0: one pass over the whole prefill.
  """

  block: int
  slots: int
  cache: Literal["exact", "none", "dual", "prefix"] = "exact"
  autoregressive: bool = False
  whole_sequence: bool = False
  draft: int = 0
  causal_context: bool = False
  prefill_chunk: int = 0

  def __post_init__(self):
    if self.block < 1 or self.slots % self.block or self.slots < 2 * self.block:
      raise ValueError(f"block={self.block} must be >= 1 and slots={self.slots} a multiple of it, >= 2 blocks")
    if self.cache not in CACHES:
      raise ValueError(f"cache={self.cache!r} must be one of {CACHES}")
    if self.autoregressive and (self.block != 1 or self.cache not in ("exact", "none")):
      raise ValueError("the autoregressive twin decodes blocks of 1 token with cache 'exact' or 'none'")
    if self.whole_sequence and self.cache == "exact":
      raise ValueError("a whole-sequence checkpoint has no exact cache; use 'dual' or 'prefix' (approximate) or 'none'")
    if not self.whole_sequence and self.cache in ("dual", "prefix"):
      raise ValueError(f"cache={self.cache!r} is the approximate cache of whole-sequence checkpoints")
    if self.draft < 0 or (self.draft and not (self.autoregressive and self.cache == "exact")):
      raise ValueError(f"draft={self.draft} must be >= 0, and > 0 only for an autoregressive plan with the exact cache")
    if self.prefill_chunk < 0 or self.prefill_chunk % self.block:
      raise ValueError(f"prefill_chunk={self.prefill_chunk} must be >= 0 and a multiple of block={self.block}")

  @property
  def blocks(self) -> int:
    """Blocks per row, the padding block in front included."""
    return self.slots // self.block

  @property
  def length(self) -> int:
    """Canvas positions per row."""
    return self.slots - self.block - 2 * self.draft

  @property
  def tail(self) -> int:
    """The prefix cache's longest chunk: from a block's start to the last slot, at most ``slots - block``."""
    return self.slots - self.block

  @property
  def suffix_sizes(self) -> tuple[int, ...]:
    """The prefix cache's chunk lengths, longest first: ``tail``, then halving, in whole blocks. A step runs the
    shortest that covers every row's block and suffix, so later blocks cost less."""
    sizes, size = [], self.tail
    while size >= self.block and len(sizes) < 4:
      sizes.append(-(-size // self.block) * self.block)
      size //= 2
    return tuple(sorted(set(sizes), reverse=True))


def plan_blocks(
  kinds: np.ndarray,
  block: int,
  *,
  cache: str = "exact",
  autoregressive: bool = False,
  whole_sequence: bool = False,
  draft: int = 0,
  causal_context: bool = False,
  prefill_chunk: int = 0,
) -> BlockPlan:
  """The :class:`BlockPlan` of a batch of canvases (host side: it is static under ``jax.jit``).

  Args:
    kinds: int [batch, length], the canvases' kinds (rows without a ``TARGET`` are batch padding).
    block: Block size.
    cache: See :data:`CACHES`.
    autoregressive: Whether the model is the autoregressive twin.
    whole_sequence: Whether the model is a bidirectional whole-sequence checkpoint.
    draft: Verified decoding's draft length (0: off).
    causal_context: The checkpoint's clean keys and values are causal (a verified checkpoint).
    prefill_chunk: Slots per chunk of the exact cache's prefill, rounded up to whole blocks (0: one pass).

  Raises:
    ValueError: A bad block size or cache, or an autoregressive row whose first position is to be generated.
  """
  kinds = np.asarray(kinds)
  if block < 1:
    raise ValueError(f"block={block} must be >= 1")
  target = kinds == K.TARGET
  if autoregressive and (target.any(axis=1) & (np.argmax(target, axis=1) == 0)).any():
    raise ValueError("the autoregressive twin needs a known first token in every row (a prompt, or BOS)")
  if prefill_chunk < 0:
    raise ValueError(f"prefill_chunk={prefill_chunk} must be >= 0 (0: one pass)")
  slots = block + -(-kinds.shape[1] // block) * block + 2 * draft
  chunk = -(-prefill_chunk // block) * block
  return BlockPlan(block, slots, cache, autoregressive, whole_sequence, draft, causal_context, chunk)
