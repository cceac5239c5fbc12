"""Loop schedules for a CPU, where tinygrad's heuristic leaves the prompt's kernels scalar and on one core.

Two schedules, chosen per kernel when it compiles:

- **stock+** (tinygrad's own kernels: `--decode reference` and the families that decode per stream). tinygrad's
  heuristic first, unchanged, reduce-axis choices (UNROLL) included, so a value is the sum tinygrad computes; then,
  for a kernel with a symbolic loop axis (a prefill chunk of 1..32 tokens) the upcast and the threads the heuristic
  could not size, on the constant output axis. tests/integration/test_loop_schedules.py checks these against a process without them.

- **rows** (the batched path, `pyruntime/stage/compute/rows.py`, under `rows_schedules()`): every reduce kernel gets a schedule of
  ours alone, on a CPU with no reduce-axis opt at all. Each output is one sequential sum over its reduce axis, so a row's bits
  cannot depend on how many rows share the kernel or where the kernel was cut: a decode row and a prompt row at the
  same position compute the same numbers (the exactness contract of docs/stage-ownership.md). On top of that, only
  output axes move: the output axis the biggest input walks with stride 1 is upcast by VEC (vector loads and FMAs of
  VEC floats), an output axis that input does not depend on (rows, query heads) by ROWS (each loaded vector serves that
  many accumulators), and the threads split an output axis. A 576x1536 projection of 128 rows runs at 100-190
  GFLOP/s on two cores this way, 25 under tinygrad's schedule (bench/kernels.py).

`install()` also widens the CPU's vector loads and stores of floats from 4 to up to VEC (what tinygrad already
does for AMX): without it clang gets 4-wide loads and emits 128-bit FMAs only. A load's width changes no value.
Devices with local memory (GPUs) keep tinygrad's schedules for their own kernels; under `rows_schedules()` a reduce
kernel's sum is split over a workgroup by a fixed rule (`_fixed_groups`, docs/prompt-path.md's GPU rule), then
tinygrad's output-axis choices apply, minus any of its reduce-axis opts and upcasts.
PYRUNTIME_LOOP_OPTS=0 turns the speed-ups off: tinygrad's schedules for its own kernels, and no opt at all for the rows
path's (the same sums in the same order: tests/integration/test_loop_schedules.py compares the bits of both settings).
"""
from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Iterator

from tinygrad.codegen.opt import KernelOptError, Opt, OptOps, heuristic
from tinygrad.codegen.opt.postrange import Scheduler
from tinygrad.dtype import dtypes
from tinygrad.helpers import getenv, prod
from tinygrad.uop.ops import AxisType, Ops, UOp

from pyruntime import errors

UPCAST = 8  # stock+: accumulators added per output of a symbolic-token kernel (8 measured best of 4 and 8 on SmolLM2)
ROW_UPCAST = 8  # stock+: a fixed loop axis this small is the batch's rows: upcast whole, each loaded weight serves every row
OUT_UPCAST = 4  # stock+: then the largest output axis, 4 outputs per loaded input
VEC = 16   # rows: outputs per vector (16 float32: one AVX-512 register, two AVX2 ones)
GROUP_THREADS = 32  # rows, on devices with local memory: threads that share one output's sum (a warp's worth)
# rows, on devices with local memory: threads per workgroup at most. tinygrad checks each local dimension, not their
# product: its heuristic's LOCAL choices (up to 128 threads) on top of a group of 32 made workgroups of 4096, which no
# CUDA device launches (1024 at most); 256 is what WebGPU and many OpenCL devices allow
WORKGROUP_MAX = 256
ROWS = 8   # rows: accumulator rows per loaded vector (8 x 16 measured best of 4..16 x 8..16 on SmolLM2's shapes)
# stock+: a kernel doing less than this (multiply-adds at the largest token count and context) keeps tinygrad's schedule
MIN_WORK = 1 << 20
ENABLED = bool(getenv("PYRUNTIME_LOOP_OPTS", 1))
_stock = heuristic.hand_coded_optimizations
_state = threading.local()


