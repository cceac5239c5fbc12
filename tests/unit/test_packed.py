"""Packed weights (pyruntime/stage/compute/packed.py): the repacked codes, scales and offsets rebuild every weight of a Q4_0,
Q4_1 or Q8_0 matrix as the reference's float16-rounded value, outputs in the order asked, on the host and in a kernel."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from tinygrad import Tensor

from pyruntime.stage.compute.packed import BLOCK, PackedMatrix, packable, repack

VEC = 16
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0]


def quantized(kind: Q, rows: int, K: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """A random (rows, K) matrix as GGML bytes, and the reference's weights: dequantised in float32, rounded to float16."""
  w = np.random.default_rng(seed).standard_normal((rows, K)).astype(np.float32) * 0.05
  raw = quantize(w, kind)
  return raw.reshape(-1), dequantize(raw, kind).reshape(rows, K).astype(np.float16)


def unpack_on_host(pm: PackedMatrix) -> np.ndarray:
  """The packed matrix's values (outputs, inputs) as float16, computed from its arrays the way its kernel does."""
  n, K, vec = pm.shape
  per = 32 // pm.bits
  fields = (pm.codes[:, :, None, :] >> (np.arange(per, dtype=np.int32) * pm.bits)[None, None, :, None]) & ((1 << pm.bits) - 1)
  q = (fields.reshape(n, K // BLOCK, BLOCK, vec) - pm.bias).astype(np.float32)
  w = q * pm.scale[:, :, None, :].astype(np.float32)
  if pm.offset is not None: w = w + pm.offset[:, :, None, :].astype(np.float32)
  return w.astype(np.float16).reshape(n, K, vec).transpose(0, 2, 1).reshape(n * vec, K)


@pytest.mark.parametrize("kind", TYPES)
def test_repacked_codes_rebuild_the_reference_weights(kind):
  raw, want = quantized(kind, 48, 96)
  pm = repack(raw, kind, (48, 96), None, VEC, half=True)
  assert pm.codes.dtype == np.int32 and pm.codes.shape == (3, 96 * pm.bits // 32, VEC) and pm.scale.shape == (3, 96 // BLOCK, VEC)
  assert (pm.offset is not None) == (kind == Q.Q4_1)
  assert np.array_equal(unpack_on_host(pm).view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("kind", TYPES)
def test_outputs_come_in_the_order_asked(kind):
  raw, want = quantized(kind, 32, 64, seed=1)
  rows = np.random.default_rng(2).permutation(32)
  assert np.array_equal(unpack_on_host(repack(raw, kind, (32, 64), rows, VEC, half=True)), want[rows])


def test_matrices_join_and_cut_along_the_outputs():
  (ra, wa), (rb, wb) = quantized(Q.Q4_1, 32, 64, 3), quantized(Q.Q4_1, 16, 64, 4)
  a, b = repack(ra, Q.Q4_1, (32, 64), None, VEC, True), repack(rb, Q.Q4_1, (16, 64), None, VEC, True)
  both = PackedMatrix.cat([a, b])
  assert both is not None and np.array_equal(unpack_on_host(both), np.concatenate([wa, wb]))
  assert np.array_equal(unpack_on_host(both[2:3]), wb)
  assert PackedMatrix.cat([a, repack(*quantized(Q.Q8_0, 16, 64)[:1], Q.Q8_0, (16, 64), None, VEC, True)]) is None  # formats differ


def test_the_kernel_expression_gives_the_same_values():
  raw, want = quantized(Q.Q4_1, 32, 64, seed=5)
  pm = repack(raw, Q.Q4_1, (32, 64), None, VEC, half=True).upload("CPU")
  got = pm.matrix().numpy()  # (outputs/VEC, inputs, VEC) float32
  assert got.dtype == np.float32 and np.array_equal(got.transpose(0, 2, 1).reshape(32, 64), want.astype(np.float32))
  assert all(isinstance(t, Tensor) for t in pm.buffers()) and len(pm.buffers()) == 3


def test_what_can_be_packed():
  assert packable(Q.Q4_1, (1536, 576), VEC) and packable(Q.Q8_0, (49152, 576), VEC)
  assert not packable(Q.Q4_1, (1000, 576), VEC)   # outputs not a whole number of vectors
  assert not packable(Q.Q4_1, (32, 48), VEC)      # inputs not a whole number of blocks
  assert not packable(Q.F16, (32, 64), VEC) and not packable(Q.Q4_K, (32, 256), VEC)
