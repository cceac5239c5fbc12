"""Text <-> token ids for GGUF vocabularies, equal to llama.cpp's tokenizer: byte-level BPE (`gpt2`) here, and
SentencePiece (`llama`) through pyruntime/text/sentencepiece.py.

The model was trained on ids produced by one specific pre-tokenizer; llama.cpp picks it by
`tokenizer.ggml.pre` (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_* -> regex_exprs). A single
llama3-style split for every preset (what tinygrad's SimpleTokenizer does) gives different ids
for GPT-2-style presets such as SmolLM2's `smollm`, so we keep llama.cpp's per-preset regex
lists here and run them through the `tokenizers` library (Split per regex, in sequence, then
byte-level BPE over the GGUF's own vocab and merges).

Special tokens are cut out before BPE with llama.cpp's own algorithm (tokenizer_st_partition:
longest token text first, every occurrence), so `parse_special` means what it means there:
control/unknown tokens are only recognised when it is set, user-defined tokens always.
"""
from __future__ import annotations

import codecs
import operator
import os
from collections.abc import Iterable, Mapping
from typing import Any

from tokenizers import Regex, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.models import BPE

from pyruntime.errors import ModelLoadFailed, TokenIdInvalid
from pyruntime.modelfile.plan import TOKENIZER_MODELS
from pyruntime.text.sentencepiece import SPACE, SentencePiece, escape

# --- llama.cpp pre-tokenizer regexes (src/llama-vocab.cpp, llm_tokenizer_bpe) -------------------
# llama.cpp spells the GPT-2 regex without the final `|\s+` but runs it through a hand-written
# splitter (unicode_regex_split_custom_gpt2) that does have the `\s+` fallback, so the HF form
# below is the one that reproduces it.
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
          r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SEED_CODER = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
              r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
         r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
         r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
         r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
          r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# pre type -> the regexes llama.cpp applies one after the other (each splits the pieces of the last)
PRE_REGEXES: dict[str, tuple[str, ...]] = {
  "default": (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
  "gpt2": (GPT2,),
  "starcoder": (r"\p{N}", GPT2),   # starcoder, refact, command-r, smollm, codeshell, exaone, minerva
  "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"),
  "llama3": (LLAMA3,),             # also dbrx, smaug, chatglm4 (same regex)
  "qwen2": (QWEN2,),
  "qwen35": (QWEN35,),
  "seed-coder": (SEED_CODER,),
  "gpt-4o": (GPT4O,),
  "tekken": (TEKKEN,),
  "bloom": (r" ?[^(\s|.,!?…。，、।۔،)]+",),
  "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"),
}

# tokenizer.ggml.pre -> (pre type, ignore_merges, add_bos default) as in llama_vocab::impl::load
_PRE: dict[str, tuple[str, bool, bool]] = {}
def _pre(names: Iterable[str], kind: str, ignore_merges: bool = False, add_bos: bool = False) -> None:
  for n in names: _PRE[n] = (kind, ignore_merges, add_bos)
_pre(["default"], "default")
_pre(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"],
     "llama3", ignore_merges=True, add_bos=True)
_pre(["dbrx", "smaug-bpe", "glm4", "chatglm-bpe"], "llama3")
_pre(["deepseek-coder"], "deepseek-coder")
_pre(["falcon"], "falcon")
_pre(["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
      "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais", "exaone4", "trillion",
      "granite-docling"], "gpt2")
_pre(["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"], "starcoder")
_pre(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"], "qwen2")
_pre(["qwen35"], "qwen35")
_pre(["seed-coder"], "seed-coder")
_pre(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], "gpt-4o")
_pre(["tekken"], "tekken", ignore_merges=True, add_bos=True)
_pre(["poro-chat", "bloom", "gpt3-finnish"], "bloom")

# llama_token_type in GGUF
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's text lists for end-of-generation / end-of-turn / FIM tokens (llama_vocab::impl::load)
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
             "<｜end▁of▁sentence｜>", "[e~[")
EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
             "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
