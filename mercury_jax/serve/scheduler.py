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

import numpy as np

from mercury_jax.limits import MAX_SEED
from mercury_jax.sampling import automata as constrained
from mercury_jax.sampling.programs import compilations
from mercury_jax.sampling.proposal import Knobs
from mercury_jax.sampling.sampler import Sampler
from mercury_jax.sampling.settings import SettingError
from mercury_jax.sampling.text import Row
from mercury_jax.serve.commands import Dispatched
from mercury_jax.serve.config import ServeConfig
from mercury_jax.serve.handles import TIMED_EVERY, EngineDown, Handle, QueueFull, ShuttingDown, StepStats, Update, post
from mercury_jax.serve.news import Active, Reader
from mercury_jax.serve.pacing import PrefillPacer
from mercury_jax.serve.pages import NoPages
from mercury_jax.serve.slots import SlotEngine

__all__ = ["EngineDown", "Handle", "Knobs", "QueueFull", "Row", "Scheduler", "ShuttingDown", "StepStats", "Update"]
logger = logging.getLogger("mercury_jax.serve")
MAX_STREAM = 2**31 - 1  # fold_in's data.
MAX_HEALED = 256  # Characters token healing may re-generate: one token's text.
IDLE_TICK = 1.0  # Seconds between the no-op commands an idle multi-host leader sends, so followers never time out.


@dataclasses.dataclass
class _Step:
  """A dispatched step and the requests it carried (slot -> their :class:`_Active`), read when it is collected."""

  dispatched: Dispatched
  rows: dict[int, Active]


