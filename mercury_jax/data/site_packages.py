"""The ``site-packages`` corpus: Python sources of installed distributions that carry a permissive licence.

``site-packages`` reads every installed distribution whose licence is permissive; ``site-packages:numpy,jax`` reads
only those (names normalised as in PEP 503), and a name that is not installed, or whose licence is not permissive or
not readable, is an error. A distribution's ``.py`` files are those its ``RECORD`` lists under its site-packages
folder, outside test and vendored folders; each then passes the stdlib corpus's content filter (non-empty ASCII under
200 KB that ``ast.parse`` accepts). A document's key is its path in site-packages (``numpy/linalg/_linalg.py``), which
starts with the package's import name and is the same on every machine, so the split is too. Identical files (one
vendored by two packages) are kept once: the first in key order.

Licences (the first of these that a distribution's metadata states decides):

1. ``License-Expression`` (PEP 639), an SPDX expression;
2. ``License``: a known name or spelling (``MIT License``, ``Apache 2.0``, ``3-Clause BSD License``), an SPDX
   expression, or a pasted licence text read by its title line (``Apache License``); other text falls through;
3. the ``License ::`` classifiers, read as AND (all must be permissive; the conservative reading of a list).

Permissive: MIT, MIT-0, BSD-2-Clause, BSD-3-Clause, the unversioned "BSD" of the classifier, 0BSD, Apache-2.0,
PSF-2.0, Python-2.0, ISC, Zlib and CC0-1.0. ``A OR B`` is permissive if either is, ``A AND B`` if both are,
``A WITH exception`` if ``A`` is. Anything else, or no readable licence, is not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import os
import re
import site
import sysconfig
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from mercury_jax.data import corpus as corpus_lib

SITE_PACKAGES = corpus_lib.SITE_PACKAGES
PERMISSIVE = frozenset(
  {
    "MIT",
    "MIT-0",
    "BSD",
    "BSD-2-Clause",
    "BSD-3-Clause",
    "0BSD",
    "Apache-2.0",
    "PSF-2.0",
    "Python-2.0",
    "ISC",
    "Zlib",
    "CC0-1.0",
  }
)
# Folders whose files are tests, or third-party code that may carry another licence than the distribution's.
SKIP_DIRS = frozenset(
  {
    "test",
    "tests",
    "__pycache__",
    "_vendor",
    "vendor",
    "_vendored",
    "vendored",
    "third_party",
    "_third_party",
    "externals",
    "_externals",
  }
)

# Words dropped before a licence name is looked up, so "The MIT License" and "MIT" meet.
_NOISE = frozenset({"the", "license", "licence", "licensed", "version", "v", "software", "osi", "approved"})
_ALIASES = {
  "mit": "MIT",
  "expat": "MIT",
  "mit 0": "MIT-0",
  "bsd": "BSD",
  "bsd 2 clause": "BSD-2-Clause",
  "2 clause bsd": "BSD-2-Clause",
  "bsd 2": "BSD-2-Clause",
  "simplified bsd": "BSD-2-Clause",
  "bsd simplified": "BSD-2-Clause",
  "freebsd": "BSD-2-Clause",
  "bsd 3 clause": "BSD-3-Clause",
  "3 clause bsd": "BSD-3-Clause",
  "bsd 3": "BSD-3-Clause",
  "new bsd": "BSD-3-Clause",
  "bsd new": "BSD-3-Clause",
  "modified bsd": "BSD-3-Clause",
  "revised bsd": "BSD-3-Clause",
  "0bsd": "0BSD",
  "apache": "Apache-2.0",
  "apache 2": "Apache-2.0",
  "apache 2.0": "Apache-2.0",
  "apache2": "Apache-2.0",
  "asl 2.0": "Apache-2.0",
  "psf": "PSF-2.0",
  "psfl": "PSF-2.0",
  "psf 2.0": "PSF-2.0",
  "python foundation": "PSF-2.0",
  "python 2.0": "Python-2.0",
  "isc": "ISC",
  "iscl": "ISC",
  "zlib": "Zlib",
  "cc0": "CC0-1.0",
  "cc0 1.0": "CC0-1.0",
  "cc0 1.0 universal cc0 1.0 public domain dedication": "CC0-1.0",
}
_OPERATORS = {"and": "AND", "or": "OR", "with": "WITH"}
_LICENSE_ID = re.compile(r"[A-Za-z0-9.+-]+")


@dataclasses.dataclass(frozen=True)
class License:
  """A distribution's licence as read from its metadata.

  Attributes:
    expression: The normalised SPDX-style expression (``"BSD-3-Clause"``, ``"Apache-2.0 OR BSD-2-Clause"``), or
      ``""`` when none is readable.
    permissive: Whether the corpus may use the distribution.
    field: The metadata field that decided (``"License-Expression"``, ``"License"`` or ``"Classifier"``), or that
      held the unreadable text; ``""`` when the metadata states nothing.
    text: What the metadata said (its first line), for messages.
  """

  expression: str
  permissive: bool
  field: str
  text: str

  def describe(self) -> str:
    """``'GPL-3.0-only' (License-Expression)`` or ``no readable licence (License: 'Custom')``."""
    if self.expression:
      return f"{self.expression!r} ({self.field})"
    return f"no readable licence ({self.field}: {self.text!r})" if self.text else "no licence in its metadata"


def normalize_name(name: str) -> str:
  """A distribution name as PEP 503 normalises it: lower case, runs of ``-_.`` become ``-``."""
  return re.sub(r"[-_.]+", "-", name).lower()


def _alias(name: str) -> str | None:
  """The SPDX id of a known licence name; ``"The MIT License (MIT)"`` is also read without its closing bracket."""
  outer = re.sub(r"\s*\([^()]*\)\s*$", "", name)
  for candidate in (name, outer):
    words = re.sub(r"[^a-z0-9.+]+", " ", candidate.lower()).split()
    spdx = _ALIASES.get(" ".join(w for w in words if w not in _NOISE))
    if spdx:
      return spdx
  return None


def parse_expression(text: str) -> tuple[str, bool] | None:
  """``(normalised expression, permissive)`` of an SPDX licence expression, or ``None`` if it does not parse."""
  tokens = re.findall(r"\(|\)|[^\s()]+", text)
  pos = 0

  def peek() -> str | None:
    return _OPERATORS.get(tokens[pos].lower(), tokens[pos]) if pos < len(tokens) else None

  def take() -> str:
    nonlocal pos
    pos += 1
    return tokens[pos - 1]

  def binary(operator: str, operand) -> tuple[str, bool, str]:
    """``(text, permissive, top-level operator)`` of ``operand (operator operand)*``."""
    items = [operand()]
    while peek() == operator:
      take()
      items.append(operand())
    if len(items) == 1:
      return items[0]
    # AND binds tighter than OR, so only an OR inside an AND needs parentheses.
    joined = f" {operator} ".join(f"({t})" if operator == "AND" and op == "OR" else t for t, _, op in items)
    flags = [p for _, p, _ in items]
    return joined, (all(flags) if operator == "AND" else any(flags)), operator

  def factor() -> tuple[str, bool, str]:
    if peek() == "(":
      take()
      inner = binary("OR", lambda: binary("AND", factor))
      if peek() != ")":
        raise ValueError
      take()
      return inner
    token = take() if pos < len(tokens) else ""
    if not _LICENSE_ID.fullmatch(token) or token.lower() in _OPERATORS:
      raise ValueError
    name = _alias(token) or token
    if peek() == "WITH":
      take()
      exception = take() if pos < len(tokens) else ""
      if not _LICENSE_ID.fullmatch(exception):
        raise ValueError
      return f"{name} WITH {exception}", name in PERMISSIVE, ""
    return name, name in PERMISSIVE, ""

  try:
    text, permissive, _ = binary("OR", lambda: binary("AND", factor))
  except ValueError:
    return None
  return (text, permissive) if pos == len(tokens) else None


def read_license(metadata: Any) -> License:
  """The licence that a distribution's metadata (an ``email.message.Message``) states; see the module docstring."""
  expression = (metadata.get("License-Expression") or "").strip()
  if expression:
    parsed = parse_expression(expression)
    if parsed is None:
      return License("", False, "License-Expression", expression)
    return License(*parsed, "License-Expression", expression)
  text = (metadata.get("License") or "").strip()
  title = next((line.strip() for line in text.splitlines() if line.strip()), "")
  if text and text.upper() != "UNKNOWN":
    name = _alias(text)
    if name:
      return License(name, name in PERMISSIVE, "License", title)
    parsed = parse_expression(text)
    if parsed is not None:
      return License(*parsed, "License", title)
    name = _alias(title)
    if name:
      return License(name, name in PERMISSIVE, "License", title)
  classifiers = [c.split("::")[-1].strip() for c in metadata.get_all("Classifier") or [] if c.startswith("License ::")]
  names = list(dict.fromkeys(_alias(c) or c for c in classifiers if c != "OSI Approved"))
  if names:
    return License(" AND ".join(names), all(n in PERMISSIVE for n in names), "Classifier", "; ".join(classifiers))
  unreadable = text and text.upper() != "UNKNOWN"
  return License("", False, "License" if unreadable else "", title if unreadable else "")


