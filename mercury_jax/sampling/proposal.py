"""What the denoiser proposes at every position: a candidate token and the confidence a step rule ranks it by.

The model's logits become the clean-token distribution (:func:`clean_logits`, the one place where tokens are
excluded, for the diffusion loop and the autoregressive decoder alike): the mask class gets logit -inf (the SUBS
parameterisation, MDLM, Sahoo et al. 2024), and so do the padding, BOS and unknown ids and every id at or above the
tokenizer's size (a model vocabulary padded beyond the tokenizer), which no decoder may ever emit; EOS stays, except
where ``min_length`` bans it. Confidence is measured on this cleaned, untempered, unfiltered distribution, as LLaDA
and Dream do; candidates are drawn from its tempered, top-k/top-p filtered version.

Sampling is an exact, two-level Gumbel-max in float32 (LLaDA draws Gumbel noise in float64 because low-precision
noise hurts generation; float32 is JAX's widest default type). The vocabulary is cut into ``C`` chunks of ``C``
tokens (``C = ceil(sqrt(vocab))``). The maximum of Gumbel-perturbed logits over a set is itself Gumbel distributed
around the set's log-sum-exp (Maddison et al. 2014, "A* Sampling"), so drawing a chunk by Gumbel-max over the chunk
log-sum-exps and then a token by Gumbel-max inside that chunk gives every token exactly its softmax probability,
with ``2 C`` instead of ``vocab`` Gumbel draws per position: on a CPU, one full-vocabulary Gumbel draw per position
costs several forward passes of a small model. Greedy decoding uses the same two-level layout for its argmax.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mercury_jax.sampling.settings import SamplerSettings


class Knobs(NamedTuple):
  """Per-row sampling knobs as traced arrays, so a serving engine mixes requests without recompiling.

  Every field is [batch]; the values mean what the :class:`SamplerSettings` fields of the same names mean.
  """

  temperature: jax.Array  # float32; 0 picks the most likely token
  top_k: jax.Array  # int32; 0 keeps every token
  top_p: jax.Array  # float32 in (0, 1]
  threshold: jax.Array  # float32: the threshold rule's bar

  @classmethod
  def of(cls, settings: SamplerSettings, batch: int) -> Knobs:
    """``settings``' knobs for ``batch`` rows (host arrays)."""
    full = lambda value, dtype: np.full((batch,), value, dtype)  # noqa: E731
    return cls(
      full(settings.temperature, np.float32),
      full(settings.top_k, np.int32),
      full(settings.top_p, np.float32),
      full(settings.threshold, np.float32),
    )


def excluded_ids(vocab: int, settings: SamplerSettings) -> np.ndarray:
  """Bool [vocab]: the ids never proposed: mask, padding, BOS, unknown (unless one is EOS) and ids >= num_tokens."""
  ids = np.arange(vocab)
  specials = {settings.pad_id, settings.bos_id, settings.unk_id} - {settings.eos_id}
  excluded = np.isin(ids, [settings.mask_id, *specials])
  if settings.num_tokens:
    excluded |= ids >= settings.num_tokens
  return excluded


def clean_logits(logits: jax.Array, eos_banned: jax.Array, settings: SamplerSettings) -> jax.Array:
  """Float32 logits of the clean token: :func:`excluded_ids` removed (-inf), EOS too where ``eos_banned`` [b, l];
  ``settings.stop_ids`` merged into EOS (the log of their summed probability) and removed."""
  vocab = logits.shape[-1]
  logits = logits.astype(jnp.float32)
  is_eos = jnp.arange(vocab) == settings.eos_id
  removed = jnp.asarray(excluded_ids(vocab, settings)) | (is_eos & eos_banned[..., None])  # [b, l, vocab]
  stops = [i for i in settings.stop_ids if i != settings.eos_id and 0 <= i < vocab]
  if stops:
    ending = jax.nn.logsumexp(logits[..., [settings.eos_id, *stops]], axis=-1)  # [b, l]
    logits = jnp.where(is_eos, ending[..., None], logits)
    removed = removed | jnp.isin(jnp.arange(vocab), jnp.asarray(stops))
  return jnp.where(removed, -jnp.inf, logits)


