"""The denoiser as the decoding engine calls it: whole-context passes, and chunks over a key-value cache.

:class:`Network` wraps the model (:class:`~mercury_jax.model.Transformer`); :class:`FunctionNetwork` wraps any
``denoise_fn(z_t, t) -> logits`` (:data:`mercury_jax.objectives.masked_diffusion.DenoiseFn`, the one denoiser type of
the project), for tests and experiments that decode a function of their own without a cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mercury_jax.config import ModelConfig
from mercury_jax.model import KVCache, Transformer
from mercury_jax.objectives.masked_diffusion import DenoiseFn


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

  def _t(self, t: jax.Array | None, batch: int) -> jax.Array | None:
    if not self.time_conditioning:
      return None
    return jnp.zeros((batch,), jnp.float32) if t is None else t

  def logits(self, params, tokens, t=None, *, segments, positions, mask=None, diffusion_block=None, logits_length=None):
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
    )

  def empty_cache(self, batch: int, slots: int) -> KVCache:
    return KVCache.empty(self.cfg, batch, slots)


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

  def __init__(self, denoise_fn: DenoiseFn, vocab_size: int):
    self.denoise_fn, self.vocab_size = denoise_fn, vocab_size

  def logits(self, params, tokens, t=None, *, segments, positions, mask=None, diffusion_block=None, logits_length=None):
    del params, segments, positions, diffusion_block
    if mask not in (None, "bidirectional"):
      raise ValueError(f"a FunctionNetwork decodes whole canvases bidirectionally, not with {mask=}")
    t = jnp.ones((tokens.shape[0],), jnp.float32) if t is None else t
    logits = self.denoise_fn(tokens, t)
    return logits if logits_length is None else logits[:, :logits_length]

  def chunk(self, *args, **kwargs):
    raise ValueError("a FunctionNetwork has no key-value cache; decode it with cache='none'")

  def empty_cache(self, batch: int, slots: int):
    raise ValueError("a FunctionNetwork has no key-value cache; decode it with cache='none'")
