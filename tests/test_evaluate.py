"""Likelihood evaluation of trained tiny models, and the sample-quality metrics on inputs with known answers."""

import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from mercury_jax.bench import quality
from mercury_jax.checkpoint import restore_params
from mercury_jax.config import load_config
from mercury_jax.data import pipeline, records
from mercury_jax.evaluate import evaluate_params
from mercury_jax.model import Transformer
from mercury_jax.train import train

SMALL = {
  "model.max_length": "64",
  "model.vocab_size": "400",
  "train.eval_every": "20",
  "train.eval_batches": "1",
  "checkpoint.async_save": "false",
  "train.log_every": "20",
}


def test_diffusion_bound_is_finite_and_consistent_with_training(tmp_path, data_dir):
  cfg = load_config("tiny", {**SMALL, "data.path": str(data_dir), "train.steps": "40"})
  last = train(cfg, tmp_path / "run", log=False, devices=jax.devices()[:1])  # No sharding under test.
  params, stored = restore_params(tmp_path / "run")
  result = evaluate_params(params, stored, data_dir, t_samples=8, batch_size=8)
  assert math.isfinite(result["nats_per_token"]) and result["nats_per_token_stderr"] > 0
  # The training loop's evaluation is one draw of the same estimator on (almost) the same records: it must lie within
  # a few per-draw standard deviations of the 8-draw mean.
  per_draw_std = result["nats_per_token_stderr"] * math.sqrt(result["t_samples"])
  assert abs(result["nats_per_token"] - last["eval_nats_per_token"]) < 4 * per_draw_std + 0.05
  # Diffusion scores every target token: exactly the split's tokens and characters as `prepare` counted them from
  # the raw text.
  split = pipeline.read_metadata(data_dir)["splits"]["validation"]
  assert (result["scored_tokens"], result["characters"]) == (split["target_tokens"], split["characters"])
  again = evaluate_params(params, stored, data_dir, t_samples=8, batch_size=8)
  assert again["nats_per_token"] == result["nats_per_token"]  # A fixed seed gives a fixed estimate.


def test_autoregressive_nll_is_exact_and_draw_free(tmp_path, data_dir):
  cfg = load_config(
    "default_ar",
    {
      **SMALL,
      "data.path": str(data_dir),
      "train.steps": "20",
      "model.d_model": "64",
      "model.num_layers": "2",
      "model.mlp_dim": "128",
      "model.num_heads": "2",
      "model.num_kv_heads": "2",
      "model.head_dim": "32",
      "data.batch_size": "8",
    },
  )
  train(cfg, tmp_path / "ar", log=False, devices=jax.devices()[:1])
  params, stored = restore_params(tmp_path / "ar")
  a = evaluate_params(params, stored, data_dir, t_samples=5, seed=0, batch_size=8)
  b = evaluate_params(params, stored, data_dir, t_samples=5, seed=9, batch_size=8)
  assert a["t_samples"] == 1 and a["nats_per_token_stderr"] == 0.0 and not a["bound"]
  assert a["nats_per_token"] == b["nats_per_token"]
  # An independent count: the full forward pass over every validation record, and the split's characters less
  # those of each record's first token, which has no context and is not scored.
  split = pipeline.read_metadata(data_dir)["splits"]["validation"]
  records_ = records.read_shards(pipeline.split_paths(data_dir, "validation"))
  tokenizer = pipeline.load_data_tokenizer(data_dir)
  model = Transformer(stored.model)
  nll = scored = 0.0
  unscored_chars = 0
  for tokens, kinds in zip(records_[:, 0], records_[:, 1], strict=True):
    logits = model.apply({"params": params}, tokens[None], segment_ids=(kinds != 0).astype(np.int32)[None])[0]
    logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), np.float64)
    for i in range(1, len(tokens)):
      if kinds[i] == 2:
        nll, scored = nll - logp[i - 1, tokens[i]], scored + 1
    unscored_chars += len(tokenizer.decode(tokens[:1])) if kinds[0] == 2 else 0
  assert a["scored_tokens"] == scored == split["target_tokens"] - len(records_)
  assert a["characters"] == split["characters"] - unscored_chars
  assert a["nats_per_token"] == pytest.approx(nll / scored, rel=1e-5)
  assert a["bits_per_char"] == pytest.approx(nll / (a["characters"] * math.log(2)), rel=1e-5)
  assert a["perplexity"] == pytest.approx(math.exp(nll / scored), rel=1e-5)


def test_evaluate_cli_rejects_a_missing_checkpoint(tmp_path, data_dir):
  proc = subprocess.run(
    [sys.executable, "-m", "mercury_jax.evaluate", "--checkpoint", str(tmp_path / "none"), "--data", str(data_dir)],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


def test_diversity_metrics_on_known_inputs():
  assert quality.unigram_entropy([[1, 1, 2, 2], [5, 5, 5, 5]]) == pytest.approx(math.log(2) / 2)
  assert quality.distinct_n([[1, 2, 1, 2]], 2) == pytest.approx(2 / 3)
  assert quality.distinct_n([[1, 2, 3, 4]], 1) == 1.0
  assert quality.distinct_n([[7] * 10], 3) == pytest.approx(1 / 8)


def test_parse_rate_trims_to_the_last_complete_statement():
  prompt = "def area(r):\n"
  assert quality.parses(prompt, "    return 3.14 * r * r\n")
  assert quality.parses(prompt, "    x = r * r\n    return (x +")  # Cut off mid-statement: trimmed.
  assert not quality.parses(prompt, "")  # Nothing generated.
  assert not quality.parses(prompt, "return )(\n")  # Never parses.
  assert quality.parse_rate([prompt, prompt], ["    return r\n", "  ]]\n"]) == 0.5


def test_generative_perplexity_of_a_uniform_model_is_the_vocabulary_size():
  cfg = load_config(
    "default_ar",
    {
      "model.vocab_size": "50",
      "model.max_length": "16",
      "model.d_model": "32",
      "model.num_layers": "1",
      "model.mlp_dim": "64",
      "model.num_heads": "2",
      "model.num_kv_heads": "2",
      "model.head_dim": "16",
    },
  )
  model = Transformer(cfg.model)
  params = nn.meta.unbox(model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))["params"])
  params = dict(params, head=jnp.zeros_like(params["head"]))  # Zero logits: every token has probability 1/50.
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(5, 50, n)) for n in (3, 7, 1)]
  completions = [list(rng.integers(5, 50, n)) for n in (5, 9, 20)]
  assert quality.generative_perplexity(params, cfg, prompts, completions, batch_size=2) == pytest.approx(50, rel=1e-5)


def test_characters_per_token_sum_to_the_text_length(data_dir):
  tokenizer = pipeline.load_data_tokenizer(data_dir)
  chars = tokenizer.characters_per_token()
  assert chars[[tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.mask_id]].sum() == 0
  # ASCII code, runs of spaces, a literal U+2581, and characters outside the vocabulary (byte fallback, 2-4 bytes).
  for text in ["def f(x):\n    return x  # ok\n", "a\tb \u2581 c", "naïve 日本語 🙂 ∑"]:
    assert chars[tokenizer.encode(text)].sum() == len(text)
