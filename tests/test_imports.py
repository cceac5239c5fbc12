"""The design's layering, checked: pyruntime's modules import each other without a cycle (every import counts,
the ones inside functions too), and the planning side imports no tinygrad and no numpy."""
from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

PKG = pathlib.Path(__file__).resolve().parents[1] / "pyruntime"
COMPILED = {"pyruntime._ring", "pyruntime._ringfast"}  # C extensions built from native/: they import nothing of ours


def _modules() -> dict[str, pathlib.Path]:
  return {("pyruntime" if p.stem == "__init__" else f"pyruntime.{p.stem}"): p for p in PKG.glob("*.py")}


def import_graph() -> dict[str, set[str]]:
  """module -> the pyruntime modules it imports, anywhere in its body."""
  mods = _modules()
  modules = set(mods) | COMPILED
  graph: dict[str, set[str]] = {m: set() for m in mods}
  for mod, path in mods.items():
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import): names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = "pyruntime" + (f".{node.module}" if node.module else "") if node.level else (node.module or "")
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
      else: continue
      graph[mod] |= {n for n in names if n in mods and n != mod}
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  def visit(m: str, path: list[str]) -> list[str] | None:
    state[m] = 1
    for n in sorted(graph[m]):
      if state.get(n) == 1: return path[path.index(n):] + [m, n] if n in path else [m, n]
      if n not in state and (c := visit(n, path + [m])): return c
    state[m] = 2
    return None
  for m in sorted(graph):
    if m not in state and (c := visit(m, [])): return c
  return None


def test_the_graph_sees_imports_in_functions():
  g = import_graph()
  assert "pyruntime.server" in g["pyruntime.cli"]          # cmd_serve's lazy import
  assert "pyruntime.plan" in g["pyruntime.launch_plan"]    # plan_launch's
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None and find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
  assert (c := find_cycle(import_graph())) is None, " -> ".join(c)


def test_importing_the_launcher_loads_no_tinygrad_or_numpy():
  code = "import sys, pyruntime.launcher; from pyruntime.launcher import Launcher; import pyruntime.plan, pyruntime.params, pyruntime.gguf\n" \
         "import pyruntime.launch_plan, pyruntime.driver, pyruntime.request, pyruntime.stage_pool\n" \
         "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tinygrad', 'numpy')))"
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PKG.parent), os.environ.get("PYTHONPATH", "")]))
  r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
  assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
