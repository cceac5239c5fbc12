"""Planning from the header alone (pyruntime/modelfile/plan.py): splits, and that planning never imports tinygrad."""
from __future__ import annotations

import math
import os
import pathlib
import subprocess
import sys

import pytest
from tinymodels import TINY_MODELS, write_tiny_gguf, write_unsupported_gguf

from pyruntime import errors
from pyruntime.modelfile.gguf import read_header
from pyruntime.modelfile.plan import check_architecture, check_split, model_weight_bytes, parse_split, plan_split, stage_weight_bytes, suggest_split

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> pathlib.Path:
  return write_tiny_gguf(tmp_path_factory.mktemp("plan") / "qwen3.gguf", **TINY_MODELS["qwen3"])


def test_suggest_split_covers_every_block(qwen3):
  h = read_header(qwen3)
  for n in (1, 2, 3, 5):
    for by in ("memory", "compute", "time", "time-float32"):
      r = suggest_split(h, n, by)
      assert len(r) == n and r[0][0] == 0 and r[-1][1] == 5 and all(a < b for a, b in r)
      assert all(r[i][1] == r[i + 1][0] for i in range(n - 1))
  with pytest.raises(errors.LayerRangeInvalid): suggest_split(h, 6)
  with pytest.raises(errors.LayerRangeInvalid): suggest_split(h, 0)


def test_the_default_split_balances_a_decode_steps_reads(tmp_path):
  """By time, a stage costs the bytes a decode step reads of its weights: stored bytes (of routed experts the share a
  token uses), or 4 a parameter for float32 weights; the tail's output projection counts."""
  from tinymodels import TINY_FAMILIES

  from pyruntime.modelfile.plan import block_tensor_names, output_tensor_name, tensor_cost
  moe = read_header(write_tiny_gguf(tmp_path / "moe.gguf", **TINY_FAMILIES["qwen3moe"]))
  names = block_tensor_names(moe, 1)
  exps = [n for n in names if "_exps." in n]
  assert exps and tensor_cost(moe, names, "time") < tensor_cost(moe, names, "memory")  # only the used experts are read
  used, experts = moe.get("expert_used_count"), moe.get("expert_count")
  assert tensor_cost(moe, exps, "time") == sum(moe.tensors[n].nbytes * used // experts for n in exps)
  assert tensor_cost(moe, names, "time-float32") == 4 * tensor_cost(moe, names, "compute")
  out = [output_tensor_name(moe)]
  assert tensor_cost(moe, out, "time-float32") == 4 * math.prod(moe.tensors[out[0]].dims)
  for by in ("time", "time-float32"):
    r = plan_split(moe, 2, by=by)
    assert r == suggest_split(moe, 2, by) and len(r) == 2


def test_stage_bytes_add_up(qwen3):
  h = read_header(qwen3)
  split = suggest_split(h, 2)
  # every tensor but the head's host-side embedding is on exactly one stage (tied: the tail holds it as the output)
  assert sum(stage_weight_bytes(h, s, e) for s, e in split) <= model_weight_bytes(h)


@pytest.mark.parametrize("split", [[], [(0, 2), (3, 5)], [(0, 2), (1, 5)], [(0, 0), (0, 5)], [(0, 4)], [(0, 6)]])
def test_check_split_refuses(split):
  with pytest.raises(errors.LayerRangeInvalid): check_split(split, 5)


def test_plan_split(qwen3):
  h = read_header(qwen3)
  assert plan_split(h, 2) == suggest_split(h, 2)
  assert plan_split(h, 2, parse_split("0:1,1:5")) == [(0, 1), (1, 5)]
  with pytest.raises(errors.LayerRangeInvalid): plan_split(h, 2, [(0, 1), (1, 4)])
  with pytest.raises(errors.InvalidOption): parse_split("0-1")


def test_unsupported_architecture_is_named(tmp_path):
  with pytest.raises(errors.UnsupportedArchitecture): check_architecture(read_header(write_unsupported_gguf(tmp_path / "moe.gguf")))


_PLAN_SCRIPT = """
import sys
from pyruntime.engine.launcher import Launcher
lm = Launcher(sys.argv[1], stages=2)
lm.plan()
print(lm.split, lm.devices)
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("tinygrad", "numpy"))
assert not bad, bad
"""


def test_launcher_plans_without_tinygrad_or_numpy(qwen3):
  """The launcher process reads the header, plans the split and sizes the rings without the compute stack."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
  r = subprocess.run([sys.executable, "-c", _PLAN_SCRIPT, str(qwen3)], env=env, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "[(0, 2), (2, 5)]" in r.stdout or "[(0, 3), (3, 5)]" in r.stdout


def test_the_docs_support_table_is_the_codes():
  """docs/stage-ownership.md shows modelfile.plan.support_table() as the code makes it: architectures, where each runs,
  tokenizer models, tensor types read and packed."""
  from pyruntime.modelfile.plan import support_table
  text = (pathlib.Path(__file__).parents[2] / "docs" / "stage-ownership.md").read_text()
  shown = text.split("<!-- support-table -->\n", 1)[1].split("\n<!-- /support-table -->", 1)[0]
  assert shown == support_table()
