"""Several corpora read together: ``--corpus A --corpus B@2``.

Each ``SPEC[@WEIGHT]`` names a corpus and how many times each of its train documents is repeated in the train split
(an integer >= 1; validation documents are never repeated). The documents of all the corpora are deduplicated by
content (``corpus.deduplicate``): the first copy, in the order the corpora are given and then in each corpus's key
order, is kept, and the manifest lists every copy dropped. One corpus of weight 1 is read, packed and described
exactly as on its own (no deduplication, its own manifest). ``sources.load_mixture`` reads the corpora
(:func:`parse_specs`, then :func:`mix`); this module reads none.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mercury_jax.data.corpus import SPLITS, TRAIN, Corpus, Document, deduplicate


def parse_weight(spec: str) -> tuple[str, int]:
  """Splits ``SPEC@WEIGHT`` into ``(SPEC, WEIGHT)``; without ``@`` (or with a ``/`` after it) the weight is 1.

  Raises:
    ValueError: The weight is not an integer >= 1.
  """
  base, at, weight = spec.rpartition("@")
  if not at or "/" in weight:
    return spec, 1
  if not re.fullmatch(r"[0-9]+", weight) or int(weight) < 1:
    raise ValueError(f"--corpus {spec!r}: weight {weight!r} must be an integer >= 1 (e.g. {base}@2)")
  return base, int(weight)


@dataclasses.dataclass(frozen=True)
class Part:
  """One corpus of a mixture: the spec as given, its weight, and the corpus with its duplicates removed."""

  spec: str
  weight: int
  corpus: Corpus


@dataclasses.dataclass(frozen=True)
class Mixture:
  """Corpora read together (``--corpus A --corpus B@2``); see the module docstring.

  Attributes:
    parts: The corpora in the order given.
    duplicates: The documents dropped as copies of earlier ones (``deduplicate``); empty for a single corpus.
  """

  parts: tuple[Part, ...]
  duplicates: tuple[dict[str, str], ...]

  @property
  def mode(self) -> str:
    return self.parts[0].corpus.mode

  @property
  def single(self) -> bool:
    """One corpus of weight 1: prepared, and described, exactly as that corpus alone."""
    return len(self.parts) == 1 and self.parts[0].weight == 1

  def split(self, name: str) -> list[Document]:
    """The distinct documents of split ``name``, corpus by corpus."""
    return [d for part in self.parts for d in part.corpus.split(name)]

  def packed(self, name: str) -> list[tuple[Document, int]]:
    """``(document, part index)`` in packing order: validation once, train in ``max(weight)`` passes.

    Pass ``r`` holds the train documents of every corpus whose weight exceeds ``r``, so repeats are spread out.
    """
    rounds = max(p.weight for p in self.parts) if name == TRAIN else 1
    order = []
    for r in range(rounds):
      for index, part in enumerate(self.parts):
        if name != TRAIN or part.weight > r:
          order += [(d, index) for d in part.corpus.split(name)]
    return order

  def manifest(self) -> dict[str, Any]:
    """The corpus's own manifest when ``single``, else every corpus's (roots cut to their names) with weights."""
    if self.single:
      return self.parts[0].corpus.manifest()
    corpora = []
    for part in self.parts:
      entry = part.corpus.manifest()
      entry["root"] = os.pathsep.join(Path(r).name for r in entry["root"].split(os.pathsep))  # No machine's paths.
      corpora.append({"spec": part.spec, "weight": part.weight, **entry})
    manifest: dict[str, Any] = {"kind": "mixture", "mode": self.mode}
    with_python = [e for e in corpora if "python_version" in e]
    if with_python:
      manifest["python_version"] = with_python[0]["python_version"]
      manifest["python_implementation"] = with_python[0]["python_implementation"]
    splits = {}
    for name in SPLITS:
      docs = [d for d, _ in self.packed(name)]
      splits[name] = {"documents": len(docs), "characters": sum(len(d.text) for d in docs)}
    manifest["splits"] = splits
    manifest["deduplication"] = "sha256 of each text across all corpora; the first copy, in --corpus order, is kept"
    manifest["duplicates"] = list(self.duplicates)
    manifest["corpora"] = corpora
    return manifest


def parse_specs(specs: Sequence[str]) -> list[tuple[str, str, int]]:
  """``(spec, base, weight)`` of each ``SPEC[@WEIGHT]``, checked before any corpus is read.

  Raises:
    ValueError: No spec, a bad weight, or a corpus given twice.
  """
  if not specs:
    raise ValueError("give at least one --corpus")
  weighted, seen = [parse_weight(spec) for spec in specs], {}
  for spec, (base, _) in zip(specs, weighted, strict=True):
    if base in seen:
      raise ValueError(f"--corpus {base!r} is given twice ({seen[base]!r}, {spec!r}); give it once, weighted with @W")
    seen[base] = spec
  return [(spec, base, weight) for spec, (base, weight) in zip(specs, weighted, strict=True)]


def mix(parts: Sequence[Part]) -> Mixture:
  """The mixture of loaded corpora, in the order given, with duplicates across them removed (none for one corpus).

  Raises:
    ValueError: Corpora of different modes.
  """
  for part in parts[1:]:
    if part.corpus.mode != parts[0].corpus.mode:
      first = parts[0]
      raise ValueError(
        f"--corpus {part.spec!r} is {part.corpus.mode!r} but --corpus {first.spec!r} is {first.corpus.mode!r}; "
        "mix corpora of one mode"
      )
  if len(parts) == 1:
    return Mixture(tuple(parts), ())
  kept, duplicates = deduplicate([(p.spec, p.corpus.documents) for p in parts])
  parts = [
    dataclasses.replace(p, corpus=dataclasses.replace(p.corpus, documents=tuple(d)))
    for p, d in zip(parts, kept, strict=True)
  ]
  return Mixture(tuple(parts), tuple(duplicates))
