"""The documentation: the site builds in strict mode (a broken link, anchor or missing page fails it), the commands
the pages show use real flags and the quick ones run as written, and the reference tables (request fields, flags,
metrics, benchmarks, presets) name everything the code has. The JSON Schema coverage page is generated from the
compiler's own table and checked by tests/test_schema_coverage.py."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_site_builds_in_strict_mode(tmp_path):
  pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
  env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
  run = subprocess.run(
    [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=240,
  )
  assert run.returncode == 0, run.stdout + run.stderr
  assert (tmp_path / "site" / "structured-output" / "index.html").exists()
  assert (tmp_path / "site" / "api" / "sampling" / "index.html").exists()


# Pages whose commands are checked: the README and the docs' task pages (the results pages quote past runs).
COMMAND_PAGES = [ROOT / "README.md"] + [
  ROOT / "docs" / name
  for name in (
    "index.md",
    "install.md",
    "training.md",
    "sampling.md",
    "structured-output.md",
    "server.md",
    "checkpoints.md",
    "long-context.md",
    "multihost.md",
    "benchmarks.md",
  )
]
# README commands that run as written here: quick, on the bundled models, no data or checkpoint of their own.
RUN_AS_WRITTEN = [
  "python -m mercury_jax.sample --prompt 'def fibonacci(n):'",
  "python -m mercury_jax.sample --prompt 'date: ' --length 12 --regex '[0-9]{4}-[0-9]{2}-[0-9]{2}'",
  "python -m mercury_jax.bench --help",
]


def shell_commands(text: str) -> list[str]:
  """The commands of a page: lines of its ``bash`` code blocks and of its indented blocks, continuations joined."""
  lines, fence = [], None
  for line in text.splitlines():
    if line.startswith("```"):
      fence = line[3:].strip() if fence is None else None
      continue
    if fence == "bash" or (fence is None and line.startswith("    ") and not line.lstrip().startswith(("-", "|"))):
      lines.append(line.strip())
  commands, current = [], ""
  for line in lines:
    current += line
    if current.endswith("\\"):
      current = current[:-1] + " "
      continue
    current = re.sub(r"\s+# .*$", "", current)  # a trailing comment
    if current:
      commands.append(current)
    current = ""
  return commands


def _module_command(command: str) -> tuple[list[str], list[str]] | None:
  """(the ``python -m mercury_jax...`` prefix with its subcommand, the flags) of a command, or None."""
  import shlex

  words = shlex.split(command, comments=True)
  if "--" in words:  # a launcher's own arguments, then the command it runs
    words = words[words.index("--") + 1 :]
  if words[:1] == ["srun"]:
    words = words[1:]
  if words[:2] != ["python", "-m"] or not words[2].startswith("mercury_jax"):
    return None
  prefix = words[:3]
  if words[2] == "mercury_jax.bench" and len(words) > 3 and not words[3].startswith("-"):
    prefix.append(words[3])
  flags = [w.split("=", 1)[0] for w in words[len(prefix) :] if w.startswith("--")]
  return prefix, flags


def test_pages_show_commands():
  commands = shell_commands((ROOT / "README.md").read_text())
  for command in RUN_AS_WRITTEN:
    assert command in commands, command
  modules = {tuple(c[0]) for c in filter(None, map(_module_command, commands))}
  for module in ("sample", "train", "prepare", "evaluate", "bench", "serve", "convert"):
    assert ("python", "-m", f"mercury_jax.{module}") in modules, module


SERVE, BENCH = ("python", "-m", "mercury_jax.serve"), ("python", "-m", "mercury_jax.bench")


@pytest.fixture(scope="module")
def page_flags() -> dict[tuple[str, ...], set[tuple[str, str]]]:
  """``python -m mercury_jax...`` prefix (with a bench subcommand) -> the (page, flag) pairs the pages use with it;
  asserts on the way that every launch script a command names exists."""
  wanted: dict[tuple[str, ...], set[tuple[str, str]]] = {SERVE: set(), BENCH: set()}
  for page in COMMAND_PAGES:
    for command in shell_commands(page.read_text()):
      for word in command.split():
        if word.startswith("launch/"):
          assert (ROOT / word).is_file(), f"{page.name}: {word}"
      parsed = _module_command(command)
      if parsed:
        wanted.setdefault(tuple(parsed[0]), set()).update((page.name, flag) for flag in parsed[1])
  return wanted


@pytest.fixture(scope="module")
def helps(page_flags) -> dict[tuple[str, ...], str]:
  return _helps(sorted(page_flags))


def test_page_commands_name_real_flags(page_flags, helps):
  """Every ``python -m mercury_jax...`` command on the pages uses flags its ``--help`` lists."""
  missing = []
  for prefix, out in helps.items():
    known = set(re.findall(r"--[a-z0-9][a-z0-9-]*", out))
    missing += [f"{page}: {' '.join(prefix)} {flag}" for page, flag in sorted(page_flags[prefix]) if flag not in known]
  assert not missing, "flags the commands' --help does not list:\n" + "\n".join(missing)


_HELP_SCRIPT = """
import contextlib, io, json, runpy, sys
out = {}
for words in json.loads(sys.argv[1]):
  sys.argv = [words[0], *words[1:], "--help"]
  text = io.StringIO()
  with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
    try:
      runpy.run_module(words[0], run_name="__main__", alter_sys=True)
    except SystemExit as e:
      code = e.code
  out[" ".join(words)] = (code, text.getvalue())
