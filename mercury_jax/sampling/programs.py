"""The compiled engine programs: one object builds and caches them on a mesh for every entry point.

:class:`Programs` holds, for one network on one mesh, the engines (:class:`~mercury_jax.sampling.engine.BlockEngine`:
one per settings, plan and network) and their programs (JetStream's: ``prefill``, ``insert``, ``release``, ``step``,
``advance``, and a chunked prefill's ``fill`` and ``arm``), each a :class:`Program`: the function jitted on the mesh
with its shardings, lowered and compiled ahead of time for the arguments of its first call, and compiled again
only for arguments of another shape. ``Sampler`` runs ``prefill`` and ``advance``, the server's slots run every
program over its batch buckets, and ``python -m mercury_jax.aot --sample`` lowers the very ``prefill`` and
``advance`` the sampler runs, so its memory report describes the program users run.

Compilation keys: the settings without the traced knobs (:func:`without_knobs`: a new temperature, top-k, top-p or
threshold reuses the program), the plan, and the program's static options (the prefill's size); the shapes of the
arguments (batch, constraint capacity, token healing) pick an executable of the program.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import dispatch
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mercury_jax import sharding as sh
from mercury_jax.sampling.engine import BlockEngine, Start
from mercury_jax.sampling.network import InvariantNetwork, Network
from mercury_jax.sampling.plan import BlockPlan
from mercury_jax.sampling.settings import SamplerSettings


def without_knobs(settings: SamplerSettings) -> SamplerSettings:
  """``settings`` with the sampling knobs the engine traces (temperature, top-k, top-p, threshold) at their defaults:
  the compilation key, so a new value of one of them reuses the compiled program."""
  return dataclasses.replace(settings, temperature=1.0, top_k=0, top_p=1.0, threshold=0.9)


class _Compilations:
  """What JAX spent compiling, from ``jax.monitoring``'s events (registered on first use): lowerings of the whole
  process (every jit cache miss that compiles), and each thread's seconds of tracing, lowering and compiling."""

  def __init__(self):
    self.count, self._lock, self._listening, self._local = 0, threading.Lock(), False, threading.local()

  def _event(self, event: str, seconds: float, *_args, **_kwargs) -> None:
    if event == dispatch.JAXPR_TO_MLIR_MODULE_EVENT:
      with self._lock:
        self.count += 1
    if event in _COMPILE_EVENTS:
      self._local.seconds = getattr(self._local, "seconds", 0.0) + seconds

  def listen(self) -> None:
    with self._lock:
      if not self._listening:
        jax.monitoring.register_event_duration_secs_listener(self._event)
        self._listening = True

  def lowerings(self) -> int:
    """JAX programs lowered in this process since the first call."""
    self.listen()
    with self._lock:
      return self.count

  def seconds(self) -> float:
    """This thread's seconds of tracing, lowering and compiling since the first call."""
    self.listen()
    return getattr(self._local, "seconds", 0.0)


_COMPILE_EVENTS = (dispatch.JAXPR_TRACE_EVENT, dispatch.JAXPR_TO_MLIR_MODULE_EVENT, dispatch.BACKEND_COMPILE_EVENT)
compilations = _Compilations()


class Program:
  """One engine function jitted on a mesh (:class:`~mercury_jax.sharding.MeshJit`, whose cache compiles it once per
  argument signature).

  Args:
    fn: The function.
    mesh, rules: The mesh and the logical axis rules it traces under.
    in_shardings: Per argument: a sharding (tree), None (as the argument lies), or ``"same"``: the argument's own
      shardings (a state that goes in and comes out as it is; one jitted function per tree structure of the
      arguments, each compiled per shape). Empty: every argument as it lies.
    donate: Positions of the arguments whose buffers the result reuses.
    same_out: The result has the shardings of this argument (one marked ``"same"``).
  """

  def __init__(self, fn: Callable, mesh: Mesh, rules, in_shardings: tuple = (), donate=(), same_out: int | None = None):
    self.fn, self.mesh, self.rules = fn, mesh, rules
    self.in_shardings, self.donate, self.same_out = in_shardings, tuple(donate), same_out
    self._jitted: dict[Any, sh.MeshJit] = {}  # by the arguments' tree structure where shardings are "same"

  def _jit(self, args) -> sh.MeshJit:
    same = "same" in self.in_shardings
    key = jax.tree.structure(args) if same else None
    if key not in self._jitted:
      kwargs = {"donate_argnums": self.donate}
      if self.in_shardings:
        shardings = [
          jax.tree.map(lambda a: a.sharding, arg) if given == "same" else given
          for given, arg in zip(self.in_shardings, args, strict=True)
        ]
        kwargs["in_shardings"] = tuple(shardings)
        if self.same_out is not None:
          kwargs["out_shardings"] = shardings[self.same_out]
      self._jitted[key] = sh.MeshJit(self.fn, self.mesh, self.rules, **kwargs)
    return self._jitted[key]

  def lower(self, *args):
    """The lowering for ``args`` (arrays or ``jax.ShapeDtypeStruct``s with shardings): what a call compiles."""
    return self._jit(args).lower(*args)

  def __call__(self, *args):
    return self._jit(args)(*args)


