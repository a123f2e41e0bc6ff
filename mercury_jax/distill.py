"""Self-distillation sets: prompts of the training split continued by a model's own next-token head.

``python -m mercury_jax.distill --checkpoint CKPT --data DATA_DIR[@W] [--data ...] --out DIR --temperature T``

A verified model's drafter should predict what its verifier will accept: the network's own outputs, not the data's
(DistillSpec, Zhou et al. 2023, arXiv 2310.08461; Medusa-2's self-distillation, Cai et al. 2024, arXiv 2401.10774).
This command writes them. Each prompt is a record of a prepared directory's train split (``--data``; several
directories share ``--prompts`` by weight), chosen with ``--seed`` without replacement:

* a language-modelling record gives its first ``P`` tokens, ``P`` drawn uniformly from ``--prompt-tokens MIN,MAX``;
* an SFT record (``prepare``'s ``sft`` mode, e.g. the mined chat examples) gives its first example's ``[BOS] +
  prompt``: the continuation is the model's own answer.

The checkpoint continues every prompt to the end of the record (``seq_len`` tokens in all) or to its first EOS,
through the batched decoding engine (:class:`~mercury_jax.sampling.sampler.Sampler`, ``--batch`` prompts at a time)
with its next-token head: ``--decode ar`` (the default; for a verified checkpoint the distribution verified decoding
reproduces, and the faster of the two in a batch on a CPU, docs/results/chat.md) at ``--temperature`` (0: greedy).
Prompt ``i`` draws from random stream ``i`` of ``--seed``, so a set is the same at any batch size.

DIR is a prepared data directory (``mercury_jax.data.pipeline`` reads it, ``data.distill`` trains on it): records
``[prompt (FIXED), continuation with its EOS (DISTILLED), PAD ...]`` (:mod:`mercury_jax.kinds`); ``manifest.json``
holds the command, the checkpoint's sha256, the seed, the temperature, the prompts (source, record index, length)
and the throughput; ``metadata.json`` the counts. ``--validation-prompts`` prompts of the validation split make its
validation split (held-out continuations to score a drafter on).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grain
import numpy as np

from mercury_jax import files, kinds as K
from mercury_jax.data import pipeline, records

SPLITS = ("train", "validation")


def checkpoint_sha256(path: str | os.PathLike) -> str:
  """sha256 over a checkpoint folder's files (relative path and bytes, in path order)."""
  digest = hashlib.sha256()
  root = Path(path)
  for file in sorted(p for p in root.rglob("*") if p.is_file()):
    digest.update(file.relative_to(root).as_posix().encode())
    digest.update(hashlib.sha256(file.read_bytes()).digest())
  return digest.hexdigest()


def choose_prompts(
  sources: Sequence[tuple[str, float]], split: str, count: int, prompt_tokens: tuple[int, int], seed: int
) -> list[dict[str, Any]]:
  """``count`` prompts from ``split`` of the prepared directories ``sources`` (``(dir, weight)``), in proportion to
  the weights (module docstring): ``{"source", "record", "ids"}`` each, in the order they will be generated.

  Raises:
    ValueError: A source has fewer usable records than its share, or a record gives no prompt.
  """
  rng = np.random.default_rng(seed)
  weights = np.asarray([w for _, w in sources], np.float64)
  shares = np.floor(count * weights / weights.sum()).astype(int)
  shares[0] += count - shares.sum()
  low, high = prompt_tokens
  prompts = []
  for (data_dir, _), share in zip(sources, shares, strict=True):
    metadata = pipeline.read_metadata(data_dir)
    stored = grain.sources.ArrayRecordDataSource(pipeline.split_paths(data_dir, split, metadata))
    if share > len(stored):
      raise ValueError(f"{data_dir!r} has {len(stored)} {split} records, fewer than its {share} prompts")
    for index in sorted(rng.choice(len(stored), size=share, replace=False).tolist()):
      record = records.decode_record(stored[index], metadata["seq_len"])
      tokens, kinds = record["tokens"], record["kinds"]
      if metadata["mode"] == "sft":  # [BOS] + prompt: the FIXED run that opens the record.
        length = int(np.argmax(kinds != K.FIXED)) if (kinds != K.FIXED).any() else len(kinds)
      else:
        length = min(int(rng.integers(low, high + 1)), int((kinds != K.PAD).sum()))
      if length < 1 or length >= len(tokens):
        raise ValueError(f"record {index} of {data_dir!r} ({split}) gives no prompt of 1 .. {len(tokens) - 1} tokens")
      prompts.append({"source": str(data_dir), "record": index, "ids": [int(t) for t in tokens[:length]]})
  order = rng.permutation(len(prompts))  # Sources interleaved, so every batch mixes them.
  return [prompts[i] for i in order]


