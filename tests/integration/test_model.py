"""The stage compute (pyruntime/stage/compute/model.py): split runs equal tinygrad's own single-process Transformer exactly.

The reference is `tinygrad.llm.model.Transformer.from_gguf(path, max_context=...)` + `.generate(tokens)` on the same
file, device and dtype. A split run chains StageModel.forward head -> ... -> tail, passing the residual through numpy
as the rings will, and picks the argmax of the tail's logits.
"""
from __future__ import annotations

import itertools
import os
import pathlib
import subprocess
import sys
import time
from typing import Callable

import numpy as np
import pytest
from conftest import stage_graphs
from tinygrad import Tensor, UOp, dtypes
from tinygrad.llm.model import Transformer
from tinymodels import TINY_MODELS, write_tiny_gguf, write_unsupported_gguf

from pyruntime import errors
from pyruntime.modelfile.boundary import Boundary, StageBoundary
from pyruntime.modelfile.gguf import read_header
from pyruntime.modelfile.plan import stage_weight_bytes, suggest_split
from pyruntime.stage.compute.model import PREFILL_CHUNK, StageModel
from pyruntime.stage.compute.sampling import Sampler

CTX = 128
PROMPT = list(range(5, 45))  # 40 tokens: the prefill runs as two chunks (32 + 8)
PROMPT2 = [7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43]
NEW = 16


# --- helpers -----------------------------------------------------------------------------------
def fresh(ref: Transformer) -> Transformer:
  """The reference as for a new conversation: no prefix reuse, and recurrent state zeroed (generate zeroes it only when
  a prompt diverges from its cached tokens, which an emptied cache never does)."""
  ref._cached_tokens = []
  if resets := [r for b in ref.blk for r in b._state_reset_ops()]: Tensor.realize(*resets)
  return ref


def reference_tokens(ref: Transformer, prompt: list[int], n: int, times: list | None = None) -> list[int]:
  fresh(ref)  # no prefix reuse between prompts
  out = []
  for t in itertools.islice(ref.generate(list(prompt)), n):
    out.append(t)
    if times is not None: times.append(time.perf_counter())
  return out


def decode_rate(times: list[float], skip: int = 2) -> float:
  """Tokens per second over the decode steps after `skip` warm-up steps."""
  return (len(times) - 1 - skip) / (times[-1] - times[skip])


def reference_logits(ref: Transformer, tokens: list[int], prompt_len: int, steps: int) -> list[np.ndarray]:
  """The reference model's logits (pre-sampling) for the prefill and the first `steps - 1` decode steps, computed with
  its own modules exactly as `forward` does (same chunking, same symbolic variables), without its argmax."""
  fresh(ref)
  chunk = 1 if ref.has_recurrent_block else PREFILL_CHUNK  # generate's one-token prefill for recurrent models
  v_sp, v_toks = UOp.variable("start_pos", 0, ref.max_context - 1), UOp.variable("toks", 1, chunk)
  t = Tensor(tokens + [0] * (ref.max_context - len(tokens)), dtype="int32").reshape(1, ref.max_context)
  def run(x: Tensor, sp) -> np.ndarray:
    h = ref.token_embd(x).float()
    for b in ref.blk: h = b(h, sp)
    return ref.output(ref.output_norm(h))[:, -1, :].contiguous().realize().numpy().reshape(-1)
  out, pos = [], 0
  while pos < prompt_len:
    nt = min(chunk, prompt_len - pos)
    sp, tk = v_sp.bind(pos), v_toks.bind(nt)
    lg = run(t[:, sp:sp + tk], sp)
    pos += nt
  out.append(lg)
  for _ in range(steps - 1):
    out.append(run(Tensor([[tokens[pos]]], dtype="int32"), v_sp.bind(pos)))
    pos += 1
  return out


