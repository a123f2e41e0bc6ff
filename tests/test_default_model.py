"""The model bundled in the package (``mercury_jax/assets/default``): complete, small, trained, and the CLI default."""

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
from mercury_jax.data.records import TARGET
from mercury_jax.export import folder_bytes
from mercury_jax.model import Transformer
from mercury_jax.sample import main
from mercury_jax.sampling.sampler import Sampler, default_checkpoint
from mercury_jax.trainer import loss_terms

FIXTURES = Path(__file__).parent / "fixtures"
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def sampler() -> Sampler:
  return Sampler.from_checkpoint(mesh=sh.make_mesh(MeshConfig(data=1), jax.devices()[:1]))


def test_bundle_is_complete_and_fits_the_size_limit():
  path = default_checkpoint()
  assert path is not None, "mercury_jax/assets/default holds no model"
  assert folder_bytes(path) <= 30_000_000
  for name in ("MODEL_CARD.md", "manifest.json", "tokenizer.model"):
    assert (path / name).is_file(), name
  manifest = json.loads((path / "manifest.json").read_text())
  assert manifest["kind"] == "python-stdlib" and manifest["splits"]["train"]["documents"] > 100


def test_bundled_model_is_the_default_preset_diffusion_model(sampler):
  assert not sampler.autoregressive
  shipped, preset = sampler.cfg.model, load_config("default").model
  assert shipped == preset, "the bundled model no longer matches configs/default.toml"
  assert sampler.tokenizer.vocab_size <= shipped.vocab_size


def _nats_per_token(sampler: Sampler, tokens: np.ndarray, draws: int = 4) -> float:
  model = Transformer(sampler.cfg.model)
  batch = {"tokens": jnp.asarray(tokens), "kinds": jnp.full(tokens.shape, TARGET, jnp.int32)}
  step = jax.jit(lambda key: loss_terms(sampler.params, batch, key, model, sampler.cfg))
  sums = [step(jax.random.key(d)) for d in range(draws)]
  return float(sum(s["loss_sum"] for s in sums) / sum(s["tokens"] for s in sums))


def test_bundled_weights_are_trained_on_python(sampler):
  """Real, unseen Python scores far better than the same tokens shuffled (random weights score both alike)."""
  text = "\n\n".join(p.read_text() for p in sorted((FIXTURES / "corpus").rglob("*.py")))
  ids = np.asarray(sampler.tokenizer.encode(text), np.int32)
  length = 128
  rows = ids[: (ids.size // length) * length].reshape(-1, length)  # [batch, length]
  shuffled = np.random.default_rng(0).permutation(rows.reshape(-1)).reshape(rows.shape)
  real, noise = _nats_per_token(sampler, rows), _nats_per_token(sampler, shuffled)
  # Shipped model: about 4.75 vs 7.5 nats per token; random weights score both near ln(4096) = 8.3.
  assert real < 0.75 * noise and real < 5.5, (real, noise)


def test_sample_without_checkpoint_uses_the_bundle_and_matches_one_device(tmp_path, capsys):
  """The CLI's default model on this process's 8-device mesh gives the tokens of one device in a fresh process,
  and ``python -m`` keeps its compiled program in the user's cache folder."""
  argv = ["--prompt", PROMPT, "--length", "32", "--steps", "16", "--seed", "3", "--json"]
  assert main(argv) == 0
  (sharded,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
  env["XDG_CACHE_HOME"] = str(tmp_path)
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # JAX skips programs compiled in under 1 s by default.
  done = subprocess.run(
    [sys.executable, "-m", "mercury_jax.sample", *argv], capture_output=True, text=True, env=env, timeout=300
  )
  assert done.returncode == 0, done.stderr
  (single,) = [json.loads(line) for line in done.stdout.splitlines()]
  assert single["tokens"] == sharded["tokens"] and single["text"] == sharded["text"]
  assert any((tmp_path / "mercury_jax" / "xla").iterdir())
  assert sharded["prompt"] == PROMPT and 1 <= len(sharded["tokens"]) <= 32 and sharded["nfe"] <= 16
