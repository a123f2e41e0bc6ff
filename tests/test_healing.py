"""Token healing: a prompt that ends inside a token gets its last token re-generated, restricted to the tokens whose
text starts with its characters, by the block-diffusion engine and the autoregressive twin alike; the reply never
repeats them, and no other position is touched."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from random_models import random_checkpoint

from mercury_jax import sharding as sh
from mercury_jax.config import MeshConfig
from mercury_jax.data.tokenizer import NUM_SPECIAL
from mercury_jax.model import Transformer
from mercury_jax.sample import main
from mercury_jax.sampling import healing
from mercury_jax.sampling.sampler import Sampler

# A prompt ending in ':' (the data writes ':' and the newline as one token), in '(', in an indent, inside a word.
PROMPTS = ["def area(width, height):", "print(", "class Box:\n    def size(self):\n    ", "def fibon"]


@pytest.fixture(scope="module")
def samplers(tmp_path_factory, data_dir):
  root = tmp_path_factory.mktemp("healing")
  tokenizer = data_dir / "tokenizer.model"
  return {kind: Sampler.from_checkpoint(random_checkpoint(root, kind, tokenizer)) for kind in ("block_diffusion",
          "autoregressive", "whole_sequence")}  # fmt: skip


@pytest.mark.parametrize("prompt", PROMPTS)
def test_back_off_removes_the_last_token_and_exactly_its_characters(prompt, samplers):
  tokenizer = samplers["block_diffusion"].tokenizer
  ids = tokenizer.encode(prompt)
  kept, removed = healing.back_off(tokenizer, prompt, ids)
  assert kept == ids[:-1] and removed
  assert tokenizer.decode(kept) + removed == prompt


def test_nothing_is_backed_off_a_prompt_of_one_token(samplers):
  tokenizer = samplers["block_diffusion"].tokenizer
  one = next(p for p in ("(", "d", "x") if len(tokenizer.encode(p)) == 1)
  assert healing.back_off(tokenizer, one, tokenizer.encode(one)) == (tokenizer.encode(one), "")


@pytest.mark.parametrize("prefix", [":", "(", "    ", "on", "):"])
def test_the_healing_mask_allows_exactly_the_tokens_whose_text_starts_with_the_characters(prefix, samplers):
  """Checked against every token's decoded text; ids past the tokenizer (a padded model vocabulary) never."""
  tokenizer = samplers["block_diffusion"].tokenizer
  allowed = healing.allowed_tokens(tokenizer, prefix, tokenizer.vocab_size + 7)
  texts = {i: tokenizer.decode([i]) for i in range(NUM_SPECIAL, tokenizer.vocab_size)}
  expected = sorted(i for i, t in texts.items() if t.isascii() and t.startswith(prefix))
  assert np.flatnonzero(allowed).tolist() == expected and expected
  assert not allowed[tokenizer.vocab_size :].any()
  assert allowed[tokenizer.encode(prefix)[0]] == (tokenizer.decode(tokenizer.encode(prefix)[:1]) == prefix)
  with pytest.raises(ValueError, match="no token"):
    healing.allowed_tokens(tokenizer, "\u2603", tokenizer.vocab_size)  # Only halves of it (byte pieces) exist.


@pytest.mark.parametrize("kind", ["block_diffusion", "autoregressive"])
def test_the_reply_keeps_the_prompt_and_does_not_repeat_its_end(kind, samplers):
  sampler = samplers[kind]
  tokenizer = sampler.tokenizer
  for temperature in (0.0, 1.0):
    samples = sampler.generate(PROMPTS, length=24, temperature=temperature, seed=2)
    for prompt, sample in zip(PROMPTS, samples, strict=True):
      kept, removed = healing.back_off(tokenizer, prompt, tokenizer.encode(prompt))
      assert sample.healed == removed
      written = tokenizer.decode(sample.tokens)
      assert written.startswith(removed), (prompt, written)
      assert sample.text == written[len(removed) :]
      assert len(sample.tokens) <= 25  # the backed-off position plus the 24 asked for


def test_the_greedy_healed_token_is_the_twins_best_one_that_keeps_the_prompt(samplers):
  """The autoregressive twin at temperature 0: the first token is the argmax of the model's next-token distribution
  over the tokens the characters allow, and without healing over every token (EOS aside).

  The prompts decode as one batch, and the model's distributions come from one compiled pass over every prompt,
  backed off and whole, padded at the end: the twin is causal, so a row's padding leaves its last position alone.
  Prompt by prompt with eager passes, the same checks compiled 8 forward shapes and 6 decoding programs (60 s)."""
  sampler = samplers["autoregressive"]
  tokenizer, vocab_size = sampler.tokenizer, sampler.cfg.model.vocab_size
  ids = [tokenizer.encode(prompt) for prompt in PROMPTS]
  kept, removed = zip(*(healing.back_off(tokenizer, p, i) for p, i in zip(PROMPTS, ids, strict=True)), strict=True)
  rows = [*kept, *ids]
  tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)  # [rows, length]
  for row, row_ids in zip(tokens, rows, strict=True):
    row[: len(row_ids)] = row_ids
  logits = np.asarray(jax.jit(Transformer(sampler.cfg.model).apply)({"params": sampler.params}, jnp.asarray(tokens)))
  last = logits[np.arange(len(rows)), [len(r) - 1 for r in rows]]  # [rows, vocab]: each row's next-token logits
  healed = sampler.generate(PROMPTS, length=4, temperature=0.0)
  plain = sampler.generate(PROMPTS, length=4, temperature=0.0, token_healing=False, min_length=4)
  for i, prompt in enumerate(PROMPTS):
    allowed = np.flatnonzero(healing.allowed_tokens(tokenizer, removed[i], vocab_size))
    assert healed[i].tokens[0] == allowed[np.argmax(last[i][allowed])], prompt
    whole = last[len(PROMPTS) + i]
    assert plain[i].tokens[0] == NUM_SPECIAL + np.argmax(whole[NUM_SPECIAL : tokenizer.vocab_size]), prompt


