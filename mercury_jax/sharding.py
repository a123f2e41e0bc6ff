"""Sharding by logical axis names: the names, the one rules table, and the mesh.

Parameters carry ``nn.with_logical_partitioning`` and activations ``nn.with_logical_constraint`` with the names
below; ``RULES`` maps them onto the mesh axes ``data``, ``fsdp``, ``sequence`` and ``tensor``. A config may override
single rules (``mesh.rules = ["vocab=", "mlp=tensor"]``). A single device is simply a mesh of size 1.

``sequence`` is context parallelism: the activations' ``length`` axis is split over it, and attention runs across the
shards (:mod:`mercury_jax.kernels.context_parallel`). It sits between ``fsdp`` and ``tensor`` in the device order,
so that on a real slice the shards of one sequence are near neighbours, after the tensor-parallel group.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from mercury_jax.config import ConfigError, MeshConfig

MESH_AXES = ("data", "fsdp", "sequence", "tensor")
DATA_AXES = ("data", "fsdp")  # The batch is split over both; fsdp additionally shards parameters.
SEQUENCE_AXIS = "sequence"  # The activations' length is split over it (context parallelism).

# Logical axis names: parameters.
EMBED = "embed"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
VOCAB = "vocab"
LAYERS = "layers"
# Logical axis names: activations.
BATCH = "batch"
LENGTH = "length"
ACT_EMBED = "activation_embed"
ACT_HEADS = "activation_heads"
ACT_KV_HEADS = "activation_kv_heads"
ACT_MLP = "activation_mlp"
ACT_VOCAB = "activation_vocab"

RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
  (BATCH, DATA_AXES),
  (LENGTH, SEQUENCE_AXIS),
  (EMBED, "fsdp"),
  (HEADS, "tensor"),
  (KV_HEADS, "tensor"),
  (HEAD_DIM, None),
  (MLP, "tensor"),
  (VOCAB, "tensor"),
  (LAYERS, None),
  (ACT_EMBED, None),
  (ACT_HEADS, "tensor"),
  (ACT_KV_HEADS, "tensor"),
  (ACT_MLP, "tensor"),
  (ACT_VOCAB, "tensor"),
)


def axis_rules(mesh_cfg: MeshConfig | None = None) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
  """The rules table with the config's single-rule overrides applied."""
  rules = dict(RULES)
  for item in mesh_cfg.rules if mesh_cfg else ():
    logical, sep, target = item.partition("=")
    if not sep or logical not in rules:
      raise ConfigError(f"mesh.rules entry {item!r} must be 'logical=axis[+axis]' with logical one of {sorted(rules)}")
    axes = tuple(a for a in target.split("+") if a)
    for axis in axes:
      if axis not in MESH_AXES:
        raise ConfigError(f"mesh.rules entry {item!r} names mesh axis {axis!r}; mesh axes are {MESH_AXES}")
    rules[logical] = None if not axes else axes[0] if len(axes) == 1 else axes
  return tuple(rules.items())


def mesh_shape(mesh_cfg: MeshConfig, num_devices: int) -> tuple[int, int, int, int]:
  """Resolves the -1 entry of the configured mesh and checks the product against ``num_devices``; the sizes in
  :data:`MESH_AXES` order ``(data, fsdp, sequence, tensor)``."""
  shape = [mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.sequence, mesh_cfg.tensor]
  named = ", ".join(f"{a}={s}" for a, s in zip(MESH_AXES, shape, strict=True))
  if any(s == 0 or s < -1 for s in shape) or shape.count(-1) > 1:
    raise ConfigError(f"mesh ({named}) needs positive sizes and at most one -1")
  if -1 in shape:
    known = math.prod(s for s in shape if s != -1)
    if num_devices % known:
      raise ConfigError(
        f"mesh ({named}): the product {known} of the known sizes does not divide the {num_devices} available devices"
      )
    shape[shape.index(-1)] = num_devices // known
  if math.prod(shape) != num_devices:
    raise ConfigError(
      f"mesh ({named}) needs {math.prod(shape)} devices but {num_devices} are available; set mesh.data=-1 or sizes "
      f"whose product is {num_devices}"
    )
  return tuple(shape)  # type: ignore[return-value]


def make_mesh(mesh_cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the ``(data, fsdp, sequence, tensor)`` mesh (Auto axis types, as Flax linen's constraints require)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(mesh_cfg, len(devices))
  auto = (AxisType.Auto,) * len(MESH_AXES)
  if devices == list(jax.devices()):
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto)
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=auto)


