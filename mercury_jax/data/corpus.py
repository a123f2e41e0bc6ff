"""Documents and corpora: the Python standard library, a glob of text files, JSONL, and deduplication across corpora.

Every source yields ``Document``s already assigned to the ``train`` or ``validation`` split by a stable hash, so the
split never depends on file order, the machine, or how many files there are:

* files (stdlib, site-packages and text globs): validation iff
  ``int(sha1(relative_posix_path).hexdigest(), 16) % 20 == 0``;
* JSONL lines: the same rule applied to the line's 0-based index within its file, as a decimal string (``"0"``,
  ``"1"``, ...). With several JSONL files, lines with equal indices land in the same split.

A corpus also describes itself in a manifest (source, Python version for the stdlib, per-file sha256 and character
count, per-split document and character counts), because the stdlib corpus drifts with the interpreter. The
``site-packages`` corpus lives in ``site_packages``.

Several corpora read together, each with a weight, are a ``mixture.Mixture``. This module is the base the sources
build on and imports none of them; ``sources.load_corpus`` reads a ``--corpus`` spec.
"""

from __future__ import annotations

import ast
import dataclasses
import glob
import hashlib
import json
import os
import platform
import sysconfig
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

TRAIN = "train"
VALIDATION = "validation"
SPLITS = (TRAIN, VALIDATION)
VALIDATION_MODULUS = 20  # One key in 20 goes to validation.

STDLIB = "python-stdlib"
SITE_PACKAGES = "site-packages"
STDLIB_SKIP_DIRS = frozenset(
  {
    "test",
    "tests",
    "idle_test",
    "idlelib",
    "lib2to3",
    "encodings",
    "pydoc_data",
    "turtledemo",
    "ensurepip",
    "site-packages",
  }
)
STDLIB_MAX_BYTES = 200 * 1024

_WILDCARDS = frozenset("*?[")


@dataclasses.dataclass(frozen=True)
class Document:
  """One training example.

  Attributes:
    key: Where it came from: a relative posix path, or ``"file.jsonl:LINE"`` (1-based line number) for JSONL.
    split: ``"train"`` or ``"validation"``.
    text: The target text: the whole document for language modelling, the response for SFT.
    prompt: The conditioning text for SFT (prompt/response) examples; ``None`` for language modelling.
  """

  key: str
  split: str
  text: str
  prompt: str | None = None