def chain(stages: list[StageModel], prompt: list[int], n: int, slot: int = 0, logits: list | None = None,
          times: list | None = None, sampler: Sampler | None = None, piece: int | None = None) -> list[int]:
  """Greedy generation through the stages, the residual crossing each cut as a numpy array (as on a ring). `piece`:
  the prompt goes in as records of that many tokens (as a stage cuts it beside decoding streams), else as one."""
  for s in stages: s.reset_slot(slot)

  def through(x: np.ndarray, pos: int, prefill: bool):
    h = x
    for s in stages:
      r = s.forward(slot, h, pos, prefill=prefill)
      if s.is_tail: return r
      h = np.empty((len(x), s.dim), dtype=np.float32 if s.boundary_dtype == "float32" else np.float16)
      s.output_into(r, memoryview(h))
  x, pos, out = np.asarray(prompt, dtype=np.uint32), 0, []
  while len(x) - pos > (piece or len(x)):  # all but the last piece
    through(x[pos:pos + piece], pos, True)
    pos += piece
  x = x[pos:]
  while len(out) < n:
    r = through(x, pos, pos < len(prompt))
    if sampler is not None: out.append(sampler.sample(r, list(prompt) + out))  # greedy on the device
    else:
      lg = r.numpy()
      if logits is not None: logits.append(lg)
      out.append(int(lg.argmax()))
    if times is not None: times.append(time.perf_counter())
    pos += len(x)
    x = np.asarray([out[-1]], dtype=np.uint32)
  return out


def load_split(path, ranges, **kw) -> list[StageModel]:
  """The stages of a split; tinygrad's own kernels (decode="reference") unless `decode` says otherwise. Their graphs
  come from the tests' graph cache when an earlier test captured the same configuration (conftest.stage_graphs)."""
  ctx, kw = kw.pop("max_context", CTX), {"decode": "reference", "graph_cache": stage_graphs(), **kw}
  return [StageModel.load(path, a, b, max_context=ctx, **kw) for a, b in ranges]


def bits(a: np.ndarray) -> np.ndarray: return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


# --- tiny models: exactness --------------------------------------------------------------------
SPLITS = {  # 1, 2 and 3 stages, even and uneven
  "llama_tied": [[(0, 5)], [(0, 2), (2, 5)], [(0, 1), (1, 4), (4, 5)]],
  "llama_untied": [[(0, 2), (2, 4)], [(0, 1), (1, 2), (2, 4)]],
  "qwen2": [[(0, 3), (3, 4)]],
  "qwen3": [[(0, 1), (1, 5)], [(0, 2), (2, 3), (3, 5)]],
}


def write_models(folder: pathlib.Path, models: dict[str, dict]) -> dict[str, pathlib.Path]:
  return {name: write_tiny_gguf(folder / f"{name}.gguf", **kw) for name, kw in models.items()}


def reference_runs(paths: dict[str, pathlib.Path], steps: Callable[[str], int],
                   prompt_of: Callable[[str], list[int]] = lambda name: PROMPT) -> dict[str, dict]:
  """Per model: tinygrad's model, its prompt (PROMPT unless `prompt_of` says), its tokens, and its logits for the
  prefill and the first steps(name) - 1 decode steps."""
  out = {}
  for name, path in paths.items():
    ref, _ = Transformer.from_gguf(path, max_context=CTX)
    prompt = prompt_of(name)
    toks = reference_tokens(ref, prompt, NEW)
    out[name] = {"ref": ref, "prompt": prompt, "tokens": toks, "logits": reference_logits(ref, prompt + toks, len(prompt), steps(name))}
  return out


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory) -> dict[str, pathlib.Path]: return write_models(tmp_path_factory.mktemp("tiny"), TINY_MODELS)


@pytest.fixture(scope="module")
def tiny_refs(tiny_paths) -> dict[str, dict]:
  # the prefill, and a T=1 decode step where it matters most
  return reference_runs({name: tiny_paths[name] for name in SPLITS}, lambda name: 2 if name in ("llama_tied", "qwen3") else 1)


@pytest.mark.parametrize("name,ranges", [(n, r) for n, rs in SPLITS.items() for r in rs],
                         ids=[f"{n}-{'|'.join(f'{a}:{b}' for a, b in r)}" for n, rs in SPLITS.items() for r in rs])
def test_split_equals_reference(name, ranges, tiny_paths, tiny_refs):
  want = tiny_refs[name]
  stages = load_split(tiny_paths[name], ranges)
  logits: list[np.ndarray] = []
  got = chain(stages, PROMPT, NEW, logits=logits)
  assert got == want["tokens"], f"{name} split {ranges}: {got} != reference {want['tokens']}"
  for i, (a, b) in enumerate(zip(logits, want["logits"], strict=False)):
    assert np.array_equal(bits(a), bits(b)), f"step {i}: tail logits differ from the reference (max |d| {np.abs(a - b).max()})"
  # the stages hold only their own tensors
  header = read_header(tiny_paths[name])
  for s in stages: assert s.resident_bytes == stage_weight_bytes(header, s.start, s.end)


