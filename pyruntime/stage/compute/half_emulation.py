"""Float16 on a device without float16 arithmetic, converted as IEEE 754 converts it: subnormals kept.

A device whose renderer lacks float16 (the CL lane's PoCL: no cl_khr_fp16) gets tinygrad's emulation, which loads a
float16 as its 16 bits and widens them with integer operations (`tinygrad.uop.decompositions.f2f`). That conversion
treats subnormals as zero both ways ("denormals are zero"). A weight's value that small hardly matters, but a quantized
block's scale does: a Q6_K super-block's d is max|w| / (32 * 127), ~2.5e-5 for a weight of 0.1, below float16's
smallest normal (2^-14 ~ 6.1e-5), so on such a device every Q6_K weight of a real file dequantised to zero, and Q4_K and
Q5_K lost the blocks of small weights. A CPU (F16C) and a GPU convert subnormals exactly.

`install()` (at import: every user of the stage's compute gets it) wraps tinygrad's conversion so that float16 <->
float32 keeps subnormals, bit for bit what the hardware conversion gives: a float16 subnormal is its mantissa times
2^-24 (exact in float32); a float32 below float16's normals rounds to the nearest multiple of 2^-24, ties to even
(adding 2^23 makes the float32 sum's last bit that multiple, rounded by the float adder itself). Other formats
(bfloat16, fp8) keep tinygrad's conversion. Kernels where no float16 is emulated are unchanged.
"""
from __future__ import annotations

from tinygrad import dtypes
from tinygrad.uop import decompositions

_STOCK = decompositions.f2f
HALF_EXP, HALF_MANTISSA = 0x7C00, 0x3FF


def f2f(v, fr, to, sat: bool = True):
  """tinygrad's `f2f(bits, from, to)` with float16 subnormals converted exactly (see the module docstring)."""
  out = _STOCK(v, fr, to, sat)
  if (fr, to) == (dtypes.half, dtypes.float32):  # v: the float16's bits (uint16); out: a float32
    value = (v & HALF_MANTISSA).cast(dtypes.float32) * 2.0 ** -24
    value = (v & 0x8000).ne(0).where(-value, value)
    return (v & HALF_EXP).eq(0).where(value, out)
  if (fr, to) == (dtypes.float32, dtypes.half):  # v: the float32's bits (uint32); out: the float16's bits (uint16)
    magnitude = (v & 0x7FFFFFFF).bitcast(dtypes.float32)
    code = ((magnitude * 2.0 ** 24 + 2.0 ** 23).bitcast(dtypes.uint32) & 0x7FFFFF).cast(dtypes.uint16)  # <= 0x400: the smallest normal
    sign = (v // 2 ** 16 & 0x8000).cast(dtypes.uint16)
    return ((v & 0x7F800000) < (113 << 23)).where(sign | code, out)  # below 2^-14: float16's subnormal range
  return out


def install() -> None:
  """Make tinygrad's float16 emulation convert subnormals exactly (idempotent)."""
  decompositions.f2f = f2f


install()
