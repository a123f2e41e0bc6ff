"""Admission and page bookkeeping on the host: the commands that drive the serving engine, and what comes back.

A :class:`Command` says what one engine iteration does (which rows to release, which requests to admit where, whether
to step). It is a fixed-shape tree of host arrays, so on a multi-host mesh process 0 (which serves HTTP and owns the
queue) broadcasts it and every process runs the same programs in the same order (:mod:`~mercury_jax.serve.multihost`).
:class:`Admission` writes a request (a token-level :class:`~mercury_jax.sampling.text.Row`, the library's own) into a
command with the pages its canvas covers, and picks its prefill bucket; the device programs
(:class:`~mercury_jax.serve.slots.SlotEngine`) never see a request.

Pages. The cache is one pool of ``kv_pages`` pages of ``page_size`` slots (page 0 is the sink that free rows and the
slots past a canvas point at). A request holds the pages its canvas covers (prompt, ``max_tokens``, suffix and the
padding block in front) from admission to release; when too few are free it waits in the queue (:class:`NoPages`),
and one that needs more than the pool holds is refused up front. The default pool lets every slot hold a whole
context, the memory of a dense cache; a smaller one serves more slots in the same memory when requests are short.

Prefill buckets: a request's prompt runs through the model over the smallest bucket of slots (32, 64, ... up to the
canvas) that covers its first block, so a few compilations serve every prompt length; a prompt longer than
``prefill_chunk`` is admitted unfilled and prefilled in chunks between the other rows' steps.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from mercury_jax import kinds as K
from mercury_jax.constrain.automaton import Automaton
from mercury_jax.kvcache import SINK
from mercury_jax.sampling import canvas as cv
from mercury_jax.sampling.plan import BlockPlan
from mercury_jax.sampling.proposal import Knobs
from mercury_jax.sampling.settings import SamplerSettings
from mercury_jax.sampling.text import Row
from mercury_jax.serve.pages import NoPages, PagePool

MIN_BUCKET = 32  # The smallest prefill bucket, in slots; buckets double up to the whole context.


class Command(NamedTuple):
  """One engine iteration, identical on every process: fixed-shape host arrays (row ``r`` is slot ``r``)."""

  stop: np.ndarray  # [] bool: the followers leave (and nothing else happens)
  step: np.ndarray  # [] bool: run one refinement step after the releases and admissions
  release: np.ndarray  # [slots] bool: rows to give up
  bucket: np.ndarray  # [slots] int32: the prefill bucket (an index) of a request admitted into the row; -1: none
  tokens: np.ndarray  # [slots, length] int32: the admitted requests' canvases
  kinds: np.ndarray  # [slots, length] int32
  streams: np.ndarray  # [slots] int32
  keys: np.ndarray  # [slots, 2] uint32: PRNG key data of the requests' seeds
  steps: np.ndarray  # [slots] int32: steps per block
  extra: np.ndarray  # [slots] int32: first blocks that take one step more
  knobs: Knobs  # [slots] each
  constraint: np.ndarray  # [slots] int32: bytes of an admitted request's constraint spec (0: none; :func:`spec_of`)
  heal: np.ndarray  # [slots] int32: bytes of an admitted request's healed characters (UTF-8; 0: none)
  tables: np.ndarray  # [slots, pages per row] int32: an admitted request's pages (the sink past its canvas)
  chunks: np.ndarray  # [] int32: chunks of chunked prefills to run after the admissions (``serve.pacing``)


class Timing(NamedTuple):
  """What the last engine iteration measured on this process (the pacer of chunked prefills reads it)."""

  chunks: int  # chunks of chunked prefills it ran
  chunk_seconds: float  # their seconds, together
  step_seconds: float | None  # its step's, to the copy of the view; None: it ran no step
  prefill_seconds: float | None = None  # a timed dispatch's prefills (and inserts), alone on the device; else None


class Dispatched(NamedTuple):
  """A command carried out up to its step, which may still be running (:meth:`SlotEngine.dispatch`): JAX dispatches
  programs asynchronously, so the host can do other work until :meth:`SlotEngine.collect` waits for the step."""

  failures: dict[int, str]  # slot -> error message of each admission that failed (its row is free)
  prefills: tuple[int, ...]  # the prefill bucket (slots; 0: chunked) of each admission it ran
  live: np.ndarray | None  # [n] the rows its step ran (the batch bucket); None: no step
  packed: jax.Array | None  # the step's packed view (``engine.news``), still on the device
  began: float  # time.perf_counter() when the step was dispatched


class View(NamedTuple):
  """What the host reads back after a step (numpy, every row): only what the step can have changed, the window each
  row worked on and the one it works on next, never the whole canvas. On the device it is one packed int32 array
  (:func:`mercury_jax.sampling.engine.news`), one copy.

  A row's tokens before ``worked`` were final before the step. Its window at ``worked`` is final after it when the
  row moved on (``starts > worked``) or has finished (``unfinished`` False). The window at ``starts`` holds the tokens
  a constraint forced when the row moved on (final once the row has finished; a row can finish there, when the
  forced tokens fill its hole).
  """

  block: np.ndarray  # [slots, W] the tokens of the window the step worked on, after the step
  upcoming: np.ndarray  # [slots, W] the tokens of the window the row's next step works on
  proposal: np.ndarray  # [slots, W] the step's proposals in the worked window (a draft's undecided positions)
  worked: np.ndarray  # [slots] the first slot of the worked window
  starts: np.ndarray  # [slots] the first slot of the upcoming window
  unfinished: np.ndarray  # [slots] bool: the row still has a masked position
  nfe: np.ndarray  # [slots] forward passes each row needed

  @classmethod
  def unpack(cls, packed: np.ndarray, width: int) -> View:
    """The view of a packed ``[slots, 3 W + 4]`` array (``width``: ``W``)."""
    scalars = packed[:, 3 * width :]
    return cls(
      block=packed[:, :width],
      upcoming=packed[:, width : 2 * width],
      proposal=packed[:, 2 * width : 3 * width],
      worked=scalars[:, 0],
      starts=scalars[:, 1],
      unfinished=scalars[:, 2].astype(bool),
      nfe=scalars[:, 3],
    )


def key_data(seed: int) -> np.ndarray:
  """uint32 [2]: ``jax.random.key_data(jax.random.key(seed))`` for a seed in [0, 2**32), computed on the host.

  The engine thread admits requests while a step runs: asking the device for a key would wait behind that step (on
  a CPU, for its threads), which is the very wait the overlap hides. Threefry's seed is the seed's high and low 32
  bits; another PRNG implementation asks JAX.
  """
  if jax.config.jax_default_prng_impl == "threefry2x32" and 0 <= seed < 2**32:
    return np.asarray([seed >> 32, seed & 0xFFFFFFFF], np.uint32)
  return np.asarray(jax.random.key_data(jax.random.key(seed)))


def spec_of(automaton: Automaton) -> bytes:
  """What compiles to ``automaton`` again (with the same tokenizer): its kind and source."""
  return f"{automaton.kind}\n{automaton.source}".encode()


class Admission:
  """Writes requests into commands, with their pages and prefill buckets (module docstring).

  Args:
    plan: The engine's plan (its block, canvas length and slots).
    settings: The engine's sampler settings (padding id, default knobs).
    slots: Rows of the engine.
    page_size: Slots of a page; ``kv_pages``: pages of the pool, the sink included (None: every slot can hold a whole
      context).
    prefill_chunk: Slots of a chunk of a chunked prefill (a multiple of the block; 0: every prompt in one pass).
    default_steps: Steps per block of a request that gives none.
    structured: The engine holds structured output's tables (a request with a constraint is refused without).
  """

  def __init__(self, plan: BlockPlan, settings: SamplerSettings, slots: int, **layout):
    self.plan, self.settings, self.slots = plan, settings, slots
    self.block, self.length = plan.block, plan.length
    self.page_size, self.prefill_chunk = layout["page_size"], layout["prefill_chunk"]
    self.default_steps, self.structured = layout["default_steps"], layout["structured"]
    self.default_knobs = Knobs(settings.temperature, settings.top_k, settings.top_p, settings.threshold)
    self.paged = plan.cache == "exact"  # a model with a cache: pages, a page table per row, a host free list
    self.pages_per_row = -(-plan.slots // self.page_size)
    kv_pages = layout.get("kv_pages") or slots * self.pages_per_row + 1
    self.pool = PagePool(kv_pages if self.paged else 1)
    self.buckets = self._buckets()
    self.automata: dict[int, Automaton] = {}  # admitted requests' constraints, until their prefill
    self.heals: dict[int, str] = {}  # admitted requests' healed characters, until their prefill

  def _buckets(self) -> tuple[int, ...]:
    block = self.block
    top = block + self.length  # the canvas's slots (verified decoding's tail is never prefilled)
    # A request's first block ends at least two blocks in (the padding block, then its own): smaller buckets would
    # never be used (blocks of 32 tokens and more: Fast-dLLM v2, a whole-sequence model's default block).
    if self.prefill_chunk:  # Longer prefills run in chunks: the largest bucket is a chunk.
      top = max(self.prefill_chunk, 2 * block)
    size, sizes = max(MIN_BUCKET, 2 * block), []
    while size < top:
      sizes.append(-(-size // block) * block)
      size *= 2
    return tuple(sorted({*(s for s in sizes if s < top), top}))

  def pages_needed(self, row: Row) -> int:
    """Pages the row's canvas covers (the padding block in front included); 0 without a paged cache."""
    if not self.paged:
      return 0
    return -(-min(self.block + row.positions, self.plan.slots) // self.page_size)

  def prefill_end(self, prompt: int) -> int:
    """The slots ``[0, end)`` the prefill of a ``prompt``-token prompt covers: through its first generated block."""
    return ((self.block + prompt) // self.block + 1) * self.block

  def bucket(self, row: Row) -> int:
    """The index of the smallest prefill bucket that covers the row's first block; ``len(buckets)`` for a prompt
    prefilled in chunks."""
    end = self.prefill_end(len(row.prompt))
    return next((i for i, size in enumerate(self.buckets) if size >= end), len(self.buckets))

  def chunk_starts(self, prompt: int) -> list[int]:
    """The first slots of a chunked prefill's chunks of ``prefill_chunk`` slots: the last one ends at
    :meth:`prefill_end` (it may overlap the one before, whose slots it computes again, to the same values)."""
    end, chunk = self.prefill_end(prompt), self.prefill_chunk
    return [min(i * chunk, end - chunk) for i in range(-(-end // chunk))]

  def command(self) -> Command:
    """A command that does nothing (fill it in with :meth:`admit` and its fields)."""
    n, zeros = self.slots, lambda dtype: np.zeros((self.slots,), dtype)  # noqa: E731
    return Command(
      stop=np.zeros((), bool),
      step=np.zeros((), bool),
      release=zeros(bool),
      bucket=np.full((n,), -1, np.int32),
      tokens=np.full((n, self.length), self.settings.pad_id, np.int32),
      kinds=np.full((n, self.length), K.PAD, np.int32),
      streams=zeros(np.int32),
      keys=np.zeros((n, 2), np.uint32),
      steps=np.ones((n,), np.int32),
      extra=zeros(np.int32),
      knobs=Knobs.of(self.settings, n),
      constraint=zeros(np.int32),
      heal=zeros(np.int32),
      tables=np.full((n, self.pages_per_row), SINK, np.int32),
      chunks=np.zeros((), np.int32),
    )

  def admit(self, command: Command, slot: int, row: Row, *, pages: bool = True) -> None:
    """Writes ``row`` into ``command`` as the admission of row ``slot`` (host arrays, in place), with the pages its
    canvas covers (``pages`` False: none, the row reads and writes the sink; the warm-up's programs only).

    Raises:
      NoPages: Too few pages are free now (``command`` is untouched): the request must wait.
    """
    needed = self.pages_needed(row)
    if pages and needed > len(self.pool.free):
      raise NoPages(f"{needed} pages needed, {len(self.pool.free)} free")
    tokens, kinds = cv.example(row.pieces)
    command.tokens[slot], command.kinds[slot] = self.settings.pad_id, K.PAD
    command.tokens[slot, : len(tokens)], command.kinds[slot, : len(kinds)] = tokens, kinds
    command.bucket[slot] = self.bucket(row)
    command.streams[slot] = row.stream
    command.keys[slot] = key_data(row.seed)
    autoregressive = self.plan.autoregressive
    command.steps[slot] = 1 if autoregressive else (row.steps_per_block or self.default_steps)
    command.extra[slot] = 0 if autoregressive or row.steps_per_block is None else row.extra_steps
    for column, value in zip(command.knobs, row.knobs or self.default_knobs, strict=True):
      column[slot] = value
    command.constraint[slot] = 0
    self.automata.pop(slot, None)
    command.heal[slot] = len(row.heal.encode())
    self.heals.pop(slot, None)
    if row.heal:
      self.heals[slot] = row.heal
    if row.constraint is not None:
      if not self.structured:
        raise ValueError("this engine has no structured output (capacity None)")
      command.constraint[slot] = len(spec_of(row.constraint))
      self.automata[slot] = row.constraint
    command.tables[slot] = SINK
    if self.paged and pages:  # Last: nothing above can fail once the pages are taken.
      command.tables[slot, :needed] = self.pool.take(slot, needed)

  def give_back(self, command: Command, slot: int) -> None:
    """Marks row ``slot`` for release in ``command`` and returns its pages to the pool: an admission later in the
    same command may take them (the command releases before it admits)."""
    command.release[slot] = True
    self.pool.give_back(slot)
