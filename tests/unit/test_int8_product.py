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

from pyruntime.modelfile.gguf import GGML_TYPES, PACKED_TYPES
from pyruntime.stage.compute import int8_product
from pyruntime.stage.compute.packed import decode, repack

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]  # every type of a Q4_K_M file


def matrix(kind: Q, rows: int = 64, K: int = 256):
  raw, want = quantized(kind, rows, K)
  pm = repack(raw, int(kind), (rows, K), None, 16, True, wide=True)
  pm.integer = True
  return raw, want, pm


def file_terms(raw: np.ndarray, kind: Q, rows: int, K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
  """The file's codes (rows, K) less their bias, and each block's d and m (rows, K / block) in float64, from the
  file's blocks as packed.decode reads them: the terms of the integer products' formula."""
  block, _, bias, _, k_quant, scaled_offset = PACKED_TYPES[int(kind)]
  per, size = GGML_TYPES[int(kind)]
  q, scale, offset, dscale, doffset = decode(raw.reshape(rows, K // per, size), int(kind))
  sup = lambda a: np.repeat(a.astype(np.float64), 256 // block, axis=1)  # noqa: E731
  d = sup(dscale) * scale.astype(np.float64) if k_quant else scale.astype(np.float64)
  m = np.zeros_like(d) if offset is None else -sup(doffset) * offset.astype(np.float64) if k_quant else offset.astype(np.float64)
  return q.astype(np.int64) - (bias - scaled_offset), d, m, block


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
  rounding of the sum, and the result is within int8 quantization's error of the float product of the weights
  tinygrad's own dequantisation gives."""
  rows, K, R = 64, 256, 13  # a tile of 8 rows (or 4) and the rest
  raw, weights, pm = matrix(kind, rows, K)
  x = np.random.default_rng(1).standard_normal((R, K)).astype(np.float32)
  y = int8_product.product(Tensor(x), pm.upload("CPU")).numpy()
  codes, d, m, block = file_terms(raw, kind, rows, K)
  e = np.abs(x.reshape(R, -1, 32)).max(-1) * np.float32(1 / 127)
  xq = np.round(x.reshape(R, -1, 32) / e[..., None]).astype(np.int64).reshape(R, -1, block)
  eb = np.repeat(e.astype(np.float64), 32 // block, axis=1)  # each weight block's e
  sums = np.einsum("obj,rbj->rob", codes.reshape(rows, -1, block), xq)
  want = ((sums * d[None] + m[None] * xq.sum(-1)[:, None]) * eb[:, None]).sum(-1)
  assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()
  exact = x.astype(np.float64) @ weights.astype(np.float64).T
  assert 1e-4 < np.abs(y - exact).max() / np.abs(exact).max() < 0.05  # int8's error: there, and small


@pytest.mark.parametrize("kind", TYPES)
def test_a_row_gives_the_same_bits_alone_and_among_others(kind):
  _, _, pm = matrix(kind)
  pm = pm.upload("CPU")
  x = np.random.default_rng(2).standard_normal((11, 256)).astype(np.float32) * 3
  together = int8_product.product(Tensor(x), pm).numpy()
  for r in (0, 5, 10):
    assert np.array_equal(int8_product.product(Tensor(x[r:r + 1]), pm).numpy()[0].view(np.uint32), together[r].view(np.uint32))
  shuffled = int8_product.product(Tensor(x[::-1].copy()), pm).numpy()[::-1]
  assert np.array_equal(shuffled.view(np.uint32), together.view(np.uint32))


def test_only_a_cpus_matrices_multiply_in_integers():
  _, _, pm = matrix(Q.Q6_K)
  assert int8_product.supported(pm, "CPU") and not int8_product.supported(pm, "CL") and not int8_product.supported(pm, "CUDA")
  split = repack(quantized(Q.Q6_K, 32, 256)[0], int(Q.Q6_K), (32, 256), None, 16, True)
  assert split.high is not None and not int8_product.supported(split, "CPU")  # 6-bit codes in two words: not the kernel's
  experts = repack(quantized(Q.Q4_0, 64, 256)[0], int(Q.Q4_0), (64, 256), None, 16, True)
  assert not int8_product.supported(type(experts).stack([experts, experts]), "CPU")  # a MoE block's experts too


def compiled(src: str, flags: list[str], tmp_path, names: list[str]):
  """The kernel body as a C function built by clang with `flags`, loaded with ctypes."""
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
  _, _, pm = matrix(kind, rows, K)
  rng = np.random.default_rng(3)
  x = rng.standard_normal((R, K)).astype(np.float32)
  x[0, ::32] = 50  # each block's maximum: codes of +-127 against every weight
  want = int8_product.product(Tensor(x), pm.upload("CPU")).numpy()
  f = int8_product.Form.of(pm)
  xq, e, s = (np.ascontiguousarray(t.numpy()) for t in int8_product.quantize_rows(Tensor(x), f.low, f.block))
  src = int8_product.kernel_source(R, rows, K, f, 1)
  held = dict(codes=pm.codes, scale=pm.scale, dscale=pm.dscale, offset=pm.offset, doffset=pm.doffset, xq=xq, e=e, s=s)
  arrays = [np.ascontiguousarray(held[n]) for n in int8_product.buffers(f)[1:]]
  flags = subprocess.run(["clang", "-march=native", "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True, text=True).stdout
  # AVX2 and FMA; neither (float16 conversions kept: -mf16c); and AVX-512 VNNI where this CPU has it
  isas = [["-march=x86-64-v3"], ["-march=x86-64-v2", "-mf16c"]] + ([["-march=native"]] if "__AVX512VNNI__" in flags else [])
  for isa in isas:
    y = np.zeros((R, rows), np.float32)
    compiled(src, isa, tmp_path, int8_product.buffers(f))(*[a.ctypes.data_as(ctypes.c_void_p) for a in (y, *arrays)], 0)
    assert np.array_equal(y.view(np.uint32), want.view(np.uint32)), isa
