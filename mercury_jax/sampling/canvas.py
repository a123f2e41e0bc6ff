"""Canvases: what the sampler fills in. Prompts, infilling and templates all become ``(tokens, kinds)`` rows.

A canvas row has one kind per position (``mercury_jax.kinds``, the training records' kinds, so a sampler canvas looks
like an SFT record): ``FIXED`` tokens (prompt, fill-in-the-middle context, a template's text) are conditioning and
never change; ``TARGET`` positions start masked and are filled by the sampler; ``PAD`` right-pads rows of a batch to
one length and is never attended to.

Templates are strings whose holes are written ``<mask:N>`` (N tokens to generate), for example
``'{"name": "<mask:8>", "age": <mask:2>}'``: the text between holes is fixed, which gives schema-aligned output.

A hole is a maximal run of consecutive ``TARGET`` positions. An end-of-sequence token ends its own hole only
(:func:`after_eos`): the rest of that hole becomes padding, while later fixed text and later holes are kept and
still generated.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mercury_jax.kinds import FIXED, PAD, TARGET

HOLE_PATTERN = re.compile(r"<mask:(\d+)>")


class Canvas(NamedTuple):
  """A batch of canvases (a pytree of arrays, so it passes through ``jax.jit``).

  Attributes:
    tokens: int32 [batch, length]: the fixed tokens; the value at ``TARGET`` and ``PAD`` positions is ignored.
    kinds: int32 [batch, length]: ``PAD`` (0), ``FIXED`` (1) or ``TARGET`` (2) per position.
    streams: int32 [batch]: each example's random stream; the example's draws come from
      ``fold_in(key, streams[i])``, so an example gives the same output alone or at any row of any batch when
      its stream is the same.
  """

  tokens: jax.Array | np.ndarray
  kinds: jax.Array | np.ndarray
  streams: jax.Array | np.ndarray


@dataclasses.dataclass(frozen=True)
class Hole:
  """``length`` positions for the sampler to fill."""

  length: int


Piece = Sequence[int] | Hole  # Fixed token ids, or a hole.


def prefix(prompt_ids: Sequence[int], length: int) -> list[Piece]:
  """A prompt followed by ``length`` tokens to generate (plain continuation)."""
  return [list(prompt_ids), Hole(length)]


def parse_template(template: str, encode: Callable[[str], list[int]]) -> list[Piece]:
  """Splits a template at its ``<mask:N>`` holes and encodes the fixed text between them.

  Raises:
    ValueError: The template has no hole, or a hole of length 0.
  """
  pieces: list[Piece] = []
  position = 0
  for match in HOLE_PATTERN.finditer(template):
    if match.start() > position:
      pieces.append(encode(template[position : match.start()]))
    size = int(match.group(1))
    if size < 1:
      raise ValueError(f"template hole {match.group(0)!r} must ask for at least 1 token")
    pieces.append(Hole(size))
    position = match.end()
  if not any(isinstance(p, Hole) for p in pieces):
    raise ValueError(f"template {template!r} has no hole; write the positions to fill as <mask:N>, e.g. <mask:8>")
  if position < len(template):
    pieces.append(encode(template[position:]))
  return pieces


def example(pieces: Sequence[Piece]) -> tuple[np.ndarray, np.ndarray]:
  """``(tokens, kinds)`` of one canvas, int32 [length] each."""
  tokens, kinds = [], []
  for piece in pieces:
    if isinstance(piece, Hole):
      tokens.extend([0] * piece.length)
      kinds.extend([TARGET] * piece.length)
    else:
      tokens.extend(int(t) for t in piece)
      kinds.extend([FIXED] * len(piece))
  return np.asarray(tokens, np.int32), np.asarray(kinds, np.int32)


def make_canvas(
  examples: Sequence[Sequence[Piece]],
  *,
  length: int | None = None,
  streams: Sequence[int] | None = None,
  pad_id: int = 0,
) -> Canvas:
  """Right-pads examples of different lengths into one batch.

  Args:
    examples: Each example's pieces (see :func:`prefix` and :func:`parse_template`).
    length: Canvas length; default: the longest example.
    streams: Each example's random stream; default: its index.
    pad_id: The token written at padding positions.

  Raises:
    ValueError: An example is longer than ``length``, has nothing to generate, or ``streams`` has the wrong size.
  """
  rows = [example(pieces) for pieces in examples]
  for i, (_, kinds) in enumerate(rows):
    if not (kinds == TARGET).any():
      raise ValueError(f"example {i} has no position to generate; add a Hole (or <mask:N> in a template)")
  longest = max((len(t) for t, _ in rows), default=0)
  length = longest if length is None else length
  if longest > length:
    raise ValueError(f"an example of {longest} tokens does not fit a canvas of length={length}")
  tokens = np.full((len(rows), length), pad_id, np.int32)
  kinds = np.full((len(rows), length), PAD, np.int32)
  for i, (t, k) in enumerate(rows):
    tokens[i, : len(t)], kinds[i, : len(k)] = t, k
  streams = np.arange(len(rows), dtype=np.int32) if streams is None else np.asarray(streams, np.int32)
  if streams.shape != (len(rows),):
    raise ValueError(f"streams has shape {streams.shape} but there are {len(rows)} examples")
  return Canvas(tokens, kinds, streams)


def from_fixed(tokens, fixed, valid=None, streams=None) -> Canvas:
  """A canvas from arrays: ``fixed`` [b, l] marks tokens to keep (any pattern: infilling), ``valid`` the non-padding.

  Positions that are valid and not fixed are generated.
  """
  tokens = np.asarray(tokens, np.int32)
  fixed = np.asarray(fixed, bool)
  valid = np.ones_like(fixed) if valid is None else np.asarray(valid, bool)
  kinds = np.where(valid, np.where(fixed, FIXED, TARGET), PAD).astype(np.int32)
  streams = np.arange(tokens.shape[0], dtype=np.int32) if streams is None else np.asarray(streams, np.int32)
  return Canvas(tokens, kinds, streams)


def pad_length(canvas: Canvas, length: int, pad_id: int = 0) -> Canvas:
  """Right-pads canvases to ``length`` positions (a plan's)."""
  extra = length - np.shape(canvas.tokens)[1]
  if extra <= 0:
    return canvas
  return Canvas(
    np.pad(np.asarray(canvas.tokens), ((0, 0), (0, extra)), constant_values=pad_id),
    np.pad(np.asarray(canvas.kinds), ((0, 0), (0, extra)), constant_values=PAD),
    canvas.streams,
  )


def pad_batch(canvas: Canvas, multiple: int, pad_id: int = 0) -> Canvas:
  """Adds all-padding rows (nothing to generate) so the batch divides by ``multiple`` (a mesh's data size)."""
  batch, length = canvas.tokens.shape
  extra = -batch % multiple
  if not extra:
    return canvas
  return Canvas(
    np.concatenate([np.asarray(canvas.tokens), np.full((extra, length), pad_id, np.int32)]),
    np.concatenate([np.asarray(canvas.kinds), np.full((extra, length), PAD, np.int32)]),
    np.concatenate([np.asarray(canvas.streams), np.zeros((extra,), np.int32)]),
  )


def after_eos(tokens: jax.Array, generate: jax.Array, eos_id: int, known: jax.Array | None = None) -> jax.Array:
  """Generated positions that follow an EOS of their own hole, bool [batch, length].

  A hole is a maximal run of consecutive generated positions; an EOS masks the rest of its hole and nothing else.

  Args:
    tokens: int32 [batch, length].
    generate: bool [batch, length], the ``TARGET`` positions.
    eos_id: The end-of-sequence token.
    known: Optional bool [batch, length]: only an EOS at a known position counts (a decoder's decided positions).
  """
  eos = generate & (tokens == eos_id)
  if known is not None:
    eos &= known
  eos = eos.astype(jnp.int32)
  before = jnp.cumsum(eos, axis=-1) - eos  # [b, l] EOS strictly before each position
  starts = generate & ~jnp.pad(generate, ((0, 0), (1, 0)))[:, :-1]  # the first position of each hole
  # ``before`` does not decrease, so the running max of its value at hole starts is its value at this hole's start.
  at_start = jax.lax.cummax(jnp.where(starts, before, 0), axis=1)
  return generate & (before > at_start)


class SampleOutput(NamedTuple):
  """The sampler's result.

  Attributes:
    tokens: int32 [batch, length]: the finished canvases (no mask left; after a generated EOS, the rest of its hole
      is padding).
    nfe: int32 [batch]: forward passes each example needed (steps in which it needed the network).
    forwards: int32 []: steps in which the batch ran the network (``steps`` until this release).
    canvases: int32 [trace, batch, length]: the canvas after each step, when ``settings.trace`` > 0.
    commits: int32 [trace, batch]: tokens committed at each step, when traced.
    remasks: int32 [trace, batch]: tokens re-masked at each step (revision), when traced.
    accepted: int32 [batch, W]: verified decoding's steps that accepted 0, 1, ..., W - 1 candidates (None
      otherwise; ``W - 1`` is the draft tree's depth, ``k - 1`` for the drafter's chain).
    sources: int32 [batch, 3]: verified decoding's accepted candidates from the drafter's chain, its alternatives
      and the lookup chain (``mercury_jax.sampling.drafts``; None otherwise).
  """

  tokens: jax.Array
  nfe: jax.Array
  forwards: jax.Array
  canvases: jax.Array | None = None
  commits: jax.Array | None = None
  remasks: jax.Array | None = None
  accepted: jax.Array | None = None
  sources: jax.Array | None = None

  @property
  def steps(self) -> jax.Array:
    """Deprecated: :attr:`forwards` (it counts forward passes, not refinement steps)."""
    warnings.warn("SampleOutput.steps is deprecated; it is SampleOutput.forwards", DeprecationWarning, stacklevel=2)
    return self.forwards
