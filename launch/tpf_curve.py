"""Tokens per forward of a verified run's checkpoints: the drafter's learning curve, greedy and at T = 1.

    python launch/tpf_curve.py --workdir RUNS/v4_distill --steps 60,120,180 --data DATA_DIR --corpus python-stdlib \
      [--lever chain] [--tree RANK_PATHS] [--blocks all|tree|DEPTHS] [--prompts 128] [--length 64] [--batch 64] \
      [--tokens launch/draft_tokens.py's JSON] [--json OUT]
    python launch/tpf_curve.py --workdir RUNS/v4_distill --json OUT --plot curve.png   # plot OUT's rows (bench extra)

For each checkpoint step (``--checkpoint`` for exported models instead) it decodes exactly what
``python -m mercury_jax.bench --verified ... --length L --prompts N`` decodes for its verified rows: the same
documented-function prompts of the validation split (``bench.prompts.select_prompts``, the same context rule), the
same canvases (``bench.rounds.make_batches``), the same seed and random streams, at T = 1 and greedy, and reports what
the bench reports for them: tokens per forward and acceptance by draft position (``bench.verified.acceptance``).
Tokens per forward do not depend on the batch (each row draws from its own stream), so one batch size, and none of
the bench's timing rounds, is needed: the figures equal the bench's, at a fraction of its time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from mercury_jax.bench import prompts as bench_prompts, verified as bench_verified
from mercury_jax.bench.rounds import generated, make_batches
from mercury_jax.data import pipeline
from mercury_jax.sampling.sampler import Sampler


def bench_canvases(sampler: Sampler, tokenizer, data: str, corpus: str, prompts: int, length: int, batch: int):
  """``(canvases, prompts found)``: the bench's documented-function prompts that fit ``sampler``'s context with room
  for ``length`` new tokens, in canvases of ``batch`` rows (the last one padded), as the bench builds them."""
  context = sampler.max_length
  limit = context - min(length, context // 2)
  chosen, _ = bench_prompts.select_prompts(data, prompts, lambda text: len(tokenizer.encode(text)) <= limit, corpus)
  ids = [tokenizer.encode(p.text) for p in chosen]
  return make_batches(ids, length, context, batch, tokenizer.pad_id), len(chosen)


def measure(
  sampler: Sampler, canvases, real_rows: int, temperature: float, seed: int, lever: str = "chain", **overrides
) -> dict:
  """Verified decoding of every canvas at ``temperature`` with ``lever``'s knobs (and ``overrides`` of them): TPF
  and acceptance over the first ``real_rows`` rows."""
  knobs = {**bench_verified.LEVERS[lever], **overrides}
  settings = sampler.settings(temperature=temperature, top_p=1.0, top_k=0, decode="verified", draft_length=0, **knobs)
  calls, tokens, nfe = [], 0, 0
  left = real_rows
  for canvas in canvases:
    out, _, _ = sampler.run(canvas, None, seed, settings)
    real = min(left, canvas.tokens.shape[0])
    left -= real
    tokens += int(generated(canvas, out.tokens, sampler.tokenizer.pad_id, real).sum())
    nfe += int(np.asarray(out.nfe)[:real].sum())
    calls.append({"accepted": np.asarray(out.accepted)[:real]})
  accept = bench_verified.acceptance(calls)
  return {"tokens_per_forward": tokens / max(nfe, 1), "tokens": tokens, "forwards": nfe, **accept}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", help="a train workdir; its --steps are measured")
  parser.add_argument("--steps", default="", help="comma-separated checkpoint steps of --workdir")
  parser.add_argument("--checkpoint", action="append", default=[], help="an exported model (repeatable)")
  parser.add_argument("--data", help="a prepared directory with the models' tokenizer (needed to measure)")
  parser.add_argument("--corpus", default="python-stdlib", help="the prompts' corpus (as the bench's --corpus)")
  parser.add_argument("--prompts", type=int, default=128)
  parser.add_argument("--length", type=int, default=64)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--temperatures", default="1,0")
  parser.add_argument("--lever", default="chain", choices=sorted(bench_verified.LEVERS), help="the bench's lever")
  parser.add_argument("--tree", help="the draft tree instead of the lever's (SamplerSettings.draft_tree)")
  parser.add_argument("--blocks", help="the pre-draft blocks instead of the lever's (SamplerSettings.draft_blocks)")
  parser.add_argument("--tokens", help="draft_tokens.py's JSON: drafter tokens at each step, for the table")
  parser.add_argument("--offset", type=int, default=0, help="drafter tokens seen before this run (earlier stages)")
  parser.add_argument("--json", help="write the rows here (appended to an existing file's rows)")
  parser.add_argument("--plot", help="then plot --json's rows of --workdir: TPF against drafter tokens (a PNG)")
  parser.add_argument("--also", action="append", default=[], help="--plot also draws this workdir's rows (repeatable)")
  args = parser.parse_args()
  if args.plot and not (args.json and args.workdir):
    parser.error("--plot draws --json's rows of --workdir: give both")
  targets = [(f"{args.workdir}@{s}", args.workdir, int(s)) for s in args.steps.split(",") if s]
  targets += [(c, c, None) for c in args.checkpoint]
  if targets and not args.data:
    parser.error("--data is needed to measure: the prepared directory with the models' tokenizer")
  drafter = {}
  if args.tokens:
    drafter = {r["step"]: r["drafter"] for r in json.loads(Path(args.tokens).read_text())["rows"]}
  rows = json.loads(Path(args.json).read_text())["rows"] if args.json and Path(args.json).is_file() else []
  for row in rows:  # Rows measured before the run's token counts were known get them now.
    if row.get("step") in drafter and row["checkpoint"] == f"{args.workdir}@{row['step']}":
      row.setdefault("drafter_tokens", args.offset + drafter[row["step"]])
  knobs = {f"draft_{name}": v for name in ("tree", "blocks") if (v := getattr(args, name)) is not None}
  tokenizer = pipeline.load_data_tokenizer(args.data) if targets else None
  for name, path, step in targets:
    sampler = Sampler.from_checkpoint(path, step=step)
    canvases, count = bench_canvases(sampler, tokenizer, args.data, args.corpus, args.prompts, args.length, args.batch)
    row = {"checkpoint": name, "step": step, "length": args.length, "prompts": count, "lever": args.lever, **knobs}
    if step is not None and step in drafter:
      row["drafter_tokens"] = args.offset + drafter[step]
    for t in (float(v) for v in args.temperatures.split(",")):
      label = "greedy" if t == 0 else f"T={t:g}"
      row[label] = measure(sampler, canvases, count, t, args.seed, args.lever, **knobs)
    rows.append(row)
    shown = {k: round(v["tokens_per_forward"], 3) for k, v in row.items() if isinstance(v, dict)}
    by_position = {k: [round(a, 3) for a in v["accepted_by_position"]] for k, v in row.items() if isinstance(v, dict)}
    print(name, args.lever, knobs or "", row.get("drafter_tokens", ""), shown, by_position, flush=True)
    if args.json:
      Path(args.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
  if args.json and not targets:
    Path(args.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
  if args.plot:
    plot(rows, [args.workdir, *args.also], args.lever, args.plot)


def plot(rows: list[dict], workdirs: list[str], lever: str, out: str) -> None:
  """TPF greedy and at T = 1 against the drafter tokens seen, for each of ``workdirs``' rows measured with
  ``lever`` (one colour per run, greedy solid, T = 1 dashed)."""
  import matplotlib  # The bench extra: only --plot needs it.

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 3.5))
  for index, workdir in enumerate(workdirs):
    mine = [r for r in rows if r["checkpoint"].startswith(f"{workdir}@") and r.get("lever") == lever]
    mine = sorted((r for r in mine if "drafter_tokens" in r), key=lambda r: r["drafter_tokens"])
    seen = [r["drafter_tokens"] / 1e6 for r in mine]
    for label, style in (("greedy", "o-"), ("T=1", "s--")):
      tpf = [r[label]["tokens_per_forward"] for r in mine]
      ax.plot(
        seen, tpf, style, color=f"C{index}", label=f"{Path(workdir).name} {label}" if len(workdirs) > 1 else label
      )
  ax.set_xlabel("drafter tokens seen in this stage (millions)")
  ax.set_ylabel(f"tokens per forward ({lever})")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(out, dpi=120)


if __name__ == "__main__":
  main()
