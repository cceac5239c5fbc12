"""Mixture-of-experts and latent-attention blocks on the rows path (pyruntime/stage/compute/experts.py, rows.py's
_latent_qk and _attend_latent): the rows path's contract for them.

qwen3moe (softmax over the top k), glm4moe (a leading dense block, sigmoid routing with an expert bias and scale, a
gated shared expert) and deepseek2 (MLA with a low-rank query, or without one as DeepSeek-V2-Lite has it; a leading
dense block, a shared expert), tiny files: a decode row equals a prompt row (keys, values or the latent cache, logits,
router logits); a stream's rows do not depend on the streams beside it, whatever experts those choose; a mixed step
equals its parts apart; a split equals one stage, router logits on the boundary included; and greedy tokens equal
tinygrad's own model's."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import lane_device, stage_graphs
from test_model import CTX, PROMPT, PROMPT2, bits, chain, load_split, reference_tokens
from test_rows import CL, position_kv
from tinygrad.helpers import prod
from tinygrad.llm.model import Transformer
from tinymodels import TINY_FAMILIES, write_tiny_gguf

from pyruntime.stage.compute import packed as packed_module
from pyruntime.stage.compute.model import StageModel
from pyruntime.stage.compute.packed import PackedMatrix
from pyruntime.stage.compute.rows import MAX_ROWS, SHORT_ROWS
from pyruntime.stage.compute.weights import expert_matrices

MOE = ["qwen3moe", "glm4moe", "deepseek2"]
# DeepSeek-V2-Lite's form of latent attention: the query from its own projection, no low-rank half
LITE = {**TINY_FAMILIES["deepseek2"], "mla": {**TINY_FAMILIES["deepseek2"]["mla"], "q_lora": 0}}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
  folder = tmp_path_factory.mktemp("moe-rows")
  out = {name: write_tiny_gguf(folder / f"{name}.gguf", **TINY_FAMILIES[name], context=512) for name in MOE}
  return out | {"deepseek2-lite": write_tiny_gguf(folder / "deepseek2-lite.gguf", **LITE, context=512)}


def stage(path, start: int = 0, end: int = 4, **kw) -> StageModel:
  device = kw.pop("device", None)
  return StageModel.load(path, start, end, max_context=CTX, decode="batched", graph_cache=stage_graphs(), slots=kw.pop("slots", 4),
                         **({"device": lane_device(device)} if device else {}), **kw)


# every weight form the experts take (float32 and float16: column blocks; packed: the file's codes in column blocks;
# quantized: the file's bytes, dequantised in tinygrad's kernels), the tensor-core mode, latent attention with and
# without its low-rank query, and the CL lane (a GPU-style device: split sums, no buffer views)
CASES = [("qwen3moe", "float32", None, False), ("glm4moe", "packed", None, False), ("qwen3moe", "float16", None, True),
         ("glm4moe", "quantized", CL, False), ("deepseek2-lite", "packed", None, True), ("deepseek2", "quantized", CL, False)]


@pytest.mark.parametrize("name,weights,device,tensor_cores", CASES)
def test_a_moe_decode_row_equals_its_prompt_row(paths, name, weights, device, tensor_cores):
  """Positions 40..43 as decode rows and as prompt rows: the same keys and values in every block, the same logits and
  the same routing, bit for bit; the experts stay on the rows path (column blocks where the weights are float)."""
  m = stage(paths[name], slots=2, weights=weights, tensor_cores=tensor_cores, device=device)
  assert m.batched and m.rows is not None
  moe = [b for b in m.blk if b.config.num_experts]
  assert moe and all((getattr(w, "rows_blocked", None) is not None) == (weights != "quantized") for b in moe for w in expert_matrices(b))
  m.reset_slot(0)
  lg = m.prefill_rows(0, np.asarray(PROMPT, np.uint32), 0).numpy().copy()
  seq, decoded, routed = list(PROMPT), [lg], []
  for _ in range(4):
    seq.append(int(lg.argmax()))
    lg = m.batch_rows(m.forward_batch([0], np.asarray(seq[-1:], np.uint32), [len(seq) - 1]), [0])[0].numpy().copy()
    decoded.append(lg)
    routed.append(m.rows.router[0].copy())
  decode_kv = [position_kv(m, 0, p) for p in range(40, 44)]
  m.reset_slot(1)
  prompted = [m.prefill_rows(1, np.asarray(seq[:n], np.uint32), 0).numpy().copy() for n in range(40, 45)]
  for i, (a, b) in enumerate(zip(decoded, prompted, strict=True)):
    assert np.array_equal(bits(a), bits(b)), f"{name}: logits after position {39 + i}: max |d| {np.abs(a - b).max()}"
  assert all(np.array_equal(bits(r), bits(m.rows.router[40 + i])) for i, r in enumerate(routed))  # the last prompt's rows 40..43
  for p, kv in zip(range(40, 44), decode_kv, strict=True):
    for a, b in zip(kv, position_kv(m, 1, p), strict=True):
      assert np.array_equal(bits(a), bits(b)), f"{name}: keys/values at position {p} differ"


@pytest.mark.parametrize("name", ["glm4moe", "deepseek2"])
def test_packed_experts_hold_the_files_codes_and_give_float32_bits(paths, name):
  """With packed weights a block's routed experts are held as the file's codes (one PackedMatrix per expert tensor, near
  the file's size, not float16's), and a prompt chunk (experts dequantised once for its rows), a short chunk and decode
  rows (each chosen expert rebuilt in the kernel) give float32 mode's logits bit for bit."""
  packed, plain = stage(paths[name], slots=2, weights="packed"), stage(paths[name], slots=2, weights="float32")
  experts = [w for b in packed.blk if b.config.num_experts for w in expert_matrices(b)]
  assert experts and all(isinstance(w.rows_blocked, PackedMatrix) for w in experts)
  assert all(sum(t.nbytes() for t in w.rows_blocked.buffers()) < 0.6 * 2 * prod(w.weight.shape) for w in experts)

  def run(m: StageModel) -> list[np.ndarray]:
    for s in (0, 1): m.reset_slot(s)
    out = [m.prefill_rows(s, np.asarray(p, np.uint32), 0).numpy().copy() for s, p in ((0, PROMPT), (1, PROMPT2[:8]))]
    toks = [int(out[0].argmax()), int(out[1].argmax())]
    for step in range(3):
      rows = m.batch_rows(m.forward_batch([0, 1], np.asarray(toks, np.uint32), [len(PROMPT) + step, 8 + step]), [0, 1])
      out += [r.numpy().copy() for r in rows]
      toks = [int(r.numpy().argmax()) for r in rows]
    return out
  for i, (a, b) in enumerate(zip(run(packed), run(plain), strict=True)):
    assert np.array_equal(bits(a), bits(b)), f"{name}: output {i}: max |d| {np.abs(a - b).max()}"


