"""Usage errors of the command lines: one line on stderr that names the command, exit code 2, no traceback."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


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
