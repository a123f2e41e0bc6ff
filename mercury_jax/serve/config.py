"""How a server's engine is built and run: one frozen dataclass (:class:`ServeConfig`) that the command line fills
from its flags and the :class:`~mercury_jax.serve.scheduler.Scheduler` and
:class:`~mercury_jax.serve.slots.SlotEngine` read, checked in one place (:meth:`ServeConfig.validate`)."""

from __future__ import annotations

import dataclasses
import math

from mercury_jax.limits import MAX_GUIDANCE, MAX_TILE, SOLVERS, Capacity
from mercury_jax.sampling.settings import AUTO, MAX_LOOKUP
from mercury_jax.serve.pacing import DEFAULT_SHARE, MAX_SHARE, MIN_SHARE

# The automaton sizes every slot can hold (structured output): states, token classes, transitions. A constraint that
# compiles to more is refused (HTTP 400); ``--constraint-capacity`` changes it.
DEFAULT_CAPACITY = Capacity(states=512, classes=256, edges=16384)
CAPACITY_REMEDY = "start the server with a larger --constraint-capacity (STATES,CLASSES,EDGES)"
DEFAULT_PAGE_SIZE = 16  # Slots of a page of the paged key-value cache (vLLM's default block size).
MAX_PAGE_SIZE = 4096
MAX_PREFILL_CHUNK = 1 << 20  # The largest --prefill-chunk accepted (a bound on the flag, far above any context).
_KV_PAGES = "must be >= 2 (page 0 is the sink; each request needs at least one more)"
_TILE = "four rows' positions of a step"


