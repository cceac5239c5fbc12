"""The prefix cache (pyruntime/engine/prefix_cache.py, pyruntime/stage/compute/kv_blocks.py), through real stage processes on tiny models:
a stream served from the cache yields the very tokens of the same request on a launcher without one, greedy and seeded,
across stages, for the dense (rows path), MoE, MLA and hybrid families (a hybrid's recurrent state restored from a
snapshot); chat turns reuse their history; salts and opt-outs share nothing; a small budget evicts and stays exact; a
hybrid on tinygrad's own decode path runs without it and says why. The index alone is unit-tested at the end."""
from __future__ import annotations

import threading

import pytest
from tinymodels import TINY_FAMILIES, TINY_MODELS, write_tiny_gguf

from pyruntime import errors
from pyruntime.engine.launcher import Done, Launcher
from pyruntime.engine.prefix_cache import BLOCK, PrefixIndex
from pyruntime.modelfile.gguf import read_header
from pyruntime.modelfile.plan import kv_bytes_per_position, prefix_cache_bytes_per_token, recurrent_state_bytes

SYSTEM = "The quick brown fox jumps over the lazy dog. A tiny model has tiny weights, but the tokenizer is real. " * 2
QUESTIONS = ["Hello world! Hello there, how are you?", "What is the answer to the question?", "The dog sleeps in the sun."]
SAMPLED = dict(temperature=0.9, seed=5)
COMPARED = ("llama", "qwen3moe", "deepseek2", "qwen35")  # the families whose cached turns are compared with uncached ones


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
  folder = tmp_path_factory.mktemp("prefix")
  models = {"llama": TINY_MODELS["llama_tied"], **{k: TINY_FAMILIES[k] for k in ("qwen3moe", "deepseek2", "qwen35")}}
  return {name: write_tiny_gguf(folder / f"{name}.gguf", **kw, context=512) for name, kw in models.items()}


def done(lm: Launcher, **kw) -> Done:
  return next(ev for ev in lm.generate(max_tokens=kw.pop("max_tokens", 12), ignore_eos=True, **kw) if isinstance(ev, Done))


def chat(lm: Launcher, turns: list[str], **options) -> list[Done]:
  """A conversation that resends its history at every turn."""
  messages, out = [{"role": "system", "content": SYSTEM}], []
  for q in turns:
    messages.append({"role": "user", "content": q})
    out.append(done(lm, messages=list(messages), **options))
    messages.append({"role": "assistant", "content": out[-1].text})
  return out


@pytest.fixture(scope="module")
def cold(paths):
  """What a launcher without a prefix cache answers: the reference for each family in COMPARED."""
  out = {}
  for name in COMPARED:
    with Launcher(paths[name], stages=2, max_context=512, prefix_cache=0) as lm:
      out[name] = {"greedy": chat(lm, QUESTIONS), "sampled": chat(lm, QUESTIONS, **SAMPLED)}
      assert lm.prefix_cache_stats() == {"enabled": False, "why": "off (prefix_cache=0)"}
  return out


