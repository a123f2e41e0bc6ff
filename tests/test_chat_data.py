"""The bundled models' chat data: the chat template (roles, system, tools, calls, results) rendered by the server's
template code, the examples mined from code (tool calls valid for their JSON Schema, train split only), SFT packing for
next-token objectives, mixing prepared directories into one training stream, and self-distillation sets."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from random_models import random_checkpoint

from mercury_jax import distill, kinds as K
from mercury_jax.config import load_config
from mercury_jax.constrain.schema import tool_call_schema
from mercury_jax.data import chat_format, corpus, instructions, pipeline, records
from mercury_jax.data.chat_template import chat_template_of
from mercury_jax.data.tokenizer import Tokenizer
from mercury_jax.serve.structured import parse_tool_call

ROOT = Path(__file__).parent.parent
TOKENIZER = ROOT / "mercury_jax" / "assets" / "default" / "tokenizer.model"
SOURCE = '''
from typing import Literal


def gcd(a: int, b: int) -> int:
    """Greatest common divisor of two integers.

    Uses Euclid's algorithm.
    """
    while b:
        a, b = b, a % b
    return a


def render(name, width=80, align: Literal["left", "right"] = "left", tags: list[str] | None = None):
    """Render a name padded to a width.

    Parameters
    ----------
    name : str
        What to render.
    """
    text = name.ljust(width) if align == "left" else name.rjust(width)
    return text + " ".join(tags or [])


def opaque(thing):
    """A parameter of no JSON type: no tool."""
    return thing


class Box:
    def area(self, scale: float = 1.0):
        """Area of the box, scaled."""
        return self.w * self.h * scale
'''


def test_template_renders_roles_system_tools_calls_and_results_and_the_server_reads_the_calls():
  tools = [
    chat_format.tool("gcd", {"type": "object", "properties": {"a": {"type": "integer"}}}, "Greatest common divisor."),
    {"type": "function", "function": {"name": "now"}},
  ]
  messages = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Call gcd with a=12."},
    chat_format.assistant_call("gcd", {"a": 12}),
    {"role": "tool", "content": "12", "tool_call_id": "call_0"},
    {"role": "assistant", "content": "gcd returned 12."},
    {"role": "user", "content": "thanks"},
  ]
  text = chat_format.render(messages, tools)
  assert text == (
    "<|system|>\nYou write Python.\n<|tools|>\n"
    '{"name":"gcd","description":"Greatest common divisor.","parameters":{"type":"object","properties":{"a":'
    '{"type":"integer"}}}}\n{"name":"now","parameters":{"type":"object","properties":{}}}\n'
    '<|user|>\nCall gcd with a=12.\n<|assistant|>\n{"name":"gcd","arguments":{"a":12}}\n<|tool|>\n12\n'
    "<|assistant|>\ngcd returned 12.\n<|user|>\nthanks\n<|assistant|>\n"
  )
  assert chat_format.render(messages[1:2]) == "<|user|>\nCall gcd with a=12.\n<|assistant|>\n"
  # As the server renders it: arguments as JSON text (a string) give the same line.
  as_text = {**messages[2], "tool_calls": [{**messages[2]["tool_calls"][0]}]}
  as_text["tool_calls"][0]["function"] = {"name": "gcd", "arguments": '{"a":12}'}
  assert chat_format.render([messages[1], as_text]) == chat_format.render(messages[1:3])
  call = parse_tool_call(chat_format.call_text("gcd", {"a": 12}))
  assert call.function.name == "gcd" and json.loads(call.function.arguments) == {"a": 12}
  with pytest.raises(ValueError, match="unknown role robot"):
    chat_format.render([{"role": "robot", "content": "x"}])


@pytest.mark.parametrize("preset", ["v4_chat", "v4_chat_ar", "v4_distill", "v4_distill_ar"])
def test_the_v4_presets_store_the_template_and_the_server_renders_it(preset):
  cfg = load_config(preset)
  assert cfg.data.chat_template == chat_format.TEMPLATE
  template = chat_template_of(cfg.data.chat_template, Tokenizer.load(TOKENIZER))
  messages = [{"role": "user", "content": "hi"}]
  assert template.render(messages) == chat_format.render(messages)


def _functions():
  return instructions.functions_of(corpus.Document("pkg/mod.py", corpus.TRAIN, SOURCE))


def test_functions_and_their_parameter_schemas_come_from_annotations_docstrings_and_defaults():
  found = {f.qualname: f for f in _functions()}
  assert set(found) == {"gcd", "render", "opaque", "Box.area"}
  assert found["gcd"].parameters == {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
  }
  assert found["render"].parameters["properties"] == {
    "name": {"type": "string"},  # numpydoc
    "width": {"type": "integer"},  # the default's type
    "align": {"type": "string", "enum": ["left", "right"]},
    "tags": {"type": "array", "items": {"type": "string"}},
  }
  assert found["render"].parameters["required"] == ["name"]
  assert found["opaque"].parameters is None and found["Box.area"].parameters is None  # no JSON type; a method
  assert found["gcd"].summary == "Greatest common divisor of two integers."
  assert '"""' not in found["gcd"].bare and "while b:" in found["gcd"].bare
  assert found["gcd"].returns == "integer"


