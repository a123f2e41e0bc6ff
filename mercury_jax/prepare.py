"""Prepares a corpus for training: tokenizer, packed ArrayRecord shards, manifest and metadata.

Usage::

  python -m mercury_jax.prepare --corpus python-stdlib --out data/stdlib
  python -m mercury_jax.prepare --corpus 'texts/**/*.txt' --out data/texts --vocab-size 2048 --seq-len 512
  python -m mercury_jax.prepare --corpus sft.jsonl --out data/sft --tokenizer data/stdlib/tokenizer.model
  python -m mercury_jax.prepare --corpus python-stdlib@2 --corpus site-packages:numpy,jax --out data/code

``--corpus`` is ``python-stdlib``, ``site-packages`` (the Python sources of every installed distribution with a
permissive licence) or ``site-packages:NAME,...`` (those distributions), a path or glob ending in ``.jsonl`` (lines
``{"text": ...}`` for language modelling, or ``{"prompt": ..., "response": ...}``, which selects SFT mode), or any
other glob of UTF-8 text files. The mode follows from the data, so there is no ``--sft`` flag. SFT examples go one
to a record, padded with EOS targets (``records.pack_sft``, for diffusion canvases), or with ``--pack`` several to a
record and no scored padding (``records.pack_sft_packed``, for next-token objectives: the twin and verified models).

``--corpus kv-retrieval[:name=value,...]`` generates a synthetic key-value retrieval corpus (a needle in a haystack,
``mercury_jax.data.retrieval``) instead of reading one: its records hold their own layout of context and targets, so
it is prepared alone.

``--corpus`` may be repeated to mix corpora of one mode, each as ``SPEC@W`` with an integer weight ``W >= 1`` (default
1): each of its train documents is packed ``W`` times (validation documents once), and documents are deduplicated by
content across the corpora (``mercury_jax.data.mixture``). One ``--corpus`` of weight 1 is prepared exactly as it
always was. A path whose last component holds ``@`` needs an explicit ``@1``.

DATA_DIR receives ``tokenizer.model``, ``manifest.json`` (what went in), ``metadata.json`` (what came out, read by
``mercury_jax.data.pipeline``) and ``{train,validation}-NNNNN-of-NNNNN.array_record``. It is built in a temporary
folder beside DATA_DIR and renamed into place at the end, so a failure never leaves a half-written DATA_DIR.
Bad input prints one line on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mercury_jax import kinds
from mercury_jax.data import corpus as corpus_lib, mixture as mixture_lib, pipeline, records, retrieval, sources
from mercury_jax.data.tokenizer import MIN_VOCAB_SIZE, Tokenizer, train_tokenizer
from mercury_jax.files import MANIFEST_FILE, METADATA_FILE, TOKENIZER_FILE
from mercury_jax.progress import duration

MIN_SEQ_LEN = 8


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m mercury_jax.prepare", description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--corpus",
    required=True,
    action="append",
    metavar="SPEC[@W]",
    help="python-stdlib, site-packages[:NAME,...], FILE.jsonl or a *.jsonl glob, or a glob of text files ('**' "
    "recurses); repeat to mix corpora, each train document packed W times (default 1); or the generated "
    "kv-retrieval[:records=N,queries=Q,seed=S,...] (alone)",
  )
  parser.add_argument("--out", required=True, help="the data directory to create")
  parser.add_argument("--tokenizer", help="reuse this tokenizer.model instead of training one")
  parser.add_argument("--vocab-size", type=int, default=4096, help="pieces of a newly trained tokenizer")
  parser.add_argument("--seq-len", type=int, default=256, help="record length in tokens (= model.max_length)")
  parser.add_argument("--shards", type=int, default=4, help="ArrayRecord files per split (at most)")
  parser.add_argument("--force", action="store_true", help="replace an existing non-empty --out directory")
  parser.add_argument(
    "--pack",
    action="store_true",
    help="SFT data: pack several examples to a record, the rest padding, no EOS padding scored (for next-token "
    "objectives: the twin and verified models); default one example per record, padded with EOS targets",
  )
  return parser


def _encode_split(
  docs: list[corpus_lib.Document],
  tokenizer: Tokenizer,
  mode: str,
  seq_len: int,
  parts: list[int],
  num_parts: int,
  *,
  pack: bool = False,
) -> tuple[Any, dict[str, int], list[dict[str, int]]]:
  """Packs one split; returns the records, its metadata counts, and the counts of each of the ``num_parts`` corpora.

  Characters count only what went in; ``parts[i]`` is the corpus of ``docs[i]``. ``pack``: SFT examples several to
  a record (``records.pack_sft_packed``).
  """
  if mode == "lm":
    ids = tokenizer.encode_batch([d.text for d in docs])
    packed = records.pack_lm(ids, seq_len, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    targets = [len(x) + 1 for x in ids]  # Target tokens of each document: its text and its EOS.
    kept_index = range(len(docs))
  else:
    targets = [0] * len(docs)
    prompts = tokenizer.encode_batch([d.prompt or "" for d in docs])
    responses = tokenizer.encode_batch([d.text for d in docs])
    examples = zip(prompts, responses, strict=True)
    ids = {"bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}
    if pack:
      packed, skipped = records.pack_sft_packed(examples, seq_len, **ids, pad_id=tokenizer.pad_id)
    else:
      packed, skipped = records.pack_sft(examples, seq_len, **ids)
    skipped_set = set(skipped)
    kept_index = [i for i in range(len(docs)) if i not in skipped_set]
    for i in kept_index:  # Packed: the response and its EOS; else the record is target from after [BOS] + prompt.
      targets[i] = len(responses[i]) + 1 if pack else seq_len - 1 - len(prompts[i])
  kept = [docs[i] for i in kept_index]
  per_part = [{"documents": 0, "characters": 0, "target_tokens": 0} for _ in range(num_parts)]
  for i in kept_index:
    counts = per_part[parts[i]]
    counts["documents"] += 1
    counts["characters"] += len(docs[i].text)
    counts["target_tokens"] += targets[i]
  stats = {
    "documents": len(kept),
    "skipped_documents": len(docs) - len(kept),
    **records.record_stats(packed, eos_id=tokenizer.eos_id if mode == "sft" and not pack else None),
    "characters": sum(len(d.text) for d in kept),
    "prompt_characters": sum(len(d.prompt or "") for d in kept),
  }
  return packed, stats, per_part


Encoded = tuple[Any, dict[str, int], list[dict[str, int]]]  # records, split metadata, per-corpus counts


@dataclasses.dataclass(frozen=True)
class Source:
  """What ``prepare`` needs of its input, whether read (corpora, mixtures) or generated (``kv-retrieval``).

  Attributes:
    mode: ``"lm"`` or ``"sft"`` (``metadata.json``'s mode).
    corpus: ``metadata.json``'s ``corpus``: the spec, or every spec of a mixture.
    parts: A mixture's corpora (spec, kind, weight), or ``()``: their counts go to ``metadata.json``'s ``corpora``.
    texts: The texts to train a tokenizer on.
    encode: ``(split, tokenizer, seq_len) -> (records, split metadata, per-part counts)``.
    manifest: What went in (``manifest.json``).
  """

  mode: str
  corpus: str | list[str]
  parts: tuple[dict[str, Any], ...]
  texts: Callable[[], list[str]]
  encode: Callable[[str, Tokenizer, int], Encoded]
  manifest: dict[str, Any]


def _read_source(specs: list[str], pack: bool = False) -> Source:
  """The corpora of ``specs`` (one, or a mixture), packed by ``pack_lm`` or ``pack_sft``."""
  source = sources.load_mixture(specs)
  single = source.parts[0].corpus if source.single else None
  parts = () if single else tuple({"spec": p.spec, "kind": p.corpus.kind, "weight": p.weight} for p in source.parts)
  if not source.packed(corpus_lib.TRAIN):
    raise ValueError(f"--corpus {' --corpus '.join(map(repr, specs))} has no documents in the train split")

  def texts() -> list[str]:  # Each distinct train document once, whatever the weights.
    return [t for d in source.split(corpus_lib.TRAIN) for t in (d.prompt, d.text) if t]

  def encode(name: str, tokenizer: Tokenizer, seq_len: int) -> Encoded:
    pairs = source.packed(name)
    docs, indices = [d for d, _ in pairs], [i for _, i in pairs]
    packed, stats, per_part = _encode_split(
      docs, tokenizer, source.mode, seq_len, indices, len(source.parts), pack=pack
    )
    return packed, stats, per_part if parts else []

  return Source(source.mode, single.source if single else specs, parts, texts, encode, source.manifest())


def _retrieval_source(spec: str) -> Source:
  """The generated ``kv-retrieval`` corpus (``mercury_jax.data.retrieval``)."""
  generated = retrieval.parse_spec(spec)

  def encode(name: str, tokenizer: Tokenizer, seq_len: int) -> Encoded:
    packed = retrieval.records(generated, name, seq_len, retrieval.Symbols.of(tokenizer))
    return packed, {**retrieval.split_stats(packed, tokenizer), **records.record_stats(packed)}, []

  texts = functools.partial(retrieval.tokenizer_texts, generated)
  return Source("sft", generated.spec, (), texts, encode, retrieval.manifest(generated))


def load_source(specs: list[str], pack: bool = False) -> Source:
  """The ``Source`` of ``--corpus`` values.

  Raises:
    ValueError: A bad spec, or ``kv-retrieval`` beside other corpora or weighted.
  """
  bases = [mixture_lib.parse_weight(s)[0] for s in specs]
  if any(retrieval.is_spec(b) for b in bases):
    if len(specs) != 1 or not retrieval.is_spec(specs[0]):
      raise ValueError(
        f"--corpus {retrieval.SPEC} is generated with its own record layout; prepare it alone (no other --corpus, "
        "no @W), and give records=N for more of it"
      )
    return _retrieval_source(specs[0])
  return _read_source(specs, pack)


def _sha256(path: Path) -> str:
  return hashlib.sha256(path.read_bytes()).hexdigest()


def _check_destination(out: Path, force: bool) -> None:
  if out.exists() and not out.is_dir():
    raise ValueError(f"--out {str(out)!r} exists and is not a directory")
  if out.is_dir() and any(out.iterdir()) and not force:
    raise ValueError(f"--out {str(out)!r} exists and is not empty; pass --force to replace it")


def _move_into_place(tmp: Path, out: Path) -> None:
  """Renames the finished ``tmp`` to ``out``, replacing an existing ``out`` only once ``tmp`` is complete."""
  if not out.exists():
    os.rename(tmp, out)
    return
  old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
  os.rename(out, old / out.name)
  os.rename(tmp, out)
  shutil.rmtree(old)


def prepare(
  corpus: str | Sequence[str],
  out: str | os.PathLike,
  *,
  tokenizer_path: str | None = None,
  vocab_size: int = 4096,
  seq_len: int = 256,
  num_shards: int = 4,
  force: bool = False,
  pack: bool = False,
  log: Callable[[str], None] = print,
  progress: bool = False,
) -> dict[str, Any]:
  """Writes a prepared data directory and returns its metadata.

  Args:
    corpus: ``python-stdlib``, ``site-packages[:NAME,...]``, a ``.jsonl`` path or glob, or a glob of text files; or
      a list of such specs, each optionally weighted with ``@W``, to mix (see the module docstring).
    out: The directory to create (its parent is created if needed).
    tokenizer_path: Reuse this ``tokenizer.model`` instead of training one on the train split.
    vocab_size: Target vocabulary of a newly trained tokenizer.
    seq_len: Tokens per record.
    num_shards: ArrayRecord files per split, at most.
    force: Replace a non-empty ``out``.
    pack: SFT data: several examples to a record (``records.pack_sft_packed``).
    log: Receives the summary lines.
    progress: Print each stage as it starts, with the time so far, on stderr (reading the corpus and training the
      tokenizer give no count to estimate the time left from).

  Raises:
    ValueError: Bad arguments or input (the message is one line naming the value).
  """
  start = time.perf_counter()
  if seq_len < MIN_SEQ_LEN:
    raise ValueError(f"--seq-len {seq_len} is too short; use at least {MIN_SEQ_LEN} (e.g. 256)")
  if num_shards < 1:
    raise ValueError(f"--shards {num_shards} must be >= 1")
  if tokenizer_path is None and vocab_size < MIN_VOCAB_SIZE:
    raise ValueError(
      f"--vocab-size {vocab_size} is too small: byte fallback and the specials take 261 pieces; "
      f"use at least {MIN_VOCAB_SIZE} (e.g. 4096)"
    )
  out = Path(out)
  _check_destination(out, force)
  stage = _stages(start, progress)
  tokenizer = Tokenizer.load(tokenizer_path) if tokenizer_path else None
  specs = [corpus] if isinstance(corpus, str) else list(corpus)
  stage(f"reading {' + '.join(specs)}")
  source = load_source(specs, pack)
  if tokenizer is None:
    texts = source.texts()
    stage(
      f"training a {vocab_size}-piece tokenizer on {len(texts):,} texts, {sum(map(len, texts)) / 1e6:.1f} M characters"
    )
    tokenizer = train_tokenizer(texts, vocab_size)
    del texts

  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
  tmp.mkdir()  # Unlike tempfile.mkdtemp, this keeps the umask's permissions for the final directory.
  try:
    split_meta, part_meta = {}, [dict(p) for p in source.parts]
    for name in corpus_lib.SPLITS:
      stage(f"encoding and packing the {name} split")
      packed, stats, per_part = source.encode(name, tokenizer, seq_len)
      if name == corpus_lib.TRAIN and not stats["records"]:
        raise ValueError(
          f"no train example fits in --seq-len {seq_len} ({stats['skipped_documents']} skipped); use a larger --seq-len"
        )
      split_meta[name] = {**stats, "shards": records.write_shards(packed, tmp, name, num_shards)}
      for meta, counts in zip(part_meta, per_part, strict=True):
        meta.setdefault("splits", {})[name] = counts
    tokenizer.save(tmp / TOKENIZER_FILE)
    manifest = source.manifest
    (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    metadata = {
      "format_version": pipeline.FORMAT_VERSION,
      "mode": source.mode,
      "seq_len": seq_len,
      "vocab_size": tokenizer.vocab_size,
      "pad_id": tokenizer.pad_id,
      "unk_id": tokenizer.unk_id,
      "bos_id": tokenizer.bos_id,
      "eos_id": tokenizer.eos_id,
      "mask_id": tokenizer.mask_id,
      "record": {"dtype": "int32", "shape": [2, seq_len], "rows": ["tokens", "kinds"]},
      "kinds": {"padding": kinds.PAD, "prompt": kinds.FIXED, "target": kinds.TARGET},
      "corpus": source.corpus,
      **({"sft_packing": "several per record" if pack else "one per record"} if source.mode == "sft" else {}),
      **({"corpora": part_meta} if part_meta else {}),
      "python_version": manifest.get("python_version"),
      "tokenizer": {
        "file": TOKENIZER_FILE,
        "sha256": _sha256(tmp / TOKENIZER_FILE),
        "trained": tokenizer_path is None,
        "vocab_size_requested": None if tokenizer_path else vocab_size,
      },
      "splits": split_meta,
    }
    (tmp / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
    _check_destination(out, force)
    _move_into_place(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  _summarise(out, metadata, time.perf_counter() - start, log)
  return metadata


def _stages(start: float, enabled: bool) -> Callable[[str], None]:
  """Prints a stage of ``prepare`` with the time since ``start`` on stderr (when ``enabled``)."""

  def stage(text: str) -> None:
    if enabled:
      print(
        f"mercury_jax.prepare: {text} ({duration(time.perf_counter() - start)} so far)", file=sys.stderr, flush=True
      )

  return stage


def _summarise(out: Path, metadata: dict[str, Any], seconds: float, log: Callable[[str], None]) -> None:
  python = f" (Python {metadata['python_version']})" if metadata["python_version"] else ""
  corpus = metadata["corpus"] if isinstance(metadata["corpus"], str) else " + ".join(metadata["corpus"])
  log(
    f"prepared {out} in {seconds:.1f} s: corpus {corpus}{python}, mode {metadata['mode']}, "
    f"vocab {metadata['vocab_size']}, seq_len {metadata['seq_len']}"
  )
  for name, s in metadata["splits"].items():
    eos_padding = s.get("eos_padding_tokens", 0)
    text_tokens = s["target_tokens"] - eos_padding
    ratio = s["characters"] / text_tokens if text_tokens else 0.0
    skipped = f", {s['skipped_documents']} skipped (too long)" if s["skipped_documents"] else ""
    padding = f", {eos_padding:,} of them EOS padding" if eos_padding else ""
    log(
      f"  {name}: {s['documents']:,} docs{skipped}, {s['characters']:,} chars, {s['target_tokens']:,} target tokens"
      f"{padding} ({ratio:.2f} chars/token of text), {s['records']:,} records in {len(s['shards'])} shards"
    )
    for part in metadata.get("corpora", []):
      c = part["splits"][name]
      weight = part["weight"] if name == corpus_lib.TRAIN else 1
      repeats = f" ({c['documents'] // weight:,} x{weight})" if weight > 1 else ""
      log(
        f"    {part['spec']}: {c['documents']:,} docs{repeats}, {c['characters']:,} chars, "
        f"{c['target_tokens']:,} target tokens"
      )


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    prepare(
      args.corpus,
      args.out,
      tokenizer_path=args.tokenizer,
      vocab_size=args.vocab_size,
      seq_len=args.seq_len,
      num_shards=args.shards,
      force=args.force,
      pack=args.pack,
      progress=True,
    )
  except (ValueError, OSError) as e:
    message = " ".join(str(e).split())
    print(f"error: {message}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