class Programs:
  """The engines and compiled programs of one network on one mesh (module docstring).

  Args:
    network: The denoiser.
    mesh: The device mesh.
    rules: The logical axis rules.
    param_shardings: The parameters' shardings on ``mesh``.
  """

  def __init__(self, network: Network, mesh: Mesh, rules, param_shardings):
    self.network, self.mesh, self.rules, self.param_shardings = network, mesh, rules, param_shardings
    self._engines: dict[Any, BlockEngine] = {}
    self._programs: dict[Any, Program] = {}

  def engine(self, settings: SamplerSettings, plan: BlockPlan, tile: int = 0) -> BlockEngine:
    """The engine of ``settings`` (without their traced knobs) and ``plan``; ``tile`` > 0 runs its network
    batch-invariantly over tiles of that many positions (:class:`~mercury_jax.sampling.network.InvariantNetwork`)."""
    key = (without_knobs(settings), plan, tile)
    if key not in self._engines:
      network = self.network
      if tile:
        network = InvariantNetwork(self.network.cfg, group=sh.data_parallel_size(self.mesh, self.rules), tile=tile)
      self._engines[key] = BlockEngine(network, key[0], plan)
    return self._engines[key]

  def _program(self, name: str, engine: BlockEngine, build: Callable[[], Program], *static) -> Program:
    key = (name, id(engine), *static)
    if key not in self._programs:
      self._programs[key] = build()
    return self._programs[key]

  def prefill(self, engine: BlockEngine, size: int | None = None, *, inert: bool = False) -> Program:
    """``(params, Start) -> state``: :meth:`BlockEngine.init` with the exact cache's prefill over ``size`` slots
    (None: every slot). ``inert``: a chunked prefill's row, with nothing to generate until :meth:`arm` gives it its
    holes (so a step whose bucket it pads leaves it as it was)."""

    def fn(p, start: Start):
      canvas, key, steps, knobs, tables, healing, extra = start
      st = engine.init(p, canvas, key, steps, knobs, prefill=size, tables=tables, healing=healing, extra_steps=extra)
      return st._replace(generate=jnp.zeros_like(st.generate)) if inert else st

    return self._program("prefill", engine, lambda: self._on_params(fn, 2), size, inert)

  def advance(self, engine: BlockEngine) -> Program:
    """``(params, state, max_blocks, max_steps) -> state``: :meth:`BlockEngine.advance`; the state keeps the
    shardings it came with and is donated."""
    replicated = NamedSharding(self.mesh, P())
    build = lambda: Program(  # noqa: E731
      engine.advance, self.mesh, self.rules, (self.param_shardings, "same", replicated, replicated), (1,), same_out=1
    )
    return self._program("advance", engine, build)

  def step(self, engine: BlockEngine) -> Program:
    """``(params, state, live rows) -> (state, news)``: :meth:`BlockEngine.step_rows` (the state donated)."""
    return self._program("step", engine, lambda: self._on_params(engine.step_rows, 3, donate=(1,)))

  def fill(self, engine: BlockEngine, size: int) -> Program:
    """``(params, state, slot, start) -> state``: one chunk of ``size`` slots of a chunked prefill."""
    fn = lambda p, st, slot, start: engine.fill(p, st, slot, start, size)  # noqa: E731
    return self._program("fill", engine, lambda: self._on_params(fn, 4, donate=(1,)), size)

  def insert(self, engine: BlockEngine) -> Program:
    """``(state, row, slot, table) -> state``: :meth:`BlockEngine.insert` (the state donated)."""
    return self._program("insert", engine, lambda: Program(engine.insert, self.mesh, self.rules, donate=(0,)))

  def release(self, engine: BlockEngine) -> Program:
    """``(state, slot) -> state``: :meth:`BlockEngine.release` (the state donated)."""
    return self._program("release", engine, lambda: Program(engine.release, self.mesh, self.rules, donate=(0,)))

  def arm(self, engine: BlockEngine) -> Program:
    """``(state, slot) -> state``: :meth:`BlockEngine.arm` (the state donated)."""
    return self._program("arm", engine, lambda: Program(engine.arm, self.mesh, self.rules, donate=(0,)))

  def _on_params(self, fn: Callable, arity: int, donate=()) -> Program:
    """A program whose first argument is the parameters (sharded as they are) and whose others lie as they come."""
    return Program(fn, self.mesh, self.rules, (self.param_shardings, *[None] * (arity - 1)), donate)

  def __len__(self) -> int:
    return len(self._programs)
