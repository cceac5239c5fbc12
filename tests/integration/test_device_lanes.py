"""The GPU path off the GPU, through real stage processes and the rings (docs/control-channel.md#devices).

- Indexed devices: two stages on `CPU:0,CPU:1` (a stage on `CUDA:1` takes the same path: DEV without the index).
- A CPU without clang (`CPU:X86`): float32 weights by default, two stages equal one.
- The CL lane: tinygrad's OpenCL backend on the CPU through PoCL, a GPU-style device (local memory, host <-> device
  copies that complete later, no buffer views): splits equal one stage and tinygrad's own model on the same device,
  the prefix cache's hit equals a cold run, speculation on equals off, a MoE and an MLA family, SmolLM2 in 2 stages.
  Each stage there keeps its weights `quantized` (launch_plan.weights_for: not a CPU) and takes the rows schedule for
  devices with local memory (loop_schedules).
- The compile lane: `NULL:i:CUDA:sm_90`, H200's architecture, kernels compiled by NVIDIA's NVRTC and never run
  (copies out return garbage: NULL_ALLOW_COPYOUT=1), with 3 stages on distinct device indices driven to a `Done`:
  completion and compiled graphs are asserted, never tokens.
Missing its device, a lane skips outside CI and fails in CI (conftest.lane_device)."""
from __future__ import annotations

import itertools
import os

import pytest
from conftest import lane_device
from test_model import fresh
from tinymodels import TINY_FAMILIES, TINY_GEMMA, TINY_MODELS, write_tiny_gguf

from pyruntime.engine.launcher import Done, Launcher
from pyruntime.stage.compute.launch_report import launches

PROMPT = "The quick brown fox jumps over the lazy dog, and the dog"
N = 8
CL = os.environ.get("PYRUNTIME_LANE_DEVICE", "CL")  # bench/gpu_check.sh runs the CL lane's tests on CUDA
SM90 = "NULL:{}:CUDA:sm_90"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  return write_tiny_gguf(tmp_path_factory.mktemp("lanes") / "llama.gguf", **TINY_MODELS["llama_tied"], context=512)


def generate(lm: Launcher, prompt: str = PROMPT, n: int = N, **kw) -> Done:
  return next(ev for ev in lm.generate(prompt, raw=True, max_tokens=n, ignore_eos=True, **kw) if isinstance(ev, Done))


def reference(path, device: str, prompt_ids: list[int], n: int) -> list[int]:
  """tinygrad's single-process model on `device`, greedy."""
  from tinygrad.helpers import Context
  from tinygrad.llm.model import Transformer
  with Context(DEV=device):
    ref, _ = Transformer.from_gguf(path, max_context=128)
    fresh(ref)
    return list(itertools.islice(ref.generate(list(prompt_ids)), n))


def devices_of(lm: Launcher) -> list[str]:
  return [ev["device"] for ev in lm.events if ev.get("event") == "WorkerReady"]


def test_two_stages_on_indexed_devices_equal_one(tiny):
  with Launcher(tiny, split=[(0, 5)], max_context=128) as one: want = generate(one)
  with Launcher(tiny, split=[(0, 2), (2, 5)], devices="CPU:0,CPU:1", max_context=128) as two:
    got = generate(two)
    assert sorted(devices_of(two)) == ["CPU:0", "CPU:1"]
  assert got.token_ids == want.token_ids and len(got.token_ids) == N


def test_a_cpu_stage_opens_no_other_backend(tiny, monkeypatch):
  """Started without DEV in the environment on a host with an OpenCL driver, a CPU stage never opens OpenCL: tinygrad's
  default device is the stage's own (stage/worker.py), not found by opening every backend in turn, which loaded PoCL
  into every CPU stage (and, on a GPU host, opened the first GPU backend that answers in every stage whose device names
  no renderer: `CUDA:1`; one that names one, `NULL:1:CUDA:sm_90`, had DEV set already, model.resolve_device)."""
  lane_device(CL)  # the OpenCL driver is here: the check below means something
  monkeypatch.delenv("DEV", raising=False)
  with Launcher(tiny, split=[(0, 2), (2, 5)], devices="CPU", max_context=128) as lm:
    generate(lm)
    for st in lm.stage_view():
      with open(f"/proc/{st['pid']}/maps") as f: libs = {line.rsplit("/", 1)[-1].strip() for line in f if ".so" in line}
      assert not any("OpenCL" in lib or "pocl" in lib for lib in libs), (st["stage"], sorted(libs))


