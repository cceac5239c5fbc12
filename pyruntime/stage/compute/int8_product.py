"""Integer products (weights="packed-int8"): a packed matrix times rows whose values are quantized to 8 bits, on a CPU.

llama.cpp's arithmetic, in the rows path's contract. Each row of activations is quantized on its own, per block of 32
inputs: e = max|x| * (1/127), q = round(x / e) (int8, |q| <= 127), and s = sum(q), the block's sum (`quantize_rows`). A
Q4_0, Q4_1 or Q8_0 weight block (d, and m for Q4_1, as the file holds them; codes u, unsigned) then gives each output

    acc += (d * e) * float(sum(u * q) - bias * s)          (+ (m * e) * float(s) for Q4_1)

block after block in the inputs' order, from acc = 0: the integer sum is exact (|sum| < 2^19), so the ISA that
computes it (AVX-512 VNNI's vpdpbusd, AVX2's vpmaddubsw and vpmaddwd, plain C elsewhere) changes no bit, and each
float operation is one rounding in a fixed order. A row's result depends on its own values only: a decode row equals a
prompt row, and one stream alone equals the same stream beside others, bit for bit.

The kernel reads PackedMatrix's column blocks as they are (outputs / 16, words, 16): one 32-bit word is 8 nibbles (or
4 bytes) of consecutive inputs of one output, so one vector of words is 16 outputs' codes and a vpdpbusd sums 4
products into each output's lane. Its low nibbles are inputs 0, 2, 4, 6 of the word and its high nibbles 1, 3, 5, 7;
the quantized row is stored in that order (`order`), so each lane's 4 products pair a code with its own input.

What it costs: quantizing costs one small kernel per product's input, and the arithmetic is llama.cpp's: 45x further
from the file's exact values than the float modes (bench/results/2026-12-08-int8-products.md). Types other than these
three keep the float arithmetic of weights="packed", and so do a MoE block's experts.
"""
from __future__ import annotations

from tinygrad import Tensor, dtypes
from tinygrad.helpers import CPU_COUNT, prod
from tinygrad.uop.ops import AxisType, KernelInfo, Ops, UOp

from pyruntime import errors
from pyruntime.stage.compute.packed import PackedMatrix

BLOCK = 32   # inputs per quantized block of a row (a Q4_0/Q4_1/Q8_0 weight block)
LANES = 16   # outputs per column block (loop_schedules.VEC on a CPU)
# rows of one tile: each shares the tile's unpacked codes. AVX-512's 32 registers hold 8 rows' two accumulators, AVX2's
# 16 hold 4
TILE_ROWS = {"avx512": 8, "other": 4}


def supported(wb: PackedMatrix, device: str) -> bool:
  """Whether this product runs in integers: a CPU stage's Q4_0, Q4_1 or Q8_0 matrix (not a MoE block's experts)."""
  return (device.split(":")[0] == "CPU" and not wb.lead and wb.high is None and wb.dscale is None and not wb.scaled_offset
          and wb.block == BLOCK and wb.bits in (4, 8) and wb.shape[2] == LANES)


