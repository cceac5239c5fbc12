"""Mixture-of-experts, MLA and hybrid stages in one process (pyruntime/stage/compute/model.py), on tiny GGUF files of each family:
every split equals tinygrad's own single-process Transformer, tokens and tail logits bit for bit."""
from __future__ import annotations

import pathlib

import numpy as np
import pytest
from test_model import NEW, PROMPT, PROMPT2, bits, chain, load_split, reference_runs, reference_tokens, write_models
from tinymodels import TINY_FAMILIES

from pyruntime import errors
from pyruntime.modelfile.gguf import read_header
from pyruntime.modelfile.plan import stage_weight_bytes

# --- mixture-of-experts and MLA families ----------------------------------------------------------
RECURRENT = ("qwen35", "qwen35moe")
# whole, uneven (a one-block first stage), three stages (a one-block middle and tail): every kind of cut a stage sees
FAMILY_SPLITS = [[(0, 4)], [(0, 1), (1, 4)], [(0, 2), (2, 3), (3, 4)]]


@pytest.fixture(scope="module")
def family_paths(tmp_path_factory) -> dict[str, pathlib.Path]: return write_models(tmp_path_factory.mktemp("families"), TINY_FAMILIES)


@pytest.fixture(scope="module")
def family_refs(family_paths) -> dict[str, dict]:
  # a hybrid prefills one token at a time (each an eager reference step): 12 tokens show it as well as 40 do
  return reference_runs(family_paths, lambda name: 2, lambda name: PROMPT[:12] if name in RECURRENT else PROMPT)


@pytest.mark.parametrize("name,ranges", [(n, r) for n in TINY_FAMILIES for r in FAMILY_SPLITS],
                         ids=[f"{n}-{'|'.join(f'{a}:{b}' for a, b in r)}" for n in TINY_FAMILIES for r in FAMILY_SPLITS])
def test_family_split_equals_reference(name, ranges, family_paths, family_refs):
  """qwen3moe, glm4moe (leading dense block, expert bias, scale, shared expert + gate) and deepseek2 (MLA): 1, 2 and 3
  stages, even and uneven, give the reference's tokens and its prefill and decode logits bit for bit."""
  want = family_refs[name]
  stages = load_split(family_paths[name], ranges)
  for s in stages:  # the same blocks tinygrad builds, with the same config (experts, bias, shared gate, MLA ranks)
    for j, b in enumerate(s.blk):
      rb = want["ref"].blk[s.start + j]
      assert type(b) is type(rb) and b.config == rb.config, f"{name} block {s.start + j}"
  logits: list[np.ndarray] = []
  assert chain(stages, want["prompt"], NEW, logits=logits) == want["tokens"]
  for i, (a, b) in enumerate(zip(logits, want["logits"], strict=False)):
    assert np.array_equal(bits(a), bits(b)), f"step {i}: tail logits differ from the reference (max |d| {np.abs(a - b).max()})"
  header = read_header(family_paths[name])
  for s in stages: assert s.resident_bytes == stage_weight_bytes(header, s.start, s.end)


@pytest.mark.parametrize("name", ["qwen3moe", "deepseek2"])
def test_family_prompt_cut_anywhere_equals_reference(name, family_paths, family_refs):
  """Experts and MLA too: the prompt in pieces of 1, 7 and 29 tokens (a stage's load-sized prefill chunks) gives the
  reference's logits bit for bit."""
  want = family_refs[name]
  stages = load_split(family_paths[name], [(0, 2), (2, 4)])
  for piece in (1, 7, 29):
    logits: list[np.ndarray] = []
    assert chain(stages, want["prompt"], len(want["logits"]), logits=logits, piece=piece) == want["tokens"][:len(want["logits"])]
    assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(logits, want["logits"], strict=True)), f"pieces of {piece}"