def test_a_cpu_without_clang_answers_with_float32_weights(tiny):
  """CPU:X86 (what a machine without clang gets): auto weights are float32 there (tinygrad's x86 backend cannot run
  packed or float16 weights), and two stages equal one."""
  with Launcher(tiny, split=[(0, 5)], devices="CPU:X86", max_context=128) as one:
    want = generate(one)
    assert one.planned.weights == ["float32"]
  with Launcher(tiny, split=[(0, 2), (2, 5)], devices="CPU:X86", max_context=128) as two:
    assert generate(two).token_ids == want.token_ids and len(want.token_ids) == N


def test_cl_splits_cache_and_speculation_are_exact(tiny):
  """On CL: 1, 2 and 3 stages (the rows path, batched) give the same tokens; the 2-stage pipeline's second run of a
  prompt, served from the prefix cache, equals its cold run; the 3-stage one speculates (n-gram drafts) and equals
  the others; and decode="reference" gives tinygrad's own model's tokens on CL."""
  lane_device(CL)
  long_prompt = " ".join([PROMPT] * 4)  # a few prefix-cache blocks
  with Launcher(tiny, split=[(0, 5)], devices=CL, max_context=256) as one:
    want, want_long = generate(one), generate(one, long_prompt)
    assert one.planned.weights == ["quantized"]
  with Launcher(tiny, split=[(0, 2), (2, 5)], devices=CL, max_context=256) as two:
    assert generate(two).token_ids == want.token_ids
    cold, hit = generate(two, long_prompt), generate(two, long_prompt)
    assert hit.usage.cached_tokens > cold.usage.cached_tokens  # (the cold run finds the short prompt's blocks only)
    assert hit.token_ids == cold.token_ids == want_long.token_ids
  with Launcher(tiny, split=[(0, 1), (1, 4), (4, 5)], devices=CL, max_context=256, speculative="ngram") as three:
    assert generate(three, long_prompt).token_ids == want_long.token_ids
  with Launcher(tiny, split=[(0, 2), (2, 5)], devices=CL, max_context=256, decode="reference") as ref:
    got = generate(ref)
  assert got.token_ids == reference(tiny, CL, got.prompt_token_ids, N)


@pytest.mark.parametrize("device", [CL, SM90.format(0)])
@pytest.mark.parametrize("weights", ["float32", "quantized"])
def test_gpu_projections_share_each_sum_over_a_warp_of_threads(tiny, device, weights):
  """From the launch report: every projection kernel of a one-row decode step (the kernels that read a projection's
  weights) launches GROUP_THREADS threads for each output it computes, where each used to sum alone; a prompt chunk's
  projections share each sum over workgroups of as many threads (the same split, so the same bits: test_rows.py's
  contract tests on CL)."""
  lane_device(device)
  from tinygrad.helpers import Context, prod

  from pyruntime.stage.compute.launch_report import projections
  from pyruntime.stage.compute.loop_schedules import GROUP_THREADS, WORKGROUP_MAX
  from pyruntime.stage.compute.model import StageModel
  with Context(NULL_ALLOW_COPYOUT=1):
    m = StageModel.load(tiny, 0, 5, device=device, max_context=128, slots=2, weights=weights)
    m.warm_up(every_window=False)
  weights_read = m.projection_buffers()
  decode, prompt = (projections(launches(m.graph(g)), weights_read) for g in ("decode-1", "prefill"))
  assert len(decode) == len(prompt) >= 4 * 5 + 1  # 4 to 7 a block (fused or not), and the vocabulary's
  assert all(k.outputs and k.threads == GROUP_THREADS * k.outputs for k in decode), [(k.name, k.threads, k.outputs) for k in decode]
  assert all(prod(k.local_size) >= GROUP_THREADS for k in prompt), [(k.name, k.local_size) for k in prompt]
  # and no workgroup a device cannot launch (tinygrad checks each local dimension alone; CUDA allows 1024 threads)
  every = [k for g in ("decode-1", "prefill") for k in launches(m.graph(g))]
  assert all(prod(k.local_size) <= WORKGROUP_MAX for k in decode + prompt), [(k.name, k.local_size) for k in decode + prompt]
  assert all(prod(k.local_size) <= 1024 for k in every), [(k.name, k.local_size) for k in every if prod(k.local_size) > 1024]


