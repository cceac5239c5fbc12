"""What a stream hands its consumer (the launcher's protocol with the server, the CLI and embedders): `Delta`s as
text becomes final, `Logits` when asked for, then one `Done` with the usage and timings. Plain data: the server
depends on these, not on the launcher.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  import numpy as np

  from pyruntime.protocol import TokenScore
  from pyruntime.text.tools import ToolCall


@dataclass
class Delta:
  text: str
  token_ids: list[int]
  tool_calls: list[ToolCall] = field(default_factory=list)  # calls whose closing marker arrived with this token
  logprobs: list[TokenScore] = field(default_factory=list)  # with logprobs asked for: one per token id, in order
  prompt_token_ids: list[int] | None = None         # on a stream's first Delta: its prompt (an echo starts with it)
  prompt_logprobs: list[TokenScore] | None = None   # ... and with prompt_logprobs its scores (one per token after the first)


@dataclass
class Logits:
  """With `logits=True` the tail sends its float32 logits instead of a token; the launcher decodes greedily."""
  position: int
  values: np.ndarray


@dataclass
class Usage:
  prompt_tokens: int
  completion_tokens: int
  cached_tokens: int = 0
  accepted_prediction_tokens: int = 0   # of a request's `prediction`: tokens the answer kept
  rejected_prediction_tokens: int = 0   # ... and tokens it drafted that the answer did not

  @property
  def total_tokens(self) -> int: return self.prompt_tokens + self.completion_tokens


@dataclass
class Timings:
  load_s: float
  ttft_s: float                      # from the call, waiting for a slot included
  decode_tokens_per_s: float
  elapsed_s: float
  queue_s: float = 0.0               # waiting for a free stream slot
  draft_rounds: int = 0              # speculative records verified (docs/speculation.md)
  drafted_tokens: int = 0            # tokens they drafted
  accepted_tokens: int = 0           # of which the model agreed with (each saved a trip through the pipeline)
  preempted: int = 0                 # times the stream gave its positions up for the kv_budget and was resumed


@dataclass
class Done:
  finish_reason: str                 # "stop" | "length" | "cancelled" (cancel(), or an iterator closed or dropped)
  usage: Usage
  timings: Timings
  prompt_token_ids: list[int]
  token_ids: list[int]
  text: str
  stop: str | None = None            # the stop string that ended it, if one did
  tool_calls: list[ToolCall] = field(default_factory=list)  # every call parsed out of the answer (then `text` is the rest)
  logprobs: list[TokenScore] | None = None         # with logprobs asked for: one per token id
  prompt_logprobs: list[TokenScore] | None = None  # with prompt_logprobs: one per prompt token after the first
