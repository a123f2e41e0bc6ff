"""Text in, text out: ``Sampler.from_checkpoint(dir, mesh=...)`` once, then ``.generate(prompts, steps=...)``.

The tokenizer, the params-only restore, the mesh and the compiled engine programs are set up once and reused; each
(settings, batch, length) combination compiles once, whatever the step budget, temperature, top-k, top-p and threshold
(they are traced). Batches are padded to the mesh's data-parallel size and canvases to the engine's block (a
whole-canvas decode: to a multiple of ``LENGTH_BUCKET`` tokens); padding never changes an example's output.

Every checkpoint decodes through the one engine (:mod:`~mercury_jax.sampling.engine`); which cache and block it runs
is :func:`~mercury_jax.sampling.plan.plan_for`'s answer to ``generate(..., cache=...)``. ``generate`` runs the
engine's two programs, ``init`` and ``advance`` to the end; ``stream`` runs the same two, ``advance`` a block (or a
step) at a time, so both give the same tokens.

Step budgets: ``steps`` is the refinement budget of each sample's generated positions, never exceeded: a row's blocks
get the same steps, the most that keep its total within ``steps``, and its first blocks one more while the budget
lasts (``settings.steps_per_block``; a block never takes more steps than it has positions); a budget below one step
per block is an error. ``steps_per_block`` sets the
engine's steps per block directly. Neither: one token per step. A row's budget depends on its own canvas only.

Several processes (a multi-host mesh) either all pass the same prompts and all get every sample, or, with
``generate(..., per_process=True)``, each passes its own prompts and gets only its own samples; row ``i`` of process
``p`` then draws from stream ``(rows of processes 0 .. p-1) + i``, so the tokens equal those of one process given all
the prompts in process order.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from mercury_jax import kinds as K, sharding as sh
from mercury_jax.checkpoint import restore_params
from mercury_jax.config import Config, MeshConfig
from mercury_jax.data.tokenizer import Tokenizer, load_tokenizer
from mercury_jax.model import param_shardings
from mercury_jax.sampling import automata as constrained, canvas as cv, healing
from mercury_jax.sampling.canvas import SampleOutput
from mercury_jax.sampling.engine import Start, prefill_slots
from mercury_jax.sampling.jobs import Budget, Job, Jobs
from mercury_jax.sampling.network import Network
from mercury_jax.sampling.placement import BatchLayout, Placement, own_rows, pad_rows
from mercury_jax.sampling.plan import APPROXIMATE_BLOCK, CACHE_CHOICES, LENGTH_BUCKET, BlockPlan, Decoding
from mercury_jax.sampling.programs import Programs, compilations
from mercury_jax.sampling.proposal import Knobs
from mercury_jax.sampling.registry import BUNDLED_MODELS, DEFAULT_CHECKPOINT, default_checkpoint
from mercury_jax.sampling.settings import SamplerSettings
from mercury_jax.sampling.state import Healing
from mercury_jax.sampling.text import MASK_TEXT, Detokenizer, Request, Sample, StreamEvent, frames

if TYPE_CHECKING:  # The host half of structured output loads on first use (outlines-core, jsonschema).
  from mercury_jax.constrain.automaton import Automaton, Compiler

__all__ = [
  "APPROXIMATE_BLOCK",
  "BUNDLED_MODELS",
  "CACHE_CHOICES",
  "DEFAULT_CHECKPOINT",
  "LENGTH_BUCKET",
  "MASK_TEXT",
  "BatchLayout",
  "Sample",
  "Sampler",
  "StreamEvent",
  "default_checkpoint",
]
_UNBOUNDED = np.iinfo(np.int32).max  # An ``advance`` budget that never ends a chunk.


def is_autoregressive(cfg: Config) -> bool:
  """True for the autoregressive twin (decoded token by token), False for a diffusion denoiser."""
  return cfg.objective.autoregressive


def check_compatible(cfg: Config, tokenizer: Tokenizer) -> None:
  """Raises ``ValueError`` when the model cannot be sampled with this tokenizer."""
  if is_autoregressive(cfg) != cfg.model.causal:
    raise ValueError(
      f"objective.name={cfg.objective.name!r} with model.causal={cfg.model.causal}: an autoregressive "
      "model must be causal and a diffusion model bidirectional"
    )
  if tokenizer.vocab_size > cfg.model.vocab_size:
    raise ValueError(
      f"the tokenizer has {tokenizer.vocab_size} pieces but the model's vocab_size is {cfg.model.vocab_size}: "
      "the checkpoint and its tokenizer.model do not belong together"
    )
  if tokenizer.mask_id != cfg.objective.mask_id:
    raise ValueError(f"the tokenizer's mask id {tokenizer.mask_id} differs from the model's {cfg.objective.mask_id}")


class Sampler:
  """A model, its tokenizer and a mesh, ready to generate.

  Args:
    params: Parameters, sharded on ``mesh`` (as ``restore_params(path, mesh=mesh)`` returns them).
    cfg: The model's config (as stored in its checkpoint): a diffusion model or the autoregressive twin.
    tokenizer: The tokenizer the model was trained with.
    mesh: The device mesh; default: one device.
  """

  def __init__(self, params: Any, cfg: Config, tokenizer: Tokenizer, *, mesh: Mesh | None = None):
    check_compatible(cfg, tokenizer)
    # Sampling runs the layer stack as a loop whatever the training chose: an unrolled stack speeds up the backward
    # pass on XLA:CPU, but here it mostly adds compile time (docs/results/engine.md). The parameters are the same
    # arrays.
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, unroll_layers=False))
    self.cfg, self.tokenizer = cfg, tokenizer
    self.autoregressive = is_autoregressive(cfg)
    self.block_size = cfg.objective.block_size  # 0: a whole-sequence diffusion model (or the twin)
    self.mesh = mesh if mesh is not None else sh.make_mesh(MeshConfig(data=1), jax.devices()[:1])
    self.rules = sh.axis_rules(cfg.mesh)
    self.network = Network(cfg.model)
    self.param_shardings = param_shardings(self.network.model, self.mesh, self.rules)
    self.params = jax.device_put(params, self.param_shardings)
    self.placement = Placement(self.mesh, self.rules)
    self.programs = Programs(self.network, self.mesh, self.rules, self.param_shardings)
    self.jobs = Jobs(cfg, tokenizer, self.placement)
    self._compiler: Compiler | None = None  # structured output's constraint compiler, made on first use

  @classmethod
  def from_checkpoint(cls, path: str | Path | None = None, *, mesh: Mesh | None = None, step: int | None = None):
    """Restores only the parameters (and the config) onto ``mesh`` and loads ``tokenizer.model`` beside them.

    Args:
      path: A train workdir, its checkpoints folder, a step folder or an exported checkpoint; default: the
        packaged model.
      mesh: The device mesh; default: one device.
      step: Which step; default: the latest.

    Raises:
      FileNotFoundError: No checkpoint or tokenizer at ``path`` (or no packaged model).
      ValueError: The checkpoint and tokenizer do not fit together.
    """
    if path is None:
      path = default_checkpoint()
      if path is None:
        raise FileNotFoundError(f"no default model is bundled yet ({DEFAULT_CHECKPOINT} is empty)")
    mesh = mesh if mesh is not None else sh.make_mesh(MeshConfig(data=1), jax.devices()[:1])
    tokenizer = load_tokenizer(path)
    params, cfg = restore_params(path, mesh=mesh, step=step)
    return cls(params, cfg, tokenizer, mesh=mesh)

  @property
  def max_length(self) -> int:
    return self.cfg.model.max_length

  def settings(self, **knobs) -> SamplerSettings:
    """Sampler settings with this model's schedule, mask, EOS and padding ids; ``knobs`` as in SamplerSettings."""
    return self.jobs.settings(**knobs)

  def plan(
    self, decoding: Decoding | None = None, length: int | None = None, *, whole_canvas: bool = True
  ) -> BlockPlan:
    """The plan of this model's canvases of ``length`` positions (default: its context) decoded as ``decoding`` asks
    (:func:`~mercury_jax.sampling.plan.plan_for`); ``.decode`` says how the model decodes by default."""
    return self.jobs.plan(decoding or Decoding(), length, whole_canvas=whole_canvas)

  def steps_per_block(self, budget: Budget, kinds, block: int, settings: SamplerSettings) -> np.ndarray:
    """Each row's budget, [rows, 2]: steps per block and blocks with one more
    (:meth:`Jobs.steps_per_block <mercury_jax.sampling.jobs.Jobs.steps_per_block>`)."""
    return self.jobs.steps_per_block(budget, kinds, block, settings)

  # ------------------------------------------------------------------------------------------- canvases

  def run(
    self,
    canvas: cv.Canvas,
    steps: int | None,
    seed: int,
    settings: SamplerSettings,
    *,
    layout: BatchLayout | None = None,
    cache: str = "auto",
    steps_per_block: int | None = None,
    automata: Sequence[Automaton | None] | None = None,
  ) -> tuple[SampleOutput, float, float]:
    """Decodes a canvas batch (numpy; with ``layout``, this process's rows) with ``settings``.

    Returns:
      ``(output as numpy arrays, wall seconds, compile seconds)``; the output's canvases keep the padded length (the
      first ``canvas.tokens.shape[1]`` positions are the given ones) and its rows are the given ones.
    """
    decoding = Decoding.of(settings, cache)
    job = self.jobs.job(
      canvas, Budget(steps, steps_per_block), settings, decoding, layout=layout, automata=automata, seed=seed
    )
    engine, state, clock = self._start(job)
    state = clock.run(lambda: jax.block_until_ready(self._advance(engine, state, _UNBOUNDED, _UNBOUNDED)))
    return self._output(job, state, engine), clock.wall, clock.compile

  def _start(self, job: Job):
    """Places a job and runs its prefill: ``(engine, state, clock)``."""
    settings, layout, place = job.settings, job.layout, self.placement
    canvas = job.canvas
    if layout is not None and layout.own_devices:  # Each process places its rows on its devices.
      placed = place.own_canvas(canvas, layout, settings.pad_id)
    else:
      if layout is not None:  # Processes share batch rows: every process builds the whole batch, in process order.
        canvas = pad_rows(canvas, layout.local_rows, settings.pad_id)
        canvas = cv.Canvas(*(np.asarray(multihost_utils.process_allgather(a, tiled=True)) for a in canvas))
      placed = place.canvas(canvas, settings.pad_id)
    batch = np.shape(placed.tokens)[0]
    tables, capacity = None, None
    if job.automata is not None:
      capacity = constrained.capacity_of(job.automata)
      padded = [*job.automata, *[None] * (batch - len(job.automata))]
      tables = place.put_rows(constrained.tables(padded, capacity, self.cfg.model.vocab_size))
    heal = None
    if job.healing is not None:
      extra = batch - job.healing.slot.shape[0]
      heal = place.put_rows(
        Healing(
          np.pad(job.healing.allowed, ((0, extra), (0, 0))), np.pad(job.healing.slot, (0, extra), constant_values=-1)
        )
      )
    prefill = None  # Every slot: per-process rows differ, and every process must run the same programs.
    if job.plan.cache == "exact" and job.layout is None:
      prefill = prefill_slots(np.asarray(job.canvas.kinds), job.plan)
    engine = self.programs.engine(settings, job.plan)
    values = (settings.temperature, settings.top_k, settings.top_p, settings.threshold)
    dtypes = (np.float32, np.int32, np.float32, np.float32)
    knobs = Knobs(*(place.put(np.asarray(v, t)) for v, t in zip(values, dtypes, strict=True)))
    per_block, extra = self._row_steps(job, batch)
    clock = _Clock()
    init = self.programs.prefill(engine, prefill)
    start = Start(placed, place.key(job.seed), per_block, knobs, tables, heal, extra)
    state = clock.run(lambda: jax.block_until_ready(init(self.params, start)))
    return engine, state, clock

  def _advance(self, engine, state, max_blocks: int, max_steps: int):
    """The state after a chunk of steps (the engine's ``advance``, the state donated)."""
    budget = self.placement.put(np.int32(max_blocks)), self.placement.put(np.int32(max_steps))
    return self.programs.advance(engine)(self.params, state, *budget)

  def _row_steps(self, job: Job, batch: int) -> tuple[jax.Array, jax.Array]:
    """Each row's steps per block and blocks with one step more, placed like the canvas rows (padding rows: 1, 0)."""
    layout, place = job.layout, self.placement

    def pad(a, n):
      return np.concatenate([a, np.tile(np.asarray([1, 0], np.int32), (n - a.shape[0], 1))])

    if layout is None:
      budgets = pad(job.budgets, batch)
    else:
      local = pad(job.budgets, layout.local_rows)
      if layout.own_devices:
        return tuple(
          jax.make_array_from_process_local_data(place.batched(1), np.ascontiguousarray(local[:, i]), (batch,))
          for i in range(2)
        )
      budgets = pad(np.asarray(multihost_utils.process_allgather(local, tiled=True)), batch)
    return tuple(place.put(np.ascontiguousarray(budgets[:, i]), place.batched(1)) for i in range(2))

  def _output(self, job: Job, state, engine) -> SampleOutput:
    """The finished canvases (numpy) of this process's rows."""
    length = np.shape(job.canvas.tokens)[1]
    layout = job.layout
    own = layout is not None and layout.own_devices
    fetch = (lambda x, axis: own_rows(x, axis)) if own else (lambda x, axis: self.placement.gather(x))
    tokens = engine.to_canvas(fetch(state.z, 0), length)
    nfe = fetch(state.nfe, 0)
    forwards = fetch(state.forwards, None)
    trace = ()
    if state.trace:
      canvases, commits, remasks = state.trace
      trace = (engine.to_canvas(fetch(canvases, 1), length), fetch(commits, 1), fetch(remasks, 1))
    accepted = None if state.draft is None else fetch(state.draft.accepted, 0)
    sources = None if state.draft is None else fetch(state.draft.sources, 0)
    first = 0
    if layout is not None and not own:
      first = jax.process_index() * layout.local_rows
    rows = np.shape(job.canvas.tokens)[0]
    cut = slice(first, first + rows)
    out = SampleOutput(tokens[cut], nfe[cut], forwards, *trace)
    if accepted is not None:
      out = out._replace(accepted=accepted[cut], sources=sources[cut])
    if trace:
      out = out._replace(canvases=out.canvases[:, cut], commits=out.commits[:, cut], remasks=out.remasks[:, cut])
    return out

  # --------------------------------------------------------------------------------------------- text

  def generate(
    self,
    prompts: str | Sequence[str] | None = None,
    *,
    template: str | None = None,
    length: int = 64,
    steps: int | None = None,
    steps_per_block: int | None = None,
    seed: int = 0,
    num_samples: int = 1,
    streams: Sequence[int] | None = None,
    show_steps: bool = False,
    bos: bool = False,
    per_process: bool = False,
    cache: str = "auto",
    constraint: Automaton | Sequence[Automaton | None] | None = None,
    token_healing: bool = True,
    **knobs,
  ) -> list[Sample]:
    """Generates text for each prompt (``num_samples`` each), in one batch.

    An autoregressive checkpoint decodes left to right with a key-value cache (one token per forward pass); a canvas
    that would start with a position to generate (an empty prompt before a template that starts with a hole) gets
    the BOS token in front, since the decoder conditions every token on the ones before it.

    Args:
      prompts: One prompt or several (of any lengths). With ``template``, each prompt precedes the template.
      template: A string with ``<mask:N>`` holes; its text is kept and its holes filled.
      length: Tokens to generate after each prompt (prompt mode only); token healing generates one position more,
        the prompt's backed-off last token.
      steps: The refinement budget of a diffusion model for the generated length (>= the blocks it spans; default:
        one token per step). Not for an autoregressive model.
      steps_per_block: The engine's steps per block instead of ``steps`` (>= 1).
      seed: The PRNG seed.
      num_samples: Samples per prompt.
      streams: Each row's random stream (default: its row index; with ``per_process``, its row index in the batch
        of all processes); give a row the stream it had in another call to reproduce it there.
      show_steps: Record the canvas text after every step (autoregressive: every token) in ``Sample.steps``.
      bos: Start every prompt with the BOS token, as SFT records do (``[BOS] + prompt``); LM pretraining data has
        none.
      per_process: ``prompts`` are this process's own (possibly none) and only their samples come back. Every
        process must call ``generate`` with the same other arguments (it is collective). The tokens equal those of
        one process given every process's prompts, in process order. Without it, every process passes the same
        prompts and gets every sample.
      cache: The decoder's key-value cache (:data:`~mercury_jax.sampling.plan.CACHE_CHOICES`): ``auto`` (the
        model's best exact decoder), ``exact``, ``none``, or for whole-sequence checkpoints the approximate ``dual``
        and ``prefix``.
      constraint: Structured output: an :class:`~mercury_jax.constrain.automaton.Automaton` (:meth:`constraint`)
        for every prompt, or one per prompt (None: free). A constrained sample's hole (it must have exactly one) is
        a valid prefix of the automaton's language, and complete (``Sample.complete``) when ``length`` leaves room
        for it; fixed text of the automaton (a schema's keys and punctuation) is committed without the model.
      token_healing: Re-generate the prompt's last token, restricted to the tokens whose text starts with its
        characters (:mod:`~mercury_jax.sampling.healing`), so a prompt that ends inside a token (``:``, ``(``, an
        indent, half an identifier) continues as the training data would. Block-diffusion and autoregressive
        checkpoints, prompt mode, no ``constraint``, no ``per_process``, no ``bos``; ignored otherwise.
      **knobs: ``SamplerSettings`` fields: temperature, top_k, top_p, min_length, eos_to_pad, and for diffusion
        models rule, confidence, threshold, block_length, revision.

    Raises:
      SettingError: A bad setting or step budget, or a diffusion-only one (``DIFFUSION_ONLY`` of
        :mod:`~mercury_jax.sampling.settings`) for an autoregressive model; ``.field`` names the argument.
      ValueError: An empty prompt without a template, a template without holes, or a canvas beyond the model's
        context; a constraint for another tokenizer or a canvas with more than one hole.
    """
    request = Request(
      prompts, template, length, steps, steps_per_block, seed, num_samples, streams, show_steps, bos, per_process,
      cache, token_healing, knobs,
    )  # fmt: skip
    job = self.jobs.prepare(request, constraint)
    if job is None:
      return []
    engine, state, clock = self._start(job)
    state = clock.run(lambda: jax.block_until_ready(self._advance(engine, state, _UNBOUNDED, _UNBOUNDED)))
    return self._samples(job, self._output(job, state, engine), clock.wall, clock.compile, show_steps)

  def _samples(self, job: Job, out: SampleOutput, wall: float, compile_time: float, show_steps: bool) -> list[Sample]:
    rows, settings = job.rows, job.settings
    kinds = np.asarray(job.canvas.kinds)
    generated = int(((kinds == K.TARGET) & (out.tokens != settings.pad_id)).sum())
    samples = []
    for row, prompt in enumerate(rows.prompts):
      end = int((kinds[row] != K.PAD).sum())
      region = out.tokens[row, rows.prompt_lengths[row] : end]
      tokens = [int(t) for t in region if t != settings.pad_id]
      trace = None
      if show_steps:
        trace = frames(self.tokenizer, out, kinds, row, settings, job.plan.autoregressive and not job.plan.draft)
      samples.append(
        Sample(
          prompt=prompt,
          text=healing.strip(self.tokenizer.decode(region), rows.healed[row]),
          tokens=tokens,
          nfe=int(out.nfe[row]),
          wall_time=wall,
          tokens_per_s=generated / wall if wall > 0 else float("inf"),
          compile_time=compile_time,
          steps=trace,
          tokens_per_forward=len(tokens) / max(int(out.nfe[row]), 1),
          complete=None if job.automata is None else self.jobs.accepted(job.automata[row], out.tokens, kinds, row),
          healed=rows.healed[row],
          accepted=None if out.accepted is None else [int(n) for n in out.accepted[row]],
        )
      )
    return samples

  def constraint(self, *, regex: str | None = None, json_schema: dict | str | None = None) -> Automaton:
    """Compiles a regular expression or a JSON Schema (a dict, or JSON text) for this model's tokenizer, once
    (cached): the ``constraint`` of :meth:`generate`.

    Raises:
      ConstraintError: An invalid or unsupported constraint (one line naming what is wrong).
    """
    if (regex is None) == (json_schema is None):
      raise ValueError("give exactly one of regex= and json_schema=")
    if self._compiler is None:
      from mercury_jax.constrain.automaton import Compiler

      self._compiler = Compiler(self.tokenizer)
    return self._compiler.regex(regex) if regex is not None else self._compiler.json_schema(json_schema)

  def stream(self, prompts: str | Sequence[str] | None = None, *, drafts: bool = False, **kwargs):
    """Generates like :meth:`generate` and yields text as blocks are committed: the same arguments (but
    ``show_steps`` and ``per_process``), the same tokens.

    The engine's ``advance`` runs a block at a time (with ``drafts``, a step at a time): rows with nothing left never
    end a chunk, so a batch of mixed lengths syncs with the host once per block.

    Args:
      prompts: See :meth:`generate`.
      drafts: Also yield, after every step, each unfinished sample's draft: its committed tokens with the step's
        proposals at the positions still undecided in the current block (later blocks as ``MASK_TEXT``).
      **kwargs: :meth:`generate`'s other arguments.

    Yields:
      :class:`StreamEvent` per sample and chunk that has news: the newly committed text, the draft, and a last event
      with ``done=True``. Concatenating a sample's ``text`` gives its ``generate`` text.
    """
    for name in ("show_steps", "per_process"):
      if name in kwargs:
        raise TypeError(f"stream() takes no {name} argument (generate() does)")
    constraint = kwargs.pop("constraint", None)
    fields = {f.name for f in dataclasses.fields(Request)} - {"prompts", "knobs"}
    request = Request(prompts, **{k: v for k, v in kwargs.items() if k in fields},
                      knobs={k: v for k, v in kwargs.items() if k not in fields})  # fmt: skip
    job = self.jobs.prepare(request, constraint)
    engine, state, _ = self._start(job)
    rows, kinds = job.rows, np.asarray(job.canvas.kinds)
    news = [_RowNews(self.tokenizer, rows.prompt_lengths[row], int((kinds[row] != K.PAD).sum()), rows.healed[row])
            for row in range(len(rows.prompts))]  # fmt: skip
    while not all(n.done for n in news):
      state = self._advance(engine, state, _UNBOUNDED if drafts else 1, 1 if drafts else _UNBOUNDED)
      view = _StreamView(job.plan, *(self.placement.gather(x) for x in _stream_fields(state)))
      for row, row_news in enumerate(news):
        if not row_news.done:
          event = row_news.event(row, view, job.settings.mask_id, drafts)
          if event is not None:
            yield event