# tinygrad's lowering cache for the rows schedule (keyed by the kernel before its opts); install() makes it and tinygrad's own
# cache ProgramCaches (kept on disk)
_rows_programs: dict = {}


@contextlib.contextmanager
def rows_schedules() -> Iterator[None]:
  """Kernels compiled inside get the rows schedule (no reduce-axis opt chosen by shape). tinygrad caches a kernel's lowering by the
  kernel as it was before any opt, so the two schedules keep separate caches: a kernel that both paths happen to share
  (a norm of the same shape, say) must not come back with the other path's opts. A captured JIT keeps the kernels it
  compiled, so only the capturing calls need this."""
  from tinygrad import codegen
  if getattr(_state, "rows", False):
    yield
    return
  _state.rows, stock = True, codegen.to_program_cache
  codegen.to_program_cache = _rows_programs
  try: yield
  finally: _state.rows, codegen.to_program_cache = False, stock


def _loops(k: Scheduler, symbolic: bool) -> list[int]:
  return [i for i in k.axes_of(AxisType.LOOP) if isinstance(s := k.full_shape[i], int) != symbolic and (symbolic or s > 1)]


def _divides(size, n: int) -> bool:
  return size % n == 0 if isinstance(size, int) else size.divides(n) is not None


def _thread_first(k: Scheduler, axes: list[int], n: int) -> None:
  """Split the first of `axes` that n divides over n threads (an output axis: every sum keeps its order)."""
  for i in axes:
    if _divides(k.full_shape[i], n):
      try:
        k.apply_opt(Opt(OptOps.THREAD, i, n))
        return
      except KernelOptError: pass


# --- stock+ ---------------------------------------------------------------------------------------
def _symbolic_schedule(k: Scheduler) -> Scheduler:
  """A kernel with a symbolic loop axis (a prefill chunk's tokens), after tinygrad's heuristic: the upcast and the
  threads it could not size, both on the constant output axis."""
  if not (const := _loops(k, False)) or any(o.op in (OptOps.GROUP, OptOps.GROUPTOP, OptOps.TC) for o in k.applied_opts): return k
  for i in const[::-1]:
    if k.full_shape[i] % UPCAST == 0 and k.upcast_size() * UPCAST <= 128:
      try:
        k.apply_opt(Opt(OptOps.UPCAST, i, UPCAST))
        break
      except KernelOptError: pass
  if k.ren.has_threads and k.ren.global_max and not any(o.op is OptOps.THREAD for o in k.applied_opts) and k.ren.global_max[0] > 1:
    _thread_first(k, _loops(k, False), k.ren.global_max[0])
  return k


def _fixed_schedule(k: Scheduler, stock: Scheduler) -> Scheduler:
  """A reduce kernel of fixed shape (tinygrad's T=1 decode with several rows): the rows upcast whole, the largest
  output axis by 4, tinygrad's UNROLLs as it chose them (each sum keeps its order), its threads on the outputs."""
  if any(o.op not in (OptOps.UPCAST, OptOps.UNROLL, OptOps.THREAD) for o in stock.applied_opts): return stock
  t = k.copy()
  try:
    if (rows := next((i for i in _loops(t, False) if t.full_shape[i] <= ROW_UPCAST), None)) is not None:
      t.apply_opt(Opt(OptOps.UPCAST, rows, 0))
    _on_largest_output(t, OptOps.UPCAST, OUT_UPCAST)
    for o in stock.applied_opts:
      if o.op is OptOps.UNROLL: t.apply_opt(o)
    if (threads := next((o.arg for o in stock.applied_opts if o.op is OptOps.THREAD), 1)) > 1: _on_largest_output(t, OptOps.THREAD, threads)
  except KernelOptError: return stock
  return t


def _on_largest_output(k: Scheduler, op: OptOps, n: int) -> None:
  """Apply `op` of `n` to the largest loop axis, when `n` divides it (looked up anew: earlier opts renumber the axes)."""
  if (outs := _loops(k, False)) and k.full_shape[big := max(outs, key=lambda i: k.full_shape[i])] % n == 0:
    k.apply_opt(Opt(op, big, n))


