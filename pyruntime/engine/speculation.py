"""Speculative decoding's drafter and its draft length (docs/speculation.md).

The drafter is prompt lookup (n-grams): the stream's last tokens are looked up earlier in its prompt and output, and
the tokens that followed there are the draft. No second model. The pipeline verifies a draft as one record of rows
(the last token and the draft), which every stage computes through the rows path with the bits of decode rows
(docs/prompt-path.md); the tail samples every row, and the launcher keeps the longest prefix the model agrees with
plus the model's own next token, so the output is the output of plain decoding, token for token.

The draft length adapts: per stream to how much of its drafts the model accepted (a stream whose drafts fail drafts
none, and probes again later), and to load (no drafts while the pipeline has more streams than
`SOLO_STREAMS`: a draft rides in a step as a prompt chunk does, and one chunk per step would hold the others back).
"""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_NGRAM = 4         # the longest suffix looked up
MIN_NGRAM = 2         # shorter matches draft too often wrongly to pay for their rows
SOLO_STREAMS = 2      # more streams running than this: no drafts (the batch is the better use of a step)
POSITIONS = 15        # draft positions counted apart (a draft is at most MAX_VERIFY_ROWS - 1 long)
PROBE_EVERY = 8       # a stream that drafts nothing tries again after this many tokens
PROBE_MAX = 128       # ... twice as many after each try that did not pay, up to this many
MIN_ACCEPTED = 1.5    # tokens a round must keep on average beyond its own: a verify round costs about 2.5 plain steps here
# ... with recurrent blocks (hybrids): the record runs in the recurrent chunk graph (the recurrence row after row inside
# it: 8 rows ~3.4 one-row steps on a small qwen35, a dense model's ~2.4) and a rejection takes the kept rows again
# (StageModel.rewind); a record that crosses a prefix-cache block boundary runs as two chunks. Measured on a small
# random qwen35 (bench/speculative.py --family qwen35): a round that keeps nothing costs ~4.5 plain tokens' time, and
# with 2.0 here drafts that kept ~1.4 a round cost 0.71x against 0.83x with this
MIN_ACCEPTED_RECURRENT = 4.0


def ngram_draft(tokens: list[int], k: int, max_n: int = MAX_NGRAM, min_n: int = MIN_NGRAM) -> list[int]:
  """Up to k tokens that followed an earlier occurrence of the longest suffix of `tokens` (max_n down to min_n tokens
  long): the latest occurrence with k tokens after it (the most recent context repeats best; one just before the end has
  too few), else the one with the most; [] when none occurs."""
  if k <= 0: return []
  n_tok = len(tokens)
  for n in range(min(max_n, n_tok - 1), min_n - 1, -1):
    tail, best = tokens[n_tok - n:], []
    for start in range(n_tok - n - 1, -1, -1):
      if tokens[start:start + n] == tail:
        follow = tokens[start + n:start + n + k]
        if len(follow) > len(best): best = follow
        if len(best) == k: break
    if best: return best
  return []


def prediction_draft(out: list[int], predicted: list[int], k: int, max_n: int = MAX_NGRAM) -> list[int]:
  """Up to k tokens of a caller's predicted output (OpenAI's `prediction`) that should come next: its start while the
  answer is empty, else what follows the longest suffix of the answer (max_n down to 1 token) found in it, at the
  occurrence nearest to where the answer stands; [] when the answer has left it."""
  if k <= 0 or not predicted: return []
  if not out: return predicted[:k]
  n_out = len(out)
  for n in range(min(max_n, n_out), 0, -1):
    tail = out[n_out - n:]
    starts = [s for s in range(len(predicted) - n) if predicted[s:s + n] == tail]
    if starts:
      s = min(starts, key=lambda s: abs(s + n - n_out))
      if follow := predicted[s + n:s + n + k]: return follow
  return []


class DraftLength:
  """One stream's draft length. A verify record runs in the stages' short graph that fits its rows (with packed
  weights: 8 or 16 rows, so a draft of 7 costs about what a shorter one does, docs/speculation.md): drafts are as long
  as the limit while they pay, i.e. while the tokens accepted per round (a moving average) cover a round's extra cost
  over a plain step (`min_accepted`: MIN_ACCEPTED, or MIN_ACCEPTED_RECURRENT with recurrent blocks); below that the stream drafts
  nothing, and after PROBE_EVERY plain tokens it tries again. A draft model's drafts cost steps of their own, unlike a
  prompt lookup's, so with `backoff` the wait doubles after each probe that did not pay (up to PROBE_MAX: a draft model
  that never agrees costs a round every PROBE_MAX tokens at most), and `paying`, `wait` start a stream where the draft
  model's recent rounds over every stream left off. (Prompt lookup keeps probing every PROBE_EVERY tokens: a stream's
  own output often starts repeating late, and a lookup that finds nothing costs nothing.)"""

  def __init__(self, limit: int, paying: bool = True, wait: int = PROBE_EVERY, backoff: bool = False, min_accepted: float = MIN_ACCEPTED):
    self.limit, self.idle, self.wait, self.probing, self.backoff = limit, 0, wait, False, backoff
    self.min_accepted = min_accepted  # what a round must keep beyond its own token to pay (the stages' models say)
    self.k, self.mean = (limit, float(limit)) if paying else (0, 0.0)

  def next(self) -> int:
    if self.k > 0 or self.limit == 0: return self.k
    self.idle += 1
    if self.idle >= self.wait: self.idle, self.k, self.mean, self.probing = 0, self.limit, self.min_accepted, True
    return self.k

  def update(self, drafted: int, accepted: int) -> None:
    if drafted == 0: return
    self.mean = 0.5 * self.mean + 0.5 * accepted
    if self.mean >= self.min_accepted: self.k, self.wait = self.limit, PROBE_EVERY
    else: self.k, self.wait = 0, min(2 * self.wait, PROBE_MAX) if self.probing and self.backoff else PROBE_EVERY
    self.probing = False


@dataclass
class Drafting:
  """One stream's speculation: its draft length (None: it decodes plainly), the caller's prediction, the draft in flight
  (position, drafts, the answers so far) and what its rounds kept."""
  length: DraftLength | None = None
  predicted: list[int] = field(default_factory=list)  # OpenAI's `prediction`, tokenized: a drafter of its own
  verify: tuple[int, list[int], dict[int, tuple[int, bool]]] | None = None
  from_prediction: bool = False  # the draft in flight came from the prediction
  rounds: int = 0
  drafted: int = 0
  accepted: int = 0
  prediction_kept: int = 0
  prediction_rejected: int = 0

  def kept(self, drafted: int, accepted: int) -> None:
    """A round is verified: `accepted` of its `drafted` tokens were the model's own."""
    self.length.update(drafted, accepted)
    self.rounds, self.drafted, self.accepted = self.rounds + 1, self.drafted + drafted, self.accepted + accepted
    if self.from_prediction:
      self.prediction_kept, self.prediction_rejected = self.prediction_kept + accepted, self.prediction_rejected + drafted - accepted
