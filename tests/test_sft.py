"""End to end: SFT on answers of varied length teaches a diffusion model to end its answer with EOS.

``pack_sft`` pads each response with EOS targets to the record's end (LLaDA's SFT recipe), so a model trained on it
and sampled on a canvas longer than any answer writes the answer, then EOS to the end of the canvas; the sampler
turns everything after the first EOS into padding. Trained with ``PAD`` after the response instead, the model never
sees masks beyond the answer's EOS and fills such a canvas with answer tokens and stray EOS.
"""

import json
import os
import random
import subprocess
import sys

import pytest

from mercury_jax.prepare import main as prepare_main
from mercury_jax.sampling.sampler import Sampler

LETTERS = "abc"
MAX_COUNT = 8  # Answers of 1 .. MAX_COUNT tokens.
SEQ_LEN = 32
CANVAS = 16  # Generated positions: twice the longest answer.
TRAIN = {
  "model.max_length": str(SEQ_LEN),
  "model.vocab_size": "400",
  "data.batch_size": "16",
  "optim.learning_rate": "3e-3",
  "train.steps": "300",
  "train.eval_every": "0",
  "train.log_every": "100",
  "checkpoint.every": "300",
  "checkpoint.async_save": "false",
}
MIN_RIGHT = 20  # Of the 24 prompts; the model trained as above gets all 24 right on every seed tried.


def _answer(count: int, letter: str) -> str:
  return " ".join([letter] * count)


@pytest.fixture(scope="module")
def sampler(tmp_path_factory) -> Sampler:
  """A tiny diffusion model trained on "N x" -> "x x ... x" (N times); the answer length is set by the prompt."""
  root = tmp_path_factory.mktemp("sft")
  rng = random.Random(0)
  lines = []
  for _ in range(480):
    count, letter = rng.randint(1, MAX_COUNT), rng.choice(LETTERS)
    lines.append(json.dumps({"prompt": f"{count} {letter}", "response": _answer(count, letter)}))
  (root / "task.jsonl").write_text("\n".join(lines) + "\n")
  data = root / "data"
  args = ["--corpus", str(root / "task.jsonl"), "--out", str(data), "--vocab-size", "400", "--seq-len", str(SEQ_LEN)]
  assert prepare_main(args) == 0
  # The training command in a process of its own on one device: measured one after the other, the fixture took 49 s
  # training in the test process on the conftest's 8 simulated devices, 23-29 s this way (34 s at XLA's default
  # optimisation instead of the conftest's -O0).
  command = [sys.executable, "-m", "mercury_jax.train", "--config", "tiny", "--workdir", str(root / "run")]
  command += [arg for key, value in {**TRAIN, "data.path": str(data)}.items() for arg in ("--set", f"{key}={value}")]
  xla = [f for f in os.environ["XLA_FLAGS"].split() if not f.startswith("--xla_force_host_platform_device_count")]
  env = {**os.environ, "XLA_FLAGS": " ".join([*xla, "--xla_force_host_platform_device_count=1"])}
  done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=280)
  assert done.returncode == 0, done.stderr[-3000:]
  return Sampler.from_checkpoint(root / "run")


def test_sft_model_ends_answers_of_varied_length_with_eos_on_a_longer_canvas(sampler):
  prompts = [(count, letter) for count in range(1, MAX_COUNT + 1) for letter in LETTERS]
  texts = [f"{count} {letter}" for count, letter in prompts]
  eos = sampler.tokenizer.eos_id
  samples = sampler.generate(texts, length=CANVAS, steps=CANVAS, bos=True, temperature=0.0)
  # Each generated region is answer tokens, one EOS, then padding (which ``Sample.tokens`` drops).
  lengths, right = set(), 0
  for (count, letter), sample in zip(prompts, samples, strict=True):
    assert sample.tokens and sample.tokens[-1] == eos and eos not in sample.tokens[:-1], sample
    assert len(sample.tokens) < CANVAS, sample
    answer = sample.tokens[:-1]
    assert sample.text == sampler.tokenizer.decode(answer)
    lengths.add(len(answer))
    right += len(answer) == count and sample.text.split() == [letter] * count
  assert len(lengths) >= 3, lengths
  assert right >= MIN_RIGHT, [s.text for s in samples]

  # The model itself, not the sampler's padding, ends the answer: left alone it writes EOS to the end of the canvas.
  raw = sampler.generate(texts, length=CANVAS, steps=CANVAS, bos=True, temperature=0.0, eos_to_pad=False)
  ended = 0
  for sample in raw:
    assert len(sample.tokens) == CANVAS
    first = sample.tokens.index(eos) if eos in sample.tokens else CANVAS
    ended += first > 0 and all(t == eos for t in sample.tokens[first:])
  assert ended >= MIN_RIGHT, [s.tokens for s in raw]
