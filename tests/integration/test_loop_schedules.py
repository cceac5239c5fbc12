"""The loop schedules (pyruntime/stage/compute/loop_schedules.py): they add upcasts and threads to the kernels of symbolic token count
(prefill), move a batched decode step's threads from its rows to its outputs, and change no bit of any result."""
from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from tinygrad import Device, Tensor, UOp, nn
from tinygrad.codegen.opt import Opt, OptOps
from tinygrad.codegen.opt.postrange import Scheduler
from tinygrad.helpers import prod
from tinygrad.uop.ops import AxisType, Ops

from pyruntime.stage.compute import loop_schedules

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the shared helpers

# Runs in a fresh process, so that its kernels compile under the schedules PYRUNTIME_LOOP_OPTS picks: a prompt as
# one record and cut into pieces (prefill kernels), decode steps alone and batched; prints every logit's bits (hashed).
RUN = r"""
import hashlib, json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from tinymodels import TINY_FAMILIES, TINY_MODELS, write_tiny_gguf
from tinygrad.codegen.opt import heuristic
from pyruntime.stage.compute import loop_schedules
loop_schedules.MIN_WORK = 1  # the test model's kernels are small: schedule them all
from pyruntime.modelfile.gguf import read_header
from pyruntime.stage.compute.model import StageModel
from pyruntime.modelfile.plan import num_blocks
out = {"enabled": loop_schedules.ENABLED and heuristic.hand_coded_optimizations is loop_schedules.loop_optimizations}
for name in sys.argv[3:]:
 path = write_tiny_gguf(f"{sys.argv[2]}/{name}.gguf", **{**TINY_MODELS, **TINY_FAMILIES}[name])
 for decode, weights in (("reference", "quantized"), ("batched", "float32"), ("batched", "quantized")):
  m = StageModel.load(path, 0, num_blocks(read_header(path)), max_context=128, slots=3, decode=decode, weights=weights)
  h = hashlib.sha256()
  prompt = np.arange(5, 45, dtype=np.uint32)  # 40 tokens: a chunk of 32, then 8
  for slot, cuts in enumerate([[0, 40], [0, 7, 19, 40]]):
    for a, b in zip(cuts, cuts[1:]): lg = m.forward(slot, prompt[a:b], a, prefill=True).numpy()
    h.update(lg.tobytes())
    for pos in range(40, 44): h.update(m.forward(slot, np.array([int(lg.argmax()) % 97 + pos], np.uint32), pos, prefill=False).numpy().tobytes())
  if m.batched:
    m.forward(2, prompt[:11], 0, prefill=True)
    h.update(m.forward_batch([0, 2], np.array([3, 4], np.uint32), [44, 11]).numpy().tobytes())
  out[f"{name}-{decode}-{weights}"] = h.hexdigest()
print(json.dumps(out))
"""


def run(tmp_path, opts: str, names: list[str]) -> dict:
  os.makedirs(tmp_path, exist_ok=True)
  env = {**os.environ, "PYRUNTIME_LOOP_OPTS": opts}
  p = subprocess.run([sys.executable, "-c", RUN, HERE, str(tmp_path), *names], env=env, capture_output=True, text=True, timeout=400)
  assert p.returncode == 0, p.stderr[-3000:]
  return json.loads(p.stdout.strip().splitlines()[-1])


def test_schedules_change_no_bit(tmp_path):
  """Each tiny model's prompt logits (whole and cut), decode and batched decode logits, with the loop schedules off
  (tinygrad's own for its kernels, none for the rows path's) and on, each in a process of its own: equal bit for bit,
  on tinygrad's path and on the rows path (float32 weights transposed, and dequantised in the kernels). (The other families' kernels of symbolic token
  count are compared with tinygrad's in one process by tests/integration/test_model_families.py.)"""
  names = ["llama_tied"]
  with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two processes at once: much of each is clang, one thread
    stock, ours = pool.map(lambda opts: run(tmp_path / opts, opts, names), ("0", "1"))
  assert not stock.pop("enabled") and ours.pop("enabled")
  assert ours == stock


def kernels(t: Tensor) -> list[Scheduler]:
  linear, _ = t.linear_with_vars()
  asts = [u for u in linear.toposort() if u.op is Ops.SINK and u.arg is not None]
  out = []
  for ast in asts:
    k = Scheduler(ast, Device["CPU"].renderer)
    k.convert_loop_to_global()
    out.append(k)
  return out


