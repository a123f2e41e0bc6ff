"""``python -m mercury_jax.export --checkpoint RUN --out DIR``: a self-contained inference checkpoint.

The folder written holds the parameters only (no optimiser state), optionally stored in bfloat16 to halve its size,
the run's config and tokenizer, and, with ``--data``, the corpus manifest that says exactly which files the model was
trained on. No path of the exporting machine is kept: the corpus root and ``data.path`` are cut to folder names.
It is what ``Sampler.from_checkpoint``, ``sample --checkpoint`` and ``evaluate --checkpoint`` read; the model
bundled in the package (``mercury_jax/assets/default``) is one:

  python -m mercury_jax.export --checkpoint runs/default --data data/stdlib --out mercury_jax/assets/default --force

Parameters stored in bfloat16 are cast back to the model's ``param_dtype`` when restored. The folder is written
beside its destination and moved into place only when complete, so a failed export never leaves a half-written
folder or damages an existing one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from mercury_jax.config import PARAM_DTYPES
from mercury_jax.files import CARD_FILE, MANIFEST_FILE, METADATA_FILE, ORBAX_COMMIT_MARKER


def export(
  checkpoint: str | Path,
  out: str | Path,
  *,
  step: int | None = None,
  dtype: str = "bfloat16",
  data: str | Path | None = None,
  card: str | Path | None = None,
  force: bool = False,
) -> Path:
  """Exports ``checkpoint`` (a train workdir, its checkpoints or a step folder) to the folder ``out``.

  Args:
    checkpoint: where to read the parameters, config and tokenizer.
    out: the folder to write; replaced only with ``force`` (its ``MODEL_CARD.md`` is kept unless ``card`` is given).
    step: which step; default: the latest.
    dtype: storage dtype of the parameters, ``"float32"`` or ``"bfloat16"``.
    data: a prepared data folder whose ``manifest.json`` is copied in.
    card: a model card copied in as ``MODEL_CARD.md``.
    force: replace an existing non-empty ``out``.

  Returns:
    The folder written.

  Raises:
    ValueError: a bad dtype, or ``out`` exists without ``force``.
    FileNotFoundError: a missing checkpoint, tokenizer, manifest or card.
  """
  import jax
  import jax.numpy as jnp

  from mercury_jax.checkpoint import export_params, find_tokenizer, replace_folder, restore_params

  if dtype not in PARAM_DTYPES:
    raise ValueError(f"dtype={dtype!r} must be one of {', '.join(PARAM_DTYPES)}")
  out = Path(out).absolute()
  if out.exists() and not out.is_dir():
    raise ValueError(f"{str(out)!r} exists and is not a folder")
  if out.is_dir() and any(out.iterdir()) and not force:
    raise ValueError(f"{str(out)!r} exists and is not empty; pass force=True (--force) to replace it")
  manifest = Path(data) / MANIFEST_FILE if data is not None else None
  if manifest is not None and not manifest.is_file():
    raise FileNotFoundError(f"no {MANIFEST_FILE} in {str(data)!r} (expected a folder written by prepare)")
  if card is not None and not Path(card).is_file():
    raise FileNotFoundError(f"model card {str(card)!r} does not exist")
  if card is None and (out / CARD_FILE).is_file():
    card = out / CARD_FILE
  tokenizer = find_tokenizer(checkpoint)
  params, cfg = restore_params(checkpoint, step=step)
  params = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), params)
  cfg = dataclasses.replace(cfg, data=portable_data(cfg.data))

  out.parent.mkdir(parents=True, exist_ok=True)
  staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
  try:
    staging.chmod(0o755)  # mkdtemp's 0700 would make an installed package's model unreadable to other users.
    export_params(staging, params, cfg, tokenizer, step=0)
    for marker in staging.rglob(ORBAX_COMMIT_MARKER):  # It names the staging folder's absolute path; a local
      marker.unlink()  # restore does not read it (Orbax's rename is the commit there).
    if manifest is not None:
      (staging / MANIFEST_FILE).write_text(json.dumps(portable_manifest(manifest), indent=2) + "\n")
      metadata = Path(data) / METADATA_FILE  # The corpus spec and splits: `bench` reads its prompts from it.
      if metadata.is_file():
        (staging / METADATA_FILE).write_text(json.dumps(portable_metadata(metadata), indent=2) + "\n")
    if card is not None:
      shutil.copyfile(card, staging / CARD_FILE)
    replace_folder(staging, out)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  return out


def portable_data(data):
  """``cfg.data`` with the training machine's folders cut to their names (they mean nothing elsewhere): ``path`` and
  the ``DIR[@WEIGHT]`` entries of ``mix`` and ``distill`` (their weights kept)."""

  def cut(entry: str) -> str:
    folder, at, weight = entry.rpartition("@") if "@" in entry else (entry, "", "")
    return Path(folder).name + at + weight

  return dataclasses.replace(
    data,
    path=Path(data.path).name if data.path else data.path,
    mix=tuple(cut(m) for m in data.mix),
    distill=tuple(cut(d) for d in data.distill),
  )


def portable_metadata(path: str | Path) -> dict:
  """A prepared folder's ``metadata.json`` with corpus globs and paths cut to their names (a named corpus such as
  ``python-stdlib`` or ``site-packages:...`` is kept: it means the same on every machine)."""
  metadata = json.loads(Path(path).read_text())
  corpus = metadata.get("corpus")
  cut = lambda spec: Path(spec).name if os.path.isabs(spec) else spec  # noqa: E731
  if isinstance(corpus, str):
    metadata["corpus"] = cut(corpus)
  elif isinstance(corpus, list):
    metadata["corpus"] = [cut(spec) for spec in corpus]
  return metadata


def portable_manifest(path: str | Path) -> dict:
  """The data manifest at ``path`` with its corpus root cut to the folder's name (no machine's absolute paths)."""
  manifest = json.loads(Path(path).read_text())
  if "root" in manifest:
    manifest["root"] = Path(manifest["root"]).name
  return manifest


def folder_bytes(path: str | Path) -> int:
  """Total size of the files under ``path``."""
  return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m mercury_jax.export", description=__doc__.splitlines()[0])
  p.add_argument("--checkpoint", required=True, help="train workdir, its checkpoints folder, or a step folder")
  p.add_argument("--out", required=True, help="folder to write (an inference checkpoint)")
  p.add_argument("--step", type=int, default=None, help="step to export (default: latest)")
  p.add_argument("--dtype", choices=PARAM_DTYPES, default="bfloat16", help="storage dtype of the parameters")
  p.add_argument("--data", default=None, help="prepared data folder whose manifest.json is bundled")
  p.add_argument("--card", default=None, help="model card to bundle as MODEL_CARD.md")
  p.add_argument("--force", action="store_true", help="replace an existing --out folder")
  return p


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  from mercury_jax.config import ConfigError

  if not Path(args.checkpoint).exists():
    sys.stderr.write(f"mercury_jax.export: error: --checkpoint {args.checkpoint!r} does not exist\n")
    return 2
  try:
    out = export(
      args.checkpoint, args.out, step=args.step, dtype=args.dtype, data=args.data, card=args.card, force=args.force
    )
  except (ValueError, FileNotFoundError, ConfigError) as e:
    sys.stderr.write(f"mercury_jax.export: error: {str(e).splitlines()[0]}\n")
    return 2
  print(f"exported {args.checkpoint} -> {out} ({folder_bytes(out) / 2**20:.1f} MiB, parameters in {args.dtype})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
