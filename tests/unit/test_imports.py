"""The design's layering, checked: pyruntime's modules import each other without a cycle (every import counts,
the ones inside functions too), each folder imports only the layers docs/architecture.md allows it, and the planning
side imports no tinygrad and no numpy."""
from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

PKG = pathlib.Path(__file__).resolve().parents[2] / "pyruntime"
COMPILED = {"pyruntime._ring", "pyruntime._ringfast"}  # C extensions built from native/: they import nothing of ours


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for p in PKG.rglob("*.py"):
    parts = p.relative_to(PKG.parent).with_suffix("").parts
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
  return out


# What each folder may import besides itself (docs/architecture.md). The package's root modules are its contracts
# (errors, options, params, protocol, devices), which import only each other; pyruntime/__init__.py, __main__.py and
# launcher.py are the public face, over the engine and the CLI.
CONTRACTS = "contracts"
LAYERS = {
  CONTRACTS: set(),
  "transport": {CONTRACTS},
  "modelfile": {CONTRACTS},
  "text": {CONTRACTS, "modelfile"},
  "stage": {CONTRACTS, "transport", "modelfile", "text"},
  "engine": {CONTRACTS, "transport", "modelfile", "text"},
  "serving": {CONTRACTS, "text", "engine"},
  "cli": {CONTRACTS, "transport", "modelfile", "text", "stage", "engine", "serving"},
  "face": {CONTRACTS, "engine", "cli"},
}
FACE = {"pyruntime", "pyruntime.__main__", "pyruntime.launcher"}


def layer_of(module: str) -> str:
  if module in FACE: return "face"
  parts = module.split(".")
  return parts[1] if len(parts) > 2 or (PKG / parts[-1]).is_dir() else CONTRACTS


def import_graph() -> dict[str, set[str]]:
  """module -> the pyruntime modules it imports, anywhere in its body."""
  mods = _modules()
  modules = set(mods) | COMPILED
  graph: dict[str, set[str]] = {m: set() for m in mods}
  for mod, path in mods.items():
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import): names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]  # the package a relative import starts in
        pkg = ".".join(here[:len(here) - node.level + 1])
        base = pkg + (f".{node.module}" if node.module else "") if node.level else (node.module or "")
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
  assert "pyruntime.serving.server" in g["pyruntime.cli.commands"]  # cmd_serve's lazy import
  assert "pyruntime.modelfile.plan" in g["pyruntime.engine.launch_plan"]    # plan_launch's
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None and find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
  assert (c := find_cycle(import_graph())) is None, " -> ".join(c)


def test_every_module_is_in_a_layer_and_imports_only_what_its_layer_may():
  g = import_graph()
  assert {layer_of(m) for m in g} == set(LAYERS), sorted({layer_of(m) for m in g} ^ set(LAYERS))
  wrong = [f"{m} ({layer_of(m)}) imports {n} ({layer_of(n)})" for m in sorted(g) for n in sorted(g[m])
           if layer_of(n) != layer_of(m) and layer_of(n) not in LAYERS[layer_of(m)]]
  assert not wrong, "\n".join(wrong)


def test_the_stage_and_the_engine_never_import_each_other():
  """They meet only through the rings and the control channel: a stage process runs without the launcher's code, and
  the launcher without tinygrad."""
  assert "engine" not in LAYERS["stage"] and "stage" not in LAYERS["engine"]
  g = import_graph()
  assert "pyruntime.stage.worker" in g["pyruntime.stage.__main__"] and "pyruntime.engine.launcher" in g["pyruntime.launcher"]


def test_the_stages_compute_never_imports_its_process():
  """pyruntime/stage/compute/ runs on the device and knows nothing of the worker, its data loop or its scheduler (the
  process drives the compute, never the other way): a model can be loaded and run in a test or a benchmark alone."""
  g = import_graph()
  compute = [m for m in g if m.startswith("pyruntime.stage.compute.")]
  assert {"pyruntime.stage.compute.model", "pyruntime.stage.compute.rows", "pyruntime.stage.compute.loop_schedules"} <= set(compute)
  wrong = {m: sorted(d) for m in compute if (d := {x for x in g[m] if x.startswith("pyruntime.stage.") and ".compute" not in x})}
  assert not wrong, wrong


def test_importing_the_launcher_loads_no_tinygrad_or_numpy():
  code = "import sys, pyruntime.launcher; from pyruntime.launcher import Launcher; import pyruntime.modelfile.plan, pyruntime.params\n" \
         "import pyruntime.modelfile.gguf\n" \
         "import pyruntime.engine.launch_plan, pyruntime.engine.driver, pyruntime.engine.request, pyruntime.engine.stage_pool\n" \
         "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tinygrad', 'numpy')))"
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PKG.parent), os.environ.get("PYTHONPATH", "")]))
  r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
  assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