class Scheduler:
  """The queue and the engine thread for one model.

  Args:
    sampler: The model, tokenizer and mesh (:meth:`Sampler.from_checkpoint`).
    config: The engine's and the queue's settings (:class:`~mercury_jax.serve.config.ServeConfig`).
  """

  def __init__(self, sampler: Sampler, config: ServeConfig | None = None):
    config = (config or ServeConfig()).validate()
    self.config, self.pacer = config, PrefillPacer(config.prefill_share)  # chunks per iteration (the engine thread's)
    compilations.lowerings()  # Count from before the first compilation.
    self.engine = engine = SlotEngine(sampler, config)
    self.admission = engine.admission
    self.decode = engine.plan.decode  # ar, diffusion or verified
    self.compiler = engine.compiler  # structured output: regex / JSON Schema -> automaton (None: off)
    self.sampler, self.tokenizer, self.cfg = sampler, sampler.tokenizer, sampler.cfg
    self.autoregressive, self.block, self.slots = engine.autoregressive, engine.block, config.slots
    self.width, self.draft = engine.width, engine.plan.draft  # tokens a step commits at most; verified k
    self.block_length_fixed = not engine.whole_sequence
    self.max_length, self.max_queue = engine.max_model_len, config.max_queue
    self.vocab_size = self.cfg.model.vocab_size
    settings = engine.settings
    self.mask_id, self.eos_id, self.pad_id = settings.mask_id, settings.eos_id, settings.pad_id
    self.default_steps, self.default_knobs = engine.default_steps, engine.default_knobs
    self.reader = Reader(self.width, self.draft, self.mask_id, self.eos_id, self.pad_id)
    self.leader = engine.processes.leader
    self.stats = StepStats()
    self._lock = threading.Condition()
    self._waiting: collections.deque[Handle] = collections.deque()
    self._active: dict[int, Active] = {}
    self._released: set[int] = set()  # rows of requests that ended, given up at the next iteration
    self._admitting = 0  # requests taken from the queue by the running iteration, not yet in ``_active``
    self._ids = itertools.count()
    self._stopping = False
    self._failure: str | None = None  # why the engine cannot go on
    self._thread: threading.Thread | None = None
    self._pending: _Step | None = None  # the step dispatched last, collected by the next iteration (overlap)
    self._untimed = 0  # steps since the last timed iteration
    self.overlap = config.overlap and not engine.multiprocess
    engine.warm_up()

  @property
  def compilations(self) -> int:
    """JAX programs lowered in this process (constant after start-up: no request compiles)."""
    return compilations.lowerings()

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
    return self.admission.pool.capacity if self.admission.paged else 0

  @property
  def free_pages(self) -> int:
    """Pages of the key-value cache no request holds (0 without a paged cache)."""
    with self._lock:
      return len(self.admission.pool.free) if self.admission.paged else 0

  @property
  def healthy(self) -> bool:
    """The engine thread runs (or has not been started) and has not given up."""
    started = self._thread is not None
    return self._failure is None and (not started or self._thread.is_alive() or self._stopping)

  def check(self, request: Row) -> None:
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
    pages, capacity = self.admission.pages_needed(request), self.admission.pool.capacity
    if pages > capacity:
      raise SettingError(
        "max_tokens",
        request.max_tokens,
        f"does not fit the key-value cache: {used} positions take {pages} pages of {self.admission.page_size} slots, "
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

  def submit(self, request: Row, loop: asyncio.AbstractEventLoop, *, diffusing: bool = False) -> Handle:
    """Queues a request (a completion :class:`~mercury_jax.sampling.text.Row`: prompt, one hole, suffix; thread-safe)
    and returns its handle; ``diffusing``: its updates carry the whole draft after every step.

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
      handle = Handle(next(self._ids), request, loop, self._wake, diffusing)
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
    free, pool = self.slots - len(self._active) - self._admitting, self.admission.pool
    held = sum(len(pool.held.get(slot, ())) for slot in self._released)
    pages = len(pool.free) + held if self.admission.paged else math.inf
    room = 0
    for handle in itertools.chain(self._waiting, (new,)):
      needed = self.admission.pages_needed(handle.request)
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
              self.engine.run(self.admission.command())  # Keeps the followers' collectives alive.
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
    engine, admission, admitted = self.engine, self.admission, {}
    now = time.perf_counter()
    with self._lock:
      for slot in self._released:
        admission.give_back(command, slot)
      self._released.clear()
      for slot, active in list(self._active.items()):
        if active.handle.cancelled:
          admission.give_back(command, slot)
          del self._active[slot]
          active.handle._deliver(Update((), None, True, "cancelled", 0, time=now))
      free = [slot for slot in range(self.slots) if slot not in self._active]
      budget = engine.prefill_chunk or math.inf  # prompt slots the one-pass prefills of this iteration may cover
      while free and self._waiting:
        handle = self._waiting.popleft()
        if handle.cancelled:
          handle._deliver(Update((), None, True, "cancelled", 0, time=now))
          continue
        cost = min(admission.prefill_end(len(handle.request.prompt)), engine.prefill_chunk or math.inf)
        if admitted and cost > budget:  # The iteration's prompt work is spent: it waits for the next one.
          self._waiting.appendleft(handle)
          break
        budget -= cost
        try:
          admission.admit(command, free[0], handle.request)
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
    engine, command = self.engine, self.admission.command()
    admitted = self._admit(command)
    long = [self.admission.bucket(h.request) == len(self.admission.buckets) for h in admitted.values()]
    chunked, one_pass = any(long), len(long) > sum(long)
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
        self._active[slot] = Active(handle, start, start + handle.request.max_tokens, upto=start)
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
          update, done = self.reader.news(slot, active, view, stepped)
        except Exception as error:  # noqa: BLE001  Reading one request's news failed: that request ends alone.
          logger.exception("request %d: reading its step failed", active.handle.id)
          update, done = Update((), None, True, "error", 0, error=f"{type(error).__name__}: {error}"), True
        if done:
          self._finish(slot)
        if update is not None:
          news.append((active.handle, update))
    reported = time.perf_counter()
    stats.report += reported - stepped
    by_loop = collections.defaultdict(list)
    for handle, update in news:
      by_loop[handle.loop].append((handle, update))
    for loop, items in by_loop.items():
      post(loop, items)
    stats.post += time.perf_counter() - reported
    return True

  def _finish(self, slot: int) -> None:
    """Ends a request (the lock held): its row is released at the next iteration."""
    self._released.add(slot)
    self._active.pop(slot)
