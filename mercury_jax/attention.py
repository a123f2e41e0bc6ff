"""The attention-implementation switch used by the model.

Layout everywhere is ``[batch, length, heads, head_dim]`` for queries and ``[batch, length, kv_heads, head_dim]``
for keys and values (grouped-query attention when ``kv_heads < heads``). ``segment_ids`` is ``[batch, length]``
int32, non-negative: a query attends only to keys of its own segment, and segment 0 marks padding. A padding query
sees nothing and every implementation returns zeros for it.

Masks (``mask=``; ``causal=True`` is shorthand for ``mask="causal"``), each a function of (query, key) positions
defined once in :mod:`mercury_jax.kernels.masks`: ``bidirectional``; ``causal``; ``block_causal``, where the query
at position ``i`` sees the keys ``j`` with ``j // diffusion_block <= i // diffusion_block``; and ``block_diffusion``,
BD3-LM's training mask over the concatenation ``x_t ⊕ x_0`` (the sequence's two halves, see ``masks``).

Implementations: ``xla`` (``jax.nn.dot_product_attention`` with a boolean mask; the default off GPU), ``pallas``
(our flash-attention kernel, ``mercury_jax.kernels.flash_attention``; the default on GPU, run in interpret mode
elsewhere) and ``cudnn`` (``jax.nn.dot_product_attention(implementation="cudnn")``; GPU, fp16/bf16 only).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import AxisType, PartitionSpec as P

from mercury_jax import sharding
from mercury_jax.kernels import flash_attention as fa, masks

IMPLEMENTATIONS = ("auto", "xla", "pallas", "cudnn")


def resolve_implementation(name: str) -> str:
  """Turns ``auto`` into the backend's best implementation: ``pallas`` on GPU, ``xla`` elsewhere."""
  if name not in IMPLEMENTATIONS:
    raise ValueError(f"attention implementation {name!r} must be one of {IMPLEMENTATIONS}")
  if name != "auto":
    return name
  return "pallas" if jax.default_backend() == "gpu" else "xla"


def _resolve_mask(causal: bool, mask: str | None, diffusion_block: int | None) -> str:
  if mask is None:
    mask = "causal" if causal else "bidirectional"
  elif causal and mask != "causal":
    raise ValueError(f"causal=True contradicts {mask=}; pass only one of them")
  if mask not in masks.MASKS:
    raise ValueError(f"{mask=} must be one of {masks.MASKS}")
  if (mask in ("block_causal", "block_diffusion")) != (diffusion_block is not None):
    raise ValueError(f"{diffusion_block=} must be given exactly for the block masks (got {mask=})")
  return mask


def _dense_mask(segment_ids: jax.Array | None, mask: str, diffusion_block: int | None, length: int):
  """``[batch or 1, 1, q, k]`` bool for ``jax.nn.dot_product_attention``, or None when nothing is masked."""
  if mask == "block_diffusion" and length % 2:
    raise ValueError(f"mask='block_diffusion' runs over x_t ⊕ x_0 and needs an even length, got {length=}")
  visible = None
  if mask != "bidirectional":
    visible = masks.dense(length, mask, block=diffusion_block, half=length // 2, xp=jnp)[None, None]
  if segment_ids is not None:
    same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]  # [batch, 1, q, k]
    visible = same if visible is None else visible & same
  return visible


def _zero_padding_rows(out: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
  """Padding queries (segment 0) output zeros, as the Pallas kernel defines them."""
  if segment_ids is None:
    return out
  return jnp.where((segment_ids != 0)[:, :, None, None], out, jnp.zeros((), out.dtype))


def _xla(q, k, v, segment_ids, mask, diffusion_block):
  dense = _dense_mask(segment_ids, mask, diffusion_block, q.shape[1])
  out = jax.nn.dot_product_attention(q, k, v, mask=dense, implementation="xla")
  return _zero_padding_rows(out, segment_ids)


def _cudnn(q, k, v, segment_ids, mask, diffusion_block):
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"implementation='cudnn' needs float16 or bfloat16 inputs, got {q.dtype}; use 'pallas' or 'xla'")
  if segment_ids is None and mask in ("bidirectional", "causal"):  # cuDNN's own causal mask skips masked tiles.
    return jax.nn.dot_product_attention(q, k, v, is_causal=mask == "causal", implementation="cudnn")
  # Segments and the block masks have no cuDNN mask type: they go in as a dense additive bias, O(batch * length^2).
  dense = _dense_mask(segment_ids, mask, diffusion_block, q.shape[1])
  out = jax.nn.dot_product_attention(q, k, v, mask=dense, implementation="cudnn")
  return _zero_padding_rows(out, segment_ids)


