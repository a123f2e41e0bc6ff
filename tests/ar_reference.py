"""The autoregressive twin's decoder as it was before the block engine: the reference the engine must reproduce.

The package decodes the twin with the engine (``mercury_jax.sampling.engine``, blocks of one token); this stand-alone
decoder is kept only so that the tests can check the engine against it token for token (it follows the model's cache
API: the model returns a chunk's keys and values, the decoder writes them).

Key-value-cache decoding for the autoregressive twin: one jitted ``lax.while_loop``, one token per forward pass.

It fills the same :class:`~mercury_jax.sampling.canvas.Canvas` as the diffusion sampler, left to right: a prefill
pass writes the whole canvas into the cache (generated positions hold padding there, in segment 0, so nothing
attends to them), then each iteration feeds the token decided at position ``i - 1`` and reads the distribution of
position ``i``. Fixed tokens after a generated one (a template) are forced rather than sampled, so templates work
too, but every position to the left of a generated one must be known when it is reached.

End of sequence, per hole. A hole is a maximal run of consecutive generated positions. An EOS ends its own hole: the
rest of that hole is skipped (padding, left in segment 0 so later positions never attend to it) and decoding goes
on at the next fixed token or hole. A row is finished once its last hole is done (filled, or ended by an EOS). The
loop feeds only the positions some unfinished row still needs, so a hole cut short by EOS in every row costs no
forward pass.

Candidates come from the diffusion sampler's proposal code (special ids excluded, temperature, top-k, top-p, float32
two-level Gumbel-max, EOS banned among a row's first ``min_length`` generated positions); example ``i`` draws from
``fold_in(key, streams[i])`` and position ``j`` from ``fold_in(that, j)``, so an example's tokens do not depend on
its batch. Positions are absolute canvas slots, so a prompt means the same wherever it sits in a batch. ``nfe``
counts the prefill and every decoding pass.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from mercury_jax import kinds as K
from mercury_jax.config import ModelConfig
from mercury_jax.model import KVCache, Transformer
from mercury_jax.sampling.canvas import Canvas, SampleOutput, after_eos
from mercury_jax.sampling.mesh import jit_on_mesh
from mercury_jax.sampling.proposal import noise_width, propose, uniform_noise
from mercury_jax.sampling.settings import SamplerSettings


def decode(
  params: Any, canvas: Canvas, key: jax.Array, *, model_cfg: ModelConfig, settings: SamplerSettings
) -> SampleOutput:
  """Fills every ``TARGET`` position of ``canvas`` with a causal model and a key-value cache.

  Args:
    params: The autoregressive model's parameters.
    canvas: Rows whose first position is fixed (a prompt, or at least a BOS token).
    key: A PRNG key.
    model_cfg: The model's config (``causal=True``).
    settings: Temperature, top-k, top-p, ``min_length``, EOS handling (the step rule itself is unused).

  Returns:
    A :class:`SampleOutput`; ``nfe`` and ``steps`` count forward passes (prefill included).
  """
  model = Transformer(model_cfg)
  tokens, kinds = jnp.asarray(canvas.tokens, jnp.int32), jnp.asarray(canvas.kinds, jnp.int32)
  batch, length = tokens.shape
  generate = kinds == K.TARGET
  slots = jnp.arange(length)
  rank = jnp.cumsum(generate, axis=-1, dtype=jnp.int32) - 1  # index among the row's generated positions
  first = jnp.min(jnp.where(generate, slots, length), axis=-1)  # [b]
  start = jnp.maximum(jnp.min(first), 1)  # the first position any row samples (position 0 is always known)
  example_keys = jax.vmap(lambda stream: jax.random.fold_in(key, stream))(jnp.asarray(canvas.streams, jnp.int32))
  width = 0 if settings.temperature == 0.0 else noise_width(model_cfg.vocab_size)
  z = jnp.where(generate, settings.pad_id, tokens)

  def live(z, i):
    """``(live, to_generate)`` [b, l] knowing the tokens before ``i``: positions that count, and generated ones.

    A position after an EOS of its own hole is dead: never sampled, never attended to (segment 0).
    """
    skipped = after_eos(z, generate, settings.eos_id, known=slots < i)
    return (kinds != K.PAD) & ~skipped, generate & ~skipped

  def next_position(z, i):
    """The first position after ``i`` that an unfinished row needs decoded or fed (``length``: none is left).

    Decoding ``q`` feeds ``q - 1``: a row needs that when it generates ``q``, or when ``q - 1`` is live and the row
    generates something after it (context).
    """
    alive, to_generate = live(z, i + 1)
    pending = jnp.flip(jnp.cumsum(jnp.flip(to_generate, axis=-1), axis=-1), axis=-1) > 0  # generates at >= q
    previous_alive = jnp.pad(alive, ((0, 0), (1, 0)))[:, :-1]  # [b, l]: position q - 1 is live
    needed = jnp.any(to_generate | (previous_alive & pending), axis=0) & (slots > i)  # [l]
    return jnp.min(jnp.where(needed, slots, length)).astype(jnp.int32)

  # Generated positions wait in segment 0 until they are decided and fed.
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  prefill_segments = ((kinds != K.PAD) & ~generate).astype(jnp.int32)
  logits, kv = model.apply({"params": params}, z, segment_ids=prefill_segments, positions=positions, return_kv=True)
  prefilled = KVCache.empty(model_cfg, batch, length).write(kv, 0)

  def decide(z, i, logits):
    """Samples position ``i`` of the rows that generate there from ``logits`` [b, vocab]."""
    step_keys = jax.vmap(lambda k: jax.random.fold_in(k, i))(example_keys)
    noise = uniform_noise(step_keys, (1, width)) if width else None  # [b, 1, width]
    banned = jax.lax.dynamic_index_in_dim(rank, i, axis=1, keepdims=True) < settings.min_length
    candidate, _ = propose(logits[:, None, :], noise, banned, settings)  # [b, 1]
    sample_here = jax.lax.dynamic_index_in_dim(live(z, i)[1], i, axis=1, keepdims=True)
    current = jax.lax.dynamic_index_in_dim(z, i, axis=1, keepdims=True)
    return jax.lax.dynamic_update_index_in_dim(z, jnp.where(sample_here, candidate, current), i, axis=1)

  def cond(carry):
    return carry[0] < length

  def body(carry):
    i, z, cache, nfe = carry  # Feed the token at i - 1, read the distribution of position i.
    token = jax.lax.dynamic_index_in_dim(z, i - 1, axis=1, keepdims=True)
    segment = jax.lax.dynamic_index_in_dim(live(z, i)[0], i - 1, axis=1, keepdims=True).astype(jnp.int32)
    logits, kv = model.apply(
      {"params": params},
      token,
      segment_ids=segment,
      positions=jnp.full((batch, 1), i - 1, jnp.int32),
      cache=cache,
      cache_start=i - 1,
      return_kv=True,
    )
    z = decide(z, i, logits[:, 0])
    return next_position(z, i), z, cache.write(kv, i - 1), nfe + 1

  z = decide(z, start, jax.lax.dynamic_index_in_dim(logits, start - 1, axis=1, keepdims=False))
  init = (next_position(z, start), z, prefilled, jnp.ones((), jnp.int32))
  _, z, _, nfe = jax.lax.while_loop(cond, body, init)
  if settings.eos_to_pad:
    z = jnp.where(after_eos(z, generate, settings.eos_id), settings.pad_id, z)
  return SampleOutput(z, jnp.broadcast_to(nfe, (batch,)), nfe)


def jit_decode(
  model_cfg: ModelConfig,
  settings: SamplerSettings,
  *,
  mesh: Mesh | None = None,
  rules=None,
  param_shardings: Any = None,
) -> Callable[[Any, Canvas, jax.Array], SampleOutput]:
  """``jax.jit`` of :func:`decode` for fixed settings: ``(params, canvas, key) -> SampleOutput``.

  On a mesh the shardings are those of :func:`~mercury_jax.sampling.mesh.jit_on_mesh` (canvases over the batch axes,
  see :func:`~mercury_jax.sampling.mesh.jit_on_mesh`).

  Args:
    model_cfg: The causal model's config.
    settings: Static sampler settings (temperature, top-k, top-p, ``min_length``, EOS handling).
    mesh: The device mesh; None for plain ``jax.jit``.
    rules: Logical axis rules (default ``mercury_jax.sharding.RULES``).
    param_shardings: The parameters' shardings on ``mesh`` (needed with a mesh).
  """
  if not model_cfg.causal:
    raise ValueError("key-value-cache decoding needs a causal model (the autoregressive twin)")
  fn = functools.partial(decode, model_cfg=model_cfg, settings=settings.validate())
  return jit_on_mesh(fn, mesh, rules, param_shardings, name="jit_decode")