@dataclasses.dataclass(frozen=True)
class SourceFile:
  """A file that a corpus read, as recorded in the manifest."""

  path: str  # Relative to the corpus root, posix separators.
  sha256: str
  characters: int
  documents: int


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Documents of one source, in a deterministic order, with what is needed for the manifest.

  Attributes:
    kind: ``"python-stdlib"``, ``"site-packages"``, ``"text"`` or ``"jsonl"``.
    source: What was read, e.g. ``"python-stdlib"`` or the glob as given.
    root: The directory that file keys are relative to.
    mode: ``"lm"`` (language modelling) or ``"sft"`` (prompt/response).
    documents: All documents, sorted by file then line.
    files: Every file read.
    info: More manifest entries (site-packages: the distributions read and skipped, and the duplicates dropped).
  """

  kind: Literal["python-stdlib", "site-packages", "text", "jsonl"]
  source: str
  root: str
  mode: Literal["lm", "sft"]
  documents: tuple[Document, ...]
  files: tuple[SourceFile, ...]
  info: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False)

  def split(self, name: str) -> list[Document]:
    """The documents of split ``name`` (``"train"`` or ``"validation"``), in corpus order."""
    if name not in SPLITS:
      raise ValueError(f"split={name!r} must be one of {SPLITS}")
    return [d for d in self.documents if d.split == name]

  def manifest(self) -> dict[str, Any]:
    """A JSON-serialisable description: source, Python version (stdlib), per-file hashes, per-split counts."""
    splits = {}
    for name in SPLITS:
      docs = self.split(name)
      splits[name] = {
        "documents": len(docs),
        "characters": sum(len(d.text) for d in docs),
        "prompt_characters": sum(len(d.prompt or "") for d in docs),
      }
    key = "str(0-based line index in its file)" if self.kind == "jsonl" else "relative posix path"
    manifest: dict[str, Any] = {"kind": self.kind, "source": self.source, "root": self.root, "mode": self.mode}
    if self.kind in (STDLIB, SITE_PACKAGES):  # Both are filtered by this interpreter's parser.
      manifest["python_version"] = platform.python_version()
      manifest["python_implementation"] = platform.python_implementation()
    manifest["split_rule"] = f"validation iff int(sha1(key).hexdigest(), 16) % {VALIDATION_MODULUS} == 0, key = {key}"
    manifest["splits"] = splits
    manifest.update(self.info)
    manifest["files"] = [dataclasses.asdict(f) for f in self.files]
    return manifest


def split_of(key: str) -> str:
  """The split of a document key (a relative posix path or a JSONL line index as a string)."""
  digest = int(hashlib.sha1(key.encode("utf-8")).hexdigest(), 16)
  return VALIDATION if digest % VALIDATION_MODULUS == 0 else TRAIN


def is_jsonl_spec(spec: str) -> bool:
  """Whether a ``--corpus`` value names JSONL (a path or glob ending in ``.jsonl``)."""
  return spec.endswith(".jsonl")


# ----------------------------------------------------------------------------------------------- python-stdlib


def keep_python_source(data: bytes) -> bool:
  """The content filter of the Python corpora: non-empty ASCII under 200 KB that ``ast.parse`` accepts."""
  if not data or len(data) >= STDLIB_MAX_BYTES or not data.isascii():
    return False
  try:
    with warnings.catch_warnings():  # Invalid escapes in old code warn (Python 3.12+); they still parse.
      warnings.simplefilter("ignore")
      ast.parse(data.decode("ascii"))
  except (SyntaxError, ValueError, RecursionError):
    return False
  return True


def keep_stdlib_file(rel_path: str, data: bytes) -> bool:
  """The corpora.md filter: outside skipped folders, not ``test_*``, and ``keep_python_source``."""
  parts = rel_path.split("/")
  if any(p in STDLIB_SKIP_DIRS for p in parts[:-1]) or parts[-1].startswith("test_"):
    return False
  return keep_python_source(data)


def stdlib_corpus(root: str | os.PathLike | None = None) -> Corpus:
  """The running interpreter's standard-library ``.py`` sources (or those under ``root``), filtered.

  Args:
    root: The stdlib directory; defaults to ``sysconfig.get_paths()["stdlib"]``.
  """
  base = Path(root or sysconfig.get_paths()["stdlib"])
  if not base.is_dir():
    raise ValueError(f"python-stdlib: {str(base)!r} is not a directory")
  docs, files = [], []
  for dirpath, dirnames, filenames in os.walk(base):
    dirnames[:] = sorted(d for d in dirnames if d not in STDLIB_SKIP_DIRS and d != "__pycache__")
    for filename in sorted(filenames):
      if not filename.endswith(".py"):
        continue
      path = Path(dirpath) / filename
      rel = path.relative_to(base).as_posix()
      data = path.read_bytes()
      if keep_stdlib_file(rel, data):
        text = data.decode("ascii")
        docs.append(Document(rel, split_of(rel), text))
        files.append(SourceFile(rel, hashlib.sha256(data).hexdigest(), len(text), 1))
  order = sorted(range(len(docs)), key=lambda i: docs[i].key)
  return Corpus(STDLIB, STDLIB, str(base), "lm", tuple(docs[i] for i in order), tuple(files[i] for i in order))


# ----------------------------------------------------------------------------------------------- globs


def glob_root(pattern: str) -> Path:
  """The leading path components of ``pattern`` that hold no wildcard (a plain file's parent folder)."""
  parts = Path(pattern).parts
  fixed = []
  for part in parts:
    if _WILDCARDS & set(part):
      return Path(*fixed) if fixed else Path(".")
    fixed.append(part)
  return Path(pattern).parent


def match_files(pattern: str) -> tuple[Path, list[Path]]:
  """Files matching ``pattern`` (``**`` recurses), sorted, with the glob's root.

  Raises:
    ValueError: Nothing matches.
  """
  root = glob_root(pattern)
  paths = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
  if not paths:
    raise ValueError(f"--corpus {pattern!r} matches no files")
  return root, paths


def _read_text(path: Path) -> tuple[str, bytes]:
  try:
    data = path.read_bytes()
  except OSError as e:
    raise ValueError(f"cannot read {str(path)!r}: {e.strerror or e}") from None
  try:
    return data.decode("utf-8"), data
  except UnicodeDecodeError as e:
    raise ValueError(f"{str(path)!r} is not UTF-8 text (byte {e.start})") from None


def text_corpus(pattern: str) -> Corpus:
  """One document per file matching ``pattern``; keys are paths relative to the glob's wildcard-free root.

  Empty files are skipped.
  """
  root, paths = match_files(pattern)
  docs, files = [], []
  for path in paths:
    text, data = _read_text(path)
    rel = path.relative_to(root).as_posix()
    files.append(SourceFile(rel, hashlib.sha256(data).hexdigest(), len(text), 1 if text else 0))
    if text:
      docs.append(Document(rel, split_of(rel), text))
  return Corpus("text", pattern, str(root), "lm", tuple(docs), tuple(files))


def _parse_jsonl_line(line: str, where: str) -> tuple[str, str | None]:
  """Returns ``(text, prompt)`` of one JSONL line, or raises a ValueError naming ``where``."""
  try:
    obj = json.loads(line)
  except json.JSONDecodeError as e:
    raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
  if not isinstance(obj, dict):
    raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
  if "text" in obj and "prompt" not in obj and "response" not in obj:
    fields = {"text": obj["text"]}
  elif "prompt" in obj and "response" in obj and "text" not in obj:
    fields = {"prompt": obj["prompt"], "response": obj["response"]}
  else:
    raise ValueError(f"{where}: expected keys {{'text'}} or {{'prompt', 'response'}}, got {sorted(obj)}")
  for name, value in fields.items():
    if not isinstance(value, str):
      raise ValueError(f"{where}: {name!r} must be a string, got {type(value).__name__}")
  if "text" in fields:
    return fields["text"], None
  return fields["response"], fields["prompt"]


def jsonl_corpus(pattern: str) -> Corpus:
  """Documents from JSONL lines: ``{"text": ...}`` (language modelling) or ``{"prompt": ..., "response": ...}`` (SFT).

  Blank lines are skipped (but still counted for line numbers and indices). All lines of a corpus must be of one kind.

  Raises:
    ValueError: A line is not JSON, not an object, has other keys or non-string values, or the kinds are mixed; the
      message names the file and the 1-based line number.
  """
  root, paths = match_files(pattern)
  docs, files = [], []
  mode = None
  for path in paths:
    content, data = _read_text(path)
    rel = path.relative_to(root).as_posix()
    count = 0
    for index, line in enumerate(content.splitlines()):
      if not line.strip():
        continue
      where = f"{path}:{index + 1}"
      text, prompt = _parse_jsonl_line(line, where)
      line_mode = "lm" if prompt is None else "sft"
      if mode is None:
        mode, first = line_mode, where
      elif line_mode != mode:
        raise ValueError(
          f"{where}: a {line_mode!r} line, but {first} made this corpus {mode!r}; do not mix "
          "{'text'} and {'prompt', 'response'} lines"
        )
      docs.append(Document(f"{rel}:{index + 1}", split_of(str(index)), text, prompt))
      count += 1
    files.append(SourceFile(rel, hashlib.sha256(data).hexdigest(), len(content), count))
  if mode is None:
    raise ValueError(f"--corpus {pattern!r}: the JSONL files hold no lines")
  return Corpus("jsonl", pattern, str(root), mode, tuple(docs), tuple(files))


# ----------------------------------------------------------------------------------------------- deduplication


def deduplicate(sources: Sequence[tuple[str, Sequence[Document]]]) -> tuple[list[list[Document]], list[dict[str, str]]]:
  """Keeps the first document of each content (sha256 of its text, and prompt for SFT), in the order given.

  Args:
    sources: ``(corpus spec, documents)`` pairs.

  Returns:
    The kept documents of each source, and one ``{"sha256", "corpus", "key", "kept_corpus", "kept_key"}`` entry
    per dropped copy.
  """
  first: dict[str, tuple[str, str]] = {}
  kept, duplicates = [], []
  for spec, docs in sources:
    kept.append([])
    for doc in docs:
      content = doc.text if doc.prompt is None else json.dumps([doc.prompt, doc.text])
      digest = hashlib.sha256(content.encode("utf-8")).hexdigest()
      if digest in first:
        kept_spec, kept_key = first[digest]
        duplicates.append(
          {"sha256": digest, "corpus": spec, "key": doc.key, "kept_corpus": kept_spec, "kept_key": kept_key}
        )
      else:
        first[digest] = (spec, doc.key)
        kept[-1].append(doc)
  return kept, duplicates
