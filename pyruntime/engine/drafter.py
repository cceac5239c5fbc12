"""A draft model: a smaller GGUF with the target's vocabulary, run as a one-stage pipeline of its own (its own stage
process, its own rings), whose greedy tokens are the drafts the target verifies (docs/speculation.md, "A draft model").

Its tokens only propose: the target computes every kept token itself, so the answer is plain decoding's whatever the
draft model says. Two things keep that meaningful and safe: the vocabulary gate (a draft token id must mean the same
bytes in both models, and the special ids must agree), checked at load by a digest of the two vocabularies; and the
fallback: a draft pipeline that fails or stops answering is closed, and every stream goes on decoding plainly.
"""
from __future__ import annotations

import hashlib
import json
import logging
import queue
import time
from typing import Any, Callable

from pyruntime import errors
from pyruntime.engine.driver import StreamHandle
from pyruntime.engine.events import Done
from pyruntime.engine.request import Request

log = logging.getLogger("pyruntime.launcher")

DRAFT_TIMEOUT_S = 5.0  # a draft not back by then: the draft pipeline is taken as failed (a healthy one takes milliseconds)


def special_ids(kv: dict) -> dict[str, int]:
  return {k.removeprefix("tokenizer.ggml.").removesuffix("_token_id"): int(v) for k, v in kv.items()
          if k.startswith("tokenizer.ggml.") and k.endswith("_token_id")}


def vocab_digest(kv: dict) -> str:
  """SHA-256 of a GGUF's vocabulary: every token's bytes by id, and the special ids."""
  return hashlib.sha256(json.dumps([list(kv.get("tokenizer.ggml.tokens") or ()), sorted(special_ids(kv).items())]).encode()).hexdigest()


def check_vocab(target: dict, draft: dict) -> None:
  """DrafterVocabMismatch unless the two vocabularies' digests agree; the message names the first difference."""
  if vocab_digest(target) == vocab_digest(draft): return
  t, d = list(target.get("tokenizer.ggml.tokens") or ()), list(draft.get("tokenizer.ggml.tokens") or ())
  if (i := next((i for i, (a, b) in enumerate(zip(t, d, strict=False)) if a != b), None)) is not None:
    why = f"token {i} is {t[i]!r:.40} in the target and {d[i]!r:.40} in the draft model"
  elif len(t) != len(d): why = f"the target has {len(t)} tokens, the draft model {len(d)}"
  else:
    ts, ds = special_ids(target), special_ids(draft)
    key = next(k for k in sorted(ts.keys() | ds.keys()) if ts.get(k) != ds.get(k))
    why = f"special token {key!r} is {ts.get(key)} in the target and {ds.get(key)} in the draft model"
  raise errors.DrafterVocabMismatch(f"the draft model's vocabulary is not the target's: {why}")


class ModelDrafter:
  """Drafts for the target's driver, from the draft pipeline `lm` (a started one-stage Launcher, speculation off, its
  prefix cache on: each round is a stream of its own whose context the cache mostly holds, so a round costs the few
  positions past the last cached block and k greedy steps). Runs on the target's driver thread, only while it
  speculates (a stream or two), and blocks it for the round."""

  def __init__(self, lm: Any, on_event: Callable[[dict], None]):  # lm: a started launcher.Launcher (no import: no cycle)
    from pyruntime.params import check_request
    self.lm, self.on_event = lm, on_event
    self.greedy = check_request(1, {"temperature": 0.0})
    self.failed: str | None = None  # why the drafter stopped: every stream decodes plainly from then on
    self.rounds = 0

  def draft(self, context: list[int], k: int) -> list[int]:
    """Up to k tokens the draft model would follow `context` with (greedy); [] when it cannot say."""
    if self.failed is not None or k <= 0 or len(context) + k > self.lm.context_length: return []
    d = self.lm.driver
    events: queue.SimpleQueue = queue.SimpleQueue()
    st = StreamHandle(d, next(d.stream_ids), Request(list(context), k, self.greedy, []), events.put)
    try: d.enqueue(st)
    except errors.PyruntimeError as e: return self._fail(f"{e.code}: {e}")
    deadline = time.monotonic() + DRAFT_TIMEOUT_S
    while True:
      try: ev = events.get(timeout=max(0.0, deadline - time.monotonic()))
      except queue.Empty:
        st.cancel()
        return self._fail(f"no draft within {DRAFT_TIMEOUT_S:.0f} s")
      if isinstance(ev, BaseException): return self._fail(f"{type(ev).__name__}: {ev}")
      if isinstance(ev, Done):
        self.rounds += 1
        return ev.token_ids[:k]

  def _fail(self, why: str) -> list[int]:
    self.failed = why
    log.warning("the draft model failed (%s): every stream decodes without it from now on", why)
    self.on_event({"event": "DrafterFailed", "message": why})
    self.lm.close(grace_s=0.5)
    return []

  def stats(self) -> dict[str, Any]:
    return {"model": self.lm.model_name, "rounds": self.rounds, "failed": self.failed}

  def close(self) -> None: self.lm.close()
