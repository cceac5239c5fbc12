"""The rows path's exactness contract (pyruntime/stage/compute/rows.py): every path that computes a position gives the same bits.

A decode row and a prompt row at the same position of the same stream write the same keys and values and give the same
logits; a prompt cut anywhere (pieces of 1 to 256 rows, aligned to nothing) gives the same bits as in one piece; a
stream's rows do not depend on the streams beside it; and a split gives the unsplit model's bits. Greedy tokens equal
tinygrad's own model on the test prompts (its T=1 decode kernels sum in another order, so logits differ by ~1e-6)."""
from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import lane_device, stage_graphs
from test_model import CTX, PROMPT, PROMPT2, SPLITS, bits, chain, load_split, reference_tokens, tiny_refs_blocks
from tinygrad.llm.model import Transformer
from tinymodels import TINY_MODELS, write_tiny_gguf

from pyruntime import errors
from pyruntime.modelfile.gguf import packed_types
from pyruntime.stage.compute import packed as packed_module
from pyruntime.stage.compute.loop_schedules import VEC
from pyruntime.stage.compute.model import StageModel
from pyruntime.stage.compute.packed import PackedMatrix, packable
from pyruntime.stage.compute.rows import MAX_ROWS, PIECES_REGISTERS_ROWS, SHORT_ROWS
from pyruntime.stage.compute.weights import linears