# --- rows ------------------------------------------------------------------------------------------
def _terms(idx: UOp) -> list[UOp]: return list(idx.split_uop(Ops.ADD))


def _streamed_input(k: Scheduler) -> UOp | None:
  """The INDEX of the input whose vectors the kernel should stream: of the inputs that some output axis walks with
  stride 1 (a projection's weights, an attention's keys or values: not the rows, which the sum walks), the largest;
  else the largest input."""
  stored = {u.src[0] for u in k.ast.toposort() if u.op is Ops.STORE}
  ins = sorted((b for b in k.bufs if b not in stored and b.src[0].op is Ops.PARAM), key=lambda b: -b.src[0].ptrdtype.size)
  loops = [k.rngs[i] for i in k.axes_of(AxisType.LOOP)]
  return next((b for b in ins if any(t in loops for t in _terms(b.src[1].get_idx()))), ins[0] if ins else None)


def _rows_cpu(k: Scheduler) -> Scheduler:
  if (big := _streamed_input(k)) is None: return k
  idx = big.src[1].get_idx()
  loops = k.axes_of(AxisType.LOOP)
  # the output axis this input walks with stride 1: upcast by VEC (vector loads, vector FMAs)
  unit = [i for i in loops if any(t is k.rngs[i] for t in _terms(idx)) and _divides(k.full_shape[i], VEC)]
  # the rows: an output axis this input does not depend on, so each loaded vector serves ROWS accumulators
  # (or, failing that, a small constant one upcast whole: the query heads that share a kv head)
  free = [i for i in loops if k.rngs[i] not in idx.backward_slice and i not in unit]
  rows = [i for i in free if _divides(k.full_shape[i], ROWS)] or [i for i in free if isinstance(s := k.full_shape[i], int) and 1 < s <= ROWS]
  vec = k.rngs[unit[-1]] if unit else None
  try:
    # rows first, so the vector's outputs are the accumulators' fastest index (clang then keeps them in vector registers)
    if rows: k.apply_opt(Opt(OptOps.UPCAST, rows[-1], ROWS if _divides(k.full_shape[rows[-1]], ROWS) else 0))
    if vec is not None and vec in k.rngs: k.apply_opt(Opt(OptOps.UPCAST, k.rngs.index(vec), VEC))
  except KernelOptError: pass
  n = k.ren.global_max[0] if k.ren.has_threads and k.ren.global_max else 1
  # split the largest constant output axis, else a symbolic one the graph made divisible (rows in units of ROWS * n)
  if n > 1: _thread_first(k, sorted(_loops(k, False), key=lambda i: -k.full_shape[i]) + _loops(k, True), n)
  return k


def _fixed_groups(k: Scheduler) -> None:
  """Split each output's sum over up to GROUP_THREADS threads of a workgroup, in a way chosen by the sizes of the
  kernel's constant reduce axes alone, never by its rows: innermost axis first (neighbouring threads read neighbouring
  elements), each by the largest divisor of its size that the threads left allow. Each thread sums its elements in
  order and the workgroup adds the partial sums in thread order (tinygrad's GROUP: a local buffer, then one loop), so
  an output's bits are the same in a one-row decode kernel as in a 256-row prompt chunk's. A symbolic reduce axis
  (the attended length) stays whole."""
  left = GROUP_THREADS
  for i in reversed(range(len(k.axes_of(AxisType.REDUCE)))):
    if left < 2: return
    size = k.full_shape[k.axes_of(AxisType.REDUCE)[i]]
    if not isinstance(size, int): continue
    if (g := max(d for d in range(1, min(size, left) + 1) if size % d == 0)) < 2: continue
    try: k.apply_opt(Opt(OptOps.GROUP, i, g))
    except KernelOptError: return
    left //= g


def _workgroup_allows(k: Scheduler, o: Opt) -> bool:
  """Whether LOCAL opt `o` keeps k's workgroup within WORKGROUP_MAX threads."""
  now = prod(k.full_shape[a] for a in k.axes_of(AxisType.LOCAL, AxisType.GROUP_REDUCE, AxisType.WARP))
  amt = o.arg or (k.full_shape[o.axis] if o.axis is not None and o.axis < len(k.full_shape) else None)
  return isinstance(now, int) and isinstance(amt, int) and now * amt <= WORKGROUP_MAX


