"""The denoiser as the decoding engine calls it: whole-context passes, and chunks over a key-value cache.

:class:`Network` wraps the model (:class:`~mercury_jax.model.Transformer`); :class:`FunctionNetwork` wraps any
``denoise_fn(z_t, t) -> logits`` (:data:`mercury_jax.objectives.masked_diffusion.DenoiseFn`, the one denoiser type of
the project), for tests and experiments that decode a function of their own without a cache.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mercury_jax.batch_invariance import Tiling, by_rows
from mercury_jax.config import ModelConfig
from mercury_jax.kvcache import KVCache
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
    batch_invariant: A row's outputs are bitwise the same in any batch (:class:`InvariantNetwork`): a pass's shape
      must not depend on the other rows (verified decoding then always runs its whole chunk).
  """

  batch_invariant = False

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

  def logits(self, params, tokens, t=None, **kwargs):
    """``[b, l or logits_length, vocab]`` logits of a whole context (no cache; :meth:`chunk`'s other keywords), each
    position's own distribution."""
    logits = self.chunk(params, tokens, t, return_kv=False, **kwargs)
    return unshift(logits) if self.shift else logits

  def chunk(
    self,
    params,
    tokens,
    t=None,
    *,
    segments,
    positions,
    mask: str | None = None,
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
    :class:`InvariantNetwork` runs it row by row, so that its rounding does not depend on the batch either."""
    return fn(*args)

  def empty_cache(self, batch: int, slots: int) -> KVCache:
    return KVCache.empty(self.cfg, batch, slots)


class InvariantNetwork(Network):
  """The network run batch-invariantly: a row's outputs are bitwise the same whatever else is in its batch.

  A batched pass is row-independent only up to rounding: XLA picks other kernels as a product's rows grow (on XLA:CPU
  a matmul over 64 tokens rounds otherwise than over 32, and so do softmax reductions), and one ulp can flip a
  sampled token. The serving engine's batch buckets run this network, so a request's tokens do not depend on its
  bucket. Every matmul and normalisation runs over fixed tiles of positions, attention over a cache takes its
  normaliser by a batched product (or runs row by row where it cannot), and proposals run row by row
  (:mod:`mercury_jax.batch_invariance`); ``docs/results/serving.md`` ("Batch buckets over a paged KV cache") has the
  cost.

  Args:
    cfg: The model.
    group: The data-parallel size of the mesh: every device works on its own shard's rows.
    tile: Positions per tile of a matmul (a bucket's positions are padded to whole tiles of every shard).
  """

  batch_invariant = True

  def __init__(self, cfg: ModelConfig, group: int = 1, tile: int = 8):
    super().__init__(cfg)
    if tile < 1:
      raise ValueError(f"tile={tile} must be >= 1")
    self.tiling = Tiling(tile, group)
    self.model = Transformer(cfg, tiling=self.tiling)

  def map_rows(self, fn, *args):
    """``fn(*args)`` one row of every shard at a time: XLA:CPU reduces a ``[1, ...]`` array in another order than a
    ``[4, ...]`` one (a proposal's softmax normaliser moved by 20 ulp between batch buckets 1 and 4, which flipped a
    near tie of two positions' confidences), so every batch runs the same program on each row."""
    return by_rows(fn, self.tiling.shards, *args)


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

  def logits(self, params, tokens, t=None, *, mask=None, logits_length=None, latent=None, **positions):
    """``denoise_fn(tokens, t)`` (``positions``: the segments, rotary positions and block a network would read)."""
    del params, positions
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
