"""The graph cache (pyruntime/stage/compute/graph_cache.py): a stage's captured graphs kept on disk without the weights, loaded by a
new process with the same bits, and every way a cache file can be wrong or unusable met with one named warning and a
rebuild, never a crash or a wrong token."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from tinymodels import TINY_FAMILIES, TINY_MODELS, write_tiny_gguf

from pyruntime.stage.compute import graph_cache
from pyruntime.stage.compute.graph_cache import SUFFIX, GraphCache
from pyruntime.stage.compute.rows import SHORT_ROWS

HERE = pathlib.Path(__file__).resolve().parents[1]  # tests/

# In a process of its own (as a stage is): the model's graphs through a graph cache in argv[2]; prints the logits' bits
# (hashed), how many graphs came from the cache and were saved, and the warnings.
RUN = r"""
import hashlib, json, sys
import numpy as np
from pyruntime.stage.compute.graph_cache import GraphCache
from pyruntime.modelfile.gguf import read_header
from pyruntime.stage.compute.model import StageModel
path, folder, decode, weights = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
warnings = []
gc = GraphCache(folder, warn=warnings.append)
m = StageModel.load(path, 0, read_header(path).num_blocks, max_context=128, slots=2, decode=decode, weights=weights, graph_cache=gc)
h = hashlib.sha256()
m.warm_up(every_window=False)
lg = m.forward(0, np.arange(5, 30, dtype=np.uint32), 0).numpy()
h.update(lg.tobytes())
if m.rows is not None: h.update(m.forward_batch([0], np.asarray([int(lg.argmax())], np.uint32), [25]).numpy().tobytes())
else: h.update(m.forward(0, np.asarray([int(lg.argmax())], np.uint32), 25, prefill=False).numpy().tobytes())
print(json.dumps({"bits": h.hexdigest(), **gc.stats, "warnings": warnings}))
"""


def graphs_of(decode: str, weights: str) -> int:
  """The graphs a warm-up with every_window=False makes: tinygrad's prefill and T=1 decode, or the rows path's prefill
  graph and one-row decode window, with packed weights also the short chunks' (rows.SHORT_ROWS)."""
  return 2 + len(SHORT_ROWS) * (decode == "batched" and weights == "packed")


GRAPHS = graphs_of("batched", "float32")  # what run() makes by default


def run(path, folder, decode: str = "batched", weights: str = "float32") -> dict:
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
  p = subprocess.run([sys.executable, "-c", RUN, str(path), str(folder), decode, weights], capture_output=True, text=True, timeout=600,
                     env=env)
  assert p.returncode == 0, p.stderr[-3000:]
  return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> pathlib.Path:
  return write_tiny_gguf(tmp_path_factory.mktemp("gc") / "llama.gguf", **TINY_MODELS["llama_tied"])


@pytest.mark.parametrize("decode,weights", [("batched", "float32"), ("batched", "packed"), ("batched", "quantized"), ("reference", "quantized")])
def test_a_new_process_loads_the_graphs_and_computes_the_same_bits(model, tmp_path, decode, weights):
  graphs = graphs_of(decode, weights)
  first = run(model, tmp_path, decode, weights)
  assert first["saved"] == graphs and first["loaded"] == 0 and not first["warnings"]
  files = list(tmp_path.glob("*" + SUFFIX))
  assert len(files) == graphs and all(f.stat().st_mode & 0o077 == 0 for f in files)
  # the weights are named, not copied: every one of the first block's appears by name in the prefill graph's file (as
  # dequantised once, as packed codes, or as the file's bytes the kernels dequantise)
  prefill = max(files, key=lambda f: f.stat().st_size).read_bytes()
  named = {"float32": "blk.0.{}.weight", "packed": "blk.0.{}.rows_blocked.codes"}.get(weights, "file.blk.0.{}.weight")
  # (a fused group, the rows path's q/k/v and gate/up, is one buffer: named once, by one of its members)
  groups = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"), ("attn_output",), ("ffn_down",))
  assert all(any(named.format(w).encode() in prefill for w in g) for g in groups)
  second = run(model, tmp_path, decode, weights)
  assert second["loaded"] == graphs and second["saved"] == 0 and second["bits"] == first["bits"] and not second["warnings"]