def _rows_gpu(k: Scheduler, stock: Scheduler) -> Scheduler:
  """The fixed groups (_fixed_groups), then tinygrad's choices on a device with local memory without those that
  split or reorder a sum (tensor cores, GROUP, UNROLL) and without UPCAST, which would give a thread several outputs
  and the output fewer threads: each kept in order while it applies."""
  t = k.copy()
  _fixed_groups(t)
  for o in stock.applied_opts:
    if o.op in (OptOps.TC, OptOps.GROUP, OptOps.GROUPTOP, OptOps.UNROLL, OptOps.UPCAST): continue
    if o.op is OptOps.LOCAL and not _workgroup_allows(t, o): break
    try: t.apply_opt(o)
    except KernelOptError: break
  return t


def _as_half(u: UOp) -> UOp | None:
  """u's float16 form when u is a float16 value widened to float (or such a value where a padding row's mask keeps it,
  else zero), else None."""
  if u.op is Ops.CAST and u.src[0].dtype.scalar() == dtypes.half: return u.src[0]
  if u.op is Ops.WHERE and (v := _as_half(u.src[1])) is not None and u.src[2].op is Ops.CONST and u.src[2].arg == 0:
    return u.src[0].where(v, u.src[2].cast(v.dtype))
  return None


def _half_products(k: Scheduler) -> tuple[UOp, UOp] | None:
  """The kernel's product and its float16 form when it is a matrix product of two float16 values widened to float (a
  projection of the tensor-core mode: rows._tensor_core_rows), else None. A matrix product: each factor walks an output
  axis the other does not (the rows; the weight's outputs), which a norm's sum of squares of float16 values (the
  head's first norm) does not."""
  if len(reds := k.reduceops) != 1 or reds[0].arg[0] is not Ops.ADD or (mul := reds[0].src[0]).op is not Ops.MUL: return None
  a, b = mul.src
  if (ha := _as_half(a)) is None or (hb := _as_half(b)) is None or not (set(a.ranges) - set(b.ranges) and set(b.ranges) - set(a.ranges)):
    return None
  return mul, (ha * hb).cast(mul.dtype)


def _tensor_cores(k: Scheduler, mul: UOp, half: UOp) -> Scheduler:
  """The sum of float16 products `mul` on the device's tensor cores: the product taken in float16 (`half`: the form
  tinygrad's tensor-core opt matches; on the tensor core it is exact, as the widened product is) with a float
  accumulator, the rows axis padded to the tile. Then tinygrad's own upcasts on the tile's output axes, none on its
  sum. The reduce axis is cut by the tile's depth alone, so an output's bits do not depend on the rows beside it. A
  device with tensor cores that cannot take this kernel fails it by name rather than run it another way (the other
  kernels of the same projection, at other row counts, would sum differently)."""
  t = k.copy()
  t.ast = t.ast.substitute({mul: half})
  for sel, tc in enumerate(t.ren.tensor_cores):
    if tc.dtype_in != dtypes.half or tc.dtype_out != dtypes.float: continue
    for axis in range(64):  # every (N, M, K) choice of axes, until one fits the tile
      try:
        u = t.copy()
        rngs = u.apply_opt(Opt(OptOps.TC, axis, (sel, 2, 1)))
      except KernelOptError: continue
      for d in (1, 0):  # tinygrad's own after a tensor core: upcast the tile's M and N axes
        if rngs is not None and (szs := [n for n in (4, 2) if rngs[d].src[0].divides(n) is not None]):
          with contextlib.suppress(KernelOptError): rngs[d] = u.apply_opt(Opt(OptOps.UPCAST, u.rngs.index(rngs[d]), szs[0]))[0]
      return u
  raise errors.TensorCoresUnavailable(f"{type(k.ren).__name__} has no float16 tensor core that takes the kernel of shape {k.full_shape}")


