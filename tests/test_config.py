"""Typed configs: presets, overrides, and errors that name the key."""

import dataclasses
import math
import re
import subprocess
import sys

import jax
import pytest

from mercury_jax import sharding as sh
from mercury_jax.config import (
  Config,
  ConfigError,
  MeshConfig,
  config_from_dict,
  load_config,
  parse_set_args,
  preset_names,
)
from mercury_jax.model import Transformer
from mercury_jax.trainer import abstract_params


def test_presets_load_and_hold_only_differences():
  assert {"tiny", "default", "default_ar", "gpu8_125m", "pod64_1b"} <= set(preset_names())
  for name in preset_names():
    cfg = load_config(name)
    assert cfg.name == name
  default = load_config("default").model  # The schema's defaults are the default model.
  assert dataclasses.replace(default, unroll_layers=False) == Config().model


def test_overrides_are_typed():
  cfg = load_config(
    "tiny",
    parse_set_args(
      [
        "model.d_model=96",
        "optim.learning_rate=2e-3",
        "model.causal=true",
        "objective.name=autoregressive",
        "mesh.rules=vocab=,mlp=fsdp",
      ]
    ),
  )
  assert cfg.model.d_model == 96 and isinstance(cfg.model.d_model, int)
  assert cfg.optim.learning_rate == 2e-3
  assert cfg.model.causal is True
  assert cfg.mesh.rules == ("vocab=", "mlp=fsdp")
  assert config_from_dict(cfg.to_dict()) == cfg


def test_checkpoints_from_before_the_objective_section_still_load():
  stored = load_config("default_ar").to_dict()
  objective = stored.pop("objective")
  stored["diffusion"] = {**{k: v for k, v in objective.items() if k != "name"}, "objective": "autoregressive"}
  assert config_from_dict(stored) == load_config("default_ar")
  stored["diffusion"]["objective"] = "diffusion"
  stored["model"]["causal"] = False
  assert config_from_dict(stored).objective.name == "masked_diffusion"


@pytest.mark.parametrize(
  "item, fragment",
  [
    ("model.d_modle=3", "model.d_modle"),
    ("modle.d_model=3", "modle.d_model"),
    ("model.d_model=abc", "model.d_model='abc' is not an integer"),
    ("model.dtype=float64", "model.dtype='float64' is not one of"),
    ("objective.schedule=sqrt", "objective.schedule"),
    ("model.causal=maybe", "model.causal"),
    ("model.num_kv_heads=3", "model.num_heads=4 must be a multiple of model.num_kv_heads=3"),
    ("train.steps=0", "train.steps=0"),
    # t = 0 gives the ELBO weight -alpha'/(1 - alpha) = inf, and inf * 0 = NaN for unmasked positions.
    ("objective.t_min=0", "objective.t_min=0.0 must lie in (0, 1)"),
    ("objective.t_min=1", "objective.t_min=1.0 must lie in (0, 1)"),
    ("objective.block_size=-4", "objective.block_size=-4 must be >= 0"),
    ("objective.block_size=3", "model.max_length=256 must be a multiple of objective.block_size=3"),
    ("objective.mask_rate_min=-0.1", "objective.mask_rate_min=-0.1 and objective.mask_rate_max=1.0 must satisfy"),
    ("objective.mask_rate_max=1.5", "0 <= mask_rate_min < mask_rate_max <= 1"),
    ("objective.mask_rate_max=0", "objective.mask_rate_min=0.0 and objective.mask_rate_max=0.0 must satisfy"),
  ],
)
def test_bad_overrides_name_the_key(item, fragment):
  with pytest.raises(ConfigError, match=None) as err:
    load_config("tiny", parse_set_args([item]))
  assert fragment in str(err.value)


@pytest.mark.parametrize(
  "items, fragment",
  [
    (
      ["objective.name=autoregressive", "model.causal=true"],
      "objective.block_size=4 needs objective.name='masked_diffusion' or 'continuous' (got 'autoregressive')",
    ),
    (["model.causal=true"], "objective.block_size=4 needs a bidirectional model (model.causal=false)"),
    (["model.time_conditioning=true"], "objective.block_size=4 draws one t per block"),
    (["model.max_length=30"], "model.max_length=30 must be a multiple of objective.block_size=4"),
    (
      ["objective.mask_rate_min=0.8", "objective.mask_rate_max=0.3"],
      "mask_rate_min=0.8 and objective.mask_rate_max=0.3",
    ),
  ],
)
def test_block_diffusion_and_clip_settings_that_cannot_work_are_config_errors(items, fragment):
  with pytest.raises(ConfigError) as err:
    load_config("tiny_bd", parse_set_args(items))
  assert fragment in str(err.value)


def test_block_diffusion_preset_and_clip_load():
  cfg = load_config("tiny_bd", parse_set_args(["objective.mask_rate_min=0.3", "objective.mask_rate_max=0.8"]))
  assert (cfg.objective.block_size, cfg.objective.mask_rate_min, cfg.objective.mask_rate_max) == (4, 0.3, 0.8)
  assert dataclasses.replace(cfg.objective, block_size=0, mask_rate_min=0.0, mask_rate_max=1.0) == (
    load_config("tiny").objective
  )
  assert config_from_dict(cfg.to_dict()) == cfg