DENSE = ["llama_tied", "llama_untied", "llama_gqa", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
  folder = tmp_path_factory.mktemp("rows")
  return {name: write_tiny_gguf(folder / f"{name}.gguf", **TINY_MODELS[name], context=1024) for name in [*DENSE, "llama_kquant"]}


def whole(path, **kw) -> StageModel:
  return StageModel.load(path, 0, tiny_refs_blocks(path), max_context=kw.pop("max_context", CTX), decode="batched",
                         graph_cache=stage_graphs(), **kw)


# the contract's three tests also run on the CL lane (tests/integration/test_device_lanes.py): OpenCL through PoCL, a GPU-style
# device with the local-memory schedules (the GPU rule's split sums), asynchronous copies and no buffer views; on a lent
# GPU bench/gpu_check.sh runs them on CUDA (PYRUNTIME_LANE_DEVICE)
CL = os.environ.get("PYRUNTIME_LANE_DEVICE", "CL")


def on(device: str | None) -> dict:
  return {} if device is None else {"device": lane_device(device)}


def position_kv(m: StageModel, slot: int, pos: int) -> list[np.ndarray]:
  """Every block's key and value of `slot` at `pos`, as stored in the rows path's caches."""
  out = []
  for k, v in m.rows.caches:
    out.append(m.rows.key_view(k).numpy()[slot, :, :, pos].copy())
    if v is not None: out.append(m.rows.value_view(v).numpy()[slot, :, pos, :].copy())  # latent attention: one cache
  return out


# every dense model with float32 weights; two models cover the dequantising kernels, and two the CL lane
DECODE_CASES = [(n, "float32", None) for n in DENSE] + [(n, w, d) for n in ("llama_tied", "qwen3") for w, d in
                                                        (("quantized", None), ("float32", CL), ("quantized", CL))] + \
               [(n, "packed-int8", None) for n in ("llama_tied", "llama_gqa", "llama_kquant")]  # integer products: every packed type


# the tensor-core mode (docs/prompt-path.md, "Tensor cores"): each weight form it takes, and the CL lane
TENSOR_CORE_CASES = [("llama_tied", "float16", None), ("qwen2", "quantized", None), ("llama_gqa", "packed", None), ("qwen3", "float16", CL)]


@pytest.mark.parametrize("name,weights,device,tensor_cores", [(*c, False) for c in DECODE_CASES] + [(*c, True) for c in TENSOR_CORE_CASES])
def test_decode_row_equals_prompt_row(paths, name, weights, device, tensor_cores):
  """Positions 40..43 computed as decode rows (batched steps) and as prompt rows (prefill records): the same keys and
  values in every block and the same logits, bit for bit; in the tensor-core mode too (a decode row padded to the
  tile's rows)."""
  decode_rows_equal_prompt_rows(whole(paths[name], slots=2, weights=weights, tensor_cores=tensor_cores, **on(device)), name)


def decode_rows_equal_prompt_rows(m: StageModel, name: str) -> None:
  """PROMPT's next four positions (40..43) as decode rows in slot 0 and as prompt rows in slot 1: the same logits and
  the same keys and values in every block, bit for bit."""
  m.reset_slot(0)
  lg = m.prefill_rows(0, np.asarray(PROMPT, np.uint32), 0).numpy().copy()
  seq, decoded = list(PROMPT), [lg]
  for _ in range(4):
    seq.append(int(lg.argmax()))
    lg = m.batch_rows(m.forward_batch([0], np.asarray(seq[-1:], np.uint32), [len(seq) - 1]), [0])[0].numpy().copy()
    decoded.append(lg)
  decode_kv = [position_kv(m, 0, p) for p in range(40, 44)]
  m.reset_slot(1)
  prompted = [m.prefill_rows(1, np.asarray(seq[:n], np.uint32), 0).numpy().copy() for n in range(40, 45)]
  for i, (a, b) in enumerate(zip(decoded, prompted, strict=True)):
    assert np.array_equal(bits(a), bits(b)), f"{name}: logits after position {39 + i}: max |d| {np.abs(a - b).max()}"
  for p, kv in zip(range(40, 44), decode_kv, strict=True):
    for a, b in zip(kv, position_kv(m, 1, p), strict=True):
      assert np.array_equal(bits(a), bits(b)), f"{name}: keys/values at position {p} differ"


@pytest.mark.parametrize("name", [*DENSE, "llama_kquant"])
def test_float16_and_packed_weights_give_float32_bits(paths, name):
  """A stage holding its weights as float16 (half the bytes) or packed (the file's codes: Q4_0/Q4_1/Q8_0, and with
  packed-all a Q4_K_M file's Q4_K/Q5_K/Q6_K, dequantised in the kernels) computes each weight's float32 value inside the kernels, exactly:
  a prompt's rows, decode rows alone and beside another stream, every key and value, bit for bit the stage that holds
  them as float32. llama_untied's blocks are F16: nothing of it packs, so its packed case is not run."""
  runs = {}
  modes = {"llama_untied": ("float32", "float16"), "llama_kquant": ("float32", "float16", "packed-all")}.get(name, ("float32", "float16", "packed"))
  for weights in modes:
    m = whole(paths[name], slots=2, weights=weights)
    if weights.startswith("packed"):  # every block projection the file holds in a type the mode packs is packed; all at the file's size
      file = {n: m.header.tensors[n] for n in m.tensor_names}
      packed = 0
      for i, b in zip(range(m.start, m.end), m.blk, strict=True):
        for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
          ti = file[f"blk.{i}.{n}.weight"]
          kept = packable(ti.ggml_type, ti.shape, VEC) and ti.ggml_type in packed_types(weights)
          assert isinstance(getattr(b, n).rows_blocked, PackedMatrix) == kept, f"blk.{i}.{n}"
          packed += kept
      assert packed > 0, name  # a model whose blocks pack nothing would test nothing here
      assert m.resident_bytes <= 1.25 * sum(ti.nbytes for ti in file.values())
    prompt = np.asarray(PROMPT, np.uint32)
    out = [m.prefill_rows(0, prompt, 0).numpy().copy(), m.prefill_rows(1, prompt[:33], 0).numpy().copy()]
    # the same prompt in pieces through every prefill graph: 8 rows, 16 rows (the short graphs: a packed matrix rebuilt
    # in registers) and the symbolic graph (staged), in that order: the same logits as the whole prompt
    m.reset_slot(1)
    for s, e in ((0, 8), (8, 24), (24, len(prompt))): pieced = m.prefill_rows(1, prompt[s:e], s)
    assert np.array_equal(bits(pieced.numpy()), bits(out[0])), f"{name} {weights}: pieces through the short graphs"
    m.reset_slot(1)
    out[1] = m.prefill_rows(1, prompt[:33], 0).numpy().copy()
    tok = int(out[0].argmax())
    out += [m.batch_rows(m.forward_batch([0], np.asarray([tok], np.uint32), [len(PROMPT)]), [0])[0].numpy().copy()]
    out += [r.numpy().copy() for r in m.batch_rows(m.forward_batch([0, 1], np.asarray([tok, 7], np.uint32), [len(PROMPT) + 1, 33]), [0, 1])]
    runs[weights] = [bits(a) for a in out + position_kv(m, 0, len(PROMPT)) + position_kv(m, 1, 33)]
  for weights in [w for w in runs if w != "float32"]:
    assert [r.dtype for r in runs["float32"]] == [r.dtype for r in runs[weights]]
    for i, (a, b) in enumerate(zip(runs["float32"], runs[weights], strict=True)): assert np.array_equal(a, b), f"{name} {weights}: output {i} differs"


@pytest.mark.parametrize("name", ["llama_tied", "qwen3"])
def test_where_the_prompt_is_cut_changes_no_bit(paths, name):
  """Pieces of 1, 5, 13, 31 and 100 rows, aligned to nothing, and one piece longer than MAX_ROWS: the same logits."""
  m = whole(paths[name], max_context=512)
  prompt = np.asarray((PROMPT * 10)[:300], np.uint32)
  m.reset_slot(0)
  want = m.prefill_rows(0, prompt, 0).numpy().copy()
  assert len(prompt) > MAX_ROWS
  for piece in (1, 5, 13, 31, 100):
    m.reset_slot(1)
    for s in range(0, len(prompt), piece): got = m.prefill_rows(1, prompt[s:s + piece], s)
    assert np.array_equal(bits(got.numpy()), bits(want)), f"pieces of {piece}"


@pytest.mark.parametrize("name", ["llama_tied", "qwen3", "qwen2"])
def test_splits_equal_the_unsplit_rows_and_tinygrads_tokens(paths, name):
  """Every split of the rows path gives the unsplit run's logits bit for bit (the residual crossing each cut as float32),
  and its greedy tokens are tinygrad's own on both test prompts."""
  path = paths[name]
  ref, _ = Transformer.from_gguf(path, max_context=CTX)
  for prompt in (PROMPT, PROMPT2):
    want, unsplit = reference_tokens(ref, prompt, 12), []
    assert chain(load_split(path, [(0, tiny_refs_blocks(path))], decode="batched"), prompt, 12, logits=unsplit) == want
    for ranges in SPLITS[name]:
      logits: list[np.ndarray] = []
      assert chain(load_split(path, ranges, decode="batched"), prompt, 12, logits=logits) == want
      assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(logits, unsplit, strict=True)), ranges