def rows_schedule(k: Scheduler) -> Scheduler:
  """The batched path's schedule: on a CPU no reduce-axis opt, so every output is one sequential sum; on a device with
  local memory the fixed groups (_fixed_groups); a matrix product of float16 values (the tensor-core mode) on a device
  with tensor cores, the tile (_tensor_cores). Any way a row's bits depend on nothing but its own inputs (see the
  module's docstring). Kernels without a reduction keep tinygrad's schedule."""
  if not k.axes_of(AxisType.REDUCE): return _stock(k)
  if k.ren.tensor_cores and (products := _half_products(k)) is not None: return _tensor_cores(k, *products)
  if k.ren.has_local: return _rows_gpu(k, _stock(k.copy()))
  return _rows_cpu(k.copy())


def loop_optimizations(k: Scheduler) -> Scheduler:
  """Under rows_schedules(): the rows schedule (with PYRUNTIME_LOOP_OPTS=0: none at all, the same sums). Otherwise
  tinygrad's heuristic, then on a device without local memory, for a kernel of at least MIN_WORK multiply-adds, the
  symbolic (prefill) or the fixed-shape (decode) loop schedule."""
  if getattr(_state, "rows", False): return rows_schedule(k) if ENABLED else k
  stock = _stock(k)
  if not ENABLED: return stock
  work = prod(s if isinstance(s, int) else int(s.vmax) for s in k.full_shape)  # at the variables' largest values
  if stock.ren.has_local or work < MIN_WORK: return stock
  if _loops(k, True): return _symbolic_schedule(stock)
  return _fixed_schedule(k, stock) if k.axes_of(AxisType.REDUCE) else stock


# --- estimates --------------------------------------------------------------------------------------
def _estimates(uops: tuple[UOp, ...], ignore_indexing: bool = False):
  """tinygrad's Estimates.from_uops, with its terms summed per loop nest. tinygrad adds one term per ALU op, and with
  a symbolic loop (rows, attended length) each term is symbolic: a kernel upcast VEC x ROWS wide built a sum
  thousands of terms deep, whose repr (part of the compiled kernel's cache key) overflows Python's recursion limit.
  The same counts, grouped by their multiplier, make a sum of a few terms."""
  from collections import defaultdict

  from tinygrad.dtype import AddrSpace, PtrDType
  from tinygrad.renderer import Estimates
  from tinygrad.uop.ops import GroupOp, smin
  flops: dict = defaultdict(int)
  lds: dict = defaultdict(int)
  mem: dict = {}
  mults, stack, skip = 1, [], set()
  if ignore_indexing:
    for u in uops:
      if u.op in {Ops.LOAD, Ops.STORE}:
        skip |= set((UOp.sink(*u.src[0].src[1:]) if u.src[0].op is Ops.INDEX else u.src[0]).toposort(lambda x: x.op is not Ops.RANGE))
        if len(u.src) > 2: skip |= set(u.src[2].toposort())
      elif u.op is Ops.IF: skip |= set(u.src[0].toposort())
  for u in uops:
    if u.op in {Ops.LOAD, Ops.STORE}:
      buf = u
      while len(buf.src): buf = buf.src[0]
      if buf.op is Ops.PARAM:
        got = mem.get((buf, u.op), 0) + u.src[0].dtype.base.itemsize * mults
        mem[(buf, u.op)] = smin(got, buf.ptrdtype.nbytes()) if buf.ptrdtype.size != -1 else got
    if u.op is Ops.RANGE:
      stack.append(mults)
      mults = mults * u.src[0].ssimplify()
      if isinstance(mults, UOp): mults = mults.substitute({x: x.const_like(0) for x in mults.toposort() if x.op is Ops.SPECIAL})
    elif u.op is Ops.END: mults = stack.pop(-1)
    elif u.op is Ops.SPECIAL: mults = mults * u.src[0].ssimplify()
    elif u.op is Ops.DEFINE_VAR and u.arg[0] == "core_id": mults = mults * (u.arg[2] + 1)
    elif u.op is Ops.LOAD and (not isinstance(u.src[0].dtype, PtrDType) or u.src[0].dtype.addrspace != AddrSpace.REG): lds[mults] += u.dtype.itemsize
    elif u.op is Ops.STORE and (not isinstance(u.src[0].dtype, PtrDType) or u.src[0].dtype.addrspace != AddrSpace.REG):
      lds[mults] += u.src[1].dtype.itemsize
    elif u.op in GroupOp.ALU and u not in skip: flops[mults] += (2 if u.op is Ops.MULACC else 1) * u.dtype.count
    elif u.op is Ops.WMMA and u not in skip: flops[mults] += 2 * prod(u.arg[1]) // u.arg[5]
  total = lambda d: sum((m * n for m, n in d.items()), 0)  # noqa: E731
  return Estimates(total(flops), total(lds), sum(mem.values()))


