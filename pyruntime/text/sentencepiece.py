"""SentencePiece vocabularies from GGUF (`tokenizer.ggml.model = "llama"`: Llama 2, Mistral 7B, Gemma, Phi-3), encoded
as llama.cpp encodes them (llama-vocab.cpp, llm_tokenizer_spm), so the ids a model was run on by llama.cpp are ours.

A fragment of text (special tokens are cut out first, by the same partition as byte-level vocabularies) has its spaces
written as U+2581 `▁` (and one put in front, where the file's `add_space_prefix` asks, at the start and after a special
token), is cut into UTF-8 characters, then merged: every adjacent pair whose text is a token is a candidate, and the
candidate whose token has the highest score is merged first (equal scores: the leftmost first), until no adjacent pair
is a token. A symbol left that is no token becomes its bytes' `<0xXX>` tokens (byte fallback; the unknown token where
the vocabulary has none).

Why by hand and not with the `tokenizers` library: its BPE merges by a rank list, its Unigram model finds the most
likely segmentation; neither is this greedy merge by score with llama.cpp's tie rule, and a file's scores need not be
a consistent rank order (Gemma's are not unique), so a library model built from them would give other ids on some
strings. The loop is a heap over candidate pairs: O(n log n) in the fragment's characters.
"""
from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

SPACE = "\u2581"  # `▁`: a space, as SentencePiece writes it


def escape(text: str) -> str: return text.replace(" ", SPACE)


class SentencePiece:
  """The greedy score merge of one vocabulary (tokens, their scores and their ids), and its byte fallback."""

  def __init__(self, tok_to_id: Mapping[str, int], scores: Sequence[float], unk_id: int | None):
    self.tok_to_id, self.scores, self.unk_id = tok_to_id, scores, unk_id
    self.byte_ids = [tok_to_id.get(f"<0x{b:02X}>", tok_to_id.get(chr(b)) if b < 128 else None) for b in range(256)]

  def encode(self, text: str, out: list[int]) -> None:
    """Append the ids of `text` (spaces already escaped) to `out`."""
    if not text: return
    sym = list(text)  # one symbol per character; a merged-away symbol becomes ""
    nxt, prv = list(range(1, len(sym))) + [-1], list(range(-1, len(sym) - 1))
    heap: list[tuple[float, int, int, int]] = []  # (-score, left, right, merged length): the best first, then the leftmost

    def add(left: int, right: int) -> None:
      if left < 0 or right < 0: return
      if (tid := self.tok_to_id.get(sym[left] + sym[right])) is None: return
      heapq.heappush(heap, (-self.scores[tid], left, right, len(sym[left]) + len(sym[right])))
    for i in range(len(sym) - 1): add(i, i + 1)
    while heap:
      _, left, right, n = heapq.heappop(heap)
      if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != n or nxt[left] != right: continue  # stale
      sym[left], sym[right] = sym[left] + sym[right], ""
      nxt[left] = nxt[right]
      if nxt[right] >= 0: prv[nxt[right]] = left
      add(prv[left], left)
      add(left, nxt[left])
    i = 0
    while i >= 0:
      if (tid := self.tok_to_id.get(sym[i])) is not None: out.append(tid)
      else: out.extend(self._byte_id(b) for b in sym[i].encode("utf-8"))
      i = nxt[i]

  def _byte_id(self, b: int) -> int:
    tid = self.byte_ids[b]
    if tid is None and self.unk_id is None: raise KeyError(f"byte {b:#04x} has no token and the vocabulary no unknown token")
    return tid if tid is not None else self.unk_id  # type: ignore[return-value]
