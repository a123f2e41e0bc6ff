"""Requests made ready for the engine: the text, the canvas, the plan and each row's budget of one decode.

:class:`Jobs` turns a :class:`~mercury_jax.sampling.text.Request` (or a canvas batch) into a :class:`Job`: the
settings, the canvas padded to the plan (:func:`~mercury_jax.sampling.decoders.choose` picks the cache and block),
each row's steps per block (``settings.steps_per_block``: a row's budget depends on its own canvas only), its
constraint (structured output) and its token-healing mask.
"""

from __future__ import annotations

import contextlib
import dataclasses
import zlib
from typing import TYPE_CHECKING

import jax
import numpy as np

from mercury_jax import kinds as K
from mercury_jax.config import Config, SamplingConfig
from mercury_jax.data.tokenizer import Tokenizer
from mercury_jax.sampling import canvas as cv, healing
from mercury_jax.sampling.decoders import APPROXIMATE_BLOCK, Decoder, bucketed_length, choose
from mercury_jax.sampling.placement import BatchLayout, Placement
from mercury_jax.sampling.plan import BlockPlan, plan_blocks
from mercury_jax.sampling.settings import (
  SamplerSettings,
  SettingError,
  block_loads,
  check_knobs_for_model,
  commits_every_step,
  steps_per_block as per_block_of,
)
from mercury_jax.sampling.state import Healing
from mercury_jax.sampling.text import Request, Rows, build_rows

# The knobs a checkpoint's ``[sampling]`` section may default (its own decoding recipe); steps_per_block is the budget.
CHECKPOINT_KNOBS = (
  "rule", "confidence", "commit_counts", "threshold", "block_length", "temperature", "top_p", "top_k",
)  # fmt: skip

if TYPE_CHECKING:  # The host half of structured output loads on first use (outlines-core, jsonschema).
  from mercury_jax.constrain.automaton import Automaton


@dataclasses.dataclass
class Job:
  """A request made ready for the engine (this process's rows)."""

  settings: SamplerSettings
  canvas: cv.Canvas  # numpy, padded to the plan's length
  plan: BlockPlan
  budgets: np.ndarray  # int32 [rows, 2]: each row's steps per block, and its first blocks that take one step more
  seed: int
  rows: Rows | None = None
  layout: BatchLayout | None = None
  automata: list[Automaton | None] | None = None
  healing: Healing | None = None  # numpy, this process's rows


