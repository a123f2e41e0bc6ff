"""The ``kv-retrieval`` corpus (``mercury_jax.data.retrieval``): its records, its needle prompts and ``prepare``."""

import json

import numpy as np
import pytest

from mercury_jax import kinds as K, prepare as prepare_lib
from mercury_jax.data import pipeline, records, retrieval as R
from mercury_jax.data.tokenizer import train_tokenizer

SEQ_LEN = 96


@pytest.fixture(scope="module")
def tokenizer():
  return train_tokenizer(R.tokenizer_texts(R.RetrievalSpec()), 4096)


def test_every_symbol_is_one_token_and_text_round_trips(tokenizer):
  symbols = R.Symbols.of(tokenizer)
  assert len(set(symbols.ids.tolist())) == len(R.TEXTS)  # distinct tokens
  sym, _ = R.record(np.random.default_rng(3), R.RetrievalSpec(), 512)
  assert tokenizer.encode(R.Symbols.text(sym[:-1])) == symbols.tokens(sym[:-1]).tolist()
  assert symbols.tokens([-1]).tolist() == [tokenizer.eos_id]


def test_a_tokenizer_that_splits_the_words_is_refused(data_dir):
  from mercury_jax.data.tokenizer import Tokenizer

  with pytest.raises(ValueError, match="one token"):
    R.Symbols.of(Tokenizer.load(data_dir / "tokenizer.model"))  # trained on Python, not on the lexicon


def test_a_record_holds_one_needle_per_key_and_queries_them_with_their_values():
  spec = R.RetrievalSpec(keys=8, queries=5)
  sym, kinds = R.record(np.random.default_rng(0), spec, SEQ_LEN)
  assert sym.shape == kinds.shape == (SEQ_LEN,) and sym[-1] == -1
  length = spec.haystack_length(SEQ_LEN)
  haystack, queries = sym[:length], sym[length:-1].reshape(5, 3)
  keys = np.flatnonzero(haystack < R.VALUE_SYMBOL)
  assert sorted(haystack[keys].tolist()) == list(range(8))  # one needle of each of the first 8 keys
  value_of = {int(haystack[i]): int(haystack[i + 1]) for i in keys}
  for k, v in value_of.items():  # each value comes from its key's own set
    assert R.VALUE_SYMBOL + k * R.VALUES_PER_KEY <= v < R.VALUE_SYMBOL + (k + 1) * R.VALUES_PER_KEY
  assert (queries[:, 0] == R.QUERY_SYMBOL).all() and len(set(queries[:, 1].tolist())) == 5
  assert all(value_of[int(k)] == int(v) for _, k, v in queries)  # the answer is the needle's value
  others = np.delete(haystack, np.concatenate([keys, keys + 1]))
  assert (others >= R.FILLER_SYMBOL).all() and (others < R.QUERY_SYMBOL).all()
  target = np.flatnonzero(kinds == K.TARGET)
  np.testing.assert_array_equal(target, [*(length + 2 + 3 * np.arange(5)), SEQ_LEN - 1])  # the values and EOS
  assert (kinds[kinds != K.TARGET] == K.FIXED).all()


def test_records_are_reproducible_and_differ_by_seed_and_split(tokenizer):
  symbols = R.Symbols.of(tokenizer)
  spec = R.RetrievalSpec(records=6, validation=3)
  a, b = R.records(spec, "train", SEQ_LEN, symbols), R.records(spec, "train", SEQ_LEN, symbols)
  np.testing.assert_array_equal(a, b)
  assert a.shape == (6, 2, SEQ_LEN) and R.records(spec, "validation", SEQ_LEN, symbols).shape == (3, 2, SEQ_LEN)
  other = R.records(R.RetrievalSpec(records=6, seed=1), "train", SEQ_LEN, symbols)
  assert not np.array_equal(a[:, 0], other[:, 0])
  assert not np.array_equal(a[:3, 0], R.records(spec, "validation", SEQ_LEN, symbols)[:, 0])
  values = a[:, 0][a[:, 1] == K.TARGET]
  assert len(set(values.tolist())) > 10  # values vary from record to record: nothing to memorise


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.77, 1.0])
def test_a_needle_prompt_has_its_length_and_its_needle_at_the_depth(tokenizer, depth):
  needle = R.needle(np.random.default_rng(1), 1000, depth)
  ids = tokenizer.encode(needle.prompt)
  assert len(ids) == 1000
  key, value = ids[needle.position], ids[needle.position + 1]
  assert ids[-1] == key and ids[-2] == tokenizer.encode(R.QUERY)[0]  # the query asks for the needle's key
  assert tokenizer.id_to_piece(value) == needle.answer.replace(" ", "\u2581")
  assert ids[:-2].count(key) == 1  # one needle per key
  assert abs(needle.depth - depth) < 0.02 and needle.position == round(needle.depth * (1000 - 4))


def test_specs_parse_and_bad_ones_name_the_field():
  assert R.parse_spec("kv-retrieval") == R.RetrievalSpec()
  spec = R.parse_spec("kv-retrieval:records=10,keys=4,queries=2,seed=7")
  assert (spec.records, spec.keys, spec.queries, spec.seed) == (10, 4, 2, 7)
  assert spec.spec == "kv-retrieval:records=10,keys=4,queries=2,seed=7"
  for bad, message in [
    ("kv-retrieval:colour=3", "must be name=value"),
    ("kv-retrieval:records=-1", "non-negative integer"),
    ("kv-retrieval:keys=17", "keys=17 must lie in"),
    ("kv-retrieval:keys=4,queries=5", "queries=5 must lie in"),
  ]:
    with pytest.raises(ValueError, match=message):
      R.parse_spec(bad)
  with pytest.raises(ValueError, match="cannot hold"):
    R.RetrievalSpec().haystack_length(32)


def test_prepare_writes_the_records_the_trainer_reads(tmp_path):
  out = tmp_path / "kv"
  spec = "kv-retrieval:records=20,validation=4,seed=3"
  assert prepare_lib.main(["--corpus", spec, "--out", str(out), "--seq-len", str(SEQ_LEN), "--shards", "2"]) == 0
  meta = pipeline.read_metadata(out)
  assert meta["mode"] == "sft" and meta["corpus"] == spec and meta["seq_len"] == SEQ_LEN
  assert json.loads((out / "manifest.json").read_text())["kind"] == R.SPEC
  tokenizer = pipeline.load_data_tokenizer(out)
  stored = records.read_shards([out / name for name in meta["splits"]["train"]["shards"]])
  np.testing.assert_array_equal(stored, R.records(R.parse_spec(spec), "train", SEQ_LEN, R.Symbols.of(tokenizer)))
  assert meta["splits"]["train"]["target_tokens"] == 20 * (8 + 1)  # 8 values and the EOS per record
  batch = next(iter(pipeline.train_dataset(out, seq_len=SEQ_LEN, global_batch_size=4, seed=0)))
  assert batch["tokens"].shape == (4, SEQ_LEN) and (batch["kinds"] == K.TARGET).sum() == 4 * 9


def test_prepare_refuses_to_mix_the_generated_corpus(tmp_path, capsys):
  code = prepare_lib.main(["--corpus", "kv-retrieval", "--corpus", "python-stdlib", "--out", str(tmp_path / "o")])
  assert code == 2 and "prepare it alone" in capsys.readouterr().err
  code = prepare_lib.main(["--corpus", "kv-retrieval:keys=99", "--out", str(tmp_path / "o")])
  assert code == 2 and "keys=99" in capsys.readouterr().err
