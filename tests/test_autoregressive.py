"""The autoregressive twin's key-value-cache decoder against plain full forward passes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mercury_jax.config import load_config
from mercury_jax.kinds import TARGET as GENERATE
from mercury_jax.model import Transformer
from mercury_jax.sampling.autoregressive import jit_decode
from mercury_jax.sampling.canvas import Hole, make_canvas, prefix
from mercury_jax.sampling.settings import SamplerSettings

CFG = load_config(
  "default_ar",
  {
    "model.vocab_size": "64",
    "model.max_length": "24",
    "model.d_model": "32",
    "model.num_layers": "2",
    "model.num_heads": "4",
    "model.num_kv_heads": "2",
    "model.head_dim": "8",
    "model.mlp_dim": "64",
  },
).model
MODEL = Transformer(CFG)
PARAMS = jax.jit(MODEL.init)(jax.random.key(0), jnp.zeros((1, 24), jnp.int32))["params"]
PROMPTS = [[2, 17, 33, 9], [2, 40], [2, 5, 6, 7, 8, 9, 10]]


def _greedy_by_full_passes(canvas, settings) -> np.ndarray:
  """Reference: recompute the whole prefix at every position, argmax without the mask (and early EOS)."""
  tokens, kinds = np.array(canvas.tokens), np.asarray(canvas.kinds)
  apply = jax.jit(lambda x, seg: MODEL.apply({"params": PARAMS}, x, segment_ids=seg))
  segments = (kinds != 0).astype(np.int32)
  for row in range(tokens.shape[0]):
    generated = 0
    for i in range(1, tokens.shape[1]):
      if kinds[row, i] != GENERATE:
        continue
      logits = np.array(apply(tokens[row : row + 1], segments[row : row + 1])[0, i - 1])
      logits[settings.mask_id] = -np.inf
      if generated < settings.min_length:
        logits[settings.eos_id] = -np.inf
      tokens[row, i] = int(np.argmax(logits))
      generated += 1
      if tokens[row, i] == settings.eos_id:
        tokens[row, i + 1 :] = np.where(kinds[row, i + 1 :] == GENERATE, settings.pad_id, tokens[row, i + 1 :])
        break
  return tokens


@pytest.mark.parametrize("min_length", [0, 5])
def test_kv_cache_greedy_equals_greedy_by_full_forward_passes(min_length):
  settings = SamplerSettings(temperature=0.0, min_length=min_length)
  canvas = make_canvas([prefix(p, 24 - len(p) - 3) for p in PROMPTS], length=24)
  out = jit_decode(CFG, settings)(PARAMS, canvas, jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(out.tokens), _greedy_by_full_passes(canvas, settings))
  fixed = np.asarray(canvas.kinds) != GENERATE
  np.testing.assert_array_equal(np.asarray(out.tokens)[fixed], np.asarray(canvas.tokens)[fixed])


def test_templates_force_their_fixed_tokens():
  settings = SamplerSettings(temperature=0.0)
  canvas = make_canvas([[[2, 11], Hole(4), [30, 31], Hole(3)]], length=24)
  out = jit_decode(CFG, settings)(PARAMS, canvas, jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(out.tokens)[0, 6:8], [30, 31])
  np.testing.assert_array_equal(np.asarray(out.tokens), _greedy_by_full_passes(canvas, settings))


def test_sampling_is_batch_invariant_and_one_compile():
  settings = SamplerSettings(temperature=1.0, top_k=20, top_p=0.9)
  decode = jit_decode(CFG, settings)
  batch = make_canvas([prefix(p, 10) for p in PROMPTS], length=24)
  together = np.asarray(decode(PARAMS, batch, jax.random.key(7)).tokens)
  for row, prompt in enumerate(PROMPTS):
    alone = make_canvas([prefix(prompt, 10)], length=24, streams=[row])
    np.testing.assert_array_equal(np.asarray(decode(PARAMS, alone, jax.random.key(7)).tokens)[0], together[row])
  assert decode._cache_size() == 2  # One compilation per batch shape.


def test_nfe_counts_prefill_and_decoding_passes():
  canvas = make_canvas([prefix([2, 9, 9], 6)], length=24)
  out = jit_decode(CFG, SamplerSettings(temperature=0.0, min_length=6))(PARAMS, canvas, jax.random.key(0))
  assert int(out.steps) == 6  # Prefill gives the first token; five passes give the other five.
  with pytest.raises(ValueError, match="causal"):
    jit_decode(dataclasses.replace(CFG, causal=False), SamplerSettings())
