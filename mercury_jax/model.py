"""The transformer denoiser: ``(tokens[, t]) -> logits``. It knows nothing about diffusion.

Pre-norm RMSNorm blocks with rotary position embeddings, multi-head or grouped-query attention and a SwiGLU MLP;
layers are stacked with ``nn.scan`` (one compiled block, a leading ``layers`` axis on every block parameter).
Parameters are float32; activations use ``ModelConfig.dtype``. Every parameter carries logical axis names and
activations are constrained at block edges, so the same module runs on one device or any mesh.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import Mesh

from mercury_jax import sharding as sh
from mercury_jax.attention import CachedInputs, attend, attend_cached
from mercury_jax.batch_invariance import Tiling, by_rows, positionwise, tiled
from mercury_jax.config import ModelConfig, dtype_of
from mercury_jax.kernels.context_parallel import SequenceLayout
from mercury_jax.kvcache import KVCache, PagedKVCache
from mercury_jax.rope import rotary

_INIT = nn.initializers.normal(stddev=0.02)


def dense(x: jax.Array, w: jax.Array, contract: int = 1, tiling: Tiling | None = None) -> jax.Array:
  """Contracts the last ``contract`` dims of ``x`` with the first ``contract`` dims of ``w``, as one 2-D matmul
  (under ``tiling``, one per tile of positions: :func:`~mercury_jax.batch_invariance.tiled`).

  ``[..., *in] @ [*in, *out] -> [..., *out]``. Flattening to ``[tokens, in] @ [in, out]`` keeps the backward pass's
  weight gradient a plain matmul: XLA:CPU runs the 3-D ``bld,blm->dm`` contraction about 1.6x slower.
  """
  lead, inner, out = x.shape[: x.ndim - contract], x.shape[x.ndim - contract :], w.shape[contract:]
  w = w.reshape(math.prod(inner), math.prod(out))
  y = tiled(lambda rows: rows @ w, tiling, x.reshape(math.prod(lead), math.prod(inner)))
  return y.reshape(*lead, *out)


def _param(
  module: nn.Module, name: str, shape: tuple[int, ...], axes: tuple[str, ...], init=_INIT, dtype=jnp.float32
) -> jax.Array:
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


class RMSNorm(nn.Module):
  eps: float
  dtype: jnp.dtype
  param_dtype: jnp.dtype = jnp.float32
  axis: str = sh.EMBED  # The logical axis of the normalised (last) dimension.
  tiling: Tiling | None = None

  @nn.compact
  def __call__(self, x: jax.Array, then: Callable[[jax.Array], Any] | None = None) -> Any:
    """``x`` normalised over its last axis, or ``then`` of it: a position-wise function (the next layer's
    projections), which a tiling runs over the same tiles; its outputs keep ``x``'s leading axes."""
    scale = _param(self, "scale", (x.shape[-1],), (self.axis,), nn.initializers.ones, self.param_dtype)

    def norm(rows: jax.Array) -> Any:  # [..., dim]
      x32 = rows.astype(jnp.float32)
      normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
      normed = (normed * scale.astype(jnp.float32)).astype(self.dtype)
      return normed if then is None else then(normed)

    return positionwise(norm, self.tiling, x)