def test_cl_converts_float16_as_ieee_does():
  """PoCL has no float16 arithmetic: tinygrad emulates float16 there with integer operations, which treated subnormals
  as zero (a real Q6_K file's scales are mostly subnormal: every such weight was zero on CL). With
  pyruntime/stage/compute/half_emulation.py every float16 code widens to numpy's float32, and float32 values across
  float16's subnormal and normal ranges round to numpy's float16, bit for bit."""
  lane_device(CL)
  import numpy as np
  from tinygrad import Tensor, dtypes
  codes = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
  got, want = Tensor(codes, device=CL).cast(dtypes.float32).numpy(), codes.astype(np.float32)
  assert np.array_equal(got.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)]) and np.isnan(got[np.isnan(want)]).all()
  rng = np.random.default_rng(0)
  x = np.concatenate([rng.standard_normal(1 << 16) * 2.0 ** rng.integers(-30, 15, 1 << 16), np.arange(-3000, 3000) * 2.0 ** -26]).astype(np.float32)
  got16 = Tensor(x, device=CL).cast(dtypes.float16).contiguous().numpy()
  assert np.array_equal(got16.view(np.uint16), x.astype(np.float16).view(np.uint16))


@pytest.mark.parametrize("name", ["llama_tied", "llama_kquant"])
def test_cl_float32_weights_hold_the_float16_values(tmp_path, name):
  """A float16 cast met inside one kernel rounds nothing on PoCL: the float32 mode's weights and the head's embedding
  rows are rounded through stored float16 buffers, so a CL stage holds the CPU's values bit for bit (the K-quant file's
  too: its scales are float16 subnormals), and its logits are within float32's rounding of the model's float64
  arithmetic (they were 160 times further: every weight unrounded)."""
  lane_device(CL)
  import numpy as np
  from pyruntime.bench.exactness import compare, pyruntime_logits, reference_logits, weights64

  from pyruntime.stage.compute.model import StageModel
  path = write_tiny_gguf(tmp_path / f"{name}.gguf", **TINY_MODELS[name], context=512)
  n = TINY_MODELS[name]["n_blocks"]
  cpu, cl = (StageModel.load(path, 0, n, device=d, max_context=128, slots=1, weights="float32") for d in (None, CL))
  for b1, b2 in zip(cpu.blk, cl.blk, strict=True):
    for proj in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
      a, b = getattr(b1, proj).rows_blocked.numpy(), getattr(b2, proj).rows_blocked.numpy()
      assert np.array_equal(a, a.astype(np.float16).astype(np.float32)) and np.array_equal(a.view(np.uint32), b.view(np.uint32)), proj
  tokens = list(range(3, 40))
  ref = reference_logits(*weights64(str(path)), tokens)
  got = compare(ref, pyruntime_logits(str(path), tokens, CL, weights="float32"))
  assert got["rms"] < 5e-5 * np.sqrt((ref * ref).mean()), got


