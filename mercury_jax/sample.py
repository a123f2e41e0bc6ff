"""``python -m mercury_jax.sample --checkpoint DIR --prompt TEXT [--steps N --sampler NAME ...]``: generate text.

Examples::

  python -m mercury_jax.sample --checkpoint runs/tiny --prompt "def fibonacci(n):" --length 64 --steps 16
  python -m mercury_jax.sample --checkpoint runs/tiny --template '{"name": "<mask:8>", "age": <mask:2>}'
  python -m mercury_jax.sample --checkpoint runs/tiny --prompts-file prompts.jsonl --json
  python -m mercury_jax.sample --checkpoint runs/tiny --prompt "import os" --show-steps

``--prompts-file`` is JSON lines, each ``{"prompt": "..."}`` or a JSON string. Without ``--checkpoint`` the model
bundled in ``mercury_jax/assets/default/`` is used once there is one. Bad input gets one line on stderr and exit
code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from mercury_jax import distributed
from mercury_jax.sampling import canvas as cv
from mercury_jax.sampling.settings import CONFIDENCES, SAMPLERS, SamplerSettings

FRAME_SECONDS = 0.08  # Pause between frames of --show-steps on a terminal.

NO_DEFAULT_MODEL = (
  "no --checkpoint given and no default model is bundled yet (mercury_jax/assets/default/); train one with "
  "`python -m mercury_jax.prepare --corpus python-stdlib --out data/stdlib` and "
  "`python -m mercury_jax.train --config tiny --workdir runs/tiny --set data.path=data/stdlib`, "
  "then pass --checkpoint runs/tiny"
)


class _Parser(argparse.ArgumentParser):
  """Usage errors as one line on stderr, exit code 2."""

  def error(self, message: str):
    _fail(message)


def _fail(message: str):
  first_line = str(message).strip().splitlines()[0] if str(message).strip() else "invalid input"
  sys.stderr.write(f"mercury_jax.sample: error: {first_line}\n")
  raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
  p = _Parser(prog="python -m mercury_jax.sample", description=__doc__.splitlines()[0])
  p.add_argument("--checkpoint", help="train workdir, checkpoints folder, step folder or exported checkpoint")
  source = p.add_mutually_exclusive_group()
  source.add_argument("--prompt", help="text to continue (or to put before --template)")
  source.add_argument("--prompts-file", help='JSON lines: {"prompt": ...} or a JSON string per line')
  p.add_argument("--template", help="text with <mask:N> holes to fill; its other text is kept as is")
  p.add_argument("--length", type=int, help="tokens to generate after each prompt (default 64; not with --template)")
  p.add_argument("--steps", type=int, default=32, help="refinement steps (a budget: finished canvases stop early)")
  p.add_argument("--sampler", default="confidence", help=f"step rule: {', '.join(SAMPLERS)}")
  p.add_argument("--confidence", default="prob", help=f"what ranks positions: {', '.join(CONFIDENCES)}")
  p.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
  p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
  p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
  p.add_argument("--threshold", type=float, default=0.9, help="confidence bar of --sampler threshold")
  p.add_argument("--block-length", type=int, default=0, help="semi-autoregressive blocks (0: one block)")
  p.add_argument("--revision", type=float, default=0.0, help="ReMDM-style re-masking strength in [0, 1)")
  p.add_argument("--min-length", type=int, default=0, help="no end-of-sequence among the first N generated tokens")
  p.add_argument("--bos", action="store_true", help="start prompts with BOS, as SFT data does")
  p.add_argument("--num-samples", type=int, default=1, help="samples per prompt")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--mesh", help="DATA,FSDP,TENSOR sizes (default: every device on the data axis)")
  p.add_argument(
    "--json", action="store_true", help="one JSON object per sample: text, tokens, NFE, wall time, batch tokens/s"
  )
  p.add_argument("--show-steps", action="store_true", help="show the canvas being refined, step by step")
  distributed.add_arguments(p)
  return p


def _read_prompts(path: str) -> list[str]:
  try:
    lines = Path(path).read_text(encoding="utf-8").splitlines()
  except (OSError, UnicodeDecodeError) as e:
    _fail(f"cannot read --prompts-file {path!r}: {getattr(e, 'strerror', None) or e}")
  prompts = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      item = json.loads(line)
    except json.JSONDecodeError as e:
      _fail(f"--prompts-file {path!r} line {number} is not JSON: {e}")
    if isinstance(item, dict) and isinstance(item.get("prompt"), str):
      item = item["prompt"]
    if not isinstance(item, str):
      _fail(f'--prompts-file {path!r} line {number} must be a JSON string or an object with a "prompt" string')
    prompts.append(item)
  if not prompts:
    _fail(f"--prompts-file {path!r} holds no prompt")
  return prompts


def _check_args(args: argparse.Namespace) -> dict:
  """Every check that needs no model, before a checkpoint is read; returns the sampler knobs."""
  if args.steps < 1:
    _fail(f"--steps={args.steps} must be >= 1")
  if args.length is not None and args.length < 1:
    _fail(f"--length={args.length} must be >= 1")
  if args.length is not None and args.template is not None:
    _fail("--length does not apply to --template; the template's <mask:N> holes set the length")
  if args.num_samples < 1:
    _fail(f"--num-samples={args.num_samples} must be >= 1")
  if args.template is not None:
    cv.parse_template(args.template, lambda text: [])  # Raises for a template without holes.
  if args.prompt is None and args.prompts_file is None and args.template is None:
    _fail("give --prompt TEXT, --prompts-file FILE.jsonl or --template TEXT (e.g. --template '<mask:64>')")
  if args.prompt is not None and not args.prompt and args.template is None:
    _fail("--prompt is empty; give text to continue, or a --template with <mask:N> holes")
  knobs = {
    "rule": args.sampler,
    "confidence": args.confidence,
    "temperature": args.temperature,
    "top_k": args.top_k,
    "top_p": args.top_p,
    "threshold": args.threshold,
    "block_length": args.block_length,
    "revision": args.revision,
    "min_length": args.min_length,
  }
  try:
    SamplerSettings(**knobs).validate()
  except ValueError as e:  # Name the flag, not the library's field: "top_p=0" -> "--top-p=0".
    message = str(e)
    for name in knobs:
      message = message.replace(f"{name}=", f"--{name.replace('_', '-')}=")
    _fail(message.replace("sampler ", "--sampler "))
  return knobs


def _make_mesh(spec: str | None):
  from mercury_jax import sharding as sh
  from mercury_jax.config import MeshConfig

  if spec is None:
    return sh.make_mesh(MeshConfig(data=-1))
  try:
    data, fsdp, tensor = (int(v) for v in spec.split(","))
  except ValueError:
    _fail(f"--mesh {spec!r} must be three integers DATA,FSDP,TENSOR, e.g. 4,1,2")
  return sh.make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor))


def _show(frames: list[str], header: str) -> None:
  tty = sys.stdout.isatty()
  for j, frame in enumerate(frames):
    if tty:
      sys.stdout.write("\033[H\033[J")
    sys.stdout.write(f"{header} step {j + 1}/{len(frames)}\n{frame}\n\n")
    sys.stdout.flush()
    if tty:
      time.sleep(FRAME_SECONDS)


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    knobs = _check_args(args)
  except ValueError as e:  # A template without holes.
    _fail(f"--template: {e}")
  prompts = _read_prompts(args.prompts_file) if args.prompts_file else None
  if prompts is not None and args.template is None:
    for number, prompt in enumerate(prompts, 1):
      if not prompt:
        _fail(f"prompt {number} of --prompts-file {args.prompts_file!r} is empty")
  try:
    distributed.initialize(args)
  except SystemExit as e:  # Inconsistent --coordinator/--num-processes/--process-id.
    _fail(str(e.code))

  from mercury_jax.config import ConfigError
  from mercury_jax.sampling.sampler import Sampler, default_checkpoint

  path = args.checkpoint
  if path is None:
    path = default_checkpoint()
    if path is None:
      _fail(NO_DEFAULT_MODEL)
  elif not Path(path).exists():
    _fail(f"--checkpoint {path!r} does not exist")
  try:
    mesh = _make_mesh(args.mesh)
  except ConfigError as e:
    _fail(f"--mesh: {e}")
  try:
    sampler = Sampler.from_checkpoint(path, mesh=mesh)
  except (FileNotFoundError, ConfigError, ValueError) as e:
    _fail(f"--checkpoint {str(path)!r}: {e}")
  try:
    samples = sampler.generate(
      prompts if prompts is not None else args.prompt,
      template=args.template,
      length=64 if args.length is None else args.length,
      steps=args.steps,
      seed=args.seed,
      num_samples=args.num_samples,
      show_steps=args.show_steps,
      bos=args.bos,
      **knobs,
    )
  except ValueError as e:
    _fail(str(e))

  if not distributed.is_primary():
    return 0
  for i, s in enumerate(samples):
    if args.json:
      record = {
        "prompt": s.prompt,
        "text": s.text,
        "tokens": s.tokens,
        "nfe": s.nfe,
        "wall_time_s": round(s.wall_time, 6),
        "tokens_per_s": round(s.tokens_per_s, 2),
        "compile_time_s": round(s.compile_time, 3),
      }
      if s.steps is not None:
        record["steps"] = s.steps
      print(json.dumps(record, ensure_ascii=False))
      continue
    if s.steps is not None:
      _show(s.steps, f"[sample {i + 1}/{len(samples)}]")
    print(s.prompt + s.text)
    if i + 1 < len(samples):
      print("-" * 40)
  if not args.json and samples:
    s = samples[0]
    sys.stderr.write(
      f"{len(samples)} sample(s): NFE {max(x.nfe for x in samples)}, {s.wall_time:.3f} s, "
      f"{s.tokens_per_s:,.0f} tokens/s (compile {s.compile_time:.1f} s)\n"
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