@pytest.mark.parametrize("kind", ["block_diffusion", "autoregressive"])
def test_healing_restricts_the_backed_off_position_and_no_other(kind, samplers):
  """The healed position takes an allowed token; every later one is free, so this sharp random model writes tokens
  the mask forbids there (what it writes without healing too)."""
  sampler = samplers[kind]
  prompt = "def fibon"
  kept, removed = healing.back_off(sampler.tokenizer, prompt, sampler.tokenizer.encode(prompt))
  allowed = healing.allowed_tokens(sampler.tokenizer, removed, sampler.cfg.model.vocab_size)
  sample = sampler.generate(prompt, length=24, temperature=0.0)[0]
  assert allowed[sample.tokens[0]]
  assert not allowed[sample.tokens[1:]].all(), sample.tokens


@pytest.mark.parametrize("kind", ["block_diffusion", "autoregressive"])
def test_stream_gives_the_healed_text_generate_gives(kind, samplers):
  sampler = samplers[kind]
  kw = dict(length=20, temperature=1.0, seed=3)
  generated = sampler.generate(PROMPTS, **kw)
  streamed = [""] * len(PROMPTS)
  for event in sampler.stream(PROMPTS, **kw):
    streamed[event.index] += event.text
  assert streamed == [s.text for s in generated]


def test_a_healed_row_is_the_same_alone_in_a_batch_and_on_a_mesh(samplers, tmp_path, data_dir):
  sampler = samplers["block_diffusion"]
  alone = sampler.generate(PROMPTS[0], length=24, temperature=1.0, seed=5)[0]
  batch = ["x", PROMPTS[0], PROMPTS[3]]  # "x": one token, nothing to heal
  batched = sampler.generate(batch, length=24, temperature=1.0, seed=5, streams=[1, 0, 2])
  assert batched[1].tokens == alone.tokens and batched[0].healed == ""
  path = random_checkpoint(tmp_path, "block_diffusion", data_dir / "tokenizer.model")
  mesh = sh.make_mesh(MeshConfig(data=2, fsdp=2, tensor=1), devices=jax.devices()[:4])
  sharded = Sampler.from_checkpoint(path, mesh=mesh).generate(
    batch, length=24, temperature=1.0, seed=5, streams=[1, 0, 2]
  )
  assert [s.tokens for s in sharded] == [s.tokens for s in batched]


def test_healing_stays_off_where_it_does_not_apply(samplers):
  """Whole-sequence checkpoints, templates, structured output, and on request."""
  prompt = PROMPTS[0]
  assert samplers["whole_sequence"].generate(prompt, length=8, steps=4)[0].healed == ""
  bd = samplers["block_diffusion"]
  assert bd.generate(prompt, template=" = <mask:4>")[0].healed == ""
  assert bd.generate(prompt, length=8, constraint=bd.constraint(regex="[a-z]+"))[0].healed == ""
  off = bd.generate(prompt, length=8, token_healing=False, seed=1)[0]
  assert off.healed == "" and len(off.tokens) <= 8


def test_command_line_heals_by_default_and_not_with_the_flag(tmp_path, data_dir, capsys):
  path = random_checkpoint(tmp_path, "block_diffusion", data_dir / "tokenizer.model")
  args = ["--checkpoint", str(path), "--prompt", PROMPTS[0], "--length", "12", "--seed", "4", "--json"]
  assert main(args) == 0
  healed = json.loads(capsys.readouterr().out)
  assert main([*args, "--no-token-healing"]) == 0
  plain = json.loads(capsys.readouterr().out)
  # The Python API on the command's mesh (every device on the data axis) runs the programs the command compiled.
  sampler = Sampler.from_checkpoint(path, mesh=sh.make_mesh(MeshConfig(data=-1)))
  expected = sampler.generate(PROMPTS[0], length=12, seed=4)[0]
  assert healed["healed"] == expected.healed and expected.healed.endswith(":")
  assert healed["text"] == expected.text and healed["tokens"] == expected.tokens
  unhealed = sampler.generate(PROMPTS[0], length=12, seed=4, token_healing=False)[0]
  assert "healed" not in plain and plain["tokens"] == unhealed.tokens


def test_a_prompt_ending_in_a_character_of_byte_pieces_is_used_as_tokenised(samplers):
  """The last token of a character written as byte pieces is a byte, whose text no token starts with: nothing is
  backed off, and generation goes on from the prompt as tokenised."""
  sampler = samplers["block_diffusion"]
  prompt = "x = '\u2603"  # The snowman is three byte pieces in this tokenizer.
  assert healing.back_off(sampler.tokenizer, prompt, sampler.tokenizer.encode(prompt))[1] == ""
  assert not healing.healable(sampler.tokenizer, "\u2603") and healing.healable(sampler.tokenizer, ":")
  (sample,) = sampler.generate(prompt, length=8, seed=1)
  assert sample.healed == "" and len(sample.tokens) <= 8
