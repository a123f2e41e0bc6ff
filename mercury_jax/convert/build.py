"""Converting a Hugging Face checkpoint folder into a mercury_jax inference checkpoint (:func:`convert`).

The parameters are read one tensor at a time and cast straight into preallocated arrays of the output's layout and
dtype (the layers stacked on a leading axis), so the host holds the output plus one source tensor. The folder is
assembled beside ``out`` and renamed into place when complete: a failure leaves no partial output.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from mercury_jax.checkpoint import replace_folder
from mercury_jax.config import Config, ModelConfig
from mercury_jax.convert import safetensors_io as st
from mercury_jax.convert.families import SPECS, ConvertError, Target, block_size, config_from_hf, tensor_plan
from mercury_jax.convert.tokens import (
  GENERATION_CONFIG,
  TokenTable,
  chat_template,
  read_json,
  special_tokens,
  write_tokenizer,
)
from mercury_jax.data.hf_files import TOKENIZER_CONFIG, TOKENIZER_JSON, SpecialTokens
from mercury_jax.files import CARD_FILE, ORBAX_COMMIT_MARKER

NUMPY_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
PROGRESS_MIN_BYTES = 64 * 2**20  # Smaller conversions print no progress.


def _check_plan(plan: list[Target], tensors: dict[str, st.TensorInfo]) -> None:
  """Every source tensor exists with the shape the config implies (checked before any data is read)."""
  for target in plan:
    for name in target.sources:
      if name not in tensors:
        raise ConvertError(
          f"tensor {name!r} is missing from the checkpoint (needed for {'/'.join(target.path)}; "
          f"the checkpoint has {len(tensors)} tensors)"
        )
      if tensors[name].shape != target.source_shape:
        raise ConvertError(
          f"tensor {name!r} has shape {list(tensors[name].shape)} but the config implies {list(target.source_shape)}"
        )


def _check_layout(plan: list[Target], model: ModelConfig) -> None:
  """The plan's paths and shapes are exactly the model's parameters (an internal invariant)."""
  import flax.linen as nn
  import jax

  from mercury_jax.model import Transformer, init_params

  boxed = jax.eval_shape(functools.partial(init_params, Transformer(model)), jax.random.key(0))
  expected = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(boxed))[0]
  expected = {tuple(k.key for k in path): tuple(leaf.shape) for path, leaf in expected}
  planned = {t.path: t.shape for t in plan}
  assert planned == expected, f"conversion plan {planned} does not match the model's parameters {expected}"


def _fill(plan: list[Target], tensors: dict[str, st.TensorInfo], dtype: np.dtype, progress: bool) -> dict[str, Any]:
  """The parameter tree, each array preallocated in ``dtype`` and filled one source tensor at a time."""
  params: dict[str, Any] = {}
  total = sum(tensors[name].nbytes for t in plan for name in t.sources)
  count = sum(len(t.sources) for t in plan)
  done_bytes, done, shown = 0, 0, -1
  report = progress and total >= PROGRESS_MIN_BYTES
  for target in plan:
    array = np.empty(target.shape, dtype)
    for i, name in enumerate(target.sources):
      dst = array[i] if target.stacked else array
      src = st.read(tensors[name])
      if target.transpose:  # [out, in] -> [in, out], then the destination's own split of in/out into heads.
        st.transpose_into(dst.reshape(src.shape[1], src.shape[0]), src)
      else:
        st.copy_cast(dst.reshape(src.shape), src)
      done_bytes, done = done_bytes + tensors[name].nbytes, done + 1
      del src
      step = 20 * done_bytes // total
      if report and step > shown:
        shown = step
        sys.stderr.write(
          f"mercury_jax.convert: {5 * step:3d}% ({done}/{count} tensors, {done_bytes / 1e9:.2f}/{total / 1e9:.2f} GB)\n"
        )
    node = params
    for key in target.path[:-1]:
      node = node.setdefault(key, {})
    node[target.path[-1]] = array
  return params


@functools.cache
def _numpy_registry():
  """Orbax's type handlers, except that numpy arrays are written without the defensive deep copy (which would
  double the host memory of a conversion)."""
  from orbax.checkpoint import type_handlers as th

  handlers = [
    (ty, th.NumpyHandler(deepcopy_host_arrays=False) if ty is np.ndarray else th.get_type_handler(ty))
    for ty in th.supported_types()
  ]
  return th.create_type_handler_registry(*handlers)


def save_params(root: Path, params: dict[str, Any], cfg: Config, step: int = 0) -> None:
  """Writes the ``params`` and ``config`` items at ``step`` under ``root``, the layout of
  :func:`mercury_jax.checkpoint.export_params`, which :func:`~mercury_jax.checkpoint.restore_params` reads."""
  import orbax.checkpoint as ocp

  # Uncompressed: zstd would hold each array's compressed copy in memory until written (about 0.7x the output more
  # at the peak, for ~20 % less disk on bfloat16 weights); restore reads either.
  handler = ocp.PyTreeCheckpointHandler(type_handler_registry=_numpy_registry(), use_compression=False)
  handlers = {"params": handler}
  options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
  with ocp.CheckpointManager(root, item_names=("params", "config"), item_handlers=handlers, options=options) as mngr:
    mngr.save(
      step,
      args=ocp.args.Composite(params=ocp.args.PyTreeSave(params), config=ocp.args.JsonSave(cfg.to_dict())),
      force=True,
    )
    mngr.wait_until_finished()
  for marker in root.rglob(ORBAX_COMMIT_MARKER):  # It names the staging folder's absolute path.
    marker.unlink()


def _licence(src: Path, hf: dict[str, Any]) -> str:
  """The licence named in config.json or in README.md's front matter, or "not stated"."""
  if hf.get("license"):
    return str(hf["license"])
  readme = src / "README.md"
  if readme.is_file():
    lines = readme.read_text(errors="replace").splitlines()
    if lines and lines[0].strip() == "---":
      for line in lines[1:]:
        if line.strip() == "---":
          break
        key, _, value = line.partition(":")
        if key.strip() == "license" and value.strip():
          return value.strip()
  return "not stated in config.json or README.md"


