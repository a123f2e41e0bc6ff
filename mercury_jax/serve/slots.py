"""The serving engine's device side: slots of the block engine, and the commands that drive them on every process.

This is JetStream's prefill / insert / generate split over :class:`~mercury_jax.sampling.engine.BlockEngine`, the
engine behind every other entry point:

* **prefill** (:meth:`BlockEngine.init` of one request): the request's canvas is laid into slots and its prompt runs
  through the model over the smallest *bucket* of slots that covers its first block, giving its keys and values.
  One compilation per bucket, all made at start-up (:meth:`SlotEngine.warm_up`). A prompt longer than
  ``prefill_chunk`` is admitted unfilled and prefilled in chunks straight into its pages, between the other rows'
  steps (:meth:`SlotEngine.run`; the command says how many chunks an iteration runs, which process 0's
  :class:`~mercury_jax.serve.pacing.PrefillPacer` sizes to a share of the engine's time), so it never stalls the
  streams already running.
* **insert**: that one-row state is written into a free row of the batch state, its keys and values into the pages
  the request was given (:class:`PagePool`).
* **generate**: one jitted step advances every busy slot by one refinement step of its own block, over the smallest
  *batch bucket* (1, 2, 4, ... rows, up to ``slots``) that holds every busy row: the busy rows' state is taken out
  of the batch (:func:`~mercury_jax.sampling.state.take_rows`), stepped and put back, and each row reads and writes
  its keys and values through its own page table (:class:`~mercury_jax.kvcache.PagedKVCache`), so no cache is
  copied to compact the rows. A lone request costs a batch of one, not ``slots`` rows. Each slot has its own block,
  step, step budget, sampling knobs and random stream, all traced arrays; the host then reads back, in one copy,
  only what the step can have changed: two blocks of each row and four scalars (:class:`View`), never the
  ``[slots, S]`` canvas.
* **release**: a finished or cancelled request's row stops taking steps, its constraint stops running, and its pages
  go back to the pool (:meth:`SlotEngine.give_back`).

Pages. The cache is one pool of ``kv_pages`` pages of ``page_size`` slots (page 0 is the sink that free rows and the
slots past a canvas point at). A request holds the pages its canvas covers (prompt, ``max_tokens``, suffix and the
padding block in front) from admission to release; when too few are free it waits in the queue (:class:`NoPages`),
and one that needs more than the pool holds is refused up front. The default pool lets every slot hold a whole
context, the memory of a dense cache; a smaller one serves more slots in the same memory when requests are short.

A :class:`Command` says what one iteration does (which rows to release, which requests to admit where, whether to
step). It is a fixed-shape tree of host arrays, so on a multi-host mesh process 0 (which serves HTTP and owns the
queue) broadcasts it and every process runs the same programs in the same order (:meth:`SlotEngine.run`,
:meth:`SlotEngine.follow`).

Nothing a request asks for compiles: its knobs are arrays, its prompt length picks a prefill bucket and the busy rows
a batch bucket, all compiled at start-up. A request draws from ``fold_in(key(seed), stream)``, runs alone in its
prefill, and every step runs the network batch-invariantly (:class:`~mercury_jax.sampling.network.InvariantNetwork`:
matmuls over fixed tiles of positions, reductions by products or row by row; a batched product may round otherwise
as the bucket grows), so its tokens are the same in every bucket, whatever else is being served.
"""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from mercury_jax import kinds as K, sharding as sh
from mercury_jax.constrain.automaton import Automaton, Compiler
from mercury_jax.kvcache import SINK, PagedKVCache
from mercury_jax.limits import MAX_TILE
from mercury_jax.sampling import automata as constrained, healing
from mercury_jax.sampling.canvas import Canvas
from mercury_jax.sampling.drafts import DEVICE_DEFAULT, Drafting
from mercury_jax.sampling.engine import Start, width
from mercury_jax.sampling.plan import BlockPlan, Decoding
from mercury_jax.sampling.proposal import Knobs
from mercury_jax.sampling.sampler import Sampler
from mercury_jax.sampling.state import Healing, State, repeat_rows
from mercury_jax.serve.pages import NoPages, PagePool