def test_family_configs_exercise_what_they_claim(family_refs):
  """The tiny files hold what the tests mean to check: routed experts, expert bias, shared experts and gate, scaling,
  a leading dense block, MLA with q_lora."""
  def cfg(name: str, i: int): return family_refs[name]["ref"].blk[i].config
  q, g, d = cfg("qwen3moe", 0), cfg("glm4moe", 1), cfg("deepseek2", 1)
  assert q.num_experts == 8 and q.norm_topk_prob and not q.shared_expert_dim
  assert g.expert_bias and g.shared_expert_gate and g.shared_expert_dim == 32 and g.routed_scaling_factor == 2.5 and g.norm_topk_prob
  assert cfg("glm4moe", 0).num_experts == 0 and g.leading_dense_blocks == 1 and g.rope_dim == 8 and g.qkv_bias
  assert d.kv_lora_rank == 32 and d.q_lora_rank == 32 and d.shared_expert_dim == 32 and not d.shared_expert_gate
  assert cfg("deepseek2", 0).num_experts == 0 and d.routed_scaling_factor == 1.5 and not d.norm_topk_prob
  for name in ("qwen35", "qwen35moe"):
    ref = family_refs[name]["ref"]
    assert ref.has_recurrent_block and [type(b).__name__ for b in ref.blk] == ["GatedDeltaNetBlock", "TransformerBlock"] * 2
    assert cfg(name, 1).attn_output_gate and cfg(name, 1).qk_norm == cfg(name, 1).head_dim
  assert cfg("qwen35moe", 0).num_experts == 8 and cfg("qwen35moe", 0).shared_expert_gate


@pytest.mark.parametrize("name", ["qwen35"])  # qwen35moe's experts on the rows path: test_families.py, through stage processes
def test_a_hybrid_runs_the_rows_path_one_row_per_stream(family_paths, family_refs, name):
  """A hybrid stage on the rows path (RowPath._recurrent): warm_up prepares the decode windows and the chunk graph (a
  chunk's rows are decode rows, the recurrence one row after another: RowPath._recurrent_chunk); two stages give tinygrad's
  tokens; a stream's rows are the same bits alone and beside other streams (whose fillers leave idle slots' state
  untouched); a prompt's row beside decode rows (one window, forward_mixed) equals it apart; splits equal one stage.
  Which stages take the rows path is what modelfile.plan.ROWS_ARCHS says."""
  from pyruntime.modelfile.plan import ROWS_ARCHS
  path, want = family_paths[name], family_refs[name]
  stages = load_split(path, [(0, 2), (2, 4)], slots=4, decode="batched")
  # a scored prompt's rows are decode rows too, one at a time
  for s in stages: assert s.batched and s.recurrent and s.warm_up() == [1, 2, 4] and s.score_rows == 1
  logits: list[np.ndarray] = []
  assert chain(stages, list(want["prompt"]), len(want["tokens"]), logits=logits) == want["tokens"]
  whole: list[np.ndarray] = []
  chain(load_split(path, [(0, 4)], slots=4, decode="batched"), list(want["prompt"]), len(want["tokens"]), logits=whole)
  assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(logits, whole, strict=True))
  m = load_split(path, [(0, 4)], slots=4, decode="batched")[0]
  prompts = [np.asarray(p, np.uint32) for p in (PROMPT[:12], PROMPT2, PROMPT[20:27], PROMPT[3:6])]

  def run(slots: list[int]) -> list[np.ndarray]:
    for s in range(4): m.reset_slot(s)
    for s in slots: m.prefill_rows(s, prompts[s], 0)
    toks, out = {s: 7 + 11 * s for s in slots}, []
    for step in range(4):
      rows = m.batch_rows(m.forward_batch(slots, np.asarray([toks[s] for s in slots], np.uint32), [len(prompts[s]) + step for s in slots]), slots)
      out.append(rows[0].numpy().copy())
      toks = {s: int(r.numpy().argmax()) for s, r in zip(slots, rows, strict=True)}
    return out
  alone = run([0])
  for slots in ([0, 1], [0, 2, 3]):
    assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(run(slots), alone, strict=True)), slots

  def waiting(beside: bool) -> np.ndarray:
    # slot 1 holds a stream that waits while slots 0 and 2 decode in a window of 4 (slots 1 and 3 its fillers): its
    # next row must not see that those steps happened
    for s in range(4): m.reset_slot(s)
    for s in (0, 1, 2): m.prefill_rows(s, prompts[s], 0)
    for step in range(3 if beside else 0):
      m.forward_batch([0, 2], np.asarray([5, 9], np.uint32), [len(prompts[0]) + step, len(prompts[2]) + step])
    return m.batch_rows(m.forward_batch([1], np.asarray([7], np.uint32), [len(prompts[1])]), [1])[0].numpy().copy()
  assert np.array_equal(bits(waiting(True)), bits(waiting(False)))

  def step(mixed: bool) -> list[np.ndarray]:
    # a prompt's next row beside two decode rows: one window of every slot (forward_mixed), or apart
    for s in range(4): m.reset_slot(s)
    for s in (0, 1): m.prefill_rows(s, prompts[s], 0)
    m.prefill_rows(2, prompts[2][:4], 0)
    tok, at = np.asarray([5, 9], np.uint32), [len(prompts[0]), len(prompts[1])]
    if mixed:
      dec, pre = m.forward_mixed([0, 1], tok, at, 2, prompts[2][4:5], 4)
      return [r.numpy().copy() for r in m.mixed_rows(dec, [0, 1])] + [pre.numpy().copy()]
    out = [r.numpy().copy() for r in m.batch_rows(m.forward_batch([0, 1], tok, at), [0, 1])]
    return out + [m.prefill_rows(2, prompts[2][4:5], 4).numpy().copy()]
  assert m.mixes(1) and not m.mixes(2) and m.max_chunk == 16  # rows.RECURRENT_ROWS
  assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(step(True), step(False), strict=True))
  # several prompts' rows in one window, from position 0 (the scheduler's prompt_rows_in_window), beside a decode row:
  # each prompt's last row gives the bits its prompt gives alone, in chunks (RowPath._recurrent_chunk: a 40-row prompt
  # in chunks of 16, 16 and 8 rows, the last padded); and the state after it, the same next row
  long = np.asarray(PROMPT, np.uint32)
  m.reset_slot(0)
  chunked = [m.prefill_rows(0, long, 0).numpy().copy(), m.batch_rows(m.forward_batch([0], long[:1], [len(long)]), [0])[0].numpy().copy()]
  m.reset_slot(0)
  for i in range(len(long)): row = m.batch_rows(m.forward_batch([0], long[i:i + 1], [i]), [0])[0].numpy().copy()
  rowwise = [row, m.batch_rows(m.forward_batch([0], long[:1], [len(long)]), [0])[0].numpy().copy()]
  assert len(long) == 40 and all(np.array_equal(bits(a), bits(b)) for a, b in zip(chunked, rowwise, strict=True))
  n = min(len(p) for p in prompts[:3])
  for s in range(4): m.reset_slot(s)
  alone = [m.prefill_rows(s, prompts[s][:n], 0).numpy().copy() for s in range(3)]
  for s in range(4): m.reset_slot(s)
  m.prefill_rows(3, prompts[3], 0)
  assert m.prompt_rows_in_window
  for i in range(n):
    out = m.forward_batch([0, 1, 2, 3], np.asarray([prompts[s][i] for s in range(3)] + [5], np.uint32), [i, i, i, len(prompts[3]) + i])
  together = [r.numpy().copy() for r in m.batch_rows(out, [0, 1, 2])]
  assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(together, alone, strict=True))
  for n, p in family_paths.items():
    assert load_split(p, [(0, 1)], decode="batched")[0].batched == (read_header(p).arch in ROWS_ARCHS), n


