"""``python -m mercury_jax.sample`` and the ``Sampler`` on a tiny exported checkpoint (random params)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from mercury_jax import sharding as sh
from mercury_jax.checkpoint import export_params
from mercury_jax.config import Config, MeshConfig, ModelConfig
from mercury_jax.model import Transformer
from mercury_jax.sample import main
from mercury_jax.sampling import canvas as cv
from mercury_jax.sampling.sampler import Sampler, default_checkpoint

MAX_LENGTH = 64


def _export(root: Path, tokenizer_file: Path, vocab_size: int) -> Path:
  model_cfg = ModelConfig(
    vocab_size=vocab_size,
    d_model=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=2,
    head_dim=16,
    mlp_dim=64,
    max_length=MAX_LENGTH,
  )
  cfg = Config(model=model_cfg, name="sampler-test")
  params = Transformer(model_cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  export_params(root, nn.meta.unbox(params), cfg, tokenizer_file)
  return root


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, data_dir) -> dict[str, Path]:
  root = tmp_path_factory.mktemp("sampler")
  shutil.copyfile(data_dir / "tokenizer.model", root / "tokenizer.model")  # 400 pieces.
  empty = root / "empty"
  empty.mkdir()
  return {
    "good": _export(root / "good", root / "tokenizer.model", 512),
    "small_vocab": _export(root / "small_vocab", root / "tokenizer.model", 300),
    "empty": empty,
  }


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
  root = tmp_path_factory.mktemp("prompts")
  (root / "prompts.jsonl").write_text('{"prompt": "def add(x):"}\n"import os"\n')
  (root / "bad.jsonl").write_text('{"prompt": "ok"}\n{not json\n')
  (root / "empty_prompt.jsonl").write_text('{"prompt": ""}\n')
  return root


BAD_INPUTS = {
  "empty prompt": ["--prompt", ""],
  "nothing to condition on": [],
  "too long": ["--prompt", "x", "--length", str(MAX_LENGTH)],
  "steps < 1": ["--prompt", "x", "--steps", "0"],
  "unknown sampler": ["--prompt", "x", "--sampler", "magic"],
  "negative temperature": ["--prompt", "x", "--temperature", "-0.5"],
  "top-p zero": ["--prompt", "x", "--top-p", "0"],
  "top-p above one": ["--prompt", "x", "--top-p", "1.01"],
  "template without holes": ["--template", '{"name": ""}'],
  "length with template": ["--template", "<mask:4>", "--length", "4"],
  "missing checkpoint": ["--prompt", "x", "--checkpoint", "/no/such/checkpoint"],
  "not a checkpoint": ["--prompt", "x", "--checkpoint", "{empty}"],
  "tokenizer does not fit model": ["--prompt", "x", "--checkpoint", "{small_vocab}"],
  "unreadable prompts file": ["--prompts-file", "/no/such/prompts.jsonl"],
  "prompts file not json": ["--prompts-file", "{bad.jsonl}"],
  "empty prompt in file": ["--prompts-file", "{empty_prompt.jsonl}"],
  "unknown flag": ["--prompt", "x", "--frobnicate"],
  "half the distributed flags": ["--prompt", "x", "--coordinator", "localhost:1234"],
  "chat without a chat template": ["--chat", "hello"],
  "empty chat message": ["--chat", "  "],
  "chat and a prompt": ["--chat", "hello", "--prompt", "x"],
  "chat with a template": ["--chat", "hello", "--template", "<mask:4>"],
  "system without chat": ["--prompt", "x", "--system", "Be brief."],
}


def _argv(args, checkpoints, files):
  argv = [] if "--checkpoint" in args else ["--checkpoint", str(checkpoints["good"])]
  for a in args:
    if a.startswith("{") and a.endswith("}") and a[1:-1] in checkpoints:
      a = str(checkpoints[a[1:-1]])
    elif a.startswith("{") and a.endswith("}"):
      a = str(files / a[1:-1])
    argv.append(a)
  return argv


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_code_2(case, checkpoints, files, capsys):
  with pytest.raises(SystemExit) as exit_info:
    main(_argv(BAD_INPUTS[case], checkpoints, files))
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  lines = [line for line in err.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith("mercury_jax.sample: error: "), err


@pytest.mark.parametrize(
  "flags, message",
  [
    (["--sampler", "magic"], "--sampler='magic' is unknown; choose one of ancestral, confidence, threshold"),
    (["--top-p", "0"], "--top-p=0.0 must lie in (0, 1]"),
    (["--top-k", "-1"], "--top-k=-1 must be >= 0"),
    (["--block-length", "-2"], "--block-length=-2 must be >= 0"),
    (["--revision", "1"], "--revision=1.0 must lie in [0, 1)"),
    (["--confidence", "vibes"], "--confidence='vibes' is unknown"),
  ],
)
def test_a_bad_sampler_setting_is_named_by_its_flag_before_the_checkpoint_is_read(flags, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    main(["--checkpoint", "/no/such/checkpoint", "--prompt", "x", *flags])  # Never read: the setting fails first.
  assert exit_info.value.code == 2
  assert capsys.readouterr().err.startswith(f"mercury_jax.sample: error: {message}")


@pytest.mark.parametrize(
  "flags,message",
  [
    (
      ["--model", "gpt"],
      "--model: no bundled model is called 'gpt'; the bundled models are default, default_ar, default_bd",
    ),
    (["--model", "default_ar", "--checkpoint", "runs/x"], "argument --checkpoint: not allowed with argument --model"),
  ],
)
def test_bad_model_choice_is_one_line_and_exit_code_2(flags, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    main(["--prompt", "x", *flags])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err.strip()
  assert "\n" not in err and err.endswith(message), err


def test_missing_twin_names_itself(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr("mercury_jax.sampling.registry.ASSETS", tmp_path)
  assert default_checkpoint("default_ar") is None
  with pytest.raises(SystemExit) as exit_info:
    main(["--prompt", "x", "--model", "default_ar"])
  assert exit_info.value.code == 2
  assert "the bundled model 'default_ar' is missing from mercury_jax/assets/default_ar/" in capsys.readouterr().err


def test_missing_default_model_says_how_to_train_one(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr("mercury_jax.sampling.registry.DEFAULT_CHECKPOINT", tmp_path)
  assert default_checkpoint() is None
  with pytest.raises(SystemExit) as exit_info:
    main(["--prompt", "x"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err.strip()
  assert "\n" not in err and "mercury_jax.train" in err and "--checkpoint" in err


def test_json_gives_text_tokens_nfe_time_and_speed_per_sample(checkpoints, files, capsys):
  argv = ["--checkpoint", str(checkpoints["good"]), "--prompts-file", str(files / "prompts.jsonl"), "--length", "8"]
  assert main([*argv, "--steps", "4", "--num-samples", "2", "--json", "--sampler", "threshold"]) == 0
  records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert [r["prompt"] for r in records] == ["def add(x):"] * 2 + ["import os"] * 2
  for r in records:
    assert set(r) >= {"text", "tokens", "nfe", "wall_time_s", "tokens_per_s"}
    assert 1 <= r["nfe"] <= 4 and 1 <= len(r["tokens"]) <= 8 and r["tokens_per_s"] > 0
  assert records[0]["tokens"] != records[1]["tokens"]  # Each sample has its own random stream.


def test_show_steps_prints_the_canvas_at_every_step(checkpoints, capsys):
  argv = ["--checkpoint", str(checkpoints["good"]), "--template", "x = <mask:6>", "--steps", "3", "--show-steps"]
  assert main([*argv, "--temperature", "0"]) == 0
  out = capsys.readouterr().out
  assert "step 1/3" in out and "step 3/3" in out and "░" in out.split("step 2/3")[0]


def test_sampler_api_fills_templates_and_mixes_prompt_lengths(checkpoints):
  sampler = Sampler.from_checkpoint(checkpoints["good"])
  template = '{"name": "<mask:4>", "age": <mask:2>}'
  (filled,) = sampler.generate(template=template, steps=4, eos_to_pad=False, min_length=6)
  assert filled.text.startswith('{"name": "') and '", "age": ' in filled.text and filled.text.endswith("}")
  batch = sampler.generate(["a", "def f(x, y, z):\n  return"], length=6, steps=6, show_steps=True)
  alone = sampler.generate(["def f(x, y, z):\n  return"], length=6, steps=6, streams=[1])
  assert batch[1].tokens == alone[0].tokens  # The same stream gives the same sample, alone or in a batch.
  assert len(batch[1].steps) == batch[1].nfe and "░" in batch[1].steps[0]
  with pytest.raises(ValueError, match="context"):
    sampler.generate("x", length=MAX_LENGTH)


def test_command_line_entry_point(checkpoints):
  cmd = [sys.executable, "-m", "mercury_jax.sample", "--checkpoint", str(checkpoints["good"]), "--prompt", "def"]
  done = subprocess.run([*cmd, "--length", "6", "--steps", "3", "--json"], capture_output=True, text=True)
  assert done.returncode == 0, done.stderr
  assert json.loads(done.stdout.splitlines()[0])["nfe"] <= 3
  bad = subprocess.run([*cmd, "--steps", "0"], capture_output=True, text=True)
  assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_prompts_file_with_process_placeholder_on_one_process_matches_the_shared_file(
  checkpoints, files, tmp_path, capsys
):
  (tmp_path / "own-0.jsonl").write_text((files / "prompts.jsonl").read_text())
  argv = ["--checkpoint", str(checkpoints["good"]), "--length", "8", "--steps", "4", "--json", "--prompts-file"]
  records = []
  for path in (files / "prompts.jsonl", tmp_path / "own-{process}.jsonl"):
    assert main([*argv, str(path)]) == 0
    records.append([json.loads(line) for line in capsys.readouterr().out.splitlines()])
  shared, own = records
  assert [r.pop("process") for r in own] == [0, 0] and all("process" not in r for r in shared)
  assert [(r["prompt"], r["tokens"]) for r in own] == [(r["prompt"], r["tokens"]) for r in shared]


def test_per_process_batch_layouts_give_the_tokens_of_the_plain_batch(checkpoints):
  sampler = Sampler.from_checkpoint(checkpoints["good"], mesh=sh.make_mesh(MeshConfig(data=-1)))
  assert sampler.generate([], per_process=True) == []  # A process may have no prompts of its own.
  settings = sampler.settings()
  encode = sampler.tokenizer.encode
  canvas = cv.make_canvas([cv.prefix(encode(p), 6) for p in ("a", "def f(x):", "import")], streams=[4, 5, 6])
  plain = sampler.run(canvas, 4, 0, settings)[0]
  own = sampler.placement.agree_on_batch(3, canvas.tokens.shape[1])  # One process: its devices hold all 8 data shards.
  assert own.own_devices and own.local_rows == 8 and own.rows.tolist() == [3]
  for layout in (own, own._replace(own_devices=False, local_rows=3)):  # Rows placed by this process, or gathered.
    out = sampler.run(canvas, 4, 0, settings, layout=layout)[0]
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.nfe, plain.nfe)
