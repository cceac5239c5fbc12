"""A stage's recurrent-state snapshots (pyruntime/stage/compute/kv_blocks.py) on real CPU buffers: a slot's state kept at
its two latest block boundaries, saved into a snapshot and restored into another slot bit for bit, and every request
the launcher could get wrong refused by name, changing nothing."""
from __future__ import annotations

import numpy as np
import pytest
from tinygrad import Tensor

from pyruntime import errors
from pyruntime.stage.compute.kv_blocks import KVBlocks

SLOTS, N = 3, 6  # slots (plus the filler slot the rows path keeps), float32 elements of one slot's state


def state_blocks(snapshots: int = 2) -> tuple[KVBlocks, Tensor]:
  t = Tensor.zeros((SLOTS + 1) * N).contiguous().realize()
  return KVBlocks([], 4, 16, [(t, SLOTS + 1, N)], snapshots), t


def set_slot(t: Tensor, slot: int, values: np.ndarray) -> None:
  arr = t.numpy().copy()
  arr[slot * N:(slot + 1) * N] = values
  t.uop.buffer.copyin(memoryview(bytearray(arr.tobytes())))


def slot_of(t: Tensor, slot: int) -> np.ndarray: return t.numpy()[slot * N:(slot + 1) * N]


def test_a_kept_boundary_is_saved_and_restored_bit_for_bit():
  kb, t = state_blocks()
  assert kb.state_bytes == N * 4 and kb.snapshots == 2
  at16, at32, at48 = (np.random.default_rng(i).standard_normal(N).astype(np.float32) for i in range(3))
  for pos, v in ((16, at16), (32, at32), (48, at48)):
    set_slot(t, 1, v)
    kb.mark(1, pos)
  kb.save_state(1, [0, 32])  # the one before the latest is kept too
  kb.save_state(1, [1, 48])
  with pytest.raises(errors.PrefixBlocksInvalid, match="16"): kb.save_state(1, [0, 16])  # only the two latest are kept
  kb.load_state(2, 0, 32)
  assert slot_of(t, 2).tobytes() == at32.tobytes() and slot_of(t, 1).tobytes() == at48.tobytes()
  kb.save_state(2, [1, 32])  # a restored slot keeps the restored state as its boundary
  kb.load_state(0, 1, 32)
  assert slot_of(t, 0).tobytes() == at32.tobytes()
  assert kb.stats["saved_states"] == 3 and kb.stats["loaded_states"] == 2


def test_what_the_launcher_could_get_wrong_is_refused_by_name():
  kb, t = state_blocks()
  with pytest.raises(errors.PrefixBlocksInvalid): kb.save_state(0, [0, 16])  # nothing kept in that slot yet
  set_slot(t, 0, np.ones(N, np.float32))
  kb.mark(0, 16)
  before = t.numpy().copy()
  for bad in ([2, 16], [-1, 16], ["0", 16], [0], [0, "16"], None, {"0": 16}):
    with pytest.raises(errors.PrefixBlocksInvalid): kb.save_state(0, bad)
  with pytest.raises(errors.PrefixBlocksInvalid, match="position -1"): kb.load_state(1, 0, 16)  # never saved
  kb.save_state(0, [0, 16])
  with pytest.raises(errors.PrefixBlocksInvalid, match="position 16, not 32"): kb.load_state(1, 0, 32)
  for bad in (2, -1, True, "0", None):
    with pytest.raises(errors.PrefixBlocksInvalid): kb.load_state(1, bad, 16)
  assert t.numpy().tobytes() == before.tobytes()  # no refusal wrote anything


def test_stages_without_recurrent_blocks_keep_no_states():
  kb = KVBlocks([], 4, 16, [], snapshots=8)
  assert kb.snapshots == 0 and kb.state_bytes == 0
  kb.mark(0, 16)  # nothing to keep: no error, nothing held
  assert kb.boundary == {}
