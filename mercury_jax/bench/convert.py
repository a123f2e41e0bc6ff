"""Converter throughput and peak memory on synthetic multi-GB checkpoints (``mercury_jax.convert``).

Writes a random bfloat16 checkpoint of at least ``--gb`` GB in LLaDA's layout and in Qwen2's (Dream's) layout, as
sharded safetensors streamed one tensor at a time, converts each with ``python -m mercury_jax.convert`` in a child
process, and prints a markdown table: source GB, seconds, GB/s, the child's peak RSS and its ratio to the converted
parameters' size (the target is <= 1.3). The work folder (default: a new temporary folder) is deleted afterwards::

  python -m mercury_jax.bench convert                 # about 2.3 GB per layout
  python -m mercury_jax.bench convert --gb 4 --keep --workdir runs/bench_convert
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

from mercury_jax.bench.throughput import timed

D, MLP, HEADS, VOCAB = 2048, 5632, 16, 32000
SHARD_BYTES = 1 << 30
BF16 = np.dtype(ml_dtypes.bfloat16)


def layer_bytes() -> int:
  return 2 * (4 * D * D + 3 * D * MLP + 2 * D + 3 * D)


def tensors(layout: str, layers: int) -> list[tuple[str, tuple[int, ...]]]:
  """``(name, shape)`` of every tensor of a checkpoint in ``layout`` (``llada`` or ``qwen2``)."""
  if layout == "llada":
    p = "model.transformer."
    out = [(p + "wte.weight", (VOCAB, D))]
    for i in range(layers):
      b = f"{p}blocks.{i}."
      out += [(b + "attn_norm.weight", (D,)), (b + "ff_norm.weight", (D,))]
      out += [(b + f"{n}.weight", (D, D)) for n in ("q_proj", "k_proj", "v_proj", "attn_out")]
      out += [(b + "ff_proj.weight", (MLP, D)), (b + "up_proj.weight", (MLP, D)), (b + "ff_out.weight", (D, MLP))]
    return out + [(p + "ln_f.weight", (D,)), (p + "ff_out.weight", (VOCAB, D))]
  out = [("model.embed_tokens.weight", (VOCAB, D))]
  for i in range(layers):
    b = f"model.layers.{i}."
    out += [(b + "input_layernorm.weight", (D,)), (b + "post_attention_layernorm.weight", (D,))]
    out += [(b + f"self_attn.{n}_proj.weight", (D, D)) for n in "qkvo"]
    out += [(b + f"self_attn.{n}_proj.bias", (D,)) for n in "qkv"]
    out += [(b + f"mlp.{n}_proj.weight", (MLP, D)) for n in ("gate", "up")] + [(b + "mlp.down_proj.weight", (D, MLP))]
  return out + [("model.norm.weight", (D,)), ("lm_head.weight", (VOCAB, D))]


def config(layout: str, layers: int) -> dict:
  if layout == "llada":
    return {
      "model_type": "llada", "d_model": D, "n_layers": layers, "n_heads": HEADS, "n_kv_heads": HEADS,
      "mlp_hidden_size": MLP, "vocab_size": VOCAB, "embedding_size": VOCAB, "rope_theta": 500000.0,
      "rms_norm_eps": 1e-5, "weight_tying": False, "max_sequence_length": 4096, "mask_token_id": 3, "eos_token_id": 1,
    }  # fmt: skip
  return {
    "model_type": "Dream", "hidden_size": D, "num_hidden_layers": layers, "num_attention_heads": HEADS,
    "num_key_value_heads": HEADS, "intermediate_size": MLP, "vocab_size": VOCAB, "rope_theta": 1e6,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False, "mask_token_id": 3,
    "eos_token_id": 1,
  }  # fmt: skip


def write_checkpoint(folder: Path, layout: str, layers: int) -> int:
  """Streams a random bfloat16 checkpoint into ``folder`` (shards of about 1 GiB); returns its tensor bytes."""
  from tokenizers import Tokenizer, models

  folder.mkdir(parents=True)
  rng = np.random.default_rng(0)
  pool = (rng.standard_normal(1 << 24, np.float32) * 0.02).astype(BF16)  # Slices of it fill every tensor.
  shards, current, size = [], [], 0
  for name, shape in tensors(layout, layers):
    nbytes = int(np.prod(shape)) * 2
    if current and size + nbytes > SHARD_BYTES:
      shards.append(current)
      current, size = [], 0
    current.append((name, shape))
    size += nbytes
  shards.append(current)
  weight_map, total = {}, 0
  for k, shard in enumerate(shards):
    file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
    header, offset = {}, 0
    for name, shape in shard:
      nbytes = int(np.prod(shape)) * 2
      header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
      offset, weight_map[name] = offset + nbytes, file
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with (folder / file).open("wb") as f:
      f.write(len(blob).to_bytes(8, "little") + blob)
      for _, shape in shard:
        n = int(np.prod(shape))
        start = int(rng.integers(0, pool.size - min(n, pool.size) + 1))
        data = np.resize(pool[start:], n) if n > pool.size - start else pool[start : start + n]
        f.write(data.tobytes())
    total += offset
  (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))  # fmt: skip
  (folder / "config.json").write_text(json.dumps(config(layout, layers)))
  vocab = {"<unk>": 0, "<eos>": 1, "<bos>": 2, "<mask>": 3, **{f"t{i}": 4 + i for i in range(100)}}
  Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(folder / "tokenizer.json"))
  return total


def measure(src: str, out: str) -> None:
  """Runs the converter as a child and prints ``{"seconds", "max_rss"}`` (bytes) as JSON: what this module does run
  as ``python -m mercury_jax.bench.convert SRC OUT``, so each conversion's peak RSS is its own."""
  command = [sys.executable, "-m", "mercury_jax.convert", "--from", src, "--out", out]
  _, seconds = timed(subprocess.run, command, check=True)
  print(json.dumps({"seconds": seconds, "max_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--gb", type=float, default=2.0, help="least source size per layout, in GB")
  p.add_argument("--workdir", default=None, help="default: a new temporary folder")
  p.add_argument("--keep", action="store_true", help="keep the work folder")


def run_convert(args: argparse.Namespace) -> None:
  """The converter's speed and peak memory on multi-GB checkpoints.

  Writes a random bfloat16 checkpoint of at least --gb GB in each layout, converts it in a child process and prints
  seconds, GB/s and the child's peak RSS against the parameters' size.
  """
  work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_convert."))
  layers = max(1, -(-int(args.gb * 1e9 - 4 * VOCAB * D) // layer_bytes()))
  rows = []
  try:
    for layout in ("llada", "qwen2"):
      src, out = work / f"{layout}-hf", work / f"{layout}-out"
      total, seconds = timed(write_checkpoint, src, layout, layers)
      sys.stderr.write(f"{layout}: wrote {total / 1e9:.2f} GB in {seconds:.0f} s\n")
      child = subprocess.run(
        [sys.executable, "-m", "mercury_jax.bench.convert", str(src), str(out)],
        check=True,
        capture_output=True,
        text=True,
      )
      result = json.loads(child.stdout.strip().splitlines()[-1])
      disk = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
      rows.append((layout, layers, total, result["seconds"], result["max_rss"], disk))
      shutil.rmtree(src)
      shutil.rmtree(out)
  finally:
    if not args.keep:
      shutil.rmtree(work, ignore_errors=True)
  print("| layout | layers | source GB (bf16) | seconds | GB/s | peak RSS GB | output on disk GB | RSS / params |")
  print("|---|---|---|---|---|---|---|---|")
  for layout, n, total, seconds, rss, disk in rows:
    print(
      f"| {layout} | {n} | {total / 1e9:.2f} | {seconds:.1f} | {total / 1e9 / seconds:.2f} | {rss / 1e9:.2f} | "
      f"{disk / 1e9:.2f} | {rss / total:.2f} |"
    )


COMMANDS = {"convert": (add_arguments, run_convert)}

if __name__ == "__main__":  # a child of ``convert``: one conversion, its peak memory its own
  measure(*sys.argv[1:3])
