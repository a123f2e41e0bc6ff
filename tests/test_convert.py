"""The converter (mercury_jax.convert): tiny random checkpoints of every family, written by transformers in the
family's file format (tests/hf_reference.py), convert to checkpoints whose logits equal the reference forward's; a
plain causal model converts as the autoregressive model it is."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import hf_reference as ref
import numpy as np
import pytest

from mercury_jax.checkpoint import restore_params
from mercury_jax.convert import ConvertError, config_from_hf, convert
from mercury_jax.convert.__main__ import main
from mercury_jax.data.hf_tokenizer import HFTokenizer
from mercury_jax.model import Transformer
from mercury_jax.sampling.network import Network
from mercury_jax.sampling.sampler import Sampler

# family -> (build options, the tokenizer text of its mask, trained block, shifted logits)
FAMILIES = {
  "llada": ({}, "<|mdm_mask|>", 0, False),  # bfloat16 storage, single file
  "dream": ({"shard_size": "100KB"}, "<|mask|>", 0, True),  # sharded
  "sdar": ({"tied": True}, "<|MASK|>", 4, False),  # tied embeddings, qk-norm
  "fast_dllm_v2": ({}, "|<MASK>|", 8, True),  # mask id from the tokenizer
}
TOKENS = np.random.default_rng(0).integers(0, 290, (2, 16))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
  """family -> (source folder, torch reference model, special ids), built once per module on first use."""
  root, built = tmp_path_factory.mktemp("hf"), {}

  def get(family: str):
    if family not in built:
      folder = root / family
      built[family] = (folder, *ref.build(folder, family, **FAMILIES.get(family, ({},))[0]))
    return built[family]

  return get


def _logits(params, cfg, mask: str, block: int | None = None) -> np.ndarray:
  return np.asarray(Transformer(cfg.model).apply({"params": params}, TOKENS, mask=mask, diffusion_block=block))


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_logits_equal_the_reference_forward(family, sources, tmp_path):
  src, model, ids = sources(family)
  _, mask_text, block, shifted = FAMILIES[family]
  params, cfg = restore_params(convert(src, tmp_path / "out", dtype="float32"))
  assert (cfg.name, cfg.objective.mask_id, cfg.objective.block_size) == (family, ids[mask_text], block)
  assert cfg.model.shifted_logits == shifted and cfg.model.vocab_size == ref.VOCAB
  for mask in ("causal", "bidirectional"):
    expected = ref.reference_logits(model, TOKENS, mask)
    np.testing.assert_allclose(_logits(params, cfg, mask), expected, atol=1e-4, rtol=1e-5, err_msg=mask)
  if block:
    expected = ref.reference_logits(model, TOKENS, "block_causal", block)
    np.testing.assert_allclose(_logits(params, cfg, "block_causal", block), expected, atol=1e-4, rtol=1e-5)
  # The engine's reading: position i's distribution is the reference's output at i - 1 for a shifted family.
  bidirectional = ref.reference_logits(model, TOKENS, "bidirectional")
  read = np.asarray(Network(cfg.model).logits(params, TOKENS, segments=None, positions=None, mask="bidirectional"))
  want = np.concatenate([bidirectional[:, :1], bidirectional[:, :-1]], axis=1) if shifted else bidirectional
  np.testing.assert_allclose(read, want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("layout", ref.PLAIN)
def test_a_plain_causal_model_converts_as_autoregressive_with_the_reference_logits(layout, sources, tmp_path):
  src, model, ids = sources(layout)
  params, cfg = restore_params(convert(src, tmp_path / "out", "autoregressive", "float32"))
  assert (cfg.name, cfg.objective.name, cfg.objective.block_size) == ("autoregressive", "autoregressive", 0)
  assert cfg.model.causal and not cfg.model.shifted_logits and cfg.model.qk_norm == (layout == "qwen3")
  # The mask placeholder is the first embedding row after the tokenizer's ids: no text, never proposed.
  pieces = len(json.loads((src / "tokenizer.json").read_text())["model"]["vocab"])
  assert cfg.objective.mask_id == pieces < ref.VOCAB and ids["<|im_end|>"] < pieces
  expected = ref.reference_logits(model, TOKENS, "causal")
  got = np.asarray(Transformer(cfg.model).apply({"params": params}, TOKENS))  # A causal model's default mask.
  np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-5)


def test_a_converted_autoregressive_model_decodes_greedily_as_its_reference(sources, tmp_path):
  """Through ``Sampler.from_checkpoint`` (what ``sample`` and ``serve`` load): token by token, the reference network's
  argmax over the ids the engine proposes (no mask, BOS or ids past the tokenizer; stop ids merged into EOS)."""
  src, model, _ = sources("qwen2")
  out = convert(src, tmp_path / "out", "autoregressive", "float32")
  sampler = Sampler.from_checkpoint(out)
  assert sampler.autoregressive and sampler.cfg.sampling.temperature == 0.0  # No do_sample: greedy by default.
  tok, special = sampler.tokenizer, json.loads((out / "special_tokens.json").read_text())
  prompt = tok.encode("def add(a, b):")
  want: list[int] = []
  while len(want) < 12 and special["eos_id"] not in want:
    logits = ref.reference_logits(model, np.array([prompt + want]), "causal")[0, -1].astype(np.float64)
    stops = special["stop_ids"]
    logits[special["eos_id"]] = np.logaddexp.reduce(logits[[special["eos_id"], *stops]])
    logits[[special["mask_id"], special["bos_id"], *stops]] = -np.inf
    logits[tok.vocab_size :] = -np.inf
    want.append(int(logits.argmax()))
  got = sampler.generate("def add(a, b):", length=12, token_healing=False, eos_to_pad=False)[0].tokens
  assert got[: len(want)] == want


def test_cli_writes_a_bfloat16_checkpoint_with_tokenizer_files_and_defaults(sources, tmp_path, capsys):
  src, model, ids = sources("dream")
  out = tmp_path / "models" / "dream"
  assert main(["--from", str(src), "--out", str(out)]) == 0
  assert "converted" in capsys.readouterr().out
  params, cfg = restore_params(out)
  assert cfg.model.param_dtype == "bfloat16" and str(params["embedding"].dtype) == "bfloat16"
  expected = ref.reference_logits(model, TOKENS, "bidirectional")
  got = _logits(params, cfg, "bidirectional")
  assert np.abs(got - expected).max() < 0.05 * np.abs(expected).max()
  assert np.mean(got.argmax(-1) == expected.argmax(-1)) > 0.9

  special = json.loads((out / "special_tokens.json").read_text())
  assert set(special) == {"bos_id", "eos_id", "pad_id", "unk_id", "mask_id", "stop_ids", "add_bos"}
  eos = ids["<|endoftext|>"]
  assert special | {"unk_id": None} == {
    "bos_id": ids["<|startoftext|>"], "eos_id": eos, "pad_id": eos, "unk_id": None, "mask_id": ids["<|mask|>"],
    "stop_ids": [ids["<|im_end|>"]], "add_bos": False,
  }  # fmt: skip
  assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
  assert cfg.data.chat_template == ref.CHAT_TEMPLATE
  tokenizer = HFTokenizer.load(out)
  assert tokenizer.mask_id == ids["<|mask|>"]
  assert tokenizer.decode(tokenizer.encode("def add(a, b):")) == "def add(a, b):"
  s = cfg.sampling
  assert (s.rule, s.confidence, s.temperature, s.top_p) == ("confidence", "entropy", 0.2, 0.95)
  card = (out / "MODEL_CARD.md").read_text()
  assert "Dream" in card and s.source in card
  assert not list(out.rglob("commit_success.txt"))  # Orbax's marker names the staging folder's absolute path.


def test_config_from_hf_maps_the_full_size_configs():
  import functools

  import jax

  from mercury_jax.model import count_params, init_params

  llada = {
    "model_type": "llada", "d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 32, "mlp_hidden_size": 12288,
    "vocab_size": 126464, "embedding_size": 126464, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "weight_tying": False, "include_qkv_bias": False, "max_sequence_length": 4096, "mask_token_id": 126336,
  }  # fmt: skip
  cfg = config_from_hf(llada, "auto")
  shapes = jax.eval_shape(functools.partial(init_params, Transformer(cfg.model)), jax.random.key(0))
  assert 8.0e9 < count_params(shapes) < 8.1e9  # LLaDA-8B
  assert (cfg.objective.mask_id, cfg.objective.block_size, cfg.model.param_dtype) == (126336, 0, "bfloat16")
  assert (cfg.sampling.rule, cfg.sampling.block_length, cfg.sampling.temperature) == ("confidence", 32, 0.0)
  qwen = dict(
    hidden_size=3584,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    intermediate_size=18944,
    vocab_size=152064,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    max_position_embeddings=131072,
  )
  diffucoder = config_from_hf({"model_type": "Dream", "mask_token_id": 151666, **qwen}, "auto").model
  assert diffucoder.shifted_logits and diffucoder.qkv_bias and diffucoder.head_dim == 128
  assert diffucoder.max_length == 4096 and not diffucoder.scale_tied_logits
  sdar = config_from_hf({**qwen, "model_type": "sdar", "head_dim": 128, "block_size": 4, "vocab_size": 151936}, "auto")
  assert sdar.model.qk_norm and not sdar.model.qkv_bias and sdar.objective.block_size == 4
  assert sdar.objective.mask_id == 151669  # The family's id when config.json has none.
  fast = config_from_hf({**qwen, "model_type": "Fast_dLLM_Qwen", "bd_size": 32}, "auto")
  assert fast.objective.block_size == 32 and fast.model.shifted_logits and fast.sampling.threshold == 0.9
  yarn = {**qwen, "model_type": "Dream", "rope_scaling": {"type": "yarn", "factor": 4.0}}
  model = config_from_hf(yarn, "auto").model
  assert (model.rope_scaling, model.rope_factor, model.rope_original_length) == ("yarn", 4.0, 131072)
  with pytest.raises(ConvertError, match="pass --family autoregressive to convert the model as it is, or a diffusion"):
    config_from_hf({**qwen, "model_type": "qwen2"}, "auto")
  assert config_from_hf({**qwen, "model_type": "qwen2"}, "dream").model.shifted_logits
  with pytest.raises(ConvertError, match="'Dream' is a Dream diffusion model"):
    config_from_hf({**qwen, "model_type": "Dream"}, "autoregressive")
  # A plain model's decoding defaults are its generation_config.json, as transformers' generate reads it.
  sampling = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
  qwen_ar = config_from_hf({**qwen, "model_type": "qwen2"}, "autoregressive", generation=sampling)
  assert qwen_ar.model.causal and qwen_ar.objective.autoregressive and qwen_ar.objective.mask_id < 152064
  s = qwen_ar.sampling
  assert (s.temperature, s.top_p, s.top_k) == (0.7, 0.8, 20) and "repetition_penalty 1.05 is not applied" in s.source
  unfiltered = config_from_hf({**qwen, "model_type": "llama"}, "autoregressive", generation={"do_sample": True})
  assert (unfiltered.sampling.temperature, unfiltered.sampling.top_p, unfiltered.sampling.top_k) == (1.0, 1.0, 50)


def _edit_config(folder: Path, **fields) -> None:
  config = json.loads((folder / "config.json").read_text())
  config.update(fields)
  (folder / "config.json").write_text(json.dumps(config))


def _drop_tensor(folder: Path) -> None:
  from safetensors.numpy import load_file, save_file

  tensors = load_file(folder / "model.safetensors")
  del tensors["model.transformer.blocks.1.up_proj.weight"]
  save_file(tensors, folder / "model.safetensors")


def _truncate(folder: Path) -> None:
  shard = sorted(folder.glob("model-*.safetensors"))[-1]
  shard.write_bytes(shard.read_bytes()[:-100])


# case -> (source family, how to break a copy of it, words the one-line error must hold)
BAD = {
  "missing folder": ("dream", lambda f: shutil.rmtree(f), "is not a folder"),
  "missing config": ("dream", lambda f: (f / "config.json").unlink(), "no config.json"),
  "missing weights": ("dream", lambda f: [p.unlink() for p in f.glob("model*")], "no weights"),
  "unknown model_type": ("dream", lambda f: _edit_config(f, model_type="gpt2"), "'gpt2' is not supported; supported"),
  "shape mismatch": (
    "dream",
    lambda f: _edit_config(f, intermediate_size=128),
    "'model.layers.0.mlp.gate_proj.weight' has shape [96, 64] but the config implies [128, 64]",
  ),
  "truncated": ("dream", _truncate, "truncated"),
  "missing tensor": ("llada", _drop_tensor, "'model.transformer.blocks.1.up_proj.weight' is missing"),
  "moe keys": ("dream", lambda f: _edit_config(f, num_experts=64, moe_intermediate_size=1024), "MoE is not supported"),
  "moe type": ("llada", lambda f: _edit_config(f, model_type="llada2_moe"), "MoE is not supported"),
  "rope dynamic": (
    "dream",
    lambda f: _edit_config(f, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
    "rope_scaling type 'dynamic' is not supported; supported: default, linear, yarn, llama3",
  ),
  "rope longrope": (
    "sdar",
    lambda f: _edit_config(f, rope_parameters=None, rope_scaling={"type": "longrope", "factor": 2.0}),
    "'longrope' is not supported",
  ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_with_exit_code_2_and_no_output(case, sources, tmp_path, capsys):
  family, breaks, words = BAD[case]
  src = tmp_path / "src"
  shutil.copytree(sources(family)[0], src)
  breaks(src)
  out = tmp_path / "models" / "out"
  with pytest.raises(SystemExit) as exit_info:
    main(["--from", str(src), "--out", str(out), "--dtype", "float32"])
  err = capsys.readouterr().err
  assert exit_info.value.code == 2
  assert err.count("\n") == 1 and err.startswith("mercury_jax.convert: error: ") and words in err, err
  assert not out.exists() and not (out.parent.exists() and list(out.parent.iterdir()))


def test_a_failure_while_writing_leaves_no_output(sources, tmp_path, monkeypatch):
  from mercury_jax.convert import build

  def broken(*args, **kwargs):
    raise OSError("disk full")

  monkeypatch.setattr(build, "save_params", broken)
  with pytest.raises(OSError, match="disk full"):
    convert(sources("sdar")[0], tmp_path / "out")
  assert list(tmp_path.iterdir()) == []


def test_the_command_line_reports_a_missing_folder_without_a_traceback(tmp_path):
  proc = subprocess.run(
    [sys.executable, "-m", "mercury_jax.convert", "--from", str(tmp_path / "nope"), "--out", str(tmp_path / "o")],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines() == [
    f"mercury_jax.convert: error: --from {str(tmp_path / 'nope')!r} is not a folder (expected a Hugging Face "
    "checkpoint folder)"
  ]
  assert not (tmp_path / "o").exists()