@pytest.mark.parametrize("device,tensor_cores,weights", [(None, False, None), (CL, False, None), (None, True, "float16"),
                                                         (None, False, "packed-int8")])
def test_decode_windows_and_streams_beside_change_no_bit(paths, device, tensor_cores, weights):
  """One stream decoding alone (windows of 1 row) and beside streams in other slots (windows of 2, 4 and 8 rows, the
  stream at different rows of them): the same logits; in the tensor-core mode too (every window padded to the tile),
  and with integer products (each row quantized on its own)."""
  m = whole(paths["llama_gqa"], slots=8, tensor_cores=tensor_cores, **({"weights": weights} if weights else {}), **on(device))
  rng = np.random.default_rng(1)
  prompts = [rng.integers(1, 250, n).astype(np.uint32) for n in (40, 3, 17, 60, 9, 25, 33, 12)]

  def run(slots: list[int], me: int) -> list[np.ndarray]:
    for s in slots: m.reset_slot(s); m.prefill_rows(s, prompts[s], 0)
    toks, out = {s: 7 if s == me else 7 + s for s in slots}, []
    for step in range(3):
      r = m.forward_batch(slots, np.asarray([toks[s] for s in slots], np.uint32), [len(prompts[s]) + step for s in slots])
      rows = m.batch_rows(r, slots)
      out.append(rows[slots.index(me)].numpy().copy())
    return out
  alone = run([0], 0)
  for slots in ([0, 1], [0, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7]):
    assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(run(slots, 0), alone, strict=True)), slots
  # the same prompt in slot 5, with slots 2..7 beside it: the same numbers again
  prompts[5] = prompts[0]
  assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(run([2, 3, 4, 5, 6, 7], 5), alone, strict=True))


