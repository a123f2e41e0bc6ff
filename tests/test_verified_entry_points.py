"""Verified decoding from every entry point (random-weight verified checkpoint): ``Sampler.generate`` and ``stream``,
token healing, the command line's knobs, and the server through the official ``openai`` client."""

import concurrent.futures
import re

import numpy as np
import pytest
from random_models import random_checkpoint
from test_serve import Server

from mercury_jax.sample import main as sample_main
from mercury_jax.sampling.sampler import Sampler
from mercury_jax.sampling.settings import SettingError

PROMPTS = ["print(", "def fibon", "x = [1, 2,", "import o"]
# A draft tree with every lever: alternatives (a Cartesian product), a lookup chain, two pre-draft blocks and an
# adaptive length (the CLI's and the server's flags name the same fields).
TREE = dict(draft_tree="1,2,10", draft_lookup=3, draft_blocks="0,1", draft_confidence=0.02)


@pytest.fixture(scope="module")
def verified(tmp_path_factory, data_dir):
  return random_checkpoint(tmp_path_factory.mktemp("verified"), "verified", data_dir / "tokenizer.model")


@pytest.fixture(scope="module")
def sampler(verified):
  return Sampler.from_checkpoint(verified)


@pytest.mark.parametrize("tree", [{}, TREE], ids=["device_default", "tree"])
def test_greedy_verified_equals_the_next_token_head_with_healing_and_a_template(sampler, tree):
  """Token healing re-generates each prompt's cut last token in both modes alike; the two-hole template keeps its
  text; the rows have different prompt lengths; the device's draft tree and one with every lever."""
  for knobs in (dict(length=20), dict(template="a<mask:5> = b<mask:6>\n", length=0)):
    kw = dict(temperature=0.0, seed=1, **knobs)
    verified = sampler.generate(PROMPTS, decode="verified", **tree, **kw)
    ar = sampler.generate(PROMPTS, decode="ar", **kw)
    assert [s.text for s in verified] == [s.text for s in ar]
    assert [s.tokens for s in verified] == [s.tokens for s in ar]
    assert all(s.accepted is not None and sum(s.accepted) == s.nfe for s in verified)
    assert all(s.accepted is None for s in ar)
  assert any(s.healed for s in sampler.generate(PROMPTS, length=4, temperature=0.0))


def test_stream_gives_the_text_generate_gives_and_drafts_ahead(sampler):
  kw = dict(length=16, temperature=1.0, seed=5)
  texts = [s.text for s in sampler.generate(PROMPTS, **kw)]
  streamed, drafts = [""] * len(PROMPTS), 0
  for event in sampler.stream(PROMPTS, drafts=True, **kw):
    streamed[event.index] += event.text
    drafts += event.draft is not None
  assert streamed == texts and drafts > 0


def test_greedy_verified_with_a_tree_walks_the_constraint_along_every_path(sampler):
  """Structured output: the automaton restricts every tree node's distribution along its own path, so greedy
  verified decoding with a tree is the constrained next-token head's greedy decoding, and valid."""
  regex = r"\[(0|[1-9][0-9]{0,2})(, (0|[1-9][0-9]{0,2})){2,5}\]"
  automaton = sampler.constraint(regex=regex)
  kw = dict(length=40, constraint=automaton, temperature=0.0, seed=3)
  verified = sampler.generate(["xs = "] * 2, decode="verified", **TREE, **kw)
  ar = sampler.generate(["xs = "] * 2, decode="ar", **kw)
  assert [s.tokens for s in verified] == [s.tokens for s in ar]
  assert all(s.complete and re.fullmatch(regex, s.text) for s in verified), [s.text for s in verified]


def test_decode_modes_and_draft_lengths_that_do_not_fit_are_setting_errors(sampler, tmp_path, data_dir):
  with pytest.raises(SettingError, match="draft_length=8 must lie in \\[2, 4\\]"):
    sampler.generate("x", length=4, draft_length=8)
  with pytest.raises(SettingError, match="applies to decode='verified' only"):
    sampler.generate("x", length=4, decode="ar", draft_length=3)
  twin = Sampler.from_checkpoint(random_checkpoint(tmp_path, "autoregressive", data_dir / "tokenizer.model"))
  with pytest.raises(SettingError, match="decode='verified' needs a verified checkpoint"):
    twin.generate("x", length=4, decode="verified")
  assert sampler.generate("x", length=4, draft_length=2)[0].accepted is not None
  with pytest.raises(SettingError, match="draft_tree='01x' must be auto, one of chain"):
    sampler.generate("x", length=4, draft_tree="01x")
  with pytest.raises(SettingError, match="draft_tree='11' has path '11' without its parent '1'"):
    sampler.generate("x", length=4, draft_tree="11")
  with pytest.raises(SettingError, match="draft_tree='0001' has path '0001' deeper than the 3 drafts of k=4"):
    sampler.generate("x", length=4, draft_tree="0001")
  with pytest.raises(SettingError, match="draft_lookup=3 applies to decode='verified' only"):
    sampler.generate("x", length=4, decode="ar", draft_lookup=3)