def order(x: Tensor, bits: int) -> Tensor:
  """x (..., K) with each 8 inputs as a 4-bit code word's nibbles pair them (0, 2, 4, 6, 1, 3, 5, 7); 8-bit words hold
  consecutive inputs."""
  if bits == 8: return x
  *lead, K = x.shape
  return x.reshape(*lead, K // 8, 4, 2).transpose(-1, -2).reshape(*lead, K)


def quantize_rows(x: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor]:
  """Each row of x (R, K) float32 as int8 codes in `order` (R, K), their scales e (R, K / 32) float32 and sums
  s (R, K / 32) int32: q = round(x / e), e = max|x| * (1/127) per block (a zero block: e = 0, q = 0)."""
  R, K = x.shape
  xb = x.reshape(R, K // BLOCK, BLOCK)
  e = xb.abs().max(-1) * (1 / 127)  # (what tinygrad makes of / 127: a float32 product)
  q = (xb / (e == 0).where(1.0, e).unsqueeze(-1)).round().cast(dtypes.int32)
  return order(q.reshape(R, K), bits).cast(dtypes.int8).contiguous(), e.contiguous(), q.sum(-1, dtype=dtypes.int32).contiguous()


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


def _tile(rows: str, bits: int, bias: int, offset: bool) -> str:
  """C for column block `c`, rows r0 .. r0 + rows: each output's sum over the blocks, in order."""
  words = BLOCK * bits // 32
  fields = ("(w & 0x0F0F0F0F)", "((w >> 4) & 0x0F0F0F0F)") if bits == 4 else ("w",)
  steps = "\n".join(f"        acc[r] = DOT(acc[r], {f}, (v16si){{}} + *(const int_u *)(xr + {j * 4}));" for j, f in enumerate(fields))
  take = "0" if bias == 0 else f"BIAS_TAKEN ? 0 : {bias} * s[(long)(r0 + r) * B + b]"
  plus_offset = "\n        f[r] = FMA(m * ee, (v16sf){} + (float)s[(long)(r0 + r) * B + b], f[r]);" if offset else ""
  return f"""{{
  v16sf f[{rows}];
  for (int r = 0; r < {rows}; r++) f[r] = (v16sf){{}};
  for (int b = 0; b < B; b++) {{
    v16sf d = {{}}, m = {{}};
    for (int l = 0; l < 16; l++) d[l] = (float)scale[((long)c * B + b) * 16 + l];
    {"for (int l = 0; l < 16; l++) m[l] = (float)offset[((long)c * B + b) * 16 + l];" if offset else ""}
    v16si acc[{rows}];
    for (int r = 0; r < {rows}; r++) acc[r] = (v16si){{}} - ({take});
    for (int k = 0; k < {words}; k++) {{
      v16si w = *(const v16si_u *)(codes + (((long)c * W + b * {words} + k) * 16));
      for (int r = 0; r < {rows}; r++) {{
        const signed char *xr = xq + (long)(r0 + r) * K + b * 32 + k * {32 // words};
{steps}
      }}
    }}
    for (int r = 0; r < {rows}; r++) {{
      float ee = e[(long)(r0 + r) * B + b];
      f[r] = FMA(d * ee, __builtin_convertvector(acc[r], v16sf), f[r]);{plus_offset}
    }}
  }}
  for (int r = 0; r < {rows}; r++) for (int l = 0; l < 16; l++) y[(long)(r0 + r) * N + c * 16 + l] = f[r][l];
}}"""


def kernel_source(R: int, N: int, K: int, bits: int, bias: int, offset: bool, threads: int) -> str:
  """The body of one product's kernel: R rows, N outputs, K inputs, `threads` threads each taking a run of column
  blocks (its index the last source). Names its buffers y, codes, scale, [offset,] xq, e, s."""
  names = ["y", "codes", "scale", *(["offset"] if offset else []), "xq", "e", "s", "t"]
  decls = dict(y="float *y = (float *)@;", codes="const int *codes = (const int *)@;", scale="const __fp16 *scale = @;",
               offset="const __fp16 *offset = @;", xq="const signed char *xq = @;", e="const float *e = @;",
               s="const int *s = @;", t="const int t = @;")
  head = "\n".join(decls[n].replace("@", f"@{i}@") for i, n in enumerate(names))
  tile = lambda rows: _tile(rows, bits, bias, offset)  # noqa: E731
  c = f"""{{
{_PRELUDE.replace("@avx512@", str(TILE_ROWS["avx512"])).replace("@other@", str(TILE_ROWS["other"]))}{_SIGNED8 if bits == 8 else ""}
#ifndef BIAS_TAKEN
#define BIAS_TAKEN 0
#endif
{head}
const int R = {R}, N = {N}, K = {K}, B = {K // BLOCK}, W = {K * bits // 32}, T = {threads};
for (int c = N / 16 * t / T; c < N / 16 * (t + 1) / T; c++) {{
  int r0 = 0;
  for (; r0 + TILE_ROWS <= R; r0 += TILE_ROWS) {tile("TILE_ROWS")}
  for (; r0 < R; r0++) {tile("1")}
}}
#undef TILE_ROWS
#undef DOT
#undef BIAS_TAKEN
#undef FMA
}}"""
  c = c.replace("{", "{{").replace("}", "}}")
  for i in range(len(names)): c = c.replace(f"@{i}@", "{%d}" % i)
  return c


def product(x: Tensor, wb: PackedMatrix) -> Tensor:
  """x (..., K) float32 times packed matrix wb: (..., outputs) float32, in the integer arithmetic above."""
  *lead, K = x.shape
  n, _, lanes = wb.shape
  if not all(isinstance(d, int) for d in lead):
    raise errors.PyruntimeError(f"an integer product takes a concrete count of rows, not {lead} (RowPath.prompt_rows keeps chunks short)")
  R = prod(lead)
  xq, e, s = quantize_rows(x.reshape(R, K), wb.bits)
  offset = wb.offset is not None
  threads = CPU_COUNT.value
  src = kernel_source(R, n * lanes, K, wb.bits, wb.bias, offset, threads)
  ins = [wb.codes, wb.scale, *([wb.offset] if offset else []), xq, e, s]
  y = Tensor.empty(R, n * lanes, dtype=dtypes.float32, device=x.device)

  def kernel(*bufs: UOp) -> UOp:
    t = UOp.range(threads, 0, AxisType.THREAD)
    ptrs = [b.src[0] if b.op is Ops.RESHAPE else b for b in bufs]  # the buffers themselves, not their shaped views
    body = UOp(Ops.CUSTOM, dtypes.void, (*ptrs, t.cast(dtypes.int)), arg=src)
    return UOp.sink(body.end(t), arg=KernelInfo(name=f"int8_q{wb.bits}_{R}_{n * lanes}_{K}", opts_to_apply=()))
  return y.custom_kernel(*ins, fxn=kernel)[0].reshape(*lead, n * lanes)