MIN_BUCKET = 32  # The smallest prefill bucket, in slots; buckets double up to the whole context.
# The automaton sizes every slot can hold (structured output): states, token classes, transitions. A constraint that
# compiles to more is refused (HTTP 400); ``--constraint-capacity`` changes it.
DEFAULT_CAPACITY = constrained.Capacity(states=512, classes=256, edges=16384)
CAPACITY_REMEDY = "start the server with a larger --constraint-capacity (STATES,CLASSES,EDGES)"
DEFAULT_PAGE_SIZE = 16  # Slots of a page of the paged key-value cache (vLLM's default block size).


@dataclasses.dataclass(frozen=True)
class Request:
  """One completion to generate: ``prompt``, a hole of ``max_tokens`` positions, then ``suffix`` (token ids).

  Attributes:
    knobs: Temperature, top-k, top-p and the threshold rule's bar, as Python scalars (:class:`Knobs`, traced per
      slot, so no value ever recompiles); None: the engine's defaults (:attr:`SlotEngine.default_knobs`).
    steps_per_block: Refinement steps each block of the hole gets (>= 1; each step commits at least one token, so
      more than the block never changes the result); None: the engine's default (one token per step). A front end
      with a total budget converts it with :func:`mercury_jax.sampling.settings.steps_per_block`.
  """

  prompt: tuple[int, ...]
  max_tokens: int
  suffix: tuple[int, ...] = ()
  knobs: Knobs | None = None
  steps_per_block: int | None = None
  seed: int = 0
  stream: int = 0  # The random stream within the seed (the choice index of an n > 1 request).
  diffusing: bool = False  # Also deliver the draft after every step.
  constraint: Automaton | None = None  # The hole's text must be accepted by it (structured output).
  heal: str = ""  # Token healing: the hole's first token starts with these characters (the prompt's backed-off end).
  extra_steps: int = 0  # The hole's first ``extra_steps`` blocks take one step more (the rest of a total budget).


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
  constraint: np.ndarray  # [slots] int32: bytes of an admitted request's constraint spec (0: none; see ``_specs``)
  heal: np.ndarray  # [slots] int32: bytes of an admitted request's healed characters (UTF-8; 0: none)
  tables: np.ndarray  # [slots, pages per row] int32: an admitted request's pages (the sink past its canvas)
  chunks: np.ndarray  # [] int32: chunks of chunked prefills to run after the admissions (``serve.pacing``)


class Timing(NamedTuple):
  """What the last :meth:`SlotEngine.run` measured on this process (the pacer of chunked prefills reads it)."""

  chunks: int  # chunks of chunked prefills it ran
  chunk_seconds: float  # their seconds, together
  step_seconds: float | None  # its step's, to the copy of the view; None: it ran no step


class View(NamedTuple):
  """What the host reads back after a step (numpy, every row): only what the step can have changed, the block each
  row worked on and the block it works on next, never the whole canvas. On the device it is one packed int32 array
  (:func:`news`), one copy.

  A row's tokens before ``worked`` were final before the step. Its block at ``worked`` is final after it when the
  row moved on (``starts > worked``) or has finished (``unfinished`` False). The block at ``starts`` holds the tokens
  a constraint forced when the row moved on (final once the row has finished; a row can finish there, when the
  forced tokens fill its hole).
  """

  block: np.ndarray  # [slots, B] the tokens of the block the step worked on, after the step
  upcoming: np.ndarray  # [slots, B] the tokens of the block the row's next step works on
  proposal: np.ndarray  # [slots, B] the step's proposals in the worked block (a draft's undecided positions)
  worked: np.ndarray  # [slots] the first slot of the worked block
  starts: np.ndarray  # [slots] the first slot of the upcoming block
  unfinished: np.ndarray  # [slots] bool: the row still has a masked position
  nfe: np.ndarray  # [slots] forward passes each row needed

  @classmethod
  def unpack(cls, packed: np.ndarray, block: int) -> View:
    """The view of :func:`news`' packed ``[slots, 3 W + 4]`` array (``block``: ``W``)."""
    scalars = packed[:, 3 * block :]
    return cls(
      block=packed[:, :block],
      upcoming=packed[:, block : 2 * block],
      proposal=packed[:, 2 * block : 3 * block],
      worked=scalars[:, 0],
      starts=scalars[:, 1],
      unfinished=scalars[:, 2].astype(bool),
      nfe=scalars[:, 3],
    )