print(json.dumps(out))
"""


def _helps(prefixes: list[tuple[str, ...]]) -> dict[tuple[str, ...], str]:
  """Each command's ``--help`` text, all printed by one Python process (JAX is imported once)."""
  import json

  modules = [list(prefix[2:]) for prefix in prefixes]
  run = subprocess.run(
    [sys.executable, "-c", _HELP_SCRIPT, json.dumps(modules)], cwd=ROOT, capture_output=True, text=True, timeout=240
  )
  assert run.returncode == 0, run.stderr
  helps = json.loads(run.stdout.strip().splitlines()[-1])
  result = {}
  for prefix in prefixes:
    code, text = helps[" ".join(prefix[2:])]
    assert code == 0, f"{' '.join(prefix)} --help exited {code}: {text}"
    result[prefix] = text
  return result


def test_readme_quick_commands_run_as_written():
  """The quick README commands, run at once (each is mostly compilation on one core)."""
  runs = {
    command: subprocess.Popen(
      command, shell=True, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    for command in RUN_AS_WRITTEN
  }
  for command, proc in runs.items():
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0 and out.strip(), f"{command}: {out}"


def _bundled_sample_commands() -> list[str]:
  """Every ``sample`` command of the pages that needs nothing but the bundled models, once each."""
  commands = [c for page in COMMAND_PAGES for c in shell_commands(page.read_text())]
  quick = [c for c in commands if c.startswith("python -m mercury_jax.sample ") and "--checkpoint" not in c]
  return list(dict.fromkeys(c for c in quick if "--prompts-file" not in c))


def test_the_quick_commands_are_the_bundled_models_samples():
  assert set(RUN_AS_WRITTEN) - {"python -m mercury_jax.bench --help"} <= set(_bundled_sample_commands())


@pytest.mark.slow
@pytest.mark.parametrize("command", _bundled_sample_commands())
def test_every_bundled_sample_command_runs_as_written(command):
  """``pytest -m slow``: the pages' other sample commands on the bundled models, each as written."""
  run = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0 and run.stdout.strip(), run.stdout + run.stderr


def test_readme_python_example_runs():
  text = (ROOT / "README.md").read_text()
  example = text.split("```python\n", 1)[1].split("```", 1)[0]
  run = subprocess.run([sys.executable, "-c", example], cwd=ROOT, capture_output=True, text=True, timeout=240)
  assert run.returncode == 0, run.stdout + run.stderr
  assert run.stdout.startswith("def fibonacci(n):") or run.stdout.strip()


def test_server_page_lists_every_request_field_and_flag(helps):
  """The server page's tables name every field the request models accept, every flag of the command and every
  metric it exports."""
  from mercury_jax.serve import protocol

  text = (ROOT / "docs" / "server.md").read_text()
  fields_table = text.split("## Request fields", 1)[1].split("\n## ", 1)[0]
  named = set(re.findall(r"`([a-z_.]+)`", fields_table))
  models = (protocol.CompletionRequest, protocol.ChatRequest)
  fields = {f.alias or name for model in models for name, f in model.model_fields.items()}
  assert fields - named == set(), "request fields missing from docs/server.md's table"
  flags_table = text.split("## Flags", 1)[1].split("\n## ", 1)[0]
  help_text = helps[SERVE]
  flags = set(re.findall(r"--[a-z0-9][a-z0-9-]*", help_text)) - {"--help"}
  assert flags - set(re.findall(r"`(--[a-z0-9-]+)`", flags_table)) == set(), "flags missing from the flags table"
  metrics_table = text.split("### Metrics", 1)[1].split("\n## ", 1)[0]
  exported = set(re.findall(r'"(mercury_[a-z_]+)"', (ROOT / "mercury_jax" / "serve" / "metrics.py").read_text()))
  assert len(exported) > 20 and exported - set(re.findall(r"`(mercury_[a-z_]+)`", metrics_table)) == set()


def test_benchmarks_page_lists_every_command(helps):
  help_text = helps[BENCH]
  commands = set(re.findall(r"^  ([a-z][a-z0-9-]+)  ", help_text, flags=re.M))
  table = (ROOT / "docs" / "benchmarks.md").read_text().split("| command |", 1)[1].split("\n\n", 1)[0]
  assert len(commands) > 10 and commands - set(re.findall(r"`([a-z0-9-]+)`", table)) == set()


def test_readme_links_resolve():
  text = (ROOT / "README.md").read_text()
  links = [link.split("#")[0] for link in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in link]
  assert links and [link for link in links if not (ROOT / link).exists()] == []


def test_training_page_lists_every_preset():
  table = (ROOT / "docs" / "training.md").read_text().split("| preset |", 1)[1].split("\n\n", 1)[0]
  listed = set(re.findall(r"^\| `([a-z0-9_]+)`", table, flags=re.M)) | set(re.findall(r", `([a-z0-9_]+)` \|", table))
  assert {p.stem for p in (ROOT / "configs").glob("*.toml")} - listed == set()


def _page_python_examples() -> list[str]:
  """The pages' Python examples that run on the bundled models alone (not the HTTP clients' examples)."""
  blocks = [b.split("```", 1)[0] for page in COMMAND_PAGES for b in page.read_text().split("```python\n")[1:]]
  return [b for b in blocks if b.startswith("from mercury_jax") and "client" not in b]


@pytest.mark.slow
@pytest.mark.parametrize("example", _page_python_examples())
def test_every_page_python_example_runs(example):
  """``pytest -m slow``: the pages' self-contained Python examples, each as written."""
  run = subprocess.run([sys.executable, "-c", example], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0 and run.stdout.strip(), run.stdout + run.stderr
