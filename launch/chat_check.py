"""Do the models answer chat prompts in their template's format, and write a tool call as JSON when tools are given?

    python launch/chat_check.py --checkpoint DIR [--checkpoint DIR ...] --examples data/chat/instructions.jsonl \
      [--count 120] [--json OUT]

Takes the held-out lines of a mined chat file (``mercury_jax.data.instructions``; a line is held out by the JSONL
corpus's split rule, as ``prepare`` splits it), renders nothing anew (the prompts are the template's text), and decodes
each greedily with no constraint, as a chat request with no ``tool_choice`` would be decoded before the server's
"auto" constraint: ``[BOS] + prompt``, no token healing, at most ``--max-tokens`` tokens (cut to the context). Per kind
of example it reports how often the answer ended with EOS within the budget; for ``tool_call`` examples how often the
answer parses as a call (:func:`mercury_jax.serve.structured.parse_tool_call`), names the right function, has
arguments valid for its schema, and equals the reference call; for the text kinds how often the answer is text (does
not start with ``{``, so the server's "auto" rule reads it as text). With a verified checkpoint it also gives the
tokens per forward of these answers. Verbatim answers of the first few examples go to the JSON.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import jsonschema

from mercury_jax.data.corpus import VALIDATION, split_of
from mercury_jax.sampling.sampler import Sampler
from mercury_jax.serve.structured import parse_tool_call


def held_out(path: Path, count: int) -> list[dict]:
  """The first ``count`` held-out examples of each kind: ``{"kind", "prompt", "response"}``."""
  lines = path.read_text().splitlines()
  kinds = [json.loads(line)["kind"] for line in path.with_suffix(".sources.jsonl").read_text().splitlines()]
  chosen, per_kind = [], defaultdict(int)
  for index, (line, kind) in enumerate(zip(lines, kinds, strict=True)):
    if split_of(str(index)) == VALIDATION and per_kind[kind] < count:
      chosen.append({"kind": kind, **json.loads(line)})
      per_kind[kind] += 1
  return chosen


def _tools(prompt: str) -> dict[str, dict]:
  """The tools a rendered prompt lists: name -> parameters."""
  if "<|tools|>\n" not in prompt:
    return {}
  block = prompt.split("<|tools|>\n", 1)[1].split("\n<|", 1)[0]
  tools = [json.loads(line) for line in block.splitlines()]
  return {t["name"]: t["parameters"] for t in tools}


def check(sampler: Sampler, examples: list[dict], max_tokens: int) -> dict:
  stats = defaultdict(lambda: defaultdict(int))
  samples, forwards, tokens = [], 0, 0
  eos = sampler.tokenizer.eos_id
  for example in examples:
    prompt_ids = sampler.tokenizer.encode(example["prompt"])
    length = min(max_tokens, sampler.max_length - 1 - len(prompt_ids))
    out = sampler.generate(example["prompt"], length=length, temperature=0.0, bos=True, token_healing=False)[0]
    ended = eos in out.tokens
    text = sampler.tokenizer.decode(out.tokens[: out.tokens.index(eos)] if ended else out.tokens)
    forwards, tokens = forwards + out.nfe, tokens + len(out.tokens)
    s = stats[example["kind"]]
    s["examples"] += 1
    s["ended_with_eos"] += ended
    if example["kind"] == "tool_call":
      call = parse_tool_call(text.strip()) if ended else None
      tools = _tools(example["prompt"])
      s["parses_as_call"] += call is not None
      want = json.loads(example["response"])
      if call is not None:
        s["right_function"] += call.function.name == want["name"]
        arguments = json.loads(call.function.arguments)
        try:
          jsonschema.validate(arguments, tools.get(call.function.name, {"not": {}}))
          s["arguments_valid"] += 1
        except jsonschema.ValidationError:
          pass
        s["exact_call"] += call.function.name == want["name"] and arguments == want["arguments"]
    else:
      s["text_answer"] += bool(text) and not text.startswith("{")
      s["exact_answer"] += text == example["response"]
    if len(samples) < 12 or (example["kind"] == "tool_call" and len(samples) < 16):
      shown = {"prompt": example["prompt"], "answer": text, "reference": example["response"]}
      samples.append({"kind": example["kind"], **shown})
  return {
    "by_kind": {k: dict(v) for k, v in stats.items()},
    "tokens_per_forward": tokens / max(forwards, 1),
    "samples": samples,
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--checkpoint", action="append", required=True)
  parser.add_argument("--examples", required=True, help="a mined chat file (FILE.jsonl beside FILE.sources.jsonl)")
  parser.add_argument("--count", type=int, default=40, help="held-out examples per kind")
  parser.add_argument("--max-tokens", type=int, default=128)
  parser.add_argument("--json", help="write the results here")
  args = parser.parse_args()
  examples = held_out(Path(args.examples), args.count)
  results = {}
  for checkpoint in args.checkpoint:
    results[checkpoint] = check(Sampler.from_checkpoint(checkpoint), examples, args.max_tokens)
    tpf = results[checkpoint]["tokens_per_forward"]
    print(checkpoint, json.dumps(results[checkpoint]["by_kind"]), f"TPF {tpf:.2f}", flush=True)
  if args.json:
    Path(args.json).write_text(json.dumps({"examples": args.examples, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
  main()
