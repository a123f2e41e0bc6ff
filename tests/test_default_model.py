"""The models bundled in the package (``mercury_jax/assets/default``, the verified model, its autoregressive twin
``default_ar`` and the block-diffusion model ``default_bd``): complete, small, trained on the permissive code corpus
(the first two also on chat examples mined from it, with the chat template in their config), and the CLI's choices."""

import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mercury_jax import sharding as sh
from mercury_jax.config import MeshConfig, load_config
from mercury_jax.data import chat_format
from mercury_jax.data.records import TARGET
from mercury_jax.data.site_packages import parse_expression
from mercury_jax.export import folder_bytes
from mercury_jax.model import Transformer
from mercury_jax.sample import main
from mercury_jax.sampling.sampler import BUNDLED_MODELS, Sampler, default_checkpoint
from mercury_jax.trainer import loss_terms

FIXTURES = Path(__file__).parent / "fixtures"
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def sampler() -> Sampler:
  return Sampler.from_checkpoint(mesh=sh.make_mesh(MeshConfig(data=1), jax.devices()[:1]))


@pytest.fixture(scope="module")
def twin() -> Sampler:
  return Sampler.from_checkpoint(default_checkpoint("default_ar"))


def test_bundles_are_complete_and_fit_the_size_limit_together():
  paths = [default_checkpoint(name) for name in BUNDLED_MODELS]
  assert None not in paths, f"a bundled model is missing: {dict(zip(BUNDLED_MODELS, paths, strict=True))}"
  assert sum(folder_bytes(path) for path in paths) <= 45_000_000
  for path in paths:
    for name in ("MODEL_CARD.md", "manifest.json", "metadata.json", "tokenizer.model"):
      assert (path / name).is_file(), (path, name)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["kind"] == "mixture" and manifest["splits"]["train"]["documents"] > 5000
    stdlib, packages = manifest["corpora"]
    assert stdlib["kind"] == "python-stdlib" and packages["kind"] == "site-packages"
    licences = {d["name"]: d["license"] for d in packages["distributions"]}
    assert len(licences) >= 20 and all(parse_expression(e)[1] for e in licences.values()), licences
  # All were trained on the same data with the same tokenizer.
  assert len({(path / "tokenizer.model").read_bytes() for path in paths}) == 1
  # The chat pair's manifest also records the mined chat examples they trained on, and the same ones for both.
  chats = [json.loads((default_checkpoint(n) / "manifest.json").read_text())["v4"] for n in ("default", "default_ar")]
  assert chats[0] == chats[1] and chats[0]["chat_examples"]["split"] == "functions of the corpora's train split only"
  mined = chats[0]["chat_examples"]["examples"]
  assert sum(mined.values()) == sum(s["documents"] for s in chats[0]["chat_data"]["splits"].values()) > 40_000
  assert mined["tool_call"] > 1000


def test_bundled_models_are_the_default_presets(sampler, twin):
  """The default bundle is configs/v4_chat.toml's model, the twin configs/v4_chat_ar.toml's (the twin trained on the
  same rows for the same steps), both with the chat template; the block-diffusion bundle configs/default.toml's."""
  bd = Sampler.from_checkpoint(default_checkpoint("default_bd"))
  presets = ((sampler, "v4_chat"), (twin, "v4_chat_ar"), (bd, "default"))
  for model, name in presets:
    preset = load_config(name)
    # The sampler runs the layer stack as a loop whatever training chose (same parameters).
    assert model.cfg.model == dataclasses.replace(preset.model, unroll_layers=False)
    assert model.cfg.objective == preset.objective
    assert model.tokenizer.vocab_size <= model.cfg.model.vocab_size
  assert sampler.cfg.objective.name == "verified" and sampler.cfg.objective.draft_length == 4
  assert sampler.plan().decode == "verified" and twin.autoregressive and bd.block_size == 8
  assert sampler.cfg.data.chat_template == twin.cfg.data.chat_template == load_config("v4_chat").data.chat_template
  assert sampler.cfg.data.mix == twin.cfg.data.mix == ("chat@0.5",) and sampler.cfg.data.path == "code"
  assert not bd.cfg.data.chat_template


def _nats_per_token(sampler: Sampler, rows: list[np.ndarray], draws: int = 4) -> list[float]:
  """The training objective of each ``[batch, length]`` array in ``rows``, averaged over ``draws`` keys: one compiled
  program for all (parameters and tokens are its arguments, not constants baked into a program per batch)."""
  model = Transformer(sampler.cfg.model)
  step = jax.jit(lambda params, batch, key: loss_terms(params, batch, key, model, sampler.cfg))
  result = []
  for tokens in rows:
    batch = {"tokens": jnp.asarray(tokens), "kinds": jnp.full(tokens.shape, TARGET, jnp.int32)}
    sums = [step(sampler.params, batch, jax.random.key(d)) for d in range(draws)]
    result.append(float(sum(s["loss_sum"] for s in sums) / sum(s["tokens"] for s in sums)))
  return result


