"""A stage's prefix-cache blocks: the keys and values of BLOCK positions each, kept in host memory.

The launcher's index (pyruntime/engine/prefix_cache.py) decides what every block holds; a stage only copies: `save` fills
blocks from a stream's KV slot, `load` copies blocks into a new stream's slot. The blocks live in host memory, outside
the device's caches: a budget of their own (`--prefix-cache` tokens), allocated on first use and never grown. On a
CPU the copies are plain memory copies in and out of the device's buffers (no staging); on a device without host
access they go through a copy of the slot's region.

Which state holds positions is the model's to say (StageModel.position_states): on the rows path each block's keys
(kv heads, head dim, positions) and values (kv heads, positions, head dim), on tinygrad's path its (2, kv heads,
positions, head dim) cache, with MLA its latent cache.

Recurrent blocks (hybrid models, rows path): their conv and recurrent state after a position is not a function of that
position's keys and values, so a prefix also needs the state it ended in. Every slot's state is copied aside each time
its stream ends a block (`mark`, called by the model after the kernels that computed it: one copy of the state per
BLOCK positions; the two latest kept); a CACHE record may then keep one as a snapshot (`save_state`), and an OPEN
restores one with the blocks (`load_state`). The launcher asks for a snapshot only of a stream with nothing in flight,
at the last boundary before its last position: a stage that kept no state there refuses by name.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from pyruntime import errors
from pyruntime.stage.compute import device_memory


class KVBlocks:
  def __init__(self, states: list[tuple[Any, int, tuple[int, ...], int]], blocks: int, block_size: int,
               recurrent: list[tuple[Any, int, int]] | None = None, snapshots: int = 0):
    """states: (tensor, slots, one slot's shape, its position axis) for every state tensor that holds positions;
    recurrent: (tensor, slots, one slot's elements) for every recurrent state tensor, of which `snapshots` are kept."""
    self.states, self.blocks, self.block_size = states, blocks, block_size
    self.recurrent = recurrent or []
    self.snapshots = snapshots if self.recurrent else 0
    self.pools: list[np.ndarray] | None = None
    self.state_pools: list[np.ndarray] | None = None
    self.state_at = [-1] * self.snapshots  # the position each snapshot's state is at (-1: none saved)
    self.boundary: dict[int, list[tuple[int, list[np.ndarray]]]] = {}  # slot -> its two latest block boundaries, the state at each
    self.stats = {"saved_blocks": 0, "loaded_blocks": 0, "saved_states": 0, "loaded_states": 0}

  @property
  def bytes_per_token(self) -> int:
    return sum(int(np.prod(shape)) // shape[axis] * 4 for _, _, shape, axis in self.states)

  @property
  def state_bytes(self) -> int:
    """Host bytes of one snapshot: one stream's every recurrent state, float32."""
    return sum(n * 4 for _, _, n in self.recurrent)

  @property
  def nbytes(self) -> int: return self.blocks * self.block_size * self.bytes_per_token

  def _pools(self) -> list[np.ndarray]:
    if self.pools is None:
      self.pools = [np.empty((self.blocks, *shape[:axis], self.block_size, *shape[axis + 1:]), np.float32) for _, _, shape, axis in self.states]
    return self.pools

  def _kept(self, slot: int, position: int) -> list[np.ndarray]:
    """Arrays to keep the slot's state at `position` in: the older of its two kept boundaries' (or new ones)."""
    kept = self.boundary.setdefault(slot, [])
    arrays = kept.pop(0)[1] if len(kept) == 2 else [np.empty(n, np.float32) for _, _, n in self.recurrent]
    kept.append((position, arrays))
    return arrays

  def mark(self, slot: int, position: int) -> None:
    """The slot's recurrent state now, after `position` positions (a multiple of BLOCK), copied aside: the slot keeps
    its two latest boundaries' (a CACHE record names the last boundary before the stream's last position, which is the
    one before the latest when that position ends a block)."""
    if not self.recurrent: return
    for (t, _, n), dst in zip(self.recurrent, self._kept(slot, position), strict=True): np.copyto(dst, device_memory.slot_region(t, slot, (n,))[0])

  def _snapshot_id(self, sid: Any) -> int:
    if type(sid) is not int or not 0 <= sid < self.snapshots:
      raise errors.PrefixBlocksInvalid(f"a snapshot id must be an integer in [0, {self.snapshots}), got {str(sid)[:80]}")
    return sid

  def save_state(self, slot: int, state: Any) -> None:
    """Snapshot state[0] := the slot's state at its latest block boundary, which must be position state[1]."""
    if not (isinstance(state, (list, tuple)) and len(state) == 2 and type(state[1]) is int):
      raise errors.PrefixBlocksInvalid(f"a state must be a [snapshot, position] pair of integers, not {str(state)[:80]}")
    sid, position = self._snapshot_id(state[0]), state[1]
    kept = dict(self.boundary.get(slot, [])).get(position)
    if kept is None:
      raise errors.PrefixBlocksInvalid(f"slot {slot} kept its recurrent state at positions {[p for p, _ in self.boundary.get(slot, [])]}, "
                                       f"not at {position}")
    if self.state_pools is None: self.state_pools = [np.empty((self.snapshots, n), np.float32) for _, _, n in self.recurrent]
    for pool, arr in zip(self.state_pools, kept, strict=True): pool[sid] = arr
    self.state_at[sid] = position
    self.stats["saved_states"] += 1

  def load_state(self, slot: int, sid: Any, position: int) -> None:
    """The slot's recurrent state := snapshot `sid`, the state after the `position` cached positions it is loaded with."""
    sid = self._snapshot_id(sid)
    if self.state_at[sid] != position:
      raise errors.PrefixBlocksInvalid(f"snapshot {sid} holds the state at position {self.state_at[sid]}, not {position} (-1: none)")
    # a new stream: the slot's kept boundaries were its last stream's (their arrays are reused, no position matches)
    self.boundary[slot] = [(-1, arrays) for _, arrays in self.boundary.get(slot, [])]
    for (t, _, n), pool, dst in zip(self.recurrent, self.state_pools, self._kept(slot, position), strict=True):
      arr, back = device_memory.slot_region(t, slot, (n,))
      arr[:] = pool[sid]
      if back is not None: back(arr)
      np.copyto(dst, pool[sid])
    self.stats["loaded_states"] += 1

  def _check(self, pairs: list, upto: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(pairs, list) or not all(isinstance(p, (list, tuple)) and len(p) == 2 and all(type(x) is int for x in p) for p in pairs):
      raise errors.PrefixBlocksInvalid(f"blocks must be [block, position] pairs of integers, not {str(pairs)[:80]}")
    ids, pos = np.asarray([p[0] for p in pairs], np.int64), np.asarray([p[1] for p in pairs], np.int64)
    if len(ids) and (ids.min() < 0 or ids.max() >= self.blocks):
      raise errors.PrefixBlocksInvalid(f"block ids must be in [0, {self.blocks}), got {ids.min()}..{ids.max()}")
    if len(pos) and (pos.min() < 0 or np.any(pos % self.block_size) or (upto is not None and pos.max() + self.block_size > upto)):
      raise errors.PrefixBlocksInvalid(f"block positions must be multiples of {self.block_size} within the slot's "
                                       f"{upto} positions, got {pos.tolist()[:8]}")
    return ids, pos

  def _index(self, pos: np.ndarray) -> np.ndarray: return (pos[:, None] + np.arange(self.block_size)).reshape(-1)

  def save(self, slot: int, pairs: list, computed: int) -> None:
    """Blocks pairs[i][0] := the slot's positions pairs[i][1] ... + BLOCK (all among its `computed` positions)."""
    ids, pos = self._check(pairs, computed)
    if not len(ids): return
    idx = self._index(pos)
    for (t, _, shape, axis), pool in zip(self.states, self._pools(), strict=True):
      arr, _ = device_memory.slot_region(t, slot, shape)
      got = np.take(arr, idx, axis=axis)  # shape with positions -> (n * BLOCK)
      got = got.reshape(*shape[:axis], len(ids), self.block_size, *shape[axis + 1:])
      pool[ids] = np.moveaxis(got, axis, 0)
    self.stats["saved_blocks"] += len(ids)

  def load(self, slot: int, pairs: list) -> int:
    """The slot's positions 0 .. n * BLOCK := blocks pairs[i][0] (pairs[i][1] must be i * BLOCK). Returns n * BLOCK."""
    ids, pos = self._check(pairs)
    if not np.array_equal(pos, np.arange(len(ids)) * self.block_size):
      raise errors.PrefixBlocksInvalid(f"a stream's cached blocks hold positions 0, {self.block_size}, ... in order, got {pos.tolist()[:8]}")
    if not len(ids): return 0
    if self.pools is None: raise errors.PrefixBlocksInvalid("no block was saved yet: there is nothing to load")
    idx = self._index(pos)
    for (t, _, shape, axis), pool in zip(self.states, self.pools, strict=True):
      arr, back = device_memory.slot_region(t, slot, shape)
      vals = np.moveaxis(pool[ids], 0, axis).reshape(*shape[:axis], len(idx), *shape[axis + 1:])
      arr[(slice(None),) * axis + (idx,)] = vals
      if back is not None: back(arr)
    self.stats["loaded_blocks"] += len(ids)
    return len(idx)