def test_integer_products_run_where_the_mode_asks(paths):
  """weights="packed-int8": every packed projection (Q4_0, Q4_1, Q8_0 here) multiplies in integers, every prompt goes in the short graphs'
  calls (the integer kernel takes a concrete count of rows: no symbolic or mixed graph), a prompt in pieces gives the
  whole prompt's bits, and the logits are int8 arithmetic's: not float32 mode's bits, within its error of them. Elsewhere
  than a CPU's rows path the mode is refused by name."""
  path = paths["llama_gqa"]
  m, f = whole(path, slots=2, weights="packed-int8"), whole(path, slots=2, weights="float32")
  kept = [wb for b in m.blk for lin in linears(b) if isinstance(wb := getattr(lin, "rows_blocked", None), PackedMatrix)]
  assert kept and all(wb.integer for wb in kept)
  assert m.rows.prompt_rows == max(SHORT_ROWS) and m.rows.registers_rows == MAX_ROWS and not m.mixes(MAX_ROWS)
  prompt = np.asarray(PROMPT, np.uint32)
  whole_prompt = m.prefill_rows(0, prompt, 0).numpy().copy()
  for s, e in ((0, 3), (3, 24), (24, len(prompt))): pieced = m.prefill_rows(1, prompt[s:e], s)
  assert np.array_equal(bits(pieced.numpy()), bits(whole_prompt))
  want = f.prefill_rows(0, prompt, 0).numpy()
  rms = lambda a: float(np.sqrt(np.mean(np.square(a, dtype=np.float64))))  # noqa: E731
  assert 0 < rms(whole_prompt - want) < 0.05 * rms(want)
  from pyruntime.engine.launch_plan import LaunchOptions, weights_for
  for device, decode in (("CL", "batched"), ("CPU", "reference")):
    with pytest.raises(errors.InvalidOption, match="packed-int8"):
      weights_for(LaunchOptions(weights="packed-int8", decode=decode), "llama", device, True)


def test_bad_rows_are_refused_by_name(paths):
  m = whole(paths["llama_tied"], slots=2)
  with pytest.raises(errors.StreamPositionInvalid): m.prefill_rows(0, np.asarray([1, 2], np.uint32), 3)
  with pytest.raises(errors.ContextLengthExceeded): m.prefill_rows(0, np.ones(CTX + 1, np.uint32), 0)
  with pytest.raises(errors.TokenIdInvalid): m.prefill_rows(0, np.asarray([m.vocab_size], np.uint32), 0)
  with pytest.raises(errors.SlotInvalid): m.forward_batch([0, 0], np.asarray([1, 2], np.uint32), [1, 1])
  ref = StageModel.load(paths["llama_tied"], 0, 5, max_context=CTX, decode="reference")
  assert ref.rows is None
  with pytest.raises(errors.InvalidOption): ref.forward_batch([0], np.asarray([1], np.uint32), [1])
  with pytest.raises(errors.InvalidOption): StageModel.load(paths["llama_tied"], 0, 5, decode="fast")


def test_tensor_core_mode_rounds_only_the_projections_inputs(paths):
  """Against the model's arithmetic in float64 (bench/exactness.py's reference, the same float16 weight values): the
  float32 path's logits are within float32's rounding; the tensor-core mode's are further (each projection's input
  rounded to float16: the mode does round) but within float16's rounding of those inputs, and its likeliest tokens
  are the reference's. It is refused by name where it cannot hold: float32 weights, tinygrad's own decode."""
  from pyruntime.bench.exactness import compare, pyruntime_logits, reference_logits, weights64
  path, tokens = str(paths["qwen2"]), list(PROMPT)
  ref = reference_logits(*weights64(path), tokens)
  scale = float(np.sqrt((ref * ref).mean()))
  exact = compare(ref, pyruntime_logits(path, tokens, None, weights="float32"))
  tc = compare(ref, pyruntime_logits(path, tokens, None, weights="quantized", tensor_cores=True))
  assert exact["rms"] < 1e-5 * scale and exact["top1_agree"] == 1.0, exact
  assert 10 * exact["rms"] < tc["rms"] < 2.0 ** -9 * scale and tc["top1_agree"] == 1.0, (tc, exact, scale)
  with pytest.raises(errors.InvalidOption, match="tensor_cores"): whole(path, weights="float32", tensor_cores=True)
  with pytest.raises(errors.InvalidOption, match="tensor_cores"): StageModel.load(path, 0, 2, decode="reference", tensor_cores=True)