def mesh_from_flag(spec: str | None) -> Mesh:
  """The mesh of a command's ``--mesh`` flag: ``DATA,FSDP,TENSOR`` or ``DATA,FSDP,SEQUENCE,TENSOR`` (None: every
  device on the data axis).

  Raises:
    ConfigError: The flag is not three or four integers, or its sizes do not fit the devices.
  """
  if spec is None:
    return make_mesh(MeshConfig(data=-1))
  try:
    sizes = [int(v) for v in spec.split(",")]
  except ValueError:
    sizes = []
  if len(sizes) not in (3, 4):
    raise ConfigError(
      f"--mesh {spec!r} must be three integers DATA,FSDP,TENSOR or four DATA,FSDP,SEQUENCE,TENSOR, e.g. 4,1,2 or "
      "2,1,2,2"
    )
  if len(sizes) == 3:
    sizes.insert(2, 1)
  data, fsdp, sequence, tensor = sizes
  return make_mesh(MeshConfig(data=data, fsdp=fsdp, sequence=sequence, tensor=tensor))


def mesh_spec(logical: tuple[str | None, ...], shape: tuple[int, ...], mesh, rules) -> P:
  """The partition spec of an array of ``shape`` with the logical axes ``logical`` under ``rules``, keeping only the
  mesh axes that are not manual (inside a ``shard_map``), have more than one device and divide their dimension."""
  free = {
    name
    for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
    if kind != AxisType.Manual and mesh.shape[name] > 1
  }
  spec = []
  for axes, size in zip(nn.logical_to_mesh_axes(logical, rules), shape, strict=True):
    axes = tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ()) if a in free)
    if size % math.prod(mesh.shape[a] for a in axes):
      axes = ()
    spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return P(*spec)


def constrain(x: jax.Array, logical: tuple[str | None, ...]) -> jax.Array:
  """``nn.with_logical_constraint`` for arrays whose sizes the mesh may not divide: each dimension is split over the
  mesh axes its logical name maps to only where they divide it (:func:`mesh_spec`). A no-op outside a mesh and
  rules context."""
  mesh, rules = jax.sharding.get_abstract_mesh(), nn.get_logical_axis_rules()
  if mesh.empty or not rules:
    return x
  return jax.lax.with_sharding_constraint(x, mesh_spec(logical, x.shape, mesh, rules))


def logical_to_sharding(logical_specs, mesh: Mesh, rules) -> object:
  """Maps a pytree of logical ``PartitionSpec``s to ``NamedSharding``s on ``mesh``."""
  return nn.logical_to_mesh_sharding(logical_specs, mesh, rules)


def batch_spec(rules, ndim: int) -> P:
  """The partition spec of a ``[batch, length, ...]`` input: batch over the data axes, the rest replicated."""
  (spec,) = nn.logical_to_mesh_axes((BATCH,), rules)
  return P(spec, *([None] * (ndim - 1)))


def batch_sharding(mesh: Mesh, rules, ndim: int = 2) -> NamedSharding:
  return NamedSharding(mesh, batch_spec(rules, ndim))


def sequence_shards(mesh: Mesh, rules) -> int:
  """How many ways the activations' length is split on ``mesh`` (1: no context parallelism)."""
  (spec,) = nn.logical_to_mesh_axes((LENGTH,), rules)
  axes = (spec,) if isinstance(spec, str) else (spec or ())
  return math.prod(mesh.shape[a] for a in axes if a in mesh.shape)


def data_parallel_size(mesh: Mesh, rules) -> int:
  """How many ways the batch axis is split on ``mesh``."""
  (spec,) = nn.logical_to_mesh_axes((BATCH,), rules)
  axes = (spec,) if isinstance(spec, str) else (spec or ())
  return math.prod(mesh.shape[a] for a in axes)


def context(mesh: Mesh, rules) -> contextlib.ExitStack:
  """``jax.set_mesh(mesh)`` together with the logical axis ``rules``: what tracing a sharded program needs.

  Without both, Flax's ``nn.with_logical_constraint`` is a no-op, and GSPMD is left to guess the activations'
  shardings (and can disagree with the parameters', replicating tensors to convert between them).
  """
  stack = contextlib.ExitStack()
  stack.enter_context(jax.set_mesh(mesh))
  stack.enter_context(nn.logical_axis_rules(rules))
  return stack


class MeshJit:
  """``jax.jit(fn, **kwargs)`` that is always traced, lowered and called inside :func:`context`.

  The logical axis rules are thread-local state that ``jax.jit``'s cache does not key on, so a jitted step traced
  once outside the context would keep running unconstrained. Wrapping the jitted function makes the constraints
  part of the step itself, whoever calls it.
  """

  def __init__(self, fn: Callable[..., Any], mesh: Mesh, rules, **jit_kwargs):
    self.mesh, self.rules = mesh, rules
    self.jitted = jax.jit(fn, **jit_kwargs)

  def __call__(self, *args):
    with context(self.mesh, self.rules):
      return self.jitted(*args)

  def lower(self, *args):
    with context(self.mesh, self.rules):
      return self.jitted.lower(*args)
