"""What is static about one engine run (:class:`BlockPlan`), and the one function that chooses it (:func:`plan_for`).

Canvases (``mercury_jax.sampling.canvas``) are laid into *slots*: slot ``p + B`` holds canvas position ``p``, one
block of padding in front so that every block has a block before it, and blocks are the slot ranges
``[k B, (k + 1) B)``. A plan depends on the canvas length only, so it is a compilation key.

:func:`plan_for` maps a checkpoint, the decoding a request asks for (:class:`Decoding`: ``cache``, ``block_length``,
``decode``, ``draft_length``) and a canvas length to the plan; the library, the server and ahead-of-time
compilation all call it:

* block-diffusion checkpoints (``objective.block_size > 0``) and the autoregressive twin run the exact key-value
  cache (``auto`` / ``exact``) over their trained block (1 for the twin), or no cache (``none``, the reference the
  cache reproduces);
* whole-sequence diffusion checkpoints refine their whole canvas as one block without a cache (``auto`` / ``none``),
  or semi-autoregressive blocks of ``block_length`` tokens, or Fast-dLLM's approximate ``dual`` and ``prefix``
  caches over blocks of ``block_length`` tokens (default :data:`APPROXIMATE_BLOCK`);
* a verified checkpoint decodes ``verified`` (its default), ``ar`` (its next-token head alone) or ``diffusion`` (its
  draft half as a block-diffusion model over blocks of its draft length).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from mercury_jax import kinds as K
from mercury_jax.config import Config
from mercury_jax.sampling.drafts import Drafting, Topology, topology
from mercury_jax.sampling.settings import SettingError

# The engine's key-value caches (``mercury_jax.sampling.caches``): exact for block-diffusion and autoregressive
# models, none (every pass over the whole context), and Fast-dLLM's approximate dual and prefix caches.
CACHES = ("exact", "none", "dual", "prefix")
CACHE_CHOICES = ("auto", *CACHES)  # What ``generate(cache=...)`` and ``--cache`` accept: auto picks the best exact one.
# What ``generate(decode=...)``, ``--decode`` and the server's ``decode`` field accept: ``auto`` is the checkpoint's
# best (``verified`` for a verified checkpoint, ``ar`` for the twin, ``diffusion`` for every diffusion checkpoint).
DECODES = ("auto", "ar", "diffusion", "verified")
APPROXIMATE_BLOCK = 32  # Block of the approximate caches of whole-sequence checkpoints when block_length is 0.
LENGTH_BUCKET = 64  # Canvases are padded to a multiple of this, so varying prompt lengths share compilations.


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
      next-token distribution and drafts the next ones, in one forward pass. The slots end with a tail of padding
      slots (``2 k`` for the chain), so the step's chunk never runs past them.
    causal_context: The cache's clean keys and values are computed causally (a verified checkpoint's clean half),
      not block-causally (a block-diffusion checkpoint's): the exact cache's prefill and commit pass use the causal
      mask.
    prefill_chunk: The exact cache's prefill runs in chunks of this many slots (a multiple of ``block``), each against
      the keys and values of the chunks before it, so its activations and scores are bounded by the chunk, not the
      prompt; 0: one pass over the whole prefill.
    tree: Verified decoding's draft tree (:class:`~mercury_jax.sampling.drafts.Topology`; with ``draft``, default the
      drafter's chain of ``k - 1`` drafts, TiDAR's chunk).
  """

  block: int
  slots: int
  cache: Literal["exact", "none", "dual", "prefix"] = "exact"
  autoregressive: bool = False
  whole_sequence: bool = False
  draft: int = 0
  causal_context: bool = False
  prefill_chunk: int = 0
  tree: Topology | None = None

  def __post_init__(self):
    if self.draft > 0 and self.tree is None:
      object.__setattr__(self, "tree", Topology.chain(self.draft))
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
    if self.tree is not None and self.tree.k != self.draft:
      raise ValueError(f"tree.k={self.tree.k} must equal draft={self.draft}")
    if self.prefill_chunk < 0 or self.prefill_chunk % self.block:
      raise ValueError(f"prefill_chunk={self.prefill_chunk} must be >= 0 and a multiple of block={self.block}")

  @classmethod
  def over(cls, length: int, block: int, **fields) -> BlockPlan:
    """The plan of canvases of ``length`` positions in blocks of ``block``: the slots hold the padding block, the
    canvas rounded up to the block and verified decoding's tail; ``prefill_chunk`` is rounded up to whole blocks."""
    if block < 1:
      raise ValueError(f"block={block} must be >= 1")
    chunk = fields.pop("prefill_chunk", 0)
    if chunk < 0:
      raise ValueError(f"prefill_chunk={chunk} must be >= 0 (0: one pass)")
    draft = fields.get("draft", 0)
    if draft and fields.get("tree") is None:
      fields["tree"] = Topology.chain(draft)
    tree = fields.get("tree")
    slots = block + -(-length // block) * block + draft_tail(tree)
    return cls(block, slots, prefill_chunk=-(-chunk // block) * block, **fields)

  @property
  def decode(self) -> str:
    """``ar``, ``diffusion`` or ``verified``: how the plan decodes."""
    return "verified" if self.draft else "ar" if self.autoregressive else "diffusion"

  @property
  def blocks(self) -> int:
    """Blocks per row, the padding block in front included."""
    return self.slots // self.block

  @property
  def length(self) -> int:
    """Canvas positions per row."""
    return self.slots - self.block - draft_tail(self.tree)

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


def draft_tail(tree: Topology | None) -> int:
  """Padding slots after the canvas that a verified step's chunk, window and writes may cover (0 without one)."""
  return 0 if tree is None else max(tree.reach, tree.width)


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
  tree: Topology | None = None,
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
    tree: Verified decoding's draft tree (default: the chain of ``draft - 1`` drafts).

  Raises:
    ValueError: A bad block size or cache, or an autoregressive row whose first position is to be generated.
  """
  kinds = np.asarray(kinds)
  target = kinds == K.TARGET
  if autoregressive and (target.any(axis=1) & (np.argmax(target, axis=1) == 0)).any():
    raise ValueError("the autoregressive twin needs a known first token in every row (a prompt, or BOS)")
  return BlockPlan.over(
    kinds.shape[1], block, cache=cache, autoregressive=autoregressive, whole_sequence=whole_sequence, draft=draft,
    causal_context=causal_context, prefill_chunk=prefill_chunk, tree=tree if draft else None,
  )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Decoding:
  """How a request asks to decode: the knobs that choose the plan (:func:`plan_for` checks them).

  Attributes:
    cache: One of :data:`CACHE_CHOICES`.
    block_length: A whole-sequence checkpoint's block (0: the whole canvas); a block-diffusion checkpoint's must be
      its trained block (or 0).
    decode: One of :data:`DECODES`.
    draft_length: Verified decoding's draft length (0: the checkpoint's).
    prefill_chunk: Slots per chunk of the exact cache's prefill (0: one pass).
    drafting: Verified decoding's draft tree, lookup chain and pre-draft blocks (``auto``: the device's).
  """

  cache: str = "auto"
  block_length: int = 0
  decode: str = "auto"
  draft_length: int = 0
  prefill_chunk: int = 0
  drafting: Drafting = Drafting()

  @classmethod
  def of(cls, settings, cache: str = "auto") -> Decoding:
    """What ``settings`` (a :class:`~mercury_jax.sampling.settings.SamplerSettings`) ask of the plan."""
    return cls(
      cache, settings.block_length, settings.decode, settings.draft_length, settings.prefill_chunk,
      Drafting(settings.draft_tree, settings.draft_lookup, settings.draft_blocks),
    )  # fmt: skip


def plan_for(cfg: Config, decoding: Decoding, length: int, *, whole_canvas: bool = True) -> BlockPlan:
  """The plan of a checkpoint's canvases of ``length`` positions decoded as ``decoding`` asks (module docstring).

  Args:
    cfg: The checkpoint's config.
    decoding: The request's knobs.
    length: Canvas positions.
    whole_canvas: A whole-sequence checkpoint may refine the whole canvas as one block (rounded up to
      :data:`LENGTH_BUCKET` positions); False: blocks of ``block_length`` or :data:`APPROXIMATE_BLOCK` (a server's
      fixed slots, a constrained decode that walks blocks).

  Raises:
    SettingError: A cache or decode mode this model does not have, or a block or draft length that contradicts its
      training.
  """
  cache, block, autoregressive, draft = _choose(cfg, decoding)
  causal_context = cfg.objective.name == "verified"
  whole_sequence = not (autoregressive or cfg.objective.block_size or causal_context)
  block = block or (bucketed_length(length, cfg.model.max_length) if whole_canvas else APPROXIMATE_BLOCK)
  chunk = decoding.prefill_chunk if cache == "exact" else 0
  tree = topology(draft, decoding.drafting) if draft else None
  return BlockPlan.over(
    length, block, cache=cache, autoregressive=autoregressive, whole_sequence=whole_sequence, draft=draft,
    causal_context=causal_context, prefill_chunk=chunk, tree=tree,
  )  # fmt: skip


def bucketed_length(length: int, context: int) -> int:
  """The canvas length a whole-canvas decode runs ``length`` positions at: rounded up to ``LENGTH_BUCKET``, at most
  ``context`` (unless ``length`` itself is longer), so varying prompt lengths share compilations."""
  return min(-(-length // LENGTH_BUCKET) * LENGTH_BUCKET, max(context, length))


def _choose(cfg: Config, decoding: Decoding) -> tuple[str, int, bool, int]:
  """``(cache, block, autoregressive, draft)`` (block 0: the whole canvas) after checking the knobs."""
  cache, decode, block_length, draft_length = (
    decoding.cache,
    decoding.decode,
    decoding.block_length,
    decoding.draft_length,
  )
  if cache not in CACHE_CHOICES:
    raise SettingError("cache", cache, f"is unknown; choose one of {', '.join(CACHE_CHOICES)}")
  if decode not in DECODES:
    raise SettingError("decode", decode, f"is unknown; choose one of {', '.join(DECODES)}")
  if draft_length and cfg.objective.name != "verified":
    raise SettingError("draft_length", draft_length, "needs a verified checkpoint (objective.name='verified')")
  if cfg.objective.name != "verified":
    _no_drafting(decoding, "needs a verified checkpoint (objective.name='verified')")
  if cfg.objective.name == "verified":
    return _choose_verified(cfg, decoding)
  autoregressive, block_size = cfg.objective.autoregressive, cfg.objective.block_size
  best = "ar" if autoregressive else "diffusion"
  if decode not in ("auto", best):
    kind = "autoregressive" if autoregressive else "diffusion"
    raise SettingError("decode", decode, f"needs a verified checkpoint; this {kind} model decodes with decode='{best}'")
  if cfg.objective.continuous and not block_size:
    if cache in ("exact", "dual", "prefix"):
      raise SettingError(
        "cache", cache, "does not apply to a whole-sequence continuous checkpoint: it refines its canvas without one"
      )
    if block_length:
      raise SettingError(
        "block_length",
        block_length,
        "must be 0: a whole-sequence continuous checkpoint refines its whole canvas as one block (it was never "
        "trained on masked positions outside a block)",
      )
    return "none", 0, False, 0
  if autoregressive or block_size:
    if cache in ("dual", "prefix"):
      raise SettingError(
        "cache", cache, "is the approximate cache of whole-sequence checkpoints; this model has an exact cache"
      )
    block = 1 if autoregressive else block_size
    if block_length and not autoregressive and block_length != block:
      raise SettingError(
        "block_length", block_length, f"must be {block} (or 0): the block size this model was trained with"
      )
    return "none" if cache == "none" else "exact", block, autoregressive, 0
  if cache == "exact":
    raise SettingError(
      "cache",
      cache,
      "needs a block-diffusion checkpoint (objective.block_size > 0); this whole-sequence model has the "
      "approximate caches 'dual' and 'prefix'",
    )
  if cache in ("auto", "none"):
    return "none", block_length, False, 0
  return cache, block_length or APPROXIMATE_BLOCK, False, 0


def _choose_verified(cfg: Config, decoding: Decoding) -> tuple[str, int, bool, int]:
  trained, cache, draft_length = cfg.objective.draft_length, decoding.cache, decoding.draft_length
  if cache in ("dual", "prefix"):
    raise SettingError(
      "cache", cache, "is the approximate cache of whole-sequence checkpoints; this model has an exact cache"
    )
  exact = "none" if cache == "none" else "exact"
  if decoding.decode == "diffusion":
    if decoding.block_length and decoding.block_length != trained:
      raise SettingError(
        "block_length", decoding.block_length, f"must be {trained} (or 0): the draft length this model was trained with"
      )
    if draft_length:
      raise SettingError("draft_length", draft_length, "applies to decode='verified' only")
    _no_drafting(decoding, "applies to decode='verified' only")
    return exact, trained, False, 0
  if decoding.decode == "ar":
    if draft_length:
      raise SettingError("draft_length", draft_length, "applies to decode='verified' only")
    _no_drafting(decoding, "applies to decode='verified' only")
    return exact, 1, True, 0
  draft = draft_length or trained
  if not 2 <= draft <= trained:
    raise SettingError(
      "draft_length", draft, f"must lie in [2, {trained}]: this model drafts blocks of {trained} tokens at most"
    )
  if cache == "none":
    raise SettingError("cache", cache, "has no verified decoder; verified decoding runs the exact cache ('auto')")
  return "exact", 1, True, draft


def _no_drafting(decoding: Decoding, requirement: str) -> None:
  """Raises :class:`SettingError` for the first draft-tree knob a non-verified decode was given."""
  default, given = Drafting(), decoding.drafting
  for field, name in (("tree", "draft_tree"), ("lookup", "draft_lookup"), ("blocks", "draft_blocks")):
    if getattr(given, field) != getattr(default, field):
      raise SettingError(name, getattr(given, field), requirement)