@pytest.mark.parametrize("decode", ["reference", "batched"])
def test_recurrent_state_is_per_slot_and_reset_with_the_stream(family_paths, family_refs, decode):
  """qwen35, on tinygrad's kernels and on the rows path: two streams interleaved on two slots, then a new stream on a
  reused slot, each equal their solo reference runs (the recurrent state lives per slot and starts from zero with each
  stream); a recurrent stage cannot rewind."""
  ref = family_refs["qwen35"]["ref"]
  want1, want2 = family_refs["qwen35"]["tokens"][:6], reference_tokens(ref, PROMPT2, 6)
  stages = load_split(family_paths["qwen35"], [(0, 1), (1, 4)], slots=2, decode=decode)
  assert all(s.chunk == 1 for s in stages)  # the attention-only tail [1, 4) too: generate prefills one token at a time
  streams = {0: (list(family_refs["qwen35"]["prompt"]), []), 1: (list(PROMPT2), [])}
  pos = {0: 0, 1: 0}
  for s in stages:
    for slot in streams: s.reset_slot(slot)
  while any(len(o) < 6 for _, o in streams.values()):
    for slot, (prompt, out) in streams.items():
      x = np.asarray(prompt if not out else out[-1:], dtype=np.uint32)
      h = stages[0].forward(slot, x, pos[slot]).numpy().reshape(len(x), -1)
      out.append(int(stages[1].forward(slot, np.ascontiguousarray(h), pos[slot]).numpy().argmax()))
      pos[slot] += len(x)
  assert streams[0][1] == want1 and streams[1][1] == want2
  assert chain(stages, PROMPT2, 6, slot=0) == want2  # slot 0 reused: its state starts over
  with pytest.raises(errors.StreamPositionInvalid): stages[0].forward(0, np.asarray([5], np.uint32), 3)


