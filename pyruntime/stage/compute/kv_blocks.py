"""A stage's prefix-cache blocks: the keys and values of BLOCK positions each, kept in host memory.

The launcher's index (pyruntime/engine/prefix_cache.py) decides what every block holds; a stage only copies: `save` fills
blocks from a stream's KV slot, `load` copies blocks into a new stream's slot. The blocks live in host memory, outside
the device's caches: a budget of their own (`--prefix-cache` tokens), allocated on first use and never grown. On a
CPU the copies are plain memory copies in and out of the device's buffers (no staging); on a device without host
access they go through a copy of the slot's region.

Which state holds positions is the model's to say (StageModel.position_states): on the rows path each block's keys
(kv heads, head dim, positions) and values (kv heads, positions, head dim), on tinygrad's path its (2, kv heads,
positions, head dim) cache, with MLA its latent cache. Recurrent state is not a function of positions alone: a model
with recurrent blocks has no position states, and no blocks.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from tinygrad import dtypes

from pyruntime import errors
from pyruntime.stage.compute import device_memory


class KVBlocks:
  def __init__(self, states: list[tuple[Any, int, tuple[int, ...], int]], blocks: int, block_size: int):
    """states: (tensor, slots, one slot's shape, its position axis) for every state tensor that holds positions."""
    self.states, self.blocks, self.block_size = states, blocks, block_size
    self.pools: list[np.ndarray] | None = None
    self.stats = {"saved_blocks": 0, "loaded_blocks": 0}

  @property
  def bytes_per_token(self) -> int:
    return sum(int(np.prod(shape)) // shape[axis] * 4 for _, _, shape, axis in self.states)

  @property
  def nbytes(self) -> int: return self.blocks * self.block_size * self.bytes_per_token

  def _pools(self) -> list[np.ndarray]:
    if self.pools is None:
      self.pools = [np.empty((self.blocks, *shape[:axis], self.block_size, *shape[axis + 1:]), np.float32) for _, _, shape, axis in self.states]
    return self.pools

  def _region(self, t: Any, slot: int, shape: tuple[int, ...]) -> tuple[np.ndarray, Any]:
    """One slot's region of a state tensor as a host array, and how to write it back (None: the array is the device's
    memory itself)."""
    n = int(np.prod(shape))
    buf = t.uop.buffer
    if device_memory.has_views(buf.device):
      view = buf.view(n, dtypes.float32, slot * n * 4).ensure_allocated()
      if hasattr(view.allocator, "_as_buffer") and view.options is None:
        return np.frombuffer(view.as_memoryview(allow_zero_copy=True), dtype=np.float32).reshape(shape), None
    arr = device_memory.view(buf, (n,), slot * n).numpy().reshape(shape)
    return arr, lambda a: device_memory.write(buf, a, slot * n * 4)

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
      arr, _ = self._region(t, slot, shape)
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
      arr, back = self._region(t, slot, shape)
      vals = np.moveaxis(pool[ids], 0, axis).reshape(*shape[:axis], len(idx), *shape[axis + 1:])
      arr[(slice(None),) * axis + (idx,)] = vals
      if back is not None: back(arr)
    self.stats["loaded_blocks"] += len(ids)
    return len(idx)