class _Clock:
  """The wall and compile seconds of a decode's program calls (compile seconds: this thread's tracing, lowering and
  compiling, as ``jax.monitoring`` reports them)."""

  def __init__(self):
    self.wall = self.compile = 0.0

  def run(self, fn):
    start, compiled = time.perf_counter(), compilations.seconds()
    out = fn()
    spent = compilations.seconds() - compiled
    self.compile += spent
    self.wall += time.perf_counter() - start - spent
    return out


def _stream_fields(st) -> tuple:
  """What a stream reads of the state after a chunk (one gather each)."""
  count = st.draft.count if st.draft is not None else st.nfe
  return st.z, st.generate, st.first, st.last, st.block, st.fresh, st.proposal, st.nfe, count


class _StreamView(NamedTuple):
  """The state as a stream reads it (numpy, every row)."""

  plan: BlockPlan
  z: np.ndarray
  generate: np.ndarray
  first: np.ndarray
  last: np.ndarray
  block: np.ndarray
  fresh: np.ndarray
  proposal: np.ndarray
  nfe: np.ndarray
  draft_count: np.ndarray  # verified decoding's drafts after the row's next position


class _RowNews:
  """One sample of a stream: its final text as blocks are committed (the shared incremental
  :class:`~mercury_jax.sampling.text.Detokenizer`), and its draft."""

  def __init__(self, tokenizer, prompt_length: int, end: int, healed: str):
    self.tokenizer, self.start, self.end, self.healed = tokenizer, prompt_length, end, healed
    self.detokenizer, self.upto, self.skip, self.done = Detokenizer(tokenizer), prompt_length, len(healed), False

  def event(self, row: int, view: _StreamView, mask_id: int, drafts: bool) -> StreamEvent | None:
    plan = view.plan
    block = plan.block
    tokens = view.z[row, block : block + self.end]  # canvas positions
    pending = bool((view.generate[row] & (view.z[row] == mask_id)).any())
    row_block = min(int(view.first[row]) + int(view.block[row]), int(view.last[row]))  # the row's next block
    final = self.end if not pending else max(row_block * block - block, self.start)  # positions before it are final
    text = self.detokenizer.add(tokens[self.upto : min(final, self.end)].tolist(), final=not pending)
    self.upto = max(self.upto, min(final, self.end))
    if self.skip:  # token healing: the prompt's backed-off characters come first, and are not the completion's
      cut = min(self.skip, len(text))
      text, self.skip = text[cut:], self.skip - cut
    draft = self._draft(row, view, tokens, row_block, mask_id) if drafts and pending else None
    self.done = not pending
    if text or draft is not None or self.done:
      return StreamEvent(index=row, text=text, draft=draft, done=self.done, nfe=int(view.nfe[row]))
    return None

  def _draft(self, row: int, view: _StreamView, tokens: np.ndarray, row_block: int, mask_id: int) -> str:
    """The committed tokens with the step's proposals at the positions still undecided (later ones masked)."""
    plan, block = view.plan, view.plan.block
    slots = np.arange(len(tokens)) + block
    guess = tokens.copy()
    if plan.draft:  # The drafts the next step verifies, at the row's next positions.
      ahead = slots - row_block
      undecided = (tokens == mask_id) & (ahead >= 0) & (ahead < int(view.draft_count[row]))
      guess[undecided] = view.proposal[row, ahead[undecided]]
    else:
      open_block = row_block - 1 if bool(view.fresh[row]) else row_block  # the block the last step worked on
      undecided = (tokens == mask_id) & ((slots // block) == open_block)
      guess[undecided] = view.proposal[row, (slots[undecided] % block)]
    return self.tokenizer.decode(guess[self.start :], mask_text=MASK_TEXT)
