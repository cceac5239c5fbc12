"""A draft model (pyruntime/engine/drafter.py, docs/speculation.md "A draft model"): the vocabulary gate alone; then on tiny GGUF
pairs through real stage processes, the target's tokens with a draft model are plain decoding's (a draft model that
is the target itself gets its drafts accepted, a different one mostly rejected: the same tokens either way); a
vocabulary that differs, a missing or corrupt file are refused by name at start with nothing left; a draft stage that
dies mid-stream leaves every stream decoding plainly, its tokens unchanged."""
from __future__ import annotations

import os
import signal

import pytest
from tinymodels import TINY_MODELS, write_tiny_gguf

from pyruntime import errors
from pyruntime.engine.drafter import check_vocab, vocab_digest
from pyruntime.engine.launcher import Done, Launcher

REPEATING = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown"
PROMPTS = [REPEATING, "Hello world! Hello there, how are you? Hello world! Hello", "In the beginning"]
KV = {"tokenizer.ggml.tokens": ["a", "b", "<s>", "</s>"], "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 3}


def test_the_gate_compares_every_tokens_bytes_and_the_special_ids():
  check_vocab(KV, dict(KV))
  assert vocab_digest(KV) == vocab_digest(dict(KV, **{"general.name": "another model"}))  # only the vocabulary counts
  with pytest.raises(errors.DrafterVocabMismatch, match=r"token 1 is 'b' in the target and 'c'"):
    check_vocab(KV, dict(KV, **{"tokenizer.ggml.tokens": ["a", "c", "<s>", "</s>"]}))
  with pytest.raises(errors.DrafterVocabMismatch, match="4 tokens, the draft model 5"):
    check_vocab(KV, dict(KV, **{"tokenizer.ggml.tokens": ["a", "b", "<s>", "</s>", "x"]}))
  with pytest.raises(errors.DrafterVocabMismatch, match="special token 'eos' is 3 in the target and 2"):
    check_vocab(KV, dict(KV, **{"tokenizer.ggml.eos_token_id": 2}))
  with pytest.raises(errors.DrafterVocabMismatch, match="special token 'eot'"):
    check_vocab(KV, dict(KV, **{"tokenizer.ggml.eot_token_id": 3}))


def ask(lm: Launcher, prompt: str, **kw) -> Done:
  kw.setdefault("max_tokens", 40)
  return next(ev for ev in lm.generate(prompt, raw=True, **kw) if isinstance(ev, Done))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
  d = tmp_path_factory.mktemp("drafter")
  return {"target": str(write_tiny_gguf(d / "target.gguf", **TINY_MODELS["llama_tied"])),
          "other": str(write_tiny_gguf(d / "other.gguf", **{**TINY_MODELS["llama_tied"], "n_blocks": 2, "seed": 7})),
          "vocab280": str(write_tiny_gguf(d / "v280.gguf", **{**TINY_MODELS["llama_tied"], "vocab_size": 280}))}


@pytest.fixture(scope="module")
def plain(models):
  with Launcher(models["target"], split=[(0, 2), (2, 5)], max_context=256) as lm:
    yield {p: ask(lm, p) for p in PROMPTS}


def drafted(lm: Launcher, plain: dict[str, Done]) -> list[Done]:
  """Every prompt through `lm`: plain decoding's tokens and text, whatever the draft model proposed."""
  got = [ask(lm, p) for p in PROMPTS]
  for p, d in zip(PROMPTS, got, strict=True): assert (d.token_ids, d.text) == (plain[p].token_ids, plain[p].text), p
  return got


@pytest.mark.integration
def test_another_models_drafts_change_no_token(models, plain):
  with Launcher(models["target"], split=[(0, 2), (2, 5)], max_context=256, speculative=f"model:{models['other']}") as lm:
    drafted(lm, plain)
    stats = lm.scheduler_stats()["speculation"]
  assert stats["draft_model"]["rounds"] > 0 and stats["draft_model"]["failed"] is None and stats["drafted"] > 0


@pytest.mark.integration
def test_a_draft_model_of_another_vocabulary_is_refused_at_start(models):
  lm = Launcher(models["target"], stages=2, max_context=256, speculative=f"model:{models['vocab280']}")
  with pytest.raises(errors.DrafterVocabMismatch, match="vocabulary is not the target's"): lm.start()
  assert not lm.handles and lm.arena is None  # refused before anything was spawned


@pytest.mark.integration
def test_a_missing_or_corrupt_draft_model_is_named(models, tmp_path):
  with pytest.raises(errors.GgufLocalPathMissing): Launcher(models["target"], stages=1, speculative=f"model:{tmp_path}/none.gguf").start()
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(b"GGUF" + os.urandom(64))
  with pytest.raises(errors.PyruntimeError) as e: Launcher(models["target"], stages=1, speculative=f"model:{bad}").start()
  assert not isinstance(e.value, errors.DrafterVocabMismatch)


@pytest.mark.integration
def test_own_drafts_are_accepted_and_a_draft_stage_that_dies_leaves_every_stream_decoding_plainly(models, plain):
  """The target as its own draft model: its drafts are its own tokens, so nearly all are accepted; then its draft stage
  is killed, and every stream goes on with plain decoding's tokens, the target's stages untouched."""
  seen: list[dict] = []
  with Launcher(models["target"], split=[(0, 2), (2, 5)], max_context=256, speculative=f"model:{models['target']}", on_event=seen.append) as lm:
    got = drafted(lm, plain)
    assert sum(d.timings.accepted_tokens for d in got) >= 0.8 * sum(d.timings.drafted_tokens for d in got) > 0
    draft = lm.drafter.lm.handles[0].proc
    os.kill(draft.pid, signal.SIGKILL)
    draft.wait(10)
    drafted(lm, plain)
    assert any(ev.get("event") == "DrafterFailed" for ev in seen)
    assert lm.scheduler_stats()["speculation"]["draft_model"]["failed"]
    assert all(lm.alive())  # the target's own stages run on