@pytest.mark.parametrize(
  "flags, message",
  [
    (["--draft-length", "9"], "--draft-length=9 must lie in [2, 4]"),
    (["--decode", "ar", "--draft-length", "3"], "--draft-length=3 applies to decode='verified' only"),
    (["--decode", "verified", "--steps", "4"], "--steps=4 applies to diffusion models only"),
    (["--draft-blocks", "0,5"], "--draft-blocks='0,5' must name chain depths in [0, 3] for k=4"),
    (["--draft-confidence", "1.5"], "--draft-confidence=1.5 must lie in [0, 1) (0: off)"),
    (["--draft-lookup", "99"], "--draft-lookup=99 must lie in [0, 16]"),
  ],
)
def test_command_line_knobs_that_do_not_fit_are_one_line_and_exit_code_2(verified, flags, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    sample_main(["--checkpoint", str(verified), "--prompt", "x", "--length", "4", *flags])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err.strip()
  assert message in err and len(err.splitlines()) == 1, err


def test_command_line_reports_tokens_per_forward(verified, capsys):
  assert sample_main(["--checkpoint", str(verified), "--prompt", "def f(", "--length", "12", "--json"]) == 0
  import json

  record = json.loads(capsys.readouterr().out.splitlines()[0])
  assert sum(record["accepted"]) == record["nfe"] and record["tokens_per_forward"] >= 1


def test_server_answers_as_the_sampler_alone_and_concurrently_without_compiling(verified, sampler):
  """The server decodes with a draft tree (its flags name the sampler's fields), compiled once at start."""
  flags = [f"--{name.replace('_', '-')}={value}" for name, value in TREE.items()]
  srv = Server(verified, "--slots", "2", "--max-queue", "64", *flags, quick=True)  # buckets 1 and 2; others wait
  try:
    client = srv.client(timeout=120)
    models = client.models.list().data[0]
    assert models.model_extra["decode"] == "verified" and models.model_extra["draft_length"] == 4
    requests = [
      dict(prompt=p, max_tokens=10, temperature=t, seed=s) for p in PROMPTS for t, s in ((0.0, 0), (1.0, 3), (0.7, 9))
    ]
    for kw in requests[:6]:  # The server's text is the sampler's, greedy and sampled.
      out = client.completions.create(model="tiny", **kw)
      mine = sampler.generate(kw["prompt"], length=10, temperature=kw["temperature"], seed=kw["seed"], **TREE)[0]
      assert out.choices[0].text == mine.text, kw
    compiled = srv.metric("mercury_compilations_total")
    solo = [client.completions.create(model="tiny", **kw).choices[0].text for kw in requests]
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
      together = list(pool.map(lambda kw: client.completions.create(model="tiny", **kw).choices[0].text, requests))
    assert together == solo
    assert srv.metric("mercury_compilations_total") == compiled
    bad = client.with_options(max_retries=0)
    for extra, field in (({"decode": "diffusion"}, "decode"), ({"draft_length": 3}, "draft_length")):
      with pytest.raises(Exception) as error:
        bad.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body=extra)
      assert getattr(error.value, "status_code", None) == 400 and field in str(error.value)
    assert len({t for t in solo}) > 4 and np.mean([len(t) for t in solo]) > 0
  finally:
    srv.stop()


def test_decode_diffusion_runs_the_draft_half_and_its_cache_reproduces_the_uncached_pass(sampler):
  """The draft half as a block-diffusion model over the causal cache of the clean half: the exact cache gives the
  tokens of the uncached engine (``x_t ⊕ x_0`` under the ``verified`` mask), at several steps per block."""
  for steps_per_block in (1, 4):
    kw = dict(length=16, temperature=0.0, decode="diffusion", steps_per_block=steps_per_block, token_healing=False)
    cached = sampler.generate(PROMPTS, **kw)
    uncached = sampler.generate(PROMPTS, cache="none", **kw)
    assert [s.tokens for s in cached] == [s.tokens for s in uncached]
    assert all(s.accepted is None for s in cached)
