"""The needle-in-a-haystack recipe of issue 26, end to end: train a tiny model to retrieve at 2 K, extend it to 8 K
with RoPE scaling (with and without a short continued run at 8 K), and print the retrieval rate by depth.

    python launch/needle.py --workdir runs/needle                       # the whole recipe (~40 min on 2 CPU cores)
    python launch/needle.py --workdir runs/needle --export tests/fixtures/needle   # and ship the 8 K model
    python launch/needle.py --workdir runs/needle --skip-train          # only the measurements, from existing runs

Steps (every one a command of the package, so each can be rerun alone; a rerun skips prepared data and resumes
or skips the runs):

1. ``prepare --corpus kv-retrieval`` at 64, 2,048 and 8,192 tokens (one tokenizer, trained on the first).
2. ``train --config tiny_retrieval`` at 64 tokens (the warm-up that learns the lookup), then at 2,048 from it
   (``--init-from``).
3. The 2 K model asked ``--trials`` needles at 2 K, and at 8 K with each RoPE scaling (``none``, ``linear``, ``ntk``,
   ``yarn``): the weights unchanged, the positions stretched 4x (``bench.needle.with_context``).
4. ``train --config tiny_retrieval_8k`` (YaRN, a short run at 8 K from the 2 K model), asked the same 8 K needles.
5. With ``--export``: the 8 K model written as a params-only bfloat16 checkpoint (``export.export``).

Every measurement goes through the engine (``Sampler.generate``) with the prefill in chunks of ``--prefill-chunk``
tokens, greedy, in batches of ``--batch`` prompts; a needle is retrieved when the first generated token is its value.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

CONTEXT, TRAINED = 8192, 2048
SCALINGS = ("none", "linear", "ntk", "yarn")
DATA = {  # name: (seq_len, spec)
  "kv64": (64, "kv-retrieval:records=32000"),
  "kv2k": (TRAINED, "kv-retrieval:records=2400,seed=1"),
  "kv8k": (CONTEXT, "kv-retrieval:records=128,seed=2"),
}
WARMUP = ["model.max_length=64", "data.batch_size=64", "train.steps=500", "optim.learning_rate=1e-2",
          "optim.warmup_steps=30", "train.log_every=50", "train.eval_every=250", "checkpoint.every=250"]  # fmt: skip


def _run(args: list[str], log: Path) -> float:
  """Runs ``python -m ARGS`` with its output in ``log``; returns its wall seconds."""
  start = time.perf_counter()
  with log.open("w") as f:
    print("$ python -m " + " ".join(args), flush=True)
    code = subprocess.run([sys.executable, "-m", *args], stdout=f, stderr=subprocess.STDOUT).returncode
  if code:
    raise SystemExit(f"`python -m {' '.join(args)}` failed ({code}); see {log}")
  return time.perf_counter() - start


def prepare(root: Path) -> dict[str, Path]:
  """The three data folders (step 1), prepared once."""
  from mercury_jax import files

  paths = {name: root / "data" / name for name in DATA}
  tokenizer = paths["kv64"] / files.TOKENIZER_FILE
  for name, (seq_len, spec) in DATA.items():
    if (paths[name] / files.METADATA_FILE).is_file():
      continue
    extra = [] if name == "kv64" else ["--tokenizer", str(tokenizer)]
    cmd = ["mercury_jax.prepare", "--corpus", spec, "--out", str(paths[name]), "--seq-len", str(seq_len), *extra]
    _run(cmd, root / f"prepare_{name}.log")
  return paths


def train(root: Path, data: dict[str, Path]) -> dict[str, float]:
  """The three runs (steps 2 and 4); returns each one's wall seconds. A run found in its workdir resumes (and ends
  at once when it is finished); ``--init-from`` only starts a new one."""
  runs = {
    "warmup": ("tiny_retrieval", data["kv64"], None, WARMUP),
    "2k": ("tiny_retrieval", data["kv2k"], "warmup", []),
    "8k": ("tiny_retrieval_8k", data["kv8k"], "2k", []),
  }
  seconds = {}
  for name, (config, path, init, sets) in runs.items():
    workdir = root / "runs" / name
    cmd = ["mercury_jax.train", "--config", config, "--workdir", str(workdir), "--set", f"data.path={path}"]
    cmd += [a for s in sets for a in ("--set", s)]
    cmd += ["--init-from", str(root / "runs" / init)] if init else []
    seconds[name] = _run(cmd, root / f"train_{name}.log")
  return seconds


def measure(root: Path, trials: int, chunk: int, batch: int, seed: int) -> dict[str, dict]:
  """Steps 3 and 4: each model and context's retrieval, ``{label: {"rate", "by_depth", "seconds"}}``."""
  import jax

  from mercury_jax.bench import needle
  from mercury_jax.checkpoint import restore_params
  from mercury_jax.data.tokenizer import load_tokenizer
  from mercury_jax.sampling.sampler import Sampler

  tokenizer = load_tokenizer(root / "runs" / "2k")
  base, base_cfg = restore_params(root / "runs" / "2k")
  long, long_cfg = restore_params(root / "runs" / "8k")
  cases = [("2k model at 2K", base, base_cfg, TRAINED)]
  cases += [(f"2k model at 8K, {s}", base, needle.with_context(base_cfg, CONTEXT, s), CONTEXT) for s in SCALINGS]
  cases += [("8k model (yarn + continued run) at 8K", long, long_cfg, CONTEXT)]
  results = {}
  for label, params, cfg, length in cases:
    prompts = needle.needles(trials, length - 2, seed)  # two tokens to generate: the value and EOS
    start = time.perf_counter()
    out = needle.run(Sampler(params, cfg, tokenizer), prompts, prefill_chunk=chunk, batch=batch)
    seconds = time.perf_counter() - start
    depth = needle.by_depth(out)
    results[label] = {"rate": needle.rate(out), "by_depth": depth, "seconds": seconds, "trials": len(out)}
    cells = " ".join(f"{r:.2f}" for _, r, _ in depth)
    print(f"{label:42s} {needle.rate(out):6.1%}  by depth (8 bins): {cells}  ({seconds:.0f} s)", flush=True)
    jax.clear_caches()
  return results


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workdir", default="runs/needle", help="data, runs, logs and results.json go here")
  p.add_argument("--trials", type=int, default=64, help="needles per measurement")
  p.add_argument("--prefill-chunk", type=int, default=512, help="the engine's prefill chunk (0: one pass)")
  p.add_argument("--batch", type=int, default=8, help="prompts per generate call")
  p.add_argument("--seed", type=int, default=0, help="seed of the needle prompts")
  p.add_argument("--skip-train", action="store_true", help="measure existing runs only")
  p.add_argument("--export", metavar="DIR", help="write the 8 K model here (params-only, bfloat16)")
  args = p.parse_args()
  root = Path(args.workdir)
  root.mkdir(parents=True, exist_ok=True)
  seconds = {}
  if not args.skip_train:
    seconds = train(root, prepare(root))
    print("training seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()), flush=True)
  results = measure(root, args.trials, args.prefill_chunk, args.batch, args.seed)
  (root / "results.json").write_text(json.dumps({"train_seconds": seconds, "retrieval": results}, indent=2) + "\n")
  if args.export:
    from mercury_jax.export import export

    print(f"exported {export(root / 'runs' / '8k', args.export, dtype='bfloat16', force=True)}")


if __name__ == "__main__":
  main()
