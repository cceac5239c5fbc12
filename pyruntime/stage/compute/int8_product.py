"""Integer products (weights="packed-int8"): a packed matrix times rows whose values are quantized to 8 bits, on a CPU.

llama.cpp's arithmetic, in the rows path's contract. Each row of activations is quantized on its own, per block of 32
inputs: e = max|x| * (1/127), q = round(x / e) (int8, |q| <= 127), and s = sum(q) per weight block (`quantize_rows`).
A weight block of any type the stage packs (codes u, unsigned; the block's factors as the file holds them) then gives
each output

    acc += (d * e) * float(sum(u * q) - bias * s)          (+ (m * e) * float(s) where the type has an offset)

block after block in the inputs' order, from acc = 0, with d the block's float16 scale (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
or a K-quant's integer scale times its super-block's d (Q4_K, Q5_K, Q6_K: exact in float32), and m Q4_1's and Q5_1's
offset or a K-quant's -dmin * mn. The integer sum is exact (|sum| < 2^20), so the ISA that computes it (AVX-512 VNNI's
vpdpbusd, AVX2's vpmaddubsw and vpmaddwd, plain C elsewhere) changes no bit, and each float operation is one rounding
in a fixed order. A row's result depends on its own values only: a decode row equals a prompt row, and one stream alone
equals the same stream beside others, bit for bit.

The kernel reads PackedMatrix's column blocks as they are (outputs / 16, words, 16): one 32-bit word is 8 nibbles (or
4 bytes) of consecutive inputs of one output, so one vector of words is 16 outputs' codes and a vpdpbusd sums 4
products into each output's lane. A nibble word's low nibbles are inputs 0, 2, 4, 6 and its high nibbles 1, 3, 5, 7;
the quantized row is stored in that order (`order`), so each lane's 4 products pair a code with its own input. 5- and
6-bit codes are held a byte each in this mode (packed.repack's `wide`: those tensors 1.2-1.5x the file's bytes).

What it costs: quantizing is one small kernel per product's input, and the arithmetic is llama.cpp's, ~50x further
from the file's exact values than the float modes (bench/results/2026-12-08-int8-products.md). A MoE block's experts
keep the float arithmetic of the packed modes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tinygrad import Tensor, dtypes
from tinygrad.helpers import CPU_COUNT, prod
from tinygrad.uop.ops import AxisType, KernelInfo, Ops, UOp

from pyruntime import errors
from pyruntime.stage.compute.packed import PackedMatrix

BLOCK = 32   # inputs per quantized block of a row: a weight block, a K-quant's sub-block, or two of Q6_K's
LANES = 16   # outputs per column block (loop_schedules.VEC on a CPU)
# rows of one tile: each shares the tile's unpacked codes. AVX-512's 32 registers hold 8 rows' two accumulators, AVX2's
# 16 hold 4
TILE_ROWS = {"avx512": 8, "other": 4}


def supported(wb: PackedMatrix, device: str) -> bool:
  """Whether this product runs in integers: a CPU stage's matrix whose codes are nibbles or bytes (5- and 6-bit codes
  are held as bytes in this mode: packed.repack's `wide`), not a MoE block's experts."""
  return device.split(":")[0] == "CPU" and not wb.lead and wb.high is None and wb.block in (16, 32) and wb.shape[2] == LANES


def order(x: Tensor, bits: int) -> Tensor:
  """x (..., K) with each 8 inputs as a 4-bit code word's nibbles pair them (0, 2, 4, 6, 1, 3, 5, 7); 8-bit words hold
  consecutive inputs."""
  if bits == 8: return x
  *lead, K = x.shape
  return x.reshape(*lead, K // 8, 4, 2).transpose(-1, -2).reshape(*lead, K)


def quantize_rows(x: Tensor, bits: int, block: int = BLOCK) -> tuple[Tensor, Tensor, Tensor]:
  """Each row of x (R, K) float32 as int8 codes in `order` (R, K), their scales e (R, K / 32) float32, and the codes'
  sums s (R, K / block) int32 per weight block: q = round(x / e), e = max|x| * (1/127) per 32 inputs (a zero block:
  e = 0, q = 0)."""
  R, K = x.shape
  xb = x.reshape(R, K // BLOCK, BLOCK)
  e = xb.abs().max(-1) * (1 / 127)  # (what tinygrad makes of / 127: a float32 product)
  q = (xb / (e == 0).where(1.0, e).unsqueeze(-1)).round().cast(dtypes.int32).reshape(R, K)
  s = q.reshape(R, K // block, block).sum(-1, dtype=dtypes.int32)
  return order(q, bits).cast(dtypes.int8).contiguous(), e.contiguous(), s.contiguous()


# --- the kernel's C ---------------------------------------------------------------------------------------------
# clang's vector extensions and x86 builtins (the kernel is compiled freestanding: no headers), one integer sum per ISA
_PRELUDE = r"""
typedef int v16si __attribute__((vector_size(64)));
typedef float v16sf __attribute__((vector_size(64)));
typedef int v8si __attribute__((vector_size(32)));
typedef short v16hi __attribute__((vector_size(32)));
typedef signed char v32qi __attribute__((vector_size(32)));
typedef v16si v16si_u __attribute__((aligned(4)));
typedef int int_u __attribute__((aligned(1)));
typedef float v8sf __attribute__((vector_size(32)));
#define HALF_LO(v) __builtin_shufflevector((v), (v), 0, 1, 2, 3, 4, 5, 6, 7)
#define HALF_HI(v) __builtin_shufflevector((v), (v), 8, 9, 10, 11, 12, 13, 14, 15)
#define JOIN(a, b) __builtin_shufflevector((a), (b), 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
#if defined(__AVX512F__)
#define FMA(a, b, c) __builtin_ia32_vfmaddps512_mask((a), (b), (c), 0xffff, 4)
#elif defined(__FMA__)
#define FMA8(a, b, c) __builtin_ia32_vfmaddps256((a), (b), (c))
#define FMA(a, b, c) JOIN(FMA8(HALF_LO(a), HALF_LO(b), HALF_LO(c)), FMA8(HALF_HI(a), HALF_HI(b), HALF_HI(c)))
#else
#define FMA(a, b, c) ({ v16sf a_ = (a), b_ = (b), c_ = (c); for (int l_ = 0; l_ < 16; l_++) c_[l_] = __builtin_fmaf(a_[l_], b_[l_], c_[l_]); c_; })
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define TILE_ROWS @avx512@
#define DOT(c, u, q) __builtin_ia32_vpdpbusd512((c), (u), (q))
#elif defined(__AVX2__)
#define TILE_ROWS @other@
#define DOT8(u, q) __builtin_ia32_pmaddwd256(__builtin_ia32_pmaddubsw256((v32qi)(u), (v32qi)(q)), (v16hi){1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1})
#define DOT(c, u, q) ((c) + JOIN(DOT8(HALF_LO(u), HALF_LO(q)), DOT8(HALF_HI(u), HALF_HI(q))))
#else
#define TILE_ROWS @other@
#define DOT(c, u, q) ({ v16si c_ = (c); for (int l_ = 0; l_ < 16; l_++) for (int k_ = 0; k_ < 4; k_++) \
  c_[l_] += (int)(unsigned char)((u)[l_] >> (8 * k_)) * (int)(signed char)((q)[l_] >> (8 * k_)); c_; })
