"""``python -m mercury_jax.aot --sample``: public models' configs, parameters split over fsdp x tensor, bad input.

Every compilation here is of a tiny shape (the shipped 8 B configs are only read and mapped, never compiled).
"""

import functools
import json
import math

import flax.linen as nn
import jax
import pytest

from mercury_jax import aot
from mercury_jax.checkpoint import export_params
from mercury_jax.config import MeshConfig
from mercury_jax.convert import config_from_hf
from mercury_jax.model import Transformer, init_params

# LLaDA's layout (whole-sequence, semi-autoregressive blocks of 32 by its [sampling] defaults) and SDAR's (Qwen3,
# block-causal 4: the exact cache), scaled down.
TINY_LLADA = {
  "model_type": "llada", "d_model": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "mlp_hidden_size": 512,
  "vocab_size": 1024, "embedding_size": 1024, "max_sequence_length": 256, "rope_theta": 500000.0,
  "mask_token_id": 1000,
}  # fmt: skip
TINY_SDAR = {
  "model_type": "sdar", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "head_dim": 32, "intermediate_size": 512, "vocab_size": 1024, "max_position_embeddings": 256, "block_size": 4,
  "mask_token_id": 1000,
}  # fmt: skip
MESH = MeshConfig(data=1, fsdp=4, tensor=2)


@pytest.mark.parametrize(
  ("family", "size", "d_model", "layers", "shifted", "block"),
  [
    ("llada", None, 4096, 32, False, 0),
    ("dream", "7b", 3584, 28, True, 0),
    ("sdar", "8b", 4096, 36, False, 4),
    ("sdar", "4B", 2560, 36, False, 4),
    ("fast_dllm_v2", None, 3584, 28, True, 32),
  ],
)
def test_shipped_public_configs_map_to_the_families_shapes(family, size, d_model, layers, shifted, block):
  cfg = config_from_hf(json.loads(aot.public_config_file(family, size).read_text()), family)
  assert (cfg.name, cfg.model.d_model, cfg.model.num_layers) == (family, d_model, layers)
  assert (cfg.model.shifted_logits, cfg.objective.block_size) == (shifted, block)
  assert cfg.model.param_dtype == cfg.model.dtype == "bfloat16"


@pytest.mark.parametrize("hf", [TINY_LLADA, TINY_SDAR], ids=["llada", "sdar"])
def test_sampling_program_holds_an_eighth_of_the_parameters_per_device(hf):
  cfg = config_from_hf(hf)
  report = aot.sample_report(cfg, MESH, batch=1, length=96)
  assert report["devices"] == 8 and report["rows"] == 4  # batch 1 padded to the data-parallel size (fsdp)
  # Every parameter is split over fsdp and tensor but the norm scales (fsdp only) and biases; the loop state the
  # prefill hands the loop (the block's logits above all) is split over the rows (fsdp) but its batch counters, and
  # SDAR's cache over its key-value heads too: a device's share of the loop's arguments is an eighth of the parameters
  # and at most a quarter of the state.
  eighth = report["param_bytes"] / 8
  assert eighth <= report["param_bytes_per_device"] < 1.05 * eighth
  quarter = report["state_bytes"] / 4
  assert 0 < report["state_bytes_per_device"] < quarter + 64
  per_device = report["param_bytes_per_device"] + report["state_bytes_per_device"]
  assert report["argument"] == pytest.approx(per_device, abs=64)
  assert report["total"] >= report["argument"] + report["temp"]
  expected = "cache=exact block=4" if hf is TINY_SDAR else "cache=none block=32"
  assert report["decoder"] == expected


def test_abstract_parameters_split_over_both_axes():
  from mercury_jax import sharding as sh
  from mercury_jax.model import abstract_params

  cfg = config_from_hf(TINY_LLADA)
  params = abstract_params(Transformer(cfg.model), sh.make_mesh(MESH), sh.RULES)
  query = params["blocks"]["attention"]["query"]  # [layers, embed, heads, head_dim]
  assert query.sharding.spec[1:3] == ("fsdp", "tensor")
  assert query.sharding.shard_shape(query.shape) == (2, 128 // 4, 4 // 2, 32)


def test_cli_reads_a_converted_checkpoint_without_its_weights(tmp_path, capsys):
  cfg = config_from_hf(TINY_LLADA)
  params = nn.meta.unbox(jax.jit(functools.partial(init_params, Transformer(cfg.model)))(jax.random.key(0)))
  (tmp_path / "tok").write_bytes(b"not read")
  export_params(tmp_path / "model", params, cfg, tmp_path / "tok")
  aot.main(["--sample", "--checkpoint", str(tmp_path / "model"), "--batch", "2", "--length", "64"])
  out = capsys.readouterr().out
  assert "bfloat16 parameters" in out and "cache=none block=32" in out
  row = out.splitlines()[2].split()  # the header line, the column names, the row
  assert row[:5] == ["llada", f"{sum(math.prod(p.shape) for p in jax.tree.leaves(params)) / 1e9:.2f}", "2", "4", "64"]


@pytest.mark.parametrize(
  ("argv", "message"),
  [
    (["--family", "gpt"], "--family 'gpt' is unknown"),
    (["--family", "sdar", "--size", "70b"], "--size '70b' is not shipped for family sdar; sizes: 8b, 4b"),
    (["--size", "8b"], "--size '8b' needs --family"),
    (["--hf-config", "/nonexistent/config.json"], "no such file"),
    (["--checkpoint", "/nonexistent"], "no such folder"),
    (["--family", "llada", "--mesh", "fsdp=four"], "must be axis=size pairs"),
    (["--family", "llada", "--batch", "0"], "--batch '0' must be comma-separated positive integers"),
    (["--family", "llada", "--length", "5000"], "--length 5000 must lie in [1, 4096]"),
    (["--family", "sdar", "--cache", "dual"], "--cache='dual' is the approximate cache"),
    ([], "--sample needs exactly one of --checkpoint DIR, --hf-config PATH, --family NAME, --config NAME"),
  ],
)
def test_bad_input_is_one_line_and_exit_status_2(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    aot.main(["--sample", *argv])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err.strip()
  assert message in err and "\n" not in err


def test_a_mesh_that_does_not_divide_the_kv_heads_exits_2(tmp_path, capsys):
  path = tmp_path / "config.json"
  path.write_text(json.dumps(TINY_SDAR))  # 2 key-value heads
  with pytest.raises(SystemExit) as exit_info:
    aot.main(["--sample", "--hf-config", str(path), "--mesh", "data=1,fsdp=2,tensor=4", "--length", "64"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err.strip()
  assert "parameter blocks/attention/key has 2 along dimension 2, which tensor=4 does not divide" in err