@dataclasses.dataclass(frozen=True)
class ServeConfig:
  """The engine's and the queue's settings (each the command line's flag of the same name).

  Attributes:
    slots: Requests refined at once: the rows of every step.
    max_queue: Requests that may wait while every slot is busy (or the free pages are spoken for); beyond it a
      request is refused (429). Requests that free rows and pages are about to take do not count: an idle server takes
      ``slots + max_queue`` short requests at once.
    block_length: The block of a whole-sequence checkpoint (decoded without a cache, through the same engine);
      block-diffusion checkpoints use their trained block (a different one is an error) and the twin blocks of one
      token; 0: the model's own.
    decode: How every request decodes: ``auto``, ``ar``, ``diffusion`` or ``verified``
      (:func:`~mercury_jax.sampling.plan.plan_for`); the plan is static.
    draft_length: Verified decoding's draft length (0: the checkpoint's).
    draft_tree: Verified decoding's draft tree (``SamplerSettings.draft_tree``; ``auto``: the device's); one tree
      for every request, compiled at start.
    draft_lookup: The length of its prompt-lookup chain (``SamplerSettings.draft_lookup``; -1: the device's, 0: off).
    draft_blocks: After which outcomes a step pre-drafts (``SamplerSettings.draft_blocks``; ``auto``: the device's).
    draft_confidence: Its per-row adaptive draft length (``SamplerSettings.draft_confidence``; 0: off).
    default_steps: Steps per block when a request gives none; None: the block (one token per step).
    capacity: The automaton sizes each slot holds for structured output; None: no structured output (a request with
      a constraint fails).
    page_size: Slots of a page of the paged key-value cache.
    kv_pages: Pages of the cache's pool (the sink included); None: enough for every slot to hold a whole context (the
      memory of a dense cache). With fewer, a request waits in the queue until running requests give back the pages
      it needs.
    batch_invariant: Each request's tokens are the same whatever runs beside it: a step runs the network's matmuls
      over fixed tiles of positions (:class:`~mercury_jax.sampling.network.InvariantNetwork`); False batches the rows
      (faster under load, tokens equal only up to rounding). Prefills run one row, batched either way.
    invariant_tile: Positions per matmul tile of a batch-invariant step (a lone row pads its step to one tile); 0: the
      plan's (:func:`~mercury_jax.serve.slots.invariant_tile_of`).
    max_model_len: The longest request served (prompt, generated tokens and suffix); None: the model's context. It
      sizes the canvas, the prefill buckets and the default page pool.
    prefill_chunk: A prompt whose prefill covers more slots than this (rounded up to whole blocks) is prefilled a chunk
      at a time between the other requests' steps, and the one-pass prefills admitted in one iteration stay within
      it (one is always admitted); 0: every prompt in one pass at its admission.
    prefill_share: The engine's time the chunks may take while other requests decode (``serve.pacing``).
    solver: A continuous checkpoint's ODE solver (``SamplerSettings.solver``); None: the default (Euler).
    guidance: Its classifier-free guidance scale (``SamplerSettings.guidance``); None: the default (1, off).
    overlap: Read a step's view while the next step runs (:mod:`~mercury_jax.serve.scheduler`); False: one step at a
      time.
  """

  slots: int = 16
  max_queue: int = 256
  block_length: int = 0
  decode: str = "auto"
  draft_length: int = 0
  draft_tree: str = AUTO
  draft_lookup: int = -1
  draft_blocks: str = AUTO
  draft_confidence: float = 0.0
  default_steps: int | None = None
  capacity: Capacity | None = DEFAULT_CAPACITY
  page_size: int = DEFAULT_PAGE_SIZE
  kv_pages: int | None = None
  batch_invariant: bool = True
  invariant_tile: int = 0
  max_model_len: int | None = None
  prefill_chunk: int = 0
  prefill_share: float = DEFAULT_SHARE
  solver: str | None = None
  guidance: float | None = None
  overlap: bool = True

  def validate(self) -> ServeConfig:
    """``self``, or a ``ValueError`` naming the first setting out of its range (as ``--flag=value must ...``)."""
    checks = (
      ("slots", self.slots >= 1, "must be >= 1"),
      ("max_queue", self.max_queue >= 0, "must be >= 0"),
      ("block_length", self.block_length >= 0, "must be >= 0 (0: the model's own)"),
      ("draft_length", self.draft_length >= 0, "must be >= 0 (0: the checkpoint's)"),
      ("draft_lookup", -1 <= self.draft_lookup <= MAX_LOOKUP, f"must lie in [0, {MAX_LOOKUP}] (0: off)"),
      ("draft_confidence", 0.0 <= self.draft_confidence < 1.0, "must lie in [0, 1) (0: off)"),
      ("default_steps", self.default_steps is None or self.default_steps >= 1, "must be >= 1"),
      ("page_size", 1 <= self.page_size <= MAX_PAGE_SIZE, f"must lie in [1, {MAX_PAGE_SIZE}]"),
      ("kv_pages", self.kv_pages is None or self.kv_pages >= 2, _KV_PAGES),
      ("invariant_tile", 0 <= self.invariant_tile <= MAX_TILE, f"must lie in [0, {MAX_TILE}] (0: {_TILE})"),
      ("max_model_len", self.max_model_len is None or self.max_model_len >= 1, "must be >= 1"),
      (
        "prefill_chunk",
        0 <= self.prefill_chunk <= MAX_PREFILL_CHUNK,
        f"must lie in [0, {MAX_PREFILL_CHUNK}] (0: one pass)",
      ),
      ("prefill_share", MIN_SHARE <= self.prefill_share <= MAX_SHARE, f"must lie in [{MIN_SHARE}, {MAX_SHARE}]"),
      ("solver", self.solver in (None, *SOLVERS), f"is unknown; choose one of {', '.join(SOLVERS)}"),
      (
        "guidance",
        self.guidance is None or 0 <= self.guidance <= MAX_GUIDANCE,
        f"must lie in [0, {MAX_GUIDANCE:g}] (1: off)",
      ),
    )
    for name, ok, rule in checks:
      value = getattr(self, name)
      if not ok or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(f"--{name.replace('_', '-')}={value!r} {rule}")
    return self