@pytest.mark.parametrize("name", ["glm4moe", "deepseek2"])
def test_moe_streams_beside_change_no_bit(paths, name):
  """One stream alone (windows of 1 row) and beside up to seven others that route their rows to other experts (windows
  of 2, 4 and 8): the same logits. No sum runs over the rows that chose an expert, so none depends on how many did."""
  m = stage(paths[name], slots=8, weights="float16")
  rng = np.random.default_rng(3)
  prompts = [rng.integers(1, 250, n).astype(np.uint32) for n in (40, 3, 17, 60, 9, 25, 33, 12)]

  def run(slots: list[int]) -> list[np.ndarray]:
    for s in slots: m.reset_slot(s); m.prefill_rows(s, prompts[s], 0)
    toks, out = {s: 7 if s == 0 else 7 + 11 * s for s in slots}, []
    for step in range(3):
      r = m.forward_batch(slots, np.asarray([toks[s] for s in slots], np.uint32), [len(prompts[s]) + step for s in slots])
      out.append(m.batch_rows(r, slots)[slots.index(0)].numpy().copy())
      toks = {s: int(row.numpy().argmax()) if s else 7 for s, row in zip(slots, m.batch_rows(r, slots), strict=True)}
    return out
  alone = run([0])
  for slots in ([0, 1], [0, 2, 3], list(range(8))):
    assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(run(slots), alone, strict=True)), slots
  assert len({int(e) for e in np.argsort(-m.rows.router, axis=-1)[:, :2].reshape(-1)}) > 2  # the rows beside chose other experts