def _no_graph_estimate(call: UOp):
  """What a graph runner counts for one of its kernels: nothing. tinygrad's GraphRunner sums its kernels' estimates
  into one symbolic expression and simplifies it (used only for tinygrad's GlobalCounters and DEBUG prints): for a
  stage's graphs, hundreds of kernels over symbolic rows, that was ~6 s of a 15-block stage's 9.5 s warm-up, paid at
  every capture and every load from the graph cache. Each kernel run outside a graph still counts."""
  from tinygrad.renderer import Estimates
  return Estimates()


# --- wide loads -----------------------------------------------------------------------------------
_NARROW = '([16,8,4,2] if "AMX" in ctx.target.arch else [4,2])'
_WIDE = f'([{VEC},8,4,2] if ("AMX" in ctx.target.arch or (ctx.target.device == "CPU" and "Clang" in type(ctx).__name__)) else [4,2])'


_FOLDED = "buf.dtype.base not in (dtypes.float, dtypes.half, *dtypes.fp8s)"
# packed weights' 32-bit words fold as well, on a Clang CPU only (other renderers' vector types are float ones)
_FOLDED_CPU = _FOLDED[:-1] + ', *((dtypes.int32,) if ctx is not None and ctx.target.device == "CPU" and "Clang" in type(ctx).__name__ else ()))'


def _widen_loads() -> bool:
  """Let the devectorizer fold a CPU's float loads and stores up to VEC wide (tinygrad 0.13 folds 4 at most but for
  AMX), and packed weights' 32-bit words too. The function's code is swapped in place, as its pattern matcher holds
  the function object itself."""
  from tinygrad.codegen.late import devectorizer
  fn = devectorizer.split_load_store
  src = inspect.getsource(fn)
  if _NARROW not in src or _FOLDED not in src: return _WIDE in src or fn.__code__.co_name != "split_load_store"
  ns: dict = {}
  exec(compile(src.replace(_NARROW, _WIDE).replace(_FOLDED, _FOLDED_CPU), devectorizer.__file__, "exec"), devectorizer.__dict__, ns)  # noqa: S102
  fn.__code__ = ns["split_load_store"].__code__
  return True


# vector operations clang compiles to one instruction but does not vectorise from per-lane scalars: float16 <-> float32
# conversions (vcvtph2ps, vcvtps2ph) and the integer ops and conversion that unpack packed weights (shift, mask, cvtdq2ps)
_VECTOR_CASTS = {("half", "float"), ("float", "half"), ("int", "float")}
_VECTOR_INT_OPS = (Ops.SHR, Ops.AND)


def _clang_cpu(ctx) -> bool: return getattr(ctx, "target", None) is not None and ctx.target.device == "CPU" and "Clang" in type(ctx).__name__