@pytest.mark.parametrize("name", ["llama_tied", "qwen3"])
def test_where_the_prompt_is_cut_changes_no_bit(name, tiny_paths, tiny_refs):
  """A stage sizes prefill chunks by load (1 to 32 tokens, `StageScheduler.prefill_size`), so the prompt's cut must not matter:
  pieces of 1, 5, 13 and 31 tokens, aligned to nothing, give the reference's tokens and logits bit for bit (every chunk
  runs the same symbolic-T kernels; a row's reductions do not depend on the chunk's length)."""
  want = tiny_refs[name]
  stages = load_split(tiny_paths[name], SPLITS[name][-1])
  for piece in (1, 5, 13, 31):
    logits: list[np.ndarray] = []
    assert chain(stages, PROMPT, len(want["logits"]), logits=logits, piece=piece) == want["tokens"][:len(want["logits"])]
    for i, (a, b) in enumerate(zip(logits, want["logits"], strict=True)):
      assert np.array_equal(bits(a), bits(b)), f"pieces of {piece}, step {i}: max |d| {np.abs(a - b).max()}"


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_head_embedding_rows_are_bit_exact(name, tiny_paths):
  """The head gathers raw GGML rows from the file on the host and dequantises them on the device: every row of every
  embedding type (Q8_0, Q4_0 with its -0.0 entries, Q4_1, F16) equals the reference's token_embd(ids).float()."""
  path = tiny_paths[name]
  ref, _ = Transformer.from_gguf(path, max_context=CTX)
  head = StageModel.load(path, 0, 1, max_context=CTX)
  ids = np.arange(head.vocab_size, dtype=np.uint32)
  for s in range(0, len(ids), PREFILL_CHUNK):
    chunk = ids[s:s + PREFILL_CHUNK]
    head._stage_chunk(chunk, 0, len(chunk))
    mine = head._embed(head._stage_in, len(chunk)).numpy()
    want = ref.token_embd(Tensor(chunk.astype(np.int32).reshape(1, -1))).float().numpy()
    assert np.array_equal(bits(mine), bits(want)), f"{name}: embedding rows {s}..{s + len(chunk)} differ"


def test_slots_are_independent_streams(tiny_paths, tiny_refs):
  """Two streams interleaved on slots 0 and 1 of the same stages each equal their own unsplit run."""
  path, want1 = tiny_paths["llama_tied"], tiny_refs["llama_tied"]["tokens"]
  want2 = reference_tokens(tiny_refs["llama_tied"]["ref"], PROMPT2, NEW)
  stages = load_split(path, [(0, 3), (3, 5)], slots=2)
  streams = {0: (list(PROMPT), []), 1: (list(PROMPT2), [])}
  pos = {0: 0, 1: 0}
  while any(len(o) < NEW for _, o in streams.values()):
    for slot, (prompt, out) in streams.items():
      x = np.asarray(prompt if not out else out[-1:], dtype=np.uint32)
      h = stages[0].forward(slot, x, pos[slot])
      h2 = np.empty((len(x), stages[0].dim), np.float32)
      stages[0].output_into(h, memoryview(h2))
      out.append(int(stages[1].forward(slot, h2, pos[slot]).numpy().argmax()))
      pos[slot] += len(x)
  assert streams[0][1] == want1 and streams[1][1] == want2
  # a reset slot starts a new stream at position 0
  assert chain(stages, PROMPT2, 4, slot=0) == want2[:4]


def test_fp16_boundary_reported(tiny_paths, tiny_refs):
  """boundary_dtype=float16 halves the bytes between stages; its tokens are reported against exact mode, not asserted."""
  stages = load_split(tiny_paths["qwen3"], [(0, 2), (2, 5)], boundary_dtype="float16")
  assert stages[0].boundary.egress.token_bytes == 2 * stages[0].dim
  got, want = chain(stages, PROMPT, NEW), tiny_refs["qwen3"]["tokens"]
  agree = sum(a == b for a, b in zip(got, want, strict=True))
  print(f"\nfp16 boundary, tiny qwen3: {agree}/{NEW} tokens agree with exact mode; first difference at "
        f"{next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)}")


