"""Stop strings over a stream of text deltas, and the token budget of a request (docs/serving.md).

Text already sent to a client cannot be taken back, so a stop string that may be starting at the
end of the text seen so far is held back until the next delta decides it. Deltas come from
`IncrementalDecoder`, which only ever yields whole characters, so a held-back or cut text never
splits a multi-byte UTF-8 character.
"""
from __future__ import annotations

from collections.abc import Sequence

from pyruntime.errors import ContextLengthExceeded, InvalidOption
from pyruntime.params import validate_stop


class StopStream:
  """Push text deltas; get back the text safe to send now and the stop string hit, if any.

  The output stops right before the earliest stop string, also when it straddles deltas. Only
  the longest suffix that could still grow into a stop string is held back; `flush()` releases
  it when generation ends for another reason (end token, budget)."""

  def __init__(self, stop: str | Sequence[str] | None):
    self.stop = validate_stop(stop)
    self.matched: str | None = None    # the stop string that ended the stream
    self._held = ""

  def push(self, delta: str) -> tuple[str, str | None]:
    """(text safe to send now, the stop string if this delta completed one). Nothing more after a stop."""
    if self.matched is not None: return "", self.matched
    text = self._held + delta
    if not self.stop: return text, None
    hit, cut = None, len(text) + 1
    for s in self.stop:
      if 0 <= (i := text.find(s)) < cut: hit, cut = s, i
    if hit is not None:
      self.matched, self._held = hit, ""
      return text[:cut], hit
    keep = self._longest_partial(text)
    self._held = text[len(text) - keep:] if keep else ""
    return text[:len(text) - keep], None

  def flush(self, delta: str = "") -> str:
    """The end of generation: push a last delta (e.g. IncrementalDecoder.flush()) and release what is held.

    If that last delta completes a stop string, only the text before it is returned and `matched` is set."""
    text, hit = self.push(delta)
    if hit is None: text, self._held = text + self._held, ""
    return text

  @property
  def stopped(self) -> bool: return self.matched is not None

  @property
  def held(self) -> str: return self._held

  def _longest_partial(self, text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in self.stop:
      for k in range(min(len(s) - 1, len(text)), best, -1):
        if text.endswith(s[:k]): best = k; break
    return best


def budget(max_tokens: int | None, context: int, prompt_tokens: int) -> int:
  """How many tokens a request may generate: min(max_tokens, context - prompt_tokens).

  Raises ContextLengthExceeded when the prompt leaves no room for even one token."""
  if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
    raise InvalidOption("max_tokens", f"must be a positive integer, got {max_tokens!r}")
  if prompt_tokens >= context: raise ContextLengthExceeded(prompt_tokens, context)
  room = context - prompt_tokens
  return room if max_tokens is None else min(max_tokens, room)
