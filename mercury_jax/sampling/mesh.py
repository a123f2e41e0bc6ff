"""Compiling a decoding loop for a mesh: one set of shardings for the diffusion loop and the autoregressive decoder.

The parameters keep their logical shardings; canvases and every per-example output are split over the batch axes
of the rules; keys, scalars and batch-level outputs are replicated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mercury_jax import sharding as sh
from mercury_jax.sampling.canvas import Canvas, SampleOutput


def jit_on_mesh(
  fn: Callable[..., SampleOutput],
  mesh: Mesh | None,
  rules=None,
  param_shardings: Any = None,
  *,
  scalars: int = 0,
  trace: int = 0,
  batched: Any = None,
  name: str = "the sampler",
  accepted: bool = False,
) -> Callable[..., SampleOutput]:
  """``jax.jit`` of a sampler ``fn(params, canvas, key, *scalars) -> SampleOutput`` with its shardings on ``mesh``.

  Shared by the diffusion loop and the autoregressive decoder: the parameters keep ``param_shardings``, canvases and
  every per-example output are split over the batch axes of ``rules``, and the key, the ``scalars`` trailing scalar
  arguments and ``SampleOutput.steps`` are replicated. On a mesh the result is a :class:`~mercury_jax.sharding.MeshJit`:
  it is traced, lowered and called with the mesh and ``rules`` in context, so the model's logical sharding
  constraints always apply, whoever calls it.

  Args:
    fn: The sampler, its static settings already bound.
    mesh: The device mesh; None for plain ``jax.jit`` (one device or committed inputs).
    rules: Logical axis rules (default ``mercury_jax.sharding.RULES``).
    param_shardings: The parameters' shardings on ``mesh`` (needed with a mesh).
    scalars: How many scalar arguments follow the key (the diffusion loop's step budget).
    trace: ``settings.trace``: when > 0, the ``[trace, batch, ...]`` outputs are split on their batch axis too.
    batched: A pytree of arrays passed after the scalars (the block engine's constraint tables), split over the batch
      axes on their first axis; None: no such argument.
    name: The caller, for the error message.
    accepted: The output carries verified decoding's ``accepted`` and ``sources`` counts ([batch, ...]).
  """
  if mesh is None:
    return jax.jit(fn)
  if param_shardings is None:
    raise ValueError(f"{name} on a mesh needs param_shardings (e.g. mercury_jax.trainer.param_shardings)")
  rules = sh.RULES if rules is None else rules
  rows, vectors = sh.batch_sharding(mesh, rules, 2), sh.batch_sharding(mesh, rules, 1)
  replicated = NamedSharding(mesh, P())
  traced_rows = traced_vectors = None
  if trace:
    traced_rows = NamedSharding(mesh, P(None, *sh.batch_spec(rules, 2)))
    traced_vectors = NamedSharding(mesh, P(None, *sh.batch_spec(rules, 1)))
  return sh.MeshJit(
    fn,
    mesh,
    rules,
    in_shardings=(
      param_shardings,
      Canvas(rows, rows, vectors),
      replicated,
      *[replicated] * scalars,
      *([] if batched is None else [jax.tree.map(lambda a: sh.batch_sharding(mesh, rules, a.ndim), batched)]),
    ),
    out_shardings=SampleOutput(
      rows, vectors, replicated, traced_rows, traced_vectors, traced_vectors, *[rows if accepted else None] * 2
    ),
  )


def mesh_context(mesh: Mesh, rules=None) -> contextlib.ExitStack:
  """``jax.set_mesh(mesh)`` with the model's logical axis rules (default ``sharding.RULES``), for tracing code of one's
  own around the model (the compiled samplers enter it themselves)."""
  return sh.context(mesh, sh.RULES if rules is None else rules)