def test_mined_tool_calls_validate_against_their_schema_and_answers_fit_the_record():
  tokenizer = Tokenizer.load(TOKENIZER)
  documents = [
    corpus.Document("pkg/mod.py", corpus.TRAIN, SOURCE),
    corpus.Document("pkg/held_out.py", corpus.VALIDATION, SOURCE.replace("gcd", "held_out_gcd")),
  ]
  examples, counts = instructions.mine(documents, tokenizer, seq_len=256, seed=3, tool_variants=6)
  again, _ = instructions.mine(documents, tokenizer, seq_len=256, seed=3, tool_variants=6)
  assert [(e.prompt(), e.answer) for e in examples] == [(e.prompt(), e.answer) for e in again]  # seeded
  assert all("held_out" not in e.prompt() + e.answer for e in examples)  # train split only
  kinds = {e.kind for e in examples}
  assert {"write", "explain", "tool_call"} <= kinds and counts["functions"] == 4
  calls = [e for e in examples if e.kind == "tool_call"]
  assert len(calls) >= 6
  for e in calls:
    tools = list(e.tools)
    call = parse_tool_call(e.answer)  # what the server reads back
    assert call is not None and call.function.name == e.call["name"]
    jsonschema.validate(json.loads(e.answer), tool_call_schema(tools))  # the server's call schema
    parameters = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), parameters)
    for name, value in e.call["arguments"].items():  # the request names every argument and its value
      assert name in e.messages[-1]["content"] and json.dumps(value) in e.messages[-1]["content"]
    assert e.prompt().endswith("<|assistant|>\n") and "<|tools|>" in e.prompt()
  for e in examples:
    assert 2 + len(tokenizer.encode(e.prompt())) + len(tokenizer.encode(e.answer)) <= 256
    assert e.kind in ("tool_call",) or not e.answer.startswith("{")  # a text answer never reads as a call
  results = [e for e in examples if e.kind == "tool_result"]
  assert all("<|tool|>" in e.prompt() and e.prompt().count("<|assistant|>") == 2 for e in results)


def test_the_tools_file_holds_the_train_lines_tool_examples(tmp_path):
  documents = [corpus.Document("pkg/mod.py", corpus.TRAIN, SOURCE)]
  examples, counts = instructions.mine(documents, Tokenizer.load(TOKENIZER), seq_len=256, seed=1, tool_variants=40)
  out, tools = tmp_path / "chat.jsonl", tmp_path / "tools.jsonl"
  instructions.write(examples, out, {"seed": 1}, {}, tools)
  lines = out.read_text().splitlines()
  kinds = [json.loads(line)["kind"] for line in out.with_suffix(".sources.jsonl").read_text().splitlines()]
  want = [
    line
    for i, (line, kind) in enumerate(zip(lines, kinds, strict=True))
    if kind in instructions.TOOL_KINDS and corpus.split_of(str(i)) == corpus.TRAIN
  ]
  assert tools.read_text().splitlines() == want and 0 < len(want) < sum(k in instructions.TOOL_KINDS for k in kinds)
  assert json.loads(out.with_suffix(".manifest.json").read_text())["tools_out"]["examples"] == len(want)


def test_packed_sft_records_hold_several_examples_and_score_only_answers_and_their_eos():
  examples = [([5, 6], [7, 8, 9]), ([10], [11]), (list(range(20, 40)), [41]), ([12] * 30, [13])]
  packed, skipped = records.pack_sft_packed(examples, 16, bos_id=2, eos_id=3, pad_id=0)
  assert skipped == [2, 3]  # 1 + 20 + 1 + 1 > 16 and 1 + 30 + 1 + 1 > 16
  assert packed.shape == (1, 2, 16)
  np.testing.assert_array_equal(packed[0, 0, :11], [2, 5, 6, 7, 8, 9, 3, 2, 10, 11, 3])
  f, t, p = K.FIXED, K.TARGET, K.PAD
  np.testing.assert_array_equal(packed[0, 1], [f, f, f, t, t, t, t, f, f, t, t, p, p, p, p, p])
  more, _ = records.pack_sft_packed([([5] * 6, [7] * 4)] * 3, 16, bos_id=2, eos_id=3, pad_id=0)
  assert more.shape[0] == 3  # 12 tokens each: one to a record


