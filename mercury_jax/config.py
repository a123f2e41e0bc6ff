"""The one typed configuration schema of mercury_jax.

Every default lives here, once. Presets in the top-level ``configs/`` folder are TOML files that hold only what
differs from these defaults, and every command accepts ``--config NAME_OR_PATH`` plus repeatable
``--set section.key=value`` overrides. Unknown keys and badly typed values fail with a message naming the key.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Literal

ATTENTION_IMPLS = ("auto", "xla", "pallas", "cudnn")
OBJECTIVES = ("masked_diffusion", "autoregressive", "verified", "continuous")
SCHEDULES = ("linear", "cosine", "polynomial")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")  # What the model computes in (``ModelConfig.dtype``).
# What parameters are stored in (``ModelConfig.param_dtype``); also what ``export`` and ``convert`` write.
PARAM_DTYPES = ("float32", "bfloat16")


class ConfigError(ValueError):
  """A configuration key or value is wrong; the message names the key."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The transformer denoiser. It knows nothing about diffusion: tokens (and optionally t) in, logits out."""

  vocab_size: int = 4096
  d_model: int = 256
  num_layers: int = 6
  num_heads: int = 4
  num_kv_heads: int = 4  # < num_heads gives grouped-query attention.
  head_dim: int = 64
  mlp_dim: int = 704  # SwiGLU hidden width.
  max_length: int = 256  # Context length: training sequence length and the sampler's canvas limit.
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  causal: bool = False  # True for the autoregressive twin; diffusion denoisers are bidirectional.
  time_conditioning: bool = False  # Adds an embedding of t to every block's input (MDLM/MD4 both work without).
  tie_embeddings: bool = False
  # Architecture features of public checkpoints (mercury_jax.convert); the defaults are this project's own models.
  qkv_bias: bool = False  # Biases on the query, key and value projections (Qwen2: Dream, DiffuCoder, Fast-dLLM v2).
  qk_norm: bool = False  # RMSNorm over head_dim on queries and keys before RoPE (Qwen3: SDAR).
  scale_tied_logits: bool = True  # A tied head divides its logits by sqrt(d_model); Hugging Face's tied models don't.
  # Position i's output predicts token i + 1, as in the AR model a checkpoint was adapted from (Dream, DiffuCoder,
  # Fast-dLLM v2): the decoding engine reads a masked position's distribution from the position before it.
  shifted_logits: bool = False
  # RoPE scaling (mercury_jax.rope): none, linear (position interpolation), ntk (NTK-aware base change), yarn
  # (Peng et al. 2023) or llama3; factor and the original context as in Hugging Face's rope_scaling.
  rope_scaling: Literal["none", "linear", "ntk", "yarn", "llama3"] = "none"
  rope_factor: float = 1.0
  rope_original_length: int = 0  # original_max_position_embeddings (yarn, llama3); 0: max_length / rope_factor.
  rope_beta_fast: float = 32.0  # yarn
  rope_beta_slow: float = 1.0  # yarn
  rope_attention_factor: float = 0.0  # yarn's cos/sin scale; 0: 0.1 * ln(factor) + 1.
  rope_low_freq_factor: float = 1.0  # llama3
  rope_high_freq_factor: float = 4.0  # llama3
  param_dtype: Literal[*PARAM_DTYPES] = "float32"  # Parameters' storage dtype (converted models: bfloat16).
  dtype: Literal[*COMPUTE_DTYPES] = "float32"  # Compute dtype (parameters: param_dtype).
  attention: Literal[*ATTENTION_IMPLS] = "auto"  # auto: pallas on GPU, xla elsewhere.
  remat: bool = False  # Rematerialise each block in the backward pass (saves activation memory).
  # How attention crosses the shards of a sequence split over mesh.sequence > 1 (mercury_jax.kernels.context_parallel):
  # all_gather (every shard gathers the whole sequence's keys and values, per layer) or ring (key/value blocks pass
  # around the shards, one neighbour exchange per step: no shard ever holds more than two blocks).
  context_parallel: Literal["all_gather", "ring"] = "all_gather"
  # Compile the layer stack unrolled instead of as a loop: 1.5-1.9x faster backward on XLA:CPU, slower to compile
  # for deep models. Parameters keep the same stacked layout either way, so checkpoints are interchangeable.
  unroll_layers: bool = False
  # Width of the continuous family's token latents (objective.name='continuous'): a normalised embedding table
  # [vocab, latent_dim] whose noisy rows enter the network through a projection; 0: no latent path (every other
  # objective).
  latent_dim: int = 0
  # Width of a draft-only SwiGLU MLP in every block, added to the residual stream only at positions whose input token
  # is draft_token (the [MASK] a drafter fills; objective.mask_id). Every other position, and so a verified model's
  # next-token head, computes exactly what the network without it computes: a drafter trained through it alone
  # (train.trainable='draft') leaves the verifier, and its fair twin, as they were. 0: none.
  draft_mlp: int = 0
  draft_token: int = 4

  def validate(self) -> None:
    if self.latent_dim < 0:
      raise ConfigError(f"model.latent_dim={self.latent_dim} must be >= 0 (0: no continuous latents; e.g. 64)")
    if self.draft_mlp < 0:
      raise ConfigError(f"model.draft_mlp={self.draft_mlp} must be >= 0 (0: no draft-only MLP; e.g. 128)")
    if self.draft_mlp and not 0 <= self.draft_token < self.vocab_size:
      raise ConfigError(
        f"model.draft_token={self.draft_token} must be a token id in [0, {self.vocab_size}) (the [MASK], "
        "objective.mask_id)"
      )
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(
        f"model.num_heads={self.num_heads} must be a multiple of model.num_kv_heads={self.num_kv_heads}"
      )
    for name in (
      "vocab_size",
      "d_model",
      "num_layers",
      "num_heads",
      "num_kv_heads",
      "head_dim",
      "mlp_dim",
      "max_length",
    ):
      if getattr(self, name) < 1:
        raise ConfigError(f"model.{name}={getattr(self, name)} must be >= 1")
    if self.rope_scaling != "none" and not self.rope_factor >= 1.0:
      raise ConfigError(f"model.rope_factor={self.rope_factor} must be >= 1 with rope_scaling={self.rope_scaling!r}")
    if self.rope_original_length < 0:
      raise ConfigError(f"model.rope_original_length={self.rope_original_length} must be >= 0 (0: derived)")
    if self.head_dim % 2:
      raise ConfigError(f"model.head_dim={self.head_dim} must be even (rotary embeddings rotate pairs)")


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
  """The training objective (``mercury_jax.objectives``): masked diffusion, or next-token prediction for the AR twin.

  The schedule fields apply to ``masked_diffusion`` (training and the ancestral sampler); ``autoregressive`` ignores
  them. ``block_size > 0`` turns masked diffusion into block diffusion (BD3-LM, Arriola et al. 2025): the sequence
  is cut into blocks of ``block_size`` tokens, each denoised given the clean blocks before it. ``verified`` (TiDAR,
  Liu et al. 2025) trains one network as a drafter of blocks of ``draft_length`` tokens and as an autoregressive
  verifier, in one pass (``objectives.verified``).
  """

  name: Literal[*OBJECTIVES] = "masked_diffusion"
  schedule: Literal[*SCHEDULES] = "linear"
  exponent: float = 1.0  # Polynomial schedule: alpha_t = 1 - t**exponent.
  antithetic: bool = True  # Low-discrepancy t across the global batch (Kingma et al. 2021, VDM).
  t_min: float = 1e-4  # t is drawn from [t_min, 1] so the ELBO weight -alpha'_t / (1 - alpha_t) stays finite.
  mask_id: int = 4  # The [MASK] token; mercury_jax tokenizers put it at 4 (pad 0, unk 1, bos 2, eos 3).
  # BD3-LM's block length L' (objectives.block_diffusion); 0 is whole-sequence masked diffusion (MDLM / MD4).
  block_size: int = 0
  # Clipped schedule (BD3-LM Sec. 5.2), training only: mask rates 1 - alpha_t in [mask_rate_min, mask_rate_max]
  # (uniform with the linear schedule). Evaluation always integrates all of [t_min, 1], so the ELBO stays a bound.
  mask_rate_min: float = 0.0
  mask_rate_max: float = 1.0
  # verified: the draft block length k, the weight α of the next-token loss (loss = (α·L_AR + L_draft) / (1 + α)),
  # and the range of the draft half's mask rate, drawn per (sequence, block); 1 and 1 masks every draft target
  # (TiDAR's choice: one-step drafting), a range trains the drafter to refine a block over several steps.
  draft_length: int = 4
  ar_weight: float = 1.0
  draft_mask_min: float = 1.0
  draft_mask_max: float = 1.0
  # verified: the weight λ of the drafter's KL to the clean half's own stop-gradient next-token distributions
  # (objectives.verified: self-distillation; 0 trains on the tokens alone).
  draft_kl_weight: float = 0.0
  # continuous (objectives.continuous, CDCD / LangFlow): Gaussian noise of scale sigma in [sigma_min, sigma_max] on
  # normalised token latents (unit variance per dimension); sigma_schedule is how training draws sigma: fixed
  # (log-uniform), warped (CDCD's time warping: a learned piecewise-linear CDF fitted to the loss) or gumbel
  # (LangFlow's learnable Gumbel CDF over log sigma); self_conditioning is the probability of a training step's
  # self-conditioning pass (Chen et al. 2022, analog bits). block_size > 0 is the block-causal variant.
  sigma_min: float = 1.0
  sigma_max: float = 100.0
  sigma_schedule: Literal["fixed", "warped", "gumbel"] = "warped"
  self_conditioning: float = 0.5

  @property
  def continuous(self) -> bool:
    return self.name == "continuous"

  @property
  def autoregressive(self) -> bool:
    return self.name == "autoregressive"

  @property
  def verified(self) -> bool:
    return self.name == "verified"

  def validate(self) -> None:
    if self.exponent <= 0:
      raise ConfigError(f"objective.exponent={self.exponent} must be > 0")
    if not 0.0 < self.t_min < 1.0:
      raise ConfigError(
        f"objective.t_min={self.t_min} must lie in (0, 1): at t = 0 the ELBO weight is infinite (e.g. 1e-4)"
      )
    if self.block_size < 0:
      raise ConfigError(f"objective.block_size={self.block_size} must be >= 0 (0: whole-sequence masked diffusion)")
    if self.block_size and self.name not in ("masked_diffusion", "continuous"):
      raise ConfigError(
        f"objective.block_size={self.block_size} needs objective.name='masked_diffusion' or 'continuous' (got "
        f"{self.name!r}); use block_size=0"
      )
    if not 0.0 < self.sigma_min < self.sigma_max:
      raise ConfigError(
        f"objective.sigma_min={self.sigma_min} and objective.sigma_max={self.sigma_max} must satisfy "
        "0 < sigma_min < sigma_max (e.g. 1 and 100)"
      )
    if not 0.0 <= self.self_conditioning <= 1.0:
      raise ConfigError(f"objective.self_conditioning={self.self_conditioning} must lie in [0, 1] (e.g. 0.5)")
    if not 0.0 <= self.mask_rate_min < self.mask_rate_max <= 1.0:
      raise ConfigError(
        f"objective.mask_rate_min={self.mask_rate_min} and objective.mask_rate_max={self.mask_rate_max} must "
        "satisfy 0 <= mask_rate_min < mask_rate_max <= 1 (e.g. 0.3 and 0.8)"
      )
    if self.draft_length < 1:
      raise ConfigError(f"objective.draft_length={self.draft_length} must be >= 1 (e.g. 4)")
    if self.ar_weight < 0:
      raise ConfigError(f"objective.ar_weight={self.ar_weight} must be >= 0 (e.g. 1.0)")
    if not self.draft_kl_weight >= 0:
      raise ConfigError(f"objective.draft_kl_weight={self.draft_kl_weight} must be >= 0 (e.g. 1.0; 0: off)")
    if not 0.0 < self.draft_mask_min <= self.draft_mask_max <= 1.0:
      raise ConfigError(
        f"objective.draft_mask_min={self.draft_mask_min} and objective.draft_mask_max={self.draft_mask_max} must "
        "satisfy 0 < draft_mask_min <= draft_mask_max <= 1 (e.g. 1.0 and 1.0: every draft token masked)"
      )


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where prepared ArrayRecord shards live and how grain reads them."""

  path: str = ""  # A directory written by `python -m mercury_jax.prepare`.
  batch_size: int = 16  # Global batch, split over the mesh's data axes and over processes.
  shuffle_seed: int = 0
  num_threads: int = 2
  prefetch: int = 8
  # Packed LM records: attention stays within each document (a segment per document, from the EOS that ends it), so a
  # long record of many files never attends across files. False: a record is one segment.
  document_segments: bool = False
  # A Jinja2 chat template that renders `messages` (OpenAI-style dicts) into the SFT prompt text, for the server's
  # /v1/chat/completions (mercury_jax.data.chat_template); "" = none: the model has no chat format.
  chat_template: str = ""
  # More prepared directories whose training records are mixed into data.path's, as "DIR@WEIGHT" (data.path weighs 1;
  # e.g. "data/chat@0.33": a quarter of the rows), record by record; evaluation stays on data.path's validation split.
  mix: tuple[str, ...] = ()
  # Self-distillation sets (`python -m mercury_jax.distill`), "DIR[@WEIGHT]", mixed with each other by weight:
  # distill_batch_size of their records follow the data.batch_size rows of every batch, which stay exactly the batches
  # a run without them reads (objective.name='verified' only: their tokens train the drafter alone).
  distill: tuple[str, ...] = ()
  distill_batch_size: int = 0

  @property
  def rows(self) -> int:
    """Rows of a training batch: ``batch_size`` and the self-distillation rows."""
    return self.batch_size + self.distill_batch_size

  def weighted(self, name: str) -> list[tuple[str, float]]:
    """``data.mix`` or ``data.distill`` as ``(directory, weight)`` pairs."""
    out = []
    for spec in getattr(self, name):
      path, at, weight = spec.rpartition("@")
      if not at or "/" in weight:
        path, weight = spec, "1"
      try:
        value = float(weight)
      except ValueError:
        value = float("nan")
      if not path or not value > 0:
        raise ConfigError(f"data.{name}: {spec!r} must be DIR or DIR@WEIGHT with a weight > 0 (e.g. data/chat@0.25)")
      out.append((path, value))
    return out

  def validate(self) -> None:
    if self.batch_size < 1:
      raise ConfigError(f"data.batch_size={self.batch_size} must be >= 1")
    if self.distill_batch_size < 0 or bool(self.distill) != (self.distill_batch_size > 0):
      raise ConfigError(
        f"data.distill ({len(self.distill)} sets) and data.distill_batch_size={self.distill_batch_size} go "
        "together: give both (e.g. distill_batch_size=8) or neither"
      )
    self.weighted("mix"), self.weighted("distill")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW with linear warmup, cosine decay and global-norm clipping."""

  learning_rate: float = 3e-4
  warmup_steps: int = 200
  final_lr_fraction: float = 0.1  # Cosine decays to learning_rate * final_lr_fraction at train.steps.
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.98
  eps: float = 1e-9
  clip_norm: float = 1.0

  def validate(self) -> None:
    if self.learning_rate <= 0:
      raise ConfigError(f"optim.learning_rate={self.learning_rate} must be > 0")
    if self.warmup_steps < 0:
      raise ConfigError(f"optim.warmup_steps={self.warmup_steps} must be >= 0")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh shape; -1 on one axis absorbs the remaining devices.

  ``rules`` overrides single entries of the logical-to-mesh table in ``mercury_jax.sharding``, as
  ``"logical=mesh_axis"`` or ``"logical=axis1+axis2"`` or ``"logical="`` (replicated).
  """

  data: int = -1
  fsdp: int = 1
  tensor: int = 1
  # Context parallelism: activations split over the sequence, attention across the shards
  # (mercury_jax.kernels.context_parallel). After `tensor` so that MeshConfig(data, fsdp, tensor) keeps its meaning.
  sequence: int = 1
  rules: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 1000
  seed: int = 0
  log_every: int = 10
  eval_every: int = 200
  eval_batches: int = 8
  # Which parameters the optimiser moves: all, or only the draft-only MLPs (model.draft_mlp), every other parameter
  # bit-identical to the run's start (--init-from): a verified model's drafter trained with its verifier fixed.
  trainable: Literal["all", "draft"] = "all"

  def validate(self) -> None:
    if self.steps < 1:
      raise ConfigError(f"train.steps={self.steps} must be >= 1")
    for name in ("log_every", "eval_every", "eval_batches"):
      if getattr(self, name) < 0:
        raise ConfigError(f"train.{name}={getattr(self, name)} must be >= 0")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """A checkpoint's recommended decoding defaults: what the sampler, the CLI and the server use for a knob the user
  leaves unset. Converted public checkpoints carry their authors' settings (``mercury_jax.convert``: ``source``
  says where each came from); this project's own models keep the built-in defaults below."""

  rule: Literal["ancestral", "confidence", "threshold"] = "threshold"
  confidence: Literal["prob", "margin", "entropy"] = "prob"
  commit_counts: Literal["even", "timesteps"] = "even"  # LLaDA's even split, or Dream's time grid.
  threshold: float = 0.9
  block_length: int = 0  # Semi-autoregressive blocks of a whole-sequence model (0: one block).
  steps_per_block: int = 0  # 0: one token per step (the engine's default budget).
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  source: str = ""  # Where these defaults come from (a paper, a repository's generate script).

  def validate(self) -> None:
    if self.block_length < 0 or self.steps_per_block < 0:
      raise ConfigError(
        f"sampling.block_length={self.block_length} and sampling.steps_per_block={self.steps_per_block} must be >= 0"
      )
    if not self.temperature >= 0 or not 0.0 < self.top_p <= 1.0 or self.top_k < 0:
      raise ConfigError(
        f"sampling.temperature={self.temperature} must be >= 0, sampling.top_p={self.top_p} in (0, 1] and "
        f"sampling.top_k={self.top_k} >= 0"
      )


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every: int = 200
  max_to_keep: int = 3
  async_save: bool = True

  def validate(self) -> None:
    if self.every < 1:
      raise ConfigError(f"checkpoint.every={self.every} must be >= 1")
    if self.max_to_keep < 1:
      raise ConfigError(f"checkpoint.max_to_keep={self.max_to_keep} must be >= 1")


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = ModelConfig()
  objective: ObjectiveConfig = ObjectiveConfig()
  data: DataConfig = DataConfig()
  optim: OptimConfig = OptimConfig()
  mesh: MeshConfig = MeshConfig()
  train: TrainConfig = TrainConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  sampling: SamplingConfig = SamplingConfig()
  name: str = "custom"

  def validate(self) -> Config:
    for section in dataclasses.fields(self):
      value = getattr(self, section.name)
      if hasattr(value, "validate"):
        value.validate()
    if self.objective.autoregressive and not self.model.causal:
      raise ConfigError("objective.name='autoregressive' needs model.causal=true")
    if self.objective.autoregressive and self.model.time_conditioning:
      raise ConfigError("model.time_conditioning=true needs objective.name='masked_diffusion' (an AR model has no t)")
    block = self.objective.block_size
    if block and self.model.causal:
      raise ConfigError(f"objective.block_size={block} needs a bidirectional model (model.causal=false)")
    if block and self.model.max_length % block:
      raise ConfigError(f"model.max_length={self.model.max_length} must be a multiple of objective.block_size={block}")
    if block and self.model.time_conditioning:
      raise ConfigError(
        f"objective.block_size={block} draws one t per block, which model.time_conditioning=true (one t per "
        "sequence) cannot take; set model.time_conditioning=false"
      )
    if self.objective.verified and self.model.causal:
      raise ConfigError(
        "objective.name='verified' runs its own mask over drafts and a causal clean half; set model.causal=false"
      )
    if self.data.distill and not self.objective.verified:
      raise ConfigError(
        f"data.distill trains a verified model's drafter on its own continuations; objective.name="
        f"{self.objective.name!r} has no drafter (use objective.name='verified' or drop data.distill)"
      )
    if self.objective.verified and self.model.time_conditioning:
      raise ConfigError(
        "objective.name='verified' has no diffusion time (one pass drafts and verifies); set "
        "model.time_conditioning=false"
      )
    k = self.objective.draft_length
    if self.objective.verified and self.model.max_length % k:
      raise ConfigError(
        f"model.max_length={self.model.max_length} must be a multiple of objective.draft_length={k} "
        f"(e.g. draft_length={math.gcd(self.model.max_length, 4)})"
      )
    if not self.objective.autoregressive and self.model.causal:
      raise ConfigError("model.causal=true is only meaningful with objective.name='autoregressive'")
    shards = self.mesh.sequence
    if shards > 1 and self.model.max_length % (2 * shards):
      raise ConfigError(
        f"model.max_length={self.model.max_length} must be a multiple of 2 * mesh.sequence={2 * shards}: each "
        "sequence shard holds two chunks of every training sequence (the zig-zag layout)"
      )
    if self.model.draft_mlp and self.model.draft_token != self.objective.mask_id:
      raise ConfigError(
        f"model.draft_token={self.model.draft_token} must equal objective.mask_id={self.objective.mask_id}: the "
        "draft-only MLP runs where the drafter's input is the [MASK]"
      )
    if self.train.trainable == "draft" and not (self.model.draft_mlp and self.objective.verified):
      raise ConfigError(
        "train.trainable='draft' trains only a verified model's draft-only MLPs; set model.draft_mlp (e.g. 128) and "
        "objective.name='verified', or train.trainable='all'"
      )
    if self.objective.continuous and not self.model.latent_dim:
      raise ConfigError("objective.name='continuous' denoises token latents; set model.latent_dim (e.g. 64)")
    if self.objective.continuous and self.model.time_conditioning:
      raise ConfigError(
        "objective.name='continuous' conditions every position on its own noise level; set "
        "model.time_conditioning=false"
      )
    return self

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)