@pytest.mark.parametrize("decode,n", [("reference", 36), ("batched", 300)])
def test_prompt_longer_than_a_chunk_returns_every_position(tmp_path, decode, n):
  """A non-tail stage returns the residual for all T positions of a prompt longer than its largest chunk (tinygrad's
  32, the rows path's MAX_ROWS): it chunks internally, and the same positions fed in two records give the same bytes."""
  path = write_tiny_gguf(tmp_path / "long.gguf", **TINY_MODELS["llama_untied"], context=1024)
  prompt = np.asarray((PROMPT * 8)[:n], dtype=np.uint32)
  whole = StageModel.load(path, 0, 2, max_context=512, decode=decode)
  r = whole.forward(0, prompt, 0)
  assert r.shape == (1, n, whole.dim)
  full = np.empty((n, whole.dim), np.float32)
  assert whole.output_into(r, memoryview(full)) == full.nbytes
  part = StageModel.load(path, 0, 2, max_context=512, decode=decode)
  cut = whole.max_chunk
  a, b = part.forward(0, prompt[:cut], 0).numpy(), part.forward(0, prompt[cut:], cut).numpy()
  assert np.array_equal(bits(np.concatenate([a[0], b[0]])), bits(full))


_X86_SCRIPT = """
import sys
import numpy as np
from tinygrad import Device
from pyruntime.stage.compute.model import StageModel
s = StageModel.load(sys.argv[1], 0, 2, device="CPU:X86", max_context=64)
r = s.forward(0, np.arange(5, 13, dtype=np.uint32), 0).numpy()
print(s.device, type(Device[s.device].renderer).__name__, r.shape[-1])
"""


