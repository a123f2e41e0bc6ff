"""The compile pool's processes (:mod:`mercury_jax.serve.compiling`): one zygote that forks a child per job.

The zygote (``python -m mercury_jax.serve.zygote SPEC_FD CONTROL_FD``, spawned by the server while the model loads)
builds a :class:`~mercury_jax.constrain.automaton.Compiler` for the tokenizer once, compiles a small schema so that
what a compile imports lazily is loaded, and compiles nothing more itself. The server sends it one datagram per
command on the control socket: ``start`` (fork a child for a job, whose socket comes with the datagram), ``nice``
(lower a child's priority), ``grow`` (raise its address-space limit to the general one) and ``end`` (kill the child
if it still runs, and reap it: a pid is reaped only when the server ends its job, so none is reused under it). A child
sets its own limits (``RLIMIT_AS``, its niceness), dies with the zygote (``PR_SET_PDEATHSIG``), reads one constraint,
answers ``("ok", automaton)``, ``("refused", (message, param))``, ``("memory", None)`` or ``("failed", text)`` and
exits. Spawned, not forked from the server, because the server process runs XLA's threads and an engine thread that a
fork would copy mid-flight; the zygote has one thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import resource
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any

from mercury_jax.constrain.automaton import ConstraintError

QUICK_SECONDS = 0.1  # Seconds a job runs at the server's priority; then at nice LONG_NICE.
LONG_NICE = 10  # The niceness of a job past QUICK_SECONDS (CFS gives nice 0 about nine times its share).
STARTUP_TIMEOUT = 120.0  # Seconds a new zygote may take to import and build its compiler.
INLINE_SOURCE = 1 << 15  # Characters of a constraint sent to its child from the event loop; longer: from a thread.
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies.
# Compiled once by the zygote before it forks: what a compile imports lazily (numpy.random, ...) is then loaded in every
# child, whose address space limit could otherwise refuse to map a module.
WARM_UP = (
  ("json_schema", '{"type":"object","properties":{"a":{"type":"string","maxLength":4},"b":{"enum":[1.5,"x",null]}}}'),
  ("regex", "[a-z]+"),
)
_ENV = {  # Small, predictable processes with one thread each (the zygote forks).
  "OPENBLAS_NUM_THREADS": "1",
  "OMP_NUM_THREADS": "1",
  "MKL_NUM_THREADS": "1",
  "TOKENIZERS_PARALLELISM": "false",
  "RAYON_NUM_THREADS": "1",
}


@dataclasses.dataclass(frozen=True)
class CompilerSpec:
  """What the zygote needs to build its compiler: the tokenizer and the limits (pickled to the process).

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


def _statm_bytes() -> int:
  """This process's address space in bytes (0 where /proc is missing)."""
  try:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
  except OSError:
    return 0


def _die_with_parent() -> None:
  """SIGKILL this process when the one that forked it dies (Linux; elsewhere nothing)."""
  try:
    import ctypes

    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
  except (OSError, AttributeError):
    pass


def _run_job(fd: int, compile_, soft: int, hard: int, nice: int) -> None:
  """A forked job: one constraint from the socket ``fd``, its answer back, then ``os._exit`` (never returns). Its
  stderr goes nowhere: a job past its address space may abort in Rust with a line there, and the server logs what
  matters (a death in the general lane)."""
  _die_with_parent()
  if nice:
    os.nice(nice)
  null = os.open(os.devnull, os.O_WRONLY)
  os.dup2(null, 2)
  os.close(null)
  base = _statm_bytes()
  if base:
    resource.setrlimit(resource.RLIMIT_AS, (base + soft, base + hard))
  code = 0
  try:
    conn = Connection(fd)
    kind, source = conn.recv()
    try:
      answer = ("ok", compile_[kind](source))
    except ConstraintError as e:
      answer = ("refused", (str(e), e.param))
    except RecursionError:
      answer = ("refused", ("the constraint is nested too deeply to compile", None))
    except (MemoryError, ImportError, OSError):  # Past the address space (a module that could not be mapped, too).
      answer = ("memory", None)
    except Exception as e:  # noqa: BLE001  Whatever the input does to the compiler, the answer says it.
      answer = ("failed", f"{type(e).__name__}: {e}")
    conn.send(answer)
  except BaseException:  # noqa: BLE001  The server went away, or the answer could not be sent: nothing to do.
    code = 1
  os._exit(code)


def main(spec_fd: int, control_fd: int) -> None:
  """The zygote: builds its compiler from the spec the server sends first, says ready, then forks a child per job
  and kills and reaps children when the server says so, until the server goes away."""
  from mercury_jax.constrain.automaton import Compiler
  from mercury_jax.data.tokenizer import tokenizer_from_bytes

  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the server, which then closes this process.
  spec_conn = Connection(spec_fd)
  control = socket.socket(fileno=control_fd)
  spec, memory = spec_conn.recv()
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
  for kind, source in WARM_UP:  # The modules a compile imports on first use, imported before any fork.
    compile_[kind](source)
  children: dict[int, int] = {}  # job id -> pid (reaped only when the server ends the job: no pid is reused)
  try:
    spec_conn.send(("ready", None))
    while True:
      data, fds, _, _ = socket.recv_fds(control, 4096, 1)
      if not data:
        break
      message = json.loads(data)
      job = message["job"]
      if message["op"] == "start":
        pid = os.fork()
        if pid == 0:
          control.close()
          _run_job(fds[0], compile_, message["soft"], memory, message["nice"])
        os.close(fds[0])
        children[job] = pid
      elif message["op"] == "nice" and job in children:  # It ran QUICK_SECONDS.
        with contextlib.suppress(OSError):
          os.setpriority(os.PRIO_PROCESS, children[job], LONG_NICE)
      elif message["op"] == "grow" and job in children:  # An express job continues as a general one.
        _, hard = resource.prlimit(children[job], resource.RLIMIT_AS)
        resource.prlimit(children[job], resource.RLIMIT_AS, (hard, hard))
      elif message["op"] == "end" and job in children:
        _end(children.pop(job))
  except (EOFError, OSError):  # The server went away (exited, or failed at start-up): nothing to answer, no trace.
    pass
  finally:
    for pid in children.values():
      _end(pid)