def _prepared(tmp_path, name, lines, pack=False):
  from mercury_jax.prepare import prepare

  path = tmp_path / f"{name}.jsonl"
  path.write_text("".join(json.dumps(line) + "\n" for line in lines))
  out = tmp_path / name
  prepare(str(path), out, tokenizer_path=str(TOKENIZER), seq_len=32, num_shards=2, pack=pack, log=lambda _: None)
  return out


def test_mixed_and_distilled_rows_follow_the_real_rows_and_resume_exactly(tmp_path):
  code = _prepared(tmp_path, "code", [{"text": f"def f{i}(x):\n    return x + {i}\n" * 3} for i in range(80)])
  chat = _prepared(tmp_path, "chat", [{"prompt": f"add {i}", "response": f"x + {i}"} for i in range(60)], pack=True)
  common = dict(seq_len=32, global_batch_size=4, seed=7, num_threads=1, prefetch=1)
  plain = iter(pipeline.train_dataset(code, **common))
  mixed = iter(pipeline.train_dataset(code, mix=[(str(chat), 1.0)], **common))
  with_drafts = pipeline.train_dataset(
    code, mix=[(str(chat), 1.0)], distill=[(str(chat), 1.0)], distill_batch_size=2, **common
  )
  it = iter(with_drafts)
  fixed_rows = 0
  for step in range(6):
    a, b, c = next(plain), next(mixed), next(it)
    assert a["tokens"].shape == (4, 32) and c["tokens"].shape == (6, 32)
    np.testing.assert_array_equal(b["tokens"], c["tokens"][:4])  # the same real rows with or without drafts
    fixed_rows += int((b["kinds"] == K.FIXED).any(axis=1).sum())
    assert (c["kinds"][4:] == K.FIXED).any(axis=1).all()
    if step == 2:
      state = it.get_state()
      rest = [next(it)["tokens"] for _ in range(3)]
      resumed = iter(with_drafts)
      resumed.set_state(state)
      for want in rest:
        np.testing.assert_array_equal(next(resumed)["tokens"], want)
      break
  assert fixed_rows > 0  # chat rows came from the mixture


def test_distillation_sets_are_the_heads_own_continuations_reproducibly(tmp_path, data_dir):
  checkpoint = random_checkpoint(tmp_path, "verified", data_dir / "tokenizer.model")
  kw = dict(prompts=6, validation_prompts=2, temperature=0.0, seed=5, prompt_tokens=(8, 12), log=lambda _: None)
  meta = distill.build(str(checkpoint), [(str(data_dir), 1.0)], tmp_path / "greedy", batch=4, **kw)
  again = distill.build(str(checkpoint), [(str(data_dir), 1.0)], tmp_path / "again", batch=3, **kw)
  first = records.read_shards(pipeline.split_paths(tmp_path / "greedy", "train"))
  np.testing.assert_array_equal(first, records.read_shards(pipeline.split_paths(tmp_path / "again", "train")))
  assert meta["splits"]["train"]["records"] == 6 and again["mode"] == "distill"
  manifest = json.loads((tmp_path / "greedy" / "manifest.json").read_text())
  assert manifest["temperature"] == 0.0 and len(manifest["prompts"]["train"]) == 6
  assert manifest["checkpoint_sha256"] == distill.checkpoint_sha256(checkpoint)
  from mercury_jax.sampling.sampler import Sampler

  sampler = Sampler.from_checkpoint(checkpoint)
  source = records.read_shards(pipeline.split_paths(data_dir, "train"))
  checked = 0
  for row, prompt in zip(first, manifest["prompts"]["train"], strict=True):
    tokens, kinds = row
    n = prompt["prompt_tokens"]
    np.testing.assert_array_equal(tokens[:n], source[prompt["record"], 0, :n])  # a prompt of the train split
    assert (kinds[:n] == K.FIXED).all() and (kinds[n:] != K.FIXED).all()
    generated = tokens[kinds == K.DISTILLED].tolist()
    assert len(generated) > 0 and (kinds[n : n + len(generated)] == K.DISTILLED).all()
    text = sampler.tokenizer.decode(tokens[:n].tolist())
    if sampler.tokenizer.encode(text) != tokens[:n].tolist():
      continue  # Text prompts re-encode; this one would not give the same ids.
    greedy = sampler.generate(text, length=64 - n, temperature=0.0, decode="ar", token_healing=False)[0]
    assert generated == greedy.tokens  # the head's greedy continuation, its EOS included
    checked += 1
  assert checked >= 3
