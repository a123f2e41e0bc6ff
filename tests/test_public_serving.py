"""A converted public checkpoint through every entry point: the sampler's text path with the checkpoint's tokenizer
and the OpenAI routes with its chat template, on a tiny Fast-dLLM v2 (shifted logits, blocks of 32 with the exact
cache, special ids far from 0-4)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_reference import build  # noqa: E402

from mercury_jax.convert import convert  # noqa: E402
from mercury_jax.sampling.sampler import Sampler  # noqa: E402
from mercury_jax.serve.config import ServeConfig  # noqa: E402
from mercury_jax.serve.routes import Options, create_app  # noqa: E402
from mercury_jax.serve.scheduler import Scheduler  # noqa: E402


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  root = tmp_path_factory.mktemp("fast_dllm_v2")
  build(root / "hf", "fast_dllm_v2")
  config = json.loads((root / "hf" / "config.json").read_text())
  (root / "hf" / "config.json").write_text(json.dumps({**config, "bd_size": 32}))  # Fast-dLLM v2's own block
  return convert(root / "hf", root / "model", max_length=64)


def test_the_sampler_reads_the_checkpoints_tokenizer_and_decoding_defaults(converted):
  sampler = Sampler.from_checkpoint(converted)
  special = json.loads((converted / "special_tokens.json").read_text())
  assert (sampler.tokenizer.eos_id, sampler.tokenizer.mask_id) == (special["eos_id"], special["mask_id"])
  assert sampler.cfg.objective.block_size == 32 and sampler.cfg.model.shifted_logits
  assert sampler.jobs.defaults() == {"temperature": 0.0, "top_p": 0.95}  # threshold 0.9 is the built-in one
  first, again = (sampler.generate("def add(a, b):", length=24, seed=s, token_healing=False)[0] for s in (0, 1))
  assert first.tokens == again.tokens  # the family's default is greedy: the seed does not matter
  assert 0 < len(first.tokens) <= 24 and special["mask_id"] not in first.tokens
  assert sampler.tokenizer.decode(first.tokens) == first.text


def test_the_server_starts_with_blocks_of_32_and_chats_with_the_checkpoints_template(converted):
  """Prefill buckets start at two blocks (a block of 32 once left the smallest bucket unusable and start-up failed);
  a chat request renders the checkpoint's template into one prompt."""
  scheduler = Scheduler(
    Sampler.from_checkpoint(converted), ServeConfig(slots=1, max_queue=8)
  )  # start-up is under test, not batches
  scheduler.start()
  try:
    client = TestClient(create_app(scheduler, None, Options("fast", token_healing=False)))
    messages = [{"role": "user", "content": "add two numbers"}]
    reply = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    rendered = scheduler.tokenizer.encode("<|im_start|>user\nadd two numbers<|im_end|>\n")
    assert body["usage"]["prompt_tokens"] == len(rendered)
    assert 1 <= body["usage"]["completion_tokens"] <= 6
  finally:
    scheduler.shutdown(0)
