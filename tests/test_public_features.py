"""The architecture features of public checkpoints: shifted logits through every cache, and RoPE scaling (tiny random
models, f32; the converter's own tests compare whole converted models with transformers)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from mercury_jax import rope
from mercury_jax.config import ModelConfig
from mercury_jax.model import Transformer
from mercury_jax.sampling import canvas as cv
from mercury_jax.sampling.engine import BlockEngine
from mercury_jax.sampling.network import Network
from mercury_jax.sampling.plan import plan_blocks
from mercury_jax.sampling.settings import SamplerSettings

VOCAB, BLOCK, EOS = 64, 4, 3


def _cfg(**overrides) -> ModelConfig:
  base = dict(
    vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64, max_length=64,
    attention="xla", shifted_logits=True, qkv_bias=True, qk_norm=True, tie_embeddings=True, scale_tied_logits=False,
  )  # fmt: skip
  return ModelConfig(**{**base, **overrides})


def _params(cfg: ModelConfig, scale: float = 6.0):
  params = nn.meta.unbox(Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"]
  return jax.tree.map(lambda p: p * scale, params)


def _canvas() -> cv.Canvas:
  examples = [cv.prefix([5, 6, 7], 13), cv.prefix([5, 6, 7, 8, 9, 10], 10), [[9, 9], cv.Hole(5), [12, 13], cv.Hole(6)]]
  return cv.make_canvas(examples)


def _sample(cfg, params, settings, cache, steps, whole_sequence=False):
  canvas = _canvas()
  plan = plan_blocks(canvas.kinds, BLOCK, cache=cache, whole_sequence=whole_sequence)
  engine = BlockEngine(cfg, settings, plan)
  return np.asarray(jax.jit(engine.sample)(params, canvas, jax.random.key(1), jnp.int32(steps)).tokens)


def test_the_model_builds_the_features_parameters():
  params = _params(_cfg())
  attention = params["blocks"]["attention"]
  assert attention["query_bias"].shape == (2, 4, 8) and attention["key_bias"].shape == (2, 2, 8)
  assert attention["query_norm"]["scale"].shape == (2, 8) and "value_norm" not in attention
  assert "head" not in params  # tied
  bf16 = nn.meta.unbox(
    jax.eval_shape(lambda: Transformer(_cfg(param_dtype="bfloat16")).init(jax.random.key(0), jnp.zeros((1, 8), int)))
  )["params"]
  assert {leaf.dtype for leaf in jax.tree.leaves(bf16)} == {jnp.dtype(jnp.bfloat16)}


def test_a_shifted_block_model_decodes_the_same_with_and_without_the_exact_cache():
  """The exact cache's block pass runs from the slot before the block; the uncached 2n pass reads the clean half's
  output there. Both must give the same tokens (sampled, several commits a step), and different ones from reading the
  unshifted outputs."""
  cfg = _cfg()
  params = _params(cfg)
  settings = SamplerSettings(eos_id=EOS, num_tokens=VOCAB, rule="threshold", threshold=0.5).validate()
  cached = _sample(cfg, params, settings, "exact", 3)
  np.testing.assert_array_equal(cached, _sample(cfg, params, settings, "none", 3))
  unshifted = _sample(dataclasses.replace(cfg, shifted_logits=False), params, settings, "exact", 3)
  assert (unshifted != cached).any()


def test_a_shifted_whole_sequence_model_agrees_across_caches_at_one_step_per_block():
  """With one step per block every approximate-cache step is a refresh of the whole canvas, so dual, prefix and no
  cache give the same tokens; each reads position i's distribution from the output at i - 1."""
  cfg = _cfg()
  params = _params(cfg)
  settings = SamplerSettings(eos_id=EOS, num_tokens=VOCAB, rule="confidence", temperature=0.0).validate()
  none = _sample(cfg, params, settings, "none", 1, whole_sequence=True)
  for cache in ("dual", "prefix"):
    np.testing.assert_array_equal(_sample(cfg, params, settings, cache, 1, whole_sequence=True), none, err_msg=cache)
  unshifted = _sample(dataclasses.replace(cfg, shifted_logits=False), params, settings, "none", 1, whole_sequence=True)
  assert (unshifted != none).any()


def test_network_logits_read_the_previous_position_for_a_shifted_model():
  cfg = _cfg()
  params = _params(cfg)
  tokens = jnp.arange(10, 22, dtype=jnp.int32)[None]
  positions = jnp.arange(12, dtype=jnp.int32)[None]
  raw = Transformer(cfg).apply({"params": params}, tokens)
  got = Network(cfg).logits(params, tokens, segments=jnp.ones_like(tokens), positions=positions)
  np.testing.assert_allclose(got[:, 1:], raw[:, :-1], rtol=1e-5, atol=1e-3)
  np.testing.assert_allclose(got[:, 0], raw[:, 0], rtol=1e-5, atol=1e-3)