def test_cl_copies_only_a_records_own_bytes(tiny):
  """On CL (no buffer views): a write at an offset lands there and keeps the rest of the buffer, and a one-row decode
  step copies its inputs' own bytes to the device, one copy each, where every write used to read the whole staging
  buffer back, patch it and write it all again."""
  lane_device(CL)
  import numpy as np
  from tinygrad import Tensor

  from pyruntime.stage.compute import device_memory
  from pyruntime.stage.compute.model import StageModel
  t = Tensor(np.arange(64, dtype=np.float32), device=CL).realize()
  device_memory.write(t.uop.buffer, np.full(4, -1, np.float32), 16 * 4)
  assert t.numpy().tolist() == [*range(16), -1, -1, -1, -1, *range(20, 64)]
  m = StageModel.load(tiny, 0, 5, device=CL, max_context=128, slots=2, weights="float32")
  m.reset_slot(0)
  m.prefill_rows(0, np.arange(8, dtype=np.uint32) + 100, 0)
  m.forward_batch([0], np.asarray([7], np.uint32), [8]).numpy()  # captures the graph
  inputs = m.rows._decode_inputs([0], np.asarray([9], np.uint32), [9], *m.rows.window([0]))
  before = dict(device_memory.copies)
  m.forward_batch([0], np.asarray([9], np.uint32), [9]).numpy()
  assert device_memory.copies["count"] - before["count"] == len(inputs)
  assert device_memory.copies["bytes"] - before["bytes"] == sum(a.nbytes for a in inputs)


@pytest.mark.parametrize("name,split", [("qwen3moe", [(0, 1), (1, 4)]), ("deepseek2", [(0, 2), (2, 4)]), ("qwen35", [(0, 1), (1, 4)])])
def test_cl_moe_mla_and_hybrid_families_equal_tinygrad(tmp_path, name, split):
  """MoE, MLA and hybrid (recurrent blocks one row per stream) pipelines on the CL lane's rows path: tinygrad's tokens."""
  lane_device(CL)
  path = write_tiny_gguf(tmp_path / f"{name}.gguf", **{**TINY_FAMILIES, "gemma3": TINY_GEMMA}[name])
  with Launcher(path, split=split, devices=CL, max_context=256) as lm: got = generate(lm, n=6)
  assert got.token_ids == reference(path, CL, got.prompt_token_ids, 6)


@pytest.mark.slow
def test_cl_smollm2_in_two_stages_answers():
  lane_device(CL)
  with Launcher(None, stages=2, devices=CL, max_context=256) as lm:
    done = next(ev for ev in lm.generate("What is the capital of France?", max_tokens=12) if isinstance(ev, Done))
  assert "Paris" in done.text, done.text


def test_sm90_compile_lane_three_stages_on_distinct_indices(tiny, monkeypatch):
  """Every graph a stage prepares (prompt chunks, each decode window, the mixed step) compiled for sm_90 by NVRTC,
  in 3 stage processes on NULL:0, NULL:1, NULL:2, then driven through the rings to a Done."""
  lane_device(SM90.format(0))
  monkeypatch.setenv("NULL_ALLOW_COPYOUT", "1")
  devs = [SM90.format(i) for i in range(3)]
  with Launcher(tiny, split=[(0, 1), (1, 3), (3, 5)], devices=",".join(devs), max_context=128, max_streams=4, warmup=True) as lm:
    done = generate(lm, n=4)
    ready = [ev for ev in lm.events if ev.get("event") == "GraphReady"]
    assert sorted(devices_of(lm)) == devs
  assert isinstance(done, Done) and done.finish_reason in ("length", "stop")
  graphs = {(ev["stage"], ev["graph"]) for ev in ready}
  for s in range(3):
    kinds = {g for st, g in graphs if st == s}
    assert "prefill" in kinds and "mixed" in kinds and {"decode-1", "decode-2", "decode-4"} <= kinds, (s, sorted(kinds))


