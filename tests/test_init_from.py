"""``train --init-from``: another checkpoint's parameters start a fresh run; a mismatch is one line and exit code 2;
a workdir's own checkpoint takes precedence."""

from pathlib import Path

import jax
import numpy as np
import pytest
from flax import traverse_util

from mercury_jax import sharding as sh
from mercury_jax.checkpoint import Checkpointer, export_params, init_params_from, restore_params
from mercury_jax.config import CheckpointConfig, ConfigError, MeshConfig, load_config
from mercury_jax.model import LATENT_PARAMS, is_draft_param
from mercury_jax.train import main, train
from mercury_jax.trainer import Trainer

ASSETS = Path(__file__).parent.parent / "mercury_jax" / "assets"
TINY = {"model.max_length": "64", "model.vocab_size": "400", "train.eval_every": "0", "checkpoint.async_save": "false"}


def _exported_tiny(tmp_path: Path, data_dir: Path, preset: str = "tiny", **overrides: str) -> tuple[Path, object]:
  """A tiny model's fresh parameters exported as an inference checkpoint (seed 7, not the trainer's 0)."""
  cfg = load_config(preset, {**TINY, "data.path": str(data_dir), **overrides})
  trainer = Trainer(cfg, sh.make_mesh(MeshConfig(data=1), jax.devices()[:1]))
  params = trainer.init_state(7)["params"]
  export_params(tmp_path / "source", params, cfg, data_dir / "tokenizer.model")
  return tmp_path / "source", jax.tree.map(np.asarray, params)


def test_bundled_twin_initialises_the_verified_model_exactly():
  """The shipped recipe: the verified model (bidirectional, same shapes) from the exported twin, at step 0."""
  cfg = load_config("verified")
  trainer = Trainer(cfg, sh.make_mesh(MeshConfig(data=1), jax.devices()[:1]))
  state = trainer.init_state(cfg.train.seed)
  state["params"] = init_params_from(ASSETS / "default_ar", trainer.abstract_state()["params"])
  source, _ = restore_params(ASSETS / "default_ar")
  for got, want in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(source), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert int(state["step"]) == 0
  assert all(not np.asarray(x).any() for x in jax.tree.leaves(state["opt_state"]))  # Fresh moments and counts.


def test_mismatched_shapes_fail_with_one_line_and_exit_code_2(tmp_path, data_dir, capsys):
  source, _ = _exported_tiny(tmp_path, data_dir, **{"model.mlp_dim": "128"})
  argv = ["--config", "tiny", "--workdir", str(tmp_path / "run"), "--init-from", str(source)]
  argv += [a for key, value in {**TINY, "data.path": str(data_dir)}.items() for a in ("--set", f"{key}={value}")]
  with pytest.raises(SystemExit) as exit_info:
    main(argv)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "Traceback" not in err
  assert "parameter blocks/mlp/down has shape (2, 128, 64) in the checkpoint but (2, 192, 64) in the new model" in err


def test_init_applies_to_a_fresh_run_only(tmp_path, data_dir):
  """Step 0 holds the source's parameters; a rerun resumes the workdir's checkpoint, ignoring --init-from."""
  source, params = _exported_tiny(tmp_path, data_dir)
  sets = {**TINY, "data.path": str(data_dir), "train.steps": "1", "checkpoint.every": "1"}
  # Zero learning rate through the whole (one-step) schedule: the saved step 1 still holds the initial parameters.
  cfg = load_config("tiny", {**sets, "optim.learning_rate": "1e-30", "optim.weight_decay": "0"})
  train(cfg, tmp_path / "run", log=False, init_from=source, devices=jax.devices()[:1])  # No sharding under test.
  saved, _ = restore_params(tmp_path / "run")
  for got, want in zip(jax.tree.leaves(saved), jax.tree.leaves(params), strict=True):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-30)
  mismatched, _ = _exported_tiny(tmp_path / "other", data_dir, **{"model.d_model": "32", "model.mlp_dim": "96"})
  resumed = load_config("tiny", {**sets, "train.steps": "2", "optim.learning_rate": "1e-30"})
  # Resumes; the mismatch is never read.
  train(resumed, tmp_path / "run", log=False, init_from=mismatched, devices=jax.devices()[:1])
  assert Checkpointer(tmp_path / "run" / "checkpoints", CheckpointConfig()).latest_step() == 2


def test_a_continuous_model_starts_from_a_discrete_one_with_fresh_latent_parameters(tmp_path, data_dir):
  """A continuous model grown from a discrete one (``train --init-from``), at tiny size: every shared parameter is the
  source's, the latent path is the new model's own initialisation; a discrete model asked to grow anything else still
  fails naming the parameter."""
  source, params = _exported_tiny(tmp_path, data_dir)
  cfg = load_config("tiny_continuous", {**TINY, "data.path": str(data_dir)})
  trainer = Trainer(cfg, sh.make_mesh(MeshConfig(data=1), jax.devices()[:1]))
  fresh = trainer.init_state(0)["params"]
  grown = init_params_from(source, trainer.abstract_state()["params"], fresh=fresh)
  assert set(grown) == set(fresh) and set(grown) - set(params) == set(LATENT_PARAMS)
  for name in params:
    for got, want in zip(jax.tree.leaves(grown[name]), jax.tree.leaves(params[name]), strict=True):
      np.testing.assert_array_equal(np.asarray(got), want)
  for name in LATENT_PARAMS:
    np.testing.assert_array_equal(np.asarray(grown[name]), np.asarray(fresh[name]))
  with pytest.raises(ConfigError, match=r"parameter (latent|noise|self_cond)\w* .* is missing from the checkpoint"):
    init_params_from(source, trainer.abstract_state()["params"])  # without fresh parameters: nothing may be new


def test_a_drafter_grown_on_a_verified_model_trains_alone(tmp_path, data_dir):
  """``model.draft_mlp`` over a checkpoint without it, ``train.trainable='draft'``: after training steps (weight
  decay on) every parameter of the source is bitwise the source's; the draft-only MLPs have moved from their zero
  start."""
  source, params = _exported_tiny(tmp_path, data_dir, "tiny_verified")
  sets = {**TINY, "data.path": str(data_dir), "train.steps": "2", "checkpoint.every": "2", "optim.warmup_steps": "0"}
  cfg = load_config("tiny_verified", {**sets, "model.draft_mlp": "16", "train.trainable": "draft"})
  train(cfg, tmp_path / "run", log=False, init_from=source, devices=jax.devices()[:1])
  saved, _ = restore_params(tmp_path / "run")
  flat, source_flat = traverse_util.flatten_dict(saved), traverse_util.flatten_dict(params)
  assert set(flat) - set(source_flat) == {key for key in flat if is_draft_param(key)} != set()
  for key, want in source_flat.items():
    np.testing.assert_array_equal(np.asarray(flat[key]), want, err_msg=str(key))
  assert np.asarray(saved["blocks"]["draft_mlp"]["down"]).any()
