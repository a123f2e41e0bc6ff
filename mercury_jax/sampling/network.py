"""The denoiser as the decoding engine calls it: whole-context passes, and chunks over a key-value cache.

:class:`Network` wraps the model (:class:`~mercury_jax.model.Transformer`); :class:`FunctionNetwork` wraps any
``denoise_fn(z_t, t) -> logits`` (:data:`mercury_jax.objectives.masked_diffusion.DenoiseFn`, the one denoiser type of
the project), for tests and experiments that decode a function of their own without a cache.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mercury_jax.config import ModelConfig
from mercury_jax.kvcache import KVCache, PagedKVCache
from mercury_jax.model import Transformer
from mercury_jax.objectives.masked_diffusion import DenoiseFn


class LatentInputs(NamedTuple):
  """A continuous checkpoint's noisy inputs to one pass (:class:`~mercury_jax.model.Transformer`'s ``latents``,
  ``noise_level`` and ``self_cond``), over the pass's positions; a position at noise level 0 reads its token."""

  latents: jax.Array  # [b, l, latent_dim] float32
  noise_level: jax.Array  # [b, l] float32 sigma (0: the position is a clean token)
  self_cond: jax.Array | None = None  # [b, l, latent_dim] the last estimate of the clean latents, or None

  def kwargs(self) -> dict:
    return {"latents": self.latents, "noise_level": self.noise_level, "self_cond": self.self_cond}


def _latent_kwargs(latent: LatentInputs | None) -> dict:
  return {} if latent is None else latent.kwargs()


class Network:
  """The model behind the engine.

  Attributes:
    vocab_size: Logits per position.
    causal: A causal model (the autoregressive twin).
    time_conditioning: The model reads the diffusion time ``t``.
    shift: 1 for a shifted-logits checkpoint (``ModelConfig.shifted_logits``: Dream, DiffuCoder, Fast-dLLM v2), whose
      output at position ``i`` is the distribution of token ``i + 1``; else 0. :meth:`logits` returns every
      position's own distribution either way (the first position, which is never generated, keeps its own output,
      as Dream's ``_sample`` does); :meth:`chunk` returns the raw outputs, and a cache strategy that wants the
      distributions of slots ``s .. s + B - 1`` runs the chunk from slot ``s - shift``.
  """

  def __init__(self, cfg: ModelConfig):
    self.cfg = cfg
    self.model = Transformer(cfg)
    self.vocab_size, self.causal, self.time_conditioning = cfg.vocab_size, cfg.causal, cfg.time_conditioning
    self.shift = int(cfg.shifted_logits)
    self.latent_dim = cfg.latent_dim

  def latent_table(self, params) -> jax.Array:
    """The continuous family's normalised token latents, [vocab, latent_dim] float32."""
    probe = jnp.zeros((1, 1), jnp.int32)
    return self.model.apply({"params": params}, probe, None, latent_params=True)["table"]

  def _t(self, t: jax.Array | None, batch: int) -> jax.Array | None:
    if not self.time_conditioning:
      return None
    return jnp.zeros((batch,), jnp.float32) if t is None else t

  def logits(
    self,
    params,
    tokens,
    t=None,
    *,
    segments,
    positions,
    mask=None,
    diffusion_block=None,
    logits_length=None,
    latent: LatentInputs | None = None,
  ):
    """``[b, l or logits_length, vocab]`` logits of a whole context (no cache), each position's own distribution."""
    logits = self.model.apply(
      {"params": params},
      tokens,
      self._t(t, tokens.shape[0]),
      segment_ids=segments,
      positions=positions,
      mask=mask,
      diffusion_block=diffusion_block,
      logits_length=logits_length,
      **_latent_kwargs(latent),
    )
    return unshift(logits) if self.shift else logits

  def chunk(
    self,
    params,
    tokens,
    t=None,
    *,
    segments,
    positions,
    mask: str,
    diffusion_block: int | None = None,
    cache: KVCache | None = None,
    starts: jax.Array | None = None,
    logits_length: int | None = None,
    return_kv: bool = True,
    latent: LatentInputs | None = None,
  ):
    """``(logits, the chunk's KVCache)`` (or the logits alone without ``return_kv``) of a chunk at slots
    ``starts[r] ...``, attending to ``cache`` too when given (see :class:`~mercury_jax.model.Transformer`)."""
    return self.model.apply(
      {"params": params},
      tokens,
      self._t(t, tokens.shape[0]),
      segment_ids=segments,
      positions=positions,
      mask=mask,
      diffusion_block=diffusion_block,
      logits_length=logits_length,
      cache=cache,
      cache_start=starts,
      return_kv=return_kv,
      **_latent_kwargs(latent),
    )

  def map_rows(self, fn, *args):
    """``fn(*args)``: a function of batched pytrees (``[b, ...]`` leaves; None allowed) that works on each row alone.
    :class:`RowwiseNetwork` runs it row by row, so that its rounding does not depend on the batch either."""
    return fn(*args)

  def empty_cache(self, batch: int, slots: int) -> KVCache:
    return KVCache.empty(self.cfg, batch, slots)


