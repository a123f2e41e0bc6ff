"""The one sampling loop: every sampler is this ``lax.while_loop`` with a step rule plugged in.

:func:`sample` is pure and jit-able: params, a batch of canvases, a PRNG key and a *traced* step count in, tokens
out, so 4, 16 or 64 steps reuse one compilation per (batch, length) shape. The loop stops as soon as no masked
position is left, so no forward pass is spent on a finished batch; the forward passes each example needed (NFE)
come back with the tokens.

Schedule. An example with ``n`` positions to generate and block length ``B_len`` has ``B = ceil(n / B_len)``
blocks (one when ``block_length=0``), numbered left to right over its generated positions. With ``S`` steps, step
``i`` works on the blocks up to ``h = ceil((i + 1) B / S) - 1``, and block ``h`` must be finished by step
``floor((h + 1) S / B) - 1``; when a block is finished early the window moves on to the next one. Within the window
the confidence rules commit ``k = ceil(open / steps_left)`` tokens (LLaDA's linear schedule) and the ancestral rule
steps the window's own time grid from ``t = 1`` down to ``0``; at a window's last step everything open is committed.
A block with no masked position left is finished: revision (``settings.revision``) re-masks only tokens of the
window's unfinished blocks, so a finished block never changes again.

End of sequence. A hole is a maximal run of consecutive generated positions. With ``settings.eos_to_pad``, an EOS
ends its own hole only: the positions after it in that hole become padding, while later fixed text and later holes
keep what was generated there (:func:`pad_after_eos`). ``min_length`` bans EOS from a row's first ``min_length``
generated positions, counted over its holes in canvas order.

Randomness. Example ``i`` draws from ``key_i = fold_in(key, streams[i])`` and step ``j`` from
``fold_in(key_i, j)``, each draw shaped for one example; with partitionable threefry (JAX's default) an example's
output does not depend on its batch, its row, its padding or the mesh.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from mercury_jax import kinds as K
from mercury_jax.config import ModelConfig
from mercury_jax.model import Transformer
from mercury_jax.sampling.canvas import Canvas, SampleOutput, after_eos
from mercury_jax.sampling.mesh import jit_on_mesh
from mercury_jax.sampling.proposal import noise_width, propose, uniform_noise
from mercury_jax.sampling.rules import StepInputs, make_rule
from mercury_jax.sampling.settings import SamplerSettings

# (params, z_t [batch, length], t [batch], segment_ids [batch, length]) -> logits [batch, length, vocab].
DenoiseFn = Callable[[Any, jax.Array, jax.Array, jax.Array], jax.Array]


class _Carry(NamedTuple):
  step: jax.Array  # []
  z: jax.Array  # [b, l] the canvas
  score: jax.Array  # [b, l] confidence of each generated token when it was committed
  window: jax.Array  # [b] last block of the current window (-1 before the first step)
  window_start: jax.Array  # [b] step at which the current window began
  nfe: jax.Array  # [b]
  trace: tuple[jax.Array, ...]  # (canvases, commits, remasks) or ()


def model_denoise_fn(model_cfg: ModelConfig) -> DenoiseFn:
  """The Transformer as a denoiser; it is given ``t`` only when it was trained with time conditioning."""
  model = Transformer(model_cfg)

  def denoise_fn(params, z_t, t, segment_ids):
    return model.apply({"params": params}, z_t, t if model_cfg.time_conditioning else None, segment_ids=segment_ids)

  return denoise_fn


def _ceil_div(a: jax.Array, b: jax.Array) -> jax.Array:
  return (a + b - 1) // b


def _count_in_runs(flags: jax.Array, starts: jax.Array, ends: jax.Array) -> jax.Array:
  """How many ``flags`` [b, l] lie in each position's run; runs open at ``starts`` and close at ``ends`` (bool).

  Two running sums and two running maxima, so no scatter: ``upto - before`` counts the flags from the run's start to
  the position, ``after_here - after_end`` those from the position to the run's end.
  """
  flags = flags.astype(jnp.int32)
  upto = jnp.cumsum(flags, axis=-1)
  before = jax.lax.cummax(jnp.where(starts, upto - flags, 0), axis=1)
  after_here = jnp.flip(jnp.cumsum(jnp.flip(flags, axis=-1), axis=-1), axis=-1)
  after_end = jax.lax.cummax(jnp.where(ends, after_here - flags, 0), axis=1, reverse=True)
  return (upto - before) + (after_here - after_end) - flags


def sample(
  params: Any,
  canvas: Canvas,
  key: jax.Array,
  num_steps: jax.Array,
  *,
  denoise_fn: DenoiseFn,
  settings: SamplerSettings,
) -> SampleOutput:
  """Fills every ``TARGET`` position of ``canvas`` in at most ``num_steps`` refinement steps.

  Args:
    params: The denoiser's parameters (any sharding).
    canvas: The batch to fill (see :mod:`mercury_jax.sampling.canvas`).
    key: A PRNG key (typed or raw); each example folds in its stream.
    num_steps: Step budget, an int32 scalar (pass ``jnp.int32(n)``, not a Python int: it stays traced).
    denoise_fn: ``(params, z_t, t, segment_ids) -> logits``.
    settings: The step rule and its knobs (static).

  Returns:
    A :class:`SampleOutput`.
  """
  rule = make_rule(settings)
  mask_id = settings.mask_id
  tokens, kinds = jnp.asarray(canvas.tokens, jnp.int32), jnp.asarray(canvas.kinds, jnp.int32)
  batch, length = tokens.shape
  generate = kinds == K.TARGET
  segment_ids = K.segment_ids(kinds)
  num_steps = jnp.maximum(jnp.asarray(num_steps, jnp.int32), 1)

  rank = jnp.cumsum(generate, axis=-1, dtype=jnp.int32) - 1  # [b, l] index among the example's generated positions
  num_generate = generate.sum(axis=-1, dtype=jnp.int32)  # [b]
  if settings.block_length:
    block = rank // settings.block_length
    num_blocks = jnp.maximum(_ceil_div(num_generate, settings.block_length), 1)
    offset = rank % settings.block_length
    block_starts = generate & (offset == 0)
    block_ends = generate & ((offset == settings.block_length - 1) | (rank == num_generate[:, None] - 1))
  else:
    block = jnp.zeros_like(rank)
    num_blocks = jnp.ones_like(num_generate)

  def unfinished(masked):
    """[b, l] (or [b, 1]): whether the position's block still has a masked position."""
    if settings.block_length:
      return _count_in_runs(masked, block_starts, block_ends) > 0
    return jnp.any(masked, axis=-1, keepdims=True)

  eos_banned = generate & (rank < settings.min_length)
  example_keys = jax.vmap(lambda stream: jax.random.fold_in(key, stream))(jnp.asarray(canvas.streams, jnp.int32))

  def still_masked(z):
    return (z == mask_id) & generate

  def cond(carry: _Carry) -> jax.Array:
    return (carry.step < num_steps) & jnp.any(still_masked(carry.z))

  def body(carry: _Carry) -> _Carry:
    i, z = carry.step, carry.z
    masked = still_masked(z)
    # The window: the scheduled blocks, or further when those are finished.
    first_open = jnp.min(jnp.where(masked, block, num_blocks[:, None]), axis=-1)  # [b]
    scheduled = _ceil_div((i + 1) * num_blocks, num_steps) - 1
    window = jnp.minimum(jnp.maximum(scheduled, first_open), num_blocks - 1)
    last = jnp.clip((window + 1) * num_steps // num_blocks - 1, i, num_steps - 1)  # the window's deadline
    start = jnp.where(window != carry.window, i, carry.window_start)
    steps_left, window_steps = last - i + 1, last - start + 1
    t = 1.0 - (i - start) / window_steps  # [b] float32
    s = 1.0 - (i - start + 1) / window_steps
    in_window = generate & (block <= window[:, None])
    open_ = masked & in_window
    committed = in_window & ~masked & unfinished(masked)  # What revision may re-mask: never a finished block.

    logits = denoise_fn(params, z, t.astype(jnp.float32), segment_ids)  # [b, l, vocab]
    # One draw per step and example: the rule's uniform, then the proposal's Gumbel noise (threefry is costly on CPU).
    width = 0 if settings.temperature == 0.0 else noise_width(logits.shape[-1])
    step_keys = jax.vmap(lambda k: jax.random.fold_in(k, i))(example_keys)
    noise = uniform_noise(step_keys, (length, 1 + width))  # [b, l, 1 + width]
    x0, confidence = propose(logits, noise[..., 1:] if width else None, eos_banned, settings)

    inputs = StepInputs(
      x0=x0,
      confidence=confidence,
      open=open_,
      committed=committed,
      score=carry.score,
      k=_ceil_div(open_.sum(axis=-1, dtype=jnp.int32), steps_left),
      steps_left=steps_left,
      window_steps=window_steps,
      t=t.astype(jnp.float32),
      s=s.astype(jnp.float32),
      u=noise[..., 0],
    )
    out = rule(inputs)
    is_last = (i >= last)[:, None]
    commit = (out.commit | is_last) & open_
    remask = out.remask & committed & ~is_last
    z_next = jnp.where(remask, mask_id, jnp.where(commit, x0, z))
    score = jnp.where(commit, confidence, carry.score)
    nfe = carry.nfe + jnp.any(masked, axis=-1).astype(jnp.int32)
    trace = carry.trace
    if trace:
      canvases, commits, remasks = trace
      row = jnp.minimum(i, settings.trace - 1)
      keep = i < settings.trace
      trace = (
        canvases.at[row].set(jnp.where(keep, z_next, canvases[row])),
        commits.at[row].set(jnp.where(keep, commit.sum(axis=-1, dtype=jnp.int32), commits[row])),
        remasks.at[row].set(jnp.where(keep, remask.sum(axis=-1, dtype=jnp.int32), remasks[row])),
      )
    return _Carry(i + 1, z_next, score, window, start, nfe, trace)

  z = jnp.where(generate, mask_id, tokens)
  trace = ()
  if settings.trace:
    trace = (
      jnp.full((settings.trace, batch, length), settings.pad_id, jnp.int32),
      jnp.zeros((settings.trace, batch), jnp.int32),
      jnp.zeros((settings.trace, batch), jnp.int32),
    )
  init = _Carry(
    step=jnp.zeros((), jnp.int32),
    z=z,
    score=jnp.zeros((batch, length), jnp.float32),
    window=jnp.full((batch,), -1, jnp.int32),
    window_start=jnp.zeros((batch,), jnp.int32),
    nfe=jnp.zeros((batch,), jnp.int32),
    trace=trace,
  )
  final = jax.lax.while_loop(cond, body, init)
  z = final.z
  return SampleOutput(pad_after_eos(z, generate, settings), final.nfe, final.step, *final.trace)


def pad_after_eos(z: jax.Array, generate: jax.Array, settings: SamplerSettings) -> jax.Array:
  """The positions after an EOS in its own hole become padding (when ``settings.eos_to_pad``); nothing else changes.

  ``generate`` [b, l] marks the generated positions; a hole is a maximal run of them (see
  :func:`~mercury_jax.sampling.canvas.after_eos`).
  """
  if not settings.eos_to_pad:
    return z
  return jnp.where(after_eos(z, generate, settings.eos_id), settings.pad_id, z)


def jit_sample(
  denoise_fn: DenoiseFn,
  settings: SamplerSettings,
  *,
  mesh: Mesh | None = None,
  rules=None,
  param_shardings: Any = None,
) -> Callable[[Any, Canvas, jax.Array, jax.Array], SampleOutput]:
  """``jax.jit`` of :func:`sample` for fixed settings; on a mesh, canvases are split over the batch axes and the
  model's logical sharding constraints apply (see :func:`~mercury_jax.sampling.mesh.jit_on_mesh`).

  Args:
    denoise_fn: The denoiser (e.g. :func:`model_denoise_fn`).
    settings: Static sampler settings.
    mesh: The device mesh; None for plain ``jax.jit`` (one device or committed inputs).
    rules: Logical axis rules (default ``mercury_jax.sharding.RULES``).
    param_shardings: The parameters' shardings on ``mesh`` (needed with a mesh; e.g.
      ``mercury_jax.trainer.param_shardings``).
  """
  fn = functools.partial(sample, denoise_fn=denoise_fn, settings=settings.validate())
  return jit_on_mesh(fn, mesh, rules, param_shardings, scalars=1, trace=settings.trace, name="jit_sample")
