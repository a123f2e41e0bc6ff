"""Chat examples mined from a code corpus: requests and answers in the bundled chat format, as SFT JSONL.

``python -m mercury_jax.data.instructions --corpus SPEC [--corpus SPEC ...] --tokenizer TOKENIZER --out FILE.jsonl``

Every function and method of the corpus's **train** split (so nothing of the held-out code is ever an answer) that
has a docstring gives examples of these kinds, rendered by :mod:`mercury_jax.data.chat_format`:

* ``write``: the docstring's first paragraph and the signature as the user's request, the function's source (without
  decorators) as the answer;
* ``explain``: the function without its docstring as the request, the docstring's first paragraph as the answer;
* ``tool_call``: the function as a tool (its JSON Schema from the parameters' annotations, else their numpydoc or
  Google-style docstring types, else their defaults' types; functions with a parameter of another type are not
  tools), beside 0-2 other tools of the corpus; a request naming the arguments' values, the answer the call
  ``{"name": ..., "arguments": {...}}`` whose arguments validate against the parameters' schema;
* ``tool_result``: the same call in the history, then the tool's result, and a sentence reporting it as the answer;
* ``no_tool``: tools given, but a ``write`` request: the answer is text (code), not a call.

A quarter of the examples start with a system message. Each tool function gives ``--tool-variants`` examples (other
argument values, wording and neighbouring tools). Examples whose ``[BOS] + prompt + answer + [EOS]`` exceed
``--seq-len`` tokens are left out, so ``prepare`` keeps every line. Everything is drawn from ``--seed``: the same
corpus, tokenizer and seed give the same file.

Outputs: ``FILE.jsonl`` (``{"prompt", "response"}`` lines, what ``python -m mercury_jax.prepare --corpus FILE.jsonl``
reads), ``FILE.sources.jsonl`` (line by line: the kind, the corpus, the file and the function each came from) and
``FILE.manifest.json`` (the command, seed, counts by kind and by distribution, and the source corpora's
distributions, versions and licences). ``--tools-out TOOLS.jsonl`` also writes the tool examples (``tool_call``,
``tool_result``, ``no_tool``) of ``FILE.jsonl``'s train lines (the JSONL corpus's split rule, by line index), to be
mixed in with a weight of their own: no example held out of ``FILE.jsonl`` is among them.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import random
import re
import sys
import textwrap
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mercury_jax.data import chat_format as chat, corpus as corpus_lib, sources
from mercury_jax.data.tokenizer import Tokenizer

KINDS = ("write", "explain", "tool_call", "tool_result", "no_tool")
SYSTEM_PROMPTS = (
  "You are a helpful assistant that writes Python code.",
  "You are a concise Python expert.",
  "You write clear, correct Python.",
)
TOOL_SYSTEM_PROMPTS = (
  "You can call the tools listed. To call one, answer with a JSON object holding its name and arguments.",
  "Use a tool when it fits the request.",
)
SYSTEM_SHARE = 0.25
MAX_PARAMETERS = 5
MAX_DESCRIPTION = 100  # Characters of a tool's description (its docstring's first sentence).
_SIMPLE = {"int": "integer", "float": "number", "str": "string", "bool": "boolean"}
_DOC_TYPES = {
  "int": "integer",
  "integer": "integer",
  "float": "number",
  "number": "number",
  "str": "string",
  "string": "string",
  "bool": "boolean",
  "boolean": "boolean",
}
# Parameter names whose type the corpus's conventions make plain, for parameters with no annotation, no documented
# type and no default (the stdlib annotates little): a name is a string, a count is an integer.
_NAMED = {
  **dict.fromkeys(
    (
      "name",
      "path",
      "filename",
      "fname",
      "text",
      "string",
      "s",
      "prefix",
      "suffix",
      "sep",
      "encoding",
      "url",
      "pattern",
      "title",
      "label",
      "message",
      "msg",
      "fmt",
      "host",
      "dirname",
      "directory",
      "source",
      "module",
      "attr",
      "word",
      "line",
    ),
    {"type": "string"},
  ),
  **dict.fromkeys(
    (
      "n",
      "count",
      "size",
      "width",
      "height",
      "index",
      "i",
      "j",
      "k",
      "level",
      "depth",
      "port",
      "offset",
      "length",
      "num",
      "limit",
      "maxsize",
      "timeout",
      "indent",
      "start",
      "stop",
      "step",
      "seed",
      "degree",
      "base",
      "precision",
      "lineno",
    ),
    {"type": "integer"},
  ),
  **dict.fromkeys(("x", "y", "z", "alpha", "beta", "tol", "rtol", "atol", "eps", "scale", "rate"), {"type": "number"}),
}
_SEQUENCES = {"list", "List", "Sequence", "Iterable", "tuple", "Tuple", "set", "Set", "frozenset"}
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-/]{1,24}")


@dataclasses.dataclass(frozen=True)
class Function:
  """A documented function of the corpus.

  Attributes:
    key: The document it comes from.
    qualname: ``name`` or ``Class.name``.
    signature: ``name(params)`` as written (annotations and defaults kept).
    source: The function's source, dedented, decorators left out.
    bare: The source without its docstring.
    summary: The docstring's first paragraph, on one line.
    parameters: The JSON Schema of its parameters, or None when it is no tool (a method, a private name, a
      parameter whose type is not a JSON type, or more than :data:`MAX_PARAMETERS`).
    returns: The JSON type of its return annotation, or "".
    words: String values for its string parameters (short literals and names of its document).
  """

  key: str
  qualname: str
  signature: str
  source: str
  bare: str
  summary: str
  parameters: dict | None
  returns: str
  words: tuple[str, ...]

  @property
  def name(self) -> str:
    return self.qualname.rsplit(".", 1)[-1]


# ----------------------------------------------------------------------------------------------- parsing


def _summary(docstring: str) -> str:
  """The first paragraph of a cleaned docstring, on one line."""
  return " ".join(docstring.strip().split("\n\n", 1)[0].split())


def _first_sentence(text: str) -> str:
  sentence = re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0]
  if len(sentence) <= MAX_DESCRIPTION:
    return sentence
  return sentence[:MAX_DESCRIPTION].rsplit(" ", 1)[0] + " ..."


def _annotation_schema(node: ast.expr | None) -> dict | None:
  """The JSON Schema of a parameter annotation, or None when it is not a JSON type."""
  if node is None:
    return None
  if isinstance(node, ast.Constant) and isinstance(node.value, str):  # A string annotation: "int".
    try:
      return _annotation_schema(ast.parse(node.value, mode="eval").body)
    except SyntaxError:
      return None
  if isinstance(node, ast.Name) and node.id in _SIMPLE:
    return {"type": _SIMPLE[node.id]}
  if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):  # X | None
    sides = [s for s in (node.left, node.right) if not (isinstance(s, ast.Constant) and s.value is None)]
    return _annotation_schema(sides[0]) if len(sides) == 1 else None
  if isinstance(node, ast.Subscript):
    base = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
    inner = node.slice
    if base == "Optional":
      return _annotation_schema(inner)
    if base == "Literal":
      values = inner.elts if isinstance(inner, ast.Tuple) else [inner]
      if values and all(isinstance(v, ast.Constant) and type(v.value) is str for v in values):
        return {"type": "string", "enum": [v.value for v in values]}
      if values and all(isinstance(v, ast.Constant) and type(v.value) is int for v in values):
        return {"type": "integer", "enum": [v.value for v in values]}
      return None
    if base in _SEQUENCES:
      items = inner.elts[0] if isinstance(inner, ast.Tuple) and inner.elts else inner
      item = _annotation_schema(items)
      return {"type": "array", "items": item} if item and item["type"] != "array" else None
  return None


def _docstring_types(docstring: str) -> dict[str, dict]:
  """Parameter types that a numpydoc (``x : int, optional``) or Google-style (``x (int): ...``) docstring states."""
  found = {}
  for name, kind in re.findall(r"^\s*(\w+)\s*:\s*([A-Za-z_ ]+?)\s*(?:,|$)", docstring, re.M):
    words = kind.lower().split()
    if len(words) == 1 and words[0] in _DOC_TYPES:
      found.setdefault(name, {"type": _DOC_TYPES[words[0]]})
    elif len(words) == 3 and words[:2] == ["list", "of"] and words[2].rstrip("s") in _DOC_TYPES:
      found.setdefault(name, {"type": "array", "items": {"type": _DOC_TYPES[words[2].rstrip("s")]}})
    elif words == ["array_like"]:
      found.setdefault(name, {"type": "array", "items": {"type": "number"}})
  for name, kind in re.findall(r"^\s*(\w+)\s*\(\s*([A-Za-z]+)[^)]*\)\s*:", docstring, re.M):
    if kind.lower() in _DOC_TYPES:
      found.setdefault(name, {"type": _DOC_TYPES[kind.lower()]})
  return found


def _default_schema(node: ast.expr | None) -> dict | None:
  if isinstance(node, ast.Constant) and type(node.value) in (int, float, str, bool):
    return {"type": {int: "integer", float: "number", str: "string", bool: "boolean"}[type(node.value)]}
  return None


def parameters_schema(node: ast.FunctionDef | ast.AsyncFunctionDef, docstring: str) -> dict | None:
  """The JSON Schema of a function's arguments (module docstring), or None when it is no tool.

  ``*args`` and ``**kwargs`` are left out; a parameter without a default is required.
  """
  args = node.args
  positional = [*args.posonlyargs, *args.args]
  defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
  named = list(zip(positional, defaults, strict=True)) + list(zip(args.kwonlyargs, args.kw_defaults, strict=True))
  if not named or len(named) > MAX_PARAMETERS:
    return None
  documented = _docstring_types(docstring)
  properties, required = {}, []
  for arg, default in named:
    if arg.arg in ("self", "cls"):
      return None
    schema = _annotation_schema(arg.annotation)
    if schema is None and arg.annotation is None:
      schema = documented.get(arg.arg) or _default_schema(default) or _NAMED.get(arg.arg)
    if schema is None:
      return None
    properties[arg.arg] = schema
    if default is None:
      required.append(arg.arg)
  return {"type": "object", "properties": properties, "required": required}


def _without_docstring(source: str, node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
  """``source`` (the function's own, starting at its ``def`` line) without the docstring's lines."""
  first = node.body[0]
  lines = source.splitlines()
  start, end = first.lineno - node.lineno, first.end_lineno - node.lineno + 1
  if len(node.body) == 1:  # Only a docstring: keep a body.
    indent = re.match(r"\s*", lines[start])[0]
    return "\n".join([*lines[:start], f"{indent}...", *lines[end:]])
  return "\n".join(lines[:start] + lines[end:])


def _words(tree: ast.Module) -> tuple[str, ...]:
  words = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and _WORD.fullmatch(node.value):
      words.add(node.value)
  return tuple(sorted(words))


def functions_of(document: corpus_lib.Document) -> list[Function]:
  """The documented functions of a Python document: module-level functions and methods of module-level classes."""
  with warnings.catch_warnings():  # Invalid escapes in old code warn (Python 3.12+); they still parse.
    warnings.simplefilter("ignore")
    tree = ast.parse(document.text)
  lines = document.text.splitlines()
  words = _words(tree)
  found = []
  for parent, node in [(None, n) for n in tree.body] + [
    (c.name, n) for c in tree.body if isinstance(c, ast.ClassDef) for n in c.body
  ]:
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    docstring = ast.get_docstring(node)
    summary = _summary(docstring or "")
    if not 15 <= len(summary) <= 300 or summary.startswith("{"):
      continue
    source = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
    header = f"{node.name}({ast.unparse(node.args)})"
    tool = parent is None and not node.name.startswith("_")
    schema = parameters_schema(node, docstring or "") if tool else None
    returns = _annotation_schema(node.returns)
    found.append(
      Function(
        key=document.key,
        qualname=node.name if parent is None else f"{parent}.{node.name}",
        signature=header,
        source=source,
        bare=_without_docstring(source, node),
        summary=summary,
        parameters=schema,
        returns=returns["type"] if returns and returns["type"] != "array" else "",
        words=words,
      )
    )
  return found


# ----------------------------------------------------------------------------------------------- examples


@dataclasses.dataclass(frozen=True)
class Example:
  """One mined conversation: ``messages`` and ``tools`` render the prompt; ``answer`` is the assistant's reply."""

  kind: str
  function: Function
  messages: tuple[dict, ...]
  tools: tuple[dict, ...]
  answer: str
  call: dict | None = None  # tool_call: the call's {"name", "arguments"}; tool_result: the call in the history.

  def prompt(self) -> str:
    return chat.render(list(self.messages), list(self.tools) or None)


def _value(schema: dict, rng: random.Random, words: Sequence[str]) -> Any:
  """A value of ``schema`` (the JSON types :func:`parameters_schema` produces)."""
  if "enum" in schema:
    return rng.choice(schema["enum"])
  kind = schema["type"]
  if kind == "integer":
    return rng.choice([rng.randint(0, 10), rng.randint(1, 100), rng.randint(-5, 5)])
  if kind == "number":
    return round(rng.uniform(0, 10), rng.choice([1, 2]))
  if kind == "boolean":
    return rng.random() < 0.5
  if kind == "string":
    return rng.choice(words) if words else rng.choice(["data", "name", "value", "path/to/file.txt", "x"])
  return [_value(schema["items"], rng, words) for _ in range(rng.randint(1, 3))]


def _arguments(function: Function, rng: random.Random) -> dict:
  """Every required argument and each optional one with probability 0.3, in the parameters' order."""
  schema = function.parameters
  chosen = {}
  for name, prop in schema["properties"].items():
    if name in schema["required"] or rng.random() < 0.3:
      chosen[name] = _value(prop, rng, function.words)
  return chosen


def _json(value: Any) -> str:
  return json.dumps(value, ensure_ascii=False)


def _request_for_call(function: Function, arguments: dict, rng: random.Random) -> str:
  name = function.name
  if not arguments:
    return rng.choice([f"Call `{name}`.", f"Run {name} with no arguments.", f"Use the {name} tool."])
  pairs = [(k, _json(v)) for k, v in arguments.items()]
  style = rng.randrange(4)
  if style == 0:
    listed = ", ".join(f"{k}={v}" for k, v in pairs[:-1])
    text = f"{listed} and {pairs[-1][0]}={pairs[-1][1]}" if listed else f"{pairs[0][0]}={pairs[0][1]}"
    return f"Call `{name}` with {text}."
  if style == 1:
    return f"Use the {name} tool: " + "; ".join(f"{k} is {v}" for k, v in pairs) + "."
  if style == 2:
    return f"{function.summary} Use {name} with " + ", ".join(f"{k} set to {v}" for k, v in pairs) + "."
  return f"Run {name}(" + ", ".join(f"{k}={v}" for k, v in pairs) + ")."


def _write_request(function: Function, rng: random.Random) -> str:
  sig, summary = function.signature, function.summary
  if "." in function.qualname:
    cls = function.qualname.split(".")[0]
    return rng.choice(
      [f"Write the method `{cls}.{sig}`:\n{summary}", f"{summary}\nImplement it as the method `{sig}` of `{cls}`."]
    )
  return rng.choice(
    [
      f"Write a Python function `{sig}` that does the following:\n{summary}",
      f"{summary}\nImplement it as `{sig}`.",
      f"Implement `{sig}` in Python. Its docstring: {summary}",
      f"Can you write `{function.name}`? {summary}",
    ]
  )


def _explain_request(function: Function, rng: random.Random) -> str:
  code = function.bare
  return rng.choice(
    [
      f"What does this function do?\n```python\n{code}\n```",
      f"Explain this code briefly:\n{code}",
      f"Write a one-paragraph docstring for:\n```python\n{code}\n```",
    ]
  )


def _system(rng: random.Random, tools: bool) -> list[dict]:
  if rng.random() >= SYSTEM_SHARE:
    return []
  return [{"role": chat.SYSTEM, "content": rng.choice(TOOL_SYSTEM_PROMPTS if tools else SYSTEM_PROMPTS)}]


def _tool_of(function: Function) -> dict:
  return chat.tool(function.name, function.parameters, _first_sentence(function.summary))


def _neighbours(function: Function, pool: Sequence[Function], rng: random.Random, count: int) -> list[dict]:
  others = {f.name: f for f in rng.sample(list(pool), min(len(pool), count + 2)) if f.name != function.name}
  return [_tool_of(f) for f in list(others.values())[:count]]


def _result(function: Function, rng: random.Random) -> str:
  kind = function.returns or rng.choice(["integer", "string", "boolean", "number"])
  return _json(_value({"type": kind}, rng, function.words))


def examples_of(function: Function, tools: Sequence[Function], rng: random.Random, tool_variants: int) -> list[Example]:
  """Every kind of example ``function`` gives (module docstring); ``tools`` is the corpus's pool of tool functions."""
  user = lambda text: {"role": chat.USER, "content": text}  # noqa: E731
  out = [Example("write", function, (*_system(rng, False), user(_write_request(function, rng))), (), function.source)]
  if function.bare.count("\n") >= 2:
    out.append(
      Example("explain", function, (*_system(rng, False), user(_explain_request(function, rng))), (), function.summary)
    )
  if rng.random() < 0.1 and tools:
    listed = _neighbours(function, tools, rng, rng.randint(1, 2))
    request = user(_write_request(function, rng))
    out.append(Example("no_tool", function, (*_system(rng, True), request), tuple(listed), function.source))
  if function.parameters is None:
    return out
  for variant in range(tool_variants):
    listed = [_tool_of(function), *_neighbours(function, tools, rng, rng.randint(0, 2))]
    rng.shuffle(listed)
    arguments = _arguments(function, rng)
    call = {"name": function.name, "arguments": arguments}
    request = user(_request_for_call(function, arguments, rng))
    system = _system(rng, True)
    if variant == 0 or rng.random() >= 0.2:
      answer = chat.call_text(function.name, arguments)
      out.append(Example("tool_call", function, (*system, request), tuple(listed), answer, call))
      continue
    result = _result(function, rng)
    history = (request, chat.assistant_call(function.name, arguments), {"role": chat.TOOL, "content": result})
    answer = rng.choice([f"`{function.name}` returned {result}.", f"The result is {result}."])
    out.append(Example("tool_result", function, (*system, *history), tuple(listed), answer, call))
  return out


def mine(
  documents: Sequence[corpus_lib.Document], tokenizer: Tokenizer, *, seq_len: int, seed: int, tool_variants: int
) -> tuple[list[Example], dict[str, Any]]:
  """The examples of ``documents``' train split that fit ``seq_len`` tokens, and counts for the manifest."""
  functions = [f for d in documents if d.split == corpus_lib.TRAIN for f in functions_of(d)]
  pool = [f for f in functions if f.parameters is not None]
  rng = random.Random(seed)
  candidates = [e for f in functions for e in examples_of(f, pool, rng, tool_variants)]
  prompts = tokenizer.encode_batch([e.prompt() for e in candidates])
  answers = tokenizer.encode_batch([e.answer for e in candidates])
  kept = [e for e, p, a in zip(candidates, prompts, answers, strict=True) if 1 + len(p) + len(a) + 1 <= seq_len]
  counts = {
    "functions": len(functions),
    "tool_functions": len(pool),
    "candidates": dict(Counter(e.kind for e in candidates)),
    "examples": dict(Counter(e.kind for e in kept)),
    "too_long": len(candidates) - len(kept),
  }
  return kept, counts


# ----------------------------------------------------------------------------------------------- command line


def _source_summary(mixture) -> list[dict]:
  """Each corpus's spec, kind, Python version and distributions (name, version, licence), without file lists."""
  out = []
  for part in mixture.parts:
    manifest = part.corpus.manifest()
    entry = {"spec": part.spec, "kind": manifest["kind"]}
    for name in ("python_version", "python_implementation", "split_rule"):
      if name in manifest:
        entry[name] = manifest[name]
    if "distributions" in manifest:
      entry["distributions"] = [
        {k: d[k] for k in ("name", "version", "license")} for d in manifest["distributions"] if d["files"]
      ]
    out.append(entry)
  return out


def _owners(mixture) -> dict[str, str]:
  """Document key -> its distribution (site-packages) or corpus spec."""
  owners = {}
  for part in mixture.parts:
    for f in part.corpus.files:
      owners[f.path] = getattr(f, "distribution", None) or part.spec
  return owners


TOOL_KINDS = ("tool_call", "tool_result", "no_tool")


def write(
  examples: Sequence[Example],
  out: Path,
  manifest: dict[str, Any],
  owners: dict[str, str],
  tools_out: Path | None = None,
) -> None:
  """Writes ``out`` (prompt/response lines), ``out.sources.jsonl``, ``out.manifest.json`` and, with ``tools_out``,
  the train lines' tool examples (module docstring)."""
  out.parent.mkdir(parents=True, exist_ok=True)
  if tools_out is not None:
    train_tools = [
      e for i, e in enumerate(examples) if e.kind in TOOL_KINDS and corpus_lib.split_of(str(i)) == corpus_lib.TRAIN
    ]
    with tools_out.open("w") as lines:
      for e in train_tools:
        lines.write(json.dumps({"prompt": e.prompt(), "response": e.answer}, ensure_ascii=False) + "\n")
    manifest = {**manifest, "tools_out": {"file": tools_out.name, "examples": len(train_tools)}}
    manifest["tools_out"]["sha256"] = hashlib.sha256(tools_out.read_bytes()).hexdigest()
  by_distribution = Counter(owners.get(e.function.key, "") for e in examples)
  with out.open("w") as lines, out.with_suffix(".sources.jsonl").open("w") as provenance:
    for e in examples:
      lines.write(json.dumps({"prompt": e.prompt(), "response": e.answer}, ensure_ascii=False) + "\n")
      owner = owners.get(e.function.key, "")
      provenance.write(
        json.dumps({"kind": e.kind, "source": owner, "key": e.function.key, "function": e.function.qualname}) + "\n"
      )
  manifest = {**manifest, "by_source": dict(sorted(by_distribution.items()))}
  manifest["sha256"] = hashlib.sha256(out.read_bytes()).hexdigest()
  out.with_suffix(".manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m mercury_jax.data.instructions", description=__doc__.split("\n")[0])
  parser.add_argument("--corpus", action="append", required=True, metavar="SPEC", help="as prepare's --corpus")
  parser.add_argument("--tokenizer", required=True, help="the tokenizer.model the examples must fit with")
  parser.add_argument("--out", required=True, help="the JSONL file to write")
  parser.add_argument("--seq-len", type=int, default=256, help="a record's length: longer examples are left out")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--tool-variants", type=int, default=3, help="examples per tool function (default 3)")
  parser.add_argument("--tools-out", help="also write the train lines' tool examples to this JSONL file")
  args = parser.parse_args(argv)
  try:
    mixture = sources.load_mixture(args.corpus)
    tokenizer = Tokenizer.load(args.tokenizer)
    documents = mixture.split(corpus_lib.TRAIN)
    examples, counts = mine(
      documents, tokenizer, seq_len=args.seq_len, seed=args.seed, tool_variants=args.tool_variants
    )
  except (ValueError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  manifest = {
    "command": "python -m mercury_jax.data.instructions " + " ".join(argv if argv is not None else sys.argv[1:]),
    "seed": args.seed,
    "seq_len": args.seq_len,
    "tool_variants": args.tool_variants,
    "tokenizer_sha256": hashlib.sha256(Path(args.tokenizer).read_bytes()).hexdigest(),
    "chat_template_sha256": hashlib.sha256(chat.TEMPLATE.encode()).hexdigest(),
    "split": "functions of the corpora's train split only",
    **counts,
    "corpora": _source_summary(mixture),
  }
  write(examples, Path(args.out), manifest, _owners(mixture), Path(args.tools_out) if args.tools_out else None)
  print(f"{len(examples):,} examples of {counts['functions']:,} functions ({counts['examples']}) -> {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