class RowwiseNetwork(Network):
  """The network run one batch row at a time (a ``lax.map`` over rows), so a row's outputs are bitwise the same
  whatever else is in its batch.

  A batched pass is row-independent only up to rounding: XLA picks other kernels as a product's rows grow (on XLA:CPU
  a matmul over 64 tokens rounds otherwise than over 32, and so do the cached attention's reductions), and one ulp
  can flip a sampled token. The serving engine's batch buckets run this network, so a request's tokens do not depend
  on its bucket; it gives up the weight reuse of batched matmuls (``BUILD_NOTES.md`` has the cost).

  Args:
    cfg: The model.
    group: Rows per pass: the data-parallel size of the mesh, so that every device runs one row of its own shard per
      pass (row ``r`` of a batch of ``n`` goes with rows ``r + n / group``, ``r + 2 n / group``, ...: one from each
      shard).
  """

  def __init__(self, cfg: ModelConfig, group: int = 1):
    super().__init__(cfg)
    self.group = group

  def _rows(self, tree):
    """``[b, ...]`` leaves as ``[b / g, g, ...]`` (``g``: ``group``, or what divides a smaller batch, a prefill's
    one row): pass ``i`` takes row ``i`` of every shard."""
    g = math.gcd(self.group, jax.tree.leaves(tree)[0].shape[0])
    return jax.tree.map(lambda a: jnp.swapaxes(a.reshape(g, a.shape[0] // g, *a.shape[1:]), 0, 1), tree)

  def _batch(self, tree):
    """The inverse of :meth:`_rows` over the leading two axes."""
    return jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1).reshape(a.shape[0] * a.shape[1], *a.shape[2:]), tree)

  def map_rows(self, fn, *args):
    """``fn(*args)`` run over groups of rows (see :meth:`_rows`) in a ``lax.map``: XLA:CPU reduces a ``[1, ...]``
    array in another order than a ``[4, ...]`` one (a proposal's softmax normaliser moved by 20 ulp between batch
    buckets 1 and 4, which flipped a near tie of two positions' confidences), so every batch runs the same program on
    each row."""
    return self._batch(jax.lax.map(lambda rows: fn(*rows), self._rows(args)))

  def logits(self, params, tokens, t=None, *, segments, positions, latent=None, **kwargs):
    def one(rows):
      tokens, t, segments, positions, latent = rows
      return super(RowwiseNetwork, self).logits(
        params, tokens, t, segments=segments, positions=positions, latent=latent, **kwargs
      )

    rows = self._rows((tokens, self._t(t, tokens.shape[0]), segments, positions, latent))
    return self._batch(jax.lax.map(one, rows))

  def chunk(
    self, params, tokens, t=None, *, segments, positions, cache=None, starts=None, return_kv=True, latent=None, **kwargs
  ):
    batch = tokens.shape[0]
    starts = None if starts is None else jnp.broadcast_to(jnp.asarray(starts, jnp.int32), (batch,))
    per_row, rebuild = _cache_rows(cache)

    def one(rows):
      tokens, t, segments, positions, starts, cache_rows, latent = rows
      out = super(RowwiseNetwork, self).chunk(
        params,
        tokens,
        t,
        segments=segments,
        positions=positions,
        cache=rebuild(cache_rows),
        starts=starts,
        return_kv=return_kv,
        latent=latent,
        **kwargs,
      )
      if not return_kv:
        return out
      logits, kv = out  # the chunk's keys and values with the rows first: [rows, layers, length, ...]
      return logits, KVCache(jnp.moveaxis(kv.keys, 1, 0), jnp.moveaxis(kv.values, 1, 0), kv.segments)

    rows = (tokens, self._t(t, batch), segments, positions, starts, per_row, latent)
    out = self._batch(jax.lax.map(one, self._rows(rows)))
    if not return_kv:
      return out
    logits, kv = out
    return logits, KVCache(jnp.moveaxis(kv.keys, 0, 1), jnp.moveaxis(kv.values, 0, 1), kv.segments)


def _cache_rows(cache):
  """``(per-row part, rebuild)`` of a cache for :class:`RowwiseNetwork`: the part ``lax.map`` slices (leading axis:
  rows), and the function that makes the cache of a slice. A paged cache's pool is shared by every row and never
  sliced."""
  if cache is None:
    return None, lambda rows: None
  if isinstance(cache, PagedKVCache):
    return (cache.segments, cache.table), lambda rows: PagedKVCache(cache.keys, cache.values, *rows)
  per_row = (jnp.moveaxis(cache.keys, 1, 0), jnp.moveaxis(cache.values, 1, 0), cache.segments)  # [b, layers, ...]
  return per_row, lambda rows: KVCache(jnp.moveaxis(rows[0], 0, 1), jnp.moveaxis(rows[1], 0, 1), rows[2])


def unshift(logits: jax.Array) -> jax.Array:
  """Each position's distribution from a shifted-logits pass ``[b, l, vocab]``: position ``i > 0`` takes the output
  at ``i - 1``; position 0 keeps its own."""
  return jnp.concatenate([logits[:, :1], logits[:, :-1]], axis=1)


class FunctionNetwork:
  """A ``denoise_fn(z_t, t) -> logits`` as a network without a cache (``cache="none"`` plans only).

  The function sees the canvas (not the slots) and ``t`` [b]; its parameters, if any, are its own (the engine's
  ``params`` argument is ignored).
  """

  causal = False
  time_conditioning = True
  shift = 0
  latent_dim = 0

  def __init__(self, denoise_fn: DenoiseFn, vocab_size: int):
    self.denoise_fn, self.vocab_size = denoise_fn, vocab_size

  def logits(
    self,
    params,
    tokens,
    t=None,
    *,
    segments,
    positions,
    mask=None,
    diffusion_block=None,
    logits_length=None,
    latent: LatentInputs | None = None,
  ):
    del params, segments, positions, diffusion_block
    if latent is not None:
      raise ValueError("a FunctionNetwork denoises tokens, not latents")
    if mask not in (None, "bidirectional"):
      raise ValueError(f"a FunctionNetwork decodes whole canvases bidirectionally, not with {mask=}")
    t = jnp.ones((tokens.shape[0],), jnp.float32) if t is None else t
    logits = self.denoise_fn(tokens, t)
    return logits if logits_length is None else logits[:, :logits_length]

  def chunk(self, *args, **kwargs):
    raise ValueError("a FunctionNetwork has no key-value cache; decode it with cache='none'")

  map_rows = Network.map_rows

  def empty_cache(self, batch: int, slots: int):
    raise ValueError("a FunctionNetwork has no key-value cache; decode it with cache='none'")