def continue_prompts(
  sampler,
  prompts: Sequence[Sequence[int]],
  *,
  seq_len: int,
  temperature: float,
  seed: int,
  batch: int,
  decode: str = "ar",
  first_stream: int = 0,
  log: Callable[[str], None] = lambda _: None,
) -> tuple[list[list[int]], dict[str, float]]:
  """Each prompt's continuation to ``seq_len`` tokens or its first EOS (included), and the throughput.

  Prompt ``i`` draws from stream ``first_stream + i``, whatever the batch it runs in.
  """
  from mercury_jax.sampling import canvas as cv

  settings = sampler.settings(temperature=temperature, top_p=1.0, top_k=0, decode=decode, eos_to_pad=True)
  pad_id, eos_id = settings.pad_id, settings.eos_id
  out, generated, wall, compile_s = [], 0, 0.0, 0.0
  for start in range(0, len(prompts), batch):
    chunk = prompts[start : start + batch]
    examples = [cv.prefix(p, seq_len - len(p)) for p in chunk]
    streams = list(range(first_stream + start, first_stream + start + len(chunk)))
    canvas = cv.pad_batch(cv.make_canvas(examples, length=seq_len, streams=streams, pad_id=pad_id), batch, pad_id)
    result, seconds, compiled = sampler.run(canvas, None, seed, settings)
    wall, compile_s = wall + seconds, compile_s + compiled
    for row, prompt in enumerate(chunk):
      ids = [int(t) for t in result.tokens[row, len(prompt) : seq_len] if t != pad_id]
      out.append(ids[: ids.index(eos_id) + 1] if eos_id in ids else ids)
      generated += len(out[-1])
    log(
      f"  {start + len(chunk):,}/{len(prompts):,} prompts, {generated:,} tokens, "
      f"{generated / max(wall, 1e-9):,.0f} tokens/s"
    )
  return out, {"generated_tokens": generated, "wall_s": wall, "compile_s": compile_s, "tokens_per_s": generated / wall}


def distill_records(
  prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], seq_len: int, pad_id: int
):
  """``int32[n, 2, seq_len]``: each prompt (``FIXED``) and its continuation (``DISTILLED``), padded (``PAD``)."""
  out = np.zeros([len(prompts), 2, seq_len], np.int32)
  out[:, 0] = pad_id
  for row, (prompt, continuation) in enumerate(zip(prompts, continuations, strict=True)):
    ids = [*prompt, *continuation]
    if len(ids) > seq_len:
      raise ValueError(f"prompt {row}: {len(prompt)} + {len(continuation)} tokens exceed seq_len={seq_len}")
    out[row, 0, : len(ids)] = ids
    out[row, 1, : len(prompt)] = K.FIXED
    out[row, 1, len(prompt) : len(ids)] = K.DISTILLED
  return out