@pytest.mark.skipif(not Device.DEFAULT.startswith("CPU"), reason="the schedules are for CPU devices")
def test_symbolic_token_kernel_gains_upcast_and_threads(monkeypatch):
  """A projection of a symbolic number of tokens: tinygrad's own opts come first and unchanged, ours add only an
  upcast and a thread split of the constant output axis (never a reduce axis)."""
  monkeypatch.setattr(loop_schedules, "MIN_WORK", 32 * 128 * 64)  # this kernel's work at 32 tokens
  lin = nn.Linear(64, 128, bias=False)
  lin.weight = Tensor(np.ones((128, 64), np.float32)).realize()
  x = Tensor(np.ones((1, 32, 64), np.float32)).realize()
  (k,) = kernels(lin(x.shrink(((0, 1), (0, UOp.variable("toks", 1, 32).bind(5)), (0, 64)))).contiguous())
  stock, ours = loop_schedules._stock(k.copy()), loop_schedules.loop_optimizations(k.copy())
  assert ours.applied_opts[:len(stock.applied_opts)] == stock.applied_opts
  added = ours.applied_opts[len(stock.applied_opts):]
  assert OptOps.UPCAST in [o.op for o in added]
  if (Device["CPU"].renderer.global_max or [1])[0] > 1: assert OptOps.THREAD in [o.op for o in added]
  assert {o.op for o in added} <= {OptOps.UPCAST, OptOps.THREAD}
  assert all(k.axis_types[o.axis] is AxisType.LOOP for o in added)  # output axes of the kernel before them
  monkeypatch.setattr(loop_schedules, "MIN_WORK", 32 * 128 * 64 + 1)  # less work than that: tinygrad's schedule
  assert loop_schedules.loop_optimizations(k.copy()).applied_opts == stock.applied_opts


def batch_matmul(rows: int) -> Scheduler:
  lin = nn.Linear(256, 512, bias=False)
  lin.weight = Tensor(np.ones((512, 256), np.float32)).realize()
  (k,) = kernels(lin(Tensor(np.ones((rows, 256), np.float32)).realize()).contiguous())
  return k


@pytest.mark.skipif(not Device.DEFAULT.startswith("CPU"), reason="the schedules are for CPU devices")
def test_batched_decode_kernel_threads_its_outputs(monkeypatch):
  """A decode step's projection for 8 rows: the rows upcast whole (each loaded weight serves all of them), tinygrad's
  reduce-axis opts (UNROLL) as it chose them, and its thread count split over the outputs instead of the rows."""
  monkeypatch.setattr(loop_schedules, "MIN_WORK", 512 * 256)
  k = batch_matmul(8)
  stock, ours = loop_schedules._stock(k.copy()), loop_schedules.loop_optimizations(k.copy())
  unrolls = [o for o in stock.applied_opts if o.op is OptOps.UNROLL]
  assert unrolls and [o for o in ours.applied_opts if o.op is OptOps.UNROLL] == unrolls
  assert {o.op for o in ours.applied_opts} <= {OptOps.UPCAST, OptOps.UNROLL, OptOps.THREAD}
  assert ours.applied_opts[0] == Opt(OptOps.UPCAST, 0, 0)  # the rows, whole
  assert prod(s for t, s in zip(ours.axis_types, ours.full_shape, strict=True) if t is AxisType.UPCAST) == 8 * 4
  threads = [o.arg for o in stock.applied_opts if o.op is OptOps.THREAD]
  assert [o.arg for o in ours.applied_opts if o.op is OptOps.THREAD] == threads
  if threads:  # the threads split the outputs: each thread's loop covers 512 / 4 / threads of them
    assert ours.full_shape[ours.axis_types.index(AxisType.LOOP)] == 512 // 4 // threads[0]
  one = batch_matmul(1)  # a single row: only the outputs' upcast and threads
  first = loop_schedules.loop_optimizations(one.copy()).applied_opts[0]
  assert first.op is OptOps.UPCAST and first.arg == 4 and one.full_shape[first.axis] == 512
  monkeypatch.setattr(loop_schedules, "MIN_WORK", 8 * 512 * 256 + 1)  # less work than that: tinygrad's schedule
  assert loop_schedules.loop_optimizations(k.copy()).applied_opts == stock.applied_opts