def filter_logits(logits: jax.Array, settings: SamplerSettings) -> jax.Array:
  """Temperature, then top-k, then top-p (nucleus, Holtzman et al. 2020); removed tokens get -inf."""
  if settings.temperature != 1.0:
    logits = logits / settings.temperature
  if settings.top_k:
    top = jax.lax.top_k(logits, min(settings.top_k, logits.shape[-1]))[0]  # [b, l, k], descending
    logits = jnp.where(logits >= top[..., -1:], logits, -jnp.inf)
  if settings.top_p < 1.0:
    ranked = top if settings.top_k else -jnp.sort(-logits, axis=-1)  # [b, l, k or vocab], descending
    probs = jax.nn.softmax(ranked, axis=-1)
    kept = (jnp.cumsum(probs, axis=-1) - probs) < settings.top_p  # The most likely token is always kept.
    cutoff = jnp.min(jnp.where(kept, ranked, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits >= cutoff, logits, -jnp.inf)
  return logits


def filter_rows(logits: jax.Array, knobs: Knobs) -> jax.Array:
  """:func:`filter_logits` with per-row top-k and top-p (``[b, l, vocab]``, temperature already applied).

  A row whose ``top_k`` is 0 and ``top_p`` 1 keeps its logits bit for bit, so a row's tokens never depend on the
  knobs of the rows batched with it.
  """
  ranked = -jnp.sort(-logits, axis=-1)  # [b, l, vocab], descending
  vocab = logits.shape[-1]
  kth = jnp.take_along_axis(ranked, jnp.clip(knobs.top_k - 1, 0, vocab - 1)[:, None, None], axis=-1)  # [b, l, 1]
  by_k = (knobs.top_k > 0)[:, None, None]
  ranked = jnp.where(by_k & (ranked < kth), -jnp.inf, ranked)
  probs = jax.nn.softmax(ranked, axis=-1)
  kept = (jnp.cumsum(probs, axis=-1) - probs) < knobs.top_p[:, None, None]  # The most likely token is always kept.
  cutoff = jnp.min(jnp.where(kept, ranked, jnp.inf), axis=-1, keepdims=True)
  cutoff = jnp.where((knobs.top_p < 1.0)[:, None, None], cutoff, jnp.where(by_k, kth, -jnp.inf))
  return jnp.where(logits >= cutoff, logits, -jnp.inf)


def tempered(logits: jax.Array, knobs: Knobs) -> jax.Array:
  """Each row's logits [b, l, vocab] divided by its temperature (a greedy row's left as they are) and, where the row
  asks for it, top-k/top-p filtered (:func:`filter_rows`, behind a ``lax.cond`` that runs only when some sampling row
  filters): the distribution a sampling row draws from."""
  sampled = knobs.temperature > 0.0
  scaled = logits / jnp.where(sampled, knobs.temperature, 1.0)[:, None, None]  # x / 1 is x, bit for bit
  filtered = (knobs.top_k > 0) | (knobs.top_p < 1.0)
  return jax.lax.cond(
    jnp.any(filtered & sampled),
    lambda: jnp.where(filtered[:, None, None], filter_rows(scaled, knobs), scaled),
    lambda: scaled,
  )


def _chunk_size(vocab: int) -> int:
  return math.isqrt(vocab - 1) + 1 if vocab > 1 else 1


def noise_width(vocab: int) -> int:
  """Uniform draws per position that :func:`sample_tokens` needs: one Gumbel per chunk, one per chunk member."""
  return 2 * _chunk_size(vocab)


def uniform_noise(keys: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Float32 uniforms in (0, 1) of ``shape`` for each example's key: [batch, *shape].

  Each example draws for its own shape, and threefry's counters make a shorter draw a prefix of a longer one along
  the first axis, so an example's noise does not depend on its batch or on the canvas padding.
  """
  tiny = jnp.finfo(jnp.float32).tiny
  return jax.vmap(lambda key: jax.random.uniform(key, shape, jnp.float32, minval=tiny, maxval=1.0))(keys)


def _chunked(logits: jax.Array) -> jax.Array:
  """[b, l, vocab] -> [b, l, C, C] (-inf padded); token ``r * C + c`` sits at ``[r, c]`` and chunk ``c`` is column c.

  Columns as chunks keep every reduction over the vocabulary on the second-to-last axis, which vectorises well.
  """
  vocab = logits.shape[-1]
  size = _chunk_size(vocab)
  padded = jnp.pad(logits, ((0, 0), (0, 0), (0, size * size - vocab)), constant_values=-jnp.inf)
  return padded.reshape(*logits.shape[:-1], size, size)


def _chunk_stats(chunks: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(chunk_max, chunk_lse, log_z)``: each chunk's max and log-sum-exp ([b, l, C]) and the normaliser ([b, l]).

  One max and one exp-sum pass over the vocabulary, both relative to the position's maximum (float32 softmax
  accuracy: a chunk more than ~87 nats below the maximum counts as probability 0).
  """
  chunk_max = jnp.max(chunks, axis=-2)  # [b, l, C]
  top = jnp.max(chunk_max, axis=-1)  # [b, l], finite: some token is always allowed (``SamplerSettings.validate``)
  sums = jnp.sum(jnp.exp(chunks - top[..., None, None]), axis=-2)  # [b, l, C]
  return chunk_max, top[..., None] + jnp.log(sums), top + jnp.log(jnp.sum(sums, axis=-1))


def _two_level_argmax(chunks: jax.Array, chunk_scores: jax.Array, inner_noise: jax.Array | None) -> jax.Array:
  """Token index from a chunk choice (argmax of ``chunk_scores``) and an argmax inside the chosen chunk."""
  size = chunks.shape[-1]
  chunk = jnp.argmax(chunk_scores, axis=-1)  # [b, l]
  inner = jnp.take_along_axis(chunks, chunk[..., None, None], axis=-1)[..., 0]  # [b, l, C]: column ``chunk``
  if inner_noise is not None:
    inner = inner + inner_noise
  return (jnp.argmax(inner, axis=-1) * size + chunk).astype(jnp.int32)


def sample_tokens(logits: jax.Array, uniforms: jax.Array | None) -> jax.Array:
  """One token per position from ``softmax(logits)`` (two-level Gumbel-max), or the argmax when ``uniforms`` is None.

  Args:
    logits: [batch, length, vocab] float32; -inf for excluded tokens (at least one finite per position).
    uniforms: [batch, length, noise_width(vocab)] float32 uniforms in (0, 1) (see :func:`uniform_noise`).

  Returns:
    int32 [batch, length]. Exact ties between logits may resolve to another maximiser than ``jnp.argmax``'s.
  """
  chunks = _chunked(logits)  # [b, l, C, C]
  chunk_max, chunk_lse, _ = _chunk_stats(chunks)
  return _gumbel_max(chunks, chunk_max, chunk_lse, uniforms)


def greedy_tokens(logits: jax.Array) -> jax.Array:
  """int32 [batch, length]: the most likely token of each position, ties broken as :func:`propose_rows` breaks them."""
  chunks = _chunked(logits)
  return _two_level_argmax(chunks, jnp.max(chunks, axis=-2), None)


def _gumbel_max(chunks, chunk_max, chunk_lse, uniforms):
  if uniforms is None:
    return _two_level_argmax(chunks, chunk_max, None)
  gumbel = -jnp.log(-jnp.log(uniforms))  # [b, l, 2C] float32
  size = chunks.shape[-1]
  return _two_level_argmax(chunks, chunk_lse + gumbel[..., :size], gumbel[..., size:])


def propose(
  logits: jax.Array, uniforms: jax.Array | None, eos_banned: jax.Array, settings: SamplerSettings
) -> tuple[jax.Array, jax.Array]:
  """Draws a candidate token per position and its confidence.

  Args:
    logits: The denoiser's output, [batch, length, vocab].
    uniforms: [batch, length, noise_width(vocab)] uniforms in (0, 1); unused (may be None) at temperature 0.
    eos_banned: [batch, length] bool, positions where EOS may not be proposed.
    settings: Temperature, top-k, top-p and the confidence measure.

  Returns:
    ``(x0, confidence)``: int32 [batch, length] candidates (never an id of :func:`excluded_ids`) and float32
    [batch, length] confidences, both from the cleaned distribution of :func:`clean_logits`.
  """
  logits = clean_logits(logits, eos_banned, settings)
  chunks = _chunked(logits)  # [b, l, C, C]
  chunk_max, chunk_lse, log_z = _chunk_stats(chunks)
  greedy = settings.temperature == 0.0
  if greedy or (settings.temperature == 1.0 and not settings.top_k and settings.top_p == 1.0):
    x0 = _gumbel_max(chunks, chunk_max, chunk_lse, None if greedy else uniforms)  # Reuses the normaliser's work.
  else:
    x0 = sample_tokens(filter_logits(logits, settings), uniforms)
  return x0, _confidence(logits, x0, _Chunked(chunks, chunk_max, log_z), settings, x0 if greedy else None)


def propose_rows(
  logits: jax.Array, uniforms: jax.Array | None, eos_banned: jax.Array, settings: SamplerSettings, knobs: Knobs
) -> tuple[jax.Array, jax.Array]:
  """:func:`propose` with the sampling knobs of each row (``knobs``, traced) instead of ``settings``' own.

  A row's proposals are a function of its own logits, noise and knobs only: the top-k/top-p filter runs (behind a
  ``lax.cond``) only when some row asks for it and leaves the other rows' logits untouched, and everything after it
  is the same program for every row. A row at temperature 1 without filters draws exactly what :func:`propose`
  draws; at temperature 0 it takes the argmax and ignores ``uniforms`` (which may be None when no row samples).
  """
  logits = clean_logits(logits, eos_banned, settings)
  chunks = _chunked(logits)  # [b, l, C, C]
  chunk_max, chunk_lse, log_z = _chunk_stats(chunks)
  greedy_x0 = _two_level_argmax(chunks, chunk_max, None)
  if uniforms is None:
    x0 = greedy_x0
  else:
    sampled = knobs.temperature > 0.0
    scaled_chunks = _chunked(tempered(logits, knobs))
    scaled_max, scaled_lse, _ = _chunk_stats(scaled_chunks)
    x0 = jnp.where(sampled[:, None], _gumbel_max(scaled_chunks, scaled_max, scaled_lse, uniforms), greedy_x0)
  return x0, _confidence(logits, x0, _Chunked(chunks, chunk_max, log_z), settings, greedy_x0)


class _Chunked(NamedTuple):
  """Cleaned logits in chunks of the vocabulary (the two-level argmax's), with their statistics."""

  chunks: jax.Array  # [b, l, C, C]
  max: jax.Array  # [b, l, C] each chunk's maximum
  log_z: jax.Array  # [b, l] the log-normaliser


def _confidence(logits, x0, chunked: _Chunked, settings, top1=None):
  """The confidence of proposals ``x0`` (``settings.confidence``) under the cleaned distribution ``logits``; ``top1``:
  the argmax, when known."""
  chunks, chunk_max, log_z = chunked
  if settings.confidence == "prob":
    confidence = jnp.exp(jnp.take_along_axis(logits, x0[..., None], axis=-1)[..., 0] - log_z)
  elif settings.confidence == "margin":
    if top1 is None:
      top1 = _two_level_argmax(chunks, chunk_max, None)
    first = jnp.take_along_axis(logits, top1[..., None], axis=-1)[..., 0]
    second = jnp.max(jnp.where(jnp.arange(logits.shape[-1]) == top1[..., None], -jnp.inf, logits), axis=-1)
    confidence = jnp.exp(first - log_z) - jnp.exp(second - log_z)
  else:  # Negative entropy: sum_v p_v log p_v, with 0 log 0 = 0.
    p = jnp.exp(logits - log_z[..., None])
    confidence = jnp.sum(jnp.where(p > 0, p * logits, 0.0), axis=-1) - log_z
  return confidence
