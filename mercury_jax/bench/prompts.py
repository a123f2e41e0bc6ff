"""The benchmark's fixed prompt set: function signatures with their docstrings, from held-out Python sources.

A prompt is the source text of a ``def`` (or ``async def``) from its ``def`` line through the line that closes its
docstring, dedented, ending in a newline: the model is asked to write the body. Functions without a docstring are
skipped, and so is any prompt that does not parse on its own once dedented (a docstring line indented less than
its ``def``), so every prompt is a complete function whose body is only the docstring. The order is stable: corpus
order of the documents (sorted by key), then source order within a document.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from mercury_jax.data import corpus as corpus_lib, pipeline, sources

# Short code prompts of the serving and accelerator benchmarks (``bench serve``'s default, ``bench gpu-sampling``).
CODE_PROMPTS = (
  "def fibonacci(n):",
  "import os\n",
  "class Stack:\n    def push(self, item):",
  "def is_prime(n):",
  "def read_config(path):",
  "import json\n\ndef load(path):",
  "def merge_sorted(a, b):",
  "for i in range(10):",
  "class Node:\n    def __init__(self, value):",
  "def binary_search(items, target):",
  "def parse_args():",
  "import numpy as np\n\ndef normalize(x):",
  "def flatten(nested):",
  "with open('data.txt') as f:",
  "def quicksort(items):",
  "class Counter:\n    def increment(self):",
)


class Prompt(NamedTuple):
  """One prompt and where it came from (``key`` is the corpus document key, ``line`` its 1-based ``def`` line)."""

  key: str
  line: int
  text: str


def function_prompts(source: str, key: str = "") -> list[Prompt]:
  """Every documented function of ``source`` as a prompt (see the module docstring); [] if it does not parse."""
  try:
    tree = ast.parse(source)
  except (SyntaxError, ValueError):
    return []
  lines = source.splitlines(keepends=True)
  functions = [
    node
    for node in ast.walk(tree)
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and ast.get_docstring(node, clean=False) is not None
  ]
  prompts = []
  for node in sorted(functions, key=lambda n: (n.lineno, n.col_offset)):
    text = textwrap.dedent("".join(lines[node.lineno - 1 : node.body[0].end_lineno]))
    text = text if text.endswith("\n") else text + "\n"
    try:
      ast.parse(text)
    except (SyntaxError, ValueError):
      continue
    prompts.append(Prompt(key, node.lineno, text))
  return prompts


def spread(items: Sequence, n: int) -> list:
  """``n`` items evenly spaced over ``items`` (all of them when there are at most ``n``), in order."""
  if len(items) <= n:
    return list(items)
  return [items[i * len(items) // n] for i in range(n)]


def corpus_prompts(spec: str, split: str = corpus_lib.VALIDATION) -> list[Prompt]:
  """Every documented-function prompt of one split of a corpus (``python-stdlib``, a glob, ...), in stable order."""
  documents = sources.load_corpus(spec).split(split)
  return [p for d in documents for p in function_prompts(d.text, d.key)]


def select_prompts(
  data_dir: str | Path | None, n: int, fits: Callable[[str], bool], corpus: str | None = None
) -> tuple[list[Prompt], str]:
  """``n`` prompts spread over the validation split of the corpus that ``data_dir`` was prepared from (or ``corpus``).

  Args:
    data_dir: A prepared data directory; its ``metadata.json`` names the corpus (None: ``corpus`` is needed).
    n: How many prompts.
    fits: Keeps a prompt text (e.g. it leaves room to generate in the model's context).
    corpus: Read this corpus instead of the one named in the metadata (e.g. a glob relative to another folder).

  Returns:
    ``(prompts, corpus spec read)``; fewer than ``n`` prompts when the split has fewer that fit.

  Raises:
    ValueError: The data directory is not prepared, the corpus cannot be read, or no prompt fits.
  """
  if corpus is None and data_dir is None:
    raise ValueError("no corpus to take prompts from: give --corpus (or --data, a prepared data directory)")
  spec = corpus or pipeline.read_metadata(data_dir)["corpus"]
  candidates = [p for p in corpus_prompts(spec) if fits(p.text)]
  if not candidates:
    raise ValueError(
      f"the validation split of corpus {spec!r} has no documented Python function that fits the context "
      "(a def with a docstring); pass --corpus to read it from elsewhere"
    )
  return spread(candidates, n), spec
