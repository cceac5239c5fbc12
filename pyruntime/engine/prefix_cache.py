"""The prefix cache's index: which token prefixes have their keys and values kept, and where. The launcher owns it.

A conversation resends its history at every turn, and a server's requests share system prompts and few-shot
examples: the keys and values of those tokens were computed once already. Every stage keeps them in BLOCK-token
blocks of host memory (pyruntime/stage/compute/kv_blocks.py), numbered alike in every stage; this index, in the launcher, decides
alone which block holds which tokens, and tells the stages in ring order (docs/streams.md, "Prefix cache"):

- a new stream's OPEN names the blocks that hold its prompt's first tokens: each stage copies them into the stream's
  KV slot, and the prompt's first record starts after them;
- a CACHE record names the blocks to fill from a running stream's slot, for positions every stage has computed (the
  launcher has their answers): once the prompt is in (so that requests arriving meanwhile share it), and when the
  stream ends (its reply too, so the next turn of a conversation finds it).

A stage acts on records in the order the launcher wrote them, so a block is always filled before any OPEN that reads
it, and read before any later CACHE record refills it: the stages never disagree with the index.

Granularity: blocks of BLOCK tokens, keyed by a hash chained from the previous block's key (and the request's cache
salt, so tenants with different salts share nothing), like vLLM's. A block is the unit of reuse and eviction: a
conversation's next turn reuses all its full blocks, recomputing at most BLOCK - 1 tokens, and one hash lookup per
block keeps the launcher's work per request small. Eviction: least recently used first, a block only once no cached
block continues it (so every cached chain stays whole). A prompt's last token is never taken from the cache: its
logits give the first token.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

BLOCK = 16  # tokens per block
from pyruntime.options import PREFIX_CACHE_TOKENS as PREFIX_CACHE_TOKENS  # noqa: E402 - the default budget, with the other launch options


@dataclass
class _Block:
  id: int
  key: bytes
  parent: bytes | None
  tokens: tuple[int, ...]
  children: int = 0
  used: int = 0


def _key(parent: bytes, tokens: tuple[int, ...]) -> bytes:
  return hashlib.blake2b(parent + struct.pack(f"<{len(tokens)}I", *tokens), digest_size=16).digest()


class PrefixIndex:
  """`blocks` blocks of BLOCK tokens: which token prefix each holds, and which to give up when one is needed."""

  def __init__(self, blocks: int, block_size: int = BLOCK):
    self.capacity, self.block_size = blocks, block_size
    self.free = list(range(blocks))[::-1]
    self.entries: dict[bytes, _Block] = {}
    self.clock = 0
    self.stats = {"queries": 0, "hits": 0, "hit_tokens": 0, "prompt_tokens": 0, "saved_blocks": 0, "evictions": 0}

  @staticmethod
  def root(salt: str | None) -> bytes:
    # surrogatepass: a salt that got past the door's check still hashes, as bytes no valid salt has
    tag = b"\x01" + salt.encode("utf-8", "surrogatepass") if salt is not None else b"\x00"
    return hashlib.blake2b(b"pyruntime-prefix" + tag, digest_size=16).digest()

  def _chain(self, tokens: list[int], salt: str | None, blocks: int):
    key, bs = self.root(salt), self.block_size
    for i in range(blocks):
      block = tuple(tokens[i * bs:(i + 1) * bs])
      parent, key = key, _key(key, block)
      yield i, parent, key, block

  def match(self, tokens: list[int], salt: str | None = None) -> list[int]:
    """The ids of the blocks holding the longest cached prefix of `tokens` that leaves at least its last token to
    compute, in order (block i holds positions i * BLOCK ...). Counts a query."""
    self.clock += 1
    found: list[int] = []
    for _, _, key, block in self._chain(tokens, salt, (len(tokens) - 1) // self.block_size):
      if (e := self.entries.get(key)) is None or e.tokens != block: break
      e.used = self.clock
      found.append(e.id)
    self.stats["queries"] += 1
    self.stats["prompt_tokens"] += len(tokens)
    if found:
      self.stats["hits"] += 1
      self.stats["hit_tokens"] += len(found) * self.block_size
    return found

  def insert(self, tokens: list[int], salt: str | None = None) -> list[tuple[int, int]]:
    """Index the full blocks of `tokens` (their keys and values computed in every stage): the ones already cached are
    refreshed, each new one gets a block (a free one, else the least recently used whose chain ends with it). Returns
    the (block id, first position) pairs the stages must fill, in order; fewer when no block can be given up."""
    self.clock += 1
    out: list[tuple[int, int]] = []
    mine: set[bytes] = set()
    for i, parent, key, block in self._chain(tokens, salt, len(tokens) // self.block_size):
      mine.add(key)
      if (e := self.entries.get(key)) is not None and e.tokens == block:
        e.used = self.clock
        continue
      if e is not None: self._drop(e)  # another prefix under the same key (a hash collision): this one replaces it
      if (bid := self._take(mine)) is None: break
      self.entries[key] = _Block(bid, key, parent if i else None, block, used=self.clock)
      if i and (p := self.entries.get(parent)) is not None: p.children += 1
      out.append((bid, i * self.block_size))
    self.stats["saved_blocks"] += len(out)
    return out

  def _take(self, keep: set[bytes]) -> int | None:
    if self.free: return self.free.pop()
    leaves = [e for e in self.entries.values() if e.children == 0 and e.key not in keep]
    if not leaves: return None
    victim = min(leaves, key=lambda e: e.used)
    self._drop(victim)
    self.stats["evictions"] += 1
    return self.free.pop()

  def _drop(self, e: _Block) -> None:
    del self.entries[e.key]
    if e.parent is not None and (p := self.entries.get(e.parent)) is not None: p.children -= 1
    self.free.append(e.id)

  @property
  def held_blocks(self) -> int: return len(self.entries)

  def snapshot(self) -> dict:
    """Counters for /metrics and scheduler_stats: queries, hits, tokens served from the cache, blocks held and saved,
    evictions."""
    return {**self.stats, "blocks": self.capacity, "held_blocks": self.held_blocks, "block_size": self.block_size}


@dataclass
class PrefixCache:
  """The pipeline's prefix cache as the launcher runs it: the index (None when off, `why_off` says why), whether decoded
  positions are cached too, and the host memory a cached token takes over all stages."""
  index: PrefixIndex | None
  why_off: str
  decoded: bool = False
  bytes_per_token: int = 0

  @classmethod
  def for_stages(cls, tokens: int, caches: list[dict | None], arch: str) -> PrefixCache:
    """On when it was asked for and every stage keeps blocks (a model with recurrent blocks has none: its state is not a
    function of positions alone). A decoded position is cached only if a decode row computes a prompt row's bits: every
    stage on the rows path."""
    if not tokens // BLOCK: return cls(None, "off (prefix_cache=0)")
    if not all(caches): return cls(None, f"off: {arch} has recurrent blocks, whose state cannot be cut at a position")
    return cls(PrefixIndex(tokens // BLOCK, BLOCK), "", all(c["decoded_positions"] for c in caches), sum(c["bytes_per_token"] for c in caches))

  def stats(self) -> dict:
    """The index's counters (PrefixIndex.snapshot) and its host memory in all stages; {"enabled": False, "why": ...}."""
    if self.index is None: return {"enabled": False, "why": self.why_off}
    snap = self.index.snapshot()
    return {"enabled": True, **snap, "bytes_held": snap["held_blocks"] * BLOCK * self.bytes_per_token,
            "bytes_budget": snap["blocks"] * BLOCK * self.bytes_per_token, "caches_decoded_positions": self.decoded}
