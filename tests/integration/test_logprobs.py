"""Log-probabilities, scoring a prompt, several choices and the tokenizer endpoints, end to end: SmolLM2 on 2 stages
behind the server, driven by the official `openai` client (docs/serving.md#log-probabilities)."""
from __future__ import annotations

import math
import threading
import time
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from pyruntime.engine.launcher import Done
from pyruntime.params import choice_seed
from pyruntime.serving.httpd import BackgroundServer
from pyruntime.serving.server import create_app

pytestmark = pytest.mark.slow
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def live(smollm2_launcher):
  srv = BackgroundServer(create_app(smollm2_launcher, queue_size=32)).start()
  try: yield smollm2_launcher, srv, openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=300)
  finally: srv.stop()


def chat_logprobs(client: openai.OpenAI, **kw: Any) -> tuple[str, list[Any]]:
  r = client.chat.completions.create(model="default", messages=CHAT, logprobs=True, **kw)
  return r.choices[0].message.content, r.choices[0].logprobs.content


def test_chat_logprobs_are_the_models_log_softmax_streamed_or_not(live):
  lm, _, client = live
  text, entries = chat_logprobs(client, max_tokens=12, temperature=0, top_logprobs=5)
  assert "".join(e.token for e in entries) == text and len(entries) == 12
  for e in entries:
    assert len(e.top_logprobs) == 5 and e.logprob <= 0 and bytes(e.bytes).decode("utf-8", "replace") == e.token
    tops = [t.logprob for t in e.top_logprobs]
    assert tops == sorted(tops, reverse=True) and e.logprob == tops[0]  # greedy: the token taken is the likeliest
    assert math.fsum(math.exp(t) for t in tops) <= 1 + 1e-9
  streamed = [e for ch in client.chat.completions.create(model="default", messages=CHAT, max_tokens=12, temperature=0, logprobs=True,
                                                         top_logprobs=5, stream=True)
              for e in ((ch.choices[0].logprobs.content or []) if ch.choices and ch.choices[0].logprobs else [])]
  assert [(e.token, e.logprob, [t.logprob for t in e.top_logprobs]) for e in streamed] == \
         [(e.token, e.logprob, [t.logprob for t in e.top_logprobs]) for e in entries]


def test_logprobs_match_a_float64_log_softmax_of_the_logits(live):
  lm, _, _ = live
  ids = lm.prompt_ids(messages=CHAT)
  logits = next(ev for ev in lm.generate(messages=CHAT, max_tokens=1, logits=True) if not isinstance(ev, Done)).values
  done = next(ev for ev in lm.generate(messages=CHAT, max_tokens=1, temperature=0, logprobs=3) if isinstance(ev, Done))
  x = logits.astype(np.float64)
  ref = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
  s = done.logprobs[0]
  assert s.token == int(x.argmax()) and s.logprob == pytest.approx(ref[s.token], abs=1e-12)
  assert [t for t, _ in s.top] == [int(i) for i in np.argsort(-ref, kind="stable")[:3]]
  assert done.prompt_token_ids == ids


def test_sampling_does_not_change_the_logprobs_it_reports(live):
  """Temperature, top-k and penalties change what is picked, never how likely the model found it: a token sampled
  hot has the logprob the raw logits give it (the same as a greedy stream reports for that token at that place)."""
  _, _, client = live
  _, hot = chat_logprobs(client, max_tokens=1, temperature=1.5, presence_penalty=1.0, seed=3, top_logprobs=20, extra_body={"top_k": 3})
  _, cold = chat_logprobs(client, max_tokens=1, temperature=0, top_logprobs=20)
  table = {t.token: t.logprob for t in cold[0].top_logprobs}
  assert hot[0].token in table and hot[0].logprob == table[hot[0].token]
  assert [t.logprob for t in hot[0].top_logprobs] == [t.logprob for t in cold[0].top_logprobs]


