"""Packed weights: a projection kept as the file's quantized codes, rebuilt inside the kernel that reads it.

A stage with `--weights packed` holds each dense projection of a Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K
tensor (every type of a Q4_K_M file) as integer codes and per-block scales, repacked once at load into the rows path's
column blocks (outputs / VEC, words, VEC): each 32-bit word holds the low 4 bits of 8 consecutive inputs of one output
(8 bits of 4 for Q8_0), a second set of words the high bits of 5- and 6-bit codes (32 / (bits - 4) a word), so VEC
outputs' codes are one vector load; each block's scale (and offset) sits beside them the same way.

The kernel unpacks a code with shifts and masks and computes the value float32 mode holds, in the same arithmetic as
the reference's dequantisation (tinygrad's `ggml_data_to_tensor`), then rounds it to float16 as the reference model
rounds every weight and widens it to float32. Every product in those formulas is exact in float32 (a code has at most
8 bits, a float16 scale 11, a K-quant's sub-block scale 6 or 8), so a product's factors may be grouped differently:
 - Q4_0, Q8_0: (q - bias) * d, a float16 d; Q5_0: q * d + (-16 * d), as the reference writes it (the same value as
   (q - 16) * d, but for the sign of a zero);
 - Q4_1, Q5_1: q * d + m, float16 d and m;
 - Q4_K, Q5_K: q * (d * sc) - dmin * mn per 32 inputs, the integer sc and mn held per block and the float16 d and
   dmin per super-block of 256, as in the file: d * sc and dmin * mn are exact (17 bits), so this is the reference's
   (d * sc) * q - dmin * mn;
 - Q6_K: (q - 32) * (d * sc), an int8 sc per 16 inputs and d per 256 (the reference's (d * (q - 32)) * sc: the same
   exact product).
The sum over the inputs is the rows path's, in the same order, so a packed stage gives float32 mode's bits
(tests/integration/test_rows.py, tests/unit/test_packed.py) from the file's bytes, or a few hundredths of a bit a
weight more (a code's bits, and a block's scale and offset as the file holds them), where float16 holds 16 bits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from tinygrad import Tensor, dtypes

from pyruntime.modelfile.gguf import GGML_TYPES, PACKED_TYPES, SUPER_BLOCK
from pyruntime.stage.compute import device_memory

LOW = 4  # the low bits of a code below 8 bits live in words of 8 fields; the rest in words of their own
# a product of many rows reads a packed matrix staged (dequantised into a float16 scratch copy first:
# matrix(staged=True)), in pieces whose copies each fit this (PackedMatrix.pieces): a copy that does not stay in the
# CPU's last-level cache costs more memory traffic than rebuilding the values in registers for every ROWS rows (Llama
# 3.2 1B's 2048 x 8192 feed-forward, 33.5 MB staged whole: its 64-row chunks 1.4x faster in registers), while a piece
# read by all the rows as soon as it is written is the float16 product's rate (that matrix's 256-row chunks ~1.5x
# faster in two pieces than in registers; SmolLM2's 1.8 MB copies are one piece each). A MoE block's experts are one
# copy here, staged only whole (a row's experts are chosen inside the kernel): a Qwen3-30B-A3B block's 128 experts
# would be a 403 MB copy per matrix, 1.2 GB a block, and stay in registers
STAGED_MAX_BYTES = 16 << 20


def packable(ggml_type: int, shape: tuple[int, ...], vec: int) -> bool:
  """Whether a matrix (outputs, inputs), or a MoE block's experts' matrices (experts, outputs, inputs), can be packed."""
  if ggml_type not in PACKED_TYPES or len(shape) not in (2, 3) or shape[-2] % vec: return False
  return shape[-1] % GGML_TYPES[ggml_type][0] == 0  # whole blocks (a K-quant's super-block: 256 inputs)


@dataclass
class PackedMatrix:
  """One (outputs, inputs) matrix as codes (outputs/VEC, words, VEC) int32 (low bits), `high` codes of the same layout
  for 5- and 6-bit types, and per-block scale and offset (outputs/VEC, inputs/block, VEC): float16, or a K-quant's
  integers with its super-blocks' float16 d and dmin (`dscale`, `doffset`: (outputs/VEC, inputs/256, VEC)). Host
  arrays as `repack` makes them, realized buffers once uploaded (the graph cache names them). `matrix()` is the lazy
  expression of its values in the column-block layout of float modes, (outputs/VEC, inputs, VEC) float32.

  A MoE block's experts are one PackedMatrix whose arrays lead with the experts axis (`stack`); `matrix()` keeps any
  leading axes, so `matrix()[sel]` is the chosen experts' values: indexed after the rebuild, the gather stays a load
  by index in the kernel that reads them. (Gathering the arrays first made tinygrad copy every chosen expert's codes
  into a buffer of their own before the product: 3.5x the product's time and 300 MB a 16-row graph for a
  Qwen3-30B-A3B-shaped block; bench/results/2026-12-07-moe-real-size-block.md.)"""
  codes: Any
  high: Any
  scale: Any
  offset: Any
  bits: int
  bias: int
  block: int
  half: bool
  scaled_offset: int = 0  # k: an offset of k * scale (Q5_0), computed here rather than held
  dscale: Any = None      # a K-quant's super-block factors of its integer scales and offsets
  doffset: Any = None
  integer: bool = False   # its products in int8 arithmetic (weights="packed-int8", int8_product.py), not from its values

  @property
  def low_bits(self) -> int: return 8 if self.bits == 8 else LOW

  @property
  def fits_staging(self) -> bool:
    """Whether matrix(staged=True)'s float16 copy (every expert's, for a MoE block's) is at most STAGED_MAX_BYTES."""
    return 2 * math.prod(self.shape) <= STAGED_MAX_BYTES

  def pieces(self) -> list[PackedMatrix]:
    """One matrix (no leading axes) as runs of its column blocks whose float16 copies each fit STAGED_MAX_BYTES (itself
    when its copy fits, or when not even one column block's would): a product of many rows stages one piece, reads it
    while it is in the cache, then the next."""
    n, K, vec = self.shape
    per = STAGED_MAX_BYTES // (2 * K * vec)
    return [self] if per >= n or per == 0 else [self[i:i + per] for i in range(0, n, per)]

  @property
  def lead(self) -> tuple[int, ...]:
    """The axes before a matrix's own: () for one matrix, (experts,) for a MoE block's."""
    return tuple(self.codes.shape[:-3])

  @property
  def shape(self) -> tuple[int, ...]:
    *lead, n, words, vec = self.codes.shape
    return (*lead, n, words * (32 // self.low_bits), vec)

  def matrix(self, staged: bool = False) -> Tensor:
    """The values, rebuilt in the registers of the kernel that reads them; `staged`: written to a scratch buffer (in the
    graph's memory) by a kernel of their own first, as float16 (the same values), so that a kernel of many rows does
    not rebuild each weight for every ROWS of them, where that copy fits (fits_staging; else rebuilt in registers)."""
    *lead, n, K, vec = self.shape
    q = _fields(self.codes, self.low_bits, K)
    if self.high is not None: q = q + (_fields(self.high, self.bits - LOW, K) << LOW)
    if self.bias: q = q - self.bias
    q = q.reshape(*lead, n, K // self.block, self.block, vec).cast(dtypes.float32)
    w = q * self._per_block(self.scale, self.dscale)
    if self.dscale is not None and self.offset is not None: w = w - self._per_block(self.offset, self.doffset)  # - dmin * mn
    elif self.offset is not None: w = w + self._per_block(self.offset, None)
    if self.scaled_offset: w = w + self._per_block(self.scale, None) * self.scaled_offset
    if self.half: w = w.cast(dtypes.float16)
    if staged and self.fits_staging: w = w.contiguous()
    return w.cast(dtypes.float32).reshape(*lead, n, K, vec)

  def _per_block(self, a: Tensor, factor: Tensor | None) -> Tensor:
    """A per-block array as float32 (..., n, blocks, 1, vec); with a K-quant's super-block `factor`, factor * a (exact)."""
    *lead, n, K, vec = self.shape
    if factor is None: return a.reshape(*lead, n, K // self.block, 1, vec).cast(dtypes.float32)
    per = SUPER_BLOCK // self.block
    f = factor.reshape(*lead, n, K // SUPER_BLOCK, 1, 1, vec).cast(dtypes.float32)
    return (f * a.reshape(*lead, n, K // SUPER_BLOCK, per, 1, vec).cast(dtypes.float32)).reshape(*lead, n, K // self.block, 1, vec)

  def _arrays(self) -> tuple[Any, ...]: return self.codes, self.high, self.scale, self.offset, self.dscale, self.doffset

  def _with(self, arrays: Any) -> PackedMatrix:
    codes, high, scale, offset, dscale, doffset = arrays
    return PackedMatrix(codes, high, scale, offset, self.bits, self.bias, self.block, self.half, self.scaled_offset, dscale, doffset,
                        self.integer)

  def __getitem__(self, s: slice) -> PackedMatrix:
    """Column blocks s of this matrix (views of its buffers)."""
    return self._with(None if a is None else a[s] for a in self._arrays())

  def buffers(self) -> list[Tensor]: return [t for t in self._arrays() if isinstance(t, Tensor)]

  @property
  def on_host(self) -> bool: return isinstance(self.codes, np.ndarray)

  def upload(self, device: str) -> PackedMatrix:
    return self._with(None if a is None else device_memory.upload(a, device) for a in self._arrays())

  @staticmethod
  def cat(parts: list[PackedMatrix]) -> PackedMatrix | None:
    """Host matrices one after another in one set of arrays, or None when their formats differ."""
    first = parts[0]
    kinds = {(p.bits, p.bias, p.block, p.half, p.scaled_offset, p.high is None, p.offset is None, p.dscale is None, p.scale.dtype, p.shape[1:],
              p.integer)
             for p in parts}
    if not all(p.on_host for p in parts) or len(kinds) != 1: return None
    return first._with(None if a is None else np.concatenate([p._arrays()[i] for p in parts], axis=0) for i, a in enumerate(first._arrays()))

  @staticmethod
  def stack(parts: list[PackedMatrix]) -> PackedMatrix:
    """Host matrices of one format (a MoE block's experts: one tensor of the file) along a new leading axis."""
    return parts[0]._with(None if a is None else np.stack([p._arrays()[i] for p in parts]) for i, a in enumerate(parts[0]._arrays()))


def _fields(words: Tensor, bits: int, K: int) -> Tensor:
  """The `bits`-wide fields of (..., n, K * bits / 32, vec) int32 words as (..., n, K, vec) ints: field i of word w is
  input w * (32 / bits) + i."""
  *lead, n, _, vec = words.shape
  per = 32 // bits
  shifts = (Tensor.arange(per, dtype=dtypes.int32, device=words.device) * bits).reshape(1, 1, per, 1)
  return ((words.reshape(*lead, n, K // per, 1, vec) >> shifts) & ((1 << bits) - 1)).reshape(*lead, n, K, vec)


# --- the file's blocks as codes, scales and offsets ---------------------------------------------------------------
def _nibbles(qs: np.ndarray) -> np.ndarray:
  """A 32-input block's 16 bytes: input j (< 16) in the low nibble of byte j, input j + 16 in its high nibble."""
  out = np.empty((*qs.shape[:-1], 2 * qs.shape[-1]), np.uint8)
  np.bitwise_and(qs, 15, out=out[..., :qs.shape[-1]])
  np.right_shift(qs, 4, out=out[..., qs.shape[-1]:])
  return out


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Q4_K's and Q5_K's 12 bytes of 6-bit sub-block scales and mins: 8 of each."""
  sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
  mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
  return sc, mn


def _k_low(qs: np.ndarray) -> np.ndarray:
  """Q4_K's and Q5_K's 128 bytes of low nibbles: 4 chunks of 32 bytes, the low nibbles of a chunk its even sub-block,
  the high nibbles the next."""
  c = qs.reshape(*qs.shape[:-1], 4, 32)
  return np.stack([c & 15, c >> 4], axis=-2).reshape(*qs.shape[:-1], 256)


def _bits(b: np.ndarray, width: int) -> np.ndarray:
  """Every `width`-bit field of bytes b (..., m), lowest first: (..., 8 / width, m), field f of byte i at [f, i]."""
  return np.stack([(b >> (f * width)) & ((1 << width) - 1) for f in range(8 // width)], axis=-2)


def decode(blocks: np.ndarray, ggml_type: int) -> tuple[np.ndarray, ...]:
  """A row's blocks (rows, blocks, bytes) as (codes (rows, inputs) uint8, before the bias; scale and offset per block
  (rows, inputs / block): float16 as the file holds them, a K-quant's integers; a K-quant's d and dmin per super-block
  (rows, inputs / 256) float16, else None): the terms of the formulas in packed.py's module docstring."""
  t, r = ggml_type, blocks.shape[0]
  f16 = lambda b: b.copy().view(np.float16)[..., 0]  # noqa: E731
  if t in (2, 3, 8, 6, 7):
    d = f16(blocks[..., 0:2])
    m = f16(blocks[..., 2:4]) if t in (3, 7) else None
    if t == 8: return (blocks[..., 2:34] ^ 0x80).reshape(r, -1), d, None, None, None
    if t in (2, 3): return _nibbles(blocks[..., 4 if t == 3 else 2:]).reshape(r, -1), d, m, None, None
    at = 4 if t == 7 else 2  # Q5_0 / Q5_1: 32 high bits (input j's is bit j), then the low nibbles
    qh = _bits(blocks[..., at:at + 4], 1)  # (..., 8, 4): bit f of byte i is input 8 i + f
    high = qh.swapaxes(-1, -2).reshape(*blocks.shape[:-1], 32)
    return (_nibbles(blocks[..., at + 4:]) | (high << 4)).reshape(r, -1), d, m, None, None
  if t in (12, 13):
    d, dmin = f16(blocks[..., 0:2]), f16(blocks[..., 2:4])
    sc, mn = _k_scales(blocks[..., 4:16])
    q = _k_low(blocks[..., 48 if t == 13 else 16:])
    if t == 13: q = q | (_bits(blocks[..., 16:48], 1).reshape(*blocks.shape[:-1], 256) << 4)  # bit j of byte i: input 32 j + i
    return q.reshape(r, -1), sc.reshape(r, -1), mn.reshape(r, -1), d, dmin
  if t == 14:
    low = _bits(blocks[..., 0:128].reshape(*blocks.shape[:-1], 2, 64), 4).reshape(*blocks.shape[:-1], 2, 128)
    high = _bits(blocks[..., 128:192].reshape(*blocks.shape[:-1], 2, 32), 2).reshape(*blocks.shape[:-1], 2, 128)
    sc = blocks[..., 192:208].view(np.int8)
    return (low | (high << 4)).reshape(r, -1), sc.reshape(r, -1), None, f16(blocks[..., 208:210]), None
  raise ValueError(f"GGML type {t} is not packed")


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
  """(rows, K) uint8 codes of `bits` (1, 2, 4 or 8) bits, 32 / bits to a little-endian int32 word, field i of word w
  input w * 32 / bits + i. Packed a byte at a time (8 / bits fields each), all in uint8: byte j of a word holds its
  fields j * 8 / bits.., so the bytes read as int32 are the words (widening every code to a word first made the
  repack most of a stage's load: 6 of 10 s for a 1B Q4_0 model)."""
  per = 8 // bits
  fields = q.astype(np.uint8, copy=False).reshape(q.shape[0], -1, per)
  out = fields[..., 0].copy()
  for k in range(1, per): out |= fields[..., k] << np.uint8(k * bits)
  return out.view(np.int32)


def repack_experts(raw: np.ndarray, ggml_type: int, shape: tuple[int, int, int], vec: int, half: bool) -> PackedMatrix:
  """A MoE block's experts (experts, outputs, inputs) from the bytes of their one GGML tensor (expert after expert), each
  repacked as `repack` does a matrix, stacked along a leading experts axis."""
  E, n_out, K = shape
  per_block, size = GGML_TYPES[ggml_type]
  each = n_out * K // per_block * size
  return PackedMatrix.stack([repack(raw[e * each:(e + 1) * each], ggml_type, (n_out, K), None, vec, half) for e in range(E)])


def repack(raw: np.ndarray, ggml_type: int, shape: tuple[int, int], rows: np.ndarray | None, vec: int, half: bool,
           wide: bool = False) -> PackedMatrix:
  """The matrix of `shape` (outputs, inputs) from its GGML bytes `raw`, its outputs taken in the order `rows` (the
  reference's rotary permutation of q and k, or None), as a PackedMatrix of host arrays (`upload` puts it on a device).
  `wide`: 5- and 6-bit codes held a byte each (as 8-bit codes: the integer products' kernel reads bytes), not split."""
  block, bits, bias, _, _, scaled_offset = PACKED_TYPES[ggml_type]
  per_block, size = GGML_TYPES[ggml_type]
  n_out, K = shape
  blocks = np.ascontiguousarray(raw[:n_out * K // per_block * size]).reshape(n_out, K // per_block, size)
  if rows is not None: blocks = blocks[rows]
  q, scale, offset, dscale, doffset = decode(blocks, ggml_type)
  if wide and bits > LOW: bits = 8
  low = LOW if bits < 8 else 8
  codes = _pack(q if bits == low else q & ((1 << low) - 1), low)  # (codes of `low` bits or fewer need no mask)
  high = _pack(q >> LOW, bits - LOW) if LOW < bits < 8 else None

  def blocked(a: np.ndarray | None) -> np.ndarray | None:
    return None if a is None else np.ascontiguousarray(a.reshape(n_out // vec, vec, -1).transpose(0, 2, 1))
  return PackedMatrix(blocked(codes), blocked(high), blocked(scale), blocked(offset), bits, bias, block, half, scaled_offset,
                      blocked(dscale), blocked(doffset))
