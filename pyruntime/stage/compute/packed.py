"""Packed weights: a projection kept as the file's quantized blocks, rebuilt inside the kernel that reads it.

A stage with `--weights packed` holds each dense projection of a Q4_0, Q4_1 or Q8_0 tensor as the file's bytes,
repacked once at load into the rows path's column blocks (outputs / VEC, words, VEC): each 32-bit word holds the codes
of 8 (4-bit) or 4 (8-bit) consecutive inputs of one output, so VEC outputs' codes are one vector load, and each
block's scale (and Q4_1's offset) sit beside them the same way, as float16. The kernel unpacks a code with a shift and a
mask, converts it, and computes the value float32 mode holds, in the same arithmetic: q * d (+ m) in float32 (q * d is
exact: a code has at most 8 bits, d 11), rounded to float16 as the reference model rounds every weight, then widened
to float32. The sum over the inputs is the rows path's, in the same order, so a packed stage gives float32 mode's bits
(tests/integration/test_rows.py) from the file's bytes: ~0.6 bytes a weight for Q4_1 where float16 holds 2.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from tinygrad import Tensor, dtypes

from pyruntime.modelfile.gguf import GGML_TYPES, PACKED_TYPES
from pyruntime.stage.compute import device_memory

BLOCK = 32  # inputs per quantization block (all three types)


def packable(ggml_type: int, shape: tuple[int, ...], vec: int) -> bool:
  return ggml_type in PACKED_TYPES and len(shape) == 2 and shape[0] % vec == 0 and shape[1] % BLOCK == 0


@dataclass
class PackedMatrix:
  """One (outputs, inputs) matrix as codes (outputs/VEC, words, VEC) int32 and per-block scale and offset (outputs/VEC,
  inputs/BLOCK, VEC) float16: host arrays as `repack` makes them, realized buffers once uploaded (the graph cache names
  them). `matrix()` is the lazy expression of its values in the column-block layout of float modes, (outputs/VEC,
  inputs, VEC) float32."""
  codes: Any
  scale: Any
  offset: Any
  bits: int
  bias: int
  half: bool

  @property
  def shape(self) -> tuple[int, int, int]:
    n, words, vec = self.codes.shape
    return n, words * (32 // self.bits), vec

  def matrix(self, staged: bool = False) -> Tensor:
    """The values, rebuilt in the registers of the kernel that reads them; `staged`: written to a scratch buffer (in the
    graph's memory) by a kernel of their own first, as float16 (the same values), so that a kernel of many rows does
    not rebuild each weight for every ROWS of them."""
    n, K, vec = self.shape
    per = 32 // self.bits
    shifts = (Tensor.arange(per, dtype=dtypes.int32, device=self.codes.device) * self.bits).reshape(1, 1, per, 1)
    q = (self.codes.reshape(n, K // per, 1, vec) >> shifts) & ((1 << self.bits) - 1)
    if self.bias: q = q - self.bias
    q = q.reshape(n, K // BLOCK, BLOCK, vec).cast(dtypes.float32)
    w = q * self.scale.reshape(n, K // BLOCK, 1, vec).cast(dtypes.float32)
    if self.offset is not None: w = w + self.offset.reshape(n, K // BLOCK, 1, vec).cast(dtypes.float32)
    if self.half: w = w.cast(dtypes.float16)
    if staged: w = w.contiguous()
    return w.cast(dtypes.float32).reshape(n, K, vec)

  def __getitem__(self, s: slice) -> PackedMatrix:
    """Column blocks s of this matrix (views of its buffers)."""
    return PackedMatrix(self.codes[s], self.scale[s], None if self.offset is None else self.offset[s], self.bits, self.bias, self.half)

  def buffers(self) -> list[Tensor]:
    return [t for t in (self.codes, self.scale, self.offset) if isinstance(t, Tensor)]

  @property
  def on_host(self) -> bool: return isinstance(self.codes, np.ndarray)

  def upload(self, device: str) -> PackedMatrix:
    return PackedMatrix(*(None if a is None else device_memory.upload(a, device) for a in (self.codes, self.scale, self.offset)),
                        self.bits, self.bias, self.half)

  @staticmethod
  def cat(parts: list[PackedMatrix]) -> PackedMatrix | None:
    """Host matrices one after another in one set of arrays, or None when their formats differ."""
    first = parts[0]
    if not all(p.on_host for p in parts) or len({(p.bits, p.bias, p.half, p.offset is None, p.shape[1:]) for p in parts}) != 1: return None
    join = lambda arrays: np.concatenate(arrays, axis=0)  # noqa: E731
    return PackedMatrix(join([p.codes for p in parts]), join([p.scale for p in parts]),
                        None if first.offset is None else join([p.offset for p in parts]), first.bits, first.bias, first.half)


def repack(raw: np.ndarray, ggml_type: int, shape: tuple[int, int], rows: np.ndarray | None, vec: int, half: bool) -> PackedMatrix:
  """The matrix of `shape` (outputs, inputs) from its GGML bytes `raw`, its outputs taken in the order `rows` (the
  reference's rotary permutation of q and k, or None), as a PackedMatrix of host arrays (`upload` puts it on a device)."""
  (bits, bias, has_offset), size = PACKED_TYPES[ggml_type], GGML_TYPES[ggml_type][1]
  n_out, K = shape
  blocks = np.ascontiguousarray(raw[:n_out * K // BLOCK * size]).reshape(n_out, K // BLOCK, size)
  if rows is not None: blocks = blocks[rows]
  scale = blocks[..., 0:2].copy().view(np.float16)[..., 0]
  offset = blocks[..., 2:4].copy().view(np.float16)[..., 0] if has_offset else None
  qs = blocks[..., 4 if has_offset else 2:]
  if bits == 4:  # a block's 16 bytes hold input j (< 16) in the low nibble of byte j, input j + 16 in its high nibble
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n_out, K)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)  # two inputs a byte, the earlier in the low nibble: a word's field i is input 8w + i
  else:
    packed = (qs ^ 0x80).reshape(n_out, K)  # int8 q as q + 128, so a field unpacks with a shift and a mask (the bias restores q)
  codes = np.ascontiguousarray(packed).view(np.int32)  # little-endian: byte b is bits 8b..8b+7

  def blocked(a: np.ndarray) -> np.ndarray: return np.ascontiguousarray(a.reshape(n_out // vec, vec, -1).transpose(0, 2, 1))
  return PackedMatrix(blocked(codes), blocked(scale), None if offset is None else blocked(offset), bits, bias, half)
