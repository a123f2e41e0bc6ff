"""Text in, text out: ``Sampler.from_checkpoint(dir, mesh=...)`` once, then ``.generate(prompts, steps=...)``.

The tokenizer, the params-only restore, the mesh and the compiled loops are set up once and reused; each
(settings, batch, length) combination compiles once, whatever the step count. Batches are padded to the mesh's
data-parallel size and canvases to a multiple of ``LENGTH_BUCKET`` tokens (padding never changes an example's
output), so varying prompt lengths share compilations.

Diffusion checkpoints run the refinement loop (:func:`~mercury_jax.sampling.loop.jit_sample`); checkpoints of the
autoregressive twin (``objective.name = "autoregressive"``) run the key-value-cache decoder
(:func:`~mercury_jax.sampling.autoregressive.jit_decode`) on the same canvases, through the same ``generate``.

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
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mercury_jax import kinds as K, sharding as sh
from mercury_jax.checkpoint import find_tokenizer, restore_params
from mercury_jax.config import Config, MeshConfig
from mercury_jax.data.tokenizer import Tokenizer
from mercury_jax.model import Transformer
from mercury_jax.sampling import canvas as cv
from mercury_jax.sampling.autoregressive import jit_decode
from mercury_jax.sampling.canvas import SampleOutput
from mercury_jax.sampling.loop import jit_sample, model_denoise_fn
from mercury_jax.sampling.settings import SamplerSettings, SettingError, check_knobs_for_model
from mercury_jax.trainer import param_shardings

# A later release drops a params-only checkpoint (``export_params``) plus ``tokenizer.model`` here.
DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "assets" / "default"
LENGTH_BUCKET = 64
MASK_TEXT = "░"  # How an undecided position looks in a step-by-step trace.
DEFAULT_STEPS = 32


def bucketed_length(length: int, context: int) -> int:
  """The canvas length a sampler runs ``length`` positions at: rounded up to ``LENGTH_BUCKET``, at most ``context``
  (unless ``length`` itself is longer), so varying prompt lengths share compilations."""
  return min(-(-length // LENGTH_BUCKET) * LENGTH_BUCKET, max(context, length))


def default_checkpoint() -> Path | None:
  """The model shipped inside the package, or None while there is none."""
  has_steps = DEFAULT_CHECKPOINT.is_dir() and any(p.name.isdigit() for p in DEFAULT_CHECKPOINT.iterdir())
  return DEFAULT_CHECKPOINT if has_steps and (DEFAULT_CHECKPOINT / "tokenizer.model").is_file() else None


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
    compile_time: Seconds spent compiling for this batch (0 when a compilation was reused).
    steps: With ``show_steps``, the canvas text after each refinement step (autoregressive: after each generated
      token), undecided positions as ``MASK_TEXT``.
  """

  prompt: str
  text: str
  tokens: list[int]
  nfe: int
  wall_time: float
  tokens_per_s: float
  compile_time: float = 0.0
  steps: list[str] | None = None


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
    self.cfg, self.tokenizer = cfg, tokenizer
    self.autoregressive = is_autoregressive(cfg)
    self.mesh = mesh if mesh is not None else sh.make_mesh(MeshConfig(data=1), jax.devices()[:1])
    self.rules = sh.axis_rules(cfg.mesh)
    self.param_shardings = param_shardings(Transformer(cfg.model), self.mesh, self.rules)
    self.params = jax.device_put(params, self.param_shardings)
    self.denoise_fn = model_denoise_fn(cfg.model)
    self._compiled: dict[tuple, Any] = {}

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

  def agree_on_batch(self, rows: int, length: int, *, digest: int = 0, failed: bool = False) -> BatchLayout:
    """Agrees with every other process on the batch of a ``per_process`` call (collective: all processes call it).

    Args:
      rows: This process's canvas rows (may be 0).
      length: This process's canvas length.
      digest: A number that must be equal on every process (e.g. of the settings and seed).
      failed: This process could not build its rows; every process then raises.

    Raises:
      ValueError: Some process failed, or the processes' ``digest`` differ.
    """
    mine = np.asarray([rows, length, int(failed), self._local_slices(), digest & 0x7FFFFFFF], np.int32)
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
    return BatchLayout(table[:, 0], int(table[:, 1].max()), local_rows, own)

  def run(
    self,
    canvas: cv.Canvas,
    steps: int | None,
    seed: int,
    settings: SamplerSettings,
    *,
    layout: BatchLayout | None = None,
  ) -> tuple[SampleOutput, float, float]:
    """Runs the compiled sampler (diffusion loop or autoregressive decoder) on a canvas batch.

    Args:
      canvas: The rows to fill (numpy). With ``layout``, this process's rows only.
      steps: Step budget of the diffusion loop (>= 1); unused by an autoregressive model.
      seed: The PRNG seed (the same on every process).
      settings: Sampler settings.
      layout: For per-process rows, the batch every process agreed on (:meth:`agree_on_batch`).

    Returns:
      ``(output as numpy arrays, wall seconds, compile seconds)``; the batch is padded to the mesh's data size and
      the canvas to ``LENGTH_BUCKET``, and the output is cut back to the rows given (its canvases keep the padded
      length: the first ``canvas.tokens.shape[1]`` positions are the given ones).
    """
    if not self.autoregressive and (steps is None or steps < 1):
      raise SettingError("steps", steps, "must be >= 1")
    batch, length = np.shape(canvas.tokens)
    length = length if layout is None else layout.length
    canvas = self._pad_length(canvas, length, settings.pad_id)
    rows, vectors = sh.batch_sharding(self.mesh, self.rules, 2), sh.batch_sharding(self.mesh, self.rules, 1)
    first = 0  # This process's first row in the gathered output.
    if layout is not None and layout.own_devices:  # Each process places its rows on its devices.
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
      canvas = cv.pad_batch(canvas, sh.data_parallel_size(self.mesh, self.rules), settings.pad_id)
      canvas = cv.Canvas(
        self._place(canvas.tokens, rows), self._place(canvas.kinds, rows), self._place(canvas.streams, vectors)
      )
    replicated = NamedSharding(self.mesh, P())
    # Host values placed by callback, so every process of a multi-host mesh builds the same global arrays.
    args = (self.params, canvas, self._place(np.asarray(jax.random.key_data(jax.random.key(seed))), replicated))
    if not self.autoregressive:
      args += (self._place(np.asarray(steps, np.int32), replicated),)
    cache_key = (settings, np.shape(canvas.tokens))
    compile_time = 0.0
    if cache_key not in self._compiled:
      start = time.perf_counter()
      shardings = dict(mesh=self.mesh, rules=self.rules, param_shardings=self.param_shardings)
      if self.autoregressive:
        fn = jit_decode(self.cfg.model, settings, **shardings)
      else:
        fn = jit_sample(self.denoise_fn, settings, **shardings)
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

  def _pad_length(self, canvas: cv.Canvas, length: int, pad_id: int) -> cv.Canvas:
    """Right-pads canvases to :func:`bucketed_length` of ``length``."""
    extra = bucketed_length(length, self.max_length) - np.shape(canvas.tokens)[1]
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
    **knobs,
  ) -> list[Sample]:
    """Generates text for each prompt (``num_samples`` each), in one batch.

    An autoregressive checkpoint decodes left to right with a key-value cache (one token per forward pass); a canvas
    that would start with a position to generate (an empty prompt before a template that starts with a hole) gets
    the BOS token in front, since the decoder conditions every token on the ones before it.

    Args:
      prompts: One prompt or several (of any lengths). With ``template``, each prompt precedes the template.
      template: A string with ``<mask:N>`` holes; its text is kept and its holes filled.
      length: Tokens to generate after each prompt (prompt mode only).
      steps: Step budget of a diffusion model (>= 1; default 32). Not for an autoregressive model.
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
      **knobs: ``SamplerSettings`` fields: temperature, top_k, top_p, min_length, eos_to_pad, and for diffusion
        models rule, confidence, threshold, block_length, revision.

    Raises:
      SettingError: A bad setting or step count, or a diffusion-only one (``DIFFUSION_ONLY`` of
        :mod:`~mercury_jax.sampling.settings`) for an autoregressive model; ``.field`` names the argument.
      ValueError: An empty prompt without a template, a template without holes, or a canvas beyond the model's
        context.
    """
    spread = per_process and jax.process_count() > 1
    try:
      settings, examples, prompts, prompt_lengths = self._examples(
        prompts, template, length, steps, num_samples, show_steps, bos, per_process, knobs
      )
    except ValueError:
      if spread:  # Tell the other processes, which would otherwise wait for this one.
        with contextlib.suppress(ValueError):
          self.agree_on_batch(0, 0, failed=True)
      raise
    offset, layout = 0, None
    if spread:
      width = max((sum(p.length if isinstance(p, cv.Hole) else len(p) for p in e) for e in examples), default=0)
      digest = zlib.crc32(repr((settings, steps, seed)).encode())
      layout = self.agree_on_batch(len(examples), width, digest=digest)
      offset = int(layout.rows[: jax.process_index()].sum())
    if not (examples if layout is None else layout.rows.any()):
      return []
    if streams is None:
      streams = range(offset, offset + len(examples))
    canvas = cv.make_canvas(examples, streams=streams, pad_id=settings.pad_id)
    out, wall, compile_time = self.run(
      canvas, steps if steps is not None else DEFAULT_STEPS, seed, settings, layout=layout
    )
    kinds = np.asarray(canvas.kinds)
    generated = int(((kinds == K.TARGET) & (out.tokens[:, : kinds.shape[1]] != settings.pad_id)).sum())
    samples = []
    for row, prompt in enumerate(prompts):
      end = int((kinds[row] != K.PAD).sum())
      region = out.tokens[row, prompt_lengths[row] : end]
      trace = None
      if show_steps:
        trace = self._frames(out, kinds, row, end, settings)
      samples.append(
        Sample(
          prompt=prompt,
          text=self.tokenizer.decode(region),
          tokens=[int(t) for t in region if t != settings.pad_id],
          nfe=int(out.nfe[row]),
          wall_time=wall,
          tokens_per_s=generated / wall if wall > 0 else float("inf"),
          compile_time=compile_time,
          steps=trace,
        )
      )
    return samples

  def _examples(self, prompts, template, length, steps, num_samples, show_steps, bos, per_process, knobs):
    """Checks ``generate``'s arguments and builds ``(settings, examples, prompt of each row, prompt lengths)``."""
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
    trace = (steps or DEFAULT_STEPS) if show_steps and not self.autoregressive else 0
    settings = self.settings(trace=trace, **knobs)
    tail = cv.parse_template(template, self.tokenizer.encode) if template is not None else None
    examples, prompt_lengths = [], []
    for i, prompt in enumerate(prompts):
      if not prompt and template is None:
        raise ValueError(f"prompt {i} is empty; give text to continue, or a template with <mask:N> holes")
      ids = ([self.tokenizer.bos_id] if bos else []) + self.tokenizer.encode(prompt)
      if self.autoregressive and not ids and (tail is None or isinstance(tail[0], cv.Hole)):
        ids = [self.tokenizer.bos_id]  # The decoder needs a known first token.
      pieces = [ids, *tail] if tail is not None else cv.prefix(ids, length)
      size = sum(p.length if isinstance(p, cv.Hole) else len(p) for p in pieces)
      if size > self.max_length:
        what = "the template" if tail is not None else f"length={length}"
        raise ValueError(
          f"prompt {i} ({len(ids)} tokens) plus {what} needs {size} positions but the model's context is "
          f"{self.max_length} tokens"
        )
      examples += [pieces] * num_samples
      prompt_lengths += [len(ids)] * num_samples
    return settings, examples, [p for p in prompts for _ in range(num_samples)], prompt_lengths

  def _frames(self, out: SampleOutput, kinds: np.ndarray, row: int, end: int, settings: SamplerSettings) -> list[str]:
    """The canvas text of one row after each step (diffusion) or each generated token (autoregressive)."""
    decode = lambda ids: self.tokenizer.decode(ids, mask_text=MASK_TEXT)
    if not self.autoregressive:
      return [decode(out.canvases[j, row, :end]) for j in range(min(int(out.nfe[row]), settings.trace))]
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
