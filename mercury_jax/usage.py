"""Usage errors of the command lines: one line on stderr that names the command, exit code 2, no traceback."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from mercury_jax.limits import MAX_GUIDANCE, SOLVERS


def fail(command: str, message) -> NoReturn:
  """Writes ``COMMAND: error: FIRST LINE OF MESSAGE`` to stderr and exits with code 2."""
  lines = str(message).strip().splitlines()
  sys.stderr.write(f"{command}: error: {lines[0] if lines else 'invalid input'}\n")
  raise SystemExit(2)


class Parser(argparse.ArgumentParser):
  """An ``ArgumentParser`` whose usage errors go through :func:`fail` under ``command``."""

  def __init__(self, *args, command: str, **kwargs):
    super().__init__(*args, **kwargs)
    self.command = command

  def error(self, message: str) -> NoReturn:
    fail(self.command, message)


def add_latent_flags(p: argparse.ArgumentParser) -> None:
  """A continuous checkpoint's ``--solver`` and ``--guidance`` (the sample and serve command lines)."""
  p.add_argument(
    "--solver",
    metavar="SOLVER",
    help=f"a continuous checkpoint's ODE solver: {', '.join(SOLVERS)} (default euler; heun: two passes a step)",
  )
  p.add_argument(
    "--guidance",
    type=float,
    metavar="W",
    help=f"a continuous checkpoint's classifier-free guidance scale in [0, {MAX_GUIDANCE:g}] (default 1: off; two "
    "passes a step otherwise)",
  )


def add_draft_flags(p: argparse.ArgumentParser) -> None:
  """Verified decoding's draft-tree flags (``python -m mercury_jax.sample`` and ``python -m mercury_jax.serve``):
  each a ``SamplerSettings`` field of the same name."""
  p.add_argument(
    "--draft-tree",
    help="verified decoding's draft tree: chain, small, wide, none (sampling.settings.TREES), rank paths added to "
    "the drafter's chain like '1,2,10' (r: its r-th next likeliest token), or auto (default: the device's; a CPU's "
    "is none, the lookup chain alone, its fastest measured greedy; a GPU's wide)",
  )
  p.add_argument(
    "--draft-lookup",
    type=int,
    help="length of the prompt-lookup chain verified beside the drafts (the tokens that followed the last ones where "
    "they occurred before in the text); 0: off (default -1: the device's, 8 on a CPU and a GPU)",
  )
  p.add_argument(
    "--draft-blocks",
    help="after which outcomes a step pre-drafts the next drafts: all (every chain depth), tree (every node of the "
    "tree, alternatives too), depths like '0,1' (a cheaper chunk), none (default auto: the device's; none on a CPU, "
    "all on a GPU)",
  )
  p.add_argument(
    "--draft-confidence",
    type=float,
    help="adaptive draft length: verify a drafter candidate only where the drafter's probability of it reaches this "
    "bar (default 0: off)",
  )