def _end(pid: int) -> None:
  """Kills a child (if it still runs) and reaps it."""
  with contextlib.suppress(ProcessLookupError):
    os.kill(pid, signal.SIGKILL)
  with contextlib.suppress(ChildProcessError):
    os.waitpid(pid, 0)


async def _readable(conn: Connection, timeout: float) -> None:
  """Returns once ``conn`` has data (or its end closed), waiting at most ``timeout`` seconds without blocking the loop.

  Raises:
    TimeoutError: Nothing came in time.
  """
  if conn.poll():
    return
  loop = asyncio.get_running_loop()
  readable = loop.create_future()
  fd = conn.fileno()
  loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
  try:
    await asyncio.wait_for(readable, max(timeout, 0.0))
  finally:
    loop.remove_reader(fd)


class Zygote:
  """The zygote process and the server's ends of its two sockets: the spec (and its "ready"), and the control socket
  (one datagram per command, a job's socket passed along with its start)."""

  def __init__(self, spec: CompilerSpec, memory: int):
    spec_ours, spec_theirs = socket.socketpair()
    control_ours, control_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fds = (spec_theirs.fileno(), control_theirs.fileno())
    command = [sys.executable, "-m", "mercury_jax.serve.zygote", *map(str, fds)]
    self.process = subprocess.Popen(command, pass_fds=fds, env={**os.environ, **_ENV})
    spec_theirs.close()
    control_theirs.close()
    self.spec = Connection(spec_ours.detach())
    self.control = control_ours
    self.spec.send((spec, memory))
    self.ready = False
    self._jobs = 0

  async def start(self) -> None:
    """Waits until the process has built its compiler.

    Raises:
      RuntimeError: It died or took longer than :data:`STARTUP_TIMEOUT`.
    """
    if self.ready:
      return
    try:
      await _readable(self.spec, STARTUP_TIMEOUT)
      status, _ = self.spec.recv()
    except (TimeoutError, EOFError, OSError):
      self.kill()
      raise RuntimeError(f"the compiling process did not start (exit code {self.process.returncode})") from None
    self.ready = status == "ready"

  def fork(self, soft: int, nice: int) -> tuple[int, Connection]:
    """Starts a job's child with ``soft`` bytes of address space to grow by, at niceness ``nice``; returns its id and
    its socket.

    Raises:
      OSError: The zygote is gone.
    """
    self._jobs += 1
    ours, theirs = socket.socketpair()
    try:
      message = json.dumps({"op": "start", "job": self._jobs, "soft": soft, "nice": nice}).encode()
      socket.send_fds(self.control, [message], [theirs.fileno()])
    finally:
      theirs.close()
    return self._jobs, Connection(ours.detach())

  def command(self, op: str, job: int) -> None:
    """``nice`` (a job's priority lowered), ``grow`` (its memory limit raised to the general one) or ``end`` (its child
    killed and reaped); nothing if the zygote is gone."""
    with contextlib.suppress(OSError):
      self.control.send(json.dumps({"op": op, "job": job}).encode())

  def kill(self) -> None:
    if self.process.poll() is None:
      self.process.kill()
    self.process.wait(timeout=5.0)
    self.spec.close()
    self.control.close()

  @property
  def alive(self) -> bool:
    return self.ready and self.process.poll() is None


class Child:
  """The server's end of one job's child."""

  def __init__(self, zygote: Zygote, soft: int, nice: int, kind: str, source: str):
    self.zygote = zygote
    self.job, self.conn = zygote.fork(soft, nice)
    self.niced = bool(nice)
    self._sent = None
    if len(source) <= INLINE_SOURCE:  # It fits the socket's buffer: the send does not wait for the child.
      self.conn.send((kind, source))
    else:  # A big one goes from a thread, so the loop never waits on the child's reading.
      self._sent = asyncio.ensure_future(asyncio.to_thread(self.conn.send, (kind, source)))

  async def answer(self, timeout: float) -> tuple[str, Any]:
    """The child's answer, waiting at most ``timeout`` seconds (past :data:`QUICK_SECONDS` its priority is lowered).

    Raises:
      TimeoutError: It did not answer in time.
      EOFError, OSError: It died.
    """
    if not self.niced and timeout > QUICK_SECONDS:
      try:
        await _readable(self.conn, QUICK_SECONDS)
      except TimeoutError:
        self.zygote.command("nice", self.job)
        self.niced = True
        timeout -= QUICK_SECONDS
    await _readable(self.conn, timeout)
    return self.conn.recv()

  def grow(self) -> None:
    self.zygote.command("grow", self.job)

  def end(self) -> None:
    """Kills the child if it still runs (the zygote reaps it) and closes its socket, once a send in a thread has
    stopped (the killed child's socket fails it at once): a socket closed under a writing thread could see its number
    reused."""
    self.zygote.command("end", self.job)
    if self._sent is None or self._sent.done():
      self.conn.close()
    else:
      self._sent.add_done_callback(lambda sent: (sent.cancelled() or sent.exception(), self.conn.close()))


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]))
