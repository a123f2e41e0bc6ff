"""The shape of the house, read from the source (nothing is imported or run): the import graph has no cycle, not
between modules and not between folders (a lower layer never imports a higher one back), and the engine and the
server keep their functions short and their signatures narrow (``shared/STYLE.md``: "A function takes what it
needs")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mercury_jax"
MAX_LINES = 80  # in sampling/ and serve/
MAX_POSITIONAL = 6  # outside kernels/ (a Pallas kernel's body takes its refs positionally)


def _modules() -> dict[str, ast.Module]:
  out = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    out[name] = ast.parse(path.read_text(), str(path))
  return out


MODULES = _modules()


def _imports(name: str, tree: ast.Module) -> set[str]:
  """The package modules ``name`` imports at its top level or in functions (not under ``TYPE_CHECKING``)."""
  found = set()
  package = name if (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists() else name.rpartition(".")[0]

  def visit(node, typing_only=False):
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
      typing_only = True
    if not typing_only and isinstance(node, ast.Import):
      found.update(a.name for a in node.names if a.name.startswith("mercury_jax"))
    if not typing_only and isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
      if base.startswith("mercury_jax"):
        for alias in node.names:  # ``from pkg import module`` names a module; ``from module import name`` does not
          found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    for child in ast.iter_child_nodes(node):
      visit(child, typing_only)

  visit(tree)
  return {m for m in found if m in MODULES and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components with more than one node (Tarjan)."""
  index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

  def connect(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        connect(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in graph:
    if v not in index:
      connect(v)
  return out


def _folder(module: str) -> str:
  """A subpackage is one room (``mercury_jax.sampling``); a top-level module is its own."""
  parts = module.split(".")
  return ".".join(parts[:2])


GRAPH = {name: _imports(name, tree) for name, tree in MODULES.items() if not name.endswith("__init__")}


def test_no_module_imports_itself_through_others():
  graph = {m: {d for d in deps if not MODULES[d].body or not m.startswith(d + ".")} for m, deps in GRAPH.items()}
  assert _cycles(graph) == []


def test_no_folder_imports_a_folder_that_imports_it_back():
  folders: dict[str, set[str]] = {}
  for module, deps in GRAPH.items():
    for dep in deps:
      if _folder(dep) != _folder(module):
        folders.setdefault(_folder(module), set()).add(_folder(dep))
  assert _cycles(folders) == []


def _functions():
  for name, tree in MODULES.items():
    for node in ast.walk(tree):
      if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        yield name, node


@pytest.mark.parametrize("folder", ["mercury_jax.sampling", "mercury_jax.serve"])
def test_the_engine_and_the_server_keep_functions_under_a_screen(folder):
  long = [f"{m}.{f.name} ({f.end_lineno - f.lineno + 1} lines)" for m, f in _functions() if m.startswith(folder)]
  long = [entry for entry in long if int(entry.rsplit("(", 1)[1].split()[0]) > MAX_LINES]
  assert long == []


def test_no_function_outside_the_kernels_takes_more_than_six_positional_parameters():
  wide = []
  for module, f in _functions():
    positional = [a.arg for a in f.args.posonlyargs + f.args.args if a.arg not in ("self", "cls")]
    if len(positional) > MAX_POSITIONAL and ".kernels." not in module:
      wide.append(f"{module}.{f.name} ({len(positional)})")
  assert wide == []
