"""Structured output through the block engine: every finished output is valid, for block diffusion, the
autoregressive twin and whole-sequence checkpoints, with random and trained weights; forced text costs no steps;
rows are the same alone, batched and sharded."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re

import jax
import jsonschema
import numpy as np
import pytest
from random_models import KINDS, drafting, random_checkpoint

from mercury_jax import sharding as sh
from mercury_jax.config import MeshConfig
from mercury_jax.constrain.suite import REGEXES, SCHEMAS
from mercury_jax.sample import main
from mercury_jax.sampling.sampler import Sampler, default_checkpoint

LENGTH = 96  # generated tokens: room for every suite schema's shortest instance


def _check(samples, automata, kinds_of_rows, length):
  """Every complete sample validates; every sample whose automaton fits the room is complete."""
  for sample, automaton, (kind, name) in zip(samples, automata, kinds_of_rows, strict=True):
    fits = int(automaton.distance[automaton.start]) <= length
    assert sample.complete or not fits, (name, sample.text)
    if not sample.complete:
      continue
    if kind == "schema":
      jsonschema.validate(json.loads(sample.text), SCHEMAS[name])
    else:
      assert re.fullmatch(REGEXES[name], sample.text), (name, sample.text)


_SUITES: dict[bytes, tuple[list, list]] = {}


def _suite(sampler: Sampler):
  """``(rows, automata)`` of the whole suite for ``sampler``'s tokenizer, compiled once per tokenizer in this process
  (an automaton depends on the tokenizer alone; the decoders of a file share it)."""
  key = hashlib.sha256(sampler.tokenizer.to_bytes()).digest()
  if key not in _SUITES:
    rows = [("schema", name) for name in SCHEMAS] + [("regex", name) for name in REGEXES]
    automata = [
      sampler.constraint(json_schema=SCHEMAS[name]) if kind == "schema" else sampler.constraint(regex=REGEXES[name])
      for kind, name in rows
    ]
    _SUITES[key] = rows, automata
  return _SUITES[key]


BIG = 8192  # Edges: the suite's two largest automata (invoice, record_ids) have more, the rest fewer (at most 5,419
# with the fixture's tokenizer, 7,535 with the bundle's).


def by_size(rows: list, automata: list) -> list[tuple[list, list]]:
  """``rows`` and ``automata`` as batches: the automata over :data:`BIG` edges in a batch of their own. A batch pads
  every row's automaton to its largest, and the constrained program's work per step grows with the padded edges
  (at the tests' XLA settings a step of 18 rows padded to invoice's 16,384 edges took 0.6 s, the model 0.04 s)."""
  split = [[i for i, a in enumerate(automata) if (a.num_edges > BIG) == big] for big in (False, True)]
  return [([rows[i] for i in part], [automata[i] for i in part]) for part in split if part]


def halves(rows: list, automata: list, swap: int, split: bool = True):
  """``[(temperature, rows, automata)]``: every suite row once, half of them greedy and half sampled, in batches
  :func:`by_size` when ``split``; ``swap`` (0 or 1) exchanges the halves, so decoders that alternate it run every
  row at both temperatures between them."""
  cut = by_size if split else lambda rows, automata: [(rows, automata)]
  return [(t, *batch) for t, part in ((0.0, swap), (1.0, 1 - swap)) for batch in cut(rows[part::2], automata[part::2])]


DECODERS = [*KINDS, "whole_sequence_dual_cache"]


@pytest.mark.parametrize("kind", DECODERS)
def test_random_weights_give_valid_output_for_every_schema_and_regex(kind, tmp_path, data_dir):
  """Each decoder writes every schema and regex of the suite; the greedy and sampled halves alternate between the
  decoders (:func:`halves`)."""
  swap = DECODERS.index(kind) % 2
  dual = kind.endswith("_dual_cache")
  kind = kind.removesuffix("_dual_cache")
  sampler = Sampler.from_checkpoint(random_checkpoint(tmp_path, kind, data_dir / "tokenizer.model"))
  knobs = {"block_length": 8} if kind == "whole_sequence" else drafting(kind)
  if dual:  # Fast-dLLM's approximate cache: blocks in lockstep
    knobs["cache"] = "dual"
  # A block-refining decoder's steps are mostly the constrained program; a verified or autoregressive one takes a
  # step per token or two, and a batch of its own cost it one more compile than it saved (23-27 s against 21-22 s).
  split = kind in ("block_diffusion", "whole_sequence")
  for temperature, rows, automata in halves(*_suite(sampler), swap, split):
    samples = sampler.generate(
      ["x = "] * len(rows), length=LENGTH, constraint=automata, temperature=temperature, seed=3, **knobs
    )
    _check(samples, automata, rows, LENGTH)


@pytest.mark.skipif(default_checkpoint() is None, reason="no bundled model")
@pytest.mark.parametrize(
  "part,model,steps",
  [(0, "default", None), (1, "default", None), (2, "default", None), (1, "default_bd", 24), (2, "default_ar", None)],
)
def test_the_trained_models_give_valid_output_at_several_budgets(part, model, steps):
  """The bundled models (trained): the verified model over the whole suite (in thirds), the block-diffusion model at
  four tokens per step (24 steps for 96 tokens) and the autoregressive twin over a third each."""
  sampler = _bundled(model)
  rows, automata = _suite(sampler)
  rows, automata = rows[part::3], automata[part::3]
  samples = sampler.generate(["record = "] * len(rows), length=LENGTH, steps=steps, constraint=automata, seed=1)
  _check(samples, automata, rows, LENGTH)
  assert sum(s.complete for s in samples) == len(samples)


_BUNDLED = {}


def _bundled(name: str) -> Sampler:
  if name not in _BUNDLED:
    _BUNDLED[name] = Sampler.from_checkpoint(default_checkpoint(name))
  return _BUNDLED[name]


def test_forced_text_costs_no_forward_passes(tmp_path, data_dir):
  """A schema of long fixed keys: its keys are committed without the model, so block diffusion needs fewer forward
  passes than the same automaton with forcing turned off, and the text is the same valid JSON kind."""
  sampler = Sampler.from_checkpoint(random_checkpoint(tmp_path, "block_diffusion", data_dir / "tokenizer.model"))
  schema = {
    "type": "object",
    "properties": {
      "customer_shipping_address_line": {"type": "string", "maxLength": 8},
      "customer_billing_postal_code_value": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["customer_shipping_address_line", "customer_billing_postal_code_value"],
    "additionalProperties": False,
  }
  automaton = sampler.constraint(json_schema=schema)
  unforced = dataclasses.replace(automaton, forced=np.full_like(automaton.forced, -1))
  forced, free = sampler.generate(["x = "] * 2, length=LENGTH, constraint=[automaton, unforced], temperature=0.0)
  for sample in (forced, free):
    assert sample.complete
    jsonschema.validate(json.loads(sample.text), schema)
  keys = len(sampler.tokenizer.encode('{"customer_shipping_address_line":"","customer_billing_postal_code_value":}'))
  assert forced.nfe <= free.nfe - keys // 2, (forced.nfe, free.nfe, keys)


def test_a_constrained_row_is_the_same_alone_in_a_batch_and_on_a_mesh(tmp_path, data_dir):
  path = random_checkpoint(tmp_path, "block_diffusion", data_dir / "tokenizer.model")
  sampler = Sampler.from_checkpoint(path)
  small = sampler.constraint(regex=REGEXES[next(iter(REGEXES))])
  big = sampler.constraint(json_schema=SCHEMAS[next(iter(SCHEMAS))])
  alone = sampler.generate("x = ", length=48, constraint=small, temperature=1.0, seed=5)[0]
  batched = sampler.generate(
    ["x = ", "y = ", "x = "], length=48, constraint=[big, small, None], temperature=1.0, seed=5, streams=[1, 0, 2]
  )
  assert batched[1].tokens == alone.tokens and batched[1].complete == alone.complete
  mesh = sh.make_mesh(MeshConfig(data=2, fsdp=2, tensor=1), devices=jax.devices()[:4])
  sharded = Sampler.from_checkpoint(path, mesh=mesh).generate(
    ["x = ", "y = ", "x = "], length=48, constraint=[big, small, None], temperature=1.0, seed=5, streams=[1, 0, 2]
  )
  assert [s.tokens for s in sharded] == [s.tokens for s in batched]


def test_room_too_small_ends_with_a_valid_unfinished_prefix(tmp_path, data_dir):
  sampler = Sampler.from_checkpoint(random_checkpoint(tmp_path, "block_diffusion", data_dir / "tokenizer.model"))
  automaton = sampler.constraint(regex=r"\{\"alpha_beta_gamma\": [0-9]{6}\}")
  sample = sampler.generate("x = ", length=6, constraint=automaton, temperature=0.0)[0]
  assert sample.complete is False
  assert automaton.walk(sample.tokens) >= 0  # a valid prefix
  assert '{"alpha_beta_gamma": '.startswith(sample.text) or sample.text.startswith('{"alpha_beta_gamma": ')


@pytest.mark.skipif(default_checkpoint() is None, reason="no bundled model")
def test_command_line_json_schema_and_regex(tmp_path, capsys):
  schema = SCHEMAS[next(iter(SCHEMAS))]
  path = tmp_path / "schema.json"
  path.write_text(json.dumps(schema))
  common = ["--prompt", "x = ", "--length", str(LENGTH), "--json", "--no-compile-cache"]
  assert main([*common, "--json-schema", str(path), "--temperature", "0"]) == 0
  record = json.loads(capsys.readouterr().out)
  assert record["complete"] is True
  jsonschema.validate(json.loads(record["text"]), schema)
  assert main([*common, "--regex", r"[a-f0-9]{6}", "--seed", "2"]) == 0
  record = json.loads(capsys.readouterr().out)
  assert record["complete"] and re.fullmatch(r"[a-f0-9]{6}", record["text"])


@pytest.mark.skipif(default_checkpoint() is None, reason="no bundled model")
@pytest.mark.parametrize(
  "flags,message",
  [
    (["--json-schema", '{"type": "integer", "multipleOf": 0.123456789}'], "--json-schema at multipleOf: "),
    (["--json-schema", "{not json"], "--json-schema: neither a JSON Schema file nor JSON text"),
    (["--regex", "[a-"], "--regex: "),
  ],
)
def test_command_line_bad_constraints_are_one_line_and_exit_code_2(flags, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    main(["--prompt", "x = ", "--no-compile-cache", *flags])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith(f"mercury_jax.sample: error: {message}") and err.count("\n") == 1, err


def test_a_constraint_above_the_limits_is_refused_with_the_remedy_given(data_dir):
  from mercury_jax.constrain.automaton import Compiler, ConstraintError
  from mercury_jax.data.tokenizer import Tokenizer

  remedy = "start the server with a larger --constraint-capacity"
  compiler = Compiler(Tokenizer.load(data_dir / "tokenizer.model"), max_states=12, remedy=remedy)
  with pytest.raises(ConstraintError, match=f"more than max_states=12; .* or {remedy}"):
    compiler.json_schema(SCHEMAS["invoice"])


def test_stream_gives_the_constrained_text_generate_gives(tmp_path, data_dir):
  sampler = Sampler.from_checkpoint(random_checkpoint(tmp_path, "block_diffusion", data_dir / "tokenizer.model"))
  automaton = sampler.constraint(json_schema=SCHEMAS["geo_point"])
  kw = dict(length=48, constraint=[automaton, None], temperature=1.0, seed=4)
  generated = sampler.generate(["x = ", "y = "], **kw)
  streamed = ["", ""]
  for event in sampler.stream(["x = ", "y = "], **kw):
    streamed[event.index] += event.text
  assert streamed == [s.text for s in generated]
  assert generated[0].complete and generated[1].complete is None
  jsonschema.validate(json.loads(streamed[0]), SCHEMAS["geo_point"])
