"""Which source a ``--corpus`` spec names: the one dispatcher, above every source module.

``load_corpus`` reads ``python-stdlib`` and globs of text or JSONL files (``corpus``), ``site-packages[:NAME,...]``
(``site_packages``), and a list of ``SPEC[@WEIGHT]`` specs as their mixture (``mixture``). The source modules build on
``corpus`` and import neither this module nor each other, so the package has no import cycle.
"""

from __future__ import annotations

from collections.abc import Sequence

from mercury_jax.data import corpus, mixture, site_packages


def load_corpus(spec: str | Sequence[str]) -> corpus.Corpus | mixture.Mixture:
  """Loads ``python-stdlib``, ``site-packages[:NAME,...]``, a ``*.jsonl`` path or glob, or another glob of text files.

  A list of specs (as a mixture's ``metadata.json`` names its corpora) loads their ``Mixture`` (:func:`load_mixture`).

  Raises:
    ValueError: No file matches, a file is unreadable or not UTF-8, a JSONL line is malformed, or a distribution is
      not installed or not permissively licensed.
  """
  if not isinstance(spec, str):
    return load_mixture(spec)
  if spec == corpus.STDLIB:
    return corpus.stdlib_corpus()
  if spec.split(":", 1)[0] == corpus.SITE_PACKAGES:
    return site_packages.site_packages_corpus(spec)
  if corpus.is_jsonl_spec(spec):
    return corpus.jsonl_corpus(spec)
  return corpus.text_corpus(spec)


def load_mixture(specs: Sequence[str]) -> mixture.Mixture:
  """Loads ``SPEC[@WEIGHT]`` corpora and removes duplicates across them (none for a single corpus).

  Every spec is checked before any corpus is read.

  Raises:
    ValueError: A bad weight, a corpus given twice, corpora of different modes, or what :func:`load_corpus` raises.
  """
  parsed = mixture.parse_specs(specs)
  return mixture.mix([mixture.Part(spec, weight, load_corpus(base)) for spec, base, weight in parsed])