@dataclasses.dataclass(frozen=True)
class PackageFile(corpus_lib.SourceFile):
  """A source file of a distribution, as recorded in the manifest (``path`` is relative to site-packages)."""

  distribution: str
  version: str
  license: str


def _site_roots() -> list[Path]:
  paths = [*site.getsitepackages(), site.getusersitepackages()]
  paths += [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
  return [Path(p).resolve() for p in dict.fromkeys(paths)]


def installed(path: Sequence[str | Path] | None = None) -> dict[str, importlib.metadata.Distribution]:
  """Installed distributions by normalised name, the first found on the path winning (as imports do).

  Args:
    path: Folders to look in; defaults to ``sys.path``, of which only the site-packages folders count (a
      ``*.egg-info`` in the working directory is no installed distribution).
  """
  roots = _site_roots() if path is None else [Path(p).resolve() for p in path]
  found = (
    importlib.metadata.distributions() if path is None else importlib.metadata.distributions(path=list(map(str, path)))
  )
  result: dict[str, importlib.metadata.Distribution] = {}
  for dist in found:
    name = dist.metadata["Name"] if dist.metadata else None
    if name and Path(dist.locate_file("")).resolve() in roots:
      result.setdefault(normalize_name(name), dist)
  return result


def is_source_path(rel: str) -> bool:
  """Whether a ``RECORD`` path is a ``.py`` file inside site-packages, outside test and vendored folders."""
  path = PurePosixPath(rel)
  parts = path.parts
  if path.is_absolute() or ".." in parts or not parts or path.suffix != ".py":
    return False
  name = parts[-1]
  if name.startswith(("test_", "__editable__")) or name.endswith("_test.py") or name == "conftest.py":
    return False
  return not any(p in SKIP_DIRS or p.endswith((".dist-info", ".egg-info")) for p in parts[:-1])


def _parse_spec(spec: str) -> list[str] | None:
  if spec == SITE_PACKAGES:
    return None
  names = [n.strip() for n in spec[len(SITE_PACKAGES) + 1 :].split(",")]
  if not spec.startswith(f"{SITE_PACKAGES}:") or not all(names):
    raise ValueError(f"--corpus {spec!r} must be {SITE_PACKAGES} or {SITE_PACKAGES}:NAME[,NAME...] (e.g. numpy,jax)")
  return list(dict.fromkeys(normalize_name(n) for n in names))


def _choose(spec: str, dists: dict[str, importlib.metadata.Distribution]):
  """``(chosen distributions with licences, skipped entries)`` for ``spec``; raises for a bad explicit name."""
  names = _parse_spec(spec)
  chosen, skipped = [], []
  for name in sorted(dists) if names is None else names:
    if name not in dists:
      raise ValueError(f"--corpus {spec!r}: no distribution {name!r} is installed (pip install {name}, or drop it)")
    dist, lic = dists[name], read_license(dists[name].metadata)
    if lic.permissive:
      chosen.append((name, dist, lic))
    elif names is not None:
      raise ValueError(
        f"--corpus {spec!r}: {name} {dist.version} has {lic.describe()}, which is not permissive "
        f"({', '.join(sorted(PERMISSIVE))}); drop it"
      )
    else:
      skipped.append({"name": name, "version": dist.version, "license": lic.expression, "license_text": lic.text[:200]})
  return chosen, skipped


def site_packages_corpus(spec: str = SITE_PACKAGES, path: Sequence[str | Path] | None = None) -> corpus_lib.Corpus:
  """The corpus that ``--corpus site-packages[:NAME,...]`` names.

  Args:
    spec: ``site-packages`` (every permissively licensed distribution) or ``site-packages:NAME,...``.
    path: Folders to find distributions in; defaults to the interpreter's site-packages.

  Raises:
    ValueError: A malformed spec, or an explicit name that is not installed or not permissively licensed.
  """
  chosen, skipped = _choose(spec, installed(path))
  found, seen = [], set()
  for name, dist, lic in chosen:
    root = Path(dist.locate_file(""))
    for rel in sorted({p.as_posix() for p in dist.files or []}):
      if rel in seen or not is_source_path(rel) or not (root / rel).is_file():
        continue  # A path that an earlier distribution owns is shadowed by it on import.
      seen.add(rel)
      data = (root / rel).read_bytes()
      if corpus_lib.keep_python_source(data):
        text = data.decode("ascii")
        doc = corpus_lib.Document(rel, corpus_lib.split_of(rel), text)
        found.append(
          (doc, PackageFile(rel, hashlib.sha256(data).hexdigest(), len(text), 1, name, dist.version, lic.expression))
        )
  found.sort(key=lambda pair: pair[0].key)
  (kept,), duplicates = corpus_lib.deduplicate([(spec, [doc for doc, _ in found])])
  kept_keys = {d.key for d in kept}
  files = [f if f.path in kept_keys else dataclasses.replace(f, documents=0) for _, f in found]
  distributions = []
  for name, dist, lic in chosen:
    mine = [f for f in files if f.distribution == name and f.documents]
    distributions.append(
      {
        "name": name,
        "version": dist.version,
        "license": lic.expression,
        "license_field": lic.field,
        "files": len(mine),
        "characters": sum(f.characters for f in mine),
      }
    )
  roots = sorted({str(Path(dist.locate_file(""))) for _, dist, _ in chosen})
  info = {"distributions": distributions, "skipped_distributions": skipped, "duplicates": duplicates}
  return corpus_lib.Corpus(SITE_PACKAGES, spec, os.pathsep.join(roots), "lm", tuple(kept), tuple(files), info)
