"""lm-evaluation-harness (`lm-eval[api]`, 0.4.x) scoring SmolLM2 through the server, as evaluators run it: its
`local-completions` model, token-id prompts in batches, `echo` + `logprobs` for loglikelihood, the tokenizer read from
our `/tokenizer_info`, `/tokenize` (its `remote` backend), offline (no hub), on two tasks written here. The scores it
computes must be the ones the launcher gives for the same tokens (docs/serving.md#scoring-a-prompt)."""
from __future__ import annotations

import json
import math
import socket

import pytest

from pyruntime.engine.launcher import Done
from pyruntime.serving.httpd import BackgroundServer
from pyruntime.serving.server import create_app

pytestmark = pytest.mark.slow

MC = [{"question": "What is the capital of France?", "choices": ["Paris", "Banana", "Seven"], "label": 0},
      {"question": "How many legs does a spider have?", "choices": ["Two", "Eight", "Blue"], "label": 1}]
GEN = [{"question": "The capital of France is", "answer": "Paris"}]
TASKS = {"pyr_mc": """task: pyr_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: label
metric_list:
  - metric: acc
""", "pyr_gen": """task: pyr_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
generation_kwargs: {until: ["\\n"], max_gen_toks: 12, do_sample: false, temperature: 0.0}
metric_list:
  - metric: exact_match
"""}


@pytest.fixture
def offline(monkeypatch, tmp_path):
  """No hub, no dataset server: any connection but to this machine is refused, and the hub libraries are told so."""
  stock = socket.socket.connect

  def connect(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1", "localhost"):
      raise ConnectionRefusedError(f"test_lm_eval is offline: {address}")
    return stock(self, address)
  monkeypatch.setattr(socket.socket, "connect", connect)
  for k, v in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf"), "HF_HOME": str(tmp_path / "hf"),
               "OPENAI_API_KEY": "x"}.items():
    monkeypatch.setenv(k, v)


def score(lm, context: str, continuation: str) -> float:
  """The launcher's own log-likelihood of `continuation` after `context`, tokenized as lm-eval does (the context alone,
  then the whole, the continuation being the difference)."""
  ctx = lm.tokenizer.encode(context, parse_special=True)
  whole = lm.tokenizer.encode(context + continuation, parse_special=True)
  done = next(ev for ev in lm.generate(prompt_ids=whole, max_tokens=0, logprobs=0, prompt_logprobs=True) if isinstance(ev, Done))
  return math.fsum(s.logprob for s in done.prompt_logprobs[len(ctx) - 1:])


def test_lm_eval_local_completions_scores_and_generates_through_the_server(smollm2_launcher, offline, tmp_path):
  import lm_eval
  from lm_eval.tasks import TaskManager
  lm = smollm2_launcher
  (tmp_path / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC))
  (tmp_path / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN))
  for name, text in TASKS.items(): (tmp_path / f"{name}.yaml").write_text(text.replace("{data}", str(tmp_path)))
  with BackgroundServer(create_app(lm, queue_size=32)) as srv:
    res = lm_eval.simple_evaluate(
      model="local-completions", tasks=list(TASKS), task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
      model_args={"model": "default", "base_url": f"{srv.url}/v1/completions", "tokenizer_backend": "remote", "max_retries": 1,
                  "max_length": 512, "batch_size": 2},
      num_fewshot=0, log_samples=True)
  # loglikelihood: each choice's score is the launcher's for the same tokens, and the pick is the likeliest choice
  for sample in res["samples"]["pyr_mc"]:
    doc, ctx = sample["doc"], f"Question: {sample['doc']['question']}\nAnswer:"
    got = [r[0][0] for r in sample["resps"]]
    want = [score(lm, ctx, " " + c) for c in doc["choices"]]
    assert got == pytest.approx(want, abs=1e-9)
    assert sample["acc"] == float(max(range(len(want)), key=want.__getitem__) == doc["label"])
  accs = {s["doc"]["question"]: s["acc"] for s in res["samples"]["pyr_mc"]}
  assert accs[MC[0]["question"]] == 1.0 and res["results"]["pyr_mc"]["acc,none"] == sum(accs.values()) / len(accs)
  # generate_until: the text is the server's greedy answer, cut at the task's stop
  (sample,) = res["samples"]["pyr_gen"]
  ids = lm.tokenizer.encode(GEN[0]["question"], parse_special=True)
  done = next(ev for ev in lm.generate(prompt_ids=ids, max_tokens=12, temperature=0, stop=["\n"]) if isinstance(ev, Done))
  assert sample["resps"][0][0] == done.text and "Paris" in done.text
