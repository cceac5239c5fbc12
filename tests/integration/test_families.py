"""Mixture-of-experts, MLA and hybrid (recurrent) models through real stage processes, on tiny GGUF files: tokens equal tinygrad's
single-process Transformer, streams in flight together equal their solo runs, and the family's boundary (router
logits, MLA positions) crosses every cut."""
from __future__ import annotations

import itertools
import json
import threading
import time

import numpy as np
import pytest
from test_model import fresh
from tinymodels import TINY_FAMILIES, write_tiny_gguf

from pyruntime import errors
from pyruntime.engine.launcher import Done, Launcher
from pyruntime.modelfile.boundary import Boundary

PROMPTS = ["The quick brown fox jumps", "Hello world! Hello there, how are you?", "42"]
N = 6
SPLITS = {"qwen3moe": [(0, 1), (1, 3), (3, 4)], "glm4moe": [(0, 1), (1, 4)], "deepseek2": [(0, 2), (2, 4)],
          "qwen35": [(0, 1), (1, 3), (3, 4)], "qwen35moe": [(0, 3), (3, 4)]}
MOE = ["qwen3moe", "glm4moe", "deepseek2", "qwen35moe"]


@pytest.fixture(scope="module", params=list(SPLITS))
def family(request, tmp_path_factory):
  name = request.param
  path = write_tiny_gguf(tmp_path_factory.mktemp(name) / f"{name}.gguf", **TINY_FAMILIES[name])
  with Launcher(path, split=SPLITS[name], max_context=128, max_streams=4) as lm:
    yield name, path, lm
  assert not any(lm.alive())


def test_scoring_a_prompt_gives_the_logprobs_its_generation_had(family):
  """A MoE, MLA or hybrid pipeline scores a prompt (prompt_logprobs) with the bits its generation had: a prompt row
  computes what a decode row did, experts, latent cache and recurrent state included."""
  name, _, lm = family

  def ask(**kw) -> Done: return next(ev for ev in lm.generate(raw=True, ignore_eos=True, **kw) if isinstance(ev, Done))
  first = lm.tokenizer.encode(PROMPTS[0])
  gen = ask(prompt_ids=first, max_tokens=N, logprobs=2)
  scored = ask(prompt_ids=first + gen.token_ids, max_tokens=1, logprobs=2, prompt_logprobs=True)
  assert len(gen.logprobs) == N and len(scored.prompt_logprobs) == len(first) + N - 1
  assert scored.prompt_logprobs[len(first) - 1:] == gen.logprobs[:N], name
  # and the same scores beside a decoding stream (its rows ride in that stream's steps: mixed steps)
  started = threading.Event()
  other = lm.submit(prompt_ids=[5, 6, 7], max_tokens=60, ignore_eos=True, on_event=lambda ev: started.set())
  assert started.wait(120)
  beside = ask(prompt_ids=first + gen.token_ids, max_tokens=1, logprobs=2, prompt_logprobs=True)
  other.cancel()
  assert beside.prompt_logprobs == scored.prompt_logprobs, name


def generate(lm: Launcher, i: int) -> Done:
  return next(ev for ev in lm.generate(PROMPTS[i], raw=True, max_tokens=N, ignore_eos=True) if isinstance(ev, Done))


HYBRID = ("qwen35", "qwen35moe")
NEAR_TIE = 0.05  # logits: a hybrid's recurrent blocks compute in float16, and the rows path rounds where tinygrad's kernels do not


def chosen_by_tinygrad(ref, prompt: list[int], got: list[int], name: str, i: int) -> None:
  """Every token of `got` is tinygrad's own greedy choice after the same prefix, or within NEAR_TIE of it in tinygrad's
  logits: a hybrid's rows path agrees with tinygrad to float16's precision (RowPath._recurrent), so at a near tie the two
  may part, and comparing the tokens after that would compare different prefixes."""
  from test_model import reference_logits
  for step, (lg, t) in enumerate(zip(reference_logits(ref, prompt + got, len(prompt), len(got)), got, strict=True)):
    assert lg[t] >= lg.max() - NEAR_TIE, f"{name}: prompt {i}, token {step}: {t} at {lg[t]:.4f}, tinygrad's {int(lg.argmax())} at {lg.max():.4f}"


