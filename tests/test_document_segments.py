"""Long packed records keep their documents apart (``data.document_segments``): each document of an LM record is its
own attention segment, from the EOS that ends it, so no token attends across files; training and evaluation run
on those segments."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from mercury_jax import kinds as K, sharding as sh
from mercury_jax.config import ConfigError, load_config
from mercury_jax.data import pipeline, records
from mercury_jax.model import Transformer
from mercury_jax.trainer import Trainer

EOS = 3


def test_segments_count_the_documents_of_a_record_and_padding_is_zero():
  tokens = np.asarray([[7, 8, EOS, 9, EOS, 10, 11, 0, 0], [EOS, 5, 6, 7, 8, 9, 10, 11, 12]])
  kinds = np.asarray([[2] * 7 + [0, 0], [2] * 9])
  np.testing.assert_array_equal(
    records.document_segments(tokens, kinds, EOS), [[1, 1, 1, 2, 2, 3, 3, 0, 0], [1, 2, 2, 2, 2, 2, 2, 2, 2]]
  )


@pytest.fixture(scope="module")
def long_records(tmp_path_factory, data_dir):
  """The fixture corpus packed into records of 512 tokens: several documents per record."""
  from mercury_jax.prepare import main as prepare_main

  out = tmp_path_factory.mktemp("long") / "data"
  from conftest import FIXTURES

  corpus = str(FIXTURES / "corpus" / "**" / "*")
  assert prepare_main(["--corpus", corpus, "--out", str(out), "--vocab-size", "400", "--seq-len", "512"]) in (0, None)
  return out


def test_batches_carry_document_segments_that_isolate_each_document(long_records):
  (batch,) = pipeline.eval_batches(long_records, "train", seq_len=512, global_batch_size=2, num_batches=1)
  assert set(batch) == {"tokens", "kinds"}
  (batch,) = pipeline.eval_batches(
    long_records, "train", seq_len=512, global_batch_size=2, num_batches=1, document_segments=True
  )
  tokens, kinds, segments = batch["tokens"], batch["kinds"], batch["segments"]
  assert segments.max() >= 2  # a record holds the end of one document and the start of another
  np.testing.assert_array_equal(segments, records.document_segments(tokens, kinds, EOS))
  stream = next(iter(pipeline.train_dataset(long_records, seq_len=512, global_batch_size=2, seed=0,
                                            document_segments=True)))  # fmt: skip
  np.testing.assert_array_equal(stream["segments"], records.document_segments(stream["tokens"], stream["kinds"], EOS))
  # Through the model: changing the first document of a row changes no output of the second one with these
  # segments, and does without them (one segment for the whole record).
  row = int(np.argmax(segments.max(axis=1)))
  first = segments[row] == 1
  cfg = load_config("tiny", {"model.max_length": "512", "model.vocab_size": "400", "model.attention": "xla"}).model
  model = Transformer(cfg)
  params = nn.meta.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"]
  edited = np.where(first, (tokens[row] + 11) % 390 + 5, tokens[row])
  second = segments[row] == 2
  for segment_ids, isolated in ((segments[row : row + 1], True), (K.segment_ids(kinds[row : row + 1]), False)):
    a, b = (
      model.apply({"params": params}, jnp.asarray(t)[None], segment_ids=segment_ids) for t in (tokens[row], edited)
    )
    same = np.allclose(np.asarray(a)[0, second], np.asarray(b)[0, second], atol=1e-5)
    assert same == isolated


def test_training_and_evaluation_run_on_document_segments(long_records, tmp_path):
  from mercury_jax.checkpoint import restore_params
  from mercury_jax.evaluate import evaluate_params
  from mercury_jax.train import train

  sets = {
    "data.path": str(long_records), "model.max_length": "512", "model.vocab_size": "400", "data.batch_size": "8",
    "train.steps": "2", "train.eval_every": "2", "train.eval_batches": "1", "optim.warmup_steps": "1",
    "data.document_segments": "true", "checkpoint.async_save": "false",
  }  # fmt: skip
  cfg = load_config("tiny", sets)
  trainer = Trainer(cfg, sh.make_mesh(cfg.mesh))
  assert trainer.batch_keys == ("tokens", "kinds", "segments")
  train(cfg, tmp_path, log=False, devices=jax.devices()[:1])  # No sharding under test.
  metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert np.isfinite(metrics[-1]["loss"]) and np.isfinite(metrics[-1]["eval_nats_per_token"])
  params, stored = restore_params(tmp_path)
  assert stored.data.document_segments
  out = evaluate_params(params, stored, long_records, t_samples=1, batch_size=8, max_batches=1)
  assert np.isfinite(out["nats_per_token"])


def test_document_segments_need_lm_records(tmp_path, data_dir):
  from mercury_jax.train import _check_data

  cfg = load_config("tiny", {"data.document_segments": "true", "model.max_length": "64", "model.vocab_size": "400"})
  meta = {**json.loads((data_dir / "metadata.json").read_text()), "mode": "sft"}
  with pytest.raises(ConfigError, match="data.document_segments needs packed LM records"):
    _check_data(cfg, meta)
