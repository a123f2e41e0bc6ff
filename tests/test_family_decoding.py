"""Converted public checkpoints decode as their families' own sampling loops do, token for token.

Each family's published greedy decoding rule is written here again, independently, as a numpy loop over the
reference network (transformers' own Llama / Qwen2 / Qwen3 classes, the architectures of LLaDA, Dream and SDAR, at
a tiny random shape: ``tests/hf_reference.py``): LLaDA's semi-autoregressive low-confidence remasking
(``generate.py``), Dream's entropy-ordered decoding on its time grid (``_sample`` with ``alg="entropy"``) and SDAR's
block decoding with a cache of block-causal keys and values (``generate.py``, ``low_confidence_static``). The
converted checkpoint then runs through this project's engine, and the tokens must be the same.

Two documented differences are applied to the references: the engine never proposes the mask, padding (unless it is
EOS), BOS or UNK ids, so the references never do either; and the engine runs with ``eos_to_pad=False`` (the
families' loops keep generating after an EOS and cut the text afterwards).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_reference import VOCAB, build, reference_logits  # noqa: E402

from mercury_jax.checkpoint import restore_params  # noqa: E402
from mercury_jax.convert import convert  # noqa: E402
from mercury_jax.sampling import canvas as cv  # noqa: E402
from mercury_jax.sampling.engine import BlockEngine  # noqa: E402
from mercury_jax.sampling.network import Network  # noqa: E402
from mercury_jax.sampling.plan import Decoding, plan_blocks, plan_for  # noqa: E402
from mercury_jax.sampling.settings import SamplerSettings  # noqa: E402

PROMPTS = [[20, 31, 42, 53, 64], [70, 81, 92]]


def _banned(logits: np.ndarray, special: dict) -> np.ndarray:
  """The ids the engine never proposes (mask, BOS, UNK; padding unless it is EOS), removed from a reference's logits."""
  logits = logits.astype(np.float64).copy()
  for name in ("mask_id", "bos_id", "unk_id", "pad_id"):
    if special.get(name) is not None and special[name] != special["eos_id"]:
      logits[..., special[name]] = -np.inf
  return logits


def _softmax(logits: np.ndarray) -> np.ndarray:
  p = np.exp(logits - logits.max(-1, keepdims=True))
  return p / p.sum(-1, keepdims=True)


def _forward(model, ids: np.ndarray, mask: str, block: int = 0) -> np.ndarray:
  """The reference network's logits [length, vocab] of one row."""
  return reference_logits(model, ids[None], mask, block)[0]


