"""End to end: the launcher, its stage processes and the CLI, on the real SmolLM2-135M."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import SMOLLM2_CONTEXT as MAX_CONTEXT  # the shared launcher's (tests/conftest.py)
from tinymodels import TINY_MODELS, write_tiny_gguf

from pyruntime import errors
from pyruntime.engine.launcher import Delta, Done, Launcher

pytestmark = pytest.mark.slow


def run(lm: Launcher, prompt=None, **kw) -> tuple[Done, list[Delta]]:
  deltas, done = [], None
  for ev in lm.generate(prompt, **kw):
    if isinstance(ev, Delta): deltas.append(ev)
    elif isinstance(ev, Done): done = ev
  return done, deltas


def children_of(pid: int) -> list[int]:
  out = []
  for d in os.listdir("/proc"):
    if d.isdigit():
      try:
        with open(f"/proc/{d}/stat") as f: fields = f.read().rsplit(")", 1)[1].split()
      except OSError: continue
      if int(fields[1]) == pid and fields[0] != "Z": out.append(int(d))
  return out


def gone(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f: return f.read().rsplit(")", 1)[1].split()[0] == "Z"
  except OSError: return True


@pytest.fixture(scope="module")
def lm(smollm2_launcher):
  return smollm2_launcher


def test_factual_answer(lm):
  done, deltas = run(lm, "What is the capital of France?", max_tokens=24)
  assert "Paris" in done.text
  assert "".join(d.text for d in deltas) == done.text
  assert done.usage.completion_tokens == len(done.token_ids) and done.usage.prompt_tokens == len(done.prompt_token_ids)
  assert done.timings.ttft_s > 0 and done.timings.load_s > 0


STAGGERED = ["What is the capital of France?", "Write a haiku about rain.", "Hi", "List three colours.",
             "Explain what a pipeline is, in one paragraph, to someone who has never programmed a computer before.",
             "Translate 'good morning' into Spanish.", "What is 12 times 7?", "Name a famous painter."]


def test_eight_streams_at_once_equal_their_solo_runs(lm):
  """8 streams of different prompt lengths, each started once the one before it has its first token (so they are
  in flight together however fast a step is), greedy and seeded, each equal to its solo run."""
  kw = {i: dict(max_tokens=8, ignore_eos=True, **(dict(temperature=0.8, seed=i) if i % 2 else {})) for i in range(8)}
  solo = {i: run(lm, p, **kw[i])[0].token_ids for i, p in enumerate(STAGGERED)}
  before = lm.scheduler_stats()
  together: dict[int, list[int]] = {}
  started = [threading.Event() for _ in range(9)]
  started[0].set()

  def one(i: int) -> None:
    started[i].wait(600)
    ids = []
    for ev in lm.generate(STAGGERED[i], **kw[i]):
      if isinstance(ev, Delta): started[i + 1].set()
      elif isinstance(ev, Done): ids = ev.token_ids
    started[i + 1].set()
    together[i] = ids
  threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
  for t in threads: t.start()
  for t in threads: t.join(600)
  assert together == solo
  after = lm.scheduler_stats()
  assert (after["tokens"] - before["tokens"]) > (after["steps"] - before["steps"])  # some steps carried several streams


def test_max_tokens_gives_length(lm):
  done, _ = run(lm, "Count from one to one hundred in words.", max_tokens=5)
  assert done.finish_reason == "length" and done.usage.completion_tokens == 5


def test_end_token_gives_stop(lm):
  done, _ = run(lm, "Reply with the single word: yes", max_tokens=40)
  assert done.finish_reason == "stop" and done.stop is None
  assert not set(done.token_ids) & lm.tokenizer.end_ids
  assert done.usage.completion_tokens < 40


def test_ignore_eos_generates_through_end_tokens(lm):
  ended, _ = run(lm, "Reply with the single word: yes", max_tokens=40)
  assert ended.finish_reason == "stop"
  done, _ = run(lm, "Reply with the single word: yes", max_tokens=ended.usage.completion_tokens + 2, ignore_eos=True)
  assert done.finish_reason == "length" and done.usage.completion_tokens == ended.usage.completion_tokens + 2
  assert done.token_ids[:len(ended.token_ids)] == ended.token_ids
  assert done.token_ids[len(ended.token_ids)] in lm.tokenizer.end_ids


def test_stop_string_straddling_two_tokens(lm):
  full, _ = run(lm, "Write a sentence about the sea.", max_tokens=20)
  pieces = [lm.tokenizer.decode([t]) for t in full.token_ids]
  # a stop string made of the end of one token and the start of the next
  k = next(i for i in range(1, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
  stop = pieces[k][-2:] + pieces[k + 1][:2]
  cut = full.text.index(stop)
  done, deltas = run(lm, "Write a sentence about the sea.", max_tokens=20, stop=[stop, "never-seen-stop"])
  assert done.finish_reason == "stop" and done.stop == stop
  assert done.text == full.text[:cut] == "".join(d.text for d in deltas)


def test_stop_string_inside_multibyte_text(lm):
  prompt = "Les élèves étudient à l'école. Les élèves"
  full, _ = run(lm, prompt, max_tokens=12, raw=True)
  i = next((i for i, c in enumerate(full.text) if ord(c) > 127), None)
  assert i is not None, f"the model wrote no non-ASCII text: {full.text!r}"
  stop = full.text[i:i + 2]  # starts with a multi-byte character
  done, deltas = run(lm, prompt, max_tokens=12, raw=True, stop=stop)
  assert done.text == full.text[:full.text.index(stop)]
  assert all("\ufffd" not in d.text for d in deltas)


def test_seeded_sampling_repeats(lm):
  kw = dict(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
  a, _ = run(lm, "Tell me a story about a cat.", **kw)
  b, _ = run(lm, "Tell me a story about a cat.", **kw)
  c, _ = run(lm, "Tell me a story about a cat.", **dict(kw, seed=99))
  assert a.token_ids == b.token_ids
  assert c.token_ids != a.token_ids


def test_empty_prompt_and_context_errors(lm):
  with pytest.raises(errors.EmptyPrompt) as e:
    lm.generate("", raw=True)
  assert e.value.field == "prompt"
  with pytest.raises(errors.ContextLengthExceeded) as e:
    lm.generate("word " * MAX_CONTEXT, raw=True)
  assert e.value.context == MAX_CONTEXT and e.value.prompt_tokens >= MAX_CONTEXT
  assert str(MAX_CONTEXT) in str(e.value) and str(e.value.prompt_tokens) in str(e.value)
  with pytest.raises(errors.InvalidOption) as e:
    lm.generate("hi", temperature=-1)
  assert e.value.field == "temperature"
  with pytest.raises(errors.UnsupportedFeature):
    lm.generate("hi", best_of=2)
  with pytest.raises(errors.InvalidOption) as e:
    lm.generate("hi", logprobs=True)  # the alternatives per token: an integer, not a flag
  assert e.value.field == "logprobs"
  with pytest.raises(errors.InvalidOption) as e:
    lm.generate("hi", n=3)  # one iterator, one completion (submit takes n)
  assert e.value.field == "n"
  done, _ = run(lm, "Say hi.", max_tokens=3)  # the launcher still serves after refusing bad requests
  assert done.usage.completion_tokens >= 1


def test_abandoned_generation_frees_its_stream(lm):
  gen = lm.generate("Write a long poem about rivers.", max_tokens=50)
  next(ev for ev in gen if isinstance(ev, Delta) and ev.text)
  gen.close()
  done, _ = run(lm, "What is the capital of France?", max_tokens=8)
  assert done.usage.completion_tokens >= 1


CLI = [sys.executable, "-m", "pyruntime"]


def test_cli_generate_json_equals_single_process(tmp_path):
  """--decode reference runs tinygrad's own decode kernels: through the stage processes and rings, the tokens of
  tinygrad's single-process model, exactly (a tiny model: SmolLM2's stages equal it in test_model_smollm2)."""
  from tinygrad.llm.model import Transformer
  tiny = write_tiny_gguf(tmp_path / "llama.gguf", **TINY_MODELS["llama_tied"])
  out = subprocess.run([*CLI, "generate", "The quick brown fox", "--raw", "--ignore-eos", "--json", "--max-tokens", "12",
                        "--decode", "reference", "--model", str(tiny), "--max-context", "128"], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  res = json.loads(out.stdout)
  assert set(res) >= {"model", "split", "prompt_token_ids", "token_ids", "text", "finish_reason", "usage", "timings"}
  assert res["split"] == [[0, res["split"][0][1]], [res["split"][0][1], 5]] and res["finish_reason"] == "length"
  ref, _ = Transformer.from_gguf(tiny, max_context=128)
  want = [t for t, _ in zip(ref.generate(list(res["prompt_token_ids"])), range(12), strict=False)]
  assert res["token_ids"] == want
  assert res["usage"] == {"prompt_tokens": len(res["prompt_token_ids"]), "completion_tokens": 12}


def test_a_llama_file_with_a_sentencepiece_vocabulary_runs_in_two_stages(tmp_path):
  """What Llama 2 and Mistral 7B files are: llama blocks with a SentencePiece vocabulary. The launcher plans it, encodes
  the prompt as llama.cpp would (BOS, the space prefix, `▁`), and two stages on the rows path give tinygrad's own
  model's tokens for those ids."""
  from tinygrad.llm.model import Transformer
  path = write_tiny_gguf(tmp_path / "llama-spm.gguf", **TINY_MODELS["llama_tied"], tokenizer="llama", chat_template=None)
  with Launcher(str(path), stages=2, max_context=128) as lm:
    assert lm.tokenizer.spm and lm.tokenizer.add_bos
    done = next(ev for ev in lm.generate("The quick brown fox", raw=True, max_tokens=10, ignore_eos=True) if isinstance(ev, Done))
  assert done.prompt_token_ids[0] == 1 and lm.tokenizer.decode(done.prompt_token_ids[1:]) == " The quick brown fox"
  ref, _ = Transformer.from_gguf(path, max_context=128)
  assert done.token_ids == [t for t, _ in zip(ref.generate(list(done.prompt_token_ids)), range(10), strict=False)]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_launcher_signalled_mid_run_leaves_nothing(tmp_path, sig):
  """`pyruntime generate` stopped mid-run: by SIGTERM it ends its stages and unlinks its arena itself; killed with
  SIGKILL it cannot, so its orphaned stages (told by their parent-death signal) unlink that launcher's arena."""
  tiny = write_tiny_gguf(tmp_path / "llama.gguf", **dict(TINY_MODELS["llama_tied"], context=8192))  # a run of minutes
  proc = subprocess.Popen([*CLI, "generate", "The quick brown fox", "--raw", "--ignore-eos", "--max-tokens", "8000", "--model", str(tiny),
                           "--split", "0:2,2:5"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  def segments() -> list[str]: return [n for n in os.listdir("/dev/shm") if n.startswith(f"pyruntime-{proc.pid}-")]
  assert proc.stdout.read(1)  # text is flowing, so every stage is up
  stages = children_of(proc.pid)
  assert len(stages) == 2 and segments()
  proc.send_signal(sig)
  proc.wait(timeout=10)
  deadline = time.monotonic() + 10
  while time.monotonic() < deadline and not (all(gone(p) for p in stages) and not segments()): time.sleep(0.05)
  assert all(gone(p) for p in stages)
  assert not segments()