def test_the_same_request_alone_and_among_eight_gives_identical_logprobs(live):
  _, _, client = live
  kw = {"max_tokens": 16, "temperature": 0.8, "seed": 11, "top_logprobs": 4}
  alone = chat_logprobs(client, **kw)
  results: dict[int, Any] = {}
  spans: dict[int, tuple[float, float]] = {}

  def one(i: int) -> None:
    t0 = time.monotonic()
    results[i] = chat_logprobs(client, **kw) if i == 0 else \
      client.chat.completions.create(model="default", messages=[{"role": "user", "content": f"Count to {i + 3}."}], max_tokens=24)
    spans[i] = (t0, time.monotonic())
  threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
  for t in threads: t.start()
  for t in threads: t.join(300)
  assert sorted(results) == list(range(8)), sorted(results)  # every one of the eight answered (an error leaves a hole)
  assert all(results[i].choices[0].finish_reason in ("stop", "length") and results[i].choices[0].message.content for i in range(1, 8))
  beside = [i for i in range(1, 8) if spans[i][0] < spans[0][1] and spans[0][0] < spans[i][1]]
  assert len(beside) >= 4, spans  # it really ran among the others, not alone before or after them
  text, entries = results[0]
  assert text == alone[0]
  assert [(e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in entries] == \
         [(e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in alone[1]]


def test_scoring_a_prompt_gives_the_logprobs_its_generation_had(live):
  """echo + logprobs + max_tokens 1 (lm-eval's loglikelihood request): the prompt's rows are scored exactly as the same
  tokens were when they were generated (a prompt row computes the bits a decode row does), the first token has none."""
  _, srv, client = live
  prompt = "The three primary colours are"
  gen = client.completions.create(model="default", prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
  glp = gen.choices[0].logprobs
  ids = httpx.post(f"{srv.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
  gen_ids = httpx.post(f"{srv.url}/tokenize", json={"prompt": prompt + gen.choices[0].text}).json()["tokens"]
  assert gen_ids[:len(ids)] == ids
  scored = client.completions.create(model="default", prompt=[gen_ids], max_tokens=1, temperature=0, echo=True, logprobs=2)
  slp = scored.choices[0].logprobs
  assert len(slp.token_logprobs) == len(gen_ids) + 1 and slp.token_logprobs[0] is None and slp.top_logprobs[0] is None
  n = len(gen_ids) - len(ids)  # the continuation, retokenized (the same ids when the text round-trips)
  assert n > 0 and gen.choices[0].text, gen  # an empty continuation would compare nothing below
  assert slp.token_logprobs[len(ids):len(gen_ids)] == glp.token_logprobs[:n]
  assert slp.top_logprobs[len(ids):len(gen_ids)] == glp.top_logprobs[:n]
  assert scored.choices[0].text.startswith(prompt + gen.choices[0].text)
  # streamed: the echo (its scores) first, then the answer's chunks, the same numbers
  chunks = list(client.completions.create(model="default", prompt=[gen_ids], max_tokens=1, temperature=0, echo=True, logprobs=2,
                                          stream=True))
  assert "".join(c.choices[0].text for c in chunks) == scored.choices[0].text
  assert [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs] == slp.token_logprobs
  # max_tokens 0: the prompt alone, and the cache never stands in for a scored row
  again = client.completions.create(model="default", prompt=[gen_ids], max_tokens=0, echo=True, logprobs=2)
  assert again.choices[0].logprobs.token_logprobs == slp.token_logprobs[:-1] and again.usage.completion_tokens == 0
  assert again.choices[0].text == prompt + gen.choices[0].text


def test_a_batch_of_token_id_prompts_answers_each_in_order(live):
  _, srv, client = live
  prompts = ["Red, green and", "One, two,", "The sky is"]
  ids = [httpx.post(f"{srv.url}/tokenize", json={"prompt": p}).json()["tokens"] for p in prompts]
  batch = client.completions.create(model="default", prompt=ids, max_tokens=5, temperature=0)
  singles = [client.completions.create(model="default", prompt=p, max_tokens=5, temperature=0) for p in prompts]
  assert [c.index for c in batch.choices] == [0, 1, 2]
  assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
  assert batch.usage.prompt_tokens == sum(len(i) for i in ids) and batch.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_n_choices_are_each_reproducible_and_count_the_prompt_once(live):
  lm, _, client = live
  kw = {"model": "default", "messages": CHAT, "max_tokens": 12, "temperature": 1.0, "seed": 21}
  r = client.chat.completions.create(n=4, **kw)
  assert [c.index for c in r.choices] == [0, 1, 2, 3] and len({c.message.content for c in r.choices}) > 1
  alone = [client.chat.completions.create(n=1, **{**kw, "seed": choice_seed(21, i)}) for i in range(4)]
  assert [a.choices[0].message.content for a in alone] == [c.message.content for c in r.choices]  # choice i: seed choice_seed(seed, i)
  assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens == len(lm.prompt_ids(messages=CHAT))  # counted once
  assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
  streamed: dict[int, str] = {}
  for ch in client.chat.completions.create(n=4, stream=True, **kw):
    for c in ch.choices: streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
  assert [streamed[i] for i in range(4)] == [c.message.content for c in r.choices]


def test_the_other_choices_read_the_first_ones_prompt_from_the_cache(live):
  from pyruntime.engine.prefix_cache import BLOCK
  lm, _, _ = live
  msgs = [{"role": "user", "content": "Describe the colour teal to someone who has never seen it, in two sentences."}]
  n_ids = len(lm.prompt_ids(messages=msgs))
  dones: dict[int, Done] = {}
  got = threading.Event()

  def on(i: int, ev: Any) -> None:
    if isinstance(ev, (Done, BaseException)):
      dones[i] = ev
      if len(dones) == 3: got.set()
  lm.submit(messages=msgs, max_tokens=4, temperature=0.7, seed=1, n=3, on_event=on)
  assert got.wait(300) and all(isinstance(d, Done) for d in dones.values())
  # the first computed its prompt (bar the template's opening, which earlier requests cached); the others read it all
  assert dones[0].usage.cached_tokens < n_ids // BLOCK * BLOCK == dones[1].usage.cached_tokens == dones[2].usage.cached_tokens


def test_the_tokenizer_endpoints_round_trip_and_name_bad_input(live):
  lm, srv, _ = live
  text = "Hello <|im_end|> wörld"
  tok = httpx.post(f"{srv.url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
  assert tok["tokens"] == lm.tokenizer.encode(text, parse_special=True) and tok["count"] == len(tok["tokens"])
  assert httpx.post(f"{srv.url}/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": text}
  msgs = httpx.post(f"{srv.url}/tokenize", json={"messages": CHAT}).json()
  assert msgs["tokens"] == lm.prompt_ids(messages=CHAT)
  info = httpx.get(f"{srv.url}/tokenizer_info").json()
  assert info["eos_token"] == "<|im_end|>" and info["chat_template"] and info["model_max_length"] == lm.context_length
  bad = httpx.post(f"{srv.url}/detokenize", json={"tokens": [1, 10 ** 9]})
  assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
  assert httpx.post(f"{srv.url}/tokenize", json={"prompt": 5}).json()["error"]["param"] == "prompt"