def test_streams_equal_reference_alone_and_together(family):
  """Each prompt alone gives tinygrad's own tokens (a hybrid's: tinygrad's choices, or within a near tie of them; one
  after another on the same slot: a hybrid's recurrent state starts over with each stream); the three in flight
  together (batched on the rows path: a hybrid's recurrent blocks one row per stream, RowPath._recurrent) give the
  same."""
  from tinygrad.llm.model import Transformer
  name, path, lm = family
  ref, _ = Transformer.from_gguf(path, max_context=128)
  solo = {}
  for i in range(len(PROMPTS)):
    d = generate(lm, i)
    if name in HYBRID: chosen_by_tinygrad(ref, list(d.prompt_token_ids), d.token_ids, name, i)
    else:
      fresh(ref)
      assert d.token_ids == list(itertools.islice(ref.generate(list(d.prompt_token_ids)), N)), f"{name}: prompt {i}"
    solo[i] = d.token_ids
  together: dict[int, list[int]] = {}

  def one(i: int) -> None:
    time.sleep(0.05 * i)
    together[i] = generate(lm, i).token_ids
  # a long stream runs beside all three, so they share steps however fast this machine runs six tokens
  tokens_before = lm.scheduler_stats()["tokens"]
  beside = lm.submit(PROMPTS[1], raw=True, max_tokens=None, ignore_eos=True, on_event=lambda ev: None)
  deadline = time.monotonic() + 60
  while lm.scheduler_stats()["tokens"] == tokens_before: assert time.monotonic() < deadline; time.sleep(0.005)
  threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
  for t in threads: t.start()
  for t in threads: t.join(300)
  still_running = beside.state == "open"
  beside.cancel()
  deadline = time.monotonic() + 60
  while beside.state != "done": assert time.monotonic() < deadline; time.sleep(0.005)  # its CLOSE came back: nothing in flight
  assert together == solo
  assert still_running, "the long stream ended before the three did: the check below would not show they shared a step"
  stats = lm.stage_stats()
  assert max(s["max_batch"] for s in stats) > 1  # they were in flight together
  # the expert load of every stage that holds a MoE block (the tail too): each token it computed went to top-k experts
  for s, (_, end) in zip(stats, SPLITS[name], strict=True):
    cfg = lm.header.kv
    k = cfg.get(f"{lm.header.arch}.expert_used_count", 0)
    holds_moe = k and end > cfg.get(f"{lm.header.arch}.leading_dense_block_count", 0)  # the dense blocks lead
    if not holds_moe: assert "expert_load" not in s or not any(s["expert_load"]); continue
    load = s["expert_load"]
    assert len(load) == cfg[f"{lm.header.arch}.expert_count"] and sum(load) == k * s["tokens"] and sum(v > 0 for v in load) > 1, load
  assert lm.expert_load() == ([s.get("expert_load") for s in stats] if name in MOE else [])  # what /metrics shows


def test_inspect_shows_a_running_servers_expert_load(family, capsys):
  """`pyruntime inspect MODEL --server URL` after a run: each stage's expert load, as the stages counted it."""
  from pyruntime.cli import commands as cli
  from pyruntime.serving.httpd import BackgroundServer
  from pyruntime.serving.server import create_app
  name, path, lm = family
  generate(lm, 1)
  with BackgroundServer(create_app(lm)) as srv:
    assert cli.main(["inspect", str(path), "--server", srv.url, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["expert_load"]
    assert cli.main(["inspect", str(path), "--server", srv.url]) == 0
    text = capsys.readouterr().out
  want = {str(i): load for i, load in enumerate(lm.expert_load()) if load is not None}
  assert shown == want and (bool(want) == (name in MOE))
  for stage, load in want.items():
    assert f"stage {stage}: {sum(load)} routings over {len(load)} experts; busiest e{int(np.argmax(load))} " in text
  if not want: assert "none counted" in text


@pytest.mark.parametrize("name", MOE)
def test_boundary_carries_router_logits_and_positions(name, tmp_path):
  """A cut after block 2: hidden_states, the router logits of block 1 (the last MoE block before the cut: the values
  tinygrad routes by, to float32's precision, a hybrid's to float16's), and for MLA the positions; a receiver refuses a
  boundary without them by name."""
  from tinygrad import Tensor
  from tinygrad.llm.model import Transformer

  from pyruntime.stage.compute.model import StageModel
  path = write_tiny_gguf(tmp_path / f"{name}.gguf", **TINY_FAMILIES[name])
  a, b = StageModel.load(path, 0, 2, max_context=128), StageModel.load(path, 2, 4, max_context=128)
  want = ["hidden_states", "router_logits"] + (["mla_position_state"] if name == "deepseek2" else [])
  assert list(a.boundary.egress.tensors) == want and a.row_bytes == 4 * a.dim + 4 * 8 + 4 * (name == "deepseek2")
  b.boundary.check_ingress(a.boundary)
  with pytest.raises(errors.BoundarySchemaMismatch): b.boundary.check_ingress(Boundary.hidden(name, 2, a.dim))
  with pytest.raises(errors.BoundarySchemaMismatch): Boundary(name, 2, {"hidden_states": ("float32", a.dim)}).validate()
  ids = np.arange(5, 15 if a.chunk > 1 else 6, dtype=np.uint32)  # recurrent blocks take one token at a time
  r = a.forward(0, ids, 0)
  buf = bytearray(a.row_bytes * len(ids))
  assert a.egress_into(r, memoryview(buf), 0, 0) == len(buf)
  parts = b.boundary.ingress.ingress_arrays(buf)
  assert np.array_equal(parts["hidden_states"], r.numpy().reshape(len(ids), -1))
  if name == "deepseek2": assert parts["mla_position_state"].reshape(-1).tolist() == list(range(len(ids)))
  # the reference's router logits of block 1, computed eagerly from its own modules
  ref, _ = Transformer.from_gguf(path, max_context=128)
  x = ref.token_embd(Tensor(ids.astype(np.int32).reshape(1, -1))).float()
  x = ref.blk[0](x, 0)
  blk = ref.blk[1]
  blk._init_state(x)
  h = x + blk._attention(blk.attn_norm(x), 0)
  # a hybrid's recurrent block computes in float16 (tinygrad's definition of it), and the rows path rounds to float16
  # where tinygrad's kernels do not always (RowPath._recurrent): its router logits agree to float16's precision
  tol = 1e-2 if a.recurrent else 1e-4
  np.testing.assert_allclose(parts["router_logits"], blk.ffn_gate_inp(blk.ffn_norm(h)).float().numpy()[0], rtol=tol, atol=tol)
  with pytest.raises(errors.ActivationExtentInvalid): b.boundary.ingress.ingress_arrays(buf[:4 * a.dim * len(ids)])  # hidden only
