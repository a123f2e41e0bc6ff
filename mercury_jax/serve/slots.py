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

Admission, the pages and the commands that drive the engine on every process are the host's
(:mod:`~mercury_jax.serve.commands`, :mod:`~mercury_jax.serve.multihost`); this module runs the device programs the
commands ask for (:class:`~mercury_jax.sampling.programs.Programs`: the engine's ``prefill``, ``insert``, ``release``,
``step``, and a chunked prefill's ``fill`` and ``arm``).

Nothing a request asks for compiles: its knobs are arrays, its prompt length picks a prefill bucket and the busy rows
a batch bucket, all compiled at start-up. A request draws from ``fold_in(key(seed), stream)``, runs alone in its
prefill, and every step runs the network batch-invariantly (:class:`~mercury_jax.sampling.network.InvariantNetwork`:
matmuls over fixed tiles of positions, reductions by products or row by row; a batched product may round otherwise
as the bucket grows), so its tokens are the same in every bucket, whatever else is being served.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from mercury_jax import kinds as K, sharding as sh
from mercury_jax.constrain.automaton import Automaton, Compiler
from mercury_jax.kvcache import PagedKVCache
from mercury_jax.sampling import automata as constrained, healing
from mercury_jax.sampling.canvas import Canvas
from mercury_jax.sampling.drafts import Drafting
from mercury_jax.sampling.engine import Start, width
from mercury_jax.sampling.plan import BlockPlan, Decoding
from mercury_jax.sampling.proposal import Knobs
from mercury_jax.sampling.sampler import Sampler
from mercury_jax.sampling.state import Healing, State, repeat_rows
from mercury_jax.sampling.text import Row
from mercury_jax.serve.commands import Admission, Command, Dispatched, Timing, View
from mercury_jax.serve.config import CAPACITY_REMEDY, ServeConfig
from mercury_jax.serve.multihost import Processes


def invariant_tile_of(plan: BlockPlan) -> int:
  """Positions per matmul tile of a batch-invariant step: four rows' positions (a step's block, a verified step's
  chunk: its draft tree's nodes and pre-draft blocks, ``k + k * k`` for the chain; a whole-sequence canvas), a
  multiple of 8 in [8, 64]. A full bucket's products then run four rows at a time, and a lone row pays a four-row
  product, whose weights it reads once (docs/results/serving.md)."""
  positions = plan.length if plan.whole_sequence else plan.tree.mask.size if plan.draft else plan.block
  return min(64, max(8, -(-4 * positions // 8) * 8))


class SlotEngine:
  """The block engine over a fixed number of slots, for one model: the device programs a command asks for.

  Args:
    sampler: The model, tokenizer and mesh (:meth:`Sampler.from_checkpoint`).
    config: The engine's settings (:class:`~mercury_jax.serve.config.ServeConfig`; its queue's are the scheduler's).

  Raises:
    ValueError: A setting out of its range, or a plan the model does not have (one line naming the flag).
  """

  def __init__(self, sampler: Sampler, config: ServeConfig):
    self.sampler, self.config = sampler, config.validate()
    self.slots, self.capacity, self.batch_invariant = config.slots, config.capacity, config.batch_invariant
    self.compiler = None
    if config.capacity is not None:
      capacity = config.capacity
      self.compiler = Compiler(
        sampler.tokenizer, max_states=capacity.states, max_classes=capacity.classes, max_edges=capacity.edges,
        remedy=CAPACITY_REMEDY,
      )  # fmt: skip
    self.plan = plan = self._plan(sampler, config)
    self.max_model_len = sampler.max_length if config.max_model_len is None else config.max_model_len
    self.autoregressive, self.whole_sequence, self.block = plan.autoregressive, plan.whole_sequence, plan.block
    self.length, self.width = plan.length, width(plan)  # canvas positions of a row; tokens a step commits at most
    # Chunked prefill (the exact cache): prompts whose prefill covers more than ``prefill_chunk`` slots fill their rows'
    # pages in chunks (``filling``: slot -> the chunks' first slots still to run, in admission order).
    chunk = -(-config.prefill_chunk // plan.block) * plan.block if plan.cache == "exact" else 0
    self.prefill_chunk = chunk if chunk < self.length else 0  # no prompt that long: every prefill is one pass
    latent = {name: getattr(config, name) for name in ("solver", "guidance") if getattr(config, name) is not None}
    if config.draft_confidence:
      latent["draft_confidence"] = config.draft_confidence
    self.settings = sampler.settings(rule="ode" if sampler.cfg.objective.continuous else "threshold", **latent)
    self.default_steps = 1 if self.autoregressive else (config.default_steps or plan.block)
    layout = dict(page_size=config.page_size, kv_pages=config.kv_pages, prefill_chunk=self.prefill_chunk)
    layout |= dict(default_steps=self.default_steps, structured=config.capacity is not None)
    self.admission = Admission(plan, self.settings, config.slots, **layout)
    self.default_knobs = self.admission.default_knobs
    self.processes = Processes(sampler.mesh)
    self.multiprocess = self.processes.many
    # Batch buckets: a step runs the smallest that holds every busy row (multiples of the data-parallel size).
    parallel = sh.data_parallel_size(sampler.mesh, sampler.rules)
    self.row_buckets = tuple(sorted({*(parallel << i for i in range(config.slots.bit_length())), config.slots}))
    self.row_buckets = tuple(n for n in self.row_buckets if n <= config.slots)
    self.invariant_tile = (config.invariant_tile or invariant_tile_of(plan)) if config.batch_invariant else 0
    self._programs()
    self.busy: set[int] = set()  # rows holding a request (the same on every process: it follows the commands)
    self.filling: dict[int, list[int]] = {}
    self.timing = Timing(0, 0.0, None)
    self._plain = None  # (tables, healing) of a row without a constraint or healing, built at the first prefill
    self.state: State | None = None

  @staticmethod
  def _plan(sampler: Sampler, config: ServeConfig) -> BlockPlan:
    """The engine's plan: fixed slots hold no whole canvas, so a whole-sequence checkpoint decodes blocks without a
    cache (a whole-sequence continuous one cannot be served)."""
    context = sampler.max_length if config.max_model_len is None else config.max_model_len
    if not 1 <= context <= sampler.max_length:
      raise ValueError(
        f"max_model_len={context} must lie in [1, {sampler.max_length}] (the model's context; a longer one needs a "
        "model trained or extended to it, e.g. with RoPE scaling)"
      )
    drafting = Drafting(config.draft_tree, config.draft_lookup, config.draft_blocks)
    decoding = Decoding("auto", config.block_length, config.decode, config.draft_length, drafting=drafting)
    plan = sampler.plan(decoding, context, whole_canvas=False)
    if plan.whole_sequence and sampler.cfg.objective.continuous:
      raise ValueError(
        "a whole-sequence continuous checkpoint refines its whole canvas as one block, which a server's fixed slots "
        "cannot hold; serve a block-causal one (objective.block_size > 0), or sample it with python -m "
        "mercury_jax.sample"
      )
    return plan

  def _programs(self) -> None:
    """The engine's compiled programs (:class:`~mercury_jax.sampling.programs.Programs`): a prefill runs one row
    whatever the load, so it is invariant batched (``prefiller``); a step's rows must not depend on its bucket
    (``engine``, over tiles of positions when batch-invariant)."""
    programs, plan, sampler, slots = self.sampler.programs, self.plan, self.sampler, self.slots
    self.prefiller = programs.engine(self.settings, plan)
    self.engine = engine = programs.engine(self.settings, plan, self.invariant_tile)
    # The last prefill: a chunked prefill's row, unfilled and inert until its last chunk ``arm`` s it.
    self._prefill = [programs.prefill(self.prefiller, size) for size in self.admission.buckets]
    self._prefill.append(programs.prefill(self.prefiller, 0, inert=True))
    self._arm, self._fill = programs.arm(engine), programs.fill(self.prefiller, self.prefill_chunk)
    self._insert, self._release, self._step = programs.insert(engine), programs.release(engine), programs.step(engine)
    pages, page_size = self.admission.pool.pages, self.config.page_size

    def blank(row: State) -> State:  # the batch state of ``slots`` copies of a one-row state, over an empty pool
      paged = self.admission.paged
      return repeat_rows(
        row, slots, PagedKVCache.empty(sampler.cfg.model, slots, plan.slots, pages, page_size) if paged else ()
      )

    self._blank = sh.MeshJit(blank, sampler.mesh, sampler.rules)

  # ------------------------------------------------------------------------------------------- memory

  @property
  def kv_bytes_per_slot(self) -> int:
    """Bytes of keys and values one slot of the canvas holds (every layer)."""
    model = self.sampler.cfg.model
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * jnp.dtype(model.dtype).itemsize

  def memory(self) -> dict[str, int]:
    """The key-value cache's sizes: ``pool`` bytes of the paged pool (0: no cache), ``dense_row`` bytes one row of a
    dense cache would hold, ``page`` bytes of a page, ``pages`` and ``page_size``."""
    admission = self.admission
    if not admission.paged:
      return {"pool": 0, "dense_row": 0, "page": 0, "pages": 0, "page_size": 0}
    page = admission.page_size * self.kv_bytes_per_slot
    pages = admission.pool.pages
    dense = self.plan.slots * self.kv_bytes_per_slot
    return {"pool": pages * page, "dense_row": dense, "page": page, "pages": pages, "page_size": admission.page_size}

  # ------------------------------------------------------------------------------------------- programs

  def prefill(self, command: Command, slot: int) -> State:
    """The one-row state of the request admitted into ``slot``: its prefill over its bucket."""
    row, place = slice(slot, slot + 1), self.processes.place
    canvas = Canvas(place(command.tokens[row]), place(command.kinds[row]), place(command.streams[row]))
    knobs = Knobs(*(place(k[row]) for k in command.knobs))
    automaton, healed = self.admission.automata.pop(slot, None), self.admission.heals.pop(slot, "")
    if automaton is None and not healed:  # The usual admission: the arrays of "no constraint", built once.
      if self._plain is None:
        self._plain = (self._tables([None]), self._healing([""], [0]))
      tables, heal = self._plain
    else:
      tables = self._tables([automaton])
      heal = self._healing([healed], [int(np.argmax(command.kinds[slot] == K.TARGET))])
    steps, extra, key = place(command.steps[row]), place(command.extra[row]), place(command.keys[slot])
    start = Start(canvas, key, steps, knobs, tables, heal, extra)
    return self._prefill[int(command.bucket[slot])](self.sampler.params, start)

  def _healing(self, texts: list[str], positions: list[int]) -> Healing:
    """Rows' token-healing masks (every row has one, so one program serves all;
    :func:`~mercury_jax.sampling.healing.masks`)."""
    masks = healing.masks(self.sampler.tokenizer, texts, positions, self.sampler.cfg.model.vocab_size)
    return Healing(*(self.processes.place(a) for a in masks))

  def _tables(self, automata: list[Automaton | None]) -> constrained.Tables | None:
    if self.capacity is None:
      return None
    tables = constrained.tables(automata, self.capacity, self.sampler.cfg.model.vocab_size)
    return jax.tree.map(self.processes.place, tables)

  def run(self, command: Command, *, received: bool = False) -> tuple[View | None, dict[int, str]]:
    """Carries ``command`` out on this process: process 0's command, on every process of a multi-host mesh (it is
    broadcast here unless ``received`` says it already was). :meth:`dispatch`, then :meth:`collect`.

    Returns:
      ``(view after the step or None, {slot: error message} of admissions that failed)``. A failed admission leaves
      its row free; the others go on.
    """
    dispatched = self.dispatch(command, received=received)
    return self.collect(dispatched), dispatched.failures

  def collect(self, dispatched: Dispatched) -> View | None:
    """The view of a dispatched command's step (None without one): waits for the step and copies its view."""
    if dispatched.packed is None:
      return None
    view = self._view(dispatched.live, self.sampler.placement.gather(dispatched.packed))
    self.timing = self.timing._replace(step_seconds=time.perf_counter() - dispatched.began)
    return view

  def dispatch(self, command: Command, *, received: bool = False, timed: bool = False) -> Dispatched:
    """Carries ``command`` out up to its step: releases, admissions and their prefills, the chunks of chunked
    prefills (waited for, to be timed), then the step, dispatched but not waited for; its view's copy to the host
    starts as soon as it is computed. Programs run in the order they are dispatched (each takes the batch state the
    one before it gives), so the next command may be dispatched before this step is collected.

    ``timed``: the device's work is waited for before the prefills, after them and before the step, so
    :attr:`timing` has the prefills' seconds alone and :meth:`collect` the step's alone, each on the device as it is
    loaded right now (the server samples an iteration in many so: the bare work of its load, in place)."""
    if not received:
      command = self.processes.command(command)
    if bool(command.stop):
      return Dispatched({}, (), None, None, time.perf_counter())
    self.processes.specs(command, self.admission, self.compiler)
    sync, place = self.processes.sync, self.processes.place
    for slot in np.flatnonzero(command.release):
      self.state = sync(self._release(self.state, place(np.int32(slot))))
      self.busy.discard(int(slot))
      self.filling.pop(int(slot), None)
    if timed:
      jax.block_until_ready(self.state)
    began = time.perf_counter()
    failures, prefills = self._admit(command)
    prefill_seconds = None
    if timed:
      jax.block_until_ready(self.state)
      prefill_seconds = time.perf_counter() - began
    self.timing = Timing(*self._fill_chunks(int(command.chunks)), None, prefill_seconds)
    if not bool(command.step) or not self.busy:
      return Dispatched(failures, prefills, None, None, time.perf_counter())
    live = self.live_rows()
    began = time.perf_counter()
    self.state, packed = sync(self._step(self.sampler.params, self.state, place(live)))
    if not self.multiprocess:
      packed.copy_to_host_async()  # a device's copy starts once the step is done, not when the host asks
    return Dispatched(failures, prefills, live, packed, began)

  def _admit(self, command: Command) -> tuple[dict[int, str], tuple[int, ...]]:
    """The command's admissions: each request's prefill, inserted into its row (a long prompt's row starts filling
    in chunks); ``({slot: error} of the admissions that failed, each admission's prefill bucket in slots)``."""
    sync, place, buckets = self.processes.sync, self.processes.place, self.admission.buckets
    failures, prefills = {}, []
    for slot in np.flatnonzero(command.bucket >= 0):
      bucket = int(command.bucket[slot])
      prefills.append(buckets[bucket] if bucket < len(buckets) else 0)
      try:
        row = sync(self.prefill(command, int(slot)))
        self.state = sync(self._insert(self.state, row, place(np.int32(slot)), place(command.tables[slot])))
        if bucket == len(buckets):  # A long prompt: its chunks run from now, paced.
          self.filling[int(slot)] = self.admission.chunk_starts(int(np.argmax(command.kinds[slot] == K.TARGET)))
        else:
          self.busy.add(int(slot))
      except Exception as error:  # noqa: BLE001  The request fails alone; the engine keeps serving.
        failures[int(slot)] = f"{type(error).__name__}: {error}"
        self.admission.pool.give_back(int(slot))
    return failures, tuple(prefills)

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
    sync, place = self.processes.sync, self.processes.place
    slot = next(iter(self.filling))
    starts = self.filling[slot]
    self.state = sync(
      self._fill(self.sampler.params, self.state, place(np.int32(slot)), place(np.int32(starts.pop(0))))
    )
    if not starts:  # Whole: the row is armed and steps from this iteration on.
      del self.filling[slot]
      self.state = sync(self._arm(self.state, place(np.int32(slot))))
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

  def follow(self) -> None:
    """A process other than 0: runs process 0's commands until it sends ``stop``."""
    self.processes.follow(self.admission.command(), lambda command: self.run(command, received=True))

  def stop_followers(self) -> None:
    """Process 0: tells the other processes to leave :meth:`follow`."""
    self.processes.stop(self.admission.command())

  def reset(self) -> None:
    """Every row free: the state after start-up (after a failed step, too)."""
    self.state = None
    self.warm_up()

  def _admit_now(self, command: Command, slot: int, row: State | None = None) -> State:
    """Warm-up: inserts the admission of ``slot`` in ``command``, prefilled here unless ``row`` is its prefill
    already (the same request in every slot); returns the prefill."""
    sync, place = self.processes.sync, self.processes.place
    row = sync(self.prefill(command, slot)) if row is None else row
    self.state = sync(self._insert(self.state, row, place(np.int32(slot)), place(command.tables[slot])))
    self.busy.add(slot)
    return row

  def _release_now(self, slot: int) -> None:
    self.state = self.processes.sync(self._release(self.state, self.processes.place(np.int32(slot))))
    self.busy.discard(slot)

  def warm_up(self) -> None:
    """Builds the batch state with every row free and an empty page pool, compiling every program a request can
    reach on the way: each prefill bucket's prefill, insert, release and the step of each batch bucket."""
    admission, sync, place = self.admission, self.processes.sync, self.processes.place
    admission.pool.reset()
    self.busy.clear()
    self.filling.clear()
    command, bos = admission.command(), self.settings.bos_id
    prompt = lambda length: Row.completion((bos,) * length, 1)  # noqa: E731
    for bucket, size in enumerate(admission.buckets):  # A prompt whose first block ends at the bucket's end.
      admission.admit(command, 0, prompt(max(1, size - 2 * self.block)), pages=False)
      assert command.bucket[0] == bucket
      if self.state is None:
        self.state = sync(self._blank(self.prefill(command, 0)))
      self._admit_now(command, 0)
      self._release_now(0)
    if self.prefill_chunk:  # A chunked prefill: its unfilled row, and one chunk.
      admission.admit(command, 0, prompt(self.prefill_chunk), pages=False)
      assert command.bucket[0] == len(admission.buckets)
      self._admit_now(command, 0)
      self.busy.discard(0)
      self.state = sync(self._fill(self.sampler.params, self.state, *map(place, np.zeros(2, np.int32))))
      self.state = sync(self._arm(self.state, place(np.int32(0))))
      self._release_now(0)
    row = None
    for slot in range(self.slots):  # Every row busy (one prefill for all), then the step of each batch bucket.
      admission.admit(command, slot, prompt(1), pages=False)
      row = self._admit_now(command, slot, row)
    for size in self.row_buckets:
      self.state, _ = sync(self._step(self.sampler.params, self.state, place(np.arange(size, dtype=np.int32))))
    for slot in range(self.slots):
      self._release_now(slot)