@pytest.mark.parametrize("name", COMPARED)
def test_cached_turns_equal_a_launcher_without_the_cache(paths, cold, name):
  """Three chat turns, greedy and seeded, twice over: every turn's tokens equal the uncached launcher's, later turns
  find their history (and the second conversation the first's) in the cache, and usage says how many tokens came from it."""
  with Launcher(paths[name], stages=2, max_context=512) as lm:
    for kind, sampling in (("greedy", {}), ("sampled", SAMPLED)):
      for round_ in range(2):
        got = chat(lm, QUESTIONS, **sampling)
        for i, (a, b) in enumerate(zip(got, cold[name][kind], strict=True)):
          assert a.token_ids == b.token_ids, f"{name} {kind} round {round_} turn {i}"
          assert b.usage.cached_tokens == 0 and 0 <= a.usage.cached_tokens < a.usage.prompt_tokens
          assert a.usage.cached_tokens % BLOCK == 0
        if round_: assert all(d.usage.cached_tokens for d in got), [d.usage.cached_tokens for d in got]
        else: assert all(d.usage.cached_tokens for d in got[1:])
    stats = lm.prefix_cache_stats()
    assert stats["enabled"] and stats["hits"] >= 8 and stats["hit_tokens"] > 0 and stats["bytes_held"] > 0
    # what `inspect` says from the header alone is what the stages hold: keys and values per position, and with
    # recurrent blocks (qwen35) one state snapshot per PREFIX_STATE_TOKENS of the budget
    h = read_header(paths[name])
    state = recurrent_state_bytes(h, 0, h.num_blocks)
    assert bool(state) == (name == "qwen35") and bool(stats["states"]) == bool(state) and bool(stats["held_states"]) == bool(state)
    assert stats["bytes_budget"] == stats["blocks"] * BLOCK * kv_bytes_per_position(h, 0, h.num_blocks) + stats["states"] * state
    assert stats["bytes_budget"] <= stats["blocks"] * BLOCK * prefix_cache_bytes_per_token(h)
    # every compared family runs the rows path (dense, MoE, MLA: a decode row is a prompt row), so each caches replies
    assert stats["caches_decoded_positions"]


@pytest.mark.parametrize("name", ["llama", "deepseek2", "qwen35"])
def test_a_reply_is_cached_on_the_rows_path(paths, name):
  """The next turn of a conversation finds the previous reply's tokens in the cache, not only the prompt's (an MLA
  model's too: its latent cache's decoded positions are prompt rows' positions). The turn resends the reply's token ids: a tiny model's reply is
  random bytes, which a chat template's text would not give back token for token."""
  with Launcher(paths[name], stages=2, max_context=512) as lm:
    first = lm.tokenizer.encode(SYSTEM + QUESTIONS[0])
    a = done(lm, prompt_ids=first, max_tokens=40)
    b = done(lm, prompt_ids=first + a.token_ids + lm.tokenizer.encode(QUESTIONS[1]), max_tokens=4)
    assert b.usage.cached_tokens > len(first)  # beyond the first prompt: into its reply


def test_salts_and_opt_outs_share_nothing(paths, cold):
  with Launcher(paths["llama"], stages=2, max_context=512) as lm:
    ask = dict(messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}])
    first = done(lm, **ask, cache_salt="tenant-a")
    assert first.usage.cached_tokens == 0
    assert done(lm, **ask, cache_salt="tenant-a").usage.cached_tokens > 0
    assert done(lm, **ask, cache_salt="tenant-b").usage.cached_tokens == 0
    assert done(lm, **ask).usage.cached_tokens == 0  # no salt: another tenant too
    n = lm.prefix_cache_stats()["held_blocks"]
    off = done(lm, **ask, prefix_cache=False, cache_salt="tenant-c")
    assert off.usage.cached_tokens == 0 and off.token_ids == first.token_ids == cold["llama"]["greedy"][0].token_ids
    assert lm.prefix_cache_stats()["held_blocks"] == n  # it took nothing, and left nothing
    assert done(lm, **ask, cache_salt="tenant-c").usage.cached_tokens == 0
    for bad in ({"cache_salt": 5}, {"prefix_cache": "no"}):
      with pytest.raises(errors.InvalidOption): lm.submit(messages=ask["messages"], on_event=lambda ev: None, **bad)


def test_a_small_budget_evicts_and_stays_exact(paths, cold):
  """Room for 6 blocks, two tenants' conversations (salts) taking turns: each evicts the other's blocks, the counters
  say so, the budget holds, and every answer is still exact."""
  with Launcher(paths["llama"], stages=2, max_context=512, prefix_cache=6 * BLOCK) as lm:
    for i in range(4):
      got = chat(lm, QUESTIONS[:2], cache_salt=f"tenant-{i % 2}")
      assert [d.token_ids for d in got] == [d.token_ids for d in cold["llama"]["greedy"][:2]]
    s = lm.prefix_cache_stats()
    assert s["evictions"] > 0 and s["held_blocks"] <= 6 and s["bytes_held"] <= s["bytes_budget"]