def model_card(src: Path, hf: dict[str, Any], cfg: Config, special: SpecialTokens, dtype: str) -> str:
  """The ``MODEL_CARD.md`` of a converted checkpoint."""
  m, s, spec = cfg.model, cfg.sampling, SPECS[cfg.name]
  name = hf.get("_name_or_path") or src.name
  block = f"block diffusion, blocks of {cfg.objective.block_size}" if cfg.objective.block_size else "whole sequence"
  mask = f"mask id {cfg.objective.mask_id}"
  knobs = (
    f"rule `{s.rule}`, confidence `{s.confidence}`, threshold {s.threshold}, block_length {s.block_length},\n"
    f"steps_per_block {s.steps_per_block} (0: one token per step)"
  )
  if cfg.objective.autoregressive:
    knobs = "one token per step"
    block = "autoregressive, one token per step over the exact key-value cache"
    mask += " (a placeholder for positions still to come: no output the decoder reads depends on it)"
  return f"""# {name} (converted)

Converted from the Hugging Face checkpoint `{src.name}` (`model_type` `{hf.get("model_type")}`, architectures
{", ".join(hf.get("architectures") or ["not stated"])}) by `python -m mercury_jax.convert`.

- Family: {spec.title} (`{cfg.name}`); licence: {_licence(src, hf)}.
- Model: {m.num_layers} layers, d_model {m.d_model}, {m.num_heads} heads ({m.num_kv_heads} key/value heads) of
  {m.head_dim}, MLP {m.mlp_dim}, vocabulary {m.vocab_size}, RoPE theta {m.rope_theta:g} ({m.rope_scaling} scaling),
  q/k/v bias {m.qkv_bias}, qk-norm {m.qk_norm}, tied embeddings {m.tie_embeddings}; parameters stored in {dtype}.
- Decoding: {block}; shifted logits {m.shifted_logits} (position i's output predicts token i + 1); {mask};
  EOS {special.eos_id}, stop ids {list(special.stop_ids)}; context {m.max_length} tokens.

## Sampling defaults (`[sampling]` of the stored config)

{knobs}, temperature {s.temperature}, top_p {s.top_p}, top_k {s.top_k}.

Source: {s.source}.
"""


