"""One benchmark in two checkouts, interleaved: the speed gate of a refactor.

    python launch/speed_ab.py --base ../before --runs 6 -- slot-step --model mercury_jax/assets/default_bd --rounds 1

Runs ``python -m mercury_jax.bench ARGS`` (or, with ``--base-script``, that script of the base checkout, for a
commit from before the benchmarks moved into ``mercury_jax.bench``) alternately in the base checkout and in this one,
``--runs`` times each, in one process after the other (a CPU host's capacity drifts for minutes at a time, so the two
must see the same drift). Every number of every markdown table the benchmark prints is collected by table, row and
column; the result is each cell's median over the runs in both checkouts and their ratio, written so that above 1 is
slower here: this checkout's time over the base's, or the base's rate over this one's for a column of tokens per
second. The last line is the largest ratio.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

_NUMBER = re.compile(r"^\s*(-?\d+(?:\.\d+)?)")
_RATE = re.compile(r"tok(en)?s?/s|per second|/s\b", re.IGNORECASE)
_SKIP = re.compile(r"ratio|speed-?up|\bvs\b|×|^x |share|%", re.IGNORECASE)  # ratios: "x dual per pass", "× twin"


def tables(text: str) -> dict[tuple[int, str, str], float]:
  """Every number of every markdown table in ``text``, keyed by (table, row label, column header)."""
  cells, table, header = {}, -1, None
  for line in text.splitlines():
    line = line.strip()
    if not line.startswith("|"):
      header = None
      continue
    parts = [p.strip() for p in line.strip("|").split("|")]
    if header is None:
      header, table = parts, table + 1
      continue
    if set("".join(parts)) <= set("-: "):
      continue
    for column, cell in zip(header[1:], parts[1:], strict=False):
      match = _NUMBER.match(cell)
      if match and not _SKIP.search(column) and not cell.rstrip().endswith("x"):
        cells[table, parts[0], column] = float(match.group(1))
  return cells


def run(checkout: Path, command: list[str]) -> dict:
  env = {**os.environ, "PYTHONPATH": str(checkout)}
  done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, check=False)
  if done.returncode:
    sys.exit(f"speed_ab: {' '.join(command)} failed in {checkout}:\n{done.stderr[-2000:]}")
  return tables(done.stdout)


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(prog="python launch/speed_ab.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--base", required=True, type=Path, help="a checkout of the commit to compare against")
  p.add_argument("--base-script", help="run this script of the base checkout instead of python -m mercury_jax.bench")
  p.add_argument("--runs", type=int, default=5, help="runs in each checkout, alternating (default 5)")
  p.add_argument("bench", nargs=argparse.REMAINDER, help="-- then the bench subcommand and its flags")
  args = p.parse_args(argv)
  bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
  if not bench or args.runs < 1:
    p.error("give --runs >= 1 and, after --, a bench subcommand")
  here = Path(__file__).resolve().parents[1]
  new_command = [sys.executable, "-m", "mercury_jax.bench", *bench]
  base_command = [sys.executable, args.base_script, *bench[1:]] if args.base_script else new_command
  base, new = [], []
  for i in range(args.runs):
    order = [(base, args.base.resolve(), base_command), (new, here, new_command)]
    for into, checkout, command in order if i % 2 == 0 else order[::-1]:
      into.append(run(checkout, command))
      print(f"run {i + 1}/{args.runs}: {'base' if into is base else 'this'} done", file=sys.stderr, flush=True)
  worst = 0.0
  print("| table | row | column | base | this | ratio |\n|---|---|---|---:|---:|---:|")
  for key in sorted(set.intersection(*(set(r) for r in base + new))):
    b, n = (statistics.median(r[key] for r in runs) for runs in (base, new))
    if b <= 0 or n <= 0:
      continue
    ratio = b / n if _RATE.search(key[2]) else n / b
    worst = max(worst, ratio)
    print(f"| {key[0]} | {key[1]} | {key[2]} | {b:.4g} | {n:.4g} | {ratio:.3f} |")
  print(f"largest ratio (above 1: slower here): {worst:.3f}")


if __name__ == "__main__":
  main()