def test_stale_cache_bytes_never_reach_a_sum(paths):
  """The caches are not zeroed: positions no row may see can hold anything, NaN included. Filled with NaN before the
  streams start, every logit is still finite and equal to a fresh model's."""
  fresh, dirty = whole(paths["qwen3"], slots=2), whole(paths["qwen3"], slots=2)
  for k, v in dirty.rows.caches:
    for t in (k, v): t.uop.buffer.copyin(memoryview(np.full(t.numel(), np.nan, np.float32)).cast("B"))
  def run(m: StageModel) -> list[np.ndarray]:
    out = [m.prefill_rows(0, np.asarray(PROMPT, np.uint32), 0).numpy().copy()]
    m.prefill_rows(1, np.asarray(PROMPT2, np.uint32), 0)
    for i in range(3):
      r = m.forward_batch([0, 1], np.asarray([5 + i, 9 + i], np.uint32), [len(PROMPT) + i, len(PROMPT2) + i])
      out.append(m.batch_rows(r, [0, 1])[0].numpy().copy())
    return out
  for a, b in zip(run(dirty), run(fresh), strict=True):
    assert np.isfinite(a).all() and np.array_equal(bits(a), bits(b))


@pytest.mark.parametrize("device,tensor_cores", [(None, False), (CL, False), (None, True)])
@pytest.mark.parametrize("name,cut", [("llama_tied", (0, 5)), ("qwen3", (0, 2)), ("qwen3", (2, 5))])
def test_a_mixed_step_equals_its_decode_and_prompt_apart(paths, name, cut, device, tensor_cores):
  """A decode step and a prompt's chunk in one pass over the weights (StageModel.forward_mixed) give the very bits of
  the two computed apart, on a head, a middle and a tail stage; in the tensor-core mode too."""
  m = StageModel.load(paths[name], *cut, max_context=CTX, slots=4, decode="batched", weights="float16" if tensor_cores else "float32",
                      tensor_cores=tensor_cores, **on(device))
  rng = np.random.default_rng(0)
  mk = lambda n: rng.integers(1, 250, n).astype(np.uint32) if m.is_head else rng.standard_normal((n, m.dim)).astype(np.float32)  # noqa: E731
  p0, p1, p2, tok = mk(30), mk(17), mk(45), mk(2)

  def run(mixed: bool) -> list[np.ndarray]:
    for s in range(3): m.reset_slot(s)
    m.prefill_rows(0, p0, 0); m.prefill_rows(1, p1, 0)
    if mixed:
      dec, pre = m.forward_mixed([0, 1], tok, [30, 17], 2, p2, 0)
      return [r.numpy().copy() for r in m.mixed_rows(dec, [0, 1])] + [pre.numpy().copy()]
    dec = [r.numpy().copy() for r in m.batch_rows(m.forward_batch([0, 1], tok, [30, 17]), [0, 1])]
    return dec + [m.prefill_rows(2, p2, 0).numpy().copy()]
  assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(run(True), run(False), strict=True))
  with pytest.raises(errors.SlotInvalid): m.forward_mixed([0, 2], tok, [30, 45], 2, p2, 45)


