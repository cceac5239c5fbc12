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

Recurrent blocks (hybrid models): their state after a position is not a function of that position's keys and values,
so a prefix is only usable where the stages also kept the state it ended in. The index then keeps `states` snapshots
besides the blocks, each attached to the block it ends at: a stream saves one at the end of its last full block (the
stages keep every slot's state as it was at its latest block boundary), a match stops at the last matched block that
has one, and the snapshots are evicted least recently used first, on their own (a block without one stays: a longer
prefix through it may still have one).
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

BLOCK = 16  # tokens per block
from pyruntime.options import PREFIX_CACHE_TOKENS as PREFIX_CACHE_TOKENS  # noqa: E402 - the default budget, with the other launch options
from pyruntime.options import PREFIX_STATE_TOKENS  # noqa: E402


def prefix_states(tokens: int) -> int:
  """The recurrent-state snapshots a budget of `tokens` keeps (models with recurrent blocks): one per
  PREFIX_STATE_TOKENS, at least one when there is a block at all."""
  return max(1, tokens // PREFIX_STATE_TOKENS) if tokens >= BLOCK else 0


@dataclass
class _Block:
  id: int
  key: bytes
  parent: bytes | None
  tokens: tuple[int, ...]
  children: int = 0
  used: int = 0
  state: int | None = None  # the recurrent state snapshot at this block's end (models with recurrent blocks)


def _key(parent: bytes, tokens: tuple[int, ...]) -> bytes:
  return hashlib.blake2b(parent + struct.pack(f"<{len(tokens)}I", *tokens), digest_size=16).digest()


class PrefixIndex:
  """`blocks` blocks of BLOCK tokens: which token prefix each holds, and which to give up when one is needed; with
  `states` > 0 (a model with recurrent blocks) also which blocks end in a kept recurrent state."""

  def __init__(self, blocks: int, block_size: int = BLOCK, states: int = 0):
    self.capacity, self.block_size, self.states = blocks, block_size, states
    self.free = list(range(blocks))[::-1]
    self.free_states = list(range(states))[::-1]
    self.entries: dict[bytes, _Block] = {}
    self.by_id: dict[int, _Block] = {}
    self.clock = 0
    self.stats = {"queries": 0, "hits": 0, "hit_tokens": 0, "prompt_tokens": 0, "saved_blocks": 0, "evictions": 0,
                  "saved_states": 0, "state_evictions": 0}

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
    compute, in order (block i holds positions i * BLOCK ...); with recurrent state, the longest that ends in a kept
    state (`state_of` its last block). Counts a query."""
    self.clock += 1
    found: list[int] = []
    usable = 0
    for _, _, key, block in self._chain(tokens, salt, (len(tokens) - 1) // self.block_size):
      if (e := self.entries.get(key)) is None or e.tokens != block: break
      e.used = self.clock
      found.append(e.id)
      if not self.states or e.state is not None: usable = len(found)
    found = found[:usable]
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
      self.entries[key] = self.by_id[bid] = _Block(bid, key, parent if i else None, block, used=self.clock)
      if i and (p := self.entries.get(parent)) is not None: p.children += 1
      out.append((bid, i * self.block_size))
    self.stats["saved_blocks"] += len(out)
    return out

  def state_of(self, block_id: int) -> int | None:
    """The recurrent state snapshot kept at the end of block `block_id` (None: none, or no recurrent blocks)."""
    return self.by_id[block_id].state

  def attach_state(self, tokens: list[int], salt: str | None = None) -> int | None:
    """After insert(tokens): the snapshot the stages must fill with the state at the end of the last full block of
    `tokens` (what every stage kept at its stream's latest block boundary). None when that block is not cached (no
    room), already ends in a snapshot (the same tokens from the same root give the same state bits: the rows path's
    contract), no snapshot can be given up, or the model has no recurrent blocks."""
    n = len(tokens) // self.block_size
    if not self.states or not n: return None
    chain = list(self._chain(tokens, salt, n))
    keys = {key for _, _, key, _ in chain}
    _, _, last, block = chain[-1]
    if (e := self.entries.get(last)) is None or e.tokens != block: return None
    if e.state is not None: return None
    if not self.free_states:
      held = [b for b in self.entries.values() if b.state is not None and b.key not in keys]
      if not held: return None
      victim = min(held, key=lambda b: b.used)
      self.free_states.append(victim.state)
      victim.state = None
      self.stats["state_evictions"] += 1
    e.state = self.free_states.pop()
    self.stats["saved_states"] += 1
    return e.state

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
    del self.by_id[e.id]
    if e.state is not None: self.free_states.append(e.state)
    if e.parent is not None and (p := self.entries.get(e.parent)) is not None: p.children -= 1
    self.free.append(e.id)

  @property
  def held_blocks(self) -> int: return len(self.entries)

  def snapshot(self) -> dict:
    """Counters for /metrics and scheduler_stats: queries, hits, tokens served from the cache, blocks held and saved,
    evictions."""
    held = sum(e.state is not None for e in self.entries.values())
    return {**self.stats, "blocks": self.capacity, "held_blocks": self.held_blocks, "block_size": self.block_size,
            "states": self.states, "held_states": held}


@dataclass
class PrefixCache:
  """The pipeline's prefix cache as the launcher runs it: the index (None when off, `why_off` says why), whether decoded
  positions are cached too, the host memory a cached token takes over all stages, and a recurrent-state snapshot."""
  index: PrefixIndex | None
  why_off: str
  decoded: bool = False
  bytes_per_token: int = 0
  state_bytes: int = 0

  @classmethod
  def for_stages(cls, tokens: int, caches: list[dict | None], arch: str) -> PrefixCache:
    """On when it was asked for and every stage keeps blocks (not a stage on tinygrad's own decode path with recurrent
    blocks, `decode="reference"`: its state is kept nowhere). A decoded position is cached only if a decode row computes
    a prompt row's bits: every stage on the rows path. Stages with recurrent blocks keep `states` snapshots too."""
    if not tokens // BLOCK: return cls(None, "off (prefix_cache=0)")
    if not all(caches): return cls(None, f"off: a stage of {arch} keeps no blocks (on tinygrad's own decode path: "
                                                 "recurrent state, or a device without buffer views)")
    states = min((c["states"] for c in caches if c.get("state_bytes")), default=0)  # (an attention-only stage keeps none)
    return cls(PrefixIndex(tokens // BLOCK, BLOCK, states), "", all(c["decoded_positions"] for c in caches),
               sum(c["bytes_per_token"] for c in caches), sum(c.get("state_bytes", 0) for c in caches))

  def stats(self) -> dict:
    """The index's counters (PrefixIndex.snapshot) and its host memory in all stages; {"enabled": False, "why": ...}."""
    if self.index is None: return {"enabled": False, "why": self.why_off}
    snap = self.index.snapshot()
    return {"enabled": True, **snap, "bytes_held": snap["held_blocks"] * BLOCK * self.bytes_per_token + snap["held_states"] * self.state_bytes,
            "bytes_budget": snap["blocks"] * BLOCK * self.bytes_per_token + snap["states"] * self.state_bytes,
            "caches_decoded_positions": self.decoded}
