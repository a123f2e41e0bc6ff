"""Prepares a corpus for training: tokenizer, packed ArrayRecord shards, manifest and metadata.

Usage::

  python -m mercury_jax.prepare --corpus python-stdlib --out data/stdlib
  python -m mercury_jax.prepare --corpus 'texts/**/*.txt' --out data/texts --vocab-size 2048 --seq-len 512
  python -m mercury_jax.prepare --corpus sft.jsonl --out data/sft --tokenizer data/stdlib/tokenizer.model

``--corpus`` is ``python-stdlib``, a path or glob ending in ``.jsonl`` (lines ``{"text": ...}`` for language
modelling, or ``{"prompt": ..., "response": ...}``, which selects SFT mode), or any other glob of UTF-8 text files.
The mode follows from the data, so there is no ``--sft`` flag.

DATA_DIR receives ``tokenizer.model``, ``manifest.json`` (what went in), ``metadata.json`` (what came out, read by
``mercury_jax.data.pipeline``) and ``{train,validation}-NNNNN-of-NNNNN.array_record``. It is built in a temporary
folder beside DATA_DIR and renamed into place at the end, so a failure never leaves a half-written DATA_DIR.
Bad input prints one line on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mercury_jax import kinds
from mercury_jax.data import corpus as corpus_lib, pipeline, records
from mercury_jax.data.tokenizer import MIN_VOCAB_SIZE, Tokenizer, train_tokenizer

MIN_SEQ_LEN = 8


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m mercury_jax.prepare", description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--corpus",
    required=True,
    help="python-stdlib, FILE.jsonl or a *.jsonl glob, or a glob of text files ('**' recurses)",
  )
  parser.add_argument("--out", required=True, help="the data directory to create")
  parser.add_argument("--tokenizer", help="reuse this tokenizer.model instead of training one")
  parser.add_argument("--vocab-size", type=int, default=4096, help="pieces of a newly trained tokenizer")
  parser.add_argument("--seq-len", type=int, default=256, help="record length in tokens (= model.max_length)")
  parser.add_argument("--shards", type=int, default=4, help="ArrayRecord files per split (at most)")
  parser.add_argument("--force", action="store_true", help="replace an existing non-empty --out directory")
  return parser


def _encode_split(
  docs: list[corpus_lib.Document], tokenizer: Tokenizer, mode: str, seq_len: int
) -> tuple[Any, dict[str, int]]:
  """Packs one split; returns the records and its metadata counts (characters only of what went in)."""
  if mode == "lm":
    packed = records.pack_lm(
      tokenizer.encode_batch([d.text for d in docs]), seq_len, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id
    )
    kept = docs
  else:
    examples = zip(
      tokenizer.encode_batch([d.prompt or "" for d in docs]),
      tokenizer.encode_batch([d.text for d in docs]),
      strict=True,
    )
    packed, skipped = records.pack_sft(examples, seq_len, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
    skipped_set = set(skipped)
    kept = [d for i, d in enumerate(docs) if i not in skipped_set]
  stats = {
    "documents": len(kept),
    "skipped_documents": len(docs) - len(kept),
    **records.record_stats(packed, eos_id=tokenizer.eos_id if mode == "sft" else None),
    "characters": sum(len(d.text) for d in kept),
    "prompt_characters": sum(len(d.prompt or "") for d in kept),
  }
  return packed, stats


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
  corpus: str,
  out: str | os.PathLike,
  *,
  tokenizer_path: str | None = None,
  vocab_size: int = 4096,
  seq_len: int = 256,
  num_shards: int = 4,
  force: bool = False,
  log: Callable[[str], None] = print,
) -> dict[str, Any]:
  """Writes a prepared data directory and returns its metadata.

  Args:
    corpus: ``python-stdlib``, a ``.jsonl`` path or glob, or a glob of text files.
    out: The directory to create (its parent is created if needed).
    tokenizer_path: Reuse this ``tokenizer.model`` instead of training one on the train split.
    vocab_size: Target vocabulary of a newly trained tokenizer.
    seq_len: Tokens per record.
    num_shards: ArrayRecord files per split, at most.
    force: Replace a non-empty ``out``.
    log: Receives the summary lines.

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
  tokenizer = Tokenizer.load(tokenizer_path) if tokenizer_path else None
  source = corpus_lib.load_corpus(corpus)
  splits = {name: source.split(name) for name in corpus_lib.SPLITS}
  if not splits[corpus_lib.TRAIN]:
    raise ValueError(f"--corpus {corpus!r} has no documents in the train split")
  if tokenizer is None:
    texts = [t for d in splits[corpus_lib.TRAIN] for t in (d.prompt, d.text) if t]
    tokenizer = train_tokenizer(texts, vocab_size)

  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
  tmp.mkdir()  # Unlike tempfile.mkdtemp, this keeps the umask's permissions for the final directory.
  try:
    split_meta = {}
    for name, docs in splits.items():
      packed, stats = _encode_split(docs, tokenizer, source.mode, seq_len)
      if name == corpus_lib.TRAIN and not stats["records"]:
        raise ValueError(
          f"no train example fits in --seq-len {seq_len} ({stats['skipped_documents']} skipped); use a larger --seq-len"
        )
      split_meta[name] = {**stats, "shards": records.write_shards(packed, tmp, name, num_shards)}
    tokenizer.save(tmp / pipeline.TOKENIZER_FILE)
    manifest = source.manifest()
    (tmp / pipeline.MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
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
      "corpus": source.source,
      "python_version": manifest.get("python_version"),
      "tokenizer": {
        "file": pipeline.TOKENIZER_FILE,
        "sha256": _sha256(tmp / pipeline.TOKENIZER_FILE),
        "trained": tokenizer_path is None,
        "vocab_size_requested": None if tokenizer_path else vocab_size,
      },
      "splits": split_meta,
    }
    (tmp / pipeline.METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
    _check_destination(out, force)
    _move_into_place(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  _summarise(out, metadata, time.perf_counter() - start, log)
  return metadata


def _summarise(out: Path, metadata: dict[str, Any], seconds: float, log: Callable[[str], None]) -> None:
  python = f" (Python {metadata['python_version']})" if metadata["python_version"] else ""
  log(
    f"prepared {out} in {seconds:.1f} s: corpus {metadata['corpus']}{python}, mode {metadata['mode']}, "
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
    )
  except (ValueError, OSError) as e:
    message = " ".join(str(e).split())
    print(f"error: {message}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