#endif
"""
# 8-bit codes (0..255) on AVX2: vpmaddubsw's pairs of products would saturate 16 bits, so the codes go signed (q - 128,
# |.| <= 128) with the sign moved onto the row's values: the same exact sum, with no bias left to take off
_SIGNED8 = r"""
#if !(defined(__AVX512VNNI__) && defined(__AVX512F__)) && defined(__AVX2__)
#undef DOT
#define SIGN8(a, b) __builtin_ia32_psignb256((v32qi)(a), (v32qi)(b))
#define DOTS8(w, q) DOT8(SIGN8((w), (w)), SIGN8((q), (w)))
#define DOT(c, u, q) ((c) + JOIN(DOTS8(HALF_LO((u) ^ (int)0x80808080), HALF_LO(q)), DOTS8(HALF_HI((u) ^ (int)0x80808080), HALF_HI(q))))
#define BIAS_TAKEN 1
#endif
"""


@dataclass(frozen=True)
class Form:
  """What the kernel needs to know of a matrix's format: `low` bits a stored code (4: nibbles, 8: bytes), inputs per
  `block` (32, or 16 for Q6_K), the codes' `bias`, its offset ("half": Q4_1 and Q5_1's m; "kquant": a K-quant's
  -dmin * mn; or none) and its scale ("half": the block's d; "u8" or "i8": a K-quant's integer scale times its
  super-block's d)."""
  low: int
  block: int
  bias: int
  offset: str | None
  scale: str

  @staticmethod
  def of(wb: PackedMatrix) -> Form:
    offset = None if wb.offset is None else "kquant" if wb.dscale is not None else "half"
    signed = wb.scale.dtype == (np.int8 if isinstance(wb.scale, np.ndarray) else dtypes.int8)  # Q6_K's scales
    return Form(wb.low_bits, wb.block, wb.bias - wb.scaled_offset, offset, "half" if wb.dscale is None else "i8" if signed else "u8")


def _tile(rows: str, f: Form) -> str:
  """C for column block `c`, rows r0 .. r0 + rows: each output's sum over the blocks, in order."""
  words = f.block * f.low // 32  # a block's words per output
  fields = ("(w & 0x0F0F0F0F)", "((w >> 4) & 0x0F0F0F0F)") if f.low == 4 else ("w",)
  steps = "\n".join(f"        acc[r] = DOT(acc[r], {x}, (v16si){{}} + *(const int_u *)(xr + {j * 4}));" for j, x in enumerate(fields))
  take = "0" if f.bias == 0 else f"BIAS_TAKEN ? 0 : {f.bias} * s[(long)(r0 + r) * B + b]"
  at, sup = "((long)c * B + b) * 16 + l", f"((long)c * (K / 256) + b / {256 // f.block}) * 16 + l"  # a block's, its super-block's
  scale = f"(float)dscale[{sup}] * (float)scale[{at}]" if f.scale != "half" else f"(float)scale[{at}]"
  offset = {None: "", "half": f"(float)offset[{at}]", "kquant": f"-((float)doffset[{sup}] * (float)offset[{at}])"}[f.offset]
  plus_offset = "\n      f[r] = FMA(m * ee, (v16sf){} + (float)s[(long)(r0 + r) * B + b], f[r]);" if f.offset else ""
  return f"""{{
  v16sf f[{rows}];
  for (int r = 0; r < {rows}; r++) f[r] = (v16sf){{}};
  for (int b = 0; b < B; b++) {{
    v16sf d, m = {{}};
    for (int l = 0; l < 16; l++) d[l] = {scale};
    {f"for (int l = 0; l < 16; l++) m[l] = {offset};" if offset else ""}
    v16si acc[{rows}];
    for (int r = 0; r < {rows}; r++) acc[r] = (v16si){{}} - ({take});
    for (int k = 0; k < {words}; k++) {{
      v16si w = *(const v16si_u *)(codes + (((long)c * W + b * {words} + k) * 16));
      for (int r = 0; r < {rows}; r++) {{
        const signed char *xr = xq + (long)(r0 + r) * K + b * {f.block} + k * {f.block // words};
{steps}
      }}
    }}
    for (int r = 0; r < {rows}; r++) {{
      float ee = e[(long)(r0 + r) * (K / 32) + b / {32 // f.block}];
      f[r] = FMA(d * ee, __builtin_convertvector(acc[r], v16sf), f[r]);{plus_offset}
    }}
  }}
  for (int r = 0; r < {rows}; r++) for (int l = 0; l < 16; l++) y[(long)(r0 + r) * N + c * 16 + l] = f[r][l];
}}"""


def buffers(f: Form) -> list[str]:
  """The kernel's buffers in order (its thread index follows): output, codes, scales (and super-block factors),
  offsets, the quantized rows, their scales and block sums."""
  return ["y", "codes", "scale", *(["dscale"] if f.scale != "half" else []), *(["offset"] if f.offset else []),
          *(["doffset"] if f.offset == "kquant" else []), "xq", "e", "s"]


def kernel_source(R: int, N: int, K: int, f: Form, threads: int) -> str:
  """The body of one product's kernel: R rows, N outputs, K inputs, `threads` threads each taking a run of column
  blocks (its index the last source). Its buffers are named as `buffers` lists them."""
  names = [*buffers(f), "t"]
  scales = {"half": "const __fp16 *", "u8": "const unsigned char *", "i8": "const signed char *"}
  kinds = dict(y="float *", codes="const int *", scale=scales[f.scale],
               dscale="const __fp16 *", offset="const __fp16 *" if f.offset == "half" else "const unsigned char *", doffset="const __fp16 *",
               xq="const signed char *", e="const float *", s="const int *")
  head = "\n".join(f"{kinds[n]}{n} = ({kinds[n]})@{i}@;" if n != "t" else f"const int t = @{i}@;" for i, n in enumerate(names))
  c = f"""{{
{_PRELUDE.replace("@avx512@", str(TILE_ROWS["avx512"])).replace("@other@", str(TILE_ROWS["other"]))}{_SIGNED8 if f.bias == 128 else ""}
#ifndef BIAS_TAKEN
#define BIAS_TAKEN 0
#endif
{head}
const int R = {R}, N = {N}, K = {K}, B = {K // f.block}, W = {K * f.low // 32}, T = {threads};
for (int c = N / 16 * t / T; c < N / 16 * (t + 1) / T; c++) {{
  int r0 = 0;
  for (; r0 + TILE_ROWS <= R; r0 += TILE_ROWS) {_tile("TILE_ROWS", f)}
  for (; r0 < R; r0++) {_tile("1", f)}
}}
#undef TILE_ROWS
#undef DOT
#undef BIAS_TAKEN
#undef FMA
}}"""
  c = c.replace("{", "{{").replace("}", "}}")  # (str.format's braces: the buffers' names go in as {0}, {1}, ...)
  for i in range(len(names)): c = c.replace(f"@{i}@", "{%d}" % i)
  return c


def product(x: Tensor, wb: PackedMatrix) -> Tensor:
  """x (..., K) float32 times packed matrix wb: (..., outputs) float32, in the integer arithmetic above."""
  *lead, K = x.shape
  n, _, lanes = wb.shape
  if not all(isinstance(d, int) for d in lead):
    raise errors.PyruntimeError(f"an integer product takes a concrete count of rows, not {lead} (RowPath.prompt_rows keeps chunks short)")
  R, f = prod(lead), Form.of(wb)
  xq, e, s = quantize_rows(x.reshape(R, K), f.low, f.block)
  threads = CPU_COUNT.value
  src = kernel_source(R, n * lanes, K, f, threads)
  held = dict(codes=wb.codes, scale=wb.scale, dscale=wb.dscale, offset=wb.offset, doffset=wb.doffset, xq=xq, e=e, s=s)
  y = Tensor.empty(R, n * lanes, dtype=dtypes.float32, device=x.device)
  ins = [held[name] for name in buffers(f)[1:]]

  def kernel(*bufs: UOp) -> UOp:
    t = UOp.range(threads, 0, AxisType.THREAD)
    ptrs = [b.src[0] if b.op is Ops.RESHAPE else b for b in bufs]  # the buffers themselves, not their shaped views
    body = UOp(Ops.CUSTOM, dtypes.void, (*ptrs, t.cast(dtypes.int)), arg=src)
    return UOp.sink(body.end(t), arg=KernelInfo(name=f"int8_q{f.low}_{f.block}_{R}_{n * lanes}_{K}", opts_to_apply=()))
  return y.custom_kernel(*ins, fxn=kernel)[0].reshape(*lead, n * lanes)
