"""``python -m mercury_jax.bench`` on converted public checkpoints: a tiny random Fast-dLLM v2 and a tiny random Qwen2
converted with ``--family autoregressive`` (tests/hf_reference.py), which carry one tokenizer, benchmarked with
prompts from a corpus glob and no prepared data; tokenizers that differ, and flags that do not fit, are one line and
exit code 2."""

from __future__ import annotations

import json
import math
import shutil
import textwrap

import pytest

pytest.importorskip("transformers")

import hf_reference as ref  # noqa: E402
import tokenizers  # noqa: E402

from mercury_jax.bench import cli as bench  # noqa: E402
from mercury_jax.bench.models import tokenizer_difference  # noqa: E402
from mercury_jax.convert import convert  # noqa: E402
from mercury_jax.data.corpus import VALIDATION, split_of  # noqa: E402
from mercury_jax.data.hf_files import SpecialTokens  # noqa: E402
from mercury_jax.data.hf_tokenizer import HFTokenizer  # noqa: E402
from mercury_jax.sampling.registry import default_checkpoint  # noqa: E402

VALIDATION_FILE = "helpers28.py"  # A name the corpus's hash puts in the validation split (checked below).
SOURCE = textwrap.dedent(
  '''\
  def add(a, b):
      """Adds two numbers."""
      return a + b


  def scale(xs, k):
      """Scales every item of xs by k."""
      return [x * k for x in xs]
  '''
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  """The converted diffusion model, its autoregressive counterpart and a corpus glob with two documented functions
  in its validation split."""
  root = tmp_path_factory.mktemp("converted_pair")
  ref.build(root / "hf_fast", "fast_dllm_v2")
  ref.build(root / "hf_qwen2", "qwen2", seed=1)
  diffusion = convert(root / "hf_fast", root / "fast_dllm_v2", dtype="float32")
  ar = convert(root / "hf_qwen2", root / "qwen2", "autoregressive", dtype="float32")
  assert split_of(VALIDATION_FILE) == VALIDATION
  (root / "corpus").mkdir()
  (root / "corpus" / VALIDATION_FILE).write_text(SOURCE)
  return root, diffusion, ar, str(root / "corpus" / "*.py")


def test_bench_runs_a_converted_pair_with_the_checkpoints_tokenizer_and_a_corpus_glob(pair):
  root, diffusion, ar, corpus = pair
  out = root / "out"
  argv = ["--diffusion", str(diffusion), "--autoregressive", str(ar), "--corpus", corpus, "--out", str(out)]
  grid = ["--steps", "4", "--taus", "", "--ar-temperatures", "1", "--batch-sizes", "2"]
  bench.main([*argv, "--prompts", "2", "--length", "8", *grid])
  result = json.loads((out / "results.json").read_text())
  assert result["canvas"]["tokenizer"] == "the checkpoints' own"
  # The prompts are the corpus's documented functions, encoded by the converted checkpoints' tokenizer.
  tokenizer = HFTokenizer.load(ar)
  texts = [
    'def add(a, b):\n    """Adds two numbers."""\n',
    'def scale(xs, k):\n    """Scales every item of xs by k."""\n',
  ]
  assert [(p["key"], p["tokens"]) for p in result["prompts"]] == [
    (VALIDATION_FILE, len(tokenizer.encode(t))) for t in texts
  ]
  rows = {r["name"]: r for r in result["rows"]}
  assert set(rows) == {"confidence steps=4", "AR T=1"}
  assert (rows["confidence steps=4"]["model"], rows["AR T=1"]["model"]) == ("diffusion", "autoregressive")
  for row in result["rows"]:
    assert math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0 and row["speedup_vs_ar"] > 0
    assert 0 < row["mean_tokens"] <= 8 and row["nfe"] >= 1
    assert math.isfinite(row["gen_ppl"]) and row["gen_ppl"] > 1  # Scored by the converted Qwen2.
    assert row["unigram_entropy"] > 0 and 0 < row["distinct_2"] <= 1 and 0 <= row["parse_rate"] <= 1
  assert rows["confidence steps=4"]["nfe"] <= 4 < rows["AR T=1"]["nfe"]  # Blocks of 8 in at most 4 steps.
  assert "| confidence steps=4 | 2 |" in (out / "results.md").read_text()


def _reordered_vocabulary(src, dst) -> None:
  """A copy of the checkpoint ``src`` whose tokenizer gives two pieces each other's ids."""
  shutil.copytree(src, dst)
  spec = json.loads((dst / "tokenizer.json").read_text())
  vocab = spec["model"]["vocab"]
  a, b = (piece for piece, i in vocab.items() if i in (100, 101))
  vocab[a], vocab[b] = vocab[b], vocab[a]
  (dst / "tokenizer.json").write_text(json.dumps(spec))


# case -> (the --autoregressive checkpoint, flags, words the one-line error must hold)
BAD = {
  "another vocabulary": (
    "reordered",
    ["--corpus"],
    "have different tokenizers (their tokenizer.json vocabulary or merges differ)",
  ),
  "sentencepiece twin": (
    "bundled",
    ["--corpus"],
    "have different tokenizers (one is a sentencepiece tokenizer.model, the other a Hugging Face tokenizer.json)",
  ),
  "with --data": (
    "converted",
    ["--corpus", "--data"],
    "carries its own tokenizer (tokenizer.json), not the sentencepiece one of --data",
  ),
  "no corpus": ("converted", [], "carries its own tokenizer but no corpus; name the prompts' corpus with --corpus"),
}


@pytest.mark.parametrize("case", BAD)
def test_tokenizers_that_differ_or_flags_that_do_not_fit_are_one_line_and_exit_2(case, pair, capsys):
  root, diffusion, ar, corpus = pair
  which, flags, words = BAD[case]
  bundled = default_checkpoint("default_ar")  # A sentencepiece model, and a folder with prepared data's files.
  if bundled is None and ("--data" in flags or which == "bundled"):
    pytest.skip("the bundled default_ar is missing")
  if which == "reordered":
    ar = root / "qwen2_reordered"
    if not ar.exists():
      _reordered_vocabulary(root / "qwen2", ar)
  elif which == "bundled":
    ar = bundled
  argv = ["--diffusion", str(diffusion), "--autoregressive", str(ar), "--out", str(root / "bad"), "--smoke"]
  argv += ["--corpus", corpus] if "--corpus" in flags else []
  argv += ["--data", str(bundled)] if "--data" in flags else []
  with pytest.raises(SystemExit) as exit_info:
    bench.main(argv)
  err = capsys.readouterr().err
  assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
  assert err.startswith("mercury_jax.bench compare: error: ") and words in err, err
  if which in ("reordered", "bundled"):
    assert repr(str(diffusion)) in err and repr(str(ar)) in err  # Both paths named.
  assert not (root / "bad").exists()


def test_tokenizers_that_differ_only_by_a_token_one_of_them_adds_are_one_tokenizer(pair):
  """A diffusion model's tokenizer is its parent's plus the mask token its authors added (Fast-dLLM v2's
  ``|<MASK>|`` at 151665 after Qwen2.5's last id): the same tokenizer for the bench. A token both have at different
  ids, or a reordered vocabulary, is not."""
  _, _, ar, _ = pair
  parent_json = (ar / "tokenizer.json").read_text()
  special = SpecialTokens(eos_id=0, pad_id=0, mask_id=290)
  parent = HFTokenizer(parent_json, special)

  def child(token: str) -> HFTokenizer:
    tok = tokenizers.Tokenizer.from_str(parent_json)
    tok.add_special_tokens([token])
    return HFTokenizer(tok.to_str(), SpecialTokens(eos_id=0, pad_id=0, mask_id=tok.token_to_id(token)))

  assert tokenizer_difference(parent, child("<|child_mask|>")) is None
  assert tokenizer_difference(child("<|child_mask|>"), parent) is None
  piece = next(p for p, i in json.loads(parent_json)["model"]["vocab"].items() if i == 200)
  overlay = tokenizer_difference(parent, child(piece))  # A piece made an added token: text would split apart.
  assert overlay == f"added token {piece!r} (id 200) of one is a token of the other"
  spec = json.loads(parent_json)
  spec["model"]["merges"] = spec["model"]["merges"][:-1]
  assert tokenizer_difference(parent, HFTokenizer(json.dumps(spec), special)) == (
    "their tokenizer.json vocabulary or merges differ"
  )
