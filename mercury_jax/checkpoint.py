"""Orbax checkpoints: training save/resume, restore onto any mesh, and params-only restore for inference.

A checkpoint directory (``WORKDIR/checkpoints``) holds one folder per step with the items

- ``params``: the model parameters (restorable alone, for inference),
- ``train``: ``{"step", "opt_state", "key"}``,
- ``data``: the grain iterator state (so the data stream resumes exactly). The training stream's state is the same
  on every process and for every process count (see ``data.pipeline.train_dataset``), so it is stored once as
  JSON and a run saved by N processes resumes on M,
- ``config``: the full ``Config`` as JSON.

Orbax writes each step into a temporary folder and renames it when complete, so a crash mid-save never replaces a
good checkpoint, and ``max_to_keep`` only removes old steps after a newer one is committed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import traverse_util
from jax.sharding import Mesh

from mercury_jax import sharding as sh
from mercury_jax.config import CheckpointConfig, Config, ConfigError, MeshConfig, config_from_dict
from mercury_jax.files import CHECKPOINTS, PARAMS, TOKENIZER_FILE
from mercury_jax.model import LATENT_PARAMS, Transformer, abstract_params, is_draft_param

ITEMS = (PARAMS, "train", "data", "config")


class Checkpointer:
  """Saves and restores the train state, the data iterator and the config under ``directory``."""

  def __init__(self, directory: str | Path, cfg: CheckpointConfig):
    self.directory = Path(directory).absolute()
    options = ocp.CheckpointManagerOptions(
      max_to_keep=cfg.max_to_keep, enable_async_checkpointing=cfg.async_save, create=True
    )
    self.manager = ocp.CheckpointManager(self.directory, item_names=ITEMS, options=options)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, state: dict[str, Any], data_iterator, cfg: Config) -> None:
    """Saves ``state`` at ``state["step"]`` (asynchronously when configured); no-op if that step exists."""
    step = int(jax.device_get(state["step"]))
    if step in self.manager.all_steps():
      return
    train = {k: state[k] for k in ("step", "opt_state", "key")}
    self.manager.save(
      step,
      args=ocp.args.Composite(
        params=ocp.args.StandardSave(state["params"]),
        train=ocp.args.StandardSave(train),
        data=ocp.args.JsonSave(data_iterator.get_state()),
        config=ocp.args.JsonSave(cfg.to_dict()),
      ),
      force=True,
    )

  def restore(self, abstract_state: dict[str, Any], data_iterator, step: int | None = None) -> dict[str, Any]:
    """Restores the state onto the shardings carried by ``abstract_state`` and the iterator in place."""
    step = self.latest_step() if step is None else step
    abstract_train = {k: abstract_state[k] for k in ("step", "opt_state", "key")}
    restored = self.manager.restore(
      step,
      args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_state["params"]),
        train=ocp.args.StandardRestore(abstract_train),
        data=ocp.args.JsonRestore(),
      ),
    )
    data_iterator.set_state(restored.data)
    return {"params": restored.params, **restored.train}

  def stored_config(self, step: int | None = None) -> Config:
    step = self.latest_step() if step is None else step
    return config_from_dict(self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config)

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def _manager_root(path: Path) -> Path:
  """Accepts a train workdir, its ``checkpoints`` folder, or one step folder inside it."""
  if (path / CHECKPOINTS).is_dir():
    return path / CHECKPOINTS
  if (path / PARAMS).is_dir() and path.name.isdigit():
    return path.parent
  return path


def find_tokenizer(path: str | Path) -> Path:
  """The sentencepiece model that belongs to a checkpoint: ``tokenizer.model`` beside or above its folders."""
  path = Path(path).absolute()
  for folder in (path, path.parent, path.parent.parent):
    if (folder / TOKENIZER_FILE).is_file():
      return folder / TOKENIZER_FILE
  raise FileNotFoundError(f"no {TOKENIZER_FILE} found in {str(path)!r} or the two folders above it")


def restore_params(
  path: str | Path, mesh: Mesh | None = None, mesh_cfg: MeshConfig | None = None, step: int | None = None
) -> tuple[Any, Config]:
  """Params-only restore for inference: reads the ``params`` and ``config`` items, never the optimiser state.

  Args:
    path: a train workdir, its ``checkpoints`` folder, a step folder, or an exported inference checkpoint.
    mesh: where to place the parameters; default: a one-device mesh.
    mesh_cfg: its rule overrides (default: the stored config's).
    step: which step; default: the latest (or the step named by a step-folder path).

  Returns:
    ``(params, config)`` with params sharded by the model's logical axis rules on ``mesh``.
  """
  root, step = _locate(path, step)
  with ocp.CheckpointManager(root, item_names=("params", "config")) as manager:
    step = _step(manager, path, step)
    try:
      cfg = config_from_dict(manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config)
    except ConfigError:
      raise
    except Exception as e:  # Orbax raises several types for a missing or foreign item.
      raise FileNotFoundError(f"{str(path)!r} step {step} has no readable mercury_jax config: {e}") from None
    mesh = mesh if mesh is not None else sh.make_mesh(MeshConfig(data=1), jax.devices()[:1])
    rules = sh.axis_rules(mesh_cfg if mesh_cfg is not None else cfg.mesh)
    target = abstract_params(Transformer(cfg.model), mesh, rules)
    params = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target))).params
  return params, cfg


def _locate(path: str | Path, step: int | None) -> tuple[Path, int | None]:
  """``(manager root, step or None for the latest)`` of a workdir, checkpoints folder, step folder or export."""
  path = Path(path).absolute()
  if not path.exists():
    raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
  root = _manager_root(path)
  if step is None and path.name.isdigit() and root == path.parent:
    step = int(path.name)
  return root, step


def _step(manager: ocp.CheckpointManager, path: str | Path, step: int | None) -> int:
  step = manager.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"no checkpoint found in {str(path)!r} (expected step folders written by train)")
  return step


def _shapes(tree) -> dict[str, tuple[int, ...]]:
  """``{"blocks/attention/query": shape, ...}`` of a parameter tree (arrays, abstract arrays or Orbax metadata)."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(key, simple=True, separator="/"): tuple(leaf.shape) for key, leaf in leaves}


def parameter_mismatch(stored, target) -> str | None:
  """The first difference between two parameter trees' paths and shapes, in words; None if they match."""
  stored, target = _shapes(stored), _shapes(target)
  for name, shape in target.items():
    if name not in stored:
      return f"parameter {name} {shape} of the new model is missing from the checkpoint"
    if stored[name] != shape:
      return f"parameter {name} has shape {stored[name]} in the checkpoint but {shape} in the new model"
  for name, shape in stored.items():
    if name not in target:
      return f"the checkpoint's parameter {name} {shape} is not in the new model"
  return None


def init_params_from(path: str | Path, target: Any, step: int | None = None, fresh: Any = None) -> Any:
  """Another checkpoint's parameters for a fresh run (``train --init-from``), restored onto ``target``.

  Args:
    path: a train workdir, its ``checkpoints`` folder, a step folder, or an exported model.
    target: the new model's abstract parameters (shape, dtype and sharding), e.g. ``Trainer.abstract_state()``'s;
      stored parameters are cast to its dtypes (an export stores bfloat16).
    step: which step; default: the latest (or the step named by a step-folder path).
    fresh: the new model's initialised parameters: with them, a model may add parameters the checkpoint's network
      lacks, taken from ``fresh``: a continuous model's latent parameters (``model.LATENT_PARAMS``) over a discrete
      checkpoint, a verified model's draft-only MLPs (``model.DRAFT_PARAMS``) over one without.

  Raises:
    ConfigError: the trees differ; the message names the first differing parameter and both shapes.
  """
  root, step = _locate(path, step)
  handlers = {"params": ocp.StandardCheckpointHandler()}
  with ocp.CheckpointManager(root, item_names=("params",), item_handlers=handlers) as manager:
    step = _step(manager, path, step)
    stored = manager.item_metadata(step).params
    flat = traverse_util.flatten_dict(target)
    added = []
    if fresh is not None:
      have = {tuple(name.split("/")) for name in _shapes(stored)}
      added = [key for key in flat if key not in have and (key[0] in LATENT_PARAMS or is_draft_param(key))]
    part = traverse_util.unflatten_dict({key: value for key, value in flat.items() if key not in added})
    mismatch = parameter_mismatch(stored, part)
    if mismatch:
      raise ConfigError(f"--init-from {str(path)!r}: {mismatch}")
    params = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(part))).params
    grown = traverse_util.flatten_dict(params)
    fresh_flat = traverse_util.flatten_dict(fresh) if added else {}
    return traverse_util.unflatten_dict({**grown, **{key: fresh_flat[key] for key in added}})


def export_params(path: str | Path, params: Any, cfg: Config, tokenizer_file: str | Path, step: int = 0) -> Path:
  """Writes an inference checkpoint (``params``, ``config`` and the tokenizer) readable by :func:`restore_params`."""
  root = Path(path).absolute()
  root.mkdir(parents=True, exist_ok=True)
  shutil.copyfile(tokenizer_file, root / TOKENIZER_FILE)
  with ocp.CheckpointManager(
    root, item_names=("params", "config"), options=ocp.CheckpointManagerOptions(create=True)
  ) as manager:
    manager.save(
      step,
      args=ocp.args.Composite(params=ocp.args.StandardSave(params), config=ocp.args.JsonSave(cfg.to_dict())),
      force=True,
    )
    manager.wait_until_finished()
  return root / str(step)


def replace_folder(staging: Path, out: Path) -> None:
  """Puts the finished folder ``staging`` (a sibling of ``out``) at ``out``, replacing what is there: a reader sees the
  old folder or the new one, never a partial one (``export`` and ``convert`` build their output this way)."""
  if out.exists():
    retired = out.with_name(f".{out.name}.old-{os.getpid()}")
    out.rename(retired)
    staging.rename(out)
    shutil.rmtree(retired)
  else:
    staging.rename(out)