def build(
  checkpoint: str,
  sources: Sequence[tuple[str, float]],
  out: str | os.PathLike,
  *,
  prompts: int,
  validation_prompts: int,
  temperature: float,
  seed: int,
  batch: int = 64,
  prompt_tokens: tuple[int, int] = (16, 128),
  decode: str = "ar",
  num_shards: int = 4,
  command: str = "",
  log: Callable[[str], None] = print,
) -> dict[str, Any]:
  """Writes a self-distillation set to ``out`` (module docstring) and returns its metadata."""
  from mercury_jax.sampling.sampler import Sampler

  out = Path(out)
  if out.exists() and any(out.iterdir()):
    raise ValueError(f"--out {str(out)!r} exists and is not empty")
  first = pipeline.read_metadata(sources[0][0])
  seq_len = first["seq_len"]
  for data_dir, _ in sources[1:]:
    if pipeline.read_metadata(data_dir)["seq_len"] != seq_len:
      raise ValueError(f"{data_dir!r} has another seq_len than {sources[0][0]!r} ({seq_len})")
  sampler = Sampler.from_checkpoint(checkpoint)
  tokenizer_path = Path(sources[0][0]) / files.TOKENIZER_FILE
  if hashlib.sha256(tokenizer_path.read_bytes()).hexdigest() != first["tokenizer"]["sha256"]:
    raise ValueError(f"{str(tokenizer_path)!r} is not the tokenizer its metadata names")
  tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
  tmp.mkdir(parents=True)
  try:
    split_meta, chosen, speed = {}, {}, {}
    for split, count in zip(SPLITS, (prompts, validation_prompts), strict=True):
      picked = choose_prompts(sources, split, count, prompt_tokens, seed + SPLITS.index(split))
      log(f"{split}: {len(picked):,} prompts, temperature {temperature:g}, seed {seed}")
      first_stream = 0 if split == "train" else prompts  # Distinct random streams across the splits.
      continuations, speed[split] = continue_prompts(
        sampler,
        [p["ids"] for p in picked],
        seq_len=seq_len,
        temperature=temperature,
        seed=seed,
        batch=batch,
        decode=decode,
        first_stream=first_stream,
        log=log,
      )
      packed = distill_records([p["ids"] for p in picked], continuations, seq_len, sampler.tokenizer.pad_id)
      stats = records.record_stats(packed)
      stats["distilled_tokens"] = int(np.count_nonzero(packed[:, 1] == K.DISTILLED))
      stats["ended_with_eos"] = sum(1 for c in continuations if c and c[-1] == sampler.tokenizer.eos_id)
      split_meta[split] = {**stats, "shards": records.write_shards(packed, tmp, split, num_shards)}
      chosen[split] = [
        {"source": p["source"], "record": p["record"], "prompt_tokens": len(p["ids"]), "stream": first_stream + i}
        for i, p in enumerate(picked)
      ]
    shutil.copyfile(tokenizer_path, tmp / files.TOKENIZER_FILE)
    manifest = {
      "kind": "self-distillation",
      "command": command,
      "checkpoint": str(checkpoint),
      "checkpoint_sha256": checkpoint_sha256(checkpoint),
      "decode": decode,
      "temperature": temperature,
      "seed": seed,
      "batch": batch,
      "prompt_tokens": list(prompt_tokens),
      "sources": [
        {
          "dir": str(d),
          "weight": w,
          "corpus": pipeline.read_metadata(d)["corpus"],
          "mode": pipeline.read_metadata(d)["mode"],
        }
        for d, w in sources
      ],
      "prompt_rule": "records chosen without replacement (numpy default_rng(seed + split index)); an LM record's first "
      "P ~ U[prompt_tokens] tokens, an SFT record's [BOS] + prompt; the row's random stream is its index",
      "throughput": {split: {**s, "batch": batch} for split, s in speed.items()},
      "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
      "prompts": chosen,
    }
    (tmp / files.MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
    metadata = {
      "format_version": pipeline.FORMAT_VERSION,
      "mode": "distill",
      "seq_len": seq_len,
      **{k: first[k] for k in ("vocab_size", "pad_id", "unk_id", "bos_id", "eos_id", "mask_id")},
      "record": {"dtype": "int32", "shape": [2, seq_len], "rows": ["tokens", "kinds"]},
      "kinds": {"padding": K.PAD, "prompt": K.FIXED, "target": K.TARGET, "distilled": K.DISTILLED},
      "corpus": [f"distill:{d}" for d, _ in sources],
      "python_version": None,
      "tokenizer": first["tokenizer"],
      "splits": split_meta,
    }
    (tmp / files.METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
    if out.exists():
      out.rmdir()  # Empty (checked above).
    os.rename(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  train = split_meta["train"]
  log(
    f"wrote {out}: {train['records']:,} records, {train['distilled_tokens']:,} distilled tokens at "
    f"{speed['train']['tokens_per_s']:,.0f} tokens/s (batch {batch})"
  )
  return metadata


def _pair(text: str) -> tuple[int, int]:
  low, _, high = text.partition(",")
  return int(low), int(high or low)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m mercury_jax.distill", description=__doc__.split("\n")[0])
  parser.add_argument("--checkpoint", required=True, help="the model whose next-token head writes the continuations")
  parser.add_argument(
    "--data", action="append", required=True, metavar="DIR[@W]", help="prepared directories the prompts come from"
  )
  parser.add_argument("--out", required=True, help="the directory to create")
  parser.add_argument("--prompts", type=int, default=4096, help="train prompts (default 4096)")
  parser.add_argument("--validation-prompts", type=int, default=256, help="validation prompts (default 256)")
  parser.add_argument("--temperature", type=float, required=True, help="0: greedy")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--batch", type=int, default=64, help="prompts per engine call")
  parser.add_argument("--prompt-tokens", type=_pair, default=(16, 128), help="MIN,MAX tokens of an LM prompt")
  parser.add_argument("--decode", default="ar", choices=("ar", "verified"), help="the engine's decode mode")
  args = parser.parse_args(argv)
  from mercury_jax.config import DataConfig

  try:
    sources = DataConfig(distill=tuple(args.data)).weighted("distill")
    if args.temperature < 0 or args.prompts < 1 or args.validation_prompts < 0 or args.batch < 1:
      raise ValueError("--temperature must be >= 0, --prompts and --batch >= 1, --validation-prompts >= 0")
    build(
      args.checkpoint,
      sources,
      args.out,
      prompts=args.prompts,
      validation_prompts=args.validation_prompts,
      temperature=args.temperature,
      seed=args.seed,
      batch=args.batch,
      prompt_tokens=args.prompt_tokens,
      decode=args.decode,
      command="python -m mercury_jax.distill " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
  except (ValueError, OSError) as e:
    print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
