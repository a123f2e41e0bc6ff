"""``python -m mercury_jax.bench COMMAND``: every benchmark and measurement of the project, one subcommand each.

``python -m mercury_jax.bench --help`` lists them by what they are for; ``python -m mercury_jax.bench COMMAND
--help`` gives a command's flags and names the module that holds its code (whose docstring says what is measured
and how). Without a command, ``python -m mercury_jax.bench [FLAGS]`` runs ``compare`` (the command line before the
bench had subcommands). Bad input gets one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import inspect
import sys

from mercury_jax import usage
from mercury_jax.bench import (
  caches,
  compare,
  convert,
  families,
  gpu_attention,
  gpu_sampling,
  long_attention,
  long_context,
  needle,
  objectives,
  recipes,
  sampler,
  schema_coverage,
  serve,
  slot_step,
  structured,
  training,
)  # fmt: skip

PROG = "python -m mercury_jax.bench"
MODULES = (  # each with ``COMMANDS = {name: (add_arguments, run)}``; run's docstring is the command's help
  compare, serve, slot_step, sampler, caches, structured, training, long_context, long_attention, needle, families,
  convert, gpu_attention, gpu_sampling, recipes, objectives, schema_coverage,
)  # fmt: skip
GROUPS = (  # what --help lists, in this order
  ("start here", ("compare", "serve")),
  ("the engine's parts", ("slot-step", "sampler", "exact-cache", "approximate-caches", "structured", "train")),
  ("JSON Schema coverage of structured output", ("schema-suite", "schema-bench", "schema-vendor")),
  ("long contexts", ("long-context", "long-attention", "context-parallel", "needle")),
  ("public checkpoints", ("families", "convert")),
  ("on a GPU (launch/gpu_checks.sh runs them)", ("gpu-attention", "gpu-sampling")),
  (
    "experiments whose numbers docs/results quotes",
    (
      "targets",
      "first-text",
      "block-size-sweep",
      "continuous",
      "noise-profile",
      "draft-masking",
      "diffusion-heads",
      "needle-recipe",
    ),
  ),  # fmt: skip
)


def build_parser() -> argparse.ArgumentParser:
  """The parser of every command of :data:`MODULES`, listed as :data:`GROUPS` says."""
  commands = {name: (module, *command) for module in MODULES for name, command in module.COMMANDS.items()}
  grouped = [name for _, names in GROUPS for name in names]
  if sorted(grouped) != sorted(commands):
    raise AssertionError(f"bench.cli.GROUPS and the modules' commands differ: {sorted(grouped)} {sorted(commands)}")
  width = max(map(len, commands)) + 2
  epilog = []
  for title, names in GROUPS:
    epilog += [f"{title}:"] + [f"  {name:{width}s}{_summary(commands[name][2])}" for name in names] + [""]
  epilog += [f"{PROG} COMMAND --help: a command's flags and its module. Without a command: compare."]
  p = usage.Parser(
    prog=PROG, command="mercury_jax.bench", description="Every benchmark and measurement, one command each.",
    usage=f"{PROG} COMMAND [FLAGS]", epilog="\n".join(epilog), formatter_class=argparse.RawDescriptionHelpFormatter,
  )  # fmt: skip
  sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True, help=argparse.SUPPRESS)
  for name in grouped:
    module, add_arguments, run = commands[name]
    parser = sub.add_parser(
      name,
      prog=f"{PROG} {name}",
      description=f"{inspect.getdoc(run)}\n\nThe code, and how it measures: {module.__name__}.",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      command=f"mercury_jax.bench {name}",
    )
    add_arguments(parser)
    parser.set_defaults(run=run)
  return p


def _summary(run) -> str:
  return inspect.getdoc(run).splitlines()[0]


def main(argv: list[str] | None = None) -> None:
  """Parses ``argv`` (default: the command line) and runs its command; exits with the command's code."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
    argv = ["compare", *argv]
  args = build_parser().parse_args(argv)
  run = vars(args).pop("run")
  vars(args).pop("command")
  code = run(args)
  if code:
    raise SystemExit(code)
