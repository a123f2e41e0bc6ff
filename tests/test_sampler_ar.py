"""The autoregressive twin through ``Sampler`` and ``python -m mercury_jax.sample`` (tiny exported checkpoint)."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ar_reference import jit_decode
from flax import linen as nn

from mercury_jax import sharding as sh
from mercury_jax.checkpoint import export_params
from mercury_jax.config import Config, MeshConfig, ModelConfig, ObjectiveConfig
from mercury_jax.model import Transformer
from mercury_jax.sample import main
from mercury_jax.sampling import canvas as cv
from mercury_jax.sampling.sampler import MASK_TEXT, Sampler

MAX_LENGTH = 64
PROMPTS = ["def add(x, y):", "import os", "class Point:\n  def", "x ="]
KNOBS = dict(top_k=50, min_length=6)  # One compilation per batch shape for the whole module.


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, data_dir) -> Path:
  root = tmp_path_factory.mktemp("ar")
  model_cfg = ModelConfig(
    vocab_size=512,
    d_model=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=64,
    max_length=MAX_LENGTH,
    causal=True,
    unroll_layers=True,
  )
  cfg = Config(model=model_cfg, objective=ObjectiveConfig(name="autoregressive"), name="ar-test")
  params = nn.meta.unbox(Transformer(model_cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"]
  params = jax.tree.map(lambda p: p * 10.0, params)  # Sharper distributions than the 0.02 init.
  return export_params(root / "export", params, cfg, data_dir / "tokenizer.model").parent


@pytest.fixture(scope="module")
def sampler(checkpoint) -> Sampler:
  return Sampler.from_checkpoint(checkpoint)


def test_sampler_decodes_prompts_and_templates_of_an_autoregressive_checkpoint(sampler):
  assert sampler.autoregressive
  # Without token healing: the canvases the reference decoder gets (tests/test_healing.py covers healing).
  batch = sampler.generate(PROMPTS, length=6, seed=5, num_samples=2, token_healing=False, **KNOBS)
  assert [s.prompt for s in batch] == [p for p in PROMPTS for _ in range(2)]
  # Each sample has its own random stream: a prompt's two samples differ (for some prompt; a sharp distribution can
  # make two draws coincide).
  assert any(batch[2 * i].tokens != batch[2 * i + 1].tokens for i in range(len(PROMPTS)))
  (alone,) = sampler.generate(PROMPTS[2], length=6, seed=5, streams=[4], show_steps=True, token_healing=False, **KNOBS)
  assert alone.tokens == batch[4].tokens  # The same stream gives the same sample, alone or in a batch.
  assert len(alone.tokens) == 6 and alone.nfe == 6  # Prefill gives the first token, 5 passes the rest.
  assert len(alone.steps) == 6 and alone.steps[0].count(MASK_TEXT) == 5 and alone.steps[-1] == PROMPTS[2] + alone.text
  # The decoder's own tokens for the prompt's canvas: the Sampler adds nothing but padding.
  ids = sampler.tokenizer.encode(PROMPTS[2])
  canvas = cv.make_canvas([cv.prefix(ids, 6)], streams=[4], pad_id=sampler.tokenizer.pad_id)
  direct = jit_decode(sampler.cfg.model, sampler.settings(**KNOBS))(sampler.params, canvas, jax.random.key(5))
  assert alone.tokens == np.asarray(direct.tokens)[0, len(ids) :].tolist()

  template = '{"name": "<mask:4>", "age": <mask:2>}'
  (filled,) = sampler.generate(template=template, **KNOBS)
  assert filled.text.startswith('{"name": "') and '", "age": ' in filled.text and filled.text.endswith("}")
  (opening,) = sampler.generate(template="<mask:5> = 1", **KNOBS)  # Starts with a hole: BOS goes in front.
  assert len(opening.tokens) == 5 + len(sampler.tokenizer.encode(" = 1")) and opening.text.endswith(" = 1")


@pytest.mark.parametrize("knob", [{"steps": 8}, {"rule": "threshold"}, {"block_length": 4}, {"revision": 0.2}])
def test_diffusion_only_settings_are_an_error_for_an_autoregressive_model(sampler, knob):
  (name,) = knob
  with pytest.raises(ValueError, match=f"{name}=.* applies to diffusion models only"):
    sampler.generate("x", length=4, **knob)


def test_autoregressive_on_a_4x2_mesh_equals_one_device(checkpoint, sampler):
  mesh = sh.make_mesh(MeshConfig(data=4, fsdp=1, tensor=2))
  sharded = Sampler.from_checkpoint(checkpoint, mesh=mesh)
  assert any(
    len(leaf.sharding.device_set) == 8 and not leaf.sharding.is_fully_replicated
    for leaf in jax.tree.leaves(sharded.params)
  )
  one, eight = (s.generate(PROMPTS, length=6, seed=2, num_samples=2, **KNOBS) for s in (sampler, sharded))
  assert [s.tokens for s in eight] == [s.tokens for s in one]
  assert [s.nfe for s in eight] == [s.nfe for s in one]


def test_command_line_samples_an_autoregressive_checkpoint(checkpoint, tmp_path, capsys):
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text(json.dumps({"prompt": PROMPTS[0]}) + "\n" + json.dumps(PROMPTS[1]) + "\n")
  argv = ["--checkpoint", str(checkpoint), "--prompts-file", str(prompts), "--length", "6", "--json", "--show-steps"]
  assert main([*argv, "--num-samples", "2", "--top-k", "20", "--min-length", "6", "--seed", "1"]) == 0
  records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert [r["prompt"] for r in records] == [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2
  for r in records:
    assert set(r) >= {"text", "tokens", "nfe", "wall_time_s", "tokens_per_s"} and "process" not in r
    generated = 6 + ("healed" in r)  # token healing re-generates the prompt's last token
    assert len(r["tokens"]) == generated and r["nfe"] >= 6 and r["tokens_per_s"] > 0  # NFE: passes of the batch.
    assert len(r["steps"]) == generated and r["steps"][-1] == r["prompt"] + r["text"]  # a frame per generated token


@pytest.mark.parametrize(
  "flag", [["--steps", "8"], ["--sampler", "'confidence'"], ["--threshold", "0.5"], ["--block-length", "4"]]
)
def test_diffusion_only_flag_for_an_autoregressive_checkpoint_is_exit_code_2(checkpoint, flag, capsys):
  name, value = flag
  with pytest.raises(SystemExit) as exit_info:
    main(["--checkpoint", str(checkpoint), "--prompt", "x", name, value.strip("'")])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err.strip()
  assert "\n" not in err and f"{name}={value} applies to diffusion models only" in err, err
