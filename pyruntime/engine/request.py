"""A request as the launcher takes it: every option checked (sampling by params.check_request; the cache, speculation,
prediction, response_format and tools here), the prompt tokenized and its grammar built, in the caller's thread and
before anything is queued, so a bad request is refused by name and costs the pipeline nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from pyruntime import errors
from pyruntime.text.tools import CallFormat, ToolRequest, check_tools


@dataclass
class Request:
  ids: list[int]                   # the prompt, tokenized
  n_max: int                       # the most tokens it may generate (max_tokens within the context)
  params: Any                      # params.SamplingParams
  stops: list[str]
  want_logits: bool = False
  end_ids: frozenset[int] = frozenset()
  cache_salt: str | None = None
  prefix_cache: bool = True
  grammar: str | None = None       # a structured answer's grammar (response_format, tools), enforced at the tail
  calls: CallFormat | None = None  # the tool-call format its text is parsed with, when the request offered tools
  predicted: list[int] = field(default_factory=list)  # OpenAI's `prediction`, tokenized: a drafter of its own
  speculate: bool = False          # drafts are verified for it (exactly: greedy, free, every stage on the rows path)
  logprobs: int = -1               # k >= 0: every token comes with its log-probability and the k most likely tokens'
  prompt_logprobs: bool = False    # ... and every prompt token after the first with its own (scoring a prompt)


def check_logprobs(logprobs: Any, prompt_logprobs: Any, logits: bool, max_tokens: Any) -> int:
  """The log-probabilities asked for: k (the alternatives per token, 0..MAX_TOP_LOGPROBS) or -1 for none."""
  from pyruntime.protocol import MAX_TOP_LOGPROBS
  if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
    raise errors.InvalidOption("logprobs", f"must be an integer from 0 to {MAX_TOP_LOGPROBS} (the alternatives per token), got {logprobs!r:.80}")
  if not isinstance(prompt_logprobs, bool): raise errors.InvalidOption("prompt_logprobs", f"must be true or false, got {prompt_logprobs!r:.80}")
  if prompt_logprobs and logprobs is None: raise errors.InvalidOption("prompt_logprobs", "needs logprobs (the alternatives per token, 0 for none)")
  if logits and logprobs is not None: raise errors.InvalidOption("logprobs", "not with logits=True (the logits themselves come back)")
  if max_tokens == 0 and not prompt_logprobs:
    raise errors.InvalidOption("max_tokens", "must be a positive integer (0 only when scoring a prompt: prompt_logprobs)")
  return -1 if logprobs is None else logprobs


def check_salt(salt: Any) -> None:
  """A cache salt is a tenant's key: a string of at most 1024 characters that has a UTF-8 spelling (a lone surrogate,
  valid in JSON, has none; it would be hashed as some other tenant's bytes or not at all)."""
  if salt is None: return
  if not isinstance(salt, str) or len(salt) > 1024:
    raise errors.InvalidOption("cache_salt", f"must be a string of at most 1024 characters, got {salt!r:.80}")
  try: salt.encode("utf-8")
  except UnicodeEncodeError as e:
    raise errors.InvalidOption("cache_salt", f"is not valid Unicode: a lone surrogate at character {e.start}") from None