def test_matrices_too_large_to_stage_keep_every_bit(paths, monkeypatch):
  """A packed matrix whose float16 copy would not stay in the CPU's cache (packed.STAGED_MAX_BYTES; here every matrix of
  more than one column block) is staged in pieces for a prompt chunk, each piece's product stored, then joined
  (rows._blocked_product): a 100-row prompt in one call and a mixed step's 40-row chunk give the bits of the stage that
  stages each matrix whole. A shorter chunk goes in short graphs' calls (RowPath.registers_rows). The warm-up leaves
  nothing for those calls to capture."""
  path = paths["llama_tied"]
  outs, widest = [], 0
  for pieces in (False, True):
    # one column block of the widest matrix a piece: every matrix but the narrowest in pieces
    if pieces: monkeypatch.setattr(packed_module, "STAGED_MAX_BYTES", 2 * VEC * widest)
    # no graph cache: the two stages' graphs differ under one key
    m = StageModel.load(path, 0, tiny_refs_blocks(path), max_context=CTX, slots=2, decode="batched", weights="packed")
    held = [wb for b in m.blk for w in linears(b) if isinstance(wb := getattr(w, "rows_blocked", None), PackedMatrix)]
    widest = max(wb.shape[1] for wb in held)
    split = [len(wb.pieces()) > 1 for wb in held]
    assert held and (sum(split) >= len(held) // 2 if pieces else not any(split))
    # a chunk too short to pay for staging goes in short graphs' calls; the 100-row prompt below stages
    assert m.rows.prompt_rows == MAX_ROWS and m.rows.registers_rows == (PIECES_REGISTERS_ROWS if pieces else SHORT_ROWS[-1]) < 100
    if pieces:
      m.warm_up()
      m.on_capture = lambda name: pytest.fail(f"graph {name} captured after the warm-up")
    prompt = np.asarray((PROMPT * 3)[:100], np.uint32)
    out = [m.prefill_rows(0, prompt, 0).numpy().copy()]
    dec, pre = m.forward_mixed([0], np.asarray([7], np.uint32), [100], 1, prompt[:40], 0)
    outs.append(out + [r.numpy().copy() for r in m.mixed_rows(dec, [0])] + [pre.numpy().copy()])
  assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(*outs, strict=True))


def test_short_chunks_beside_decode_rows_go_apart_only_with_packed_weights(paths):
  """A chunk that fits a short graph runs apart from the decode rows with packed weights (the mixed graph would stage
  every weight first); a longer one, or any with weights already float, rides in their step."""
  packed, floats = whole(paths["qwen3"], slots=2, weights="packed"), whole(paths["qwen3"], slots=2, weights="float16")
  assert [packed.mixes(n) for n in (1, SHORT_ROWS[0], SHORT_ROWS[-1], SHORT_ROWS[-1] + 1)] == [False, False, False, True]
  assert all(floats.mixes(n) for n in (1, SHORT_ROWS[-1], SHORT_ROWS[-1] + 1))


def test_a_closed_streams_cache_pages_go_back_to_the_system(tmp_path):
  """On a CPU a slot's keys and values are given back to the system when its stream ends (reset_slot: the pages a
  stream wrote would otherwise stay resident for the stage's life), so the cache's resident memory follows the streams;
  a short stream's keys, one page of each (kv head, dim) lane, stay for the next stream (which would fault them in
  again), and no more than those. The next stream in that slot computes the same bits as the first did."""
  from pyruntime.protocol import PAGE_POSITIONS
  from pyruntime.stage.memory_use import buffer_resident
  path = write_tiny_gguf(tmp_path / "long.gguf", **dict(TINY_MODELS["llama_tied"], context=2048))
  m = StageModel.load(path, 0, 5, max_context=2048, slots=2, weights="float32", graph_cache=stage_graphs())
  def kv() -> int: return sum(buffer_resident(t) for t in m.state_tensors())
  lanes = sum(t.nbytes() // (m.slots + 1) // (4 * m.rows.length) for t, _ in m.rows.caches)  # one slot's key lanes
  m.reset_slot(0)
  base = kv()
  prompt = np.asarray((list(range(5, 250)) * 7)[:1500], np.uint32)  # past each lane's first page
  first = m.prefill_rows(0, prompt, 0).numpy().copy()
  grown = kv()
  m.reset_slot(0)
  assert grown - base > 500_000 and kv() - base < (grown - base) // 10, (base, grown, kv())
  assert np.array_equal(bits(m.prefill_rows(0, prompt, 0).numpy()), bits(first))
  m.reset_slot(0)
  short = prompt[:100]
  want = m.prefill_rows(0, short, 0).numpy().copy()
  m.reset_slot(0)
  kept = kv() - base
  assert 0 < kept <= lanes * 4 * PAGE_POSITIONS, (kept, lanes)  # its keys' first pages, no more (the values went)
  assert np.array_equal(bits(m.prefill_rows(0, short, 0).numpy()), bits(want))
  m.reset_slot(0)
  assert kv() - base == kept  # the next short stream wrote into the same pages
