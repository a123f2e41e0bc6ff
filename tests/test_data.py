"""Tests of mercury_jax.data (corpora, tokenizer, records, grain pipeline) and the prepare CLI."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import sentencepiece as spm
from jax.sharding import PartitionSpec as P

from mercury_jax import prepare as prepare_lib, sharding
from mercury_jax.config import MeshConfig
from mercury_jax.data import corpus, pipeline, records, sources
from mercury_jax.data.tokenizer import Tokenizer, train_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
CORPUS_GLOB = str(FIXTURES / "corpus" / "**" / "*")
SFT_JSONL = str(FIXTURES / "sft.jsonl")
SEQ_LEN = 32
SFT_SEQ_LEN = 64
CODE = "def f(x):\n\tif x:\n        return 'naïve 😀 中文'  # two  spaces\n\n\nclass A:\r\n  pass\n"


def _sha1_split(key: str) -> str:
  return "validation" if int(hashlib.sha1(key.encode()).hexdigest(), 16) % 20 == 0 else "train"


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory) -> Path:
  out = tmp_path_factory.mktemp("prepared") / "lm"
  prepare_lib.prepare(CORPUS_GLOB, out, vocab_size=512, seq_len=SEQ_LEN, num_shards=3, log=lambda _: None)
  return out


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory, lm_dir) -> Path:
  out = tmp_path_factory.mktemp("prepared") / "sft"
  prepare_lib.prepare(
    SFT_JSONL,
    out,
    tokenizer_path=str(lm_dir / "tokenizer.model"),
    seq_len=SFT_SEQ_LEN,
    num_shards=2,
    log=lambda _: None,
  )
  return out


@pytest.fixture(scope="module")
def tokenizer(lm_dir) -> Tokenizer:
  return pipeline.load_data_tokenizer(lm_dir)


def _take(dataset, n):
  iterator = iter(dataset)
  return [next(iterator) for _ in range(n)]


def _assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b, strict=True):
    np.testing.assert_array_equal(x["tokens"], y["tokens"])
    np.testing.assert_array_equal(x["kinds"], y["kinds"])


# ----------------------------------------------------------------------------------------------- corpus


def test_stdlib_filter_on_a_fake_tree(tmp_path):
  files = {
    "os.py": "import sys\n",
    "json/decoder.py": "x = 1\n",
    "test/support.py": "x = 1\n",
    "tests/a.py": "x = 1\n",
    "idlelib/run.py": "x = 1\n",
    "lib2to3/fixer.py": "x = 1\n",
    "encodings/utf_8.py": "x = 1\n",
    "site-packages/pkg/mod.py": "x = 1\n",
    "sqlite3/test_dbapi.py": "x = 1\n",
    "email/mime/__init__.py": "",
    "broken.py": "def f(:\n",
    "accents.py": "s = 'café'\n",
    "big.py": "x = 1\n" * 40_000,
    "README.txt": "not python\n",
    "xml/dom/minidom.py": "y = 2\n",
  }
  for name, text in files.items():
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(text, encoding="utf-8")
  result = corpus.stdlib_corpus(tmp_path)
  assert [d.key for d in result.documents] == ["json/decoder.py", "os.py", "xml/dom/minidom.py"]
  assert [d.split for d in result.documents] == [_sha1_split(d.key) for d in result.documents]
  manifest = result.manifest()
  assert (
    manifest["python_version"]
    and manifest["splits"]["train"]["documents"] + manifest["splits"]["validation"]["documents"] == 3
  )
  assert manifest["files"][1] == {
    "path": "os.py",
    "sha256": hashlib.sha256(b"import sys\n").hexdigest(),
    "characters": 11,
    "documents": 1,
  }


def test_real_stdlib_corpus_is_filtered_and_split_by_path_hash():
  result = corpus.stdlib_corpus()
  keys = [d.key for d in result.documents]
  assert keys == sorted(keys) and "os.py" in keys and "json/decoder.py" in keys
  assert not any(set(k.split("/")[:-1]) & corpus.STDLIB_SKIP_DIRS for k in keys)
  assert not any(k.rsplit("/", 1)[-1].startswith("test_") for k in keys)
  assert all(d.text.isascii() and d.text for d in result.documents)
  assert all(d.split == _sha1_split(d.key) for d in result.documents)
  validation = result.split("validation")
  assert 0 < len(validation) < len(result.documents) // 10


def test_text_glob_keys_are_relative_to_the_glob_root():
  result = sources.load_corpus(CORPUS_GLOB)
  assert result.kind == "text" and result.mode == "lm"
  assert [d.key for d in result.documents] == [
    "calc.py",
    "notes.txt",
    "parser.py",
    "pkg/stats.py",
    "poem.txt",
    "shapes.py",
  ]
  assert [d.key for d in result.split("validation")] == ["parser.py"]
  for entry in result.manifest()["files"]:
    data = (FIXTURES / "corpus" / entry["path"]).read_bytes()
    assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert entry["characters"] == len(data.decode("utf-8"))


def test_jsonl_sft_corpus_splits_by_line_index():
  result = sources.load_corpus(SFT_JSONL)
  assert result.kind == "jsonl" and result.mode == "sft" and len(result.documents) == 60
  (held_out,) = result.split("validation")
  assert held_out.key == "sft.jsonl:54" and _sha1_split("53") == "validation"
  first = json.loads(Path(SFT_JSONL).read_text().splitlines()[0])
  assert (result.documents[0].prompt, result.documents[0].text) == (first["prompt"], first["response"])


@pytest.mark.parametrize(
  "line, message",
  [
    ('{"text": "ok"', "invalid JSON"),
    ('["text"]', "expected a JSON object"),
    ('{"txt": "a"}', "expected keys"),
    ('{"text": 3}', "'text' must be a string"),
    ('{"prompt": "p", "response": "r"}', "do not mix"),
  ],
)
def test_bad_jsonl_lines_name_file_and_line(tmp_path, line, message):
  path = tmp_path / "data.jsonl"
  path.write_text('{"text": "fine"}\n\n' + line + "\n")
  with pytest.raises(ValueError, match=message) as info:
    sources.load_corpus(str(path))
  assert f"{path}:3" in str(info.value)


def test_jsonl_text_lines_are_language_modelling(tmp_path):
  path = tmp_path / "lm.jsonl"
  path.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(25)))
  result = sources.load_corpus(str(path))
  assert result.mode == "lm" and [d.prompt for d in result.documents] == [None] * 25
  assert [d.split for d in result.documents] == [_sha1_split(str(i)) for i in range(25)]


# ----------------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_special_ids_and_round_trip(tokenizer):
  assert (tokenizer.pad_id, tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.mask_id) == (0, 1, 2, 3, 4)
  assert [tokenizer.id_to_piece(i) for i in range(5)] == ["<pad>", "<unk>", "<s>", "</s>", "[MASK]"]
  for text in (CODE, "    indented\n\ttabbed\n", " leading space", "[MASK] in text", "", "x" * 3000):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert not set(ids) & {0, 1, 2, 3, 4}, text
    assert max(ids, default=0) < tokenizer.vocab_size
  prompt, response = "def f(x):\n", "  return x\n"
  assert tokenizer.decode(tokenizer.encode(prompt) + tokenizer.encode(response)) == prompt + response
  assert tokenizer.encode_batch([CODE, "abc"]) == [tokenizer.encode(CODE), tokenizer.encode("abc")]


def test_tokenizer_decode_is_robust_to_special_and_bad_ids(tokenizer):
  a, b = tokenizer.encode("alpha"), tokenizer.encode(" beta")
  ids = [2, *a, 4, 4, *b, 3, *tokenizer.encode("gamma"), 0, 0]
  assert tokenizer.decode(ids) == "alpha betagamma"
  assert tokenizer.decode(np.asarray(ids, np.int32), stop_at_eos=True) == "alpha beta"
  assert tokenizer.decode(ids, mask_text="_", stop_at_eos=True) == "alpha__ beta"
  assert tokenizer.decode([*a, tokenizer.vocab_size + 7, -1]) == "alpha ⁇  ⁇ "


def test_tokenizer_serialisation(tmp_path, tokenizer):
  tokenizer.save(tmp_path / "t.model")
  loaded = Tokenizer.load(tmp_path / "t.model")
  again = Tokenizer.from_bytes(tokenizer.to_bytes())
  assert loaded.to_bytes() == tokenizer.to_bytes() == again.to_bytes()
  assert loaded.encode(CODE) == tokenizer.encode(CODE) and loaded.vocab_size == tokenizer.vocab_size


def test_train_tokenizer_is_deterministic_and_checks_vocab_size():
  texts = [(FIXTURES / "corpus" / name).read_text() for name in ("calc.py", "shapes.py", "notes.txt")]
  first, second = train_tokenizer(texts, 400), train_tokenizer(texts, 400)
  assert first.to_bytes() == second.to_bytes()
  assert 261 < first.vocab_size <= 400
  with pytest.raises(ValueError, match="vocab_size=300 is too small"):
    train_tokenizer(texts, 300)


def test_tokenizer_rejects_models_with_other_special_ids(tmp_path):
  model = tmp_path / "plain"
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(["hello world"] * 10),
    model_prefix=str(model),
    vocab_size=30,
    hard_vocab_limit=False,
    minloglevel=2,
  )
  with pytest.raises(ValueError, match="special ids"):
    Tokenizer.load(f"{model}.model")
  with pytest.raises(ValueError, match="cannot read tokenizer"):
    Tokenizer.load(tmp_path / "missing.model")


# ----------------------------------------------------------------------------------------------- records


def test_pack_lm_separates_documents_with_eos_and_pads_the_tail():
  docs = [[10, 11, 12], [13], [14, 15, 16, 17, 18]]
  packed = records.pack_lm(docs, 4, eos_id=3, pad_id=0)
  assert packed.shape == (3, 2, 4) and packed.dtype == np.int32
  np.testing.assert_array_equal(packed[:, 0].reshape(-1), [10, 11, 12, 3, 13, 3, 14, 15, 16, 17, 18, 3])
  np.testing.assert_array_equal(packed[:, 1].reshape(-1), [2] * 12)
  tail = records.pack_lm([[10, 11]], 4, eos_id=3, pad_id=0)
  np.testing.assert_array_equal(tail[0], [[10, 11, 3, 0], [2, 2, 2, 0]])
  assert records.pack_lm([], 4, eos_id=3, pad_id=0).shape == (0, 2, 4)


def test_pack_sft_pads_the_response_with_eos_targets_to_the_end_of_the_record():
  examples = [([7, 8], [9]), ([7] * 5, [9] * 5), ([], [9, 9]), ([7, 7], [9, 9]), ([7, 7, 7], [9, 9])]
  packed, skipped = records.pack_sft(examples, 6, bos_id=2, eos_id=3)
  assert skipped == [1, 4]  # 1 + prompt + response + EOS > seq_len: skipped, never truncated.
  assert packed.shape == (3, 2, 6) and packed.dtype == np.int32
  # [BOS] + prompt is FIXED; response, its EOS and EOS to the end of the record are TARGET; no PAD anywhere.
  np.testing.assert_array_equal(packed[0], [[2, 7, 8, 9, 3, 3], [1, 1, 1, 2, 2, 2]])
  np.testing.assert_array_equal(packed[1], [[2, 9, 9, 3, 3, 3], [1, 2, 2, 2, 2, 2]])
  np.testing.assert_array_equal(packed[2], [[2, 7, 7, 9, 9, 3], [1, 1, 1, 2, 2, 2]])  # An exact fit: EOS only.
  assert not (packed[:, 1] == records.PAD).any()
  assert records.record_stats(packed) == {"records": 3, "tokens": 18, "target_tokens": 11, "prompt_tokens": 7}
  assert records.record_stats(packed, eos_id=3)["eos_padding_tokens"] == 3
  assert records.pack_sft([([7] * 9, [])], 6, bos_id=2, eos_id=3)[0].shape == (0, 2, 6)


def test_record_bytes_round_trip_and_length_check():
  record = np.asarray([[5, 6, 0], [2, 2, 0]], np.int32)
  data = records.encode_record(record)
  assert len(data) == 2 * 3 * 4
  decoded = records.decode_record(data, 3)
  np.testing.assert_array_equal(decoded["tokens"], [5, 6, 0])
  np.testing.assert_array_equal(decoded["kinds"], [2, 2, 0])
  assert decoded["tokens"].dtype == np.int32
  with pytest.raises(ValueError, match="--seq-len"):
    records.decode_record(data, 4)


# ----------------------------------------------------------------------------------------------- prepare


def test_prepare_lm_end_to_end(lm_dir, tokenizer):
  metadata = pipeline.read_metadata(lm_dir)
  manifest = json.loads((lm_dir / "manifest.json").read_text())
  assert metadata["mode"] == "lm" and metadata["seq_len"] == SEQ_LEN and metadata["format_version"] == 1
  assert metadata["vocab_size"] == tokenizer.vocab_size
  assert [metadata[f"{k}_id"] for k in ("pad", "bos", "eos", "mask")] == [0, 2, 3, 4]
  source = sources.load_corpus(CORPUS_GLOB)
  for split in ("train", "validation"):
    meta = metadata["splits"][split]
    assert meta["shards"] and all((lm_dir / name).is_file() for name in meta["shards"])
    packed = records.read_shards([lm_dir / name for name in meta["shards"]])
    assert packed.shape == (meta["records"], 2, SEQ_LEN)
    kinds, tokens = packed[:, 1].reshape(-1), packed[:, 0].reshape(-1)
    # All target tokens first, then only padding (pad ids) in the last record.
    n = meta["target_tokens"]
    assert n == meta["tokens"] and (kinds[:n] == 2).all() and (kinds[n:] == 0).all() and (tokens[n:] == 0).all()
    assert len(kinds) - n < SEQ_LEN
    # The EOS-separated token stream decodes back to the split's documents, in order.
    texts = [d.text for d in source.split(split)]
    assert tokens[n - 1] == 3 and int((tokens[:n] == 3).sum()) == len(texts)
    pieces = np.split(tokens[:n], np.nonzero(tokens[:n] == 3)[0] + 1)[:-1]
    assert [tokenizer.decode(p) for p in pieces] == texts
    assert meta["characters"] == sum(map(len, texts)) == manifest["splits"][split]["characters"]
    assert meta["documents"] == len(texts)


def test_prepare_sft_end_to_end(sft_dir, tokenizer):
  metadata = pipeline.read_metadata(sft_dir)
  assert metadata["mode"] == "sft" and metadata["tokenizer"]["trained"] is False
  train = metadata["splits"]["train"]
  assert train["skipped_documents"] == 1 and train["documents"] == 58 and train["records"] == 58
  packed = records.read_shards([sft_dir / name for name in train["shards"]])
  docs = [d for d in sources.load_corpus(SFT_JSONL).split("train") if d.key != "sft.jsonl:11"]
  eos_padding = 0
  for (ids, kinds), doc in zip(packed, docs, strict=True):
    prompt, response = [tokenizer.bos_id, *tokenizer.encode(doc.prompt)], tokenizer.encode(doc.text)
    end = len(prompt) + len(response)
    # [BOS] + prompt (FIXED), then the response and EOS to the end of the record (TARGET); no PAD.
    assert (kinds[: len(prompt)] == 1).all() and (kinds[len(prompt) :] == 2).all()
    np.testing.assert_array_equal(ids[:end], prompt + response)
    assert end < SFT_SEQ_LEN and (ids[end:] == tokenizer.eos_id).all()
    assert tokenizer.decode(ids[kinds == 2]) == doc.text
    eos_padding += SFT_SEQ_LEN - end - 1
  assert train["characters"] == sum(len(d.text) for d in docs)  # EOS padding has no characters.
  assert train["prompt_tokens"] == int((packed[:, 1] == 1).sum())
  assert train["target_tokens"] == int((packed[:, 1] == 2).sum()) == train["tokens"] - train["prompt_tokens"]
  assert train["eos_padding_tokens"] == eos_padding > 0


def _run_main(capsys, *argv):
  code = prepare_lib.main(list(argv))
  captured = capsys.readouterr()
  return code, captured.err.strip().splitlines()


@pytest.mark.parametrize(
  "case, expected",
  [
    ("no_match", "matches no files"),
    ("not_utf8", "is not UTF-8"),
    ("bad_jsonl", "bad.jsonl:2: invalid JSON"),
    ("vocab", "--vocab-size 100 is too small"),
    ("seq_len", "--seq-len 4 is too short"),
    ("tokenizer", "cannot read tokenizer"),
    ("nothing_fits", "no train example fits in --seq-len 8"),
  ],
)
def test_prepare_bad_input_exits_2_with_one_line(tmp_path, capsys, case, expected):
  (tmp_path / "raw.bin").write_bytes(b"\xff\xfe\x00abc")
  (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{oops\n')
  (tmp_path / "long.jsonl").write_text(json.dumps({"prompt": "a long prompt " * 10, "response": "r"}) + "\n")
  argv = {
    "no_match": ["--corpus", str(tmp_path / "*.nothing")],
    "not_utf8": ["--corpus", str(tmp_path / "*.bin")],
    "bad_jsonl": ["--corpus", str(tmp_path / "bad.jsonl")],
    "vocab": ["--corpus", CORPUS_GLOB, "--vocab-size", "100"],
    "seq_len": ["--corpus", CORPUS_GLOB, "--seq-len", "4"],
    "tokenizer": ["--corpus", CORPUS_GLOB, "--tokenizer", str(tmp_path / "none.model")],
    "nothing_fits": ["--corpus", str(tmp_path / "long.jsonl"), "--vocab-size", "400", "--seq-len", "8"],
  }[case]
  before = set(tmp_path.iterdir())
  code, err = _run_main(capsys, *argv, "--out", str(tmp_path / "out"))
  assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err
  assert set(tmp_path.iterdir()) == before  # Neither out/ nor a temporary folder was left behind.


def test_prepare_refuses_a_non_empty_directory_unless_forced(tmp_path, capsys):
  out = tmp_path / "out"
  out.mkdir()
  (out / "keep.txt").write_text("x")
  code, err = _run_main(capsys, "--corpus", CORPUS_GLOB, "--out", str(out), "--vocab-size", "400")
  assert code == 2 and len(err) == 1 and "--force" in err[0] and (out / "keep.txt").exists()
  code, _ = _run_main(capsys, "--corpus", CORPUS_GLOB, "--out", str(out), "--vocab-size", "400", "--force")
  assert code == 0 and not (out / "keep.txt").exists() and (out / "metadata.json").is_file()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_prepare_cli_subprocess(tmp_path):
  env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
  bad = subprocess.run(
    [sys.executable, "-m", "mercury_jax.prepare", "--corpus", str(tmp_path / "*.none"), "--out", str(tmp_path / "o")],
    capture_output=True,
    text=True,
    env=env,
    timeout=60,
  )
  assert bad.returncode == 2 and "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
  good = subprocess.run(
    [
      sys.executable,
      "-m",
      "mercury_jax.prepare",
      "--corpus",
      SFT_JSONL,
      "--out",
      str(tmp_path / "o"),
      "--vocab-size",
      "400",
      "--seq-len",
      "64",
    ],
    capture_output=True,
    text=True,
    env=env,
    timeout=60,
  )
  assert good.returncode == 0, good.stderr
  assert "train: 58 docs, 1 skipped" in good.stdout and "chars/token" in good.stdout


# ----------------------------------------------------------------------------------------------- pipeline


def _train(data_dir, **kwargs):
  args = {"seq_len": SEQ_LEN, "global_batch_size": 4, "seed": 0, "process_index": 0, "process_count": 1}
  return pipeline.train_dataset(data_dir, **{**args, **kwargs})


def _all_records(data_dir, split="train"):
  meta = pipeline.read_metadata(data_dir)["splits"][split]
  return records.read_shards([Path(data_dir) / name for name in meta["shards"]])


def test_train_dataset_is_deterministic_and_reshuffles_each_epoch(lm_dir):
  first = _take(_train(lm_dir), 6)
  assert first[0]["tokens"].shape == (4, SEQ_LEN) and first[0]["tokens"].dtype == np.int32
  _assert_batches_equal(first, _take(_train(lm_dir), 6))
  other = _take(_train(lm_dir, seed=1), 6)
  assert any(not np.array_equal(a["tokens"], b["tokens"]) for a, b in zip(first, other, strict=True))
  stored = [r.tobytes() for r in _all_records(lm_dir)]
  n = len(stored)
  rows = [
    np.stack([b["tokens"][0], b["kinds"][0]]).tobytes() for b in _take(_train(lm_dir, global_batch_size=1), 2 * n)
  ]
  assert sorted(rows[:n]) == sorted(stored) and sorted(rows[n:]) == sorted(stored)
  assert rows[:n] != rows[n:] and rows[:n] != stored


def test_train_iterator_resumes_exactly(lm_dir):
  iterator = iter(_train(lm_dir))
  assert isinstance(iterator, grain.DatasetIterator)
  for _ in range(5):
    next(iterator)
  state = iterator.get_state()
  expected = [next(iterator) for _ in range(10)]  # Crosses the epoch boundary (25 records, batches of 4).
  resumed = iter(_train(lm_dir))
  resumed.set_state(state)
  _assert_batches_equal([next(resumed) for _ in range(10)], expected)


def test_train_iterator_state_round_trips_through_orbax(lm_dir, tmp_path):
  iterator = iter(_train(lm_dir))
  for _ in range(3):
    next(iterator)
  manager = ocp.CheckpointManager(
    tmp_path / "ckpt", item_names=("data",), item_handlers={"data": grain.checkpoint.CheckpointHandler()}
  )
  manager.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(iterator)))
  manager.wait_until_finished()
  expected = [next(iterator) for _ in range(4)]
  resumed = iter(_train(lm_dir))
  manager.restore(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(resumed)))
  manager.close()
  _assert_batches_equal([next(resumed) for _ in range(4)], expected)


def test_processes_read_disjoint_records_that_cover_the_split(lm_dir):
  stored = sorted(r.tobytes() for r in _all_records(lm_dir))
  seen = []
  for index in range(2):
    count = len(range(index, len(stored), 2))
    batches = _take(_train(lm_dir, global_batch_size=2, process_index=index, process_count=2), count)
    assert batches[0]["tokens"].shape == (1, SEQ_LEN)
    seen.append({np.stack([b["tokens"][0], b["kinds"][0]]).tobytes() for b in batches})
    assert len(seen[-1]) == count
  assert not seen[0] & seen[1] and sorted(seen[0] | seen[1]) == stored


def test_train_dataset_argument_errors(lm_dir, tmp_path):
  with pytest.raises(ValueError, match=r"seq_len=64 .* seq_len=32; set model.max_length=32.*--seq-len 64"):
    _train(lm_dir, seq_len=64)
  with pytest.raises(ValueError, match="global_batch_size=3 must be a positive multiple of the 2 processes"):
    _train(lm_dir, global_batch_size=3, process_count=2)
  with pytest.raises(ValueError, match="python -m mercury_jax.prepare"):
    pipeline.read_metadata(tmp_path)
  with pytest.raises(ValueError, match="does not exist"):
    pipeline.read_metadata(tmp_path / "missing")


def test_eval_batches_are_fixed_wrap_around_and_split_over_processes(lm_dir):
  stored = _all_records(lm_dir, "validation")
  n = len(stored)
  args = {"seq_len": SEQ_LEN, "global_batch_size": 4}
  single = pipeline.eval_batches(lm_dir, "validation", num_batches=4, process_index=0, process_count=1, **args)
  _assert_batches_equal(
    single, pipeline.eval_batches(lm_dir, "validation", num_batches=4, process_index=0, process_count=1, **args)
  )
  rows = np.concatenate([np.stack([b["tokens"], b["kinds"]], axis=1) for b in single])
  np.testing.assert_array_equal(rows, stored[np.arange(16) % n])  # n = 11 < 16: wraps around.
  halves = [
    pipeline.eval_batches(lm_dir, "validation", num_batches=4, process_index=i, process_count=2, **args)
    for i in range(2)
  ]
  for step in range(4):
    for key in ("tokens", "kinds"):
      np.testing.assert_array_equal(np.concatenate([halves[0][step][key], halves[1][step][key]]), single[step][key])


def test_eval_batches_one_pass_counts_each_target_token_once(lm_dir):
  metadata = pipeline.read_metadata(lm_dir)
  batches = pipeline.eval_batches(
    lm_dir, "validation", seq_len=SEQ_LEN, global_batch_size=4, num_batches=None, process_index=0, process_count=1
  )
  assert len(batches) == -(-metadata["splits"]["validation"]["records"] // 4)
  targets = sum(int((b["kinds"] == records.TARGET).sum()) for b in batches)
  assert targets == metadata["splits"]["validation"]["target_tokens"]


def test_to_global_assembles_a_batch_sharded_over_the_data_axes():
  mesh = sharding.make_mesh(MeshConfig())
  rules = sharding.axis_rules()
  rows = 2 * sharding.data_parallel_size(mesh, rules)
  local = {"tokens": np.arange(rows * 8, dtype=np.int32).reshape(rows, 8), "kinds": np.full([rows, 8], 2, np.int32)}
  out = pipeline.to_global(local, mesh, rules)
  assert out["tokens"].shape == (rows * jax.process_count(), 8)
  assert out["tokens"].sharding.spec == P(("data", "fsdp"), None)
  assert len(out["tokens"].addressable_shards) == len(jax.devices())
  np.testing.assert_array_equal(np.asarray(out["tokens"]), local["tokens"])
  np.testing.assert_array_equal(np.asarray(out["kinds"]), local["kinds"])
  if sharding.data_parallel_size(mesh, rules) > 1:
    with pytest.raises(ValueError, match="must be a multiple of"):
      pipeline.to_global({"tokens": local["tokens"][:1]}, mesh, rules)


def test_data_modules_import_no_cycle():
  """The data package's modules import each other along a DAG: ``sources`` dispatches above the source modules."""
  import ast

  package = Path(pipeline.__file__).parent
  graph = {}
  for path in package.glob("*.py"):
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module == "mercury_jax.data":
        deps |= {alias.name for alias in node.names}
      elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mercury_jax.data."):
        deps.add(node.module.split(".")[2])
    graph[path.stem] = deps
  assert graph["sources"] >= {"corpus", "mixture", "site_packages"}
  done, visiting = set(), []

  def visit(module):
    assert module not in visiting, f"import cycle: {' -> '.join([*visiting, module])}"
    if module in done or module not in graph:
      return
    visiting.append(module)
    for dep in sorted(graph[module]):
      visit(dep)
    visiting.pop()
    done.add(module)

  for module in sorted(graph):
    visit(module)