def test_bundled_weights_are_trained_on_python(sampler):
  """Real, unseen Python scores far better than the same tokens shuffled (random weights score both alike)."""
  text = "\n\n".join(p.read_text() for p in sorted((FIXTURES / "corpus").rglob("*.py")))
  ids = np.asarray(sampler.tokenizer.encode(text), np.int32)
  length = 128
  rows = ids[: (ids.size // length) * length].reshape(-1, length)  # [batch, length]
  shuffled = np.random.default_rng(0).permutation(rows.reshape(-1)).reshape(rows.shape)
  real, noise = _nats_per_token(sampler, [rows, shuffled])
  # Random weights score both near ln(4096) = 8.3 nats per token; the trained model separates them.
  assert real < 0.75 * noise and real < 5.5, (real, noise)


def test_sample_without_checkpoint_uses_the_bundle_and_matches_one_device(tmp_path, capsys):
  """The CLI's default model on this process's 8-device mesh gives the tokens of one device in a fresh process,
  and ``python -m`` keeps its compiled program in the user's cache folder, under the lock that keeps concurrent
  commands from reading each other's half-written entries."""
  argv = ["--prompt", PROMPT, "--length", "32", "--seed", "3", "--json"]
  assert main(argv) == 0
  (sharded,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
  # One device, compiled as quickly as this process compiles (the conftest's flags but its device count).
  quick = [f for f in os.environ["XLA_FLAGS"].split() if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(quick)
  env["XDG_CACHE_HOME"] = str(tmp_path)
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # JAX skips programs compiled in under 1 s by default.
  done = subprocess.run(
    [sys.executable, "-m", "mercury_jax.sample", *argv], capture_output=True, text=True, env=env, timeout=300
  )
  assert done.returncode == 0, done.stderr
  (single,) = [json.loads(line) for line in done.stdout.splitlines()]
  assert single["tokens"] == sharded["tokens"] and single["text"] == sharded["text"]
  cache = tmp_path / "mercury_jax" / "xla"
  assert any(cache.glob("*-cache"))
  assert (cache / ".lockfile").exists()  # Bounded, so every read and write holds JAX's file lock.
  # Token healing backs off the prompt's last token (``):``), so the tokens are the 32 asked for plus that one.
  assert sharded["prompt"] == PROMPT and sharded["healed"] == "):" and 1 <= len(sharded["tokens"]) <= 33
  assert sum(sharded["accepted"]) == sharded["nfe"] <= len(sharded["tokens"])  # verified decoding


def test_model_default_ar_samples_the_bundled_twin(twin, capsys):
  """``--model default_ar`` decodes the twin, token for token, with the same seed and knobs as the Python API."""
  argv = ["--model", "default_ar", "--prompt", PROMPT, "--length", "24", "--seed", "5", "--temperature", "0.8"]
  assert main([*argv, "--json"]) == 0
  (cli,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  (sample,) = twin.generate(PROMPT, length=24, seed=5, temperature=0.8)
  assert cli["tokens"] == [int(t) for t in sample.tokens] and cli["text"] == sample.text
  assert cli["nfe"] == len(sample.tokens)  # one token per forward pass: the twin, not the diffusion model


def test_verified_greedy_is_the_bundled_networks_own_greedy_decoding(sampler):
  """Trained weights: four prompts of different lengths and a two-hole template, verified against the network's
  next-token head alone, token for token; the drafts are accepted often enough to save forward passes."""
  prompts = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, item):", "x = "]
  for knobs in (dict(length=48), dict(template="def <mask:6>(self):\n    return <mask:8>\n", length=0)):
    verified = sampler.generate(prompts, temperature=0.0, seed=2, **knobs)
    ar = sampler.generate(prompts, temperature=0.0, seed=2, decode="ar", **knobs)
    assert [s.tokens for s in verified] == [s.tokens for s in ar]
  assert sum(s.nfe for s in verified) < sum(len(s.tokens) for s in verified)


def test_chat_turn_from_the_command_line_is_the_templates_prompt_after_bos(sampler, monkeypatch, capsys):
  """``--chat -`` reads the message from stdin, renders it with ``--system`` in the bundled template and prints the
  reply alone: the tokens the Python API gives for that text after BOS, without token healing."""
  monkeypatch.setattr("sys.stdin", io.StringIO("Write a function that reverses a string.\n"))
  argv = ["--chat", "-", "--system", "Be brief.", "--length", "16", "--temperature", "0", "--json"]
  assert main(argv) == 0
  (cli,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  messages = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Write a function that reverses a string."},
  ]
  rendered = chat_format.render(messages)
  assert cli["prompt"] == rendered and rendered.endswith("<|assistant|>\n") and "healed" not in cli
  (sample,) = sampler.generate(rendered, length=16, temperature=0.0, bos=True, token_healing=False)
  assert cli["tokens"] == sample.tokens and cli["text"] == sample.text and 1 <= len(cli["tokens"]) <= 16
  assert main(["--chat", "Write a function that reverses a string.", "--length", "8", "--temperature", "0"]) == 0
  out = capsys.readouterr().out
  assert "<|user|>" not in out and "<|assistant|>" not in out  # the reply alone, not the rendered prompt


def test_verified_greedy_with_every_draft_lever_is_the_bundled_networks_own_greedy_decoding(sampler):
  """Trained weights, a draft tree with alternatives, a lookup chain, a pre-draft block after every node and an
  adaptive length: still the next-token head's greedy text, in fewer forward passes than the drafter's chain alone
  (the trained model's greedy text repeats itself, which the lookups take)."""
  prompts = ["def fibonacci(n):", "class Stack:\n    def push(self, item):"]
  knobs = dict(draft_tree="wide", draft_lookup=8, draft_blocks="tree", draft_confidence=0.05)
  verified = sampler.generate(prompts, temperature=0.0, seed=2, length=64, **knobs)
  chain = sampler.generate(prompts, temperature=0.0, seed=2, length=64, draft_tree="chain", draft_lookup=0)
  ar = sampler.generate(prompts, temperature=0.0, seed=2, length=64, decode="ar")
  assert [s.tokens for s in verified] == [s.tokens for s in ar] == [s.tokens for s in chain]
  assert sum(s.nfe for s in verified) < sum(s.nfe for s in chain)