@pytest.mark.parametrize("cut", [(0, 2)])
def test_a_moe_mixed_step_equals_its_decode_and_prompt_apart(paths, cut):
  """A decode step and a prompt's chunk in one pass (forward_mixed): the bits of the two apart, and each slot's router
  logits, which the head's boundary carries (a tail's mixed step is the dense families' test: the same code)."""
  m = stage(paths["glm4moe"], *cut, weights="float32")
  rng = np.random.default_rng(0)
  mk = lambda n: rng.integers(1, 250, n).astype(np.uint32) if m.is_head else rng.standard_normal((n, m.dim)).astype(np.float32)  # noqa: E731
  p0, p1, p2, tok = mk(30), mk(17), mk(45), mk(2)

  def run(mixed: bool) -> tuple[list[np.ndarray], dict]:
    for s in range(3): m.reset_slot(s)
    m.prefill_rows(0, p0, 0); m.prefill_rows(1, p1, 0)
    if mixed:
      dec, pre = m.forward_mixed([0, 1], tok, [30, 17], 2, p2, 0)
      out = [r.numpy().copy() for r in m.mixed_rows(dec, [0, 1])] + [pre.numpy().copy()]
    else:
      out = [r.numpy().copy() for r in m.batch_rows(m.forward_batch([0, 1], tok, [30, 17]), [0, 1])]
      out.append(m.prefill_rows(2, p2, 0).numpy().copy())
    return out, {s: r.copy() for s, r in m.routers.items()}
  (a, ra), (b, rb) = run(True), run(False)
  assert all(np.array_equal(bits(x), bits(y)) for x, y in zip(a, b, strict=True))
  assert sorted(ra) == sorted(rb) == ([] if m.is_tail else [0, 1, 2])
  assert all(np.array_equal(bits(ra[s]), bits(rb[s])) for s in ra) and (m.is_tail or ra[2].shape == (45, 8))


@pytest.mark.parametrize("name,ranges", [("qwen3moe", [(0, 1), (1, 4)]), ("glm4moe", [(0, 2), (2, 3), (3, 4)]),
                                         ("deepseek2", [(0, 2), (2, 3), (3, 4)]), ("deepseek2-lite", [(0, 3), (3, 4)])])
def test_moe_splits_equal_one_stage_and_tinygrads_tokens(paths, name, ranges):
  """Every split of the rows path gives the unsplit stage's logits bit for bit and tinygrad's own greedy tokens on both
  test prompts; the router logits a cut carries are the last MoE block's before it, as tinygrad's model computes them
  (to float32's last bits: its router sums in another order) and picking the same experts."""
  path = paths[name]
  ref, _ = Transformer.from_gguf(path, max_context=CTX)
  for prompt in (PROMPT, PROMPT2):
    want, unsplit, logits = reference_tokens(ref, prompt, 10), [], []
    assert chain(load_split(path, [(0, 4)], decode="batched"), prompt, 10, logits=unsplit) == want
    assert chain(load_split(path, ranges, decode="batched"), prompt, 10, logits=logits) == want
    assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(logits, unsplit, strict=True))
  head, ref_head = load_split(path, ranges[:1], decode="batched")[0], load_split(path, ranges[:1])[0]
  ids = np.asarray(PROMPT, np.uint32)
  for s in (head, ref_head): s.reset_slot(0); s.forward(0, ids, 0)
  E, k = head.config.num_experts, head.config.num_experts_per_tok
  rows, refs = head.routers[0], ref_head.routers[0]
  assert rows.shape == refs.shape == (len(PROMPT), E)
  assert np.allclose(rows, refs, rtol=0, atol=1e-5 * np.abs(refs).max())
  top = lambda r: np.sort(np.argsort(-r, axis=-1)[:, :k], axis=-1)  # noqa: E731
  clear = np.sort(refs, axis=-1)[:, -k] - np.sort(refs, axis=-1)[:, -k - 1] > 1e-4  # rows whose k-th choice is not a near tie
  assert clear.sum() > len(PROMPT) // 2 and np.array_equal(top(rows)[clear], top(refs)[clear])


def test_experts_too_large_to_stage_stay_in_registers_and_keep_every_bit(paths, monkeypatch):
  """A MoE block's experts are staged for a prompt chunk only while the float16 copy of all of them fits
  packed.STAGED_MAX_BYTES (a Qwen3-30B-A3B block's would be 1.2 GB); past it each row's chosen experts are rebuilt in
  registers, and the stage takes prompts in the short graph's calls. A 100-row prompt and the decode rows after it give
  the staging stage's bits."""
  outs = []
  for registers in (False, True):
    if registers: monkeypatch.setattr(packed_module, "STAGED_MAX_BYTES", 0)
    # no graph cache: the two forms' graphs differ under one key
    m = StageModel.load(paths["glm4moe"], 0, 4, max_context=CTX, decode="batched", weights="packed", slots=2)
    held = [w.rows_blocked for b in m.blk if b.config.num_experts for w in expert_matrices(b)]
    assert held and all(isinstance(wb, PackedMatrix) and wb.fits_staging != registers for wb in held)
    assert m.rows.prompt_rows == (SHORT_ROWS[-1] if registers else MAX_ROWS)
    m.reset_slot(0)
    prompt = np.asarray((PROMPT * 3)[:100], np.uint32)
    out = [m.prefill_rows(0, prompt, 0).numpy().copy()]
    out += [r.numpy().copy() for r in m.batch_rows(m.forward_batch([0], np.asarray([7], np.uint32), [100]), [0])]
    outs.append(out)
  assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(*outs, strict=True))
