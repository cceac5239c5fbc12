"""Packed weights (pyruntime/stage/compute/packed.py): the repacked codes, scales and offsets rebuild every weight of a Q4_0,
Q4_1 or Q8_0 matrix as the reference's float16-rounded value, outputs in the order asked, on the host and in a kernel."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from tinygrad import Tensor

from pyruntime.modelfile.gguf import GGML_TYPES, PACKED_TYPES, packed_nbytes
from pyruntime.stage.compute.packed import PackedMatrix, packable, repack, repack_experts

VEC = 16
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]  # every type of a Q4_K_M file


def quantized(kind: Q, rows: int, K: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """A random (rows, K) matrix as GGML bytes, and the reference's weights: tinygrad's own dequantisation (what its model
  loads), rounded to float16 as its model rounds every weight. K-quants (which gguf cannot quantize) are random bytes
  with float16 scales of a real model's size."""
  rng = np.random.default_rng(seed)
  per, size = GGML_TYPES[kind]
  if kind in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
    blocks = rng.integers(0, 256, (rows * K // per, size), dtype=np.uint8)
    scales = [(0, 2), (2, 4)] if kind != Q.Q6_K else [(208, 210)]
    for a, b in scales: blocks[:, a:b] = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    raw = blocks.reshape(-1)
  else: raw = quantize(rng.standard_normal((rows, K)).astype(np.float32) * 0.05, kind).reshape(-1)
  from tinygrad.llm.gguf import ggml_data_to_tensor
  want = ggml_data_to_tensor(Tensor(raw, device="CPU"), rows * K, int(kind)).cast("float16").numpy().reshape(rows, K)
  assert dequantize(raw.reshape(rows, -1), kind).shape == (rows, K)  # gguf reads the same bytes as a matrix of that shape
  return raw, want


def unpack_on_host(pm: PackedMatrix) -> np.ndarray:
  """The packed matrix's values (outputs, inputs) as float16, computed from its arrays the way its kernel does."""
  n, K, vec = pm.shape

  def fields(words: np.ndarray, bits: int) -> np.ndarray:
    per = 32 // bits
    return ((words[:, :, None, :] >> (np.arange(per, dtype=np.int32) * bits)[None, None, :, None]) & ((1 << bits) - 1)).reshape(n, K, vec)
  q = fields(pm.codes, pm.low_bits)
  if pm.high is not None: q = q + (fields(pm.high, pm.bits - 4) << 4)
  q = (q.reshape(n, K // pm.block, pm.block, vec) - pm.bias).astype(np.float32)

  def per_block(a: np.ndarray, factor: np.ndarray | None) -> np.ndarray:
    a = a.astype(np.float32)
    if factor is not None: a = np.repeat(factor.astype(np.float32), 256 // pm.block, axis=1) * a
    return a[:, :, None, :]
  w = q * per_block(pm.scale, pm.dscale)
  if pm.offset is not None and pm.dscale is not None: w = w - per_block(pm.offset, pm.doffset)
  elif pm.offset is not None: w = w + per_block(pm.offset, None)
  if pm.scaled_offset: w = w + pm.scale[:, :, None, :].astype(np.float32) * np.float32(pm.scaled_offset)
  return w.astype(np.float16).reshape(n, K, vec).transpose(0, 2, 1).reshape(n * vec, K)


@pytest.mark.parametrize("kind", TYPES)
def test_repacked_codes_rebuild_the_reference_weights(kind):
  raw, want = quantized(kind, 48, 512)
  pm = repack(raw, kind, (48, 512), None, VEC, half=True)
  block, bits, _, offset, k_quant, _ = PACKED_TYPES[kind]
  assert pm.codes.dtype == np.int32 and pm.codes.shape == (3, 512 * pm.low_bits // 32, VEC) and pm.scale.shape == (3, 512 // block, VEC)
  assert (pm.offset is not None) == offset and (pm.high is not None) == (bits in (5, 6)) and (pm.dscale is not None) == k_quant
  assert pm.scale.dtype == ((np.int8 if kind == Q.Q6_K else np.uint8) if k_quant else np.float16)
  held = sum(a.nbytes for a in (pm.codes, pm.high, pm.scale, pm.offset, pm.dscale, pm.doffset) if a is not None)
  assert held == packed_nbytes(kind, 48 * 512) <= 1.03 * len(raw), (held, len(raw))  # the file's size
  assert np.array_equal(unpack_on_host(pm).view(np.uint16), want.view(np.uint16))
  # `wide` (weights="packed-int8"): 5- and 6-bit codes a byte each, the same values, the bytes packed_nbytes counts
  wide = repack(raw, kind, (48, 512), None, VEC, half=True, wide=True)
  assert wide.high is None and wide.low_bits == (4 if bits == 4 else 8)
  wide_held = sum(a.nbytes for a in (wide.codes, wide.scale, wide.offset, wide.dscale, wide.doffset) if a is not None)
  assert wide_held == packed_nbytes(kind, 48 * 512, wide=True)
  assert np.array_equal(unpack_on_host(wide).view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("kind", TYPES)
def test_outputs_come_in_the_order_asked(kind):
  raw, want = quantized(kind, 32, 256, seed=1)
  rows = np.random.default_rng(2).permutation(32)
  assert np.array_equal(unpack_on_host(repack(raw, kind, (32, 256), rows, VEC, half=True)).view(np.uint16), want[rows].view(np.uint16))


def test_matrices_join_and_cut_along_the_outputs():
  (ra, wa), (rb, wb) = quantized(Q.Q4_1, 32, 64, 3), quantized(Q.Q4_1, 16, 64, 4)
  a, b = repack(ra, Q.Q4_1, (32, 64), None, VEC, True), repack(rb, Q.Q4_1, (16, 64), None, VEC, True)
  both = PackedMatrix.cat([a, b])
  assert both is not None and np.array_equal(unpack_on_host(both), np.concatenate([wa, wb]))
  assert np.array_equal(unpack_on_host(both[2:3]), wb)
  assert PackedMatrix.cat([a, repack(*quantized(Q.Q8_0, 16, 64)[:1], Q.Q8_0, (16, 64), None, VEC, True)]) is None  # formats differ


@pytest.mark.parametrize("kind", [Q.Q4_1, Q.Q5_0, Q.Q4_K, Q.Q6_K])
def test_the_kernel_expression_gives_the_same_values(kind):
  raw, want = quantized(kind, 32, 256, seed=5)
  pm = repack(raw, kind, (32, 256), None, VEC, half=True).upload("CPU")
  got = pm.matrix().numpy()  # (outputs/VEC, inputs, VEC) float32
  assert got.dtype == np.float32 and np.array_equal(got.transpose(0, 2, 1).reshape(32, 256), want.astype(np.float32))
  assert all(isinstance(t, Tensor) for t in pm.buffers())
  assert len(pm.buffers()) == 2 + (pm.offset is not None) + (pm.high is not None) + (pm.dscale is not None) + (pm.doffset is not None)


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q5_K])
def test_experts_pack_along_a_leading_axis_and_are_taken_by_index(kind):
  """A MoE block's experts (one tensor of the file, expert after expert) packed as one matrix per expert along a
  leading axis; the kernel's expression of the experts some rows chose (`matrix()[sel]`: a gather by index, staged or
  not) gives those experts' reference weights, for one pick per row and for k picks per row."""
  E, n, K = 4, 32, 256
  raw, want = quantized(kind, E * n, K, seed=7)  # the experts' rows one after another: the file's layout of (E, n, K)
  pm = repack_experts(raw, kind, (E, n, K), VEC, half=True)
  assert pm.lead == (E,) and pm.shape == (E, n // VEC, K, VEC)
  for e in range(E): assert np.array_equal(unpack_on_host(pm[e]).view(np.uint16), want[e * n:(e + 1) * n].view(np.uint16))
  dev = pm.upload("CPU")
  for sel, staged in (([2, 0, 3], False), ([[1, 3], [3, 0]], False), ([[1, 3], [3, 0]], True)):
    got = dev.matrix(staged=staged)[Tensor(sel, dtype="int32")].numpy()  # (*sel, n / VEC, K, VEC)
    flat = got.reshape(-1, n // VEC, K, VEC).transpose(0, 1, 3, 2).reshape(-1, n, K)
    assert np.array_equal(flat, np.stack([want[e * n:(e + 1) * n] for e in np.ravel(sel)]).astype(np.float32))
  assert packable(kind, (E, n, K), VEC) and not packable(kind, (E, n, K // 2 + 16), VEC)


def test_what_can_be_packed():
  assert packable(Q.Q4_1, (1536, 576), VEC) and packable(Q.Q8_0, (49152, 576), VEC)
  assert not packable(Q.Q4_1, (1000, 576), VEC)   # outputs not a whole number of vectors
  assert not packable(Q.Q4_1, (32, 48), VEC)      # inputs not a whole number of blocks
  assert packable(Q.Q4_K, (32, 256), VEC) and packable(Q.Q6_K, (32, 512), VEC)
  assert not packable(Q.Q4_K, (32, 96), VEC)      # inputs not a whole number of super-blocks (256)
  assert not packable(Q.F16, (32, 64), VEC) and not packable(Q.IQ4_XS, (32, 256), VEC)