def test_moe_graphs_too(tmp_path):
  """tinygrad's own graphs of a MoE model (a router output besides the residual) round-trip as well."""
  path = write_tiny_gguf(tmp_path / "moe.gguf", **TINY_FAMILIES["qwen3moe"])
  first, second = run(path, tmp_path / "g", "reference", "quantized"), run(path, tmp_path / "g", "reference", "quantized")
  assert second["loaded"] == 2 and second["bits"] == first["bits"]


@pytest.fixture(scope="module")
def filled(model, tmp_path_factory) -> tuple[pathlib.Path, dict]:
  """A cache the model's graphs were saved to once, and what that run computed: each test below damages a copy."""
  folder = tmp_path_factory.mktemp("filled") / "g"
  return folder, run(model, folder)


def copy_of(filled: tuple[pathlib.Path, dict], tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict]:
  folder = tmp_path / "g"
  shutil.copytree(filled[0], folder)  # modes kept: the cache only reads a private directory's files
  return folder, filled[1]


def damage(victim: pathlib.Path, how: str) -> None:
  data = victim.read_bytes()
  if how == "truncated": victim.write_bytes(data[:len(data) // 2])
  elif how == "garbage": victim.write_bytes(data.split(b"\n", 1)[0] + b"\n" + os.urandom(4096))
  elif how == "other key": victim.write_bytes(json.dumps({"key": {"graph": "someone else's"}}).encode() + b"\n" + data.split(b"\n", 1)[1])
  else: victim.write_bytes(b"")


# two kinds of damage per run, each to one of the cache's files: four kinds in two processes
@pytest.mark.parametrize("kinds", [("truncated", "garbage"), ("other key", "empty")], ids="+".join)
def test_a_bad_file_is_named_removed_and_rebuilt(model, filled, tmp_path, kinds):
  folder, want = copy_of(filled, tmp_path)
  files = sorted(folder.glob("*" + SUFFIX))
  assert len(files) == GRAPHS
  victims = files[:len(kinds)]
  for victim, how in zip(victims, kinds, strict=True): damage(victim, how)
  got = run(model, folder)
  assert got["bits"] == want["bits"] and got["rebuilt"] == got["saved"] == len(kinds) and got["loaded"] == GRAPHS - len(kinds)
  assert len(got["warnings"]) == len(kinds) and all(any(v.name in w for w in got["warnings"]) for v in victims), got["warnings"]
  again = run(model, folder)  # rebuilt for good
  assert again["loaded"] == GRAPHS and again["rebuilt"] == 0 and not again["warnings"] and again["bits"] == want["bits"]


def test_a_file_others_may_write_is_not_unpickled(model, filled, tmp_path):
  folder, want = copy_of(filled, tmp_path)
  victim = sorted(folder.glob("*" + SUFFIX))[0]
  victim.chmod(0o666)
  got = run(model, folder)
  assert got["bits"] == want["bits"] and got["loaded"] == GRAPHS - 1 and any("writable by others" in w for w in got["warnings"])


def test_an_unusable_directory_means_no_cache_and_one_warning(model, tmp_path):
  (blocker := tmp_path / "file").write_text("not a directory")
  got = run(model, blocker / "graphs")
  assert got["loaded"] == got["saved"] == 0 and len(got["warnings"]) == 1 and "running without it" in got["warnings"][0]
  shared = tmp_path / "shared"
  shared.mkdir(mode=0o777)
  shared.chmod(0o777)  # writable by anyone: its files could be anyone's
  got = run(model, shared)
  assert got["saved"] == 0 and "writable by others" in got["warnings"][0]


def test_the_directory_is_capped_least_recently_used_first(tmp_path):
  gc = GraphCache(tmp_path, limit_bytes=2500)
  for i in range(4):
    (p := tmp_path / f"{i}{SUFFIX}").write_bytes(b"x" * 1000)
    os.utime(p, (1000 + i, 1000 + i))
  gc._trim()
  assert sorted(p.name for p in tmp_path.glob("*" + SUFFIX)) == [f"2{SUFFIX}", f"3{SUFFIX}"]
  assert graph_cache.clear(tmp_path.parent.parent / "nowhere") == (0, 0)


def test_warmup_fills_the_cache_and_clear_empties_it(model, tmp_path):
  env = {**os.environ, "PYRUNTIME_CACHE": str(tmp_path)}
  cmd = [sys.executable, "-m", "pyruntime.cli", "warmup", "--model", str(model), "--max-context", "128", "--max-streams", "2"]
  p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
  assert p.returncode == 0, p.stderr[-2000:]
  assert "captured and kept" in p.stdout and "preparing the prefill graph" in p.stderr
  n = len(list((tmp_path / "graphs").glob("*" + SUFFIX)))
  assert n >= 2 * 3  # 2 stages: prefill, decode windows of 1 and 2 rows
  again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
  assert again.returncode == 0 and f"0 captured and kept, {n} already in" in again.stdout
  p = subprocess.run([sys.executable, "-m", "pyruntime.cli", "warmup", "--clear"], capture_output=True, text=True, timeout=60, env=env)
  assert p.returncode == 0 and f"removed {n} cached graph files" in p.stdout
  assert not list((tmp_path / "graphs").glob("*" + SUFFIX))


# Flips `graphs` in a shared sticky folder (as /tmp is), a link another local user planted, between our own private
# cache folder (so every check by path passes) and a folder of theirs, as fast as it can until `stop` exists.
FLIP = r"""
import os, sys
shared, ours, foreign, stop = sys.argv[1:5]
graphs, tmp = os.path.join(shared, "graphs"), os.path.join(shared, ".flip")
while not os.path.exists(stop):
  for target in (ours, foreign):
    try: os.symlink(target, tmp); os.replace(tmp, graphs)
    except OSError: pass
"""


class _Planted:
  """A foreign pickle: loading it makes the folder `marker` (what a real attacker would make run is worse)."""
  def __init__(self, marker: str): self.marker = marker
  def __reduce__(self): return (os.mkdir, (self.marker,))


def test_a_flipping_symlink_never_gets_a_foreign_file_loaded(tmp_path):
  import pickle
  import time
  shared, ours, foreign = tmp_path / "shared", tmp_path / "ours", tmp_path / "foreign"
  marker, stop = tmp_path / "loaded", tmp_path / "stop"
  shared.mkdir(); shared.chmod(0o1777)
  ours.mkdir(mode=0o700)
  foreign.mkdir(); foreign.chmod(0o777)
  key = {"graph": "decode"}
  cache = GraphCache(ours)
  name, full = cache.name_for(key), {**cache.common, **key}
  head = json.dumps({"key": full}, sort_keys=True, default=str).encode() + b"\n"
  planted = head + pickle.dumps(_Planted(str(marker)))
  good = head + pickle.dumps({})   # ours, private: it passes every check by path
  (shared / "graphs").symlink_to(ours)  # planted before we ever look (else our mkdir would make a real folder there)
  flipper = subprocess.Popen([sys.executable, "-c", FLIP, str(shared), str(ours), str(foreign), str(stop)])
  loaded = refused = 0
  try:
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
      (ours / name).write_bytes(good); (ours / name).chmod(0o600)
      if not (foreign / name).exists(): (foreign / name).write_bytes(planted); (foreign / name).chmod(0o666)  # a cache may remove it
      warnings: list[str] = []
      c = GraphCache(shared / "graphs", warn=warnings.append)
      loaded += c.jit(lambda: None, key, lambda: {}).cnt == 2
      refused += any("symbolic link" in w for w in warnings)
      c.close()
      assert not marker.exists(), "a foreign pickle was loaded through a flipped link"
  finally:
    stop.touch()
    flipper.wait(10)
  assert loaded == 0 and refused > 0  # the link was met (and refused by name), and nothing foreign ever ran


def test_clear_never_follows_a_link(tmp_path):
  (target := tmp_path / "elsewhere").mkdir(mode=0o700)
  (target / f"precious{SUFFIX}").write_bytes(b"keep me")
  (root := tmp_path / "cache").mkdir(mode=0o700)
  (root / "graphs").symlink_to(target)
  with pytest.raises(PermissionError, match="symbolic link"): graph_cache.clear(root)
  assert (target / f"precious{SUFFIX}").read_bytes() == b"keep me"
  p = subprocess.run([sys.executable, "-m", "pyruntime.cli", "warmup", "--clear"], capture_output=True, text=True, timeout=60,
                     env={**os.environ, "PYRUNTIME_CACHE": str(root)})
  assert p.returncode == 1 and "refused" in p.stderr and "symbolic link" in p.stderr
  assert (target / f"precious{SUFFIX}").exists()
