"""Progress lines of long commands: a plain line after the first unit, then every few seconds, and the last one."""

import io

import pytest

from mercury_jax.progress import Progress, duration


def test_plain_lines_estimate_the_time_left():
  out = io.StringIO()  # Not a terminal: plain lines.
  with Progress(4, "job", "batches", every=0.0, stream=out) as progress:
    for _ in range(4):
      progress.update()
  lines = out.getvalue().splitlines()
  assert [line.split(",")[0] for line in lines] == [
    "job: 1/4 batches (25%)",
    "job: 2/4 batches (50%)",
    "job: 3/4 batches (75%)",
    "job: 4/4 batches (100%)",
  ]
  assert all("left" in line for line in lines[:-1]) and "left" not in lines[-1]


def test_lines_are_spaced_and_a_disabled_progress_is_silent():
  out = io.StringIO()
  with Progress(100, "job", every=3600.0, stream=out) as progress:
    for _ in range(100):
      progress.update()
  assert len(out.getvalue().splitlines()) == 3  # After the first and the second unit, and at the end.
  quiet = io.StringIO()
  with Progress(3, "job", enabled=False, stream=quiet) as progress:
    progress.update(3)
  assert quiet.getvalue() == ""


def test_the_estimate_leaves_the_first_unit_out(monkeypatch):
  """The first unit carries the compilation: 100 s, then 1 s a unit, leaves 1 s a unit for the rest."""
  from mercury_jax import progress as progress_lib

  now = [0.0]
  monkeypatch.setattr(progress_lib.time, "monotonic", lambda: now[0])
  out = io.StringIO()
  progress = Progress(10, "job", every=0.0, stream=out)
  for now[0] in (100.0, 101.0, 102.0):  # Only the first unit to go by at 100 s: 100 s a unit.
    progress.update()
  lines = out.getvalue().splitlines()
  assert lines[0].endswith("about 15m00s left")  # 9 units x 100 s
  assert lines[1].endswith("about 8s left") and lines[2].endswith("about 7s left")


def test_durations_and_bad_totals():
  assert [duration(s) for s in (0.4, 42, 185, 3720)] == ["0s", "42s", "3m05s", "1h02m"]
  with pytest.raises(ValueError, match="total=0"):
    Progress(0, "job")


def test_a_terminal_gets_a_bar_with_the_time_left():
  """On a terminal with a size, a tqdm bar (elapsed<left); a bare pseudo-terminal without one gets plain lines."""
  import fcntl
  import os
  import pty
  import struct
  import subprocess
  import sys
  import termios
  from pathlib import Path

  script = "from mercury_jax.progress import Progress\nwith Progress(4, 'job', 'batches') as p:\n  p.update(4)\n"
  env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
  outputs = []
  for columns in (100, 0):
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=follower, stdout=follower, stderr=follower, env=env)
    os.close(follower)
    out = b""
    while True:
      try:
        chunk = os.read(leader, 4096)
      except OSError:  # The child closed the terminal.
        break
      if not chunk:
        break
      out += chunk
    os.close(leader)
    assert proc.wait(timeout=60) == 0
    outputs.append(out.decode())
  assert "job: 100%|" in outputs[0] and "4/4 [" in outputs[0]
  assert "job: 4/4 batches (100%)" in outputs[1] and "|" not in outputs[1]
