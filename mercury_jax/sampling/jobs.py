"""Requests made ready for the engine: the rows, the canvas, the plan and each row's budget of one decode.

:class:`Jobs` turns a :class:`~mercury_jax.sampling.text.Request` (text) into token-level rows
(:class:`~mercury_jax.sampling.text.Row`, the same rows the server builds) and the rows into a :class:`Job`: the
settings, the canvas padded to the plan (:func:`~mercury_jax.sampling.plan.plan_for`), each row's steps per block
(``settings.steps_per_block``: a row's budget depends on its own canvas only), its constraint (structured output)
and its token-healing mask (:func:`~mercury_jax.sampling.healing.masks`).
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
from mercury_jax.sampling.drafts import Drafting
from mercury_jax.sampling.placement import BatchLayout, Placement
from mercury_jax.sampling.plan import BlockPlan, Decoding, plan_for
from mercury_jax.sampling.settings import (
  AUTO,
  SamplerSettings,
  SettingError,
  block_loads,
  check_knobs_for_model,
  commits_every_step,
  steps_per_block as per_block_of,
)
from mercury_jax.sampling.state import Healing
from mercury_jax.sampling.text import Request, Row, Rows, build_rows

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


@dataclasses.dataclass(frozen=True)
class Budget:
  """A request's step budget: ``steps`` for the generated length or ``steps_per_block`` (at most one; neither: one
  token per step)."""

  steps: int | None = None
  steps_per_block: int | None = None


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

  def plan(self, decoding: Decoding, length: int | None = None, *, whole_canvas: bool = True) -> BlockPlan:
    """The plan of this model's canvases of ``length`` positions (default: its context) decoded as ``decoding`` asks
    (:func:`~mercury_jax.sampling.plan.plan_for`)."""
    return plan_for(self.cfg, decoding, self.max_length if length is None else length, whole_canvas=whole_canvas)

  def steps_per_block(self, budget: Budget, kinds, block: int, settings: SamplerSettings) -> np.ndarray:
    """Each row's budget, int32 [rows, 2]: its steps per block and its first blocks that take one step more, for a
    total budget ``steps`` or an explicit ``steps_per_block`` (``settings.steps_per_block``): a row's budget depends
    on its own canvas only. The twin always takes one step per block.

    Raises:
      SettingError: Both given, one below 1, or ``steps`` below the blocks a row's generated positions lie in.
    """
    rows, steps, per_block = np.shape(kinds)[0], budget.steps, budget.steps_per_block
    if self.autoregressive:
      return np.tile(np.asarray([1, 0], np.int32), (rows, 1))
    if steps is not None and per_block is not None:
      raise SettingError("steps_per_block", per_block, "and steps are two budgets; give one of them")
    if per_block is not None:
      if per_block < 1:
        raise SettingError("steps_per_block", per_block, "must be >= 1")
      return np.tile(np.asarray([per_block, 0], np.int32), (rows, 1))
    capped = commits_every_step(settings)
    budgets = [per_block_of(steps, block_loads(row, block), capped=capped) for row in np.asarray(kinds)]
    return np.asarray(budgets, np.int32).reshape(rows, 2)

  def job(self, canvas: cv.Canvas, budget: Budget, settings: SamplerSettings, decoding: Decoding, **rows) -> Job:
    """The job of a canvas batch (numpy): ``rows`` are the optional ``layout`` (per-process rows), ``automata`` (each
    row's constraint or None) and ``healing`` (token healing's masks)."""
    layout, automata = rows.get("layout"), rows.get("automata")
    constrained = automata is not None and any(a is not None for a in automata)
    if constrained and layout is not None:
      raise SettingError("constraint", "per_process", "is not supported with per-process prompts; pass every prompt")
    length = np.shape(canvas.tokens)[1] if layout is None else layout.length
    # The constrained program walks blocks, not a whole canvas.
    plan = self.plan(decoding, length, whole_canvas=not constrained)
    canvas = cv.pad_length(canvas, plan.length, self.tokenizer.pad_id)
    if plan.autoregressive:
      target = np.asarray(canvas.kinds) == K.TARGET
      if (target.any(axis=1) & (np.argmax(target, axis=1) == 0)).any():
        raise ValueError("the autoregressive twin needs a known first token in every row (a prompt, or BOS)")
    whole = plan.block if plan.block < plan.length or not plan.whole_sequence else 0
    per_block = self.steps_per_block(budget, canvas.kinds, whole, settings)
    return Job(settings, canvas, plan, per_block, rows.get("seed", 0), None, layout,
               list(automata) if constrained else None, rows.get("healing"))  # fmt: skip

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

  def decoding(self, request: Request) -> Decoding:
    """What ``request`` asks about the plan."""
    knobs = request.knobs
    drafting = Drafting(knobs.get("draft_tree", AUTO), knobs.get("draft_lookup", -1), knobs.get("draft_blocks", AUTO))
    return Decoding(
      request.cache, knobs.get("block_length") or 0, knobs.get("decode", "auto"), knobs.get("draft_length") or 0,
      knobs.get("prefill_chunk") or 0, drafting,
    )  # fmt: skip

  def rows(self, request: Request, decoding: Decoding, constraint) -> Rows:
    """The request's rows (its knobs checked against the model first).

    Raises:
      SettingError, ValueError: A knob or mode the model lacks, or a prompt or template the rows cannot hold.
    """
    plan = self.plan(decoding)  # A cache or mode the model lacks, at once.
    budget = {"steps": request.steps, "steps_per_block": request.steps_per_block}
    check_knobs_for_model({**budget, **request.knobs}, plan.autoregressive)
    heal = (
      request.token_healing
      and constraint is None
      and not request.per_process
      and not request.bos
      and (plan.autoregressive or plan.causal_context or self.block_size > 0)
    )
    return build_rows(request, self.tokenizer, max_length=self.max_length, autoregressive=plan.autoregressive,
                      heal=heal)[0]  # fmt: skip

  def prepare(self, request: Request, constraint) -> Job | None:
    """Checks a request and builds its :class:`Job`, or None when no process has a prompt (``per_process``)."""
    spread = request.per_process and jax.process_count() > 1
    request = dataclasses.replace(request, knobs={**self.defaults(), **request.knobs})
    if request.steps is None and request.steps_per_block is None and self.cfg.sampling.steps_per_block:
      request = dataclasses.replace(request, steps_per_block=self.cfg.sampling.steps_per_block)
    decoding = self.decoding(request)
    try:
      rows = self.rows(request, decoding, constraint)
    except ValueError:
      if spread:  # Tell the other processes, which would otherwise wait for this one.
        with contextlib.suppress(ValueError):
          self.placement.agree_on_batch(0, 0, failed=True)
      raise
    offset, layout = 0, None
    if spread:
      width = max((row.positions for row in rows.rows), default=0)
      digest = zlib.crc32(repr((request.knobs, request.steps, request.steps_per_block, request.seed)).encode())
      layout = self.placement.agree_on_batch(len(rows.rows), width, digest=digest)
      offset = int(layout.rows[: jax.process_index()].sum())
    if not (rows.rows if layout is None else layout.rows.any()):
      return None
    streams = request.streams if request.streams is not None else range(offset, offset + len(rows.rows))
    canvas = self.canvas(rows.rows, streams, layout)
    settings = self.settings(**request.knobs)
    budget = Budget(request.steps, request.steps_per_block)
    automata = self.row_constraints(constraint, canvas, request.num_samples)
    heal = self.healing(rows.rows, rows.prompt_lengths)
    job = self.job(canvas, budget, settings, decoding, layout=layout, automata=automata, healing=heal,
                   seed=request.seed)  # fmt: skip
    job.rows = rows
    if request.show_steps:
      job.settings = dataclasses.replace(settings, trace=self.frames(job))
    return job

  def canvas(self, rows: list[Row], streams, layout: BatchLayout | None) -> cv.Canvas:
    """The rows' canvas batch (numpy), each row on its random stream; an empty batch of the layout's length for a
    process without rows."""
    if not rows:
      return cv.Canvas(np.zeros((0, layout.length), np.int32), np.zeros((0, layout.length), np.int32),
                       np.zeros((0,), np.int32))  # fmt: skip
    return cv.make_canvas([row.pieces for row in rows], streams=streams, pad_id=self.tokenizer.pad_id)

  def frames(self, job: Job) -> int:
    """The trace's frames of a ``show_steps`` job: one per step, at most one per generated position (verified) or
    the steps of a row's longest block times its blocks."""
    kinds = np.asarray(job.canvas.kinds)
    if job.plan.draft:
      return max(int((kinds == K.TARGET).sum(axis=1).max(initial=1)), 1)
    if job.plan.autoregressive:
      return 0
    blocks = max((len(block_loads(row, job.plan.block)) for row in kinds), default=1)
    most = int((job.budgets[:, 0] + (job.budgets[:, 1] > 0)).max(initial=1))  # steps of a row's longest block
    return most * max(blocks, 1)

  def healing(self, rows: list[Row], prompt_lengths: list[int]) -> Healing | None:
    """Each row's healing mask and position (numpy, :func:`~mercury_jax.sampling.healing.masks`), or None when no
    row heals."""
    if not any(row.heal for row in rows):
      return None
    return healing.masks(self.tokenizer, [row.heal for row in rows], prompt_lengths, self.cfg.model.vocab_size)
