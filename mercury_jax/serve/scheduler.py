"""The serving engine's host side: a queue, the requests in the slots, and one thread that drives them.

The device side is :class:`~mercury_jax.serve.slots.SlotEngine` (prefill, insert, step, release over a fixed number
of slots of the block engine). Each iteration of the engine thread frees the rows of finished and cancelled
requests, admits waiting requests into free rows (continuous batching: requests of any length and step budget come
and go between steps), runs one step, reads back what the step changed (each row's block, :class:`View`) and hands
every request its newly final tokens. On a multi-host mesh this thread runs on process 0 only, and every other
process runs the same commands (:meth:`Scheduler.follow`).

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

import jax
import numpy as np

from mercury_jax.limits import MAX_SEED
from mercury_jax.sampling import automata as constrained
from mercury_jax.sampling.drafts import DEVICE_DEFAULT, Drafting
from mercury_jax.sampling.proposal import Knobs
from mercury_jax.sampling.sampler import Sampler
from mercury_jax.sampling.settings import SettingError
from mercury_jax.serve.pacing import DEFAULT_SHARE, PrefillPacer
from mercury_jax.serve.pages import NoPages
from mercury_jax.serve.slots import DEFAULT_CAPACITY, DEFAULT_PAGE_SIZE, Request, SlotEngine, View

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
  """Every slot is busy and ``max_queue`` requests wait; try again after ``retry_after`` seconds."""

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

  Attributes:
    iterations: Engine iterations that ran a step.
    engine_seconds: Seconds in :meth:`SlotEngine.run`: releases, prefills, the step and the copy of its view (the
      dispatches and the device work).
    host_seconds: The rest of those iterations: commands, admissions, reading the view, handing out updates.
    chunks: Chunks of chunked prefills run.
    chunk_seconds: Their seconds (a part of ``engine_seconds`` where a step ran beside them).
  """

  iterations: int = 0
  engine_seconds: float = 0.0
  host_seconds: float = 0.0
  chunks: int = 0
  chunk_seconds: float = 0.0


class Scheduler:
  """The queue and the engine thread for one model.

  Args:
    sampler: The model, tokenizer and mesh (:meth:`Sampler.from_checkpoint`).
    slots: Requests refined at once (the batch of every step).
    max_queue: Requests that may wait for a slot; beyond it :meth:`submit` raises :class:`QueueFull`.
    block_length: The block of a whole-sequence checkpoint (decoded without a cache, through the same engine);
      block-diffusion checkpoints use their trained block and the twin blocks of one token.
    decode: How every request decodes (``auto``: the model's best; see ``sampling.plan.plan_for``).
    draft_length: Verified decoding's draft length (0: the checkpoint's).
    drafting: Verified decoding's draft tree, lookup chain and pre-draft blocks (``SlotEngine``).
    draft_confidence: Verified decoding's adaptive draft length (``SamplerSettings.draft_confidence``).
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
    prefill_share: float = DEFAULT_SHARE,
    solver: str | None = None,
    guidance: float | None = None,
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
      drafting=drafting,
      draft_confidence=draft_confidence,
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
    self._ids = itertools.count()
    self._stopping = False
    self._failure: str | None = None  # why the engine cannot go on
    self._thread: threading.Thread | None = None
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
    return len(self._active)

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
      QueueFull: ``max_queue`` requests are already waiting.
      ShuttingDown: The scheduler is draining.
      EngineDown: The engine failed and could not start afresh.
    """
    self.check(request)
    with self._lock:
      if not self.healthy:
        raise EngineDown("the engine failed and cannot serve; the server needs a restart")
      if self._stopping:
        raise ShuttingDown("the server is shutting down and takes no new request")
      if len(self._waiting) >= self.max_queue:
        raise QueueFull(len(self._waiting), retry_after=1.0)
      handle = Handle(next(self._ids), request, loop, self)
      self._waiting.append(handle)
      self._lock.notify()
    return handle

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
          while not (self._active or self._waiting or self._released or self._stopping):
            if not self._lock.wait(timeout=IDLE_TICK) and self.engine.multiprocess:
              self.engine.run(self.engine.command())  # Keeps the followers' collectives alive.
          if self._stopping and not (self._active or self._waiting or self._released):
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
    return admitted

  def _iterate(self) -> None:
    """One engine iteration: releases, admissions, a step, and the news it brings."""
    began = time.perf_counter()
    engine, command = self.engine, self.engine.command()
    admitted = self._admit(command)
    one_pass = any(engine.bucket(handle.request) < len(engine.buckets) for handle in admitted.values())
    chunks = self.pacer.chunks(decoding=bool(engine.busy) or one_pass)
    command = command._replace(step=np.asarray(bool(self._active or admitted)), chunks=np.asarray(chunks, np.int32))
    ran = time.perf_counter()
    try:
      view, failures = engine.run(command)
    except Exception as error:  # noqa: BLE001  A failed step fails the requests it carried, then starts afresh.
      logger.exception("the engine step failed; the requests in its slots end with an error")
      message = f"{type(error).__name__}: {error}"
      now = time.perf_counter()
      for handle in admitted.values():
        handle._deliver(Update((), None, True, "error", 0, error=message, time=now))
      self._fail_active(message)
      if engine.multiprocess:  # The other processes cannot be restarted from here: stop serving.
        raise
      engine.reset()
      return
    stepped = time.perf_counter()
    timing = engine.timing
    if timing.chunks or engine.filling:
      self.pacer.record(timing.chunks, timing.chunk_seconds, timing.step_seconds)
    else:
      self.pacer.idle()
    if timing.chunks:
      self.stats.chunks += timing.chunks
      self.stats.chunk_seconds += timing.chunk_seconds
    with self._lock:
      for slot, handle in admitted.items():
        if slot in failures:
          logger.error("request %d: prefill failed: %s", handle.id, failures[slot])
          handle._deliver(Update((), None, True, "error", 0, error=failures[slot], time=stepped))
          continue
        start = self.block + len(handle.request.prompt)
        self._active[slot] = _Active(handle, start, start + handle.request.max_tokens, upto=start)
      news: list[tuple[Handle, Update]] = []  # handed out together: one wake-up of each loop per step
      if view is not None:
        for slot, active in list(self._active.items()):
          if slot in engine.filling:  # Its prompt is still being prefilled: it has not stepped yet.
            continue
          try:
            news += self._report(slot, active, view, stepped)
          except Exception as error:  # noqa: BLE001  Reading one request's news failed: that request ends alone.
            logger.exception("request %d: reading its step failed", active.handle.id)
            news += self._finish(slot, Update((), None, True, "error", 0, error=f"{type(error).__name__}: {error}"))
    by_loop = collections.defaultdict(list)
    for handle, update in news:
      by_loop[handle.loop].append((handle, update))
    for loop, items in by_loop.items():
      _post(loop, items)
    if view is not None:
      stats = self.stats
      stats.iterations += 1
      stats.engine_seconds += stepped - ran
      stats.host_seconds += (ran - began) + (time.perf_counter() - stepped)

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
