"""Constraints compiled for the server in forked processes, each job under a time and a memory limit, fairly.

outlines-core builds a constraint's token index in Rust and cannot be interrupted from Python, and the schema
rewriter's own estimates can take long too: a JSON Schema with ``maxLength: 100000``, a pattern with ``{1000000}`` or
an integer bound near 2**70 takes seconds to minutes and hundreds of megabytes before the compiler can see that the
automaton is too large. A limit checked after the build, or a thread that is merely abandoned, bounds nothing. So
requests' constraints (``response_format``, ``tools``) compile in processes that can be killed:

* One *zygote* process (:mod:`mercury_jax.serve.zygote`, spawned with the server while the model loads)
  builds a :class:`~mercury_jax.constrain.automaton.Compiler` for the tokenizer once and compiles nothing itself. Each
  job is a child it forks (milliseconds; the child shares its memory copy-on-write), which compiles one constraint,
  answers on a socket of its own and exits. Stopping a job is killing its child: no process has to start again, so a
  killed job frees its place at once. Spawned, not forked from the server, because the server process runs XLA's
  threads and an engine thread that a fork would copy mid-flight; the zygote has one thread.
* Each child may grow by a bounded amount of address space (``RLIMIT_AS``); past it the allocation fails, the child
  dies or reports ``MemoryError``. The server process never holds a half-built index.

Fairness. Jobs of unknown cost share the processes in two lanes, so cheap constraints are never queued behind
expensive ones:

* *Express*: every new job starts at once in its own child (up to ``express`` children at a time; more wait their
  turn, first come first served), with ``express_seconds`` of time and ``express_memory`` of address space. Nearly
  every real schema compiles there (BUILD_NOTES: a boolean in 18 ms, a tool call in 64 ms, a four-field object with
  an e-mail format in 0.26 s), so a cheap one answers within its own compile time whatever else is compiling.
* *General*: a job that needs more time or memory than the express lane gives runs with the full ``timeout`` and
  ``memory``, at most ``workers`` at a time, first come first served. A job past its express time keeps running in
  its child when a general place is free (its memory limit is raised in place); otherwise the child is killed and the
  job waits for a general place, where it starts again with the rest of its time.
* A job past its ``timeout`` (express and general time together) is killed and refused; so is one past ``memory``.
* A job that has run :data:`QUICK_SECONDS` (longer than nearly every real schema takes) goes on at a lower priority
  (nice :data:`LONG_NICE`), as does every general job: the kernel gives the cores to new jobs, and to the server's
  own threads (the engine, the event loop), first. Old jobs still get every core nobody else wants.

Answers and refusals are cached in the server process by a hash of the constraint (least recently used first out;
refusals apart from compiled constraints, in a larger cache): a constraint known to fail, time out or be too large
answers at once, and a client repeating a hostile schema costs one job, not one per request. Requests for a
constraint being compiled wait for that job instead of starting another; a job whose every requester went away (the
awaiting tasks were cancelled) is killed. Token healing compiles nothing here: its one-position token masks are
cached apart (:func:`mercury_jax.sampling.healing.allowed_tokens`), so healing's many short prefixes never evict
compiled schemas.

Every refusal is a :class:`~mercury_jax.constrain.automaton.ConstraintError`, which the routes answer with 400.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import json
import logging

from mercury_jax.constrain.automaton import Automaton, ConstraintError
from mercury_jax.serve.zygote import LONG_NICE, Child, CompilerSpec, Zygote

__all__ = ["CompilePool", "CompilerSpec"]

logger = logging.getLogger("mercury_jax.serve")

MEMORY = 1 << 30  # Bytes of address space a general job may add beyond the zygote's size.
EXPRESS_MEMORY = 192 << 20  # The same for an express job (a four-field object with an e-mail format takes 58 MiB).
EXPRESS_JOBS = 16  # Express jobs at a time: a burst of this many new constraints all start at once.
EXPRESS_SECONDS = 1.0  # Seconds an express job runs before it needs a general place.
FAILURES = 4096  # Refusals kept (each a hash and a message).


@dataclasses.dataclass
class _Job:
  kind: str
  source: str
  task: asyncio.Future | None = None
  waiters: int = 0


class CompilePool:
  """Compiles constraints in forked processes with a time and a memory limit per job, in an express and a general
  lane (module docstring).

  The methods mirror :class:`~mercury_jax.constrain.automaton.Compiler`'s, as coroutines. Use it from one event
  loop; :meth:`start` it first (the zygote starts in the background), :meth:`close` it at the end.

  Args:
    spec: The tokenizer and the automaton limits.
    workers: General jobs at a time (>= 1): jobs that need more than the express lane gives.
    timeout: Seconds one job may take in all (> 0).
    memory: Bytes of address space a general job may grow by.
    cache_size: Compiled constraints kept.
    failures: Refusals kept.
    express: Express jobs at a time (>= 1).
    express_seconds: Seconds an express job runs before it needs a general place (> 0).
    express_memory: Bytes of address space an express job may grow by.

  Attributes:
    counts: ``jobs`` started, ``cached`` answers from a cache, ``shared`` requests that waited for a job already
      running, ``continued`` express jobs that went on in place, ``requeued`` ones killed to wait for a general place,
      ``timeouts``, ``killed`` jobs whose requesters all left.
  """

  def __init__(
    self,
    spec: CompilerSpec,
    *,
    workers: int = 2,
    timeout: float = 10.0,
    memory: int = MEMORY,
    cache_size: int = 64,
    failures: int = FAILURES,
    express: int = EXPRESS_JOBS,
    express_seconds: float = EXPRESS_SECONDS,
    express_memory: int = EXPRESS_MEMORY,
  ):
    if workers < 1 or express < 1:
      raise ValueError(f"workers={workers} and express={express} must be >= 1")
    if not timeout > 0 or not express_seconds > 0:
      raise ValueError(f"timeout={timeout} and express_seconds={express_seconds} must be > 0 seconds")
    self.spec, self.workers, self.timeout, self.memory = spec, workers, timeout, memory
    self.express, self.express_seconds, self.express_memory = express, min(express_seconds, timeout), express_memory
    self._cache, self._failures = _Cache(cache_size), _Cache(failures)
    self._jobs: dict[str, _Job] = {}
    self._zygote: Zygote | None = None
    self._restart: asyncio.Lock | None = None
    self._express: asyncio.Semaphore | None = None
    self._general: asyncio.Semaphore | None = None
    self.counts: collections.Counter[str] = collections.Counter()

  def start(self) -> None:
    """Starts the zygote (it gets ready while the caller goes on)."""
    self._zygote = Zygote(self.spec, self.memory)
    self._restart = asyncio.Lock()
    self._express, self._general = asyncio.Semaphore(self.express), asyncio.Semaphore(self.workers)

  async def ready(self) -> None:
    """Waits until the zygote has built its compiler (RuntimeError when it cannot)."""
    await self._zygote.start()

  def close(self) -> None:
    """Stops the zygote, and with it every child."""
    for job in list(self._jobs.values()):
      with contextlib.suppress(RuntimeError):  # its loop may be closed already (asyncio.run cancelled it then)
        job.task.cancel()
    if self._zygote is not None:
      self._zygote.kill()
      self._zygote = None

  async def regex(self, pattern: str) -> Automaton:
    if not isinstance(pattern, str) or not pattern:
      raise ConstraintError("the regex must be a non-empty string", param="regex")
    return await self._compile("regex", pattern)

  async def json_schema(self, schema: dict | str) -> Automaton:
    if not isinstance(schema, str):
      try:
        schema = json.dumps(schema, separators=(",", ":"))
      except (TypeError, ValueError) as e:
        raise ConstraintError(f"the JSON Schema must be JSON data (dicts, lists, strings, numbers): {e}") from None
    return await self._compile("json_schema", schema)

  async def json_object(self) -> Automaton:
    return await self._compile("json_object", "")

  async def _compile(self, kind: str, source: str) -> Automaton:
    key = _key(kind, source)
    found = self._cache.get(key) or self._failures.get(key)
    if found is not None:
      self.counts["cached"] += 1
    else:
      job = self._jobs.get(key)
      if job is None:
        job = self._jobs[key] = _Job(kind, source)
        job.task = asyncio.ensure_future(self._run(key, job))
      else:
        self.counts["shared"] += 1
      job.waiters += 1
      try:
        found = await asyncio.shield(job.task)
      finally:
        job.waiters -= 1
        if not job.waiters and not job.task.done():  # Nobody waits for it any more: its child is killed.
          job.task.cancel()
          self.counts["killed"] += 1
    if isinstance(found, ConstraintError):
      raise ConstraintError(str(found), param=found.param)
    return found

  async def _run(self, key: str, job: _Job) -> Automaton | ConstraintError:
    try:
      found = await self._lanes(job)
    finally:
      self._jobs.pop(key, None)
    (self._failures if isinstance(found, ConstraintError) else self._cache).put(key, found)
    return found

  async def _child(self, job: _Job, soft: int, nice: int = 0) -> Child:
    """A new child for ``job`` (the zygote started again first if it died)."""
    async with self._restart:
      if not self._zygote.alive:
        logger.warning("the compiling process died (exit code %s); starting it again", self._zygote.process.poll())
        self._zygote.kill()
        self._zygote = Zygote(self.spec, self.memory)
        await self._zygote.start()
    self.counts["jobs"] += 1
    return Child(self._zygote, soft, nice, job.kind, job.source)

  async def _lanes(self, job: _Job) -> Automaton | ConstraintError:
    """Runs ``job`` in the express lane, then (if it needs more) the general one (module docstring)."""
    loop = asyncio.get_running_loop()
    went_on, spent = None, 0.0  # the express child that goes on in a general place; the seconds it ran
    async with self._express:
      child = await self._child(job, self.express_memory)
      began = loop.time()
      try:
        try:
          status, payload = await child.answer(self.express_seconds)
        except TimeoutError:
          status, payload, spent = "slow", None, loop.time() - began
        except (EOFError, OSError):  # It died: most likely past the express memory, which the general lane raises.
          status, payload = "memory", None
        if status == "slow" and spent < self.timeout and not self._general.locked():
          await self._general.acquire()  # a free place: this does not wait
          child.grow()
          went_on = child
          self.counts["continued"] += 1
      finally:
        if went_on is None:
          child.end()
      if status not in ("slow", "memory"):
        return self._answer(job.kind, status, payload)
    if spent >= self.timeout:
      return self._timed_out()
    if went_on is None:
      self.counts["requeued"] += 1
      await self._general.acquire()
    try:
      child = went_on or await self._child(job, self.memory, LONG_NICE)
      try:
        status, payload = await child.answer(self.timeout - spent)
      except TimeoutError:
        return self._timed_out()
      except (EOFError, OSError):
        logger.warning("a compiling process died on a %s constraint", job.kind)
        return self._too_big()
      finally:
        child.end()
      return self._answer(job.kind, status, payload)
    finally:
      self._general.release()

  def _answer(self, kind: str, status: str, payload) -> Automaton | ConstraintError:
    if status == "ok":
      for array in (payload.classes, payload.table, payload.accepting, payload.distance, payload.forced):
        array.flags.writeable = False
      return payload
    if status == "refused":
      return ConstraintError(payload[0], param=payload[1])
    if status == "memory":
      return self._too_big()
    logger.error("the compiler failed on a %s constraint: %s", kind, payload)
    return ConstraintError("the constraint cannot be compiled (the compiler failed on it); simplify it")

  def _timed_out(self) -> ConstraintError:
    self.counts["timeouts"] += 1
    return ConstraintError(
      f"compiling the constraint took longer than the server allows ({self.timeout:g} s); simplify it (shorter "
      "maxLength, smaller repetition counts, fewer alternatives, smaller bounds)"
    )

  def _too_big(self) -> ConstraintError:
    return ConstraintError(
      f"compiling the constraint needs more than the {self.memory >> 20} MiB the server allows; simplify it "
      "(shorter maxLength, smaller repetition counts, fewer alternatives)"
    )


def _key(kind: str, source: str) -> str:
  """Hex sha256 of a constraint: the caches hold 64 bytes per constraint, not its text."""
  digest = hashlib.sha256(kind.encode())
  digest.update(b"\0" + source.encode())
  return digest.hexdigest()


class _Cache:
  """A least-recently-used map of ``size`` entries (0: nothing kept)."""

  def __init__(self, size: int):
    self.size, self._items = size, collections.OrderedDict()

  def get(self, key):
    found = self._items.get(key)
    if found is not None:
      self._items.move_to_end(key)
    return found

  def put(self, key, value) -> None:
    self._items[key] = value
    self._items.move_to_end(key)
    while len(self._items) > self.size:
      self._items.popitem(last=False)