def _mesh_spec(logical: tuple[str, ...], shape: tuple[int, ...], mesh, rules) -> P:
  """The partition spec of ``logical`` under ``rules``, keeping only free mesh axes that divide each dimension."""
  free = {name for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True) if kind != AxisType.Manual}
  spec = []
  for axes, size in zip(nn.logical_to_mesh_axes(logical, rules), shape, strict=True):
    axes = tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ()) if a in free)
    if size % math.prod(mesh.shape[a] for a in axes):
      axes = ()
    spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return P(*spec)


def _pallas(q, k, v, segment_ids, mask, diffusion_block):
  kernel = functools.partial(
    fa.flash_attention, mask=mask, diffusion_block=diffusion_block, interpret=jax.default_backend() != "gpu"
  )
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return kernel(q, k, v, segment_ids=segment_ids)
  # A pallas_call cannot be partitioned by GSPMD, so the kernel runs per shard: batch over the data axes, heads over
  # `tensor`; length and head_dim stay whole.
  rules = nn.get_logical_axis_rules()
  q_spec = _mesh_spec((sharding.BATCH, sharding.LENGTH, sharding.ACT_HEADS, sharding.HEAD_DIM), q.shape, mesh, rules)
  kv_spec = _mesh_spec(
    (sharding.BATCH, sharding.LENGTH, sharding.ACT_KV_HEADS, sharding.HEAD_DIM), k.shape, mesh, rules
  )
  if q_spec[1] is not None or q_spec[3] is not None:
    raise ValueError(f"the pallas kernel needs whole sequences and head_dims; the rules shard q as {q_spec}")
  kv_spec = P(q_spec[0], None, kv_spec[2], None)  # The batch is split exactly like the queries'.
  seg_spec = P(q_spec[0], None)
  heads, kv_heads = q.shape[2], k.shape[2]
  head_axes = q_spec[2]
  if kv_spec[2] == head_axes:  # Each shard holds whole groups: local query head h reads local kv head h // groups.
    select_kv = None
  else:
    # kv_heads does not split like heads (say one kv head over two head shards): every shard gets all kv heads and
    # gathers the ones its query heads read; the shard_map transpose sums their gradients over the head shards.
    kv_spec = P(q_spec[0], None, None, None)
    local_heads = heads // math.prod(mesh.shape[a] for a in ((head_axes,) if isinstance(head_axes, str) else head_axes))

    def select_kv(x):
      first = jax.lax.axis_index(head_axes) * local_heads
      return jnp.take(x, (first + jnp.arange(local_heads)) // (heads // kv_heads), axis=2)  # [b, l, local, d]

  def per_shard(q, k, v, *segment_ids):
    if select_kv is not None:
      k, v = select_kv(k), select_kv(v)
    return kernel(q, k, v, segment_ids=segment_ids[0] if segment_ids else None)

  args, specs = (q, k, v), (q_spec, kv_spec, kv_spec)
  if segment_ids is not None:
    args, specs = args + (segment_ids,), specs + (seg_spec,)
  return jax.shard_map(per_shard, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=False)(*args)


def attend(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  causal: bool = False,
  segment_ids: jax.Array | None = None,
  implementation: str = "auto",
  mask: str | None = None,
  diffusion_block: int | None = None,
) -> jax.Array:
  """Scaled dot-product attention; returns ``[batch, length, heads, head_dim]`` in ``q.dtype``.

  Args:
    q: ``[batch, length, heads, head_dim]``.
    k: ``[batch, length, kv_heads, head_dim]``.
    v: like ``k``.
    causal: shorthand for ``mask="causal"``.
    segment_ids: optional int32 ``[batch, length]``; 0 marks padding (those queries output zeros).
    implementation: ``auto``, ``xla``, ``pallas`` or ``cudnn`` (see the module docstring).
    mask: ``bidirectional``, ``causal``, ``block_causal`` or ``block_diffusion``; None follows ``causal``.
    diffusion_block: block size of ``block_causal`` and ``block_diffusion``.
  """
  mask = _resolve_mask(causal, mask, diffusion_block)
  impl = resolve_implementation(implementation)
  fn = {"xla": _xla, "pallas": _pallas, "cudnn": _cudnn}[impl]
  return fn(q, k, v, segment_ids, mask, diffusion_block)