def test_concurrent_streams_share_a_system_prompt(paths, cold):
  """Streams arriving while the first one is still generating find its prompt in the cache (it is saved once the prompt
  is in, not at the end), and each answers exactly as alone."""
  want = cold["llama"]["greedy"]
  with Launcher(paths["llama"], stages=2, max_context=512) as lm:
    first_token = threading.Event()
    ask = lambda q: [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]  # noqa: E731
    events: list = []
    h = lm.submit(messages=ask(QUESTIONS[0]), max_tokens=40, ignore_eos=True,
                  on_event=lambda ev: (events.append(ev), first_token.set()))
    assert first_token.wait(120)
    others = [done(lm, messages=ask(q)) for q in QUESTIONS[1:]]
    h.cancel()
    for d, q in zip(others, QUESTIONS[1:], strict=True):
      assert d.usage.cached_tokens >= len(SYSTEM) // 8, q  # most of the system prompt at least
    # each equals a solo first turn on the uncached launcher (cold's first turn asked QUESTIONS[0]: compare by prompt)
    with Launcher(paths["llama"], stages=2, max_context=512, prefix_cache=0) as ref:
      assert [d.token_ids for d in others] == [done(ref, messages=ask(q)).token_ids for q in QUESTIONS[1:]]
    assert want  # the module's reference ran on the same model


def test_a_hybrid_repeats_and_choices_start_from_its_kept_state(paths, cold):
  """A hybrid's prompt asked again (its length a multiple of BLOCK too: the state one block back is kept for it), and
  `n` choices of one prompt, start from a kept recurrent state and answer as the uncached launcher; in one stage too."""
  with Launcher(paths["qwen35"], stages=1, max_context=512) as lm, Launcher(paths["qwen35"], stages=1, max_context=512, prefix_cache=0) as ref:
    ids = lambda lead, k: [lead] + lm.tokenizer.encode(SYSTEM)[:k - 1]  # noqa: E731 - a first token of its own: shares nothing
    for lead, k in ((5, 3 * BLOCK), (6, 3 * BLOCK + 5)):
      want = done(ref, prompt_ids=ids(lead, k))
      first, again = done(lm, prompt_ids=ids(lead, k)), done(lm, prompt_ids=ids(lead, k))
      assert first.token_ids == again.token_ids == want.token_ids
      assert first.usage.cached_tokens == 0 and again.usage.cached_tokens == (k - 1) // BLOCK * BLOCK
    got, alone = choices(lm, ids(7, 2 * BLOCK + 8), 3), choices(ref, ids(7, 2 * BLOCK + 8), 3)
    assert [d.token_ids for d in got] == [d.token_ids for d in alone]
    assert [d.usage.cached_tokens for d in got] == [0, 2 * BLOCK, 2 * BLOCK]  # the first computed it, the others read it
    assert lm.prefix_cache_stats()["hits"] == 4


def choices(lm: Launcher, ids: list[int], n: int) -> list[Done]:
  """`n` seeded choices of one prompt, in order."""
  dones: dict[int, Done] = {}
  got = threading.Event()

  def on(i: int, ev) -> None:
    if isinstance(ev, (Done, BaseException)):
      dones[i] = ev
      if len(dones) == n: got.set()
  lm.submit(prompt_ids=ids, n=n, max_tokens=6, ignore_eos=True, on_event=on, **SAMPLED)
  assert got.wait(300) and all(isinstance(d, Done) for d in dones.values()), dones
  return [dones[i] for i in range(n)]


def test_a_hybrid_on_tinygrads_decode_path_runs_without_it_and_says_why(paths):
  """decode='reference': tinygrad's kernels keep the recurrent state where no snapshot is taken; no prefix cache, no scoring."""
  with Launcher(paths["qwen35"], stages=2, max_context=512, decode="reference") as lm:
    s = lm.prefix_cache_stats()
    assert not s["enabled"] and "keeps no blocks" in s["why"]
    with pytest.raises(errors.InvalidOption) as e: done(lm, prompt_ids=[5, 6, 7], prompt_logprobs=True, logprobs=0)
    assert e.value.field == "prompt_logprobs"  # nor can tinygrad's own kernels score a prompt's every row
    a, b = (done(lm, messages=[{"role": "user", "content": QUESTIONS[0]}]) for _ in range(2))
    assert a.token_ids == b.token_ids and a.usage.cached_tokens == b.usage.cached_tokens == 0