def llada_generate(model, prompt, gen_length, block_length, steps, special):
  """LLaDA's ``generate`` at temperature 0 with ``remasking='low_confidence'`` (ML-GSAI/LLaDA generate.py)."""
  mask_id = special["mask_id"]
  x = np.concatenate([prompt, np.full(gen_length, mask_id)]).astype(np.int64)
  start = len(prompt)
  blocks = gen_length // block_length
  per_block = steps // blocks
  for b in range(blocks):
    lo, hi = start + b * block_length, start + (b + 1) * block_length
    masked = int((x[lo:hi] == mask_id).sum())
    counts = [masked // per_block + (i < masked % per_block) for i in range(per_block)]  # get_num_transfer_tokens
    for i in range(per_block):
      is_mask = x == mask_id
      logits = _banned(_forward(model, x, "bidirectional"), special)
      x0 = logits.argmax(-1)
      p = _softmax(logits)
      confidence = np.take_along_axis(p, x0[:, None], -1)[:, 0]
      confidence[hi:] = -np.inf
      confidence = np.where(is_mask, confidence, -np.inf)
      chosen = np.argsort(-confidence, kind="stable")[: counts[i]]
      x[chosen] = x0[chosen]
  return x[start:]


def dream_generate(model, prompt, max_new_tokens, steps, special, eps=1e-3):
  """Dream's ``_sample`` with ``alg="entropy"``, temperature 0, top_p 1 (HKUNLP/Dream generation_utils.py)."""
  mask_id = special["mask_id"]
  x = np.concatenate([prompt, np.full(max_new_tokens, mask_id)]).astype(np.int64)
  timesteps = np.linspace(1, eps, steps + 1, dtype=np.float32)
  for i in range(steps):
    is_mask = x == mask_id
    logits = _forward(model, x, "bidirectional")
    logits = np.concatenate([logits[:1], logits[:-1]])  # shifted: position i reads the output at i - 1
    logits = _banned(logits, special)
    p = _softmax(logits)
    x0 = p.argmax(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
      confidence = np.where(p > 0, p * np.log(p + 1e-10), 0.0).sum(-1)  # negative entropy
    t, s = timesteps[i], timesteps[i + 1]
    num_mask = np.float32(is_mask.sum())
    n = int(num_mask * (np.float32(1) - s / t)) if i < steps - 1 else int(num_mask)
    confidence = np.where(is_mask, confidence, -np.inf)
    if n > 0:
      chosen = np.argsort(-confidence, kind="stable")[:n]
      x[chosen] = x0[chosen]
  return x[len(prompt) :]


def sdar_generate(model, prompt, gen_length, block_length, steps, special):
  """SDAR's block decoding, greedy, ``low_confidence_static`` (JetAstra/SDAR generate.py): blocks attend causally to
  the blocks before them and bidirectionally within; the prompt's last partial block is denoised with it fixed."""
  mask_id = special["mask_id"]
  num_blocks = -(-(len(prompt) + gen_length) // block_length)
  x = np.full(num_blocks * block_length, mask_id, np.int64)
  x[: len(prompt)] = prompt
  counts = [block_length // steps + (i < block_length % steps) for i in range(steps)]
  for b in range(len(prompt) // block_length, num_blocks):
    lo, hi = b * block_length, (b + 1) * block_length
    for step in range(steps):
      is_mask = x[lo:hi] == mask_id
      if not is_mask.any():
        break
      logits = _banned(_forward(model, x[:hi], "block_causal", block_length)[lo:hi], special)
      x0 = logits.argmax(-1)
      confidence = np.where(is_mask, np.take_along_axis(_softmax(logits), x0[:, None], -1)[:, 0], -np.inf)
      chosen = np.argsort(-confidence, kind="stable")[: counts[step]]
      chosen = chosen[is_mask[chosen]]
      x[lo + chosen] = x0[chosen]
  return x[len(prompt) : len(prompt) + gen_length]


def _engine_tokens(out_dir, prompt, gen_length, steps_per_block, **knobs):
  params, cfg = restore_params(out_dir)
  params = jax.tree.map(lambda a: a.astype(jnp.float32), params)
  special = _special(out_dir)
  or_pad = lambda name: special[name] if special[name] is not None else special["pad_id"]  # noqa: E731
  canvas = cv.make_canvas([cv.prefix(list(prompt), gen_length)])
  length = canvas.tokens.shape[1]
  chosen = plan_for(cfg, Decoding(block_length=knobs.get("block_length", 0)), length)
  whole = chosen.whole_sequence and not knobs.get(
    "block_length"
  )  # the canvas as one block, unpadded (as the reference)
  block = length if whole else chosen.block
  plan = plan_blocks(canvas.kinds, block, cache=chosen.cache, whole_sequence=chosen.whole_sequence)
  settings = SamplerSettings(
    objective=cfg.objective, eos_id=special["eos_id"], pad_id=special["pad_id"], bos_id=or_pad("bos_id"),
    unk_id=or_pad("unk_id"), num_tokens=VOCAB, temperature=0.0, eos_to_pad=False, **knobs,
  ).validate()  # fmt: skip
  engine = BlockEngine(Network(cfg.model), settings, plan)
  out = jax.jit(engine.sample)(params, canvas, jax.random.key(0), jnp.int32(steps_per_block))
  return np.asarray(out.tokens)[0, len(prompt) : len(prompt) + gen_length]


def _special(out_dir) -> dict:
  return json.loads((out_dir / "special_tokens.json").read_text())


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  root = tmp_path_factory.mktemp("families")
  made = {}
  for family in ("llada", "dream", "sdar"):
    model, _ = build(root / f"hf_{family}", family)
    made[family] = (model, convert(root / f"hf_{family}", root / family, dtype="float32"))
  return made


@pytest.mark.parametrize("prompt", [[20, 31, 42, 53], [70, 81, 92, 11, 12, 13, 14, 15]], ids=["prompt4", "prompt8"])
def test_llada_semi_autoregressive_low_confidence_remasking(converted, prompt):
  """LLaDA's blocks start at the prompt's end, the engine's at multiples of block_length from the canvas start: the
  same blocks when the prompt length is a multiple of block_length (README: "Run a public diffusion LLM")."""
  model, out = converted["llada"]
  want = llada_generate(model, np.array(prompt), gen_length=12, block_length=4, steps=9, special=_special(out))
  got = _engine_tokens(out, prompt, 12, 3, rule="confidence", block_length=4)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("prompt", PROMPTS, ids=["prompt5", "prompt3"])
def test_dream_entropy_ordered_decoding_on_its_time_grid(converted, prompt):
  model, out = converted["dream"]
  want = dream_generate(model, np.array(prompt), max_new_tokens=12, steps=7, special=_special(out))
  got = _engine_tokens(out, prompt, 12, 7, rule="confidence", confidence="entropy", commit_counts="timesteps")
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("prompt", PROMPTS, ids=["prompt5", "prompt3"])
def test_sdar_block_decoding_with_the_exact_cache(converted, prompt):
  """SDAR denoises whole blocks (a last block's positions past the length are masks that attend); the engine's canvas
  ends at the length asked for: the same blocks when prompt + length fills whole blocks."""
  model, out = converted["sdar"]
  length = 16 - len(prompt)  # a prompt's partial first block, then whole blocks
  want = sdar_generate(model, np.array(prompt), gen_length=length, block_length=4, steps=4, special=_special(out))
  got = _engine_tokens(out, prompt, length, 4, rule="confidence")
  np.testing.assert_array_equal(got, want)
