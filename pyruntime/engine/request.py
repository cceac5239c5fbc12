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
    self.rows_everywhere = False  # every stage runs the rows path (known once they loaded): what verifying drafts needs
    self._tool_format: tuple[CallFormat, bool] | None = None

  def prompt_ids(self, prompt: str | None = None, messages: list[dict] | None = None, raw: bool = False,
                 tools: ToolRequest | None = None) -> list[int]:
    from pyruntime.text.chat import build_prompt_ids
    return build_prompt_ids(self.tokenizer, self.kv, prompt=prompt, messages=messages, raw=raw, context_length=self.context_length, tools=tools)

  def build(self, prompt: str | None, messages: list[dict] | None, *, raw: bool, max_tokens: int | None, stop: str | Sequence[str] | None,
            logits: bool, ignore_eos: bool, cache_salt: str | None, prefix_cache: bool, response_format: dict | None,
            tools: list[dict] | None, tool_choice: str | dict | None, parallel_tool_calls: bool | None, speculative: bool,
            prediction: str | None, sampling: dict[str, Any]) -> Request:
    from pyruntime.params import check_request
    from pyruntime.text.textstream import budget
    params = check_request(max_tokens, sampling, stop)
    check_salt(cache_salt)
    if not isinstance(prefix_cache, bool): raise errors.InvalidOption("prefix_cache", f"must be true or false, got {prefix_cache!r:.80}")
    if not isinstance(speculative, bool): raise errors.InvalidOption("speculative", f"must be true or false, got {speculative!r:.80}")
    if prediction is not None and not isinstance(prediction, str):
      raise errors.InvalidOption("prediction", f"must be the predicted text, got {prediction!r:.80}")
    offered = check_tools(tools, tool_choice, parallel_tool_calls)
    calls = offered is not None and offered.calls_allowed
    grammar = self._tool_grammar(offered, response_format, logits) if calls else self._grammar(response_format, logits)
    ids = self.prompt_ids(prompt, messages, raw, tools=offered)
    n_max = budget(max_tokens if max_tokens is not None else self.context_length, self.context_length, len(ids))
    # only its first n_max tokens can ever be drafted: cut the text to what they can span before tokenizing it
    cut = (n_max + 16) * self.tokenizer.max_token_bytes
    predicted = self.tokenizer.encode(prediction[:cut], parse_special=False)[:n_max + 16] if prediction is not None else []
    # drafts (n-grams, or the caller's prediction) are verified exactly for greedy, free streams on the rows path
    # (docs/speculation.md); others decode plainly
    wanted = self.speculative != "off" or bool(predicted)
    speculate = speculative and wanted and self.rows_everywhere and params.greedy and grammar is None and not logits
    return Request(ids, n_max, params, [stop] if isinstance(stop, str) else list(stop or []), logits,
                   frozenset() if ignore_eos else self.tokenizer.end_ids, cache_salt, prefix_cache, grammar,
                   self.tool_format()[0] if calls else None, predicted, speculate)

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