class Attention(nn.Module):
  """Multi-head / grouped-query self-attention under ``mask``; given a cache, over the cache and the chunk together."""

  config: ModelConfig
  mask: str = "bidirectional"
  diffusion_block: int | None = None
  layout: SequenceLayout | None = None  # The sequence split over the `sequence` mesh axis (context parallelism).
  tiling: Tiling | None = None

  @nn.compact
  def __call__(
    self,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array | None,
    cache: tuple[jax.Array, ...] | None,
    norm: RMSNorm | None = None,
  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """``(output [batch, length, embed], (keys, values) of this chunk)``; ``cache``: this layer's index, every
    layer's cached keys and values (:class:`KVCache`; pools of pages for a :class:`PagedKVCache`), then a paged
    cache's table, the cache's segments and each row's first slot of the chunk. ``norm``: the pre-norm of ``x``."""
    cfg, dtype, pdt = self.config, dtype_of(self.config.dtype), dtype_of(self.config.param_dtype)
    d, h, kv, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def weights(name: str, heads: int, heads_axis: str) -> tuple[jax.Array, jax.Array | None]:
      w = _param(self, name, (d, heads, hd), (sh.EMBED, heads_axis, sh.HEAD_DIM), dtype=pdt).astype(dtype)
      bias = None
      if cfg.qkv_bias:
        bias = _param(self, f"{name}_bias", (heads, hd), (heads_axis, sh.HEAD_DIM), nn.initializers.zeros, pdt)
      return w, bias

    # Parameters are created in this order (query, key, value, out): Flax derives each one's init key from it.
    projections = (weights("query", h, sh.HEADS), weights("key", kv, sh.KV_HEADS), weights("value", kv, sh.KV_HEADS))

    def project(rows: jax.Array) -> tuple[jax.Array, ...]:  # [..., embed] -> [..., heads, head_dim] each
      return tuple(dense(rows, w) if b is None else dense(rows, w) + b.astype(dtype) for w, b in projections)

    # [batch, length, heads or kv_heads, head_dim]; under a tiling, the norm and the projections in one tile program
    q, k, v = positionwise(project, self.tiling, x) if norm is None else norm(x, then=project)
    if cfg.qk_norm:
      q = RMSNorm(cfg.norm_eps, dtype, pdt, sh.HEAD_DIM, self.tiling, name="query_norm")(q)
      k = RMSNorm(cfg.norm_eps, dtype, pdt, sh.HEAD_DIM, self.tiling, name="key_norm")(k)
    w_o = _param(
      self,
      "out",
      (h, hd, d),
      (sh.HEADS, sh.HEAD_DIM, sh.EMBED),
      nn.initializers.normal(stddev=0.02 / math.sqrt(2 * cfg.num_layers)),
      pdt,
    ).astype(dtype)
    length = _length_axis(self.layout)
    q = nn.with_logical_constraint(rotary(q, positions, cfg), (sh.BATCH, length, sh.ACT_HEADS, sh.HEAD_DIM))
    k = nn.with_logical_constraint(rotary(k, positions, cfg), (sh.BATCH, length, sh.ACT_KV_HEADS, sh.HEAD_DIM))
    v = nn.with_logical_constraint(v, (sh.BATCH, length, sh.ACT_KV_HEADS, sh.HEAD_DIM))
    out = nn.with_logical_constraint(
      self._attend(q, k, v, segment_ids, cache), (sh.BATCH, length, sh.ACT_HEADS, sh.HEAD_DIM)
    )
    return dense(out, w_o, contract=2, tiling=self.tiling), (k, v)  # [batch, length, embed]

  def _attend(self, q, k, v, segment_ids, cache) -> jax.Array:
    """The attention of the queries ``q`` over the chunk's keys and values (and the cache), ``[batch, length, heads,
    head_dim]``; under a tiling, batch-invariant (a whole-sequence pass row by row; ``attend_cached(tiling=)``)."""
    cfg = self.config
    if cache is None:

      def whole(q, k, v, segment_ids):
        return attend(
          q,
          k,
          v,
          segment_ids=segment_ids,
          implementation=cfg.attention,
          mask=self.mask,
          diffusion_block=self.diffusion_block,
          layout=self.layout,
          context_parallel=cfg.context_parallel,
        )

      args = (q, k, v, segment_ids)
      return whole(*args) if self.tiling is None else by_rows(whole, self.tiling.shards, *args)
    layer, cache_k, cache_v, *paged, cache_segments, starts = cache  # A paged cache: pools, then the tables.
    segment_ids = jnp.ones(q.shape[:2], jnp.int32) if segment_ids is None else segment_ids
    return attend_cached(
      CachedInputs(q, k, v, segment_ids, cache_k, cache_v, cache_segments, starts),
      mask=self.mask,
      diffusion_block=self.diffusion_block,
      implementation=cfg.attention,
      table=paged[0] if paged else None,
      layer=layer,
      tiling=self.tiling,
    )


class SwiGLU(nn.Module):
  """The block's MLP; with ``width``, the draft-only MLP (``ModelConfig.draft_mlp``), whose down projection starts at
  zero so that a model given one computes what it computed before until the drafter is trained."""

  config: ModelConfig
  layout: SequenceLayout | None = None
  tiling: Tiling | None = None
  width: int | None = None

  @nn.compact
  def __call__(self, x: jax.Array, norm: RMSNorm | None = None) -> jax.Array:
    """The MLP of ``x`` (``norm``: its pre-norm; under a tiling the norm and the MLP run in one tile program)."""
    cfg, dtype, pdt = self.config, dtype_of(self.config.dtype), dtype_of(self.config.param_dtype)
    width = cfg.mlp_dim if self.width is None else self.width
    w_gate = _param(self, "gate", (cfg.d_model, width), (sh.EMBED, sh.MLP), dtype=pdt).astype(dtype)
    w_up = _param(self, "up", (cfg.d_model, width), (sh.EMBED, sh.MLP), dtype=pdt).astype(dtype)
    down_init = nn.initializers.normal(stddev=0.02 / math.sqrt(2 * cfg.num_layers))
    w_down = _param(
      self,
      "down",
      (width, cfg.d_model),
      (sh.MLP, sh.EMBED),
      down_init if self.width is None else nn.initializers.zeros,
      pdt,
    ).astype(dtype)

    def mlp(rows: jax.Array) -> jax.Array:  # [..., embed]
      hidden = jax.nn.silu(dense(rows, w_gate)) * dense(rows, w_up)  # [..., mlp]
      if self.tiling is None:
        hidden = nn.with_logical_constraint(hidden, (sh.BATCH, _length_axis(self.layout), sh.ACT_MLP))
      return dense(hidden, w_down)

    return positionwise(mlp, self.tiling, x) if norm is None else norm(x, then=mlp)


class Block(nn.Module):
  """One pre-norm transformer block; the signature fits ``nn.scan`` (carry in, carry and this layer's keys and values
  out)."""

  config: ModelConfig
  mask: str = "bidirectional"
  diffusion_block: int | None = None
  return_kv: bool = False
  layout: SequenceLayout | None = None
  tiling: Tiling | None = None

  @nn.compact
  def __call__(
    self,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array | None,
    layer_cache,
    cache_rest,
    drafting: jax.Array | None = None,
  ):
    """``drafting``: ``[batch, length]`` bool, the positions the draft-only MLP updates (``ModelConfig.draft_mlp``)."""
    cfg, dtype, pdt, tiling = self.config, dtype_of(self.config.dtype), dtype_of(self.config.param_dtype), self.tiling
    activation = (sh.BATCH, _length_axis(self.layout), sh.ACT_EMBED)
    x = nn.with_logical_constraint(x, activation)
    cache = None if layer_cache is None else (layer_cache, *cache_rest)
    attention_norm = RMSNorm(cfg.norm_eps, dtype, pdt, tiling=tiling, name="attention_norm")
    attended, kv = Attention(cfg, self.mask, self.diffusion_block, self.layout, tiling, name="attention")(
      x, positions, segment_ids, cache, norm=attention_norm
    )
    x = x + attended
    x = x + SwiGLU(cfg, self.layout, tiling, name="mlp")(
      x, norm=RMSNorm(cfg.norm_eps, dtype, pdt, tiling=tiling, name="mlp_norm")
    )
    if cfg.draft_mlp:

      def draft(block: Block, x: jax.Array) -> jax.Array:
        return SwiGLU(cfg, block.layout, block.tiling, width=cfg.draft_mlp, name="draft_mlp")(
          x, norm=RMSNorm(cfg.norm_eps, dtype, pdt, tiling=block.tiling, name="draft_norm")
        )

      # Run only when some position drafts: a pass with no [MASK] (AR decoding, prompt lookup alone) pays nothing.
      # Both branches name the same parameters (Flax's lifted cond needs one structure); XLA drops the other's math.
      update = nn.cond(drafting.any(), draft, lambda block, x: jnp.zeros_like(draft(block, x)), self, x)
      x = jnp.where(drafting[..., None], x + update, x)  # Elsewhere x itself, bitwise.
    return nn.with_logical_constraint(x, activation), kv if self.return_kv else None


def _length_axis(layout: SequenceLayout | None) -> str | None:
  """The logical name of the activations' length axis: split over ``sequence`` only in a context-parallel pass (a
  pass over a cache, or a length the shards do not divide, keeps its whole length on every shard)."""
  return sh.LENGTH if layout is not None else None


def sequence_layout(length: int, mask: str) -> SequenceLayout | None:
  """How a pass of ``length`` positions under ``mask`` splits over the ``sequence`` mesh axis of the mesh and rules in
  context (:func:`mercury_jax.sharding.context`): zig-zag for the masks whose work grows along the sequence (when
  ``2 * shards`` divides ``length``), else contiguous; None without a sequence axis, or when its shards do not divide
  ``length`` (the pass then runs whole on every shard of the axis)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return None
  shards = sh.sequence_shards(mesh, nn.get_logical_axis_rules())
  if shards <= 1:
    return None
  for kind in ("contiguous",) if mask == "bidirectional" else ("zigzag", "contiguous"):
    layout = SequenceLayout(shards, kind)
    if layout.divides(length):
      return layout
  return None


def timestep_embedding(t: jax.Array, dim: int, max_period: float = 10_000.0) -> jax.Array:
  """Sinusoidal features of t in [0, 1] (scaled by 1000, as in DDPM-style embeddings): [...] -> [..., dim]."""
  half = dim // 2
  freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
  args = 1000.0 * t.astype(jnp.float32)[..., None] * freqs
  return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


def normalised_latents(table: jax.Array) -> jax.Array:
  """The continuous family's token latents: every row of ``table`` [vocab, d] scaled to L2 norm sqrt(d), i.e. unit
  variance per dimension (CDCD), so that a noise scale sigma means the same for every token and every width."""
  table = table.astype(jnp.float32)
  norm = jnp.sqrt(jnp.sum(table * table, axis=-1, keepdims=True) + 1e-12)
  return table * (math.sqrt(table.shape[-1]) / norm)


# The continuous family's learnable noise schedules (objectives.continuous): CDCD's warp, a piecewise-linear
# unnormalised CDF over WARP_BINS equal bins of normalised log sigma ([offset, log scale, bin logits...]), and
# LangFlow's Gumbel CDF ([offset, log scale, location, log width]).
WARP_BINS = 32
# The parameters a model with ``latent_dim > 0`` adds to the same network: a continuous model can start from a
# discrete one's weights (``train --init-from``), these starting from their initialisation.
LATENT_PARAMS = (
  "latent_embedding", "latent_in", "self_cond_in", "noise_in", "noise_out", "noise_warp", "noise_gumbel",
)  # fmt: skip
# The parameters ``draft_mlp > 0`` adds to every block (``blocks/<name>/...``): a verified model can start from one
# without them (``train --init-from``), these from their initialisation, and train alone (``train.trainable``).
DRAFT_PARAMS = ("draft_mlp", "draft_norm")


def is_draft_param(path: tuple[str, ...]) -> bool:
  """Whether the parameter at ``path`` (its names, e.g. ``("blocks", "draft_mlp", "up")``) is a draft-only one."""
  return len(path) > 1 and path[0] == "blocks" and path[1] in DRAFT_PARAMS


class Transformer(nn.Module):
  """Maps tokens ``[batch, length]`` (and optionally ``t`` of shape ``[batch]``) to float32 logits.

  Attributes:
    config: The network.
    tiling: Batch-invariant execution (:mod:`mercury_jax.batch_invariance`): a row's outputs do not depend on the
      rows beside it, bitwise. None: batched (training, ``Sampler``).
  """

  config: ModelConfig
  tiling: Tiling | None = None

  @nn.compact
  def __call__(
    self,
    tokens: jax.Array,
    t: jax.Array | None = None,
    *,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    mask: str | None = None,
    diffusion_block: int | None = None,
    logits_length: int | None = None,
    cache: KVCache | PagedKVCache | None = None,
    cache_start: jax.Array | None = None,
    return_kv: bool = False,
    latents: jax.Array | None = None,
    noise_level: jax.Array | None = None,
    self_cond: jax.Array | None = None,
    latent_params: bool = False,
  ) -> Any:
    """Logits for ``tokens``.

    Args:
      tokens: ``[batch, length]`` int32.
      t: ``[batch]`` diffusion time, used only when ``config.time_conditioning``.
      segment_ids: ``[batch, length]`` int32; attention stays within a segment and segment 0 is padding.
      positions: ``[batch, length]`` rotary positions (default ``0 .. length-1``).
      mask: the attention mask (:mod:`mercury_jax.kernels.masks`); default ``causal`` for a causal model and
        ``bidirectional`` otherwise. ``block_diffusion`` runs BD3-LM's vectorised training pass over
        ``x_t ⊕ x_0`` (``tokens`` holds both halves). With ``cache``, the mask applies to cache slots.
      diffusion_block: block size of the ``block_causal`` and ``block_diffusion`` masks.
      logits_length: compute logits for the first ``logits_length`` positions only (the noisy half of a
        ``block_diffusion`` pass: the clean half's logits are never used, and the output head is most of a small
        model's compute).
      cache: a :class:`KVCache` the chunk also attends to (decoding): the chunk sits at slots ``cache_start[r] ...``
        of row ``r``; its queries see the cached keys that ``mask`` allows in slot space and that share their
        segment, except the cache's own slots of the chunk, whose keys and values are the chunk's (the cache is read,
        never written: :meth:`KVCache.write`).
      cache_start: with ``cache``, ``[batch]`` (or ``[]``) int32: each row's first slot of the chunk.
      return_kv: also return the chunk's keys and values (a :class:`KVCache` of ``length`` slots whose segments are
        ``segment_ids``), e.g. to write them into a cache.
      latents: ``[batch, length, latent_dim]`` noisy token latents (``config.latent_dim > 0``; the continuous
        family): where ``noise_level > 0`` a position reads ``latents * c_in`` (EDM's ``c_in = 1 / sqrt(sigma^2 +
        1)``) through the ``latent_in`` projection, plus features of ``log(sigma) / 4``, instead of its token's
        embedding; positions at noise level 0 are clean tokens (context, a prompt).
      noise_level: ``[batch, length]`` sigma of every position (0: clean), with ``latents``.
      self_cond: ``[batch, length, latent_dim]`` the previous estimate of the clean latents (self-conditioning),
        added through the ``self_cond_in`` projection at noisy positions; default none (zeros).
      latent_params: return only ``{"table": normalised latents [vocab, latent_dim], "warp": [...], "gumbel":
        [...]}`` (the latent table and the learnable noise schedules' parameters, ``objectives.continuous``).

    Returns:
      ``[batch, length, vocab]`` float32 logits (``[batch, logits_length, vocab]`` with ``logits_length``), and with
      ``return_kv`` the chunk's :class:`KVCache`.
    """
    cfg, dtype, pdt = self.config, dtype_of(self.config.dtype), dtype_of(self.config.param_dtype)
    batch, length = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    if mask is None:
      mask = "causal" if cfg.causal else "bidirectional"
    clean_segments = segment_ids
    # Context parallelism: every per-position input enters in the layout's order (split over `sequence` from the
    # first constraint on), and the last hidden state, the keys and values leave in the natural one.
    layout = sequence_layout(length, mask) if cache is None and not latent_params else None
    tiling = self.tiling
    if tiling is not None and layout is not None:
      raise ValueError(
        "a batch-invariant pass (tiling) runs no context-parallel whole-sequence pass; use a mesh without a "
        "`sequence` axis, or batched execution (the server's --no-batch-invariance)"
      )
    if layout is not None:
      tokens, positions, segment_ids, latents, noise_level, self_cond = (
        None if a is None else layout.to_layout(a, 1)
        for a in (tokens, positions, segment_ids, latents, noise_level, self_cond)
      )
    length_axis = _length_axis(layout)
    embedding = _param(
      self, "embedding", (cfg.vocab_size, cfg.d_model), (sh.VOCAB, sh.EMBED), nn.initializers.normal(1.0), pdt
    )
    if cfg.latent_dim:
      raw_latents = _param(
        self, "latent_embedding", (cfg.vocab_size, cfg.latent_dim), (sh.VOCAB, None), nn.initializers.normal(1.0)
      )
      schedules = {
        "warp": self.param("noise_warp", nn.initializers.zeros, (2 + WARP_BINS,), jnp.float32),
        "gumbel": self.param("noise_gumbel", nn.initializers.zeros, (4,), jnp.float32),
      }
      if latent_params:
        return {"table": normalised_latents(raw_latents), **schedules}
    elif latents is not None or latent_params:
      raise ValueError("latents need a model with model.latent_dim > 0")
    # Gather from a replicated table: a gather from a vocab- and fsdp-sharded table makes GSPMD replicate its output.
    table = nn.with_logical_constraint(embedding, (None, sh.ACT_EMBED))
    x = jnp.take(table, tokens, axis=0).astype(dtype)  # [batch, length, embed]
    if cfg.latent_dim:
      x = self._latent_inputs(x, latents, noise_level, self_cond, dtype)
    if cfg.time_conditioning:
      if t is None:
        raise ValueError("model.time_conditioning=true needs t of shape [batch]")
      w_t = _param(self, "time_in", (cfg.d_model, cfg.d_model), (sh.EMBED, sh.MLP))
      w_t2 = _param(self, "time_out", (cfg.d_model, cfg.d_model), (sh.MLP, sh.EMBED), nn.initializers.zeros)
      t_emb = dense(jax.nn.silu(dense(timestep_embedding(t, cfg.d_model), w_t, tiling=tiling)), w_t2, tiling=tiling)
      x = x + t_emb[:, None, :].astype(dtype)
    x = nn.with_logical_constraint(x, (sh.BATCH, length_axis, sh.ACT_EMBED))

    layer_cache, cache_rest = None, None
    if cache is not None:
      if cache_start is None:
        raise ValueError("a pass over a cache needs cache_start, each row's first slot of the chunk")
      layer_cache, stacked = cache.layers()  # the layer index, scanned; every layer's keys and values (and table)
      cache_rest = (*stacked, cache.segments, jnp.broadcast_to(jnp.asarray(cache_start, jnp.int32), (batch,)))
    block = Block
    if cfg.remat:
      block = nn.remat(block, prevent_cse=False, policy=jax.checkpoint_policies.nothing_saveable)
    stack = nn.scan(
      functools.partial(
        block, mask=mask, diffusion_block=diffusion_block, return_kv=return_kv, layout=layout, tiling=tiling
      ),
      variable_axes={"params": 0},
      split_rngs={"params": True},
      in_axes=(nn.broadcast, nn.broadcast, 0, nn.broadcast, nn.broadcast),
      length=cfg.num_layers,
      unroll=cfg.num_layers if cfg.unroll_layers else 1,
      metadata_params={nn.PARTITION_NAME: sh.LAYERS},
    )
    drafting = tokens == cfg.draft_token if cfg.draft_mlp else None  # In the layout's order, as x.
    x, kv = stack(cfg, name="blocks")(x, positions, segment_ids, layer_cache, cache_rest, drafting)
    if layout is not None:
      x = layout.to_natural(x, 1, (sh.BATCH, sh.LENGTH, sh.ACT_EMBED))
      kv_axes = (None, sh.BATCH, sh.LENGTH, sh.ACT_KV_HEADS, sh.HEAD_DIM)  # [layers, batch, length, ...]
      kv = None if kv is None else tuple(layout.to_natural(a, 2, kv_axes) for a in kv)
    if logits_length is not None:
      x = x[:, :logits_length]
    x = RMSNorm(cfg.norm_eps, dtype, pdt, tiling=tiling, name="final_norm")(x)
    if cfg.tie_embeddings:
      tied = embedding.astype(dtype)
      logits = positionwise(lambda rows: jnp.einsum("...d,vd->...v", rows, tied), tiling, x)  # [batch, length, vocab]
      if cfg.scale_tied_logits:
        logits = logits / math.sqrt(cfg.d_model)
    else:
      head = _param(self, "head", (cfg.d_model, cfg.vocab_size), (sh.EMBED, sh.VOCAB), dtype=pdt).astype(dtype)
      logits = dense(x, head, tiling=tiling)  # [batch, length, vocab]
    split = layout is not None and logits.shape[1] % layout.shards == 0
    logits = nn.with_logical_constraint(
      logits.astype(jnp.float32), (sh.BATCH, length_axis if split else None, sh.ACT_VOCAB)
    )
    if not return_kv:
      return logits
    segments = jnp.ones((batch, length), jnp.int32) if clean_segments is None else clean_segments.astype(jnp.int32)
    return logits, KVCache(kv[0], kv[1], segments)  # keys and values [layers, batch, length, kv_heads, head_dim]

  def _latent_inputs(self, x, latents, noise_level, self_cond, dtype) -> jax.Array:
    """``x`` (the tokens' embeddings) with every noisy position's input replaced by its latent (see ``latents``)."""
    cfg = self.config
    d, k = cfg.d_model, cfg.latent_dim
    w_in = _param(self, "latent_in", (k, d), (None, sh.EMBED))
    w_self = _param(self, "self_cond_in", (k, d), (None, sh.EMBED), nn.initializers.zeros)
    w_n1 = _param(self, "noise_in", (d, d), (sh.EMBED, sh.MLP))
    w_n2 = _param(self, "noise_out", (d, d), (sh.MLP, sh.EMBED), nn.initializers.zeros)
    batch, length = x.shape[:2]
    if latents is None:  # A token-only pass (initialisation, a prompt): every position is clean.
      latents, noise_level = jnp.zeros((batch, length, k), jnp.float32), jnp.zeros((batch, length), jnp.float32)
    if noise_level is None:
      raise ValueError("latents need noise_level, [batch, length] sigma per position (0: a clean token)")
    sigma = noise_level.astype(jnp.float32)
    noisy = sigma > 0
    safe = jnp.where(noisy, sigma, 1.0)
    c_in = jax.lax.rsqrt(safe * safe + 1.0)[..., None]
    tiling = self.tiling
    h = dense((latents.astype(jnp.float32) * c_in).astype(dtype), w_in.astype(dtype), tiling=tiling)
    features = timestep_embedding(jnp.log(safe) / 40.0, d)  # log(sigma) / 4 (EDM's c_noise), at timestep scale 100
    noise = jax.nn.silu(dense(features.astype(dtype), w_n1.astype(dtype), tiling=tiling))
    h = h + dense(noise, w_n2.astype(dtype), tiling=tiling)
    if self_cond is not None:
      h = h + dense(self_cond.astype(dtype), w_self.astype(dtype), tiling=tiling)
    return jnp.where(noisy[..., None], h, x)


def init_params(model: Transformer, key: jax.Array):
  """The model's parameters (boxed with their logical axis names), initialised from ``key``."""
  cfg = model.config
  tokens = jnp.zeros((1, cfg.max_length), jnp.int32)
  t = jnp.zeros((1,), jnp.float32) if cfg.time_conditioning else None
  return model.init(key, tokens, t)["params"]


@functools.lru_cache(maxsize=16)
def _boxed_shapes(cfg: ModelConfig):
  """The parameters' shapes with their logical axis names (traced once per config: a trace of the whole model)."""
  return jax.eval_shape(functools.partial(init_params, Transformer(cfg)), jax.random.key(0))


def param_shardings(model: Transformer, mesh: Mesh, rules) -> Any:
  """The parameters' ``NamedSharding``s on ``mesh``, from their logical axis names (no parameters are built)."""
  return nn.logical_to_mesh_sharding(nn.get_partition_spec(_boxed_shapes(model.config)), mesh, rules)


def abstract_params(model: Transformer, mesh: Mesh, rules) -> Any:
  """Shape, dtype and sharding of the parameters: a restore target for inference."""
  boxed = _boxed_shapes(model.config)
  return jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
    nn.meta.unbox(boxed),
    param_shardings(model, mesh, rules),
  )


def count_params(params) -> int:
  return sum(math.prod(p.shape) for p in jax.tree.leaves(params))


def flops_per_token(
  cfg: ModelConfig, num_params: int, training: bool = True, doubled: bool = False, head_halves: int = 1
) -> float:
  """Matmul FLOPs per token: 6N + 12·layers·length·heads·head_dim for training, a third of it for a forward pass.

  N excludes the embedding table (a gather, not a matmul) but includes the output head (Kaplan et al. 2020).
  ``doubled``: block diffusion's vectorised pass, whose layers run ``x_t ⊕ x_0`` (each data token twice, attending
  over twice the length, counted dense) while the head runs the noisy half only, or both halves with
  ``head_halves=2`` (the ``verified`` objective scores both).
  """
  head = cfg.vocab_size * cfg.d_model
  n = num_params - head * (0 if cfg.tie_embeddings else 1)
  attention = 2 * cfg.num_layers * cfg.max_length * cfg.num_heads * cfg.head_dim * 2  # QK^T and PV, forward.
  forward = 2 * n + attention
  if doubled:
    forward = 2 * (2 * (n - head) + 2 * attention) + 2 * head * head_halves
  return 3 * forward if training else forward