def invariant_tile_of(plan: BlockPlan) -> int:
  """Positions per matmul tile of a batch-invariant step: four rows' positions (a step's block, a verified step's
  chunk: its draft tree's nodes and pre-draft blocks, ``k + k * k`` for the chain; a whole-sequence canvas), a
  multiple of 8 in [8, 64]. A full bucket's products then run four rows at a time, and a lone row pays a four-row
  product, whose weights it reads once (BUILD_NOTES.md, issue 28)."""
  positions = plan.length if plan.whole_sequence else plan.tree.mask.size if plan.draft else plan.block
  return min(64, max(8, -(-4 * positions // 8) * 8))


class SlotEngine:
  """The block engine over a fixed number of slots, for one model.

  Args:
    sampler: The model, tokenizer and mesh (:meth:`Sampler.from_checkpoint`).
    slots: Rows of every step: requests refined at once.
    block_length: The block of a whole-sequence checkpoint (decoded without a cache); block-diffusion checkpoints
      use their trained block (a different one is an error) and the autoregressive twin blocks of one token.
    decode: ``auto``, ``ar``, ``diffusion`` or ``verified`` (:func:`~mercury_jax.sampling.plan.plan_for`): every
      request of the engine decodes so (the plan is static).
    draft_length: Verified decoding's draft length (0: the checkpoint's).
    drafting: Verified decoding's draft tree, lookup chain and pre-draft blocks (``auto``: the device's); one plan
      for every request, compiled at start.
    draft_confidence: Verified decoding's adaptive draft length (``SamplerSettings.draft_confidence``; 0: off).
    default_steps: Steps per block when a request gives none; default the block (one token per step).
    capacity: The automaton sizes each slot holds for structured output (:data:`DEFAULT_CAPACITY`); None: no
      structured output (a request with a constraint fails).
    page_size: Slots of a page of the paged key-value cache.
    kv_pages: Pages of the pool, the sink included; default: enough for every slot to hold a whole context (the
      memory of a dense cache). Fewer make requests wait for pages (:class:`NoPages`) under load.
    batch_invariant: A request's tokens are the same in every batch bucket, alone or beside any other requests: a step
      runs the network's matmuls over fixed tiles of positions (:class:`~mercury_jax.sampling.network.
      InvariantNetwork`), since a product over more rows may round otherwise. False batches the rows, and a sampled
      token may then change with the load. Prefills run one row, batched either way.
    invariant_tile: Positions per matmul tile of a batch-invariant step (a lone row pads its step to one tile); 0:
      :func:`invariant_tile_of` the plan.
    max_model_len: The longest request served (prompt, generated tokens and suffix); default the model's context. It
      sizes the canvas, the prefill buckets and the default page pool.
    prefill_chunk: A prompt whose prefill covers more slots than this (rounded up to whole blocks) is prefilled a
      chunk at a time, as many chunks per iteration as its command's ``chunks`` between the other rows' steps
      (:meth:`run`), so a long prompt never stalls the streams already running; 0: every prompt in one pass at its
      admission.
  """

  def __init__(
    self,
    sampler: Sampler,
    *,
    slots: int,
    block_length: int = 0,
    decode: str = "auto",
    draft_length: int = 0,
    drafting: Drafting = DEVICE_DEFAULT,
    draft_confidence: float = 0.0,
    default_steps: int | None = None,
    capacity: constrained.Capacity | None = DEFAULT_CAPACITY,
    page_size: int = DEFAULT_PAGE_SIZE,
    kv_pages: int | None = None,
    batch_invariant: bool = True,
    invariant_tile: int = 0,
    max_model_len: int | None = None,
    prefill_chunk: int = 0,
    solver: str | None = None,
    guidance: float | None = None,
  ):
    if slots < 1:
      raise ValueError(f"slots={slots} must be >= 1")
    if page_size < 1:
      raise ValueError(f"page_size={page_size} must be >= 1")
    if not 0 <= invariant_tile <= MAX_TILE:
      raise ValueError(f"invariant_tile={invariant_tile} must lie in [0, {MAX_TILE}] (0: the plan's)")
    self.sampler, self.slots, self.capacity = sampler, slots, capacity
    self.compiler = None
    if capacity is not None:
      self.compiler = Compiler(
        sampler.tokenizer,
        max_states=capacity.states,
        max_classes=capacity.classes,
        max_edges=capacity.edges,
        remedy=CAPACITY_REMEDY,
      )
    self._automata: dict[int, Automaton] = {}  # admitted requests' constraints, until their prefill
    self._heals: dict[int, str] = {}  # admitted requests' healed characters, until their prefill
    context = sampler.max_length if max_model_len is None else max_model_len
    if not 1 <= context <= sampler.max_length:
      raise ValueError(
        f"max_model_len={context} must lie in [1, {sampler.max_length}] (the model's context; a longer one needs a "
        "model trained or extended to it, e.g. with RoPE scaling)"
      )
    if prefill_chunk < 0:
      raise ValueError(f"prefill_chunk={prefill_chunk} must be >= 0 (0: every prompt in one pass)")
    # Fixed slots hold no whole canvas: a whole-sequence checkpoint decodes blocks without a cache.
    decoding = Decoding("auto", block_length, decode, draft_length, drafting=drafting)
    self.plan = plan = sampler.plan(decoding, context, whole_canvas=False)
    self.autoregressive, self.whole_sequence = plan.autoregressive, plan.whole_sequence
    if self.whole_sequence and sampler.cfg.objective.continuous:
      raise ValueError(
        "a whole-sequence continuous checkpoint refines its whole canvas as one block, which a server's fixed slots "
        "cannot hold; serve a block-causal one (objective.block_size > 0), or sample it with python -m "
        "mercury_jax.sample"
      )
    self.max_model_len, self.block, cache = context, plan.block, plan.cache
    block = plan.block
    self.length = self.plan.length  # canvas positions of a row
    # Chunked prefill (the exact cache): prompts whose prefill covers more than ``prefill_chunk`` slots fill their rows'
    # pages in chunks (``filling``: slot -> the chunks' first slots still to run, in admission order).
    self.prefill_chunk = -(-prefill_chunk // block) * block if cache == "exact" else 0
    if self.prefill_chunk >= self.length:  # No prompt is that long: every prefill is one pass.
      self.prefill_chunk = 0
    self.filling: dict[int, list[int]] = {}
    self.timing = Timing(0, 0.0, None)
    self.width = width(self.plan)
    continuous = sampler.cfg.objective.continuous
    latent = {name: value for name, value in (("solver", solver), ("guidance", guidance)) if value is not None}
    if draft_confidence:
      latent["draft_confidence"] = draft_confidence
    self.settings = sampler.settings(rule="ode" if continuous else "threshold", **latent)
    self.default_steps = 1 if self.autoregressive else (default_steps or block)
    settings = self.settings
    self.default_knobs = Knobs(settings.temperature, settings.top_k, settings.top_p, settings.threshold)
    self.buckets = self._buckets()
    self.batch_invariant = batch_invariant
    # A prefill runs one row whatever the load, so it is invariant batched; a step's rows must not depend on its bucket.
    programs = sampler.programs
    self.prefiller = programs.engine(self.settings, plan)
    self.invariant_tile = (invariant_tile or invariant_tile_of(plan)) if batch_invariant else 0
    self.engine = engine = programs.engine(self.settings, plan, self.invariant_tile)
    self.multiprocess = jax.process_count() > 1
    mesh, rules = sampler.mesh, sampler.rules
    # Batch buckets: a step runs the smallest that holds every busy row (multiples of the data-parallel size).
    parallel = sh.data_parallel_size(mesh, rules)
    self.row_buckets = tuple(
      sorted({*(parallel << i for i in range(slots.bit_length()) if parallel << i < slots), slots})
    )
    # The paged cache (a model with a cache): pages of ``page_size`` slots, a page table per row, a host free list.
    self.paged = self.plan.cache == "exact"
    self.page_size, self.pages_per_row = page_size, -(-self.plan.slots // page_size)
    kv_pages = slots * self.pages_per_row + 1 if kv_pages is None else kv_pages
    if self.paged and kv_pages < 2:
      raise ValueError(f"kv_pages={kv_pages} must be >= 2 (page 0 is the sink)")
    self.pool = PagePool(kv_pages if self.paged else 1)
    self.busy: set[int] = set()  # rows holding a request (the same on every process: it follows the commands)

    def blank(row: State) -> State:  # the batch state of ``slots`` copies of a one-row state, over an empty pool
      cache = (
        PagedKVCache.empty(sampler.cfg.model, slots, self.plan.slots, self.pool.pages, page_size) if self.paged else ()
      )
      return repeat_rows(row, slots, cache)

    # The last prefill: a chunked prefill's row, unfilled and inert until its last chunk ``arm`` s it.
    self._prefill = [programs.prefill(self.prefiller, size) for size in self.buckets]
    self._prefill.append(programs.prefill(self.prefiller, 0, inert=True))
    self._arm, self._fill = programs.arm(engine), programs.fill(self.prefiller, self.prefill_chunk)
    self._insert, self._release, self._step = programs.insert(engine), programs.release(engine), programs.step(engine)
    self._blank = sh.MeshJit(blank, mesh, rules)
    self.state: State | None = None

  # ------------------------------------------------------------------------------------------- memory

  @property
  def kv_bytes_per_slot(self) -> int:
    """Bytes of keys and values one slot of the canvas holds (every layer)."""
    model = self.sampler.cfg.model
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * jnp.dtype(model.dtype).itemsize

  def pages_needed(self, request: Request) -> int:
    """Pages the request's canvas covers (the padding block in front included); 0 without a paged cache."""
    if not self.paged:
      return 0
    end = self.block + len(request.prompt) + request.max_tokens + len(request.suffix)
    return -(-min(end, self.plan.slots) // self.page_size)

  def memory(self) -> dict[str, int]:
    """The key-value cache's sizes: ``pool`` bytes of the paged pool (0: no cache), ``dense_row`` bytes one row of a
    dense cache would hold, ``page`` bytes of a page, ``pages`` and ``page_size``."""
    if not self.paged:
      return {"pool": 0, "dense_row": 0, "page": 0, "pages": 0, "page_size": 0}
    page = self.page_size * self.kv_bytes_per_slot
    return {
      "pool": self.pool.pages * page,
      "dense_row": self.plan.slots * self.kv_bytes_per_slot,
      "page": page,
      "pages": self.pool.pages,
      "page_size": self.page_size,
    }

  # ------------------------------------------------------------------------------------------- requests

  def _buckets(self) -> tuple[int, ...]:
    top = self.block + self.length  # the canvas's slots (verified decoding's tail is never prefilled)
    # A request's first block ends at least two blocks in (the padding block, then its own): smaller buckets would
    # never be used (blocks of 32 tokens and more: Fast-dLLM v2, a whole-sequence model's default block).
    if self.prefill_chunk:  # Longer prefills run in chunks (:meth:`fill_from`): the largest bucket is a chunk.
      top = max(self.prefill_chunk, 2 * self.block)
    size, sizes = max(MIN_BUCKET, 2 * self.block), []
    while size < top:
      sizes.append(-(-size // self.block) * self.block)
      size *= 2
    return tuple(sorted({*(s for s in sizes if s < top), top}))

  def prefill_end(self, prompt: int) -> int:
    """The slots ``[0, end)`` the prefill of a ``prompt``-token prompt covers: through its first generated block."""
    return ((self.block + prompt) // self.block + 1) * self.block

  def bucket(self, request: Request) -> int:
    """The index of the smallest prefill bucket that covers the request's first block; ``len(buckets)`` for a
    prompt prefilled in chunks."""
    end = self.prefill_end(len(request.prompt))
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

  def admit(self, command: Command, slot: int, request: Request, *, pages: bool = True) -> None:
    """Writes ``request`` into ``command`` as the admission of row ``slot`` (host arrays, in place), with the pages
    its canvas covers (``pages`` False: none, the row reads and writes the sink; the warm-up's programs only).

    Raises:
      NoPages: Too few pages are free now (``command`` is untouched): the request must wait.
    """
    if pages and self.pages_needed(request) > len(self.pool.free):
      raise NoPages(f"{self.pages_needed(request)} pages needed, {len(self.pool.free)} free")
    p, m, s = len(request.prompt), request.max_tokens, len(request.suffix)
    command.tokens[slot] = self.settings.pad_id
    command.tokens[slot, :p] = request.prompt
    command.tokens[slot, p + m : p + m + s] = request.suffix
    command.kinds[slot] = K.PAD
    command.kinds[slot, :p] = K.FIXED
    command.kinds[slot, p : p + m] = K.TARGET
    command.kinds[slot, p + m : p + m + s] = K.FIXED
    command.bucket[slot] = self.bucket(request)
    command.streams[slot] = request.stream
    command.keys[slot] = np.asarray(jax.random.key_data(jax.random.key(request.seed)))
    command.steps[slot] = 1 if self.autoregressive else (request.steps_per_block or self.default_steps)
    command.extra[slot] = 0 if self.autoregressive or request.steps_per_block is None else request.extra_steps
    for column, value in zip(command.knobs, request.knobs or self.default_knobs, strict=True):
      column[slot] = value
    command.constraint[slot] = 0
    self._automata.pop(slot, None)
    command.heal[slot] = len(request.heal.encode())
    self._heals.pop(slot, None)
    if request.heal:
      self._heals[slot] = request.heal
    if request.constraint is not None:
      if self.capacity is None:
        raise ValueError("this engine has no structured output (capacity None)")
      command.constraint[slot] = len(_spec(request.constraint))
      self._automata[slot] = request.constraint
    command.tables[slot] = SINK
    if self.paged and pages:  # Last: nothing above can fail once the pages are taken.
      command.tables[slot, : self.pages_needed(request)] = self.pool.take(slot, self.pages_needed(request))

  def give_back(self, command: Command, slot: int) -> None:
    """Marks row ``slot`` for release in ``command`` and returns its pages to the pool: an admission later in the
    same command may take them (the command releases before it admits)."""
    command.release[slot] = True
    self.pool.give_back(slot)

  def _specs(self, command: Command) -> None:
    """Every process's automata and healed characters of the command's admissions: process 0 broadcasts their specs
    (a constraint's kind and source, which compile to the same automaton everywhere; the healed text), the others
    compile them (cached)."""
    longest = int(max(command.constraint.max(initial=0), command.heal.max(initial=0)))
    if not self.multiprocess or not longest:
      return
    data = np.zeros((2, self.slots, longest), np.uint8)
    for slot, automaton in self._automata.items():
      spec = _spec(automaton)
      data[0, slot, : len(spec)] = np.frombuffer(spec, np.uint8)
    for slot, text in self._heals.items():
      data[1, slot, : command.heal[slot]] = np.frombuffer(text.encode(), np.uint8)
    data = np.asarray(multihost_utils.broadcast_one_to_all(data))
    if jax.process_index() == 0:
      return
    for slot in np.flatnonzero(command.constraint):
      kind, _, source = bytes(data[0, slot, : command.constraint[slot]]).decode().partition("\n")
      compile_ = {"regex": self.compiler.regex, "json_schema": self.compiler.json_schema}.get(kind)
      self._automata[int(slot)] = compile_(source) if compile_ else self.compiler.json_object()
    for slot in np.flatnonzero(command.heal):
      self._heals[int(slot)] = bytes(data[1, slot, : command.heal[slot]]).decode()

  # ------------------------------------------------------------------------------------------- programs

  def _place(self, array) -> jax.Array | np.ndarray:
    """A host array as a replicated global array on a multi-host mesh (every process passes the same values)."""
    if not self.multiprocess:
      return array
    array = np.asarray(array)
    sharding = NamedSharding(self.sampler.mesh, P())
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

  def prefill(self, command: Command, slot: int) -> State:
    """The one-row state of the request admitted into ``slot``: its prefill over its bucket."""
    row = slice(slot, slot + 1)
    place = self._place
    canvas = Canvas(place(command.tokens[row]), place(command.kinds[row]), place(command.streams[row]))
    knobs = Knobs(*(place(k[row]) for k in command.knobs))
    bucket = int(command.bucket[slot])
    tables = self._tables([self._automata.pop(slot, None)])
    heal = self._healing([self._heals.pop(slot, "")], [int(np.argmax(command.kinds[slot] == K.TARGET))])
    steps, extra, key = place(command.steps[row]), place(command.extra[row]), place(command.keys[slot])
    return self._prefill[bucket](self.sampler.params, Start(canvas, key, steps, knobs, tables, heal, extra))

  def _healing(self, texts: list[str], positions: list[int]) -> Healing:
    """Rows' token-healing masks (every row has one, so one program serves all): a row with healed characters lets
    its first generated position take only the tokens whose text starts with them."""
    vocab = self.sampler.cfg.model.vocab_size
    allowed = np.ones((len(texts), vocab), bool)
    slot = np.full((len(texts),), -1, np.int32)
    for row, (text, position) in enumerate(zip(texts, positions, strict=True)):
      if text:
        allowed[row] = healing.allowed_tokens(self.sampler.tokenizer, text, vocab)
        slot[row] = position
    return Healing(*(self._place(a) for a in (allowed, slot)))

  def _tables(self, automata: list[Automaton | None]) -> constrained.Tables | None:
    if self.capacity is None:
      return None
    tables = constrained.tables(automata, self.capacity, self.sampler.cfg.model.vocab_size)
    return jax.tree.map(self._place, tables)

  def run(self, command: Command, *, received: bool = False) -> tuple[View | None, dict[int, str]]:
    """Carries ``command`` out on this process: process 0's command, on every process of a multi-host mesh (it is
    broadcast here unless ``received`` says it already was).

    Returns:
      ``(view after the step or None, {slot: error message} of admissions that failed)``. A failed admission leaves
      its row free; the others go on.
    """
    if self.multiprocess and not received:
      command = multihost_utils.broadcast_one_to_all(command)
    if bool(command.stop):
      return None, {}
    self._specs(command)
    for slot in np.flatnonzero(command.release):
      self.state = self._sync(self._release(self.state, self._place(np.int32(slot))))
      self.busy.discard(int(slot))
      self.filling.pop(int(slot), None)
    failures = {}
    for slot in np.flatnonzero(command.bucket >= 0):
      try:
        row = self._sync(self.prefill(command, int(slot)))
        table = self._place(command.tables[slot])
        self.state = self._sync(self._insert(self.state, row, self._place(np.int32(slot)), table))
        if command.bucket[slot] == len(self.buckets):  # A long prompt: its chunks run from now, paced.
          self.filling[int(slot)] = self.chunk_starts(int(np.argmax(command.kinds[slot] == K.TARGET)))
        else:
          self.busy.add(int(slot))
      except Exception as error:  # noqa: BLE001  The request fails alone; the engine keeps serving.
        failures[int(slot)] = f"{type(error).__name__}: {error}"
        self.pool.give_back(int(slot))
    self.timing = Timing(*self._fill_chunks(int(command.chunks)), None)
    if not bool(command.step) or not self.busy:
      return None, failures
    live = self.live_rows()
    began = time.perf_counter()
    self.state, packed = self._sync(self._step(self.sampler.params, self.state, self._place(live)))
    view = self._view(live, self.sampler.placement.gather(packed))  # the copy waits for the step
    self.timing = self.timing._replace(step_seconds=time.perf_counter() - began)
    return view, failures

  def _fill_chunks(self, count: int) -> tuple[int, float]:
    """Runs up to ``count`` chunks of chunked prefills (the command's ``chunks``, which process 0's pacer chose);
    returns how many ran and their seconds, each waited for (the step after them waits for them anyway)."""
    count = min(count, sum(map(len, self.filling.values())))
    if not count:
      return 0, 0.0
    jax.block_until_ready(self.state)  # the admissions' work is not the chunks'
    began = time.perf_counter()
    for _ in range(count):
      self._fill_next()
    jax.block_until_ready(self.state)
    return count, time.perf_counter() - began

  def _fill_next(self) -> None:
    """Runs the next chunk of the longest-waiting chunked prefill; its row joins the steps after its last chunk. A
    failure here is the batch state's, like a failed step's."""
    slot = next(iter(self.filling))
    starts = self.filling[slot]
    where = (self._place(np.int32(slot)), self._place(np.int32(starts.pop(0))))
    self.state = self._sync(self._fill(self.sampler.params, self.state, *where))
    if not starts:  # Whole: the row is armed and steps from this iteration on.
      del self.filling[slot]
      self.state = self._sync(self._arm(self.state, self._place(np.int32(slot))))
      self.busy.add(slot)

  def live_rows(self) -> np.ndarray:
    """int32 [n]: the rows the next step runs, the busy ones then others up to the smallest batch bucket ``n``
    that holds every busy row. Free rows pad first; a row whose prompt is still being prefilled in chunks
    (``filling``) pads the bucket only when no free row is left, and is inert there: it has nothing to generate
    until its last chunk arms it, so the step leaves its state and its pages as they were."""
    busy = sorted(self.busy)
    size = next(n for n in self.row_buckets if n >= len(busy))
    free = [slot for slot in range(self.slots) if slot not in self.busy and slot not in self.filling]
    free += [slot for slot in self.filling if slot not in self.busy]
    return np.asarray(busy + free[: size - len(busy)], np.int32)

  def _view(self, live: np.ndarray, packed: np.ndarray) -> View:
    """The :class:`View` of every slot from a bucket's packed rows (rows outside the bucket: nothing to report)."""
    full = np.zeros((self.slots, packed.shape[1]), packed.dtype)
    full[live] = packed
    return View.unpack(full, self.width)

  def _sync(self, out):
    """``out``, computed, on a multi-host mesh. XLA:CPU runs programs without a data dependency between them
    concurrently, so a prefill (or the next command's broadcast) could reach its collectives before the previous
    program's on one process and after them on another, which mismatches the collectives (gloo aborts)."""
    return jax.block_until_ready(out) if self.multiprocess else out

  def follow(self) -> None:
    """A process other than 0: runs process 0's commands until it sends ``stop``."""
    while True:
      command = multihost_utils.broadcast_one_to_all(self.command())
      if bool(command.stop):
        return
      self.run(command, received=True)

  def stop_followers(self) -> None:
    """Process 0: tells the other processes to leave :meth:`follow`."""
    if self.multiprocess:
      multihost_utils.broadcast_one_to_all(self.command()._replace(stop=np.ones((), bool)))

  def reset(self) -> None:
    """Every row free: the state after start-up (after a failed step, too)."""
    self.state = None
    self.warm_up()

  def _admit_now(self, command: Command, slot: int, row: State | None = None) -> State:
    """Warm-up: inserts the admission of ``slot`` in ``command``, prefilled here unless ``row`` is its prefill
    already (the same request in every slot); returns the prefill."""
    row = self._sync(self.prefill(command, slot)) if row is None else row
    table = self._place(command.tables[slot])
    self.state = self._sync(self._insert(self.state, row, self._place(np.int32(slot)), table))
    self.busy.add(slot)
    return row

  def warm_up(self) -> None:
    """Builds the batch state with every row free and an empty page pool, compiling every program a request can
    reach on the way: each prefill bucket's prefill, insert, release and the step of each batch bucket."""
    self.pool.reset()
    self.busy.clear()
    self.filling.clear()
    command = self.command()
    bos = self.settings.bos_id
    for bucket, size in enumerate(self.buckets):  # A prompt whose first block ends at the bucket's end.
      request = Request(prompt=(bos,) * max(1, size - 2 * self.block), max_tokens=1)
      self.admit(command, 0, request, pages=False)
      assert command.bucket[0] == bucket
      if self.state is None:
        self.state = self._sync(self._blank(self.prefill(command, 0)))
      self._admit_now(command, 0)
      self.state = self._sync(self._release(self.state, self._place(np.int32(0))))
      self.busy.discard(0)
    if self.prefill_chunk:  # A chunked prefill: its unfilled row, and one chunk.
      self.admit(command, 0, Request(prompt=(bos,) * self.prefill_chunk, max_tokens=1), pages=False)
      assert command.bucket[0] == len(self.buckets)
      self._admit_now(command, 0)
      self.busy.discard(0)
      self.state = self._sync(self._fill(self.sampler.params, self.state, *map(self._place, np.zeros(2, np.int32))))
      self.state = self._sync(self._arm(self.state, self._place(np.int32(0))))
      self.state = self._sync(self._release(self.state, self._place(np.int32(0))))
    small, row = Request(prompt=(bos,), max_tokens=1), None
    for slot in range(self.slots):  # Every row busy (one prefill for all), then the step of each batch bucket.
      self.admit(command, slot, small, pages=False)
      row = self._admit_now(command, slot, row)
    for size in self.row_buckets:
      live = np.arange(size, dtype=np.int32)
      self.state, _ = self._sync(self._step(self.sampler.params, self.state, self._place(live)))
    for slot in range(self.slots):
      self.state = self._sync(self._release(self.state, self._place(np.int32(slot))))
    self.busy.clear()


def _spec(automaton: Automaton) -> bytes:
  """What compiles to ``automaton`` again (with the same tokenizer): its kind and source."""
  return f"{automaton.kind}\n{automaton.source}".encode()