class RequestBuilder:
  """Requests for one model: its tokenizer, chat template and context length, and how the pipeline can speculate."""

  def __init__(self, tokenizer: Any, kv: dict, context_length: int, speculative: str):
    self.tokenizer, self.kv, self.context_length, self.speculative = tokenizer, kv, context_length, speculative
    self.rows_everywhere = False    # every stage runs the rows path, none recurrent (known once they loaded): what verifying drafts needs
    self.scores_everywhere = False  # every stage runs the rows path: what scoring a prompt needs
    self._tool_format: tuple[CallFormat, bool] | None = None

  def prompt_ids(self, prompt: str | None = None, messages: list[dict] | None = None, raw: bool = False,
                 tools: ToolRequest | None = None) -> list[int]:
    from pyruntime.text.chat import build_prompt_ids
    return build_prompt_ids(self.tokenizer, self.kv, prompt=prompt, messages=messages, raw=raw, context_length=self.context_length, tools=tools)

  def build(self, prompt: str | None, messages: list[dict] | None, *, raw: bool, max_tokens: int | None, stop: str | Sequence[str] | None,
            logits: bool, ignore_eos: bool, cache_salt: str | None, prefix_cache: bool, response_format: dict | None,
            tools: list[dict] | None, tool_choice: str | dict | None, parallel_tool_calls: bool | None, speculative: bool,
            prediction: str | None, sampling: dict[str, Any], logprobs: int | None = None, prompt_logprobs: bool = False,
            prompt_ids: list[int] | None = None) -> Request:
    from pyruntime.params import check_request
    from pyruntime.text.textstream import budget
    k = check_logprobs(logprobs, prompt_logprobs, logits, max_tokens)
    scoring_only = max_tokens == 0
    params = check_request(None if scoring_only else max_tokens, sampling, stop)
    if prompt_logprobs and not self.scores_everywhere:
      raise errors.InvalidOption("prompt_logprobs", "scoring a prompt needs every stage on the rows path (decode='batched')")
    check_salt(cache_salt)
    if not isinstance(prefix_cache, bool): raise errors.InvalidOption("prefix_cache", f"must be true or false, got {prefix_cache!r:.80}")
    if not isinstance(speculative, bool): raise errors.InvalidOption("speculative", f"must be true or false, got {speculative!r:.80}")
    if prediction is not None and not isinstance(prediction, str):
      raise errors.InvalidOption("prediction", f"must be the predicted text, got {prediction!r:.80}")
    offered = check_tools(tools, tool_choice, parallel_tool_calls)
    calls = offered is not None and offered.calls_allowed
    grammar = self._tool_grammar(offered, response_format, logits) if calls else self._grammar(response_format, logits)
    ids = self._checked_ids(prompt_ids) if prompt_ids is not None else self.prompt_ids(prompt, messages, raw, tools=offered)
    n_max = 0 if scoring_only else budget(max_tokens if max_tokens is not None else self.context_length, self.context_length, len(ids))
    if scoring_only: budget(None, self.context_length, len(ids))  # the prompt must still fit
    # only its first n_max tokens can ever be drafted: cut the text to what they can span before tokenizing it
    cut = (n_max + 16) * self.tokenizer.max_token_bytes
    predicted = self.tokenizer.encode(prediction[:cut], parse_special=False)[:n_max + 16] if prediction is not None else []
    # drafts (n-grams, or the caller's prediction) are verified exactly for greedy, free streams on the rows path
    # (docs/speculation.md); others decode plainly
    wanted = self.speculative != "off" or bool(predicted)
    speculate = speculative and wanted and self.rows_everywhere and params.greedy and grammar is None and not logits and k < 0
    return Request(ids, n_max, params, [stop] if isinstance(stop, str) else list(stop or []), logits,
                   frozenset() if ignore_eos else self.tokenizer.end_ids, cache_salt, prefix_cache, grammar,
                   self.tool_format()[0] if calls else None, predicted, speculate, k, prompt_logprobs)

  def _checked_ids(self, ids: Any) -> list[int]:
    """A prompt given as token ids: each an id of the vocabulary, at least one."""
    if not isinstance(ids, (list, tuple)) or not ids: raise errors.InvalidOption("prompt", "token ids: a non-empty list of integers")
    try: return [self.tokenizer.check_id(t) for t in ids]
    except errors.TokenIdInvalid as e: raise errors.InvalidOption("prompt", str(e)) from None

  def _grammar(self, response_format: dict | None, logits: bool) -> str | None:
    """A structured answer's grammar (pyruntime/text/grammar.py), checked against the vocabulary here: a schema that cannot
    be enforced is refused by name before anything runs, never answered unconstrained."""
    if response_format is None: return None
    from pyruntime.text.grammar import check, grammar_for
    if (grammar := grammar_for(response_format)) is None: return None
    if logits: raise errors.InvalidOption("response_format", "a structured answer samples its tokens: not with logits=True")
    check(grammar, self.tokenizer)
    return grammar

  def tool_format(self) -> tuple[CallFormat, bool]:
    """The model's tool-call family (the same for every request: found once)."""
    if self._tool_format is None:
      from pyruntime.text.chat import require_tool_format
      self._tool_format = require_tool_format(self.kv)
    return self._tool_format

  def _tool_grammar(self, offered: ToolRequest, response_format: dict | None, logits: bool) -> str | None:
    """The grammar a call is decoded under (pyruntime/text/tools.py), checked here like a response_format's: None where the
    family's calls are parsed but not constrained (tool_choice 'auto' only)."""
    from pyruntime.text.grammar import MAX_GRAMMAR_BYTES, check, grammar_for
    if grammar_for(response_format) is not None:
      raise errors.InvalidOption("response_format", "a structured answer cannot be combined with tools (unless tool_choice is 'none')")
    if logits: raise errors.InvalidOption("tools", "tool calls are sampled under a grammar: not with logits=True")
    fmt = self.tool_format()[0]
    if not fmt.constrained and offered.choice == "auto": return None
    grammar = fmt.grammar(offered, self.tokenizer)
    if len(grammar) > MAX_GRAMMAR_BYTES: raise errors.InvalidOption("tools", f"the tools' grammar is over {MAX_GRAMMAR_BYTES} bytes")
    check(grammar, self.tokenizer, "tools")
    return grammar