FIM_SEP_TEXTS = ("<|file_sep|>",)


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character map (the alphabet byte-level vocabularies are written in)."""
  bs = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
  cs, n = bs[:], 0
  for b in range(256):
    if b not in bs: bs.append(b); cs.append(256 + n); n += 1
  return {b: chr(c) for b, c in zip(bs, cs, strict=True)}

BYTE_TO_UNICODE = _bytes_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}
# a NORMAL token's characters to its bytes as latin-1 characters, in one str.translate: each byte-level character to
# its byte, every other character below 256 to its UTF-8 bytes (what token_bytes gives a character outside the map);
# a character above 255 left is not latin-1, and such a token takes the character-by-character path
_TO_LATIN1 = {ord(c): chr(b) for c, b in UNICODE_TO_BYTE.items()} | \
             {i: chr(i).encode().decode("latin-1") for i in range(256) if chr(i) not in UNICODE_TO_BYTE}


CHUNK_CHARS = 16384  # a fragment longer than twice this is encoded in chunks about this long (~10 ms each, GIL held)


def chunks(text: str, size: int = CHUNK_CHARS) -> list[str]:
  """`text` cut, every `size` characters or so, just before a space between two letters: every pre-tokenizer above ends
  a piece there (the space begins the next word's piece, and BPE never merges across pieces), so the chunks' tokens
  are the whole text's. Text without such a space (digits, CJK) stays whole."""
  out, start = [], 0
  while len(text) - start > 2 * size:
    i = start + size
    while (i := text.find(" ", i + 1)) > 0 and not (text[i - 1].isalpha() and text[i + 1:i + 2].isalpha()): pass
    if i < 0: break
    out.append(text[start:i])
    start = i
  out.append(text[start:])
  return out


def _first_id(tok_to_id: Mapping[str, int], texts: Iterable[str]) -> int | None:
  return next((tok_to_id[t] for t in texts if t in tok_to_id), None)


def _end_tokens(tokens: list[str], tok_to_id: Mapping[str, int], types: list[int], found: dict[str, int | None],
                eos_id: int | None) -> tuple[int | None, frozenset[int]]:
  """The EOT id and the ids that end generation, as llama.cpp finds them; `types` is updated in place.

  llama.cpp finds EOT / EOM / FIM tokens by their text when the GGUF does not name them, forces such
  tokens to control type, and ends generation on all of them (special_eog_ids)."""
  for key, texts in (("eot", EOT_TEXTS), ("eom", ("<|eom_id|>",)), ("fim_pad", FIM_PAD_TEXTS),
                     ("fim_rep", FIM_REP_TEXTS), ("fim_sep", FIM_SEP_TEXTS)):
    if found[key] is None and (tid := _first_id(tok_to_id, texts)) is not None:
      found[key] = tid
      if types[tid] != UNKNOWN: types[tid] = CONTROL
  eog = {tok_to_id[t] for t in EOG_TEXTS if t in tok_to_id}
  for tid in eog:
    if types[tid] != UNKNOWN: types[tid] = CONTROL
  eog |= {v for k in ("fim_pad", "fim_rep", "fim_sep", "eom", "eot") if (v := found[k]) is not None}
  if eos_id is not None: eog.add(eos_id)
  for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):   # llama.cpp renders gpt-oss's always
    if t in tok_to_id: types[tok_to_id[t]] = USER_DEFINED
  # llama.cpp's exceptions: gpt-oss/solar-open '<|end|>' is not an end token; neither is gemma4's '</s>'
  texts = {tokens[i] for i in eog}
  if ({"<|return|>", "<|call|>", "<|end|>"} <= texts) or ({"<|calls|>", "<|flush|>", "<|end|>"} <= texts):
    eog.discard(tok_to_id["<|end|>"]); types[tok_to_id["<|end|>"]] = USER_DEFINED
  if {"<|tool_response>", "</s>"} <= texts: eog.discard(tok_to_id["</s>"]); types[tok_to_id["</s>"]] = NORMAL
  return found["eot"], frozenset(eog)