def _split_but_cheap_vectors(ctx, alu: UOp) -> UOp | None:
  """tinygrad's devectorizer rule (one scalar op per lane), but on a Clang CPU, in the rows path's kernels, the
  operations of _VECTOR_CASTS and _VECTOR_INT_OPS stay vectors. Each is exact, lane by lane, either way: only the
  instructions change. tinygrad's own kernels (the families that decode per stream) keep its rule: there the vectors
  kept made a qwen35 decode step 17x slower (380 ms where tinygrad's own rule takes 22; bench/results/2026-12-06-hybrid-decode.md)."""
  from tinygrad.codegen.late.devectorizer import no_vectorized_alu
  from tinygrad.dtype import dtypes
  if alu.dtype.count > 1 and getattr(_state, "rows", False) and _clang_cpu(ctx):
    if alu.op is Ops.CAST and (alu.src[0].dtype.scalar().name, alu.dtype.scalar().name) in _VECTOR_CASTS: return None
    if alu.op in _VECTOR_INT_OPS and alu.dtype.scalar() == dtypes.int32: return None
  return no_vectorized_alu(alu)


def _keep_half_to_float_vectors() -> None:
  """Let a CPU kernel convert a loaded vector of float16 weights to float32 as one vector (clang's
  __builtin_convertvector: vcvtph2ps) instead of one scalar cast per lane, which clang does not vectorise: with rows
  upcast over it, a float16 projection ran 8x slower than a float32 one. The conversion is exact either way, so
  float16 weights give float32 weights' bits (tests/integration/test_rows.py)."""
  from tinygrad import codegen
  from tinygrad.codegen.late import devectorizer
  from tinygrad.uop.ops import GroupOp, PatternMatcher, UPat
  stock = devectorizer.devectorize_alu
  if codegen.devectorize_alu is not stock: return

  rules = [(pat, fn) for pat, fn in stock.patterns if fn is not devectorizer.no_vectorized_alu]
  codegen.devectorize_alu = PatternMatcher([*rules, (UPat((*GroupOp.ALU, Ops.CAST, Ops.BITCAST), name="alu"), _split_but_cheap_vectors)])


def _wide_vectors() -> None:
  """clang's -march=native on an Intel AVX-512 core prefers 256-bit vectors, so each VEC-wide operation of the rows path
  became two instructions: ask for 512-bit ones where the CPU has AVX-512 (a Sapphire Rapids decode step 0.9x; the
  kernels' arithmetic, lane by lane, is unchanged, so are the bits). The flag is part of the compiler's cache key, so a
  kernel compiled without it is never taken for one compiled with it."""
  from tinygrad.runtime.support.compiler_cpu import ClangJITCompiler

  from pyruntime.devices import host_cpu
  stock = getattr(ClangJITCompiler.__init__, "_stock_init", ClangJITCompiler.__init__)
  if not any("avx512f" in ln.split() for ln in host_cpu() if ln.startswith("flags")): return

  def init(self, arch: list[str], *args, **kwargs) -> None:
    stock(self, arch, *args, **kwargs)
    if self.arch == "x86_64" and not any("prefer-vector-width" in a for a in self.args):
      self.args.append(WIDE_FLAG)
      if self.cachekey is not None: self.cachekey += "_" + WIDE_FLAG
  init._stock_init = stock  # type: ignore[attr-defined]
  ClangJITCompiler.__init__ = init


WIDE_FLAG = "-mprefer-vector-width=512"


def install() -> bool:
  """Put loop_optimizations in place of tinygrad's heuristic (the rows path needs it whatever PYRUNTIME_LOOP_OPTS says:
  it is what keeps reduce-axis opts out of its kernels) and, unless PYRUNTIME_LOOP_OPTS=0, widen the CPU's float loads.
  Once, before any kernel compiles. Returns whether the loop schedules are on."""
  global _rows_programs
  from tinygrad import codegen
  from tinygrad.engine import jit
  from tinygrad.renderer import Estimates

  from pyruntime.stage.compute.program_cache import ProgramCache
  if not isinstance(codegen.to_program_cache, ProgramCache):
    codegen.to_program_cache, _rows_programs = ProgramCache("stock"), ProgramCache("rows")
  Estimates.from_uops = staticmethod(_estimates)  # needed by the rows path's kernels whatever their schedule
  jit.estimate_uop = _no_graph_estimate  # the name GraphRunner.__init__ reads, and nothing else
  heuristic.hand_coded_optimizations = loop_optimizations
  if ENABLED:
    _keep_half_to_float_vectors()
    _wide_vectors()
  return ENABLED and _widen_loads()
