"""Constraints compiled for the server in worker processes, each job under a time and a memory limit.

outlines-core builds a constraint's token index in Rust and cannot be interrupted from Python: a JSON Schema with
``maxLength: 100000`` or a pattern with ``{1000000}`` takes seconds to minutes and hundreds of megabytes before the
compiler can see that the automaton is too large. A limit checked after the build, or a thread that is merely
abandoned, bounds nothing. So requests' constraints (``response_format``, ``tools``) compile in a small pool of
spawned processes, each holding a :class:`~mercury_jax.constrain.automaton.Compiler` for the tokenizer:

* a job that runs past the time limit, or whose client goes away (the awaiting task is cancelled), gets its process
  killed and replaced: the work stops, and its memory goes back to the system;
* each process may grow by at most ``memory`` bytes of address space beyond what it holds once ready
  (``RLIMIT_AS``); past it the allocation fails, the process dies or reports ``MemoryError``, and the job is refused;
* the server process itself never holds a half-built index: its memory does not grow with a hostile schema.

Processes, not threads, because killing is the only way to stop the Rust build; spawned, not forked, because the
server process runs XLA's threads and an engine thread that a fork would copy mid-flight. A pool of a few (default
2), started with the server while the model loads, so no request pays a start-up. Results and refusals are cached
in the server process (least recently used first out): refusals too, so a client repeating a hostile schema costs
one job, not one per request. Token healing compiles nothing here: its one-position token masks are cached apart
(:func:`mercury_jax.sampling.healing.allowed_tokens`), so healing's many short prefixes never evict compiled schemas.

Every refusal is a :class:`~mercury_jax.constrain.automaton.ConstraintError`, which the routes answer with 400.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import os
import resource
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any

from mercury_jax.constrain.automaton import Automaton, ConstraintError

logger = logging.getLogger("mercury_jax.serve")

MEMORY = 1 << 30  # Bytes of address space a compiling process may add beyond its size once ready.
STARTUP_TIMEOUT = 120.0  # Seconds a new process may take to import and build its compiler.
_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # Small, predictable workers.


@dataclasses.dataclass(frozen=True)
class CompilerSpec:
  """What a worker process needs to build its compiler: the tokenizer and the limits (pickled to the process).

  Attributes:
    tokenizer: The serialized tokenizer (``tokenizer.to_bytes()``, either backend).
    max_states, max_classes, max_edges: The automaton limits (the slots' constraint capacity).
    remedy: What a refusal above a limit tells the user to do (``{name}``: states, classes or edges).
  """

  tokenizer: bytes
  max_states: int
  max_classes: int
  max_edges: int
  remedy: str


def _limit_memory(extra: int) -> None:
  """Caps this process's address space at its current size plus ``extra`` bytes (Linux; elsewhere nothing)."""
  try:
    with open("/proc/self/statm") as f:
      size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
  except OSError:
    return
  resource.setrlimit(resource.RLIMIT_AS, (size + extra, size + extra))


def _work(fd: int) -> None:
  """The worker process: builds its compiler from the spec the server sends first, then compiles jobs for ever."""
  from mercury_jax.constrain.automaton import Compiler
  from mercury_jax.data.tokenizer import tokenizer_from_bytes

  conn = Connection(fd)
  spec, memory = conn.recv()
  compiler = Compiler(
    tokenizer_from_bytes(spec.tokenizer),
    max_states=spec.max_states,
    max_classes=spec.max_classes,
    max_edges=spec.max_edges,
    remedy=spec.remedy,
    cache_size=0,  # The server process caches.
  )
  compile_ = {
    "regex": compiler.regex,
    "json_schema": compiler.json_schema,
    "json_object": lambda _: compiler.json_object(),
  }
  _limit_memory(memory)
  try:
    conn.send(("ready", None))
    while True:
      kind, source = conn.recv()
      try:
        answer = ("ok", compile_[kind](source))
      except ConstraintError as e:
        answer = ("refused", (str(e), e.param))
      except RecursionError:
        answer = ("refused", ("the constraint is nested too deeply to compile", None))
      except MemoryError:
        answer = ("memory", None)
      except Exception as e:  # noqa: BLE001  Whatever the input does to the compiler, the process goes on serving.
        answer = ("failed", f"{type(e).__name__}: {e}")
      conn.send(answer)
  except (EOFError, OSError):  # The server went away (exited, or failed at start-up): nothing to answer, no trace.
    return


class _Worker:
  """One compiling process (``python -m mercury_jax.serve.compiling FD``) and the server's end of its socket.

  A plain subprocess rather than ``multiprocessing``'s spawn, which re-imports the caller's main script: the worker
  imports this module and nothing of the server's.
  """

  def __init__(self, spec: CompilerSpec, memory: int):
    ours, theirs = socket.socketpair()
    command = [sys.executable, "-m", "mercury_jax.serve.compiling", str(theirs.fileno())]
    self.process = subprocess.Popen(command, pass_fds=(theirs.fileno(),), env={**os.environ, **_ENV})
    theirs.close()
    self.conn = Connection(ours.detach())
    self.conn.send((spec, memory))
    self.ready = False

  async def receive(self, timeout: float) -> tuple[str, Any]:
    """The next message, waiting at most ``timeout`` seconds without blocking the loop.

    Raises:
      asyncio.TimeoutError: Nothing came in time.
      EOFError: The process died.
    """
    if not self.conn.poll():
      loop = asyncio.get_running_loop()
      readable = loop.create_future()
      fd = self.conn.fileno()
      loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
      try:
        await asyncio.wait_for(readable, timeout)
      finally:
        loop.remove_reader(fd)
    return self.conn.recv()

  async def start(self) -> None:
    """Waits until the process has built its compiler.

    Raises:
      RuntimeError: It died or took longer than :data:`STARTUP_TIMEOUT`.
    """
    if self.ready:
      return
    try:
      status, _ = await self.receive(STARTUP_TIMEOUT)
    except (TimeoutError, EOFError, OSError):
      self.kill()
      raise RuntimeError(f"a compiling process did not start (exit code {self.process.returncode})") from None
    self.ready = status == "ready"

  def kill(self) -> None:
    if self.process.poll() is None:
      self.process.kill()
    self.process.wait(timeout=5.0)
    self.conn.close()

  @property
  def alive(self) -> bool:
    return not self.conn.closed and self.process.poll() is None


class CompilePool:
  """Compiles constraints in ``workers`` processes with a time and a memory limit per job (module docstring).

  The methods mirror :class:`~mercury_jax.constrain.automaton.Compiler`'s, as coroutines. Use it from one event
  loop; :meth:`start` it first (the processes start in the background), :meth:`close` it at the end.

  Args:
    spec: The tokenizer and the automaton limits.
    workers: Processes, so jobs that run at once (>= 1).
    timeout: Seconds one job may take (> 0).
    memory: Bytes of address space a process may grow by while compiling.
    cache_size: Compiled constraints (and refusals) kept.
  """

  def __init__(
    self,
    spec: CompilerSpec,
    *,
    workers: int = 2,
    timeout: float = 10.0,
    memory: int = MEMORY,
    cache_size: int = 64,
  ):
    if workers < 1:
      raise ValueError(f"workers={workers} must be >= 1")
    if not timeout > 0:
      raise ValueError(f"timeout={timeout} must be > 0 seconds")
    self.spec, self.workers, self.timeout, self.memory = spec, workers, timeout, memory
    self._cache = _Cache(cache_size)
    self._idle: list[_Worker] = []
    self._turns: asyncio.Semaphore | None = None

  def start(self) -> None:
    """Starts the processes (they get ready while the caller goes on)."""
    self._idle = [_Worker(self.spec, self.memory) for _ in range(self.workers)]
    self._turns = asyncio.Semaphore(self.workers)

  async def ready(self) -> None:
    """Waits until every process has built its compiler (RuntimeError when one cannot)."""
    for worker in self._idle:
      await worker.start()

  def close(self) -> None:
    """Stops every process."""
    for worker in self._idle:
      worker.kill()
    self._idle = []

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
    cache = self._cache
    found = cache.get((kind, source))
    if found is None:
      async with self._turns:
        found = cache.get((kind, source))  # Another request may have compiled it meanwhile.
        if found is None:
          found = await self._job(kind, source)
          cache.put((kind, source), found)
    if isinstance(found, ConstraintError):
      raise ConstraintError(str(found), param=found.param)
    return found

  async def _job(self, kind: str, source: str) -> Automaton | ConstraintError:
    """Runs one job on an idle process (a turn is held); kills and replaces it on timeout, death or cancellation."""
    worker, finished = self._idle.pop(), False
    try:
      if not worker.alive:  # It died between jobs.
        worker = _Worker(self.spec, self.memory)
      await worker.start()
      worker.conn.send((kind, source))
      status, payload = await worker.receive(self.timeout)
      finished = True
    except TimeoutError:
      return ConstraintError(
        f"compiling the constraint took longer than the server allows ({self.timeout:g} s); simplify it (shorter "
        "maxLength, smaller repetition counts, fewer alternatives)"
      )
    except (EOFError, OSError):
      code = worker.process.wait(timeout=5.0)
      logger.warning("a compiling process died on a %s constraint (exit code %s)", kind, code)
      return self._too_big()
    finally:  # A job that did not finish (timed out, died, or cancelled because the client left): the process is
      # killed, so the work stops, and replaced.
      if not finished:
        worker.kill()
        worker = _Worker(self.spec, self.memory)
      self._idle.append(worker)
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

  def _too_big(self) -> ConstraintError:
    return ConstraintError(
      f"compiling the constraint needs more than the {self.memory >> 20} MiB the server allows; simplify it "
      "(shorter maxLength, smaller repetition counts, fewer alternatives)"
    )


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


if __name__ == "__main__":
  _work(int(sys.argv[1]))