class Jobs:
  """Builds the :class:`Job` of a request for one model and tokenizer (host side, no device work but the
  collective agreement of a ``per_process`` request)."""

  def __init__(self, cfg: Config, tokenizer: Tokenizer, placement: Placement):
    self.cfg, self.tokenizer, self.placement = cfg, tokenizer, placement
    self.autoregressive = cfg.objective.autoregressive
    self.block_size = cfg.objective.block_size
    self.max_length = cfg.model.max_length

  def defaults(self) -> dict:
    """The checkpoint's own decoding defaults (``cfg.sampling``, e.g. a converted model's authors' settings) where
    they differ from the built-in ones: the knobs a request that leaves them unset gets."""
    own, builtin = self.cfg.sampling, SamplingConfig()
    return {name: getattr(own, name) for name in CHECKPOINT_KNOBS if getattr(own, name) != getattr(builtin, name)}

  def settings(self, **knobs) -> SamplerSettings:
    """Sampler settings with this model's schedule, mask, EOS and padding ids; ``knobs`` as in SamplerSettings, and
    the checkpoint's :meth:`defaults` for those not given."""
    tok = self.tokenizer
    knobs = {**self.defaults(), **knobs}
    if self.cfg.objective.continuous and knobs.get("rule") is None:
      knobs["rule"] = "ode"  # The continuous family's one rule.
    return SamplerSettings(
      objective=self.cfg.objective,
      eos_id=tok.eos_id,
      pad_id=tok.pad_id,
      bos_id=tok.bos_id,
      unk_id=tok.unk_id,
      stop_ids=tuple(i for i in tok.stop_ids if i != tok.eos_id),
      num_tokens=tok.vocab_size,
      **knobs,
    ).validate()

  def decoder(self, cache: str = "auto", block_length: int = 0, decode: str = "auto", draft_length: int = 0) -> Decoder:
    """The engine's cache, block and decode mode for this model (:func:`~mercury_jax.sampling.decoders.choose`)."""
    return choose(self.cfg, cache, block_length, decode, draft_length)

  def plan(
    self, canvas: cv.Canvas, decoder: Decoder, length: int | None = None, prefill_chunk: int = 0
  ) -> tuple[cv.Canvas, BlockPlan]:
    """``(canvas padded to the plan, plan)``: a whole-canvas decode (``decoder.block`` 0) runs one block of the
    canvas rounded up to ``LENGTH_BUCKET``; the others the decoder's block. ``length``: the canvas length every row
    shares (default this canvas's); ``prefill_chunk``: see ``SamplerSettings.prefill_chunk``."""
    length = np.shape(canvas.tokens)[1] if length is None else length
    block = decoder.block or bucketed_length(length, self.max_length)
    canvas = _pad_length(canvas, -(-length // block) * block, self.tokenizer.pad_id)
    plan = plan_blocks(
      canvas.kinds,
      block,
      cache=decoder.cache,
      autoregressive=decoder.autoregressive,
      whole_sequence=not (decoder.autoregressive or self.block_size or decoder.causal_context),
      draft=decoder.draft,
      causal_context=decoder.causal_context,
      prefill_chunk=prefill_chunk if decoder.cache == "exact" else 0,
    )
    return canvas, plan

  def steps_per_block(
    self, steps: int | None, steps_per_block: int | None, kinds, block: int, settings: SamplerSettings
  ) -> np.ndarray:
    """Each row's budget, int32 [rows, 2]: its steps per block and its first blocks that take one step more, for a
    total budget ``steps`` or an explicit ``steps_per_block`` (``settings.steps_per_block``): a row's budget depends
    on its own canvas only. The twin always takes one step per block.

    Raises:
      SettingError: Both given, one below 1, or ``steps`` below the blocks a row's generated positions lie in.
    """
    rows = np.shape(kinds)[0]
    if self.autoregressive:
      return np.tile(np.asarray([1, 0], np.int32), (rows, 1))
    if steps is not None and steps_per_block is not None:
      raise SettingError("steps_per_block", steps_per_block, "and steps are two budgets; give one of them")
    if steps_per_block is not None:
      if steps_per_block < 1:
        raise SettingError("steps_per_block", steps_per_block, "must be >= 1")
      return np.tile(np.asarray([steps_per_block, 0], np.int32), (rows, 1))
    capped = commits_every_step(settings)
    budgets = [per_block_of(steps, block_loads(row, block), capped=capped) for row in np.asarray(kinds)]
    return np.asarray(budgets, np.int32).reshape(rows, 2)

  def job(self, canvas, steps, steps_per_block, seed, settings, cache, layout, automata, healing_rows) -> Job:
    decoder = self.decoder(cache, settings.block_length, settings.decode, settings.draft_length)
    constrained_rows = automata is not None and any(a is not None for a in automata)
    if constrained_rows and decoder.block == 0:  # The constrained program walks blocks, not a whole canvas.
      decoder = Decoder(decoder.cache, APPROXIMATE_BLOCK)
    if constrained_rows and layout is not None:
      raise SettingError("constraint", "per_process", "is not supported with per-process prompts; pass every prompt")
    length = np.shape(canvas.tokens)[1] if layout is None else layout.length
    canvas, plan = self.plan(canvas, decoder, length, settings.prefill_chunk)
    whole = plan.block if plan.block < plan.length or not plan.whole_sequence else 0
    per_block = self.steps_per_block(steps, steps_per_block, canvas.kinds, whole, settings)
    return Job(settings, canvas, plan, per_block, seed, None, layout, list(automata) if constrained_rows else None,
               healing_rows)  # fmt: skip

  def row_constraints(self, constraint, canvas: cv.Canvas, num_samples: int) -> list[Automaton | None] | None:
    """Each row's automaton (a prompt's samples share its own), checked against the tokenizer and the canvas."""
    if constraint is None:
      return None
    from mercury_jax.constrain.automaton import Automaton

    rows = np.shape(canvas.tokens)[0]
    if isinstance(constraint, Automaton):
      automata = [constraint] * rows
    else:
      given = list(constraint)
      if len(given) * num_samples != rows:
        raise ValueError(f"constraint has {len(given)} entries but there are {rows // num_samples} prompts")
      automata = [a for a in given for _ in range(num_samples)]
    kinds = np.asarray(canvas.kinds) == K.TARGET
    for row, a in enumerate(automata):
      if a is None:
        continue
      if a.classes.shape[0] != self.tokenizer.vocab_size:
        raise ValueError(
          f"constraint {row} was compiled for a vocabulary of {a.classes.shape[0]} tokens, but this model's tokenizer "
          f"has {self.tokenizer.vocab_size}; compile it with this sampler's constraint()"
        )
      starts = int(np.sum(kinds[row] & ~np.pad(kinds[row], (1, 0))[:-1]))
      if starts != 1:
        raise ValueError(f"a constrained canvas needs exactly one hole, but row {row} has {starts}")
    return automata if any(a is not None for a in automata) else None

  def accepted(self, automaton: Automaton | None, tokens: np.ndarray, kinds: np.ndarray, row: int) -> bool | None:
    """Whether a row's hole (its generated tokens, padding after EOS dropped) is a whole sentence of ``automaton``
    (None without one)."""
    if automaton is None:
      return None
    hole = tokens[row, : kinds.shape[1]][kinds[row] == K.TARGET]
    return automaton.accepts([int(t) for t in hole if t != self.tokenizer.pad_id])

  def prepare(self, request: Request, constraint) -> Job | None:
    """Checks a request and builds its :class:`Job`, or None when no process has a prompt (``per_process``)."""
    spread = request.per_process and jax.process_count() > 1
    request = dataclasses.replace(request, knobs={**self.defaults(), **request.knobs})
    if request.steps is None and request.steps_per_block is None and self.cfg.sampling.steps_per_block:
      request = dataclasses.replace(request, steps_per_block=self.cfg.sampling.steps_per_block)
    try:
      knobs = request.knobs
      decoder = self.decoder(  # A cache or mode the model lacks, at once.
        request.cache, knobs.get("block_length") or 0, knobs.get("decode", "auto"), knobs.get("draft_length") or 0
      )
      check_knobs_for_model(
        {"steps": request.steps, "steps_per_block": request.steps_per_block, **knobs}, decoder.autoregressive
      )
      heal = (
        request.token_healing
        and constraint is None
        and not request.per_process
        and not request.bos
        and (decoder.autoregressive or decoder.causal_context or self.block_size > 0)
      )
      rows, _ = build_rows(
        request, self.tokenizer, max_length=self.max_length, autoregressive=decoder.autoregressive, heal=heal
      )
    except ValueError:
      if spread:  # Tell the other processes, which would otherwise wait for this one.
        with contextlib.suppress(ValueError):
          self.placement.agree_on_batch(0, 0, failed=True)
      raise
    offset, layout = 0, None
    examples = rows.examples
    if spread:
      width = max((sum(p.length if isinstance(p, cv.Hole) else len(p) for p in e) for e in examples), default=0)
      digest = zlib.crc32(repr((request.knobs, request.steps, request.steps_per_block, request.seed)).encode())
      layout = self.placement.agree_on_batch(len(examples), width, digest=digest)
      offset = int(layout.rows[: jax.process_index()].sum())
    if not (examples if layout is None else layout.rows.any()):
      return None
    streams = request.streams if request.streams is not None else range(offset, offset + len(examples))
    pad_id = self.tokenizer.pad_id
    canvas = cv.make_canvas(examples, streams=streams, pad_id=pad_id) if examples else _empty_canvas(layout.length)
    automata = self.row_constraints(constraint, canvas, request.num_samples)
    healing_rows = self.healing(rows)
    settings = self.settings(**request.knobs)
    job = self.job(
      canvas, request.steps, request.steps_per_block, request.seed, settings, request.cache, layout, automata,
      healing_rows,
    )  # fmt: skip
    job.rows = rows
    if request.show_steps and decoder.draft:  # One frame per step: at most one per generated position.
      most = int((np.asarray(job.canvas.kinds) == K.TARGET).sum(axis=1).max(initial=1))
      job.settings = dataclasses.replace(settings, trace=max(most, 1))
    elif request.show_steps and not decoder.autoregressive:  # One frame per step: steps per block times the blocks.
      blocks = max((len(block_loads(row, job.plan.block)) for row in np.asarray(job.canvas.kinds)), default=1)
      most = int((job.budgets[:, 0] + (job.budgets[:, 1] > 0)).max(initial=1))  # steps of a row's longest block
      job.settings = dataclasses.replace(settings, trace=most * max(blocks, 1))
    return job

  def healing(self, rows: Rows) -> Healing | None:
    """Each row's healing mask and position (numpy), or None when no row heals."""
    if not any(rows.healed):
      return None
    vocab = self.cfg.model.vocab_size
    allowed = np.ones((len(rows.healed), vocab), bool)
    slot = np.full((len(rows.healed),), -1, np.int32)
    for row, text in enumerate(rows.healed):
      if text:
        allowed[row] = healing.allowed_tokens(self.tokenizer, text, vocab)
        slot[row] = rows.prompt_lengths[row]
    return Healing(allowed, slot)


def _pad_length(canvas: cv.Canvas, length: int, pad_id: int) -> cv.Canvas:
  """Right-pads canvases to ``length`` positions."""
  extra = length - np.shape(canvas.tokens)[1]
  if extra <= 0:
    return canvas
  return cv.Canvas(
    np.pad(np.asarray(canvas.tokens), ((0, 0), (0, extra)), constant_values=pad_id),
    np.pad(np.asarray(canvas.kinds), ((0, 0), (0, extra)), constant_values=K.PAD),
    canvas.streams,
  )


def _empty_canvas(length: int) -> cv.Canvas:
  """No rows (a process without prompts of a per-process call)."""
  return cv.Canvas(np.zeros((0, length), np.int32), np.zeros((0, length), np.int32), np.zeros((0,), np.int32))
