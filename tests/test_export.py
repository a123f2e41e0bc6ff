"""``python -m mercury_jax.export``: bfloat16 storage, bundled manifest and card, never a half-written folder."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from mercury_jax.checkpoint import export_params, restore_params
from mercury_jax.config import Config, DataConfig, ModelConfig
from mercury_jax.export import export, folder_bytes, main
from mercury_jax.model import Transformer
from mercury_jax.sampling.sampler import Sampler


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_dir) -> dict:
  """A float32 checkpoint of a small model (random params), a prepared-data folder and a model card."""
  root = tmp_path_factory.mktemp("export")
  shutil.copyfile(data_dir / "tokenizer.model", root / "tokenizer.model")  # 400 pieces.
  model_cfg = ModelConfig(
    vocab_size=400, d_model=64, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=32, mlp_dim=128, max_length=32
  )
  params = nn.meta.unbox(Transformer(model_cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
  data_cfg = DataConfig(path=str(root / "data"), mix=(f"{root / 'chat'}@0.5", f"{root / 'tools'}@0.25"))
  cfg = Config(model=model_cfg, data=data_cfg, name="export-test")
  export_params(root / "run", params, cfg, root / "tokenizer.model", step=7)
  data = root / "data"
  data.mkdir()
  (data / "manifest.json").write_text(json.dumps({"kind": "fixture", "root": "/home/someone/corpus", "files": []}))
  (root / "card.md").write_text("# a card\n")
  return {"root": root, "checkpoint": root / "run", "params": params, "data": data, "card": root / "card.md"}


def test_bfloat16_export_halves_the_size_and_restores_as_float32(run, tmp_path):
  f32 = export(run["checkpoint"], tmp_path / "f32", dtype="float32")
  bf16 = export(run["checkpoint"], tmp_path / "bf16", dtype="bfloat16", data=run["data"], card=run["card"])
  assert folder_bytes(bf16) < 0.65 * folder_bytes(f32)
  restored, cfg = restore_params(bf16)
  assert cfg.name == "export-test" and cfg.data.path == "data" and cfg.data.mix == ("chat@0.5", "tools@0.25")
  for path in (p for p in bf16.rglob("*") if p.is_file()):  # No absolute path of this machine is shipped.
    assert str(run["root"]).encode() not in path.read_bytes() and str(tmp_path).encode() not in path.read_bytes()
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(run["params"]), strict=True):
    assert got.dtype == jnp.float32  # Cast back to the model's param_dtype.
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(jnp.bfloat16).astype(jnp.float32)))
  manifest = json.loads((bf16 / "manifest.json").read_text())
  assert manifest["kind"] == "fixture" and manifest["root"] == "corpus"  # No machine's absolute path is shipped.
  assert (bf16 / "MODEL_CARD.md").read_text() == "# a card\n"
  sampler = Sampler.from_checkpoint(bf16)  # The exported folder is a complete inference checkpoint.
  assert 1 <= len(sampler.generate(["def"], length=4, steps=2, seed=0)[0].tokens) <= 4


@pytest.mark.parametrize(
  "corpus,shipped",
  [
    ("/home/someone/src/**/*.py", "*.py"),
    (["python-stdlib", "site-packages:numpy"], ["python-stdlib", "site-packages:numpy"]),
  ],
)
def test_the_data_metadata_ships_without_machine_paths(run, tmp_path, corpus, shipped):
  """``bench`` reads a bundle's corpus from its metadata.json: named corpora as they are, paths cut to their names."""
  data = tmp_path / "data"
  shutil.copytree(run["data"], data)
  (data / "metadata.json").write_text(json.dumps({"corpus": corpus, "seq_len": 32}))
  out = export(run["checkpoint"], tmp_path / "out", data=data)
  assert json.loads((out / "metadata.json").read_text()) == {"corpus": shipped, "seq_len": 32}


def test_existing_folder_is_replaced_only_with_force_and_keeps_its_card(run, tmp_path):
  out = export(run["checkpoint"], tmp_path / "out", card=run["card"])
  with pytest.raises(ValueError, match="not empty"):
    export(run["checkpoint"], out)
  assert (out / "MODEL_CARD.md").is_file()
  export(run["checkpoint"], out, force=True, dtype="float32")
  assert (out / "MODEL_CARD.md").read_text() == "# a card\n"
  assert jax.tree.leaves(restore_params(out)[0])[0].dtype == jnp.float32
  assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # No staging or retired folder left behind.


def test_failed_export_leaves_the_existing_folder_intact(run, tmp_path, monkeypatch):
  out = export(run["checkpoint"], tmp_path / "out", card=run["card"])
  before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))

  def broken(*args, **kwargs):
    raise OSError("disk full")

  monkeypatch.setattr("mercury_jax.checkpoint.export_params", broken)
  with pytest.raises(OSError, match="disk full"):
    export(run["checkpoint"], out, force=True)
  assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
  assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
  restore_params(out)


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--checkpoint", "/no/such/run", "--out", "{tmp}/x"], "does not exist"),
    (["--checkpoint", "{run}", "--out", "{tmp}/x", "--data", "{tmp}"], "no manifest.json"),
    (["--checkpoint", "{run}", "--out", "{tmp}/x", "--card", "/no/card.md"], "model card"),
    (["--checkpoint", "{tmp}", "--out", "{tmp}/x"], "tokenizer.model"),
  ],
)
def test_bad_input_is_one_line_and_exit_code_2(argv, message, run, tmp_path, capsys):
  argv = [a.replace("{run}", str(run["checkpoint"])).replace("{tmp}", str(tmp_path)) for a in argv]
  assert main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert "\n" not in err and err.startswith("mercury_jax.export: error: ") and message in err, err
  assert not (tmp_path / "x").exists()