@pytest.mark.parametrize("weights", ["quantized", "float16", "packed"])
def test_sm90_tensor_core_mode_runs_every_projection_on_tensor_cores(tiny, weights):
  """With tensor_cores on, every projection's sum of a one-row decode step and of a prompt chunk runs on sm_90's
  tensor cores (an mma.sync tile in its kernel), in each weight form; no other kernel does (attention and norms keep
  the GPU rule). The bits of the mode are the CL lane's and the CPU's to check (test_rows.py), a lent GPU's for its
  tiles (bench/gpu_check.sh)."""
  lane_device(SM90.format(0))
  from tinygrad.helpers import Context

  from pyruntime.stage.compute.model import StageModel
  with Context(NULL_ALLOW_COPYOUT=1):
    m = StageModel.load(tiny, 0, 5, device=SM90.format(0), max_context=128, slots=2, weights=weights, tensor_cores=True)
    m.warm_up(every_window=False)
  # one product per projection, or per fused group of them (q|k|v, gate|up), and the vocabulary's
  products = sum((1 if getattr(b, "rows_qkv", None) is not None else 3) + (1 if getattr(b, "rows_gate_up", None) is not None else 2) + 2
                 for b in m.blk) + 1
  for g in ("decode-1", "prefill"):
    tiles = [k.name for k in launches(m.graph(g)) if "mma.sync" in k.source]
    assert len(tiles) == products, (g, products, tiles)


@pytest.mark.parametrize("name", ["qwen3moe", "deepseek2", "qwen35", "gemma3"])
@pytest.mark.parametrize("weights", ["quantized", "float16"])
def test_sm90_compile_lane_families_and_weight_forms(tmp_path, name, weights):
  """Each family's stage (MoE, MLA and Gemma 3: every graph of the rows path, the routed experts', the latent attention's
  and the sliding window's included; a hybrid's: its decode windows and prompt chunk) and each weight form, compiled for
  sm_90 in-process; the kernels are CUDA C rendered for sm_90 and compiled to PTX by NVRTC."""
  lane_device(SM90.format(0))
  from tinygrad import Device
  from tinygrad.helpers import Context

  from pyruntime.stage.compute.model import StageModel
  path = write_tiny_gguf(tmp_path / f"{name}.gguf", **{**TINY_FAMILIES, "gemma3": TINY_GEMMA}[name])
  with Context(NULL_ALLOW_COPYOUT=1):
    # Gemma: blocks 4..6 (sliding window, global, sliding window) and the tail
    m = StageModel.load(path, *((4, 7) if name == "gemma3" else (0, 2)), device=SM90.format(1), max_context=64, slots=2, weights=weights)
    m.warm_up()
  dev = Device[m.device]
  assert m.device == "NULL:1" and type(dev.renderer).__name__ == "CUDARenderer" and dev.renderer.target.arch == "sm_90"
  if m.batched:  # the rows path: every decode window, the prompt graphs and the mixed step
    graphs = {f"decode-{w}": j for w, j in m.rows.decode_jits.items()} | {"prefill": m.rows.prefill_jit} | \
             {f"mixed-{w}": j for w, j in m.rows.mixed_jits.items()} | {f"prefill-{r}": j for r, j in m.rows.short_jits.items()}
    # (a hybrid: its decode windows and its one chunk graph, rows.RECURRENT_ROWS rows; its prompt rows beside decode
    # rows are decode rows)
    assert ({"decode-1", "decode-2"} if m.recurrent else {"decode-1", "decode-2", "prefill", "mixed-2"}) <= set(graphs), sorted(graphs)
    if m.recurrent: assert set(graphs) == {"decode-1", "decode-2", "prefill", "prefill-8", "prefill-16"} and graphs["prefill"] is None
    graphs = {k: j for k, j in graphs.items() if j is not None}
  else:
    graphs = m._graphs
    assert sorted(graphs) == ["decode", "prefill"]
  for kind, jit in graphs.items():
    ks = launches(jit)
    compiled = [k for k in ks if k.device.startswith("NULL")]  # (tinygrad computes a few scalars on the host's CPU)
    assert compiled and all("__global__" in k.source and k.cuda_sm == 90 for k in compiled), (kind, [(k.name, k.source[:120]) for k in compiled])

