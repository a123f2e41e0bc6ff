"""The serving engine's host side: a queue, the requests in the slots, and one thread that drives them.

The device side is :class:`~mercury_jax.serve.slots.SlotEngine` (prefill, insert, step, release over a fixed number
of slots of the block engine). Each iteration of the engine thread frees the rows of finished and cancelled
requests, admits waiting requests into free rows (continuous batching: requests of any length and step budget come
and go between steps), runs one step, reads the canvases back once and hands every request its newly final tokens.
On a multi-host mesh this thread runs on process 0 only, and every other process runs the same commands
(:meth:`Scheduler.follow`).

Requests are checked, tokenised and detokenised by the caller (the HTTP layer); the engine thread never waits on a
client: :class:`Handle` delivers :class:`Update` objects to the submitting asyncio loop.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import threading
import time
from collections.abc import AsyncIterator

import jax
import numpy as np

from mercury_jax.constrain import device as constrained
from mercury_jax.sampling.sampler import Sampler
from mercury_jax.sampling.settings import SettingError
from mercury_jax.serve.slots import DEFAULT_CAPACITY, Knobs, Request, SlotEngine, View

__all__ = ["Handle", "Knobs", "QueueFull", "Request", "Scheduler", "ShuttingDown", "Update", "lowerings"]
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
  """What a request has so far.

  Attributes:
    tokens: Every final generated token id so far (a growing prefix; EOS and padding removed).
    draft: With ``diffusing``: the whole completion now, committed tokens plus the last step's proposals in the open
      block, later positions as the mask id; None otherwise.
    done: The request's last update.
    finish_reason: When done: ``stop`` (EOS), ``length`` (the hole is full), ``cancelled`` or ``error``.
    nfe: Forward passes the request has needed so far (its prefill included).
    error: The message when ``finish_reason`` is ``error``.
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
    try:
      self.loop.call_soon_threadsafe(self._queue.put_nowait, update)
    except RuntimeError:  # The loop is closed: nobody is listening any more.
      self.cancelled = True

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


@dataclasses.dataclass
class _Active:
  handle: Handle
  start: int  # first slot of the hole
  end: int  # one past its last slot
  sent: int = -1  # tokens delivered so far (-1: nothing delivered yet)


