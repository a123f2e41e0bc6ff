"""Text in, text out: ``Sampler.from_checkpoint(dir, mesh=...)`` once, then ``.generate(prompts, steps=...)``.

The tokenizer, the params-only restore, the mesh and the compiled loops are set up once and reused; each
(settings, batch, length) combination compiles once, whatever the step count, and on the block engine whatever the
temperature, top-k, top-p and threshold too (they are traced: :func:`without_knobs`). Batches are padded to the mesh's
data-parallel size and canvases to a multiple of ``LENGTH_BUCKET`` tokens (padding never changes an example's
output), so varying prompt lengths share compilations.

Which decoder runs (``generate(..., cache=...)``, one of :data:`CACHES`):

- block-diffusion checkpoints (``objective.block_size > 0``) and the autoregressive twin run the block engine
  (:mod:`~mercury_jax.sampling.blocks`) with its exact key-value cache (``auto``/``exact``), or without a cache
  (``none``, the reference the cache reproduces); the twin is the engine with blocks of one token;
- whole-sequence diffusion checkpoints run the whole-canvas refinement loop
  (:func:`~mercury_jax.sampling.loop.jit_sample`; ``auto``/``none``), or the block engine with Fast-dLLM's
  approximate ``dual`` or ``prefix`` cache over blocks of ``block_length`` tokens (default
  ``APPROXIMATE_BLOCK``).

On the block engine ``steps`` stays the step budget for the generated length: each block gets
``ceil(steps * block / generated)`` steps (at least 1), so the same ``steps`` means about the same tokens per step
with and without a cache. :meth:`Sampler.stream` yields each block as it is committed (and, optionally, the draft
after every step).

Several processes (a multi-host mesh) either all pass the same prompts and all get every sample, or, with
``generate(..., per_process=True)``, each passes its own prompts and gets only its own samples: the processes agree
on one batch shape, each places its rows on its own devices and reads back only those rows, and row ``i`` of process
``p`` draws from stream ``(rows of processes 0 .. p-1) + i``, so the tokens equal those of one process given all the
prompts in process order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mercury_jax import kinds as K, sharding as sh
from mercury_jax.checkpoint import find_tokenizer, restore_params
from mercury_jax.config import Config, MeshConfig
from mercury_jax.constrain import device as constrained
from mercury_jax.constrain.automaton import Automaton, Compiler
from mercury_jax.data.tokenizer import Tokenizer
from mercury_jax.model import Transformer
from mercury_jax.sampling import canvas as cv, healing
from mercury_jax.sampling.blocks import BlockEngine, BlockPlan, plan_blocks
from mercury_jax.sampling.canvas import SampleOutput
from mercury_jax.sampling.loop import jit_sample, model_denoise_fn
from mercury_jax.sampling.mesh import jit_on_mesh
from mercury_jax.sampling.proposal import Knobs
from mercury_jax.sampling.settings import SamplerSettings, SettingError, check_knobs_for_model
from mercury_jax.trainer import param_shardings

# The models shipped in the package: params-only checkpoints (``export_params``) with their ``tokenizer.model``.
ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_CHECKPOINT = ASSETS / "default"
BUNDLED_MODELS = {"default": "the block-diffusion code model", "default_ar": "its autoregressive twin"}
LENGTH_BUCKET = 64
MASK_TEXT = "░"  # How an undecided position looks in a step-by-step trace.
DEFAULT_STEPS = 32
CACHES = ("auto", "exact", "none", "dual", "prefix")
APPROXIMATE_BLOCK = 32  # Block of the approximate caches of whole-sequence checkpoints when block_length is 0.


def bucketed_length(length: int, context: int) -> int:
  """The canvas length a sampler runs ``length`` positions at: rounded up to ``LENGTH_BUCKET``, at most ``context``
  (unless ``length`` itself is longer), so varying prompt lengths share compilations."""
  return min(-(-length // LENGTH_BUCKET) * LENGTH_BUCKET, max(context, length))


def default_checkpoint(name: str = "default") -> Path | None:
  """The bundled model ``name`` (a key of :data:`BUNDLED_MODELS`), or None when the package lacks it.

  Raises:
    ValueError: ``name`` is not a bundled model.
  """
  if name not in BUNDLED_MODELS:
    raise ValueError(f"no bundled model is called {name!r}; the bundled models are {', '.join(BUNDLED_MODELS)}")
  path = DEFAULT_CHECKPOINT if name == "default" else ASSETS / name
  has_steps = path.is_dir() and any(p.name.isdigit() for p in path.iterdir())
  return path if has_steps and (path / "tokenizer.model").is_file() else None


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


class BatchLayout(NamedTuple):
  """How the processes of a ``per_process`` call share one batch (the same on every process)."""

  rows: np.ndarray  # int [processes]: each process's real rows
  length: int  # the longest canvas of any process
  local_rows: int  # rows each process contributes (its own, then padding)
  own_devices: bool  # each process's devices hold rows no other process holds
  generated: int = 0  # the most positions any row of any process generates (the block engine's step share)


@dataclasses.dataclass
class Sample:
  """One generated sample.

  Attributes:
    prompt: The prompt text ("" for a template alone).
    text: The completion after the prompt: generated text, with a template's fixed text in place.
    tokens: Token ids of that completion (padding dropped).
    nfe: Forward passes this sample needed (autoregressive: those of its batch, prefill included).
    wall_time: Seconds the batch it belongs to took (compilation excluded).
    tokens_per_s: Generated tokens of the whole batch (with ``per_process``: of this process's rows) per second of
      ``wall_time``.
    tokens_per_forward: Generated tokens of this sample per forward pass it needed (TPF, ``len(tokens) / nfe``).
    compile_time: Seconds spent compiling for this batch (0 when a compilation was reused).
    steps: With ``show_steps``, the canvas text after each refinement step (autoregressive: after each generated
      token), undecided positions as ``MASK_TEXT``.
    complete: With a ``constraint``: whether the text is a whole sentence of it (False: ``length`` ran out first and
      the text is a valid prefix); None without one.
    healed: The prompt's last characters that token healing re-generated (:mod:`~mercury_jax.sampling.healing`;
      "" when none): ``tokens`` starts with their token(s), ``text`` does not repeat them.
  """

  prompt: str
  text: str
  tokens: list[int]
  nfe: int
  wall_time: float
  tokens_per_s: float
  compile_time: float = 0.0
  steps: list[str] | None = None
  tokens_per_forward: float = 0.0
  complete: bool | None = None
  healed: str = ""


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
    # pass on XLA:CPU, but here it mostly adds compile time (the bundled models: about 30 % less compilation as a
    # loop; the diffusion model samples as fast, the twin up to 10 % slower; BUILD_NOTES.md). The parameters are the
    # same stacked arrays either way.
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, unroll_layers=False))
    self.cfg, self.tokenizer = cfg, tokenizer
    self.autoregressive = is_autoregressive(cfg)
    self.block_size = cfg.objective.block_size  # 0: a whole-sequence diffusion model (or the twin)
    self.mesh = mesh if mesh is not None else sh.make_mesh(MeshConfig(data=1), jax.devices()[:1])
    self.rules = sh.axis_rules(cfg.mesh)
    self.param_shardings = param_shardings(Transformer(cfg.model), self.mesh, self.rules)
    self.params = jax.device_put(params, self.param_shardings)
    self.denoise_fn = model_denoise_fn(cfg.model)
    self._compiled: dict[tuple, Any] = {}
    self._compiler: Compiler | None = None  # structured output's constraint compiler, made on first use
    self._healer: Compiler | None = None  # token healing's (its own cache: prompts' ends are many)

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
    tokenizer = Tokenizer.load(find_tokenizer(path))
    params, cfg = restore_params(path, mesh=mesh, step=step)
    return cls(params, cfg, tokenizer, mesh=mesh)

  @property
  def max_length(self) -> int:
    return self.cfg.model.max_length

  def settings(self, **knobs) -> SamplerSettings:
    """Sampler settings with this model's schedule, mask, EOS and padding ids; ``knobs`` as in SamplerSettings."""
    tok = self.tokenizer
    return SamplerSettings(
      objective=self.cfg.objective,
      eos_id=tok.eos_id,
      pad_id=tok.pad_id,
      bos_id=tok.bos_id,
      unk_id=tok.unk_id,
      num_tokens=tok.vocab_size,
      **knobs,
    ).validate()

  # ------------------------------------------------------------------------------------------- arrays

  def _place(self, array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

  def _gather(self, array: jax.Array) -> np.ndarray:
    if jax.process_count() > 1:
      return np.asarray(multihost_utils.process_allgather(array, tiled=True))
    return np.asarray(array)

  def _local_slices(self) -> int:
    """How many distinct slices of a batch split over the data axes this process's devices hold."""
    shards = sh.data_parallel_size(self.mesh, self.rules)
    indices = sh.batch_sharding(self.mesh, self.rules, 1).addressable_devices_indices_map((shards,))
    return len({index[0].start for index in indices.values()})

  def agree_on_batch(
    self,
    rows: int,
    length: int,
    *,
    digest: int = 0,
    failed: bool = False,
    generated: int = 0,
  ) -> BatchLayout:
    """Agrees with every other process on the batch of a ``per_process`` call (collective: all processes call it).

    Args:
      rows: This process's canvas rows (may be 0).
      length: This process's canvas length.
      digest: A number that must be equal on every process (e.g. of the settings and seed).
      failed: This process could not build its rows; every process then raises.
      generated: The most positions a row of this process generates.

    Raises:
      ValueError: Some process failed, or the processes' ``digest`` differ.
    """
    mine = np.asarray([rows, length, int(failed), self._local_slices(), digest & 0x7FFFFFFF, generated], np.int32)
    table = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), mine.size)
    failures = [int(p) for p in np.flatnonzero(table[:, 2])]
    if failures:
      raise ValueError(f"process(es) {failures} could not build their prompts (see their error); nothing was sampled")
    if len(set(table[:, 4].tolist())) > 1:
      raise ValueError(
        "the processes were given different sampler settings, steps or seeds; per-process sampling needs the same "
        "ones everywhere (only the prompts differ)"
      )
    processes, shards, slices = jax.process_count(), sh.data_parallel_size(self.mesh, self.rules), table[:, 3]
    own = shards % processes == 0 and bool((slices == shards // processes).all())
    most = max(int(table[:, 0].max()), 1)
    local_rows = -(-most // (shards // processes)) * (shards // processes) if own else most
    return BatchLayout(table[:, 0], int(table[:, 1].max()), local_rows, own, int(table[:, 5].max()))

  # ------------------------------------------------------------------------------------------- decoders

  def decoder(self, cache: str = "auto", block_length: int = 0) -> tuple[str, int]:
    """``(cache, block)`` of the decoder this model runs: ``("loop", 0)`` for the whole-canvas refinement loop, else
    the block engine's cache (``exact``, ``none``, ``dual``, ``prefix``) and block size.

    Raises:
      SettingError: A cache this model does not have, or a block length that contradicts its training.
    """
    if cache not in CACHES:
      raise SettingError("cache", cache, f"is unknown; choose one of {', '.join(CACHES)}")
    if self.autoregressive or self.block_size:
      if cache in ("dual", "prefix"):
        raise SettingError(
          "cache", cache, "is the approximate cache of whole-sequence checkpoints; this model has an exact cache"
        )
      block = 1 if self.autoregressive else self.block_size
      if block_length and not self.autoregressive and block_length != block:
        raise SettingError(
          "block_length", block_length, f"must be {block} (or 0): the block size this model was trained with"
        )
      return ("none" if cache == "none" else "exact"), block
    if cache == "exact":
      raise SettingError(
        "cache",
        cache,
        "needs a block-diffusion checkpoint (objective.block_size > 0); this whole-sequence model has the "
        "approximate caches 'dual' and 'prefix'",
      )
    if cache in ("auto", "none"):
      return "loop", 0
    return cache, block_length or APPROXIMATE_BLOCK

  def block_steps(self, steps: int | None, block: int, generated: int) -> int:
    """Steps per block for a budget of ``steps`` over ``generated`` positions (the longest row's; module docstring);
    default one token per step (the twin: always 1)."""
    if self.autoregressive:
      return 1
    generated = max(generated, 1)
    if steps is None:
      return block
    return max(1, -(-steps * block // generated))

  def run(
    self,
    canvas: cv.Canvas,
    steps: int | None,
    seed: int,
    settings: SamplerSettings,
    *,
    layout: BatchLayout | None = None,
    cache: str = "auto",
    automata: Sequence[Automaton | None] | None = None,
  ) -> tuple[SampleOutput, float, float]:
    """Runs the compiled decoder (:meth:`decoder`) on a canvas batch.

    Args:
      canvas: The rows to fill (numpy). With ``layout``, this process's rows only.
      steps: Step budget of a diffusion model (>= 1; None: the block engine's default); unused by the twin.
      seed: The PRNG seed (the same on every process).
      settings: Sampler settings.
      layout: For per-process rows, the batch every process agreed on (:meth:`agree_on_batch`).
      cache: See :data:`CACHES`.
      automata: Each row's constraint (structured output; None: free), on the block engine (a whole-sequence
        checkpoint without a cache runs it uncached, in blocks of ``settings.block_length`` or
        ``APPROXIMATE_BLOCK``); not with ``layout``.

    Returns:
      ``(output as numpy arrays, wall seconds, compile seconds)``; the batch is padded to the mesh's data size and
      the canvas to ``LENGTH_BUCKET`` (the whole-canvas loop) or to the block (the block engine), and the output is
      cut back to the rows given (its canvases keep the padded length: the first ``canvas.tokens.shape[1]``
      positions are the given ones).
    """
    kind, block = self.decoder(cache, settings.block_length)
    constrained_rows = automata is not None and any(a is not None for a in automata)
    if constrained_rows and kind == "loop":
      kind, block = "none", settings.block_length or APPROXIMATE_BLOCK
    if constrained_rows and layout is not None:
      raise SettingError("constraint", "per_process", "is not supported with per-process prompts; pass every prompt")
    if not self.autoregressive and steps is not None and steps < 1:
      raise SettingError("steps", steps, "must be >= 1")
    if kind == "loop" and steps is None:
      raise SettingError("steps", steps, "must be >= 1")
    batch, length = np.shape(canvas.tokens)
    length = length if layout is None else layout.length
    plan = None
    if kind == "loop":
      canvas = self._pad_length(canvas, bucketed_length(length, self.max_length), settings.pad_id)
    else:
      generated = None if layout is None else layout.generated
      canvas, plan, steps = self.engine_layout(canvas, length, kind, block, steps, settings, generated)
    first = 0  # This process's first row in the gathered output.
    if layout is not None and layout.own_devices:  # Each process places its rows on its devices.
      rows, vectors = sh.batch_sharding(self.mesh, self.rules, 2), sh.batch_sharding(self.mesh, self.rules, 1)
      canvas = _pad_rows(canvas, layout.local_rows, settings.pad_id)
      total = jax.process_count() * layout.local_rows
      canvas = cv.Canvas(
        *(
          jax.make_array_from_process_local_data(s, a, (total, *a.shape[1:]))
          for s, a in zip((rows, rows, vectors), canvas, strict=True)
        )
      )
    else:
      if layout is not None:  # Processes share batch rows: every process builds the whole batch, in process order.
        canvas = _pad_rows(canvas, layout.local_rows, settings.pad_id)
        canvas = cv.Canvas(*(np.asarray(multihost_utils.process_allgather(a, tiled=True)) for a in canvas))
        first = jax.process_index() * layout.local_rows
      canvas = self._place_batch(canvas, settings.pad_id)
    args = (self.params, canvas, self._place_key(seed), self._place_scalar(1 if steps is None else steps))
    cache_key = (settings, plan, np.shape(canvas.tokens))
    if plan is not None:  # The block engine takes the sampling knobs as traced scalars: they never recompile.
      args, cache_key = (*args, self._place_knobs(settings)), (without_knobs(settings), *cache_key[1:])
    tables = None
    if constrained_rows:
      tables, capacity = self._place_tables(automata, np.shape(canvas.tokens)[0])
      args, cache_key = (*args, tables), (*cache_key, capacity)
    compile_time = 0.0
    if cache_key not in self._compiled:
      start = time.perf_counter()
      shardings = dict(mesh=self.mesh, rules=self.rules, param_shardings=self.param_shardings)
      if plan is None:
        fn = jit_sample(self.denoise_fn, settings, **shardings)
      else:
        engine = BlockEngine(self.cfg.model, without_knobs(settings), plan)
        fn = jit_on_mesh(
          engine.sample, scalars=2, trace=settings.trace, batched=tables, name="the block engine", **shardings
        )
      self._compiled[cache_key] = fn.lower(*args).compile()
      compile_time = time.perf_counter() - start
    start = time.perf_counter()
    out = jax.block_until_ready(self._compiled[cache_key](*args))
    wall = time.perf_counter() - start
    if layout is not None and layout.own_devices:
      out = SampleOutput(
        *(None if x is None else _own_rows(x, axis) for x, axis in zip(out, (0, 0, None, 1, 1, 1), strict=True))
      )
    else:
      out = jax.tree.map(self._gather, out)
    cut = slice(first, first + batch)
    if settings.trace:
      out = out._replace(canvases=out.canvases[:, cut], commits=out.commits[:, cut], remasks=out.remasks[:, cut])
    return out._replace(tokens=out.tokens[cut], nfe=out.nfe[cut]), wall, compile_time

  def _place_batch(self, canvas: cv.Canvas, pad_id: int) -> cv.Canvas:
    """The whole batch (the same on every process), padded to the data-parallel size and split over it."""
    canvas = cv.pad_batch(canvas, sh.data_parallel_size(self.mesh, self.rules), pad_id)
    rows, vectors = sh.batch_sharding(self.mesh, self.rules, 2), sh.batch_sharding(self.mesh, self.rules, 1)
    return cv.Canvas(
      self._place(canvas.tokens, rows), self._place(canvas.kinds, rows), self._place(canvas.streams, vectors)
    )

  # Host values placed by callback, so every process of a multi-host mesh builds the same global arrays.
  def _place_scalar(self, value: int) -> jax.Array:
    return self._place(np.asarray(value, np.int32), NamedSharding(self.mesh, P()))

  def _place_knobs(self, settings: SamplerSettings) -> Knobs:
    """``settings``' sampling knobs as replicated scalars (the block engine broadcasts them to every row)."""
    replicated = NamedSharding(self.mesh, P())
    values = (settings.temperature, settings.top_k, settings.top_p, settings.threshold)
    dtypes = (np.float32, np.int32, np.float32, np.float32)
    return Knobs(*(self._place(np.asarray(v, t), replicated) for v, t in zip(values, dtypes, strict=True)))

  def _place_tables(self, automata, rows: int) -> tuple[constrained.Tables, constrained.Capacity]:
    """The rows' automata (padding rows unconstrained) padded to the batch's capacity, split over the batch axes:
    ``(tables, capacity)``; each capacity is one compilation."""
    capacity = constrained.capacity_of(automata)
    host = constrained.tables([*automata, *[None] * (rows - len(automata))], capacity, self.cfg.model.vocab_size)
    return jax.tree.map(lambda a: self._place(a, sh.batch_sharding(self.mesh, self.rules, a.ndim)), host), capacity

  def _place_key(self, seed: int) -> jax.Array:
    return self._place(np.asarray(jax.random.key_data(jax.random.key(seed))), NamedSharding(self.mesh, P()))

  def engine_layout(self, canvas, length, kind, block, steps, settings, generated=None):
    """``(canvas, plan, steps per block)`` for the block engine: the canvas padded to the block (not to
    ``LENGTH_BUCKET``); ``generated`` (default: this canvas's) sets each block's share of ``steps``."""
    generated = _generated(canvas.kinds) if generated is None else generated
    canvas = self._pad_length(canvas, -(-length // block) * block, settings.pad_id)
    return canvas, self.plan(canvas.kinds, kind, block), self.block_steps(steps, block, generated)

  def plan(self, kinds: np.ndarray, cache: str, block: int) -> BlockPlan:
    """The block engine's :class:`~mercury_jax.sampling.blocks.BlockPlan` for these canvases."""
    return plan_blocks(
      kinds,
      block,
      cache=cache,
      autoregressive=self.autoregressive,
      whole_sequence=not (self.autoregressive or self.block_size),
    )

  def _pad_length(self, canvas: cv.Canvas, length: int, pad_id: int) -> cv.Canvas:
    """Right-pads canvases to ``length`` positions."""
    extra = length - np.shape(canvas.tokens)[1]
    if extra <= 0:
      return canvas
    return cv.Canvas(
      np.pad(np.asarray(canvas.tokens), ((0, 0), (0, extra)), constant_values=pad_id),
      np.pad(np.asarray(canvas.kinds), ((0, 0), (0, extra)), constant_values=K.PAD),
      canvas.streams,
    )

  # --------------------------------------------------------------------------------------------- text

  def generate(
    self,
    prompts: str | Sequence[str] | None = None,
    *,
    template: str | None = None,
    length: int = 64,
    steps: int | None = None,
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
      steps: Step budget of a diffusion model for the generated length (>= 1; default 32 for the whole-canvas loop,
        one token per step on the block engine). Not for an autoregressive model.
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
      cache: The decoder's key-value cache (:data:`CACHES`, module docstring): ``auto`` (the model's best exact
        decoder), ``exact``, ``none``, or for whole-sequence checkpoints the approximate ``dual`` and ``prefix``.
      constraint: Structured output: an :class:`~mercury_jax.constrain.automaton.Automaton` (:meth:`constraint`)
        for every prompt, or one per prompt (None: free). A constrained sample's hole (it must have exactly one) is
        a valid prefix of the automaton's language, and complete (``Sample.complete``) when ``length`` leaves room
        for it; fixed text of the automaton (a schema's keys and punctuation) is committed without the model. A
        whole-sequence checkpoint runs it through the block engine without a cache.
      token_healing: Re-generate the prompt's last token under the constraint that its characters come first
        (:mod:`~mercury_jax.sampling.healing`), so a prompt that ends inside a token (``:``, ``(``, an indent, half
        an identifier) continues as the training data would. Block-diffusion and autoregressive checkpoints, prompt
        mode, no ``constraint``, no ``per_process`` (to reproduce per-process samples in one process, pass False),
        no ``bos`` (an SFT prompt is tokenised on its own, so its end is a real boundary); ignored
        otherwise.
      **knobs: ``SamplerSettings`` fields: temperature, top_k, top_p, min_length, eos_to_pad, and for diffusion
        models rule, confidence, threshold, block_length, revision.

    Raises:
      SettingError: A bad setting or step count, or a diffusion-only one (``DIFFUSION_ONLY`` of
        :mod:`~mercury_jax.sampling.settings`) for an autoregressive model; ``.field`` names the argument.
      ValueError: An empty prompt without a template, a template without holes, or a canvas beyond the model's
        context; a constraint for another tokenizer or a canvas with more than one hole.
    """
    heal = token_healing and constraint is None and not per_process and not bos
    prepared = self._prepare(
      prompts, template, length, steps, seed, num_samples, streams, show_steps, bos, per_process, cache, knobs, heal
    )
    if prepared is None:
      return []
    settings, canvas, prompts, prompt_lengths, layout, healed = prepared
    automata = self._row_constraints(constraint, canvas, num_samples) or self._healing(healed)
    if steps is None and self._kind(cache, knobs)[0] == "loop" and automata is None:
      steps = DEFAULT_STEPS
    out, wall, compile_time = self.run(canvas, steps, seed, settings, layout=layout, cache=cache, automata=automata)
    kinds = np.asarray(canvas.kinds)
    generated = int(((kinds == K.TARGET) & (out.tokens[:, : kinds.shape[1]] != settings.pad_id)).sum())
    samples = []
    for row, prompt in enumerate(prompts):
      end = int((kinds[row] != K.PAD).sum())
      region = out.tokens[row, prompt_lengths[row] : end]
      tokens = [int(t) for t in region if t != settings.pad_id]
      trace = None
      if show_steps:
        trace = self._frames(out, kinds, row, end, settings)
      samples.append(
        Sample(
          prompt=prompt,
          text=healing.strip(self.tokenizer.decode(region), healed[row]),
          tokens=tokens,
          nfe=int(out.nfe[row]),
          wall_time=wall,
          tokens_per_s=generated / wall if wall > 0 else float("inf"),
          compile_time=compile_time,
          steps=trace,
          tokens_per_forward=len(tokens) / max(int(out.nfe[row]), 1),
          complete=None if automata is None else self._accepted(automata[row], out.tokens, kinds, row),
          healed=healed[row],
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
      self._compiler = Compiler(self.tokenizer)
    return self._compiler.regex(regex) if regex is not None else self._compiler.json_schema(json_schema)

  def _healing(self, healed: list[str]) -> list[Automaton | None] | None:
    """Each row's token-healing constraint (None where nothing was backed off), or None when no row has one."""
    if not any(healed):
      return None
    if self._healer is None:
      self._healer = Compiler(self.tokenizer)
    return [self._healer.heal(text) if text else None for text in healed]

  def _row_constraints(self, constraint, canvas: cv.Canvas, num_samples: int) -> list[Automaton | None] | None:
    """Each row's automaton (a prompt's samples share its own), checked against the tokenizer and the canvas."""
    if constraint is None:
      return None
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

  def _accepted(self, automaton: Automaton | None, tokens: np.ndarray, kinds: np.ndarray, row: int) -> bool | None:
    """Whether a row's hole (its generated tokens, padding after EOS dropped) is a whole sentence of ``automaton``
    (None without one)."""
    if automaton is None or automaton.kind == "heal":
      return None
    hole = tokens[row, : kinds.shape[1]][kinds[row] == K.TARGET]
    return automaton.accepts([int(t) for t in hole if t != self.tokenizer.pad_id])

  def stream(
    self,
    prompts: str | Sequence[str] | None = None,
    *,
    template: str | None = None,
    length: int = 64,
    steps: int | None = None,
    seed: int = 0,
    num_samples: int = 1,
    streams: Sequence[int] | None = None,
    bos: bool = False,
    drafts: bool = False,
    cache: str = "auto",
    constraint: Automaton | Sequence[Automaton | None] | None = None,
    token_healing: bool = True,
    **knobs,
  ) -> Iterator[StreamEvent]:
    """Generates like :meth:`generate` (same arguments, same tokens) and yields text as blocks are committed.

    The block engine runs in chunks of one block (with ``drafts``, one step): each chunk is one call of a compiled
    program that takes and returns the loop state, so streaming compiles once per batch shape. A whole-sequence
    checkpoint without a cache streams through the engine's uncached blocks of ``block_length`` tokens (default
    ``APPROXIMATE_BLOCK``), the same decoding as ``generate(..., cache="none")`` with that block only when
    ``generate`` runs on the engine too.

    Args:
      drafts: Also yield, after every step, each unfinished sample's draft: its committed tokens with the step's
        proposals at the positions still undecided in the current block (later blocks as ``MASK_TEXT``).
      See :meth:`generate` for the others.

    Yields:
      :class:`StreamEvent` per sample and chunk that has news: the newly committed text, the draft, and a last event
      with ``done=True``. Concatenating a sample's ``text`` gives its ``generate`` text.
    """
    kind, block = self._kind(cache, knobs)
    if kind == "loop":
      kind, block = "none", knobs.get("block_length") or APPROXIMATE_BLOCK
    heal = token_healing and constraint is None and not bos
    prepared = self._prepare(
      prompts, template, length, steps, seed, num_samples, streams, False, bos, False, cache, knobs, heal
    )
    settings, canvas, prompts, prompt_lengths, _, healed = prepared
    automata = self._row_constraints(constraint, canvas, num_samples) or self._healing(healed)
    batch, length = np.shape(canvas.tokens)
    canvas, plan, per_block = self.engine_layout(canvas, length, kind, block, steps, settings)
    placed = self._place_batch(canvas, settings.pad_id)
    tables, capacity = None, None
    if automata is not None:
      tables, capacity = self._place_tables(automata, np.shape(placed.tokens)[0])
    cache_key = (without_knobs(settings), plan, np.shape(canvas.tokens), "stream", capacity)
    if cache_key not in self._compiled:
      engine = BlockEngine(self.cfg.model, without_knobs(settings), plan)
      shardings = (self.param_shardings, None, None, None, None, None)
      fn = lambda p, c, k, n, kn, t: engine.init(p, c, k, n, kn, tables=t)  # noqa: E731
      init = sh.MeshJit(fn, self.mesh, self.rules, in_shardings=shardings)
      advance = sh.MeshJit(engine.advance, self.mesh, self.rules, donate_argnums=(1,))
      self._compiled[cache_key] = (engine, init, advance)
    engine, init, advance = self._compiled[cache_key]
    one = self._place_scalar(1)
    knobs_placed = self._place_knobs(settings)
    state = init(self.params, placed, self._place_key(seed), self._place_scalar(per_block), knobs_placed, tables)
    kinds = np.asarray(canvas.kinds)
    ends = [int((kinds[row] != K.PAD).sum()) for row in range(batch)]
    sent, finished = [""] * batch, [False] * batch
    decode = lambda ids: self.tokenizer.decode(ids, mask_text=MASK_TEXT)  # noqa: E731
    while not all(finished):
      state = advance(self.params, state, None, one) if drafts else advance(self.params, state, one, None)
      z, first, last, current, fresh, proposal, nfe = (
        self._gather(x) for x in (state.z, state.first, state.last, state.block, state.fresh, state.proposal, state.nfe)
      )
      done_all = bool(np.asarray(jax.device_get(engine.done(state))))
      for row in range(batch):
        if finished[row]:
          continue
        row_block = min(int(first[row]) + int(current[row]), int(last[row]))  # the row's next (or open) block
        open_block = row_block - 1 if bool(fresh[row]) else row_block  # the block the last step worked on
        slots = np.arange(length) + block
        tokens = z[row, block : block + length]
        row_done = done_all or not (tokens[: ends[row]] == settings.mask_id).any()
        committed = row_block * block - block  # the canvas positions before the row's block are final
        final_end = ends[row] if row_done else max(committed, prompt_lengths[row])
        text = self.tokenizer.decode(tokens[prompt_lengths[row] : min(final_end, ends[row])])
        text = healing.strip(text, healed[row])
        if not row_done and text.endswith("\ufffd"):  # A character split between blocks waits for its bytes.
          text = text[:-1]
        delta = text[len(sent[row]) :] if text.startswith(sent[row]) else ""
        draft = None
        if drafts and not row_done:
          undecided = (tokens == settings.mask_id) & ((slots // block) == open_block)
          guess = tokens.copy()
          guess[undecided] = proposal[row, (slots[undecided] % block)]
          draft = decode(guess[prompt_lengths[row] : ends[row]])
        if delta or draft is not None or row_done:
          sent[row] += delta
          finished[row] = row_done
          yield StreamEvent(index=row, text=delta, draft=draft, done=row_done, nfe=int(nfe[row]))

  def _kind(self, cache: str, knobs: dict) -> tuple[str, int]:
    return self.decoder(cache, knobs.get("block_length") or 0)

  def _prepare(
    self,
    prompts,
    template,
    length,
    steps,
    seed,
    num_samples,
    streams,
    show_steps,
    bos,
    per_process,
    cache,
    knobs,
    heal=False,
  ):
    """Checks ``generate``'s arguments and builds ``(settings, canvas, prompts, prompt lengths, layout, healed)``,
    or None when no process has a prompt (``per_process``)."""
    spread = per_process and jax.process_count() > 1
    try:
      kind, block = self._kind(cache, knobs)
      settings, examples, prompts, prompt_lengths, healed = self._examples(
        prompts, template, length, steps, num_samples, show_steps, bos, per_process, knobs, kind, block, heal
      )
    except ValueError:
      if spread:  # Tell the other processes, which would otherwise wait for this one.
        with contextlib.suppress(ValueError):
          self.agree_on_batch(0, 0, failed=True)
      raise
    offset, layout = 0, None
    if spread:
      width = max((sum(p.length if isinstance(p, cv.Hole) else len(p) for p in e) for e in examples), default=0)
      digest = zlib.crc32(repr((settings, steps, seed, cache)).encode())
      generated = max((sum(p.length for p in e if isinstance(p, cv.Hole)) for e in examples), default=0)
      layout = self.agree_on_batch(len(examples), width, digest=digest, generated=generated)
      offset = int(layout.rows[: jax.process_index()].sum())
    if not (examples if layout is None else layout.rows.any()):
      return None
    if streams is None:
      streams = range(offset, offset + len(examples))
    canvas = cv.make_canvas(examples, streams=streams, pad_id=settings.pad_id)
    return settings, canvas, prompts, prompt_lengths, layout, healed

  def _examples(
    self,
    prompts,
    template,
    length,
    steps,
    num_samples,
    show_steps,
    bos,
    per_process,
    knobs,
    kind="loop",
    block=0,
    heal=False,
  ):
    """Checks ``generate``'s arguments and builds ``(settings, examples, prompt of each row, prompt lengths, healed
    characters of each row)``; ``heal``: token healing where the decoder and the canvas allow it."""
    check_knobs_for_model({"steps": steps, **knobs}, self.autoregressive)
    if not self.autoregressive and steps is not None and steps < 1:
      raise SettingError("steps", steps, "must be >= 1")
    if isinstance(prompts, str):
      prompts = [prompts]
    elif per_process and prompts is not None:
      prompts = list(prompts)  # This process may have none.
    else:
      prompts = list(prompts or ([""] if template is not None else []))
      if not prompts:
        raise ValueError("give a prompt or a template")
    if num_samples < 1:
      raise ValueError(f"num_samples={num_samples} must be >= 1")
    if template is None and length < 1:
      raise ValueError(f"length={length} must be >= 1")
    tail = cv.parse_template(template, self.tokenizer.encode) if template is not None else None
    heal = heal and tail is None and (self.autoregressive or self.block_size > 0)  # not whole-sequence models
    trace = 0
    if show_steps and not self.autoregressive:
      trace = steps or DEFAULT_STEPS
      if kind != "loop":  # The block engine: steps per block times the blocks a row spans.
        holes = sum(p.length for p in tail if isinstance(p, cv.Hole)) if tail is not None else length + heal
        span = sum(p.length if isinstance(p, cv.Hole) else len(p) for p in tail) if tail is not None else length + heal
        trace = self.block_steps(steps, block, holes) * (-(-span // block) + 1)
    settings = self.settings(trace=trace, **knobs)
    examples, prompt_lengths, healed = [], [], []
    for i, prompt in enumerate(prompts):
      if not prompt and template is None:
        raise ValueError(f"prompt {i} is empty; give text to continue, or a template with <mask:N> holes")
      ids = ([self.tokenizer.bos_id] if bos else []) + self.tokenizer.encode(prompt)
      if self.autoregressive and not ids and (tail is None or isinstance(tail[0], cv.Hole)):
        ids = [self.tokenizer.bos_id]  # The decoder needs a known first token.
      removed = ""
      if heal:
        kept, removed = healing.back_off(self.tokenizer, prompt, ids)
      pieces = [ids, *tail] if tail is not None else cv.prefix(ids, length)
      size = sum(p.length if isinstance(p, cv.Hole) else len(p) for p in pieces)
      if size > self.max_length:
        what = "the template" if tail is not None else f"length={length}"
        raise ValueError(
          f"prompt {i} ({len(ids)} tokens) plus {what} needs {size} positions but the model's context is "
          f"{self.max_length} tokens"
        )
      if removed:  # The same positions, one more of them generated.
        ids, pieces = kept, cv.prefix(kept, length + len(ids) - len(kept))
      examples += [pieces] * num_samples
      prompt_lengths += [len(ids)] * num_samples
      healed += [removed] * num_samples
    return settings, examples, [p for p in prompts for _ in range(num_samples)], prompt_lengths, healed

  def _frames(self, out: SampleOutput, kinds: np.ndarray, row: int, end: int, settings: SamplerSettings) -> list[str]:
    """The canvas text of one row after each step (diffusion) or each generated token (autoregressive)."""
    decode = lambda ids: self.tokenizer.decode(ids, mask_text=MASK_TEXT)
    if not self.autoregressive:
      frames = min(int(out.nfe[row]), settings.trace)
      if (out.commits < 0).any():  # The block engine marks frames past its last step with -1.
        frames = int((out.commits[:, row] >= 0).sum())
      return [decode(out.canvases[j, row, :end]) for j in range(frames)]
    # The decoder commits one position per forward pass, left to right, and skips the rest of a hole after its EOS:
    # frame k shows the first k decided positions.
    final = out.tokens[row, :end]
    generate = kinds[row, :end] == K.TARGET
    skipped = np.asarray(cv.after_eos(final[None], generate[None], settings.eos_id))[0]
    positions = np.flatnonzero(generate & ~skipped)
    frames = []
    for k in range(1, len(positions)):
      canvas = final.copy()
      canvas[positions[k:]] = settings.mask_id
      frames.append(decode(canvas))
    return [*frames, decode(final)]


@dataclasses.dataclass
class StreamEvent:
  """One update of :meth:`Sampler.stream`.

  Attributes:
    index: The sample (its index in ``generate``'s output).
    text: Text committed since this sample's previous event ("" when only the draft changed).
    draft: With ``drafts``: the sample's whole completion now, committed tokens plus the current proposals, later
      undecided positions as ``MASK_TEXT``; None otherwise and in the last event.
    done: This is the sample's last event.
    nfe: Forward passes the sample has needed so far (prefill included).
  """

  index: int
  text: str
  draft: str | None
  done: bool
  nfe: int


def without_knobs(settings: SamplerSettings) -> SamplerSettings:
  """``settings`` with the sampling knobs the block engine traces (temperature, top-k, top-p, threshold) at their
  defaults: the engine's compilation key, so a new value of one of them reuses the compiled program."""
  return dataclasses.replace(settings, temperature=1.0, top_k=0, top_p=1.0, threshold=0.9)


def _generated(kinds: np.ndarray) -> int:
  """The most positions a row of these canvases generates."""
  return int((np.asarray(kinds) == K.TARGET).sum(axis=1).max(initial=0))


def _pad_rows(canvas: cv.Canvas, rows: int, pad_id: int) -> cv.Canvas:
  """Appends all-padding rows (nothing to generate) up to ``rows``."""
  extra = rows - np.shape(canvas.tokens)[0]
  length = np.shape(canvas.tokens)[1]
  return cv.Canvas(
    np.concatenate([np.asarray(canvas.tokens, np.int32), np.full((extra, length), pad_id, np.int32)]),
    np.concatenate([np.asarray(canvas.kinds, np.int32), np.full((extra, length), K.PAD, np.int32)]),
    np.concatenate([np.asarray(canvas.streams, np.int32), np.zeros((extra,), np.int32)]),
  )


def _own_rows(x: jax.Array, axis: int | None) -> np.ndarray:
  """This process's rows of a batch-sharded output (in the order ``make_array_from_process_local_data`` used)."""
  if axis is None:  # Replicated.
    return np.asarray(x.addressable_shards[0].data)
  pieces = {}
  for shard in x.addressable_shards:
    pieces.setdefault(shard.index[axis].start or 0, shard.data)
  return np.concatenate([np.asarray(pieces[start]) for start in sorted(pieces)], axis=axis)
