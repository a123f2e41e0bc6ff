"""The serving engine's host side: a queue, the requests in the slots, and one thread that drives them.

The device side is :class:`~mercury_jax.serve.slots.SlotEngine` (prefill, insert, step, release over a fixed number
of slots of the block engine). Each iteration of the engine thread frees the rows of finished and cancelled
requests, admits waiting requests into free rows (continuous batching: requests of any length and step budget come
and go between steps), runs one step, reads back what the step changed (each row's block, :class:`View`) and hands
every request its newly final tokens. On a multi-host mesh this thread runs on process 0 only, and every other
process runs the same commands (:meth:`Scheduler.follow`).

The host's work overlaps the device's (as JetStream's and vLLM's asynchronous output processing do): an iteration
dispatches its step, then reads the *previous* step's view while the device computes this one (JAX dispatches
asynchronously; programs run in the order they were dispatched, each on the batch state the one before it gave), and
builds the next command before it waits. So a request that finishes at one step takes one more step before its row
is released (its result is thrown away), and a waiting request is admitted one step later than it could be; no
request's tokens change (a row's steps depend on its own state only). Iterations with chunked prefills, and a
multi-host mesh, run one step at a time (the pacer times each chunk against the step beside it).
:class:`StepStats` says where the engine thread's time goes.

Requests are checked, tokenised and detokenised by the caller (the HTTP layer); the engine thread never waits on a
client: :class:`Handle` delivers :class:`Update` objects to the submitting asyncio loop.

Failures stay with the requests they concern: a request whose admission fails ends alone with ``finish_reason``
"error"; a failed step ends the requests it carried, and the engine starts afresh (every row free) and serves the
rest. The error's details go to the log (logger ``mercury_jax.serve``), tagged with the request's handle id. When the
engine cannot start afresh (or the thread died), :attr:`Scheduler.healthy` turns False, every waiting request ends
with "error" and :meth:`Scheduler.submit` raises :class:`EngineDown`.

Every shared structure (the queue, the active rows, the rows to release) is touched only with the scheduler's lock
held, by the engine thread and by :meth:`Scheduler.shutdown` alike.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import math
import threading
import time
from collections.abc import AsyncIterator
from typing import ClassVar

import jax
import numpy as np

from mercury_jax.limits import MAX_SEED
from mercury_jax.sampling import automata as constrained
from mercury_jax.sampling.proposal import Knobs
from mercury_jax.sampling.sampler import Sampler
from mercury_jax.sampling.settings import SettingError
from mercury_jax.serve.pacing import DEFAULT_SHARE, PrefillPacer
from mercury_jax.serve.pages import NoPages
from mercury_jax.serve.slots import DEFAULT_CAPACITY, DEFAULT_PAGE_SIZE, Dispatched, Request, SlotEngine, View

__all__ = [
  "EngineDown",
  "Handle",
  "Knobs",
  "QueueFull",
  "Request",
  "Scheduler",
  "ShuttingDown",
  "StepStats",
  "Update",
  "lowerings",
]
logger = logging.getLogger("mercury_jax.serve")
MAX_STREAM = 2**31 - 1  # fold_in's data.
MAX_HEALED = 256  # Characters token healing may re-generate: one token's text.
IDLE_TICK = 1.0  # Seconds between the no-op commands an idle multi-host leader sends, so followers never time out.
# One iteration in this many steps runs timed (``SlotEngine.dispatch(timed=True)``, not overlapped): its prefills and
# its step alone on the device, as loaded right now, which prices the device's share of the engine's time in place.
TIMED_EVERY = 32

_LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"


class _Lowerings:
  """Counts JAX lowerings (every jit cache miss that compiles) through ``jax.monitoring``, from its first use."""

  def __init__(self):
    self.count, self._lock, self._listening = 0, threading.Lock(), False

  def _event(self, event: str, *_args, **_kwargs) -> None:
    if event == _LOWERING_EVENT:
      with self._lock:
        self.count += 1

  def __call__(self) -> int:
    with self._lock:
      if not self._listening:
        jax.monitoring.register_event_duration_secs_listener(self._event)
        self._listening = True
      return self.count


lowerings = _Lowerings()


@dataclasses.dataclass(frozen=True)
class Update:
  """What a request has new after a step.

  Attributes:
    tokens: The token ids that became final since the previous update (EOS and padding removed); the request's text
      is the concatenation of every update's ``tokens``.
    draft: With ``diffusing``: the whole completion now, final tokens plus the last step's proposals in the open
      block, later positions as the mask id; None otherwise.
    done: The request's last update.
    finish_reason: When done: ``stop`` (EOS), ``length`` (the hole is full), ``cancelled`` or ``error``.
    nfe: Forward passes the request has needed so far (its prefill included).
    error: The message when ``finish_reason`` is ``error`` (for the log, not for clients).
    time: ``time.perf_counter()`` when the engine produced it.
  """

  tokens: tuple[int, ...]
  draft: tuple[int, ...] | None
  done: bool
  finish_reason: str | None
  nfe: int
  error: str | None = None
  time: float = 0.0


class ShuttingDown(RuntimeError):
  """The server is draining and takes no new request."""


class EngineDown(RuntimeError):
  """The engine failed and could not start afresh: the server takes no new request."""


class QueueFull(Exception):
  """Every slot is busy (or the key-value cache's free pages are spoken for) and ``max_queue`` requests wait beyond
  those the free rows and pages are about to take; try again after ``retry_after`` seconds."""

  def __init__(self, waiting: int, retry_after: float):
    super().__init__(f"the server is at capacity ({waiting} requests are waiting); retry after {retry_after:.0f} s")
    self.retry_after = retry_after


class Handle:
  """A submitted request: its updates arrive on the asyncio loop that submitted it."""

  def __init__(self, request_id: int, request: Request, loop: asyncio.AbstractEventLoop, scheduler: Scheduler):
    self.id, self.request, self.loop, self._scheduler = request_id, request, loop, scheduler
    self.submitted = time.perf_counter()
    self._queue: asyncio.Queue[Update] = asyncio.Queue()
    self.cancelled = False

  def _deliver(self, update: Update) -> None:  # Called on the engine thread.
    _post(self.loop, [(self, update)])

  async def updates(self) -> AsyncIterator[Update]:
    """Yields updates until the one with ``done``."""
    while True:
      update = await self._queue.get()
      yield update
      if update.done:
        return

  def cancel(self) -> None:
    """Gives the request up (thread-safe); its slot is freed before the next step."""
    self.cancelled = True
    self._scheduler._wake()


def _post(loop: asyncio.AbstractEventLoop, items: list[tuple[Handle, Update]]) -> None:
  """Hands ``items`` to their handles on ``loop``, with one wake-up of the loop (called on the engine thread)."""
  try:
    loop.call_soon_threadsafe(_receive, items)
  except RuntimeError:  # The loop is closed: nobody is listening any more.
    for handle, _ in items:
      handle.cancelled = True


def _receive(items: list[tuple[Handle, Update]]) -> None:
  for handle, update in items:
    handle._queue.put_nowait(update)


@dataclasses.dataclass
class _Active:
  handle: Handle
  start: int  # first slot of the hole
  end: int  # one past its last slot
  upto: int  # slots before this one are delivered (final)
  tokens: list[int] = dataclasses.field(default_factory=list)  # the final tokens so far
  stopped: bool = False  # an EOS ended the hole


@dataclasses.dataclass
class StepStats:
  """Where the engine thread's time goes, summed over its iterations (read by ``/metrics``).

  Every second of an iteration that runs a step falls in exactly one phase, so the phases add up to the engine's
  time per step. With the step overlapped (``Scheduler(overlap=True)``), ``wait`` is the part of the device's work
  that the host's phases did not cover.

  Attributes:
    iterations: Engine iterations that ran a step.
    admit: Seconds building commands: releases, admissions and their pages (host).
    dispatch: Seconds dispatching releases, prefills and the step (host: JAX's dispatch, the admissions' arrays),
      and running chunks of chunked prefills (waited for: ``chunk_seconds``).
    wait: Seconds waiting for a step's view (the device's work the host did not overlap, and the copy).
    report: Seconds reading views: each request's new tokens, drafts and end (host).
    post: Seconds handing the updates to the event loops (host).
    chunks: Chunks of chunked prefills run.
    chunk_seconds: Their seconds (a part of ``dispatch``).
    steps: Steps run, by batch bucket (rows).
    prefills: Prefills run, by prefill bucket (slots; 0: a chunked prefill's row).
    timed_steps, timed_step_seconds: Steps of the timed iterations (one in :data:`TIMED_EVERY`) by batch bucket, and
      their seconds alone on the device (the copy of their view included).
    timed_prefills, timed_prefill_seconds: The timed iterations' prefills and their seconds alone on the device.
  """

  iterations: int = 0
  admit: float = 0.0
  dispatch: float = 0.0
  wait: float = 0.0
  report: float = 0.0
  post: float = 0.0
  chunks: int = 0
  chunk_seconds: float = 0.0
  steps: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  prefills: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  timed_steps: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  timed_step_seconds: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  timed_prefills: int = 0
  timed_prefill_seconds: float = 0.0

  PHASES: ClassVar[tuple[str, ...]] = ("admit", "dispatch", "wait", "report", "post")

  @property
  def engine_seconds(self) -> float:
    """Seconds in the engine: dispatches and waiting for the device."""
    return self.dispatch + self.wait

  @property
  def host_seconds(self) -> float:
    """Seconds of host work around the engine: commands, admissions, reading views, handing out updates."""
    return self.admit + self.report + self.post


@dataclasses.dataclass
class _Step:
  """A dispatched step and the requests it carried (slot -> their :class:`_Active`), read when it is collected."""

  dispatched: Dispatched
  rows: dict[int, _Active]


class Scheduler:
  """The queue and the engine thread for one model.

  Args:
    sampler: The model, tokenizer and mesh (:meth:`Sampler.from_checkpoint`).
    slots: Requests refined at once (the batch of every step).
    max_queue: Requests that may wait while every slot is busy (or the free pages are spoken for); beyond it
      :meth:`submit` raises :class:`QueueFull`. Requests that free rows and pages are about to take do not count: an
      idle server takes ``slots + max_queue`` short requests at once.
    block_length: The block of a whole-sequence checkpoint (decoded without a cache, through the same engine);
      block-diffusion checkpoints use their trained block and the twin blocks of one token.
    decode: How every request decodes (``auto``: the model's best; see ``sampling.plan.plan_for``).
    draft_length: Verified decoding's draft length (0: the checkpoint's).
    default_steps: Steps per block when a request gives none; default the block (one token per step).
    capacity: The automaton sizes each slot holds for structured output (``slots.DEFAULT_CAPACITY``); None turns
      structured output off.
    page_size: Slots of a page of the paged key-value cache.
    kv_pages: Pages of the cache's pool (the sink included); default: every slot can hold a whole context. With
      fewer, a request waits in the queue until running requests give back the pages it needs.
    batch_invariant: Each request's tokens are the same whatever runs beside it (``SlotEngine``); False batches the
      rows through the network (faster under load, tokens equal only up to rounding).
    invariant_tile: Positions per matmul tile of a batch-invariant step (``SlotEngine``; 0: the plan's).
    max_model_len: The longest request (prompt, ``max_tokens`` and suffix) served; default the model's context.
    prefill_chunk: Prompt tokens a chunk of a chunked prefill holds (``SlotEngine``): a longer prompt is prefilled
      in chunks between the other requests' steps, and the one-pass prefills admitted in one iteration stay within
      it (one is always admitted); 0: no limit, every prompt in one pass.
    prefill_share: The engine's time the chunks may take while other requests decode (``serve.pacing``): the
      decoding streams keep the rest.
    solver: A continuous checkpoint's ODE solver (``SamplerSettings.solver``); None: the default (Euler).
    guidance: Its classifier-free guidance scale (``SamplerSettings.guidance``); None: the default (1, off).
    overlap: Read a step's view while the next step runs (module docstring); False: one step at a time.
  """

  def __init__(
    self,
    sampler: Sampler,
    *,
    slots: int = 16,
    max_queue: int = 256,
    block_length: int = 0,
    decode: str = "auto",
    draft_length: int = 0,
    default_steps: int | None = None,
    capacity: constrained.Capacity | None = DEFAULT_CAPACITY,
    page_size: int = DEFAULT_PAGE_SIZE,
    kv_pages: int | None = None,
    batch_invariant: bool = True,
    invariant_tile: int = 0,
    max_model_len: int | None = None,
    prefill_chunk: int = 0,
    prefill_share: float = DEFAULT_SHARE,
    solver: str | None = None,
    guidance: float | None = None,
    overlap: bool = True,
  ):
    if max_queue < 0:
      raise ValueError(f"max_queue={max_queue} must be >= 0")
    self.pacer = PrefillPacer(prefill_share)  # chunks per iteration (the engine thread's)
    lowerings()  # Count from before the first compilation.
    self.engine = SlotEngine(
      sampler,
      slots=slots,
      block_length=block_length,
      decode=decode,
      draft_length=draft_length,
      default_steps=default_steps,
      capacity=capacity,
      page_size=page_size,
      kv_pages=kv_pages,
      batch_invariant=batch_invariant,
      invariant_tile=invariant_tile,
      max_model_len=max_model_len,
      prefill_chunk=prefill_chunk,
      solver=solver,
      guidance=guidance,
    )
    self.decode = self.engine.plan.decode  # ar, diffusion or verified
    self.compiler = self.engine.compiler  # structured output: regex / JSON Schema -> automaton (None: off)
    self.sampler, self.tokenizer, self.cfg = sampler, sampler.tokenizer, sampler.cfg
    self.autoregressive, self.block, self.slots = self.engine.autoregressive, self.engine.block, slots
    self.width, self.draft = self.engine.width, self.engine.plan.draft  # tokens a step commits at most; verified k
    self.block_length_fixed = not self.engine.whole_sequence
    self.max_length, self.max_queue = self.engine.max_model_len, max_queue
    self.vocab_size = self.cfg.model.vocab_size
    settings = self.engine.settings
    self.mask_id, self.eos_id, self.pad_id = settings.mask_id, settings.eos_id, settings.pad_id
    self.default_steps, self.default_knobs = self.engine.default_steps, self.engine.default_knobs
    self.leader = jax.process_index() == 0
    self.stats = StepStats()
    self._lock = threading.Condition()
    self._waiting: collections.deque[Handle] = collections.deque()
    self._active: dict[int, _Active] = {}
    self._released: set[int] = set()  # rows of requests that ended, given up at the next iteration
    self._admitting = 0  # requests taken from the queue by the running iteration, not yet in ``_active``
    self._ids = itertools.count()
    self._stopping = False
    self._failure: str | None = None  # why the engine cannot go on
    self._thread: threading.Thread | None = None
    self._pending: _Step | None = None  # the step dispatched last, collected by the next iteration (overlap)
    self._untimed = 0  # steps since the last timed iteration
    self.overlap = overlap and not self.engine.multiprocess
    self.engine.warm_up()

  @property
  def compilations(self) -> int:
    """JAX programs lowered in this process (constant after start-up: no request compiles)."""
    return lowerings()

  @property
  def queue_depth(self) -> int:
    return len(self._waiting)

  @property
  def busy_slots(self) -> int:
    """Slots holding a request, those being admitted by the running iteration included."""
    return len(self._active) + self._admitting

  @property
  def kv_pages(self) -> int:
    """Pages of the key-value cache a request can hold (the sink excluded; 0 without a paged cache)."""
    return self.engine.pool.capacity if self.engine.paged else 0

  @property
  def free_pages(self) -> int:
    """Pages of the key-value cache no request holds (0 without a paged cache)."""
    with self._lock:
      return len(self.engine.pool.free) if self.engine.paged else 0

  @property
  def healthy(self) -> bool:
    """The engine thread runs (or has not been started) and has not given up."""
    started = self._thread is not None
    return self._failure is None and (not started or self._thread.is_alive() or self._stopping)

  def check(self, request: Request) -> None:
    """Raises :class:`SettingError` for a knob out of range or a request that does not fit the context.

    Every number that reaches the engine's int32 and float32 arrays is bounded here: a request :meth:`submit` takes
    can always be admitted.
    """
    knobs = request.knobs or self.default_knobs
    for name, value in zip(Knobs._fields, knobs, strict=True):
      if not isinstance(value, int | float) or not math.isfinite(value):
        raise SettingError(name, value, "must be a finite number")
    if not 0 <= knobs.top_k <= self.vocab_size:
      raise SettingError("top_k", knobs.top_k, f"must lie in [0, {self.vocab_size}] (the vocabulary; 0 keeps all)")
    values = dict(zip(Knobs._fields, knobs, strict=True))
    dataclasses.replace(self.engine.settings, **values).validate()  # The sampler's own checks of these knobs.
    per_block = request.steps_per_block
    if per_block is not None and not 1 <= per_block <= self.max_length:
      raise SettingError("steps_per_block", per_block, f"must lie in [1, {self.max_length}]")
    if not 0 <= request.extra_steps <= self.max_length:
      raise SettingError("extra_steps", request.extra_steps, f"must lie in [0, {self.max_length}]")
    if not 0 <= request.seed <= MAX_SEED:
      raise SettingError("seed", request.seed, f"must lie in [0, {MAX_SEED}]")
    if not 0 <= request.stream <= MAX_STREAM:
      raise SettingError("stream", request.stream, f"must lie in [0, {MAX_STREAM}]")
    if request.max_tokens < 1:
      raise SettingError("max_tokens", request.max_tokens, "must be >= 1")
    used = len(request.prompt) + request.max_tokens + len(request.suffix)
    if used > self.max_length:
      what = f"prompt has {len(request.prompt)} tokens"
      if request.suffix:
        what += f", suffix {len(request.suffix)}"
      raise SettingError(
        "max_tokens",
        request.max_tokens,
        f"does not fit: the {what}, together {used} positions, but the model's context is {self.max_length} tokens",
      )
    pages, capacity = self.engine.pages_needed(request), self.engine.pool.capacity
    if pages > capacity:
      raise SettingError(
        "max_tokens",
        request.max_tokens,
        f"does not fit the key-value cache: {used} positions take {pages} pages of {self.engine.page_size} slots, "
        f"the pool has {capacity} (start the server with a larger --kv-pages)",
      )
    vocab = self.vocab_size
    if any(not 0 <= t < vocab for t in (*request.prompt, *request.suffix)):
      raise ValueError(f"token ids must lie in [0, {vocab})")
    if self.autoregressive and not request.prompt:
      raise ValueError("the autoregressive model needs a prompt of at least one token (e.g. BOS)")
    if request.heal and (request.constraint is not None or len(request.heal) > MAX_HEALED):
      raise ValueError(f"token healing re-generates one token (at most {MAX_HEALED} characters), without a constraint")
    if request.constraint is not None:
      if self.engine.capacity is None:
        raise ValueError("structured output is off on this server (started without a constraint capacity)")
      problem = constrained.fits(request.constraint, self.engine.capacity)
      if problem:
        raise ValueError(f"{problem}; start the server with a larger --constraint-capacity")

  def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> Handle:
    """Queues a request (thread-safe) and returns its handle.

    Raises:
      SettingError, ValueError: See :meth:`check`.
      QueueFull: ``max_queue`` requests would wait beyond those the free rows and pages can take now.
      ShuttingDown: The scheduler is draining.
      EngineDown: The engine failed and could not start afresh.
    """
    self.check(request)
    with self._lock:
      if not self.healthy:
        raise EngineDown("the engine failed and cannot serve; the server needs a restart")
      if self._stopping:
        raise ShuttingDown("the server is shutting down and takes no new request")
      handle = Handle(next(self._ids), request, loop, self)
      waiting = len(self._waiting) + 1 - self._room(handle)  # with this one: those no free row and pages take now
      if waiting > self.max_queue:
        raise QueueFull(waiting - 1, retry_after=1.0)
      self._waiting.append(handle)
      self._lock.notify()
    return handle

  def _room(self, new: Handle) -> int:
    """How many of the waiting requests, then ``new``, the free rows and the free pages of the key-value cache can
    take now, from the head of the queue (the lock held; the rows and pages of requests that ended count as free:
    the next iteration gives them back before it admits)."""
    free, pool = self.slots - len(self._active) - self._admitting, self.engine.pool
    pages = (
      len(pool.free) + sum(len(pool.held.get(slot, ())) for slot in self._released) if self.engine.paged else math.inf
    )
    room = 0
    for handle in itertools.chain(self._waiting, (new,)):
      needed = self.engine.pages_needed(handle.request)
      if room == free or needed > pages:
        break
      pages -= needed
      room += 1
    return room

  def start(self) -> None:
    """Starts the engine thread (process 0 of a multi-host mesh; the others call :meth:`follow`)."""
    self._thread = threading.Thread(target=self._run, name="mercury-engine", daemon=True)
    self._thread.start()

  def shutdown(self, grace: float = 0.0) -> None:
    """Stops taking requests, lets running ones finish for up to ``grace`` seconds, cancels the rest, and joins."""
    with self._lock:
      self._stopping = True
      self._lock.notify()
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and self._alive():
      with self._lock:
        if not (self._active or self._waiting):
          break
      time.sleep(0.01)
    with self._lock:
      for handle in [*self._waiting, *(a.handle for a in self._active.values())]:
        handle.cancelled = True
      self._lock.notify()
    if self._thread is not None:
      self._thread.join(timeout=max(grace, 5.0))
    self.engine.stop_followers()

  def follow(self) -> None:
    """Every process but 0 of a multi-host mesh: runs process 0's engine commands until it shuts down."""
    self.engine.follow()

  def _alive(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  def _wake(self) -> None:
    with self._lock:
      self._lock.notify()

  # ------------------------------------------------------------------------------------------- the thread

  def _run(self) -> None:
    try:
      while True:
        with self._lock:
          while not (self._active or self._waiting or self._released or self._stopping or self._pending):
            if not self._lock.wait(timeout=IDLE_TICK) and self.engine.multiprocess:
              self.engine.run(self.engine.command())  # Keeps the followers' collectives alive.
          if self._stopping and not (self._active or self._waiting or self._released or self._pending):
            return
        try:
          self._iterate()
        except Exception:  # noqa: BLE001  Whatever failed, the requests it carried end and the engine starts afresh.
          logger.exception("the engine iteration failed; its requests end with an error, the engine starts afresh")
          self._fail_active("the engine iteration failed (see the log above)")
          if self.engine.multiprocess:  # The other processes cannot be restarted from here.
            raise
          self.engine.reset()
    except BaseException as error:  # noqa: BLE001  Logged; the thread ends and the server reports it.
      self._failure = f"{type(error).__name__}: {error}"
      logger.critical("the engine cannot go on; the server answers 503 from now on", exc_info=True)
    finally:
      with self._lock:
        waiting = list(self._waiting)
        self._waiting.clear()
        if self._failure is None and self._active:
          self._failure = "the engine thread ended with requests in its slots"
      now = time.perf_counter()
      for handle in waiting:  # Nothing may hang on a thread that is gone.
        handle._deliver(Update((), None, True, "cancelled" if self._failure is None else "error", 0, time=now))
      if self._failure is not None:
        self._fail_active(self._failure)

  def _fail_active(self, message: str) -> None:
    """Ends every request in a slot with "error" (after a failed step, or when the engine stops)."""
    with self._lock:
      active = list(self._active.values())
      self._active.clear()
      self._released.clear()
      self._pending = None
      self._admitting = 0
    now = time.perf_counter()
    for a in active:
      a.handle._deliver(Update((), None, True, "error", 0, error=message, time=now))

  def _admit(self, command) -> dict[int, Handle]:
    """Releases the rows of ended and cancelled requests and admits waiting ones into free rows (into ``command``).

    A request whose admission fails ends alone, with "error".
    """
    engine, admitted = self.engine, {}
    now = time.perf_counter()
    with self._lock:
      for slot in self._released:
        engine.give_back(command, slot)
      self._released.clear()
      for slot, active in list(self._active.items()):
        if active.handle.cancelled:
          engine.give_back(command, slot)
          del self._active[slot]
          active.handle._deliver(Update((), None, True, "cancelled", 0, time=now))
      free = [slot for slot in range(self.slots) if slot not in self._active]
      budget = engine.prefill_chunk or math.inf  # prompt slots the one-pass prefills of this iteration may cover
      while free and self._waiting:
        handle = self._waiting.popleft()
        if handle.cancelled:
          handle._deliver(Update((), None, True, "cancelled", 0, time=now))
          continue
        cost = min(engine.prefill_end(len(handle.request.prompt)), engine.prefill_chunk or math.inf)
        if admitted and cost > budget:  # The iteration's prompt work is spent: it waits for the next one.
          self._waiting.appendleft(handle)
          break
        budget -= cost
        try:
          engine.admit(command, free[0], handle.request)
        except NoPages:  # It waits at the head of the queue until running requests give pages back.
          self._waiting.appendleft(handle)
          break
        except Exception as error:  # noqa: BLE001  This request fails alone.
          logger.exception("request %d: admission failed", handle.id)
          command.bucket[free[0]] = -1
          command.constraint[free[0]] = 0
          handle._deliver(Update((), None, True, "error", 0, error=f"{type(error).__name__}: {error}", time=now))
          continue
        admitted[free.pop(0)] = handle
      self._admitting = len(admitted)
    return admitted

  def _iterate(self) -> None:
    """One engine iteration: releases and admissions, the step dispatched, and the news of the step before it (or,
    one step at a time, of this one)."""
    stats, began = self.stats, time.perf_counter()
    engine, command = self.engine, self.engine.command()
    admitted = self._admit(command)
    chunked = any(engine.bucket(handle.request) == len(engine.buckets) for handle in admitted.values())
    one_pass = len(admitted) > sum(engine.bucket(h.request) == len(engine.buckets) for h in admitted.values())
    chunks = self.pacer.chunks(decoding=bool(engine.busy) or one_pass)
    command = command._replace(step=np.asarray(bool(self._active or admitted)), chunks=np.asarray(chunks, np.int32))
    timed = self._untimed >= TIMED_EVERY
    overlap = self.overlap and not (engine.filling or chunked or timed)
    admitted_at = time.perf_counter()
    stats.admit += admitted_at - began
    if not overlap and self._pending is not None and not self._collect(self._pending):
      return  # One step at a time from here: the last one's news first (it failed: the engine started afresh).
    try:
      dispatched = engine.dispatch(command, timed=timed)
    except Exception as error:  # noqa: BLE001  A failed step fails the requests it carried, then starts afresh.
      self._failed(error, admitted)
      return
    dispatched_at = time.perf_counter()
    stats.dispatch += dispatched_at - admitted_at
    stats.prefills.update(dispatched.prefills)
    timing = engine.timing
    if timing.chunks:
      stats.chunks += timing.chunks
      stats.chunk_seconds += timing.chunk_seconds
    with self._lock:
      self._admitting = 0
      for slot, handle in admitted.items():
        if slot in dispatched.failures:
          logger.error("request %d: prefill failed: %s", handle.id, dispatched.failures[slot])
          handle._deliver(Update((), None, True, "error", 0, error=dispatched.failures[slot], time=dispatched_at))
          continue
        start = self.block + len(handle.request.prompt)
        self._active[slot] = _Active(handle, start, start + handle.request.max_tokens, upto=start)
      step = None
      if dispatched.packed is not None:
        rows = {slot: self._active[slot] for slot in engine.busy if slot in self._active}
        step = _Step(dispatched, rows)
        stats.iterations += 1
        stats.steps[len(dispatched.live)] += 1
        self._untimed += 1
      previous, self._pending = (self._pending, step) if overlap else (None, None)
    if previous is not None and not self._collect(previous):  # Read while the device runs this iteration's step.
      return
    if not overlap:
      if step is not None and not self._collect(step):
        return
      if timed and step is not None:
        self._untimed = 0
        stats.timed_steps[len(dispatched.live)] += 1
        stats.timed_step_seconds[len(dispatched.live)] += engine.timing.step_seconds
        if dispatched.prefills and not dispatched.failures:
          stats.timed_prefills += len(dispatched.prefills)
          stats.timed_prefill_seconds += timing.prefill_seconds
      if timing.chunks or engine.filling:
        self.pacer.record(timing.chunks, timing.chunk_seconds, engine.timing.step_seconds if step else None)
      else:
        self.pacer.idle()
    else:
      self.pacer.idle()

  def _failed(self, error: Exception, admitted: dict[int, Handle]) -> None:
    """A failed dispatch or step: the requests it carried (and the admissions of its iteration) end with an error,
    and the engine starts afresh (not on a multi-host mesh: that thread stops)."""
    logger.exception("the engine step failed; the requests in its slots end with an error")
    message = f"{type(error).__name__}: {error}"
    now = time.perf_counter()
    for handle in admitted.values():
      handle._deliver(Update((), None, True, "error", 0, error=message, time=now))
    self._fail_active(message)
    if self.engine.multiprocess:  # The other processes cannot be restarted from here: stop serving.
      raise error
    self.engine.reset()

  def _collect(self, step: _Step) -> bool:
    """Waits for a dispatched step's view and hands its requests their news (those still in their rows); False when
    the step failed (its requests ended with an error and the engine started afresh)."""
    if self._pending is step:
      self._pending = None
    stats, began = self.stats, time.perf_counter()
    try:
      view = self.engine.collect(step.dispatched)
    except Exception as error:  # noqa: BLE001  The device failed on the step.
      self._failed(error, {})
      return False
    stepped = time.perf_counter()
    stats.wait += stepped - began
    news: list[tuple[Handle, Update]] = []  # handed out together: one wake-up of each loop per step
    with self._lock:
      for slot, active in step.rows.items():
        if self._active.get(slot) is not active:  # It ended (or was cancelled) since: its row's news is stale.
          continue
        try:
          news += self._report(slot, active, view, stepped)
        except Exception as error:  # noqa: BLE001  Reading one request's news failed: that request ends alone.
          logger.exception("request %d: reading its step failed", active.handle.id)
          news += self._finish(slot, Update((), None, True, "error", 0, error=f"{type(error).__name__}: {error}"))
    reported = time.perf_counter()
    stats.report += reported - stepped
    by_loop = collections.defaultdict(list)
    for handle, update in news:
      by_loop[handle.loop].append((handle, update))
    for loop, items in by_loop.items():
      _post(loop, items)
    stats.post += time.perf_counter() - reported
    return True

  def _finish(self, slot: int, update: Update) -> list[tuple[Handle, Update]]:
    """Ends a request (the lock held): its last update, to hand out; its row is released at the next iteration."""
    self._released.add(slot)
    return [(self._active.pop(slot).handle, update)]

  def _report(self, slot: int, active: _Active, view: View, now: float) -> list[tuple[Handle, Update]]:
    """A request's news after a step (the lock held), to hand out: newly final tokens, its draft, or its end."""
    worked, starts = int(view.worked[slot]), int(view.starts[slot])
    done = not bool(view.unfinished[slot])
    final = []  # (first slot, tokens) of the blocks that became final
    if done or starts > worked:
      final.append((worked, view.block[slot]))
    if done and starts > worked:  # Tokens a constraint forced into the next block, which filled the hole.
      final.append((starts, view.upcoming[slot]))
    new = []
    for first, tokens in final:  # An unfinished verified row's worked tokens are final up to its next slot only.
      new += self._take(slot, active, first, tokens, None if done else starts)
    nfe = int(view.nfe[slot])
    if done:
      stopped = active.stopped
      constraint = active.handle.request.constraint
      if constraint is not None:  # Complete structured text stops; a valid but unfinished prefix ran out of room.
        stopped = constraint.accepts(active.tokens + [self.eos_id] * stopped)
      return self._finish(slot, Update(tuple(new), None, True, "stop" if stopped else "length", nfe, time=now))
    draft = None
    if active.handle.request.diffusing:  # The final tokens, the open block's proposals, then masks.
      first, tokens = (starts, view.upcoming[slot]) if starts > worked else (worked, view.block[slot])
      low, high = max(first, active.upto), min(first + self.width, active.end)
      piece = tokens[low - first : high - first]
      if starts == worked or self.draft:  # verified: the drafts the next step verifies, from ``starts``
        piece = np.where(piece == self.mask_id, view.proposal[slot, low - first : high - first], piece)
      draft = active.tokens + piece.tolist()
      draft = tuple(draft + [self.mask_id] * (active.end - active.start - len(draft)))
    if new or draft is not None:
      return [(active.handle, Update(tuple(new), draft, False, None, nfe, time=now))]
    return []

  def _take(self, slot: int, active: _Active, first: int, tokens: np.ndarray, limit: int | None) -> list[int]:
    """The request's tokens in the final block of ``tokens`` at slot ``first`` (before slot ``limit`` when given),
    up to its first EOS (recorded)."""
    if active.stopped:
      return []
    low, high = max(first, active.upto), min(first + self.width, active.end, limit or active.end)
    if low > active.upto:
      raise RuntimeError(f"row {slot} skipped slots {active.upto}..{low}: its blocks were not all reported")
    if high <= low:
      return []
    piece = tokens[low - first : high - first]
    eos = np.flatnonzero(piece == self.eos_id)
    if eos.size:
      piece, active.stopped = piece[: eos[0]], True
    new = [t for t in piece.tolist() if t != self.pad_id and t != self.mask_id]
    active.tokens.extend(new)
    active.upto = high
    return new