def test_bad_preset_and_set_syntax(tmp_path):
  with pytest.raises(ConfigError, match="neither a file nor a preset"):
    load_config("no_such_preset")
  with pytest.raises(ConfigError, match="section.key=value"):
    parse_set_args(["model.d_model"])
  bad = tmp_path / "bad.toml"
  bad.write_text("[model]\nwidth = 3\n")
  with pytest.raises(ConfigError, match="model.width"):
    load_config(str(bad))


def test_mesh_is_validated_against_device_count():
  assert sh.mesh_shape(MeshConfig(data=-1, fsdp=2, tensor=2), 8) == (2, 2, 1, 2)  # (data, fsdp, sequence, tensor)
  assert sh.mesh_shape(MeshConfig(data=1, sequence=-1, tensor=2), 8) == (1, 1, 4, 2)
  with pytest.raises(ConfigError, match="needs 12 devices but 8 are available"):
    sh.mesh_shape(MeshConfig(data=3, fsdp=2, tensor=2), 8)
  with pytest.raises(ConfigError, match="does not divide"):
    sh.mesh_shape(MeshConfig(data=-1, fsdp=3), 8)
  with pytest.raises(ConfigError, match="mesh.rules entry"):
    sh.axis_rules(MeshConfig(rules=("vocab=model",)))


def test_cli_reports_config_errors_with_exit_code_2(tmp_path):
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "mercury_jax.train",
      "--config",
      "tiny",
      "--workdir",
      str(tmp_path),
      "--set",
      "model.d_modle=3",
    ],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # One line, no traceback.
  assert "model.d_modle" in proc.stderr


SMALL_PRESETS = (
  "tiny",
  "tiny_bd",
  "tiny_verified",
  "tiny_continuous",
  "tiny_retrieval",
  "tiny_retrieval_8k",
  "default_continuous",
  "default",
  "default_ar",
  "verified",
  "v4_chat",
  "v4_chat_ar",
  "v4_distill",
  "v4_distill_ar",
  "v4_draft",
)  # data = -1: compiled on the test's 8 devices as (2, 2, 2).
# Presets that continue another's training: the same model, objective and mesh, so the same train step but for the
# schedule's constants (learning rate, warmup, steps); compiled as the preset they continue (checked below).
CONTINUING_PRESETS = {"default_ar_continued": "default_ar"}
# Compiled on their own mesh size: (devices, parameters).
ACCELERATOR_PRESETS = {
  "gpu8_125m": (8, 135e6),
  "gpu8_125m_32k": (8, 135e6),
  "pod64_1b": (64, 0.98e9),
  "pod64_1b_128k": (64, 0.98e9),
}
LONG_PRESETS = ("gpu8_125m_32k", "pod64_1b_128k")  # Their step must fit a 16 GiB accelerator (TPU v5e) per device.
# What GSPMD logs when it must replicate a tensor because two sharding annotations disagree.
REMATERIALIZATION = "Involuntary full rematerialization"


def test_every_shipped_preset_is_compile_checked():
  assert set(preset_names()) == {*SMALL_PRESETS, *CONTINUING_PRESETS, *ACCELERATOR_PRESETS}
  for name, continued in CONTINUING_PRESETS.items():
    cfg, base = load_config(name), load_config(continued)
    differs = {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(base, f.name)}
    assert differs <= {"name", "optim", "train", "checkpoint", "data"}, (name, differs)
    assert dataclasses.replace(cfg.data, shuffle_seed=base.data.shuffle_seed) == base.data  # the data's order only


@pytest.mark.parametrize("name", SMALL_PRESETS)
def test_small_presets_compile_on_eight_devices(name, capfd):
  from mercury_jax.aot import compile_report

  cfg = load_config(name, {"mesh.data": "2", "mesh.fsdp": "2", "mesh.tensor": "2", "data.batch_size": "8"})
  capfd.readouterr()
  report = compile_report(cfg)
  assert report["devices"] == 8
  assert REMATERIALIZATION not in capfd.readouterr().err


@pytest.mark.parametrize("name", ACCELERATOR_PRESETS)
def test_accelerator_presets_compile_ahead_of_time_on_their_mesh(name, capfd):
  """``python -m mercury_jax.aot --config NAME``; a preset of this process's 8 devices runs its ``main`` here instead
  (the command sets the device count only in a process that has not loaded JAX), saving a process start."""
  from mercury_jax import aot

  devices, params = ACCELERATOR_PRESETS[name]
  if devices == jax.device_count():
    capfd.readouterr()
    aot.main(["--config", name])
    stdout, stderr = capfd.readouterr()
  else:
    proc = subprocess.run(
      [sys.executable, "-m", "mercury_jax.aot", "--config", name], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    stdout, stderr = proc.stdout, proc.stderr
  assert f"compiled the train step on {devices} devices" in stdout
  assert REMATERIALIZATION not in stderr, stderr[-2000:]
  if name in LONG_PRESETS:
    used = sum(float(re.search(rf"{what}_bytes_per_device: ([\d.]+) GiB", stdout)[1]) for what in ("argument", "temp"))
    assert used < 16, stdout
  cfg = load_config(name)
  mesh = sh.make_mesh(MeshConfig(data=1), jax.devices()[:1])
  n = sum(math.prod(p.shape) for p in jax.tree.leaves(abstract_params(Transformer(cfg.model), mesh, sh.RULES)))
  assert abs(n - params) / params < 0.05