def _staging(out: Path, force: bool) -> Path:
  if out.exists() and not out.is_dir():
    raise ConvertError(f"--out {str(out)!r} exists and is not a folder")
  if out.is_dir() and any(out.iterdir()) and not force:
    raise ConvertError(f"--out {str(out)!r} exists and is not empty; pass --force to replace it")
  out.parent.mkdir(parents=True, exist_ok=True)
  staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
  staging.chmod(0o755)
  return staging


def convert(
  src: str | os.PathLike,
  out: str | os.PathLike,
  family: str = "auto",
  dtype: str = "bfloat16",
  *,
  max_length: int | None = None,
  force: bool = False,
  progress: bool = False,
) -> Path:
  """Converts the Hugging Face checkpoint folder ``src`` into a mercury_jax inference checkpoint at ``out``: a diffusion
  family's, or (``family="autoregressive"``) a plain causal model's, which decodes token by token.

  Args:
    src: a folder with ``config.json``, safetensors weights (one file or an index and its shards) and
      ``tokenizer.json`` (``tokenizer_config.json`` and ``generation_config.json`` when present).
    out: the folder to write: the Orbax ``params`` and ``config`` items (step 0), the tokenizer files,
      ``special_tokens.json`` and ``MODEL_CARD.md``.
    family: ``"auto"`` (from ``model_type``; a plain ``qwen2``/``qwen3``/``llama`` needs the family named) or one
      of :data:`~mercury_jax.convert.families.FAMILIES`.
    dtype: the parameters' dtype, ``"bfloat16"`` or ``"float32"``.
    max_length: the model's context; default: the source's, capped at 4096.
    force: replace a non-empty ``out``.
    progress: print progress to stderr (for checkpoints of 64 MiB or more).

  Returns:
    ``out`` (absolute).

  Raises:
    ConvertError: the source is missing, malformed, truncated or unsupported; the message is one line.
  """
  src, out = Path(src), Path(out).absolute()
  if not src.is_dir():
    raise ConvertError(f"--from {str(src)!r} is not a folder (expected a Hugging Face checkpoint folder)")
  if not (src / "config.json").is_file():
    raise ConvertError(f"no config.json in {str(src)!r} (expected a Hugging Face checkpoint folder)")
  hf = read_json(src / "config.json", "config")
  resolved = config_from_hf(hf, family, dtype=dtype, max_length=max_length)  # Fails early on an unsupported config.
  try:
    tensors = st.open_checkpoint(src)
  except st.CheckpointError as e:
    raise ConvertError(str(e)) from None
  if not (src / TOKENIZER_JSON).is_file():
    raise ConvertError(f"no {TOKENIZER_JSON} in {str(src)!r} (a converted model needs the Hugging Face tokenizer)")
  generation = read_json(src / GENERATION_CONFIG, "generation config") if (src / GENERATION_CONFIG).is_file() else {}
  tok_config = read_json(src / TOKENIZER_CONFIG, "tokenizer config") if (src / TOKENIZER_CONFIG).is_file() else {}
  table = TokenTable(src / TOKENIZER_JSON)
  special = special_tokens(hf, generation, tok_config, table, resolved.name)
  if not special.mask_id < resolved.model.vocab_size:
    raise ConvertError(f"mask id {special.mask_id} is not below the model's vocabulary {resolved.model.vocab_size}")
  cfg = config_from_hf(
    hf,
    resolved.name,
    dtype=dtype,
    max_length=max_length,
    mask_id=special.mask_id,
    chat_template=chat_template(src),
    generation=generation,
  )
  assert block_size(hf, cfg.name) == cfg.objective.block_size
  plan = tensor_plan(hf, cfg.model)
  _check_plan(plan, tensors)
  _check_layout(plan, cfg.model)
  unused = sorted(set(tensors) - {name for t in plan for name in t.sources})
  if unused and progress:
    sys.stderr.write(f"mercury_jax.convert: note: {len(unused)} tensor(s) not used, e.g. {unused[0]!r}\n")

  staging = _staging(out, force)
  try:
    params = _fill(plan, tensors, NUMPY_DTYPES[dtype], progress)
    save_params(staging, params, cfg)
    del params
    write_tokenizer(src, staging, special)
    (staging / CARD_FILE).write_text(model_card(src, hf, cfg, special, dtype))
    replace_folder(staging, out)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  return out