class Scheduler:
  """The queue and the engine thread for one model.

  Args:
    sampler: The model, tokenizer and mesh (:meth:`Sampler.from_checkpoint`).
    slots: Requests refined at once (the batch of every step).
    max_queue: Requests that may wait for a slot; beyond it :meth:`submit` raises :class:`QueueFull`.
    block_length: The block of a whole-sequence checkpoint (decoded without a cache, through the same engine);
      block-diffusion checkpoints use their trained block and the twin blocks of one token.
    default_steps: Steps per block when a request gives none; default the block (one token per step).
    capacity: The automaton sizes each slot holds for structured output (``slots.DEFAULT_CAPACITY``); None turns
      structured output off.
  """

  def __init__(
    self,
    sampler: Sampler,
    *,
    slots: int = 16,
    max_queue: int = 256,
    block_length: int = 0,
    default_steps: int | None = None,
    capacity: constrained.Capacity | None = DEFAULT_CAPACITY,
  ):
    if max_queue < 0:
      raise ValueError(f"max_queue={max_queue} must be >= 0")
    lowerings()  # Count from before the first compilation.
    self.engine = SlotEngine(
      sampler, slots=slots, block_length=block_length, default_steps=default_steps, capacity=capacity
    )
    self.compiler = self.engine.compiler  # structured output: regex / JSON Schema -> automaton (None: off)
    self.sampler, self.tokenizer, self.cfg = sampler, sampler.tokenizer, sampler.cfg
    self.autoregressive, self.block, self.slots = self.engine.autoregressive, self.engine.block, slots
    self.block_length_fixed = not self.engine.whole_sequence
    self.max_length, self.max_queue = sampler.max_length, max_queue
    settings = self.engine.settings
    self.mask_id, self.eos_id, self.pad_id = settings.mask_id, settings.eos_id, settings.pad_id
    self.default_steps = self.engine.default_steps
    self.leader = jax.process_index() == 0
    self._lock = threading.Condition()
    self._waiting: collections.deque[Handle] = collections.deque()
    self._active: dict[int, _Active] = {}
    self._released: set[int] = set()  # rows of requests that ended, given up at the next iteration
    self._ids = itertools.count()
    self._stopping = False
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

  def check(self, request: Request) -> None:
    """Raises :class:`SettingError` for a knob out of range or a request that does not fit the context."""
    knobs = request.knobs
    values = dict(temperature=knobs.temperature, top_k=knobs.top_k, top_p=knobs.top_p, threshold=knobs.threshold)
    dataclasses.replace(self.engine.settings, **values).validate()  # The sampler's own checks of these knobs.
    if knobs.steps is not None and knobs.steps < 1:
      raise SettingError("steps", knobs.steps, "must be >= 1 (steps per block)")
    if request.max_tokens < 1:
      raise SettingError("max_tokens", request.max_tokens, "must be >= 1")
    vocab = self.cfg.model.vocab_size
    if any(not 0 <= t < vocab for t in (*request.prompt, *request.suffix)):
      raise ValueError(f"token ids must lie in [0, {vocab})")
    if self.autoregressive and not request.prompt:
      raise ValueError("the autoregressive model needs a prompt of at least one token (e.g. BOS)")
    if request.constraint is not None:
      if self.engine.capacity is None:
        raise ValueError("structured output is off on this server (started without a constraint capacity)")
      problem = constrained.fits(request.constraint, self.engine.capacity)
      if problem:
        raise ValueError(f"{problem}; start the server with a larger --constraint-capacity")
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

  def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> Handle:
    """Queues a request (thread-safe) and returns its handle.

    Raises:
      SettingError, ValueError: See :meth:`check`.
      QueueFull: ``max_queue`` requests are already waiting.
      ShuttingDown: The scheduler is draining.
    """
    self.check(request)
    with self._lock:
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
    while (self._active or self._waiting) and time.monotonic() < deadline and self._alive():
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
    while True:
      with self._lock:
        while not (self._active or self._waiting or self._stopping):
          if not self._lock.wait(timeout=IDLE_TICK) and self.engine.multiprocess:
            self.engine.run(self.engine.command())  # Keeps the followers' collectives alive.
        if self._stopping and not self._active and not self._waiting:
          return
      self._iterate()

  def _iterate(self) -> None:
    """One engine iteration: releases, admissions, a step, and the news it brings."""
    engine, command = self.engine, self.engine.command()
    now = time.perf_counter()
    for slot in self._released:
      command.release[slot] = True
    self._released.clear()
    for slot, active in list(self._active.items()):
      if active.handle.cancelled:
        command.release[slot] = True
        del self._active[slot]
        active.handle._deliver(Update((), None, True, "cancelled", 0, time=now))
    admitted = {}
    free = [slot for slot in range(self.slots) if slot not in self._active]
    with self._lock:
      while free and self._waiting:
        handle = self._waiting.popleft()
        if handle.cancelled:
          handle._deliver(Update((), None, True, "cancelled", 0, time=now))
          continue
        slot = free.pop(0)
        engine.admit(command, slot, handle.request)
        admitted[slot] = handle
    command = command._replace(step=np.asarray(bool(self._active or admitted)))
    try:
      view, failures = engine.run(command)
    except Exception as error:  # noqa: BLE001  A failed step fails the requests it carried, then starts afresh.
      message = f"{type(error).__name__}: {error}"
      self._released.clear()
      for handle in [*(a.handle for a in self._active.values()), *admitted.values()]:
        handle._deliver(Update((), None, True, "error", 0, error=message, time=time.perf_counter()))
      self._active.clear()
      if engine.multiprocess:  # The other processes cannot be restarted from here: stop serving.
        with self._lock:
          self._stopping = True
        raise
      engine.reset()
      return
    for slot, handle in admitted.items():
      if slot in failures:
        handle._deliver(Update((), None, True, "error", 0, error=failures[slot], time=time.perf_counter()))
        continue
      start = self.block + len(handle.request.prompt)
      self._active[slot] = _Active(handle, start, start + handle.request.max_tokens)
    if view is None:
      return
    now = time.perf_counter()
    for slot, active in list(self._active.items()):
      try:
        self._report(slot, active, view, now)
      except Exception as error:  # noqa: BLE001  Reading one request's news failed: that request ends alone.
        self._finish(slot, Update((), None, True, "error", 0, error=f"{type(error).__name__}: {error}", time=now))

  def _finish(self, slot: int, update: Update) -> None:
    """Ends a request; its row is released at the next iteration."""
    self._active.pop(slot).handle._deliver(update)
    self._released.add(slot)

  def _report(self, slot: int, active: _Active, view: View, now: float) -> None:
    """Hands a request its news after a step: newly final tokens, its draft, or its end."""
    z, start = view.z[slot], int(view.starts[slot])
    done = not bool(view.unfinished[slot])
    final_end = active.end if done else min(max(start, active.start), active.end)
    region = z[active.start : final_end]
    eos = np.flatnonzero(region == self.eos_id)
    stopped = eos.size > 0
    tokens = region[: eos[0]] if stopped else region
    tokens = tuple(int(t) for t in tokens if t not in (self.pad_id, self.mask_id))
    nfe = int(view.nfe[slot])
    draft = None
    if active.handle.request.diffusing and not done:
      open_start = start - self.block if bool(view.fresh[slot]) else start  # The block the last step worked on.
      whole = z[active.start : active.end].copy()
      slots = np.arange(active.start, active.end)
      undecided = (whole == self.mask_id) & (slots >= open_start) & (slots < open_start + self.block)
      whole[undecided] = view.proposal[slot][slots[undecided] - open_start]
      draft = tuple(int(t) for t in whole)
    if done:
      constraint = active.handle.request.constraint
      if constraint is not None and constraint.kind != "heal":  # Complete structured text stops; a valid but
        # unfinished prefix ran out of room. (Token healing's constraint ends with its prefix: EOS decides.)
        stopped = constraint.accepts([int(t) for t in region if t != self.pad_id])
      self._finish(slot, Update(tokens, None, True, "stop" if stopped else "length", nfe, time=now))
    elif len(tokens) != active.sent or draft is not None:
      active.sent = len(tokens)
      active.handle._deliver(Update(tokens, draft, False, None, nfe, time=now))