# --- the index alone ---------------------------------------------------------------------------------
def test_index_matches_whole_blocks_and_leaves_the_last_token():
  ix = PrefixIndex(8, 4)
  toks = list(range(100, 113))  # 13 tokens: 3 full blocks
  assert ix.match(toks) == []
  saves = ix.insert(toks)
  assert [p for _, p in saves] == [0, 4, 8] and len({b for b, _ in saves}) == 3
  assert ix.match(toks) == [b for b, _ in saves]          # 12 of 13: the last token is computed
  assert ix.match(toks[:12]) == [b for b, _ in saves][:2]  # 12 tokens: at most 11 from the cache, so 2 blocks
  assert ix.match(toks[:5] + [0] * 8) == [saves[0][0]]     # diverges in the second block
  assert ix.match(toks, salt="x") == [] and ix.insert(toks) == []  # salted: nothing; again: nothing new to save
  assert ix.snapshot()["hits"] == 3


def test_index_evicts_least_recently_used_leaves_first():
  ix = PrefixIndex(4, 2)
  a, b = [1, 2, 3, 4, 5], [1, 2, 7, 8, 9]          # share their first block
  ix.insert(a + [6]); ix.insert(b + [0])            # a: 3 blocks, b: its 2 new blocks -> 5 wanted, 4 held
  assert ix.snapshot()["evictions"] == 1 and ix.held_blocks == 4
  assert len(ix.match(b + [0, 1])) == 3             # b's chain is whole
  assert len(ix.match(a + [6, 1])) == 2             # a lost its last (least recently used leaf) block, not the shared one
  full = PrefixIndex(2, 2)
  assert len(full.insert([1, 2, 3, 4, 5, 6])) == 2  # no room for the third block: the chain stops, nothing breaks


def test_index_with_recurrent_state_matches_to_the_last_kept_state():
  """With recurrent blocks a prefix is usable only up to a block that ends in a kept state; snapshots are evicted least
  recently used first, never one on the chain being saved, and a dropped block gives its snapshot back."""
  ix = PrefixIndex(8, 4, states=2)
  toks = list(range(100, 113))  # 13 tokens: 3 full blocks
  saves = ix.insert(toks)
  assert len(saves) == 3 and ix.match(toks) == []  # blocks, but no state: nothing to start from
  s = ix.attach_state(toks[:8])
  assert s is not None and ix.attach_state(toks[:8]) is None  # kept already: the same tokens give the same state
  got = ix.match(toks)
  assert got == [b for b, _ in saves][:2] and ix.state_of(got[-1]) == s
  other = list(range(200, 209))
  ix.insert(other)
  s2 = ix.attach_state(other[:8])
  assert s2 not in (None, s) and len(ix.match(other)) == 2
  s3 = ix.attach_state(toks[:12])  # no snapshot free: `other`'s (least recently used, not on this chain) goes
  assert s3 == s2 and ix.match(other) == [] and len(ix.match(toks + [1])) == 3
  snap = ix.snapshot()
  assert snap["state_evictions"] == 1 and snap["held_states"] == 2 and snap["states"] == 2
  small = PrefixIndex(2, 4, states=1)
  small.insert([1, 2, 3, 4, 5])
  assert small.attach_state([1, 2, 3, 4]) == 0
  small.insert([7, 8, 9, 10, 11, 12, 13, 14, 15])  # two new blocks: the first chain's block is evicted, its snapshot freed
  assert small.snapshot()["held_states"] == 0 and small.attach_state([7, 8, 9, 10, 11, 12, 13, 14]) == 0
