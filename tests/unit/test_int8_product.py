"""Integer products (pyruntime/stage/compute/int8_product.py): llama.cpp's arithmetic on packed Q4_0/Q4_1/Q8_0 matrices.

Each row quantized on its own (int8 per block of 32), the integer sums exact, the float steps in one fixed order: the
results are the arithmetic's (checked against float64 on the same integers), a row's bits do not depend on the rows
beside it, and every instruction set's kernel (AVX-512 VNNI, AVX2, plain C) gives the same bits."""
from __future__ import annotations

import ctypes
import platform
import subprocess

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from test_packed import quantized
from tinygrad import Tensor

from pyruntime.stage.compute import int8_product
from pyruntime.stage.compute.packed import repack

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0]


def matrix(kind: Q, rows: int = 64, K: int = 256):
  raw, _ = quantized(kind, rows, K)
  pm = repack(raw, int(kind), (rows, K), None, 16, True)
  pm.integer = True
  return raw, pm


def file_terms(raw: np.ndarray, kind: Q, rows: int, K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The file's integer codes (rows, K) as the formula takes them (q - bias), and d and m per block (rows, K / 32)."""
  b = raw.reshape(rows, K // 32, -1)
  f16 = lambda a: a.copy().view(np.float16)[..., 0].astype(np.float64)  # noqa: E731
  if kind == Q.Q8_0: return b[..., 2:].view(np.int8).astype(np.int64).reshape(rows, K), f16(b[..., 0:2]), np.zeros((rows, K // 32))
  qs = b[..., 4:] if kind == Q.Q4_1 else b[..., 2:]
  q = np.concatenate([qs & 15, qs >> 4], -1).astype(np.int64).reshape(rows, K)
  return (q, f16(b[..., 0:2]), f16(b[..., 2:4])) if kind == Q.Q4_1 else (q - 8, f16(b[..., 0:2]), np.zeros((rows, K // 32)))


def test_rows_quantize_per_block_of_32():
  """q = round(x / e), e = max|x| * (1/127) per block, s the block's sum; codes in the nibbles' order; a zero block stays zero."""
  x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
  x[1, 32:] = 0
  q, e, s = (t.numpy() for t in int8_product.quantize_rows(Tensor(x), 4))
  want_e = np.abs(x.reshape(3, 2, 32)).max(-1) * np.float32(1 / 127)
  assert np.array_equal(e, want_e)
  plain = np.round(x.reshape(3, 2, 32) / np.where(want_e == 0, 1, want_e)[..., None]).reshape(3, 64)
  assert np.array_equal(q, plain.reshape(3, 8, 4, 2).transpose(0, 1, 3, 2).reshape(3, 64))  # 0 2 4 6 1 3 5 7
  assert np.array_equal(s, plain.reshape(3, 2, 32).sum(-1)) and np.abs(q).max() == 127 and not q[1, 32:].any()
  q8, _, _ = (t.numpy() for t in int8_product.quantize_rows(Tensor(x), 8))
  assert np.array_equal(q8, plain)


@pytest.mark.parametrize("kind", TYPES)
def test_products_are_llama_cpps_arithmetic(kind):
  """y = sum over blocks of (d e) (sum(u q) - bias s) [+ (m e) s]: float64 on the same integers agrees to float32's
  rounding of the sum, and the result is within int8 quantization's error of the float product."""
  rows, K = 64, 256
  raw, pm = matrix(kind, rows, K)
  pm = pm.upload("CPU")
  x = np.random.default_rng(1).standard_normal((13, K)).astype(np.float32)  # a tile of 8 rows (or 4) and the rest
  y = int8_product.product(Tensor(x), pm).numpy()
  codes, d, m = file_terms(raw, kind, rows, K)
  e = np.abs(x.reshape(13, -1, 32)).max(-1) * np.float32(1 / 127)
  xq = np.round(x.reshape(13, -1, 32) / e[..., None]).astype(np.int64)
  sums = np.einsum("obj,rbj->rob", codes.reshape(rows, -1, 32), xq)
  want = (sums * d[None] * e[:, None].astype(np.float64) + m[None] * xq.sum(-1)[:, None] * e[:, None]).sum(-1)
  assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()
  exact = x.astype(np.float64) @ ((codes.reshape(rows, -1, 32) * d[..., None] + m[..., None]).reshape(rows, K)).T
  assert 1e-4 < np.abs(y - exact).max() / np.abs(exact).max() < 0.05  # int8's error: there, and small


@pytest.mark.parametrize("kind", TYPES)
def test_a_row_gives_the_same_bits_alone_and_among_others(kind):
  _, pm = matrix(kind)
  pm = pm.upload("CPU")
  x = np.random.default_rng(2).standard_normal((11, 256)).astype(np.float32) * 3
  together = int8_product.product(Tensor(x), pm).numpy()
  for r in (0, 5, 10):
    assert np.array_equal(int8_product.product(Tensor(x[r:r + 1]), pm).numpy()[0].view(np.uint32), together[r].view(np.uint32))
  shuffled = int8_product.product(Tensor(x[::-1].copy()), pm).numpy()[::-1]
  assert np.array_equal(shuffled.view(np.uint32), together.view(np.uint32))


def test_only_a_cpus_plain_matrices_multiply_in_integers():
  _, pm = matrix(Q.Q4_0)
  assert int8_product.supported(pm, "CPU") and not int8_product.supported(pm, "CL") and not int8_product.supported(pm, "CUDA")
  _, k = matrix(Q.Q4_K, 32, 256)
  assert not int8_product.supported(k, "CPU")  # a K-quant keeps the float arithmetic
  experts = repack(quantized(Q.Q4_0, 64, 256)[0], int(Q.Q4_0), (64, 256), None, 16, True)
  assert not int8_product.supported(type(experts).stack([experts, experts]), "CPU")  # a MoE block's experts too


def compiled(src: str, flags: list[str], tmp_path, offset: bool):
  """The kernel body as a C function built by clang with `flags`, loaded with ctypes."""
  names = ["y", "codes", "scale", *(["offset"] if offset else []), "xq", "e", "s"]
  args = ", ".join([f"void *{n}_" for n in names] + ["int t_"])
  body = src.format(*[f"{n}_" for n in names], "t_")
  lib = tmp_path / f"k_{'_'.join(flags)}.so"
  subprocess.run(["clang", "-O2", *flags, "-shared", "-fPIC", "-x", "c", "-", "-o", str(lib), "-lm"],
                 input=f"void kernel({args}) {body}\n".encode(), check=True)
  return ctypes.CDLL(str(lib)).kernel


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the instruction sets compared are x86's")
@pytest.mark.parametrize("kind", TYPES)
def test_every_instruction_set_gives_the_same_bits(kind, tmp_path):
  """The kernel built for AVX-512 VNNI (vpdpbusd), AVX2 (vpmaddubsw: 8-bit codes signed first, so no pair saturates) and
  plain C (no AVX2) gives the bits the stage's kernel gives, on rows that reach every code's extreme."""
  rows, K, R = 64, 256, 9
  _, pm = matrix(kind, rows, K)
  rng = np.random.default_rng(3)
  x = rng.standard_normal((R, K)).astype(np.float32)
  x[0, ::32] = 50  # each block's maximum: codes of +-127 against every weight
  want = int8_product.product(Tensor(x), pm.upload("CPU")).numpy()
  xq, e, s = (np.ascontiguousarray(t.numpy()) for t in int8_product.quantize_rows(Tensor(x), pm.bits))
  offset = pm.offset is not None
  src = int8_product.kernel_source(R, rows, K, pm.bits, pm.bias, offset, 1)
  arrays = [pm.codes, pm.scale, *([pm.offset] if offset else []), xq, e, s]
  flags = subprocess.run(["clang", "-march=native", "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True, text=True).stdout
  # AVX2 and FMA; neither (float16 conversions kept: -mf16c); and AVX-512 VNNI where this CPU has it
  isas = [["-march=x86-64-v3"], ["-march=x86-64-v2", "-mf16c"]] + ([["-march=native"]] if "__AVX512VNNI__" in flags else [])
  for isa in isas:
    y = np.zeros((R, rows), np.float32)
    compiled(src, isa, tmp_path, offset)(*[a.ctypes.data_as(ctypes.c_void_p) for a in (y, *arrays)], 0)
    assert np.array_equal(y.view(np.uint32), want.view(np.uint32)), isa