# ----------------------------------------------------------------------------------------------- RoPE scaling


def _rope(scaling: str, **kw) -> ModelConfig:
  return ModelConfig(head_dim=64, rope_theta=10_000.0, max_length=8192, rope_scaling=scaling, **kw)


def test_rope_frequencies_match_the_published_formulas():
  base = 10_000.0 ** (-np.arange(32) / 32)
  np.testing.assert_allclose(rope.frequencies(_rope("none"))[0], base)
  np.testing.assert_allclose(rope.frequencies(_rope("linear", rope_factor=4.0))[0], base / 4)
  # NTK-aware: the base grows by factor^(d / (d - 2)); the highest frequency stays, the lowest is divided by factor.
  ntk, _ = rope.frequencies(_rope("ntk", rope_factor=4.0))
  np.testing.assert_allclose(ntk, (10_000.0 * 4.0 ** (64 / 62)) ** (-np.arange(32) / 32))
  assert ntk[0] == 1.0 and np.isclose(ntk[-1] * 10_000.0 ** (62 / 64), 4.0**-1.0)
  yarn, scale = rope.frequencies(_rope("yarn", rope_factor=4.0, rope_original_length=2048))
  assert np.isclose(scale, 0.1 * np.log(4.0) + 1.0)
  assert yarn[0] == base[0] and np.isclose(yarn[-1], base[-1] / 4)  # fast pairs kept, slow ones interpolated


@pytest.mark.parametrize(
  "scaling, params",
  [
    ("linear", dict(factor=4.0)),
    ("yarn", dict(factor=4.0, original_max_position_embeddings=2048)),
    ("yarn", dict(factor=8.0, original_max_position_embeddings=1024, beta_fast=16.0, beta_slow=2.0)),
    ("llama3", dict(factor=8.0, original_max_position_embeddings=2048, low_freq_factor=1.0, high_freq_factor=4.0)),
  ],
)
def test_rope_frequencies_equal_transformers(scaling, params):
  transformers = pytest.importorskip("transformers")
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  hf = transformers.LlamaConfig(
    hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=8192,
    rope_parameters={"rope_type": scaling, "rope_theta": 10_000.0, **params},
  )  # fmt: skip
  want, want_scale = ROPE_INIT_FUNCTIONS[scaling](hf, None)
  ours = _rope(
    scaling,
    rope_factor=params["factor"],
    rope_original_length=params.get("original_max_position_embeddings", 0),
    rope_beta_fast=params.get("beta_fast", 32.0),
    rope_beta_slow=params.get("beta_slow", 1.0),
    rope_low_freq_factor=params.get("low_freq_factor", 1.0),
    rope_high_freq_factor=params.get("high_freq_factor", 4.0),
  )
  got, scale = rope.frequencies(ours)
  np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
  assert np.isclose(scale, want_scale)


def test_stop_ids_end_a_turn_as_one_event_with_eos():
  """A chat model's end-of-turn ids are merged into EOS: EOS's probability becomes their sum, they are never proposed,
  and a row where EOS is banned (min_length) can propose none of them."""
  from mercury_jax.sampling.proposal import clean_logits

  settings = SamplerSettings(eos_id=EOS, num_tokens=VOCAB, stop_ids=(40, 41)).validate()
  logits = jnp.zeros((2, 1, VOCAB)).at[:, :, 40].set(5.0).at[:, :, 41].set(4.0).at[:, :, EOS].set(1.0)
  banned = jnp.asarray([[False], [True]])
  cleaned = clean_logits(logits, banned, settings)
  p = jax.nn.softmax(cleaned, axis=-1)
  q = jax.nn.softmax(clean_logits(logits, banned, SamplerSettings(eos_id=EOS, num_tokens=VOCAB).validate()), -1)
  np.testing.assert_allclose(p[0, 0, EOS], q[0, 0, EOS] + q[0, 0, 40] + q[0, 0, 41], rtol=1e-6)
  assert p[0, 0, 40] == 0 and p[0, 0, 41] == 0 and int(jnp.argmax(cleaned[0, 0])) == EOS
  assert p[1, 0, EOS] == 0 and p[1, 0, 40] == 0 and p[1, 0, 41] == 0


def test_the_runtime_never_imports_torch_or_transformers():
  """torch and transformers are test dependencies: converting, sampling and serving a public checkpoint use neither."""
  import subprocess
  import sys

  modules = ["mercury_jax.convert.build", "mercury_jax.convert.__main__", "mercury_jax.sampling.sampler"]
  modules += ["mercury_jax.serve.routes", "mercury_jax.data.hf_tokenizer", "mercury_jax.aot"]
  code = f"import sys, importlib; [importlib.import_module(m) for m in {modules!r}]; "
  code += "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]"