def _bpe(kv: Mapping[str, Any], tok_to_id: dict[str, int], regexes: tuple[str, ...], ignore_merges: bool) -> _HFTokenizer:
  """tokenizers' BPE over the byte-level vocabulary, pre-tokenized by llama.cpp's regexes; the unknown id is len(vocab).

  tokenizers refuses merges whose parts or result are not in the vocabulary; llama.cpp would merge them and then fall
  back to bytes, which no sane GGUF needs. A byte missing from the vocabulary stays a symbol in llama.cpp (blocking
  merges across it) and is dropped only at the end; tokenizers would drop it first. An out-of-range unk id keeps its place."""
  merges: list[tuple[str, str]] = []
  for m in kv.get("tokenizer.ggml.merges") or ():
    if (sp := m.find(" ", 1)) < 0: continue
    a, b = m[:sp], m[sp + 1:]
    if a in tok_to_id and b in tok_to_id and a + b in tok_to_id: merges.append((a, b))
  unk = "\uffff<unk>"
  while unk in tok_to_id: unk += "_"
  hf = _HFTokenizer(BPE({**tok_to_id, unk: len(tok_to_id)}, merges, unk_token=unk, fuse_unk=False, ignore_merges=ignore_merges))
  hf.pre_tokenizer = pre_tokenizers.Sequence(
    [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  return hf


class Tokenizer:
  """A GGUF vocabulary (tokenizer.ggml.model 'gpt2' or 'llama'), tokenizing like llama.cpp."""

  def __init__(self, kv: Mapping[str, Any]):
    model = kv.get("tokenizer.ggml.model")
    if model not in TOKENIZER_MODELS:
      raise ModelLoadFailed(f"tokenizer model {model!r} is not supported (byte-level BPE 'gpt2' and SentencePiece 'llama' are)")
    self.spm = model == "llama"
    if self.spm:  # llama.cpp's SentencePiece defaults: <unk> 0, <s> 1, </s> 2, BOS added, a space in front of the text
      self.family, self.pre_type, ignore_merges, add_bos_default = "sentencepiece", "sentencepiece", False, True
      self.regexes: tuple[str, ...] = ()
      self.add_space_prefix = bool(kv.get("tokenizer.ggml.add_space_prefix", True))
    else:
      self.family = kv.get("tokenizer.ggml.pre") or "default"
      if self.family not in _PRE: raise ModelLoadFailed(f"unknown pre-tokenizer type {self.family!r}")
      self.pre_type, ignore_merges, add_bos_default = _PRE[self.family]
      self.regexes = PRE_REGEXES[self.pre_type]
      self.add_space_prefix = False

    tokens: list[str] = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(kv["tokenizer.ggml.tokens"])]
    n = len(tokens)
    types: list[int] = list(kv.get("tokenizer.ggml.token_type") or [NORMAL] * n)[:n]
    self.vocab_size = n
    self._tokens = tokens
    tok_to_id: dict[str, int] = {}
    for i, t in enumerate(tokens):
      if tok_to_id.setdefault(t, i) != i:
        raise ModelLoadFailed(f"duplicate token in vocabulary: {t!r} has ids {tok_to_id[t]} and {i}")
    self._tok_to_id = tok_to_id

    defaults = {"unknown": 0, "bos": 1, "eos": 2} if self.spm else {}

    def special(key: str) -> int | None:
      v = kv.get(f"tokenizer.ggml.{key}_token_id", defaults.get(key))
      return int(v) if v is not None and 0 <= int(v) < n else None
    self.bos_id, self.eos_id = special("bos"), special("eos")
    self.add_bos: bool = bool(kv.get("tokenizer.ggml.add_bos_token", add_bos_default)) and self.bos_id is not None
    self.add_eos: bool = bool(kv.get("tokenizer.ggml.add_eos_token", False)) and self.eos_id is not None
    self.chat_template: str | None = kv.get("tokenizer.chat_template")
    found = {key: special(key) for key in ("eot", "eom", "fim_pad", "fim_rep", "fim_sep")}
    self.eot_id, self.end_ids = _end_tokens(tokens, tok_to_id, types, found, self.eos_id)
    self._types = types

    # llama.cpp matches special tokens longest text first; ties keep vocabulary order
    specials = sorted((i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED, UNKNOWN)),
                      key=lambda i: (-len(tokens[i]), i))
    self._specials_all = [(tokens[i], i) for i in specials]
    self._specials_user = [(tokens[i], i) for i in specials if types[i] == USER_DEFINED]

    self._unk = n   # the id _bpe gives what has no token of its own
    if self.spm: self._spm = SentencePiece(tok_to_id, list(kv.get("tokenizer.ggml.scores") or [0.0] * n), special("unknown"))
    else: self._hf = _bpe(kv, tok_to_id, self.regexes, ignore_merges)
    self._piece_cache: dict[tuple[int, bool], bytes] = {}
    # For refusing a prompt that cannot fit before tokenizing it (min_tokens): the most input bytes one
    # token can stand for. BPE output stands for one byte per byte-level character; a special token,
    # matched as text, for the UTF-8 bytes of its text. Bytes without a token of their own may be
    # dropped (no id at all), so they are not counted.
    specials_set = {i for _, i in self._specials_all}
    self.max_token_bytes: int = max(max(len(t) for t in tokens),
                                    max((len(tokens[i].encode("utf-8", "surrogatepass")) for i in specials_set), default=1), 1)
    # SentencePiece: every byte has a token (its <0xXX>, or the unknown one)
    self._untokenized_bytes = b"" if self.spm else bytes(b for b in range(256) if BYTE_TO_UNICODE[b] not in tok_to_id)

  @classmethod
  def from_gguf_kv(cls, kv: Mapping[str, Any]) -> Tokenizer: return cls(kv)

  @classmethod
  def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
    from pyruntime.modelfile.gguf import read_header
    return cls(read_header(path).kv)

  # --- encoding -------------------------------------------------------------------------------
  def _partition(self, text: str, parse_special: bool) -> list[str | int]:
    frags: list[str | int] = [text]
    for tok, tid in (self._specials_all if parse_special else self._specials_user):
      if tok not in text: continue
      out: list[str | int] = []
      for f in frags:
        if isinstance(f, int) or tok not in f: out.append(f); continue
        for j, part in enumerate(f.split(tok)):
          if j: out.append(tid)
          if part: out.append(part)
      frags = out
    return frags

  def encode(self, text: str, *, parse_special: bool = True, add_special: bool = False) -> list[int]:
    """Token ids of `text` as llama_tokenize(text, add_special, parse_special) gives them.

    add_special adds BOS/EOS where the GGUF asks for them (tokenizer.ggml.add_bos_token / add_eos_token)."""
    if not isinstance(text, str): raise TypeError(f"text must be str, not {type(text).__name__}")
    # lone surrogates cannot cross into Rust; llama.cpp sees invalid UTF-8 there and uses U+FFFD
    try: text.encode("utf-8")
    except UnicodeEncodeError: text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    frags = self._partition(text, parse_special) if text else []
    ids: list[int] = [self.bos_id] if add_special and self.add_bos and self.bos_id is not None else []
    if self.spm: self._encode_spm(frags, ids)
    else: self._encode_bpe(frags, ids)
    if add_special and self.add_eos and self.eos_id is not None: ids.append(self.eos_id)
    return ids

  def _encode_spm(self, frags: list[str | int], ids: list[int]) -> None:
    """llama.cpp's SentencePiece path: a space in front of a text fragment that starts the text or follows a special
    token (where the file's add_space_prefix asks), spaces as `▁`, then the merge by score."""
    prev_special = True
    for f in frags:
      if isinstance(f, int): ids.append(f)
      else: self._spm.encode(escape(" " + f if self.add_space_prefix and prev_special else f), ids)
      prev_special = isinstance(f, int)

  def _encode_bpe(self, frags: list[str | int], ids: list[int]) -> None:
    for f in frags:
      if isinstance(f, int):
        ids.append(f)
        continue
      # encode, not encode_batch (which lets the GIL go but starts tokenizers' thread pool in an embedder's process,
      # whose forks then warn): a long fragment goes in chunks, between which other threads run
      for part in chunks(f):
        if self._unk in (piece := self._hf.encode(part, add_special_tokens=False).ids): ids.extend(i for i in piece if i != self._unk)
        else: ids.extend(piece)

  def min_tokens(self, text: str) -> int:
    """A lower bound on len(encode(text)) found without tokenizing, in linear time: the UTF-8 bytes of
    `text` that have a token of their own, divided by the most bytes one token stands for, rounded up."""
    try: data = text.encode("utf-8")
    except UnicodeEncodeError: data = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace").encode("utf-8")  # as encode()
    n = len(data.translate(None, self._untokenized_bytes)) if self._untokenized_bytes else len(data)
    return -(-n // self.max_token_bytes)

  # --- decoding -------------------------------------------------------------------------------
  def token_text(self, token_id: int) -> str:
    """The vocabulary entry as stored in the GGUF (byte-level alphabet for normal tokens)."""
    return self._tokens[token_id]

  def token_id(self, text: str) -> int | None:
    """The id of a vocabulary entry spelled exactly `text` (as stored), or None."""
    return self._tok_to_id.get(text)

  def token_type(self, token_id: int) -> int: return self._types[token_id]

  def check_id(self, token_id: Any) -> int:
    """`token_id` as an int when it names a vocabulary entry; TokenIdInvalid for anything else
    (out of range, negative, a bool, a float, a string). numpy integers are integers."""
    if type(token_id) is not int:
      if isinstance(token_id, bool): raise TokenIdInvalid(f"token id {token_id!r} is a bool, not an integer")
      try: token_id = operator.index(token_id)
      except TypeError: raise TokenIdInvalid(f"token id {token_id!r} is a {type(token_id).__name__}, not an integer") from None
    if not 0 <= token_id < self.vocab_size:
      raise TokenIdInvalid(f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
    return token_id

  def token_bytes(self, token_id: int, *, special: bool = False) -> bytes:
    """The bytes this token stands for in output text (llama_token_to_piece).

    Control and unknown tokens render as nothing unless `special`, as in llama.cpp's output.
    Raises TokenIdInvalid for an id outside the vocabulary or one that is not an integer."""
    if type(token_id) is not int: token_id = self.check_id(token_id)   # 1.0 must not hit the cache entry of 1
    key = (token_id, special)
    if (b := self._piece_cache.get(key)) is not None: return b
    self.check_id(token_id)
    t, typ = self._tokens[token_id], self._types[token_id]
    if typ in (CONTROL, UNKNOWN): b = t.encode() if special else b""
    elif typ == USER_DEFINED: b = t.encode()
    elif typ == NORMAL and self.spm: b = t.replace(SPACE, " ").encode()  # SentencePiece: the text, `▁` a space
    elif typ == NORMAL:
      try: b = t.translate(_TO_LATIN1).encode("latin-1")  # the vocabulary's 50k tokens at start: ~0.5 s a pass otherwise
      except UnicodeEncodeError: b = b"".join(bytes([UNICODE_TO_BYTE[c]]) if c in UNICODE_TO_BYTE else c.encode() for c in t)
    elif typ == BYTE and len(t) == 6 and t.startswith("<0x"): b = bytes([int(t[3:5], 16)])
    else: b = b""
    self._piece_cache[key] = b
    return b

  def decode(self, ids: Iterable[int], *, special: bool = False) -> str:
    """The text of `ids`; TokenIdInvalid (naming the id) for one outside the vocabulary or not an integer."""
    if isinstance(ids, (str, bytes)): raise TokenIdInvalid(f"token ids must be a sequence of integers, not {type(ids).__name__}")
    try: ids = iter(ids)
    except TypeError: raise TokenIdInvalid(f"token ids must be a sequence of integers, not {type(ids).__name__}") from None
    return b"".join(self.token_bytes(i, special=special) for i in ids).decode("utf-8", "replace")


  def __repr__(self) -> str:
    return f"Tokenizer(family={self.family!r}, pre_type={self.pre_type!r}, vocab_size={self.vocab_size})"


class IncrementalDecoder:
  """Append-only text of a token stream: each push returns only new, complete characters.

  Bytes of a character split across tokens wait until the character is complete; invalid bytes
  become U+FFFD, so the concatenated deltas always equal tokenizer.decode(all ids)."""

  def __init__(self, tokenizer: Tokenizer, *, special: bool = False):
    self.tokenizer, self.special = tokenizer, special
    self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

  def push(self, token_id: int) -> str:
    return self._utf8.decode(self.tokenizer.token_bytes(token_id, special=self.special))

  def flush(self) -> str:
    """Text still held back (an incomplete character at the end becomes U+FFFD)."""
    return self._utf8.decode(b"", final=True)