# ----------------------------------------------------------------------------------------------- parsing


def _coerce(key: str, annotation: Any, value: Any) -> Any:
  """Converts ``value`` (a TOML/JSON value or a command-line string) to ``annotation``, naming ``key`` on error."""
  origin = typing.get_origin(annotation)
  if origin is Literal:
    choices = typing.get_args(annotation)
    if value not in choices:
      raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(repr, choices))}")
    return value
  if annotation is bool:
    if isinstance(value, bool):
      return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
      return value.lower() in ("true", "1", "yes")
    raise ConfigError(f"{key}={value!r} is not a boolean (use true or false)")
  if annotation is int:
    if isinstance(value, bool):
      raise ConfigError(f"{key}={value!r} is not an integer")
    if isinstance(value, int):
      return value
    try:
      return int(str(value).replace("_", ""))
    except ValueError:
      raise ConfigError(f"{key}={value!r} is not an integer") from None
  if annotation is float:
    if isinstance(value, bool):
      raise ConfigError(f"{key}={value!r} is not a number")
    try:
      return float(value)
    except (TypeError, ValueError):
      raise ConfigError(f"{key}={value!r} is not a number") from None
  if annotation is str:
    if not isinstance(value, str):
      raise ConfigError(f"{key}={value!r} is not a string")
    return value
  if origin is tuple:
    if isinstance(value, str):
      value = [v for v in value.split(",") if v] if value else []
    if not isinstance(value, (list, tuple)):
      raise ConfigError(f"{key}={value!r} is not a list")
    (item_type, _) = typing.get_args(annotation)
    return tuple(_coerce(key, item_type, v) for v in value)
  raise AssertionError(f"unsupported annotation {annotation} for {key}")


