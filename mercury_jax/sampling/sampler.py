"""Text in, text out: ``Sampler.from_checkpoint(dir, mesh=...)`` once, then ``.generate(prompts, steps=...)``.

The tokenizer, the params-only restore, the mesh and the compiled loops are set up once and reused; each
(settings, batch, length) combination compiles once, whatever the step count. Batches are padded to the mesh's
data-parallel size and canvases to a multiple of ``LENGTH_BUCKET`` tokens (padding never changes an example's
output), so varying prompt lengths share compilations.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mercury_jax import sharding as sh
from mercury_jax.checkpoint import find_tokenizer, restore_params
from mercury_jax.config import Config, MeshConfig
from mercury_jax.data.tokenizer import Tokenizer
from mercury_jax.model import Transformer
from mercury_jax.sampling import canvas as cv
from mercury_jax.sampling.loop import SampleOutput, jit_sample, mesh_context, model_denoise_fn
from mercury_jax.sampling.settings import SamplerSettings
from mercury_jax.trainer import param_shardings

# A later release drops a params-only checkpoint (``export_params``) plus ``tokenizer.model`` here.
DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "assets" / "default"
LENGTH_BUCKET = 64
MASK_TEXT = "░"  # How an undecided position looks in a step-by-step trace.


def default_checkpoint() -> Path | None:
  """The model shipped inside the package, or None while there is none."""
  has_steps = DEFAULT_CHECKPOINT.is_dir() and any(p.name.isdigit() for p in DEFAULT_CHECKPOINT.iterdir())
  return DEFAULT_CHECKPOINT if has_steps and (DEFAULT_CHECKPOINT / "tokenizer.model").is_file() else None


def check_compatible(cfg: Config, tokenizer: Tokenizer) -> None:
  """Raises ``ValueError`` when the model cannot be sampled with this tokenizer or by diffusion."""
  if cfg.diffusion.objective != "diffusion" or cfg.model.causal:
    raise ValueError("this checkpoint is an autoregressive model; the sampler needs a diffusion (masked) model")
  if tokenizer.vocab_size > cfg.model.vocab_size:
    raise ValueError(
      f"the tokenizer has {tokenizer.vocab_size} pieces but the model's vocab_size is {cfg.model.vocab_size}: "
      "the checkpoint and its tokenizer.model do not belong together"
    )
  if tokenizer.mask_id != cfg.diffusion.mask_id:
    raise ValueError(f"the tokenizer's mask id {tokenizer.mask_id} differs from the model's {cfg.diffusion.mask_id}")


@dataclasses.dataclass
class Sample:
  """One generated sample.

  Attributes:
    prompt: The prompt text ("" for a template alone).
    text: The completion after the prompt: generated text, with a template's fixed text in place.
    tokens: Token ids of that completion (padding dropped).
    nfe: Forward passes this sample needed.
    wall_time: Seconds the batch it belongs to took (compilation excluded).
    tokens_per_s: Generated tokens of the whole batch per second of ``wall_time``.
    compile_time: Seconds spent compiling for this batch (0 when a compilation was reused).
    steps: The canvas text after each step (with ``show_steps``), undecided positions as ``MASK_TEXT``.
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
    cfg: The model's config (as stored in its checkpoint).
    tokenizer: The tokenizer the model was trained with.
    mesh: The device mesh; default: one device.
  """

  def __init__(self, params: Any, cfg: Config, tokenizer: Tokenizer, *, mesh: Mesh | None = None):
    check_compatible(cfg, tokenizer)
    self.cfg, self.tokenizer = cfg, tokenizer
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
      ValueError: The checkpoint and tokenizer do not fit together or are not a diffusion model.
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
    return SamplerSettings(diffusion=self.cfg.diffusion, eos_id=tok.eos_id, pad_id=tok.pad_id, **knobs).validate()

  # ------------------------------------------------------------------------------------------- arrays

  def _place(self, array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

  def _gather(self, array: jax.Array) -> np.ndarray:
    if jax.process_count() > 1:
      return np.asarray(multihost_utils.process_allgather(array, tiled=True))
    return np.asarray(array)

  def run(
    self, canvas: cv.Canvas, steps: int, seed: int, settings: SamplerSettings
  ) -> tuple[SampleOutput, float, float]:
    """Runs the compiled loop on a canvas batch.

    Returns:
      ``(output as numpy arrays, wall seconds, compile seconds)``; the batch is padded to the mesh's data size and
      the canvas to ``LENGTH_BUCKET``, and the output is cut back to the rows given.
    """
    if steps < 1:
      raise ValueError(f"steps={steps} must be >= 1")
    batch, length = np.shape(canvas.tokens)
    padded_length = min(-(-length // LENGTH_BUCKET) * LENGTH_BUCKET, max(self.max_length, length))
    if padded_length > length:
      extra = padded_length - length
      canvas = cv.Canvas(
        np.pad(np.asarray(canvas.tokens), ((0, 0), (0, extra)), constant_values=settings.pad_id),
        np.pad(np.asarray(canvas.kinds), ((0, 0), (0, extra)), constant_values=cv.PAD),
        canvas.streams,
      )
    canvas = cv.pad_batch(canvas, sh.data_parallel_size(self.mesh, self.rules), settings.pad_id)
    rows, vectors = sh.batch_sharding(self.mesh, self.rules, 2), sh.batch_sharding(self.mesh, self.rules, 1)
    replicated = NamedSharding(self.mesh, P())
    args = (
      self.params,
      cv.Canvas(
        self._place(canvas.tokens, rows), self._place(canvas.kinds, rows), self._place(canvas.streams, vectors)
      ),
      # Host values placed by callback, so every process of a multi-host mesh builds the same global arrays.
      self._place(np.asarray(jax.random.key_data(jax.random.key(seed))), replicated),
      self._place(np.asarray(steps, np.int32), replicated),
    )
    cache_key = (settings, np.shape(canvas.tokens))
    compile_time = 0.0
    if cache_key not in self._compiled:
      start = time.perf_counter()
      fn = jit_sample(self.denoise_fn, settings, mesh=self.mesh, rules=self.rules, param_shardings=self.param_shardings)
      with mesh_context(self.mesh, self.rules):
        self._compiled[cache_key] = fn.lower(*args).compile()
      compile_time = time.perf_counter() - start
    start = time.perf_counter()
    out = jax.block_until_ready(self._compiled[cache_key](*args))
    wall = time.perf_counter() - start
    out = jax.tree.map(self._gather, out)
    if settings.trace:
      out = out._replace(
        canvases=out.canvases[:, :batch], commits=out.commits[:, :batch], remasks=out.remasks[:, :batch]
      )
    return out._replace(tokens=out.tokens[:batch], nfe=out.nfe[:batch]), wall, compile_time

  # --------------------------------------------------------------------------------------------- text

  def generate(
    self,
    prompts: str | Sequence[str] | None = None,
    *,
    template: str | None = None,
    length: int = 64,
    steps: int = 32,
    seed: int = 0,
    num_samples: int = 1,
    streams: Sequence[int] | None = None,
    show_steps: bool = False,
    bos: bool = False,
    **knobs,
  ) -> list[Sample]:
    """Generates text for each prompt (``num_samples`` each), in one batch.

    Args:
      prompts: One prompt or several (of any lengths). With ``template``, each prompt precedes the template.
      template: A string with ``<mask:N>`` holes; its text is kept and its holes filled.
      length: Tokens to generate after each prompt (prompt mode only).
      steps: Step budget (>= 1).
      seed: The PRNG seed.
      num_samples: Samples per prompt.
      streams: Each row's random stream (default: its row index); give a row the stream it had in another call to
        reproduce it there.
      show_steps: Record the canvas text after every step in ``Sample.steps``.
      bos: Start every prompt with the BOS token, as SFT records do (``[BOS] + prompt``); LM pretraining data has
        none.
      **knobs: ``SamplerSettings`` fields: rule, confidence, temperature, top_k, top_p, threshold, block_length,
        revision, min_length, eos_to_pad.

    Raises:
      ValueError: An empty prompt without a template, a template without holes, a canvas beyond the model's
        context, or a bad setting.
    """
    prompts = [prompts] if isinstance(prompts, str) else list(prompts or ([""] if template is not None else []))
    if not prompts:
      raise ValueError("give a prompt or a template")
    if num_samples < 1:
      raise ValueError(f"num_samples={num_samples} must be >= 1")
    if template is None and length < 1:
      raise ValueError(f"length={length} must be >= 1")
    settings = self.settings(trace=steps if show_steps else 0, **knobs)
    tail = cv.parse_template(template, self.tokenizer.encode) if template is not None else None
    examples, prompt_lengths = [], []
    for i, prompt in enumerate(prompts):
      if not prompt and template is None:
        raise ValueError(f"prompt {i} is empty; give text to continue, or a template with <mask:N> holes")
      ids = ([self.tokenizer.bos_id] if bos else []) + self.tokenizer.encode(prompt)
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
    canvas = cv.make_canvas(examples, streams=streams, pad_id=settings.pad_id)
    out, wall, compile_time = self.run(canvas, steps, seed, settings)
    kinds = np.asarray(canvas.kinds)
    generated = int(((kinds == cv.GENERATE) & (out.tokens[:, : kinds.shape[1]] != settings.pad_id)).sum())
    samples = []
    for row, prompt in enumerate(p for p in prompts for _ in range(num_samples)):
      end = int((kinds[row] != cv.PAD).sum())
      region = out.tokens[row, prompt_lengths[row] : end]
      trace = None
      if show_steps:
        used = min(int(out.nfe[row]), settings.trace)
        trace = [self.tokenizer.decode(out.canvases[j, row, :end], mask_text=MASK_TEXT) for j in range(used)]
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