def test_device_names_a_renderer(tiny_paths):
  """device="CPU:X86" (DEV's device:renderer form, no C compiler needed) runs on the CPU with tinygrad's x86 renderer."""
  env = {k: v for k, v in os.environ.items() if k != "DEV"}
  env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
  r = subprocess.run([sys.executable, "-c", _X86_SCRIPT, str(tiny_paths["llama_tied"])], env=env, capture_output=True, text=True,
                     timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.split()[-3:] == ["CPU", "X86Renderer", "64"]


# --- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize("start,end", [(0, 0), (3, 2), (-1, 2), (0, 6), (5, 6), (2, 2)])
def test_layer_range_invalid(tiny_paths, start, end):
  with pytest.raises(errors.LayerRangeInvalid): StageModel.load(tiny_paths["qwen3"], start, end)


@pytest.mark.parametrize("arch", ["qwen2moe", "mixtral", "llama_moe", "gpt2"])
def test_unsupported_architecture(tmp_path, arch):
  path = write_unsupported_gguf(tmp_path / f"{arch}.gguf", arch)
  with pytest.raises(errors.UnsupportedArchitecture) as e: StageModel.load(path, 0, 1)
  assert (arch if arch != "llama_moe" else "llama") in str(e.value)


def test_missing_and_broken_files(tmp_path):
  with pytest.raises(errors.GgufLocalPathMissing): StageModel.load(tmp_path / "nope.gguf", 0, 1)
  (bad := tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
  with pytest.raises(errors.ModelLoadFailed): StageModel.load(bad, 0, 1)


@pytest.fixture(scope="module")
def mid_and_head(tiny_paths):
  path = tiny_paths["llama_tied"]
  return StageModel.load(path, 0, 2, max_context=CTX, slots=2), StageModel.load(path, 2, 4, max_context=CTX, slots=2)


def test_wrong_activation_extent(mid_and_head):
  head, mid = mid_and_head
  with pytest.raises(errors.ActivationExtentInvalid): mid.forward(0, np.zeros((3, mid.dim + 1), np.float32), 0)
  with pytest.raises(errors.ActivationExtentInvalid): mid.forward(0, np.zeros((0, mid.dim), np.float32), 0)
  with pytest.raises(errors.ActivationExtentInvalid): mid.forward(0, np.zeros(mid.dim, np.float32), 0)
  with pytest.raises(errors.ActivationExtentInvalid): head.forward(0, np.zeros((2, 2), np.uint32), 0)
  with pytest.raises(errors.ActivationExtentInvalid): mid.boundary.ingress_array(bytes(4 * mid.dim + 4))
  with pytest.raises(errors.PayloadNotU32Aligned): head.boundary.ingress_array(bytes(6))
  assert head.boundary.ingress_array(np.arange(3, dtype=np.uint32).tobytes()).tolist() == [0, 1, 2]
  assert mid.boundary.ingress_array(bytes(8 * mid.dim)).shape == (2, mid.dim)


def test_wrong_dtype_and_ids(mid_and_head):
  head, mid = mid_and_head
  with pytest.raises(errors.BoundarySchemaMismatch): mid.forward(0, np.zeros((2, mid.dim), np.float16), 0)
  with pytest.raises(errors.BoundarySchemaMismatch): head.forward(0, np.zeros(2, np.int64), 0)
  with pytest.raises(errors.BoundarySchemaMismatch): head.forward(0, np.zeros(2, np.float32), 0)
  with pytest.raises(errors.TokenIdInvalid): head.forward(0, np.asarray([1, head.vocab_size], np.uint32), 0)
  with pytest.raises(errors.SlotInvalid): head.forward(2, np.asarray([1], np.uint32), 0)
  with pytest.raises(errors.StreamPositionInvalid): mid.forward(1, np.zeros((1, mid.dim), np.float32), 5)  # gap in the cache
  with pytest.raises(errors.ContextLengthExceeded): mid.forward(1, np.zeros((CTX + 1, mid.dim), np.float32), 0)


def test_boundary_mismatch(mid_and_head, tiny_paths):
  head, mid = mid_and_head
  assert head.boundary.ingress == Boundary.token_ids("llama") and head.boundary.egress == Boundary.hidden("llama", 2, head.dim)
  mid.boundary.check_ingress(head.boundary)             # the upstream's egress is this stage's ingress
  mid.boundary.check_ingress(head.boundary.to_dict())   # also in wire form
  with pytest.raises(errors.BoundarySchemaMismatch): head.boundary.check_ingress(mid.boundary)  # cut at block 4, not 0
  with pytest.raises(errors.BoundaryArchitectureMismatch):
    mid.boundary.check_ingress(Boundary.hidden("qwen3", 2, mid.dim))
  with pytest.raises(errors.BoundarySchemaMismatch): mid.boundary.check_ingress(Boundary.hidden("llama", 2, mid.dim, "float16"))
  with pytest.raises(errors.BoundarySchemaMismatch): mid.boundary.check_ingress(Boundary.hidden("llama", 2, mid.dim + 1))
  with pytest.raises(errors.BoundarySchemaMismatch):
    mid.boundary.check_ingress(Boundary("llama", 2, {"hidden_states": ("float32", mid.dim), "router_logits": ("float32", 8)}))
  with pytest.raises(errors.BoundarySchemaMismatch):  # dense boundaries carry exactly hidden_states
    Boundary("llama", 2, {"hidden_states": ("float32", 64), "router_logits": ("float32", 8)}).validate()
  Boundary("qwen3moe", 2, {"hidden_states": ("float32", 64), "router_logits": ("float32", 8)}).validate()
  with pytest.raises(errors.BoundarySchemaMismatch): Boundary("qwen3moe", 2, {"hidden_states": ("float32", 64)}).validate()
  with pytest.raises(errors.BoundarySchemaMismatch): Boundary.from_dict({"arch": "llama"})
  assert StageBoundary.from_dict(mid.boundary.to_dict()) == mid.boundary
  # a stage of the other model refuses this model's boundary by architecture
  other = StageModel.load(tiny_paths["qwen3"], 2, 5, max_context=CTX)
  with pytest.raises(errors.BoundaryArchitectureMismatch): other.boundary.check_ingress(head.boundary)


# --- batched decode: batch invariance ------------------------------------------------------------
def bitwise_equal(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
  return len(a) == len(b) and all(np.array_equal(bits(x), bits(y)) for x, y in zip(a, b, strict=True))


# GQA + tied output with the weights dequantised in every kernel (GPUs, --decode reference); qk-norm with them held as
# float32 (the default on a CPU)
@pytest.mark.parametrize("name,weights", [("llama_tied", "quantized"), ("qwen3", "float32")])
def test_batched_decode_is_batch_invariant(name, weights, tiny_paths):
  """Streams of different prompt lengths decoding together, joining at different steps (so the batch shape changes
  from 1 to 2 to 4 rows and back), give every stream the same logits bit for bit as decoding it alone."""
  path = tiny_paths[name]
  stages = load_split(path, [(0, 2), (2, tiny_refs_blocks(path))], slots=4, weights=weights, decode="batched")
  prompts = [PROMPT[:n] for n in (1, 5, 9)] + [(PROMPT * 6)[:40]]  # 40: a prefill of two chunks
  steps = 6

  def prefill(slot: int, prompt: list[int]) -> np.ndarray:
    h = np.asarray(prompt, dtype=np.uint32)
    for s in stages:
      s.reset_slot(slot)
      r = s.forward(slot, h, 0, prefill=True)
      if s.is_tail: return r.numpy().copy()
      h = np.empty((len(prompt), s.dim), np.float32); s.output_into(r, memoryview(h))

  def decode(rows: dict[int, tuple[int, int]]) -> dict[int, np.ndarray]:
    """One batched step: {slot: (token, position)} -> {slot: logits}."""
    slots = sorted(rows)
    h = np.asarray([rows[s][0] for s in slots], dtype=np.uint32)
    for st in stages:
      r = st.forward_batch(slots, h, [rows[s][1] for s in slots])
      if st.is_tail: return {s: x.numpy().copy() for s, x in zip(slots, st.batch_rows(r, slots), strict=True)}
      h = np.concatenate([x.numpy().reshape(1, -1) for x in st.batch_rows(r, slots)])

  def run(joins: dict[int, int], prompt_of: dict[int, int] | None = None) -> dict[int, list[np.ndarray]]:
    """Slot i starts prompt prompt_of[i] (default i) at step joins[i]; returns each slot's logits: prefill, then `steps`
    decode steps."""
    prompt_of = prompt_of or {s: s for s in joins}
    out: dict[int, list[np.ndarray]] = {}
    for step in range(max(joins.values()) + steps):
      for slot, at in joins.items():
        if at == step: out[slot] = [prefill(slot, prompts[prompt_of[slot]])]
      live = {s: (int(out[s][-1].argmax()), len(prompts[prompt_of[s]]) + len(out[s]) - 1) for s in out if len(out[s]) <= steps}
      if live:
        for s, lg in decode(live).items(): out[s].append(lg)
    return out

  solo = {slot: run({slot: 0})[slot] for slot in range(4)}
  together = run({0: 0, 1: 2, 2: 2, 3: 3})
  for slot in range(4): assert bitwise_equal(together[slot], solo[slot]), f"slot {slot}"
  # in another slot: the same numbers (a stream's row does not depend on where it sits in the batch)
  assert bitwise_equal(run({0: 0}, {0: 3})[0], solo[3])


def tiny_refs_blocks(path) -> int:
  from pyruntime.modelfile.gguf import read_header
  from pyruntime.modelfile.plan import num_blocks
  return num_blocks(read_header(path))


def test_float32_weights_hold_the_float16_values(tiny_paths):
  """weights="float32" keeps the reference's float16-rounded weights, only wider: every value is the same."""
  q, f = (StageModel.load(tiny_paths["llama_untied"], 0, 4, max_context=CTX, weights=w) for w in ("quantized", "float32"))
  assert f.resident_bytes > q.resident_bytes
  for bq, bf in zip(q.blk, f.blk, strict=True):
    wq, wf = bq.ffn_gate.weight, bf.ffn_gate.weight
    assert wf.dtype == dtypes.float32 and np.array_equal(wq.float().numpy(), wf.numpy())
  with pytest.raises(errors.InvalidOption): StageModel.load(tiny_paths["llama_untied"], 0, 4, max_context=CTX, weights="int3")


def test_nextn_layers_are_not_blocks(tmp_path):
  """block_count counts the multi-token-prediction layers; tinygrad runs block_count - nextn_predict_layers blocks, and so
  does every count here: the stages, the suggested splits, and a split over all 4 blocks equals the reference."""
  path = write_tiny_gguf(tmp_path / "nextn.gguf", **{**TINY_MODELS["qwen3"], "n_blocks": 4}, nextn=1)
  h = read_header(path)
  assert h.get("block_count") == 5 and h.num_blocks == 4
  ref, _ = Transformer.from_gguf(path, max_context=CTX)
  assert len(ref.blk) == 4
  for by in ("memory", "compute"): assert suggest_split(h, 2, by)[-1][1] == 4
  with pytest.raises(errors.LayerRangeInvalid): StageModel.load(path, 3, 5, max_context=CTX)
  assert chain(load_split(path, [(0, 1), (1, 4)]), PROMPT2, 4) == reference_tokens(ref, PROMPT2, 4)
  # the launcher plans over the same 4 blocks (it once counted 5, and refused every split before anything ran)
  from pyruntime.engine.launcher import Launcher
  for stages, split, want in ((2, None, 4), (3, None, 4), (2, [(0, 2), (2, 4)], 4)):
    lm = Launcher(path, stages=stages, split=split, max_context=CTX)
    lm.plan()
    assert lm.num_blocks == want and lm.split[-1][1] == want and len(lm.split) == stages
  lm = Launcher(path, split=[(0, 2), (2, 5)], max_context=CTX)
  with pytest.raises(errors.LayerRangeInvalid): lm.plan()