def _section_types(cls: type) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def apply_overrides(cfg: Config, overrides: dict[str, Any], source: str = "--set") -> Config:
  """Returns ``cfg`` with dotted-key overrides applied, e.g. ``{"model.d_model": 512}``."""
  sections: dict[str, dict[str, Any]] = {}
  top: dict[str, Any] = {}
  top_types = _section_types(Config)
  for key, value in overrides.items():
    section, _, field = key.partition(".")
    if section not in top_types:
      known = ", ".join(sorted(top_types))
      raise ConfigError(f"unknown config key {key!r} in {source}; top-level sections are: {known}")
    section_type = top_types[section]
    if not dataclasses.is_dataclass(section_type):
      if field:
        raise ConfigError(f"unknown config key {key!r} in {source}")
      top[section] = _coerce(key, section_type, value)
      continue
    field_types = _section_types(section_type)
    if field not in field_types:
      known = ", ".join(sorted(field_types))
      raise ConfigError(f"unknown config key {key!r} in {source}; {section} has: {known}")
    sections.setdefault(section, {})[field] = _coerce(key, field_types[field], value)
  updated = {name: dataclasses.replace(getattr(cfg, name), **fields) for name, fields in sections.items()}
  return dataclasses.replace(cfg, **updated, **top)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  flat: dict[str, Any] = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(_flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


def _preset_dir():
  """The presets: packaged as ``mercury_jax.configs`` in a wheel, the top-level ``configs/`` in a source tree."""
  try:
    return resources.files("mercury_jax.configs")
  except ModuleNotFoundError:
    return Path(__file__).resolve().parent.parent / "configs"


def preset_names() -> list[str]:
  """Names of the presets shipped in ``configs/``."""
  return sorted(p.name.removesuffix(".toml") for p in _preset_dir().iterdir() if p.name.endswith(".toml"))


def _read_preset(name_or_path: str) -> tuple[str, dict[str, Any]]:
  path = Path(name_or_path)
  if name_or_path.endswith(".toml") or path.exists():
    if not path.is_file():
      raise ConfigError(f"--config {name_or_path!r}: no such file")
    text, name = path.read_text(), path.stem
  else:
    preset = _preset_dir() / f"{name_or_path}.toml"
    if not preset.is_file():
      raise ConfigError(
        f"--config {name_or_path!r} is neither a file nor a preset; presets: {', '.join(preset_names())}"
      )
    text, name = preset.read_text(), name_or_path
  try:
    return name, tomllib.loads(text)
  except tomllib.TOMLDecodeError as e:
    raise ConfigError(f"--config {name_or_path!r} is not valid TOML: {e}") from None


def parse_set_args(items: list[str] | tuple[str, ...]) -> dict[str, str]:
  """Turns repeated ``--set key=value`` strings into a dict."""
  out = {}
  for item in items:
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise ConfigError(f"--set {item!r} must look like section.key=value")
    out[key.strip()] = value.strip()
  return out


def load_config(name_or_path: str = "default", overrides: dict[str, Any] | None = None) -> Config:
  """Loads a preset (a name from ``configs/`` or a TOML path), applies overrides and validates."""
  name, tree = _read_preset(name_or_path)
  cfg = apply_overrides(Config(name=name), _flatten(tree), source=f"config {name_or_path!r}")
  cfg = apply_overrides(cfg, overrides or {})
  return cfg.validate()


def config_from_dict(tree: dict[str, Any]) -> Config:
  """Rebuilds a Config from ``Config.to_dict()`` output (as stored in checkpoints).

  Checkpoints written before the ``objective`` section existed store the same fields under ``diffusion`` (with
  ``objective = "diffusion" | "autoregressive"``); they are read into ``objective``.
  """
  tree = dict(tree)
  if "diffusion" in tree and "objective" not in tree:
    legacy = dict(tree.pop("diffusion"))
    name = legacy.pop("objective", "diffusion")
    tree["objective"] = {**legacy, "name": "masked_diffusion" if name == "diffusion" else name}
  return apply_overrides(Config(), _flatten(tree), source="stored config").validate()


def dtype_of(name: str) -> Any:
  import jax.numpy as jnp

  return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


__all__ = [
  "Config",
  "ConfigError",
  "ModelConfig",
  "ObjectiveConfig",
  "DataConfig",
  "OptimConfig",
  "MeshConfig",
  "TrainConfig",
  "CheckpointConfig",
  "load_config",
  "apply_overrides",
  "parse_set_args",
  "config_from_dict",
  "preset_names",
  "dtype_of",
]
