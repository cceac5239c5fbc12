"""The batched path of a stage (every family): prompt rows and decode rows through the same kernels, with the same bits.

Every position a stream computes (a prompt token, a decode token, later a drafted token under verification) is a
row, and a row's numbers depend on nothing but its stream: its input, its position and the keys and values its
stream holds before it. That is the exactness contract (docs/stage-ownership.md, "Exactness"). It holds because:

- one piece of code computes a row in both graphs: `prefill` (rows of one stream at consecutive positions, any count
  up to MAX_ROWS, symbolic; with packed weights, chunks of at most 8 or 16 rows in graphs of that many rows) and `decode` (one row for
  each stream in a window of KV slots, in one of a few fixed shapes). Both call `_layer`, which differs between them
  only in how the new keys and values are written;
- no kernel ever mixes rows: projections, norms and the attention of row r read only row r (and its stream's cache);
- every sum is cut the same way whatever the rows (loop_schedules.rows_schedule: one sequential sum on a CPU, a split fixed
  by the reduce axes' sizes on a GPU), so a row's value does not depend on how many rows run beside it or where a
  prompt was cut;
- keys past a row's position are masked to exact zeros (`where`, not an addition, so stale cache bytes never reach
  a sum), and masked terms add exact zeros: the attended length changes no bit.

Rows are padded to ROW_UNIT (the padding rows compute at later positions of the same stream and are overwritten
before anything reads them) and the attended length to KV_UNIT, so that the schedule can split rows and keys over
the CPU's threads and vector lanes. The caches are laid out for this path: keys transposed, (slot, kv head, head
dim, position), so a row's scores for VEC consecutive positions come from one vector load; values (slot, kv head,
position, head dim). They hold float32 whatever the weights (tinygrad's default float), and are not zeroed.

Latent attention (MLA, deepseek2) is absorbed, as tinygrad's MLATransformerBlock computes it, for prompt and decode rows
alike: a row's query heads are taken into the latent space (q_nope through attn_k_b) and scored against one cache of
(kv_lora_rank + rope_dim) per position, the normed latent and the rotary key; the values are the latent part of the same
cache (no second copy), and each head's weighted latent leaves through attn_v_b. The cache is the key cache of one kv
head, so everything that moves keys (writes, scatters, the prefix cache's blocks) moves the latent unchanged.

Recurrent blocks (the hybrids' GatedDeltaNet, `_recurrent`) run in the decode graph only: one row per stream of the
window, each slot's conv and recurrent state read and updated in place, and a prompt's rows one at a time through the
one-row window (StageModel.prefill_rows), as tinygrad's generate prefills such a model; so a prompt row is a decode
row by construction. Their state is not a function of positions: the prefix cache keeps it as snapshots
(kv_blocks.KVBlocks), a scored prompt's rows are decode rows, and drafts are not verified for them.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from tinygrad import Tensor, TinyJit, UOp, dtypes, function
from tinygrad.helpers import prod
from tinygrad.llm.gguf import ggml_data_to_tensor
from tinygrad.llm.model import GatedDeltaNetBlock, TransformerBlock
from tinygrad.uop.ops import KernelInfo

from pyruntime import errors
from pyruntime.modelfile.boundary import DTYPES
from pyruntime.protocol import MAX_CHUNK, PAGE_POSITIONS
from pyruntime.stage.compute import device_memory, experts, int8_product, loop_schedules
from pyruntime.stage.compute.packed import PackedMatrix
from pyruntime.stage.compute.weights import expert_matrices, linears

MAX_ROWS = MAX_CHUNK  # the most rows one prefill call takes: a stage's largest prompt chunk
ROW_UNIT = 16    # prompt rows are padded to a multiple of this (loop_schedules.ROWS x two threads)
# with packed weights, prompt chunks of at most 8 or 16 rows (a verify record: the last token and its draft; a prompt's
# last rows) run in graphs of their own, of exactly that many rows: concrete shapes, so a packed matrix is rebuilt in
# registers (SmolLM2: 8 rows ~2.5 decode steps, 16 ~5, against ~9 in the symbolic graph, which stages the weights first).
# Float weights have nothing to stage: there the symbolic graph costs the same and two more captures would buy nothing.
SHORT_ROWS = (loop_schedules.ROWS, ROW_UNIT)
# a stage with a matrix staged in pieces takes a prompt chunk of at most this many rows in short graphs' calls
# (RowPath.registers_rows)
PIECES_REGISTERS_ROWS = 64
STAGED_ROWS = ROW_UNIT  # a packed matrix read by more rows than this is dequantised into a scratch buffer first (_values)
# the tensor-core mode: a projection's rows are padded to this, the rows of every float16 tile tinygrad's renderers
# know (CUDA's 16x8x16, AMD's 16x16x16, Metal's 8x8x8 and Intel's 8x8x16 divide it)
TC_ROWS = 16
# a recurrent model's prompt chunk (_recurrent_chunk): its rows' projections at once, the recurrence one row after another
RECURRENT_ROWS = ROW_UNIT
# ... and a short one: a verify record of the last token and up to 7 drafts (docs/speculation.md) costs half the chunk's
# sequential steps in it, not all of them
RECURRENT_SHORT = (loop_schedules.ROWS, RECURRENT_ROWS)
KV_UNIT = 32     # attended lengths are padded to a multiple of this (loop_schedules.VEC x two threads)


def _round(n: int, unit: int) -> int: return -(-n // unit) * unit


def _staged(lead: list) -> bool:
  """Whether packed weights read by `lead` rows are dequantised into a scratch buffer first (_values)."""
  return not all(isinstance(n, int) for n in lead) or prod(lead) > STAGED_ROWS


def _packed_matrices(b: Any) -> list[Any]:
  """A block's matrices as the rows path holds them: its projections' and its routed experts' column blocks."""
  return [wb for w in (*linears(b), *expert_matrices(b)) if (wb := getattr(w, "rows_blocked", None)) is not None]


def _values(wb: Tensor | PackedMatrix, lead: list, staged: bool | None = None) -> Tensor:
  """Column blocks' values for a product with `lead` rows: the buffer itself, or a packed matrix's dequantisation, in
  the registers of the kernel that reads it for a few rows (a decode step: one pass over the file's bytes), staged
  through a float16 scratch buffer for more (a prompt chunk: ~7 vector instructions per 16 weights would be repeated for
  every ROWS rows; 256-row chunks took 1.6x float16's time that way). The same values either way. `staged` overrides
  the rule by rows (the tail's output matrix: _egress)."""
  if not isinstance(wb, PackedMatrix): return wb
  return wb.matrix(staged=_staged(lead) if staged is None else staged)  # staged where the copy fits (fits_staging)


def _tensor_core_rows(x: Tensor, product) -> Tensor:
  """product(rows) of x (..., K) as the tensor-core mode takes it: the rows in one axis padded with zero rows to a
  multiple of TC_ROWS (a tensor core's tile of rows: a one-row decode step runs the same tile as a prompt chunk), each
  value rounded to float16 (what the tile takes) and widened back, so that the sum is of two float16 values' products
  (loop_schedules._half_products: the kernels a device's tensor cores run; elsewhere the same numbers summed in order).
  The padding rows' outputs are stored, then dropped."""
  *lead, K = x.shape
  n = prod(lead)
  x = x.reshape(n, K)
  if padded := isinstance(n, int) and n % TC_ROWS > 0: x = x.pad(((0, _round(n, TC_ROWS) - n), None))
  # stored as float16 by a kernel of its own, so the product reads float16 values whatever tinygrad fuses
  y = product(x.cast(dtypes.float16).contiguous().cast(dtypes.float32))
  if padded: y = y.contiguous()  # computed for every row of the tile: else tinygrad computes only the rows kept
  return y[:n].reshape(*lead, y.shape[-1])


def _rotate(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
  """apply_rope's rotation of t's last axis (its halves), each row by its own position's cos and sin."""
  t1, t2 = t.chunk(2, dim=-1)
  return (t1 * cos - t2 * sin).cat(t2 * cos + t1 * sin, dim=-1)


def _gated(out: Tensor, gate: Tensor | None) -> Tensor:
  """An attention output (B, T, H * Hd) times its block's sigmoid output gate (TransformerBlock with attn_output_gate)."""
  return out if gate is None else out * gate.sigmoid()


def _blocked_product(x: Tensor, wb: Tensor | PackedMatrix, tc: bool, staged: bool | None = None) -> Tensor:
  """x (..., K) times the column blocks wb (outputs / VEC, K, VEC): (..., outputs), one sum over K per output."""
  if tc: return _tensor_core_rows(x, lambda r: _blocked_product(r, wb, False, staged))
  if isinstance(wb, PackedMatrix) and wb.integer: return int8_product.product(x, wb)
  *lead, K = x.shape
  if isinstance(wb, PackedMatrix) and not wb.lead and (_staged(lead) if staged is None else staged) and len(parts := wb.pieces()) > 1:
    # each piece's product stored on its own (a product fused into the join would rebuild its weights in registers), the
    # join stored too (a kernel reading a slice of the lazy join would pick each value from every piece with a mask)
    return Tensor.cat(*[_blocked_product(x, p, False, True).contiguous() for p in parts], dim=-1).contiguous()
  return (x.reshape(*lead, 1, K, 1) * _values(wb, lead, staged)).sum(-2).reshape(*lead, wb.shape[0] * wb.shape[2])


def _linear(lin: Any, x: Tensor, tc: bool = False, staged: bool | None = None) -> Tensor:
  """nn.Linear's x @ weight.T (+ bias), from the matrix's column blocks (outputs / VEC, inputs, VEC) when the stage keeps
  them (realized weights: weights.load): for each block of VEC outputs the kernel reads one run of memory,
  every input's VEC weights in a row, instead of VEC floats per row of the whole matrix. The same sum over the inputs.
  `tc`: the tensor-core mode's inputs (_tensor_core_rows); `staged`: a packed matrix's staging, if not by rows (_values)."""
  if (wb := getattr(lin, "rows_blocked", None)) is None:
    if not tc: return lin(x)
    y = _tensor_core_rows(x, lambda r: r @ lin.weight.T)
  else: y = _blocked_product(x, wb, tc, staged)
  return y if lin.bias is None else y + lin.bias


def _projections(b: Any, x: Tensor, fused: str, names: tuple[str, ...], tc: bool = False) -> list[Tensor]:
  """The projections `names` of x: from the block's fused matrix `fused` (StageModel's FUSED) in one kernel when it has
  one, cut into each projection's outputs (+ its bias), else one _linear each. Every output is the same sum either way."""
  if (wb := getattr(b, fused, None)) is None: return [_linear(getattr(b, n), x, tc) for n in names]
  y = _blocked_product(x, wb, tc)
  out, at = [], 0
  for n in names:
    lin = getattr(b, n)
    width = lin.rows_blocked.shape[0] * lin.rows_blocked.shape[2]
    part = y[..., at:at + width]
    out.append(part if lin.bias is None else part + lin.bias)
    at += width
  return out


def _put(dsts: tuple[Tensor, ...], arrays: tuple[np.ndarray, ...]) -> None:
  """Each host array into the first bytes of its staging tensor (the rest keeps what it held: rows no graph reads)."""
  for dst, arr in zip(dsts, arrays, strict=True): device_memory.write(dst.uop.buffer, arr)


def _join(dst: Tensor, parts: list[tuple[Tensor, Any, Any]]) -> Tensor:
  """`dst` (1, n, w) after each part (1, rows, w) was stored at its row offset; its first sum(rows) rows."""
  for t, at, rows in parts: dst = Tensor(dst.uop.after(dst[:, at:at + rows].uop.store(t.uop)))
  return dst[:, :sum(rows for _, _, rows in parts)]


def _scatter(flat: Tensor, rows: Tensor, at: Tensor, stride_a: int, stride_b: int) -> Tensor:
  """`flat` after element (i, a, b) of rows (n, A, B) is written at at[i] + a * stride_a + b * stride_b: one small kernel
  (tinygrad has no indexed store but a custom kernel's). Returns `flat` ordered after the writes."""
  n, A, B = rows.shape

  def kernel(dst: UOp, src: UOp, where: UOp) -> UOp:
    i, a, b = UOp.range(n, 0), UOp.range(A, 1), UOp.range(B, 2)
    return dst[where[i].cast(dtypes.weakint) + a * stride_a + b * stride_b].store(src[i, a, b]).end(i, a, b).sink(
      arg=KernelInfo(name="kv_scatter", opts_to_apply=()))
  return flat.custom_kernel(rows, at, fxn=kernel)[0]


class RowPath:
  """The prefill and decode graphs of one StageModel (dense, MoE, MLA, Gemma 3 and recurrent blocks), and the caches
  they share. Its length (~430 lines, ~30 attributes) is those shared buffers (keys and values, recurrent states,
  positions, masks, staging) and the graphs captured over them: one object, since every graph closes over the same
  buffers."""

  def __init__(self, m: Any):  # the StageModel that owns this path (model.py imports this module, not the reverse)
    self.m, cfg = m, m.config
    self.slots = m.slots
    # a block's cache: keys (kv heads, key width, positions) and values (kv heads, positions, head dim); with latent
    # attention one cache of one head (kv_lora_rank + rope_dim, positions) whose latent rows are also the values
    self.latent = cfg.kv_lora_rank > 0
    self.kv_heads, self.key_dim = (1, cfg.kv_lora_rank + cfg.rope_dim) if self.latent else (cfg.n_kv_heads, cfg.head_dim)
    # a chunk's padding rows may run past the context; on a CPU (pages committed as written) whole pages of positions
    self.length = _round(cfg.max_context + MAX_ROWS, PAGE_POSITIONS if m.device.startswith("CPU") else KV_UNIT)
    self.reach = [0] * (self.slots + 1)  # per slot: the positions its stream wrote keys at, padding rows included
    self.v_rows = UOp.variable("rows16", 1, MAX_ROWS // ROW_UNIT)
    self.v_kv = UOp.variable("kv32", 1, self.length // KV_UNIT)
    self.v_kvp = UOp.variable("kvp32", 1, self.length // KV_UNIT)  # the prompt's attended length in a mixed step
    self.v_slot = UOp.variable("slot", 0, self.slots - 1)
    self.v_start = UOp.variable("start", 0, cfg.max_context - 1)
    self.v_lo = UOp.variable("window", 0, max(self.slots - 1, 1))
    self.prefill_jit: TinyJit | None = None    # made on first use (StageModel._jit: from the graph cache, or captured)
    self.short_jits: dict[int, TinyJit] = {}
    self.decode_jits: dict[int, TinyJit] = {}
    self.mixed_jits: dict[int, TinyJit] = {}
    # the reference's rotary tables (a row's cos|sin; Gemma's global and sliding-window ones side by side), gathered on
    # the host for each row's position; a block reads its own (`rope_table`)
    self.rope_host = np.concatenate([t.numpy() for t in m.rope_tables], axis=-1)
    rw = self.rope_host.shape[-1]
    width = m._embd_row_bytes if m.is_head else cfg.dim
    dt = dtypes.uint8 if m.is_head else m._bdtype
    self.prefill_in, self.prefill_pos = m._empty((MAX_ROWS, width), dt), m._empty((MAX_ROWS,), dtypes.int32)
    self.prefill_rope = m._empty((MAX_ROWS, rw), dtypes.float32)
    self.decode_in, self.decode_pos = m._empty((self.slots, width), dt), m._empty((self.slots,), dtypes.int32)
    self.decode_rope = m._empty((self.slots, rw), dtypes.float32)
    self.decode_at_k, self.decode_at_v = m._empty((self.slots,), dtypes.int32), m._empty((self.slots,), dtypes.int32)
    # a mixed step's inputs (the window's rows, then the prompt's), and where its parts are joined: per block the attention's
    # output, on the tail the rows whose logits are wanted
    n = self.slots + MAX_ROWS
    self.mixed_in, self.mixed_pos = m._empty((n, width), dt), m._empty((n,), dtypes.int32)
    self.mixed_rope = m._empty((n, rw), dtypes.float32)
    self.mixed_at_k, self.mixed_at_v = m._empty((n,), dtypes.int32), m._empty((n,), dtypes.int32)
    self.joins = [m._empty((1, n, cfg.n_heads * cfg.v_head_dim), dtypes.float32) for _ in m.blk]
    self.tail_join = m._empty((1, self.slots + ROW_UNIT, cfg.dim), dtypes.float32) if m.is_tail else None
    for t in (self.prefill_in, self.decode_in): t.uop.buffer.copyin(memoryview(bytearray(t.nbytes())))  # padding rows read zeros
    self.arange = Tensor.arange(self.length, dtype=dtypes.int32, device=m.device).contiguous().realize()
    self._caches: list[tuple[Tensor, Tensor | None]] | None = None
    self._prompt_rows: int | None = None
    self._registers_rows: int | None = None
    self.router_rows: Tensor | None = None  # while a graph is traced: its router block's logits (_blocks)
    self.router: np.ndarray | None = None  # the last call's router logits, every row of its graph (_result)

  # --- caches ------------------------------------------------------------------------------------
  @property
  def caches(self) -> list[tuple[Tensor, Tensor | None]]:
    """Per block, flat: keys (slots + 1, kv heads, key width, positions) and values (slots + 1, kv heads, positions, head
    dim); with latent attention the latent cache and None; a recurrent block's conv state (slots + 1, kernel - 1,
    channels) and recurrent state (slots + 1, v heads, v head dim, v head dim), zeroed (_recurrent). The last slot
    takes a decode window's filler rows' writes (never read)."""
    if self._caches is None:
      self._caches = []
      for b in self.m.blk:
        if isinstance(b, GatedDeltaNetBlock):
          n = self.slots + 1
          conv = self.m._empty((n * (b.ssm_conv_kernel - 1) * b.conv_channels,), dtypes.float32)
          rec = self.m._empty((n * b.num_v_heads * b.head_v_dim * b.head_v_dim,), dtypes.float32)
          for t in (conv, rec): t.uop.buffer.copyin(memoryview(bytearray(t.nbytes())))
          self._caches.append((conv, rec))
          continue
        # not zeroed: a position no row may see is masked out of the scores and the values (_attend), so whatever bytes it
        # holds never reach a sum, and the pages are only touched once a stream gets that far
        keys = self.m._empty((self.cache_elems,), dtypes.float32)
        self._caches.append((keys, None if self.latent else self.m._empty((self.cache_elems,), dtypes.float32)))
    return self._caches

  def release(self, slot: int) -> int:
    """Give the pages of `slot`'s keys and values back to the system (a CPU's: device_memory.release), so that a closed
    stream's cache does not stay resident; what they held is never read again (a new stream writes a position before
    any row sees it, _attend). Recurrent states stay (zero_state rewrites them). A stream that stayed within its key
    lanes' first pages (PAGE_POSITIONS) leaves its keys, one page a lane: the next stream would otherwise fault each in
    again (~3 us a page: ~15 ms on SmolLM2 at 2048 positions, more than a short prompt's own compute). Returns the
    bytes released."""
    reach, self.reach[slot] = self.reach[slot], 0
    if self._caches is None or not self.m.device.startswith("CPU"): return 0
    self.m.synchronize()  # no kernel still writes there
    out = 0
    for b, (keys, values) in zip(self.m.blk, self._caches, strict=True):
      if isinstance(b, GatedDeltaNetBlock): continue
      for t in (x for x in (None if reach <= PAGE_POSITIONS else keys, values) if x is not None):
        one = t.nbytes() // (self.slots + 1)
        out += device_memory.release(t.uop.buffer, slot * one, one)
    return out

  def reached(self, slot: int, n: int) -> None:
    """`slot`'s stream has written keys at positions below n (release keeps or gives back its pages by that)."""
    self.reach[slot] = max(self.reach[slot], n)

  def zero_state(self, slot: int) -> None:
    """A new stream in `slot` starts from zero recurrent state (the reference's _state_reset_ops)."""
    for b, (conv, rec) in zip(self.m.blk, self.caches, strict=True):
      if not isinstance(b, GatedDeltaNetBlock): continue
      for t in (conv, rec):
        one = t.nbytes() // (self.slots + 1)
        device_memory.write(t.uop.buffer, np.zeros(one, np.uint8), slot * one)

  @property
  def cache_elems(self) -> int: return (self.slots + 1) * self.kv_heads * self.key_dim * self.length

  def position_states(self) -> list[tuple[Tensor, int, tuple[int, ...], int]]:
    """The caches as the prefix cache's blocks take them (kv_blocks.KVBlocks): (tensor, slots, one slot's shape, its
    position axis)."""
    c, n = self.m.config, self.slots + 1
    kv = [pair for b, pair in zip(self.m.blk, self.caches, strict=True) if not isinstance(b, GatedDeltaNetBlock)]
    keys = [(k, n, (self.kv_heads, self.key_dim, self.length), 2) for k, _ in kv]
    return keys + [(v, n, (c.n_kv_heads, self.length, c.head_dim), 1) for _, v in kv if v is not None]

  def recurrent_states(self) -> list[tuple[Tensor, int, int]]:
    """Every recurrent block's conv and recurrent state as the prefix cache's snapshots take them: (tensor, slots, one
    slot's float32 elements)."""
    n = self.slots + 1
    return [(t, n, t.numel() // n) for b, pair in zip(self.m.blk, self.caches, strict=True) if isinstance(b, GatedDeltaNetBlock) for t in pair]

  def key_view(self, k: Tensor) -> Tensor: return k.reshape(self.slots + 1, self.kv_heads, self.key_dim, self.length)

  def value_view(self, v: Tensor) -> Tensor:
    c = self.m.config
    return v.reshape(self.slots + 1, c.n_kv_heads, self.length, c.head_dim)

  @property
  def cache_bytes(self) -> int: return sum(t.nbytes() for kv in self._caches or [] for t in kv if t is not None)

  def prefill_graph(self) -> TinyJit:
    if self.prefill_jit is None: self.prefill_jit = self.m._jit("rows-prefill", self._prefill_graph)
    return self.prefill_jit

  @property
  def prompt_rows(self) -> int:
    """The most rows one prefill call takes: MAX_ROWS, or where a MoE block's experts are too large to stage
    (packed.STAGED_MAX_BYTES) the largest short graph's: a chunk of many rows would rebuild those values in registers
    for every ROWS rows anyway, and the short graph does so fastest (Llama 3.2 1B's shapes, rebuilt so: 64 rows 1.25x,
    256 rows 1.2x faster as 16-row calls than in one call). A dense matrix too large is staged in pieces (_blocked_product).
    The same for integer products (`integer`), whose kernels take a concrete count of rows."""
    if self._prompt_rows is None:
      big = any(isinstance(wb, PackedMatrix) and wb.lead and not wb.fits_staging for b in self.m.blk for wb in _packed_matrices(b))
      self._prompt_rows = self.short_rows[-1] if (big or self.integer) and self.short_rows else MAX_ROWS
    return self._prompt_rows

  @property
  def registers_rows(self) -> int:
    """The most rows of a prompt chunk taken in short graphs' calls (each weight rebuilt in registers) rather than in one
    call that stages them: the largest short graph's, or PIECES_REGISTERS_ROWS where a matrix is staged in pieces (its
    staging costs a pass over every weight: on Llama 3.2 1B's shapes a 32-row chunk took 1.15x the time of two 16-row
    calls, 48 and 64 rows about the same, 96 rows 0.85x)."""
    if self._registers_rows is None:
      if self.integer:  # every chunk in short calls: nothing stages, nothing is symbolic in rows
        self._registers_rows = MAX_ROWS
        return MAX_ROWS
      short = max(self.short_rows, default=0)
      split = short and any(isinstance(wb, PackedMatrix) and not wb.lead and len(wb.pieces()) > 1
                            for b in self.m.blk for wb in _packed_matrices(b))
      self._registers_rows = PIECES_REGISTERS_ROWS if split and self.prompt_rows > PIECES_REGISTERS_ROWS else short
    return self._registers_rows

  @property
  def integer(self) -> bool:
    """Whether a projection here multiplies in integers (weights="packed-int8": int8_product.py)."""
    return any(isinstance(wb, PackedMatrix) and wb.integer for b in self.m.blk for wb in _packed_matrices(b))

  @property
  def short_rows(self) -> tuple[int, ...]:
    """The row counts of this stage's short chunk graphs: SHORT_ROWS where it holds packed weights, else none."""
    return SHORT_ROWS if self.m._packed else ()

  def short_graph(self, R: int) -> TinyJit:
    if (jit := self.short_jits.get(R)) is None: jit = self.short_jits[R] = self.m._jit(f"rows-prefill-{R}", self._prefill_graph)
    return jit

  def decode_graph(self, W: int) -> TinyJit:
    if (jit := self.decode_jits.get(W)) is None: jit = self.decode_jits[W] = self.m._jit(f"rows-decode-{W}", self._decode_graph)
    return jit

  def bound_tensors(self) -> dict[str, Tensor]:
    """This path's own buffers by stable names (pyruntime/stage/compute/graph_cache.py): staging, caches, the position table."""
    out = {"rows.prefill_in": self.prefill_in, "rows.prefill_pos": self.prefill_pos, "rows.prefill_rope": self.prefill_rope,
           "rows.decode_in": self.decode_in, "rows.decode_pos": self.decode_pos, "rows.decode_rope": self.decode_rope,
           "rows.decode_at_k": self.decode_at_k, "rows.decode_at_v": self.decode_at_v, "rows.arange": self.arange,
           "rows.mixed_in": self.mixed_in, "rows.mixed_pos": self.mixed_pos, "rows.mixed_rope": self.mixed_rope,
           "rows.mixed_at_k": self.mixed_at_k, "rows.mixed_at_v": self.mixed_at_v}
    out.update({f"rows.join.{i}": t for i, t in enumerate(self.joins)})
    if self.tail_join is not None: out["rows.tail_join"] = self.tail_join
    for i, (k, v) in enumerate(self.caches): out.update({f"rows.k.{i}": k} | ({} if v is None else {f"rows.v.{i}": v}))
    return out

  # --- one layer, shared by both graphs ---------------------------------------------------------------
  def _rope_tables(self, rope: Tensor, lead: tuple) -> list[tuple[Tensor, Tensor]]:
    """Each rotary table's (cos, sin) of the rows `rope` (rows, tables x rope_dim), shaped (*lead, rope_dim / 2)."""
    cd = self.m.config.rope_dim
    return [rope[:, i * cd:(i + 1) * cd].reshape(*lead, cd).chunk(2, dim=-1) for i in range(len(self.m.rope_tables))]

  def _qkv(self, b: TransformerBlock, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """TransformerBlock._attention's projections, norms and rotary embedding for x (B, T, dim), each row at its own
    position (cos, sin: (B, 1, T, rope_dim / 2)). Returns q (B, H, T, Hd), k and v (B, KvH, T, Hd), and the output gate
    (B, T, H * Hd) of a block that has one (qwen35's attention: q's projection holds each head's query and gate), else
    None; with latent attention _latent_qk's q and k, and no v."""
    c = b.config
    B, T, _ = x.shape
    x = x.contiguous()  # normed: see _blocks
    if self.latent: return (*self._latent_qk(b, x, cos, sin), None, None)
    q, k, v = _projections(b, x, "rows_qkv", ("attn_q", "attn_k", "attn_v"), self.m.tensor_cores)
    gate = None
    if c.attn_output_gate:
      qg = q.reshape(B, T, c.n_heads, 2, c.head_dim)
      q, gate = qg[:, :, :, 0, :].reshape(B, T, c.n_heads * c.head_dim), qg[:, :, :, 1, :].reshape(B, T, c.n_heads * c.head_dim)
    if c.qk_norm and c.qk_norm != c.head_dim: q, k = b.attn_q_norm(q), b.attn_k_norm(k)
    q = q.reshape(B, T, c.n_heads, c.head_dim).transpose(1, 2)
    k = k.reshape(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
    v = v.reshape(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
    if c.qk_norm == c.head_dim: q, k = b.attn_q_norm(q), b.attn_k_norm(k)
    def rope(t: Tensor) -> Tensor: return _rotate(t[..., :c.rope_dim], cos, sin).cat(t[..., c.rope_dim:], dim=-1)
    return rope(q).contiguous(), rope(k), v, gate

  def _latent_qk(self, b: Any, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """MLATransformerBlock._attention's query and cache row for x (B, T, dim): q (B, H, T, kv_lora_rank + rope_dim), the
    non-rotary part of each head taken into the latent space through attn_k_b, and k (B, 1, T, kv_lora_rank +
    rope_dim), the normed latent beside the shared rotary key."""
    c, tc = b.config, self.m.tensor_cores
    B, T, _ = x.shape
    nope = c.head_dim - c.rope_dim
    if c.q_lora_rank:
      qa, kv_a = _projections(b, x, "rows_q_a_kv_a", ("attn_q_a", "attn_kv_a_mqa"), tc)
      qp = _linear(b.attn_q_b, b.attn_q_a_norm(qa).contiguous(), tc)  # the norm's row factor stays out of q_b's sums
    else: qp, kv_a = _projections(b, x, "rows_q_kv_a", ("attn_q", "attn_kv_a_mqa"), tc)
    q = qp.reshape(B, T, c.n_heads, c.head_dim).transpose(1, 2).contiguous()
    q = (q[..., :nope] @ b.attn_k_b["weight"].transpose(-1, -2)).cat(_rotate(q[..., nope:], cos, sin), dim=-1).contiguous()
    latent = b.attn_kv_a_norm(kv_a[..., :c.kv_lora_rank]).reshape(B, 1, T, c.kv_lora_rank)
    k_rope = _rotate(kv_a[..., c.kv_lora_rank:].reshape(B, T, 1, c.rope_dim).transpose(1, 2), cos, sin)
    return q, latent.cat(k_rope, dim=-1)

  # --- recurrent (GatedDeltaNet) blocks: _recurrent for a decode window, _recurrent_chunk for a prompt chunk ----------
  @staticmethod
  def _gdn_proj(lin: Any, t: Tensor) -> Tensor:
    """A GatedDeltaNet projection: tinygrad's block takes its input as float16 and its float16 projections return float16;
    here each is a float32 sum of the float16 values' products (a float16 product is exact in float32), rounded to
    float16 after: a float16 sum's kernel is cut by the window's rows, a float32 one is not. (The rounded input is stored
    as float32, so that the GPU rule does not take the product for the tensor-core mode's: loop_schedules._half_products.)"""
    return lin(t.half().float().contiguous()).half()

  def _gdn_rows(self, b: GatedDeltaNetBlock, x: Tensor, windows: Any) -> tuple[Tensor, ...]:
    """Each row's own values of x (W, 1, dim): its output gate (W, 1, Hv, dv), beta and alpha (W, Hv, 1, 1), its conv
    window (W, K, C) (`windows`: from the rows' projected inputs (W, 1, C)), and q, k, v (W, Hv, d, 1)."""
    C, Hv, dv, Hk, dk, W = b.conv_channels, b.num_v_heads, b.head_v_dim, b.num_k_heads, b.head_k_dim, x.shape[0]
    out_gate = self._gdn_proj(b.attn_gate, x).reshape(W, 1, Hv, dv)
    beta = self._gdn_proj(b.ssm_beta, x).sigmoid().reshape(W, Hv, 1, 1)
    alpha = ((self._gdn_proj(b.ssm_alpha, x).float() + b.ssm_dt["bias"]).softplus() * b.ssm_a).reshape(W, Hv, 1, 1).exp()
    window = windows(self._gdn_proj(b.attn_qkv, x))
    mixed = (window * b.ssm_conv1d["weight"].T.unsqueeze(0)).sum(1).silu()
    q, k, v = mixed.split([b.q_dim, b.q_dim, C - 2 * b.q_dim], dim=-1)
    q = q.reshape(W, Hk, dk).normalize(dim=-1).repeat(1, Hv // Hk, 1)
    k = k.reshape(W, Hk, dk).normalize(dim=-1).repeat(1, Hv // Hk, 1)
    # every factor of a row (a norm's, the gates') is stored before a sum reads it: fused, tinygrad may take it out of
    # the sum, and whether it does depends on the window's rows (as _blocks says of the attention blocks)
    q, k, v = q.mul(dk ** -0.5).contiguous().unsqueeze(-1), k.contiguous().unsqueeze(-1), v.reshape(W, Hv, dv).unsqueeze(-1)
    return out_gate, beta, alpha, window, q, k, v

  @staticmethod
  def _gdn_step(state: Tensor, alpha: Tensor, beta: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The recurrent state after one position: decayed by alpha, then the delta rule's update."""
    state = (state * alpha).contiguous()
    return state + ((v - state @ k) * beta).contiguous() @ k.transpose(-1, -2)

  def _gdn_out(self, b: GatedDeltaNetBlock, o: Tensor, out_gate: Tensor) -> Tensor:
    """The block's output from each row's state @ q (W, Hv, dv, 1): normed, gated, projected: (W, 1, dim)."""
    W = o.shape[0]
    out = b.ssm_norm(o.squeeze(-1).reshape(W, 1, b.num_v_heads, b.head_v_dim))
    return self._gdn_proj(b.ssm_out, (out * out_gate.silu()).reshape(W, 1, -1))

  def _recurrent(self, b: GatedDeltaNetBlock, x: Tensor, lo: Any, W: int, pos: Tensor) -> Tensor:
    """GatedDeltaNetBlock._attention for one row of each stream in slots lo..lo+W (x: (W, 1, dim), normed), as tinygrad
    computes it for a batch of streams (the same operations, the batch axis the window's), reading and writing each
    slot's conv and recurrent state in place; a filler row (pos < 0) leaves its slot's state as it was. A prompt's row
    beside other streams comes through here (a recurrence's prompt row is a decode row)."""
    K, C, Hv, dv = b.ssm_conv_kernel, b.conv_channels, b.num_v_heads, b.head_v_dim
    conv = b.rows_conv.reshape(self.slots + 1, K - 1, C)[lo:lo + W]
    rec = b.rows_rec.reshape(self.slots + 1, Hv, dv, dv)[lo:lo + W]
    out_gate, beta, alpha, window, q, k, v = self._gdn_rows(b, x, lambda qkv: conv.cat(qkv, dim=1))  # window (W, K, C)
    state = self._gdn_step(rec, alpha, beta, k, v)
    real = pos.reshape(W, 1, 1) >= 0
    conv_store = conv.uop.store(real.where(window[:, 1:, :], conv).cast(dtypes.float32).uop)
    rec_store = rec.uop.store(real.reshape(W, 1, 1, 1).where(state, rec).cast(dtypes.float32).uop)
    state = Tensor(b.rows_rec.uop.after(rec_store, conv_store)).reshape(self.slots + 1, Hv, dv, dv)[lo:lo + W]
    return self._gdn_out(b, state @ q, out_gate)

  def _recurrent_chunk(self, b: GatedDeltaNetBlock, x: Tensor, slot: UOp, R: int, pos: Tensor) -> Tensor:
    """_recurrent for R consecutive rows of the stream in `slot` (x: (1, R, dim), normed; a padding row's pos is -1 and
    leaves the state as it was): the projections, the convolution and the norms of every row at once, each row's as a
    decode window's row computes it (a row's sums do not depend on the rows beside it), and the recurrence itself one
    row after another, each step the decode step's operations on the state the row before left, stored as it stores
    it. So a chunk's outputs and final state are the bits of its rows fed one at a time."""
    K, C, Hv, dv = b.ssm_conv_kernel, b.conv_channels, b.num_v_heads, b.head_v_dim
    conv = b.rows_conv.reshape(self.slots + 1, K - 1, C)[slot:slot + 1]
    rec = b.rows_rec.reshape(self.slots + 1, Hv, dv, dv)[slot:slot + 1]

    def windows(qkv: Tensor) -> Tensor:  # row t's window (K, C): the conv state, then every row's input, from t on
      seq = conv.reshape(K - 1, C).cat(qkv.reshape(R, C))
      return Tensor.stack(*[seq[t:t + K] for t in range(R)])
    # the rows as a window's (_recurrent's x), one stream's positions in order
    out_gate, beta, alpha, window, q, k, v = self._gdn_rows(b, x.reshape(R, 1, -1), windows)
    real = pos.reshape(R) >= 0
    state, cstate, outs = rec, conv, []
    for t in range(R):
      new = self._gdn_step(state, alpha[t:t + 1], beta[t:t + 1], k[t:t + 1], v[t:t + 1])
      state = real[t].where(new, state).cast(dtypes.float32).contiguous()  # stored, as _recurrent stores the slot's
      cstate = real[t].where(window[t:t + 1, 1:, :], cstate).cast(dtypes.float32)
      if t < R - 1: outs.append(state @ q[t:t + 1])
    # the last row's output reads the state stored in the slot (which ties the stores into the graph)
    rec_store = rec.uop.store(state.uop)
    conv_store = conv.uop.store(cstate.contiguous().uop)
    last = Tensor(b.rows_rec.uop.after(rec_store, conv_store)).reshape(self.slots + 1, Hv, dv, dv)[slot:slot + 1]
    return self._gdn_out(b, Tensor.cat(*outs, last @ q[R - 1:R]), out_gate).reshape(1, R, -1)

  def _attend_cache(self, b: Any, q: Tensor, kc: Tensor, vc: Tensor | None, lo: Any, n: int, pos: Tensor, kv: UOp | int) -> Tensor:
    """The attention of q over slots lo..lo+n of the caches (kc, vc), their first kv positions: _attend, or with latent
    attention _attend_latent."""
    keys = self.key_view(kc)[lo:lo + n, :, :, :kv]
    if vc is None: return self._attend_latent(b, q, keys, pos, kv)
    return self._attend(b, q, keys, self.value_view(vc)[lo:lo + n, :, :kv, :], pos, kv)

  def _attend(self, b: TransformerBlock, q: Tensor, keys: Tensor, values: Tensor, pos: Tensor, kv: UOp | int) -> Tensor:
    """Scaled dot-product attention of q (B, H, T, Hd) over keys (B, KvH, Hd, kv) and values (B, KvH, kv, Hd), row
    (b, t) seeing positions 0..pos[b, t] (pos: (B, 1, T, 1)), or with a sliding window (a Gemma block's `window`) the
    last `window` of them; as tinygrad's (GQA by kv head groups, the scale a division, softmax; Gemma's a product), with
    masked scores replaced rather than added to. Returns (B, T, H * Hd)."""
    c = b.config
    B, _, T, Hd = q.shape
    G = c.n_heads // c.n_kv_heads
    qg = q.reshape(B, c.n_kv_heads, G * T, Hd)  # head h uses kv head h // G, as repeat_interleave has it
    scores = qg.matmul(keys, dtype=dtypes.float32)   # (B, KvH, G*T, kv)
    scores = scores * self.m.gemma.attn_scale if self.m.gemma else scores / float(np.sqrt(Hd))
    seen = self.arange[:kv].reshape(1, 1, 1, kv)
    at = pos.reshape(B, 1, 1, T, 1).expand(B, 1, G, T, 1).reshape(B, 1, G * T, 1)
    hidden = seen > at
    if window := getattr(b, "window", 0): hidden = hidden | (seen <= at - window)
    w = hidden.where(float("-inf"), scores).softmax(-1).contiguous()
    # the caches are not zeroed: a position past every row of a slot gets weight 0, and its value is made 0 as well, since
    # 0 * stale bytes (a NaN, even) must not reach the sum; a position some row sees was written this step or before
    last = pos.reshape(B, 1, T).max(-1).reshape(B, 1, 1, 1)
    out = w @ (self.arange[:kv].reshape(1, 1, kv, 1) > last).where(0.0, values)  # (B, KvH, G*T, Hd)
    # stored as (B, T, H * Hd): read through the permuted view, the output projection's sum would run over (kv heads,
    # G, Hd) axes when T > 1 and over one axis when T = 1, and a split sum (loop_schedules._fixed_groups, devices with
    # local memory) cuts those differently; as one axis it is cut alike in every graph
    return out.reshape(B, c.n_kv_heads, G, T, Hd).permute(0, 3, 1, 2, 4).reshape(B, T, c.n_heads * Hd).contiguous()

  def _attend_latent(self, b: Any, q: Tensor, cache: Tensor, pos: Tensor, kv: UOp | int) -> Tensor:
    """MLATransformerBlock's absorbed attention of q (B, H, T, kv_lora_rank + rope_dim) over the latent cache (B, 1,
    kv_lora_rank + rope_dim, kv), row (b, t) seeing positions 0..pos[b, t]; the scale a product as tinygrad writes it,
    masked scores replaced (as _attend). The weighted latent (B, H, T, kv_lora_rank) of each head through attn_v_b.
    Returns (B, T, H * v_head_dim)."""
    c = b.config
    B, H, T, width = q.shape
    scores = q.reshape(B, 1, H * T, width).matmul(cache, dtype=dtypes.float32) * (1.0 / c.head_dim ** 0.5)  # (B, 1, H*T, kv)
    seen = self.arange[:kv].reshape(1, 1, 1, kv)
    hidden = seen > pos.reshape(B, 1, 1, T, 1).expand(B, 1, H, T, 1).reshape(B, 1, H * T, 1)
    w = hidden.where(float("-inf"), scores).softmax(-1).contiguous()
    last = pos.reshape(B, 1, T).max(-1).reshape(B, 1, 1, 1)
    values = cache[:, :, :c.kv_lora_rank, :].transpose(-1, -2)  # (B, 1, kv, kv_lora_rank): the latent rows, read in place
    latent = (w @ (self.arange[:kv].reshape(1, 1, kv, 1) > last).where(0.0, values)).reshape(B, H, T, c.kv_lora_rank).contiguous()
    out = latent @ b.attn_v_b["weight"].transpose(-1, -2)  # (B, H, T, v_head_dim)
    return out.permute(0, 2, 1, 3).reshape(B, T, H * c.v_head_dim).contiguous()

  def _blocks(self, x: Tensor, attention) -> Tensor:
    """x through the stage's blocks; `attention(block, normed x)` is the graph's attention (write, then attend). The
    router logits (rows, experts) of the stage's router block (StageModel._router_block), when it has one, are kept in
    `router_rows` for _egress to return beside the result.

    Every input of a sum that carries a factor of its row (a norm's scale, softmax's 1 / sum) is made a buffer of its
    own (`contiguous`): fused into the sum, tinygrad takes such a factor out of it (sum(x * r * w) -> r * sum(x * w)),
    which rounds differently, and whether it fuses depends on the graph's shapes. As buffers, both graphs sum the
    same stored values."""
    tc, fresh = self.m.tensor_cores, self.m._router_block
    self.router_rows = None

    gemma = self.m.gemma is not None

    def dense(b: TransformerBlock, n: Tensor, fused: str, gate_up: tuple[str, str], down: str) -> Tensor:
      # tinygrad's dense feed-forward (FFNBlock._feed_forward), through the column-blocked matrices: a dense block's, or
      # a MoE block's shared expert; Gemma's GeGLU (GELU, tanh-approximated, for SiLU)
      gate, up = _projections(b, n, fused, gate_up, tc)
      h = (gate.gelu() if gemma else gate.silu()).contiguous() * up
      # for more than one row the down projection's input is stored: read inside the product, each row's gate and up
      # (power-of-two strides apart) are two streams beside the weights', and eight rows' sixteen fought for the L1
      # cache's ways (1B: 2.9x the product's time in a 256-row chunk); one row's two cost less than a kernel of its own
      one = all(isinstance(d, int) for d in n.shape[:-1]) and prod(n.shape[:-1]) == 1
      return _linear(getattr(b, down), h if one else h.contiguous(), tc)

    def post(norm: Any, t: Tensor) -> Tensor:
      # Gemma's norm of a block's attention or feed-forward output before the residual adds it (the output a buffer:
      # the norm's sum of squares reads stored values in every graph)
      return t if norm is None else norm(t.contiguous())

    def moe(b: TransformerBlock, n: Tensor) -> tuple[Tensor, Tensor]:
      logits = _linear(b.ffn_gate_inp, n, tc).float().contiguous()
      out = experts.routed(b, n, logits, staged=_staged(list(n.shape[:-1])))  # one row at a time (experts.py)
      if hasattr(b, "ffn_gate_shexp"):
        shared = dense(b, n, "rows_shexp_gate_up", ("ffn_gate_shexp", "ffn_up_shexp"), "ffn_down_shexp")
        out = out + (shared * experts.shared_gate(b, n) if hasattr(b, "ffn_gate_inp_shexp") else shared)
      return out, logits

    def call(b: TransformerBlock, x: Tensor) -> Tensor:
      @function(allow_implicit=True)
      def _run(x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        mixer = attention(b, b.attn_norm(x))  # a recurrent block's comes through its own output projection (_recurrent)
        if not isinstance(b, GatedDeltaNetBlock): mixer = _linear(b.attn_output, mixer, tc)
        h = x + post(getattr(b, "post_attention_norm", None), mixer)
        if gemma: h = h.contiguous()  # a normed output's row factor stays out of ffn_norm's sum
        n = b.ffn_norm(h).contiguous()
        if not b.config.num_experts:
          return (h + post(getattr(b, "post_ffw_norm", None), dense(b, n, "rows_gate_up", ("ffn_gate", "ffn_up"), "ffn_down"))).contiguous()
        ffn, logits = moe(b, n)
        out = (h + ffn).contiguous()
        return (out, logits.reshape(-1, b.config.num_experts).contiguous()) if b is fresh else out
      if b is not fresh: return _run(x)
      out, self.router_rows = _run(x)
      if each: Tensor.realize(out, self.router_rows)  # together: one after the other would compute the block twice
      return out
    # a graph that stages packed matrices is scheduled block by block: its arena holds one block's staged copies
    each = self.m.weights.startswith("packed") and _staged(list(x.shape[:-1]))
    return self.m._blocks(x, call, fresh=fresh, each=each)

  def _ingress(self, inp: Tensor, rows: int | UOp, B: int, T: int | UOp) -> Tensor:
    """The graph's input rows as float (B, T, dim): on the head, the token embedding from raw GGML rows (the
    reference's arithmetic: dequantise, cast to float16, then float); elsewhere the residual in the boundary dtype."""
    m = self.m
    if m.is_head:
      n = inp.shape[0] * m.dim
      w = ggml_data_to_tensor(inp.flatten(), n, m._embd_info.ggml_type).reshape(inp.shape[0], m.dim)
      # stored as float16 by a kernel of its own: a device without float16 arithmetic may skip the rounding of a cast
      # that stays inside one kernel (PoCL's CPU device does), and its rows would start from other values
      if m.half: w = w.cast("float16").contiguous()
      x = w[:rows].reshape(B, T, m.dim).float()
      return x * m.gemma.embed_scale if m.gemma else x  # Gemma scales the embedding by sqrt(dim), in float32
    x = inp[:rows].reshape(B, T, m.dim)
    return x.float() if m._bdtype != dtypes.float32 else x

  def _egress(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
    """Rows (n, 1, dim) or (1, n, dim) out: the tail's logits (n, vocab), else the residual in the boundary dtype; and
    with a router block, its logits (every row of the graph, experts) as a second output."""
    m = self.m
    if m.is_tail:
      # the output matrix is never staged: a graph's tail computes a few rows (a window, and a prompt chunk's last
      # ROW_UNIT), and its float16 copy is the largest of all (Gemma's 262,144 x 640: 335 MB of scratch in every graph
      # of more than STAGED_ROWS rows, rewritten at each of its steps)
      out = _linear(m.output, m.output_norm(x).contiguous(), m.tensor_cores, staged=False).reshape(-1, m.vocab_size)
      if m.gemma and (cap := m.gemma.softcap): out = (out.contiguous() / cap).tanh() * cap  # the file's soft cap
      out = out.contiguous()
    else: out = (x.cast(m._bdtype) if m._bdtype != dtypes.float32 else x).contiguous()
    return out if self.router_rows is None else (out, self.router_rows)

  def _result(self, ret: Tensor | tuple[Tensor, Tensor], rows: int) -> Tensor:
    """A graph's main output; the router logits of its first `rows` rows, when it has them, copied to the host as
    `router` (rows, experts)."""
    if not isinstance(ret, tuple):
      self.router = None
      return ret
    # the whole buffer in one copy out (any device, no tinygrad schedule), then its first rows
    buf = ret[1].uop.buf_uop.buffer
    full = np.empty(buf.size, np.float32)
    buf.copyout(memoryview(full).cast("B"))
    self.router = full[:rows * self.m.config.num_experts].reshape(rows, -1)
    return ret[0]

  # --- prefill: rows of one stream ------------------------------------------------------------------
  def _prefill_graph(self, inp: Tensor, pos: Tensor, rope: Tensor, rows: UOp | int, slot: UOp, start: UOp, kv32: UOp) -> Tensor:
    R, kv = rows * ROW_UNIT if isinstance(rows, UOp) else rows, kv32 * KV_UNIT
    tables = self._rope_tables(rope[:R], (1, 1, R))
    p = pos[:R].reshape(1, 1, R, 1)
    for b, (kc, vc) in zip(self.m.blk, self.caches, strict=True):
      if isinstance(b, GatedDeltaNetBlock): b.rows_conv, b.rows_rec = kc, vc
      else: b.rows_k, b.rows_v = kc, vc

    def attention(b: TransformerBlock, x: Tensor) -> Tensor:
      if isinstance(b, GatedDeltaNetBlock): return self._recurrent_chunk(b, x, slot, R, p)
      q, k, v, gate = self._qkv(b, x, *tables[getattr(b, "rope_table", 0)])
      kc, vc = self._write_rows(b.rows_k, b.rows_v, k, v, slot, start, R)
      return _gated(self._attend_cache(b, q, kc, vc, slot, 1, p, kv), gate)
    x = self._blocks(self._ingress(inp, R, 1, R), attention)
    if self.m.is_tail and isinstance(rows, UOp): x = x[:, R - ROW_UNIT:R]  # the last real row is among the last ROW_UNIT (ROWS rows would do too)
    return self._egress(x)

  def _write_rows(self, kc: Tensor, vc: Tensor | None, k: Tensor, v: Tensor | None, slot: UOp, start: UOp, R: UOp) -> tuple[Tensor, Tensor | None]:
    """The flat caches after rows k, v (1, KvH, R, Hd) of one stream went into consecutive positions start.. of its slot;
    the padding rows' too (read by no row before a later one overwrites them)."""
    kd = self.key_view(kc)[slot:slot + 1, :, :, start:start + R]
    kc = Tensor(kc.uop.after(kd.uop.store(k.transpose(2, 3).uop)))
    if vc is None: return kc, None
    vd = self.value_view(vc)[slot:slot + 1, :, start:start + R, :]
    return kc, Tensor(vc.uop.after(vd.uop.store(v.uop)))

  def prefill(self, slot: int, inp: np.ndarray, start: int, every_row: bool = False) -> Tensor:
    """Rows inp (T tokens or (T, dim)) of the stream in `slot` at positions start..start+T-1, T <= MAX_ROWS. Returns,
    realized: the residual (1, T, dim), or on the tail the logits (vocab,) of the last row (`every_row`, T <= ROW_UNIT:
    a list of every row's logits, which the graph computes anyway). May alias an internal buffer."""
    m = self.m
    T = len(inp)
    if not 1 <= T <= MAX_ROWS: raise errors.ActivationExtentInvalid(f"a prefill call takes 1..{MAX_ROWS} rows, got {T}")
    if m.recurrent and T > RECURRENT_ROWS:
      raise errors.ActivationExtentInvalid(f"a recurrent model's chunk takes 1..{RECURRENT_ROWS} rows, got {T}")
    # a recurrent model's chunk graph has its rows' steps written out one after another: RECURRENT_SHORT's sizes
    short = next((n for n in RECURRENT_SHORT if T <= n)) if m.recurrent else next((n for n in self.short_rows if T <= n), None)
    R = short or _round(T, ROW_UNIT)
    self.reached(slot, start + R)
    _put((self.prefill_in, self.prefill_pos, self.prefill_rope), self._prefill_inputs(inp, start, R))
    graph, rows = (self.short_graph(R), R) if short else (self.prefill_graph(), self.v_rows.bind(R // ROW_UNIT))
    with loop_schedules.rows_schedules():
      ret = graph(self.prefill_in, self.prefill_pos, self.prefill_rope, rows, self.v_slot.bind(slot), self.v_start.bind(start),
                  self.v_kv.bind(_round(start + R, KV_UNIT) // KV_UNIT))
    buf = self._result(ret, T).uop.buf_uop.buffer
    if m.is_tail: return self._tail_rows(buf, T, R, 0, every_row)
    return m._view(buf, (1, T, m.dim))

  def _tail_rows(self, buf: Any, T: int, R: int, at: int, every_row: bool) -> Any:
    """The tail's logits of a chunk of T rows (padded to R) that start `at` rows into the graph's output, which holds the
    last ROW_UNIT rows of the chunk: the last row's (vocab,), or with `every_row` (T <= ROW_UNIT) all of them (T, vocab)."""
    m = self.m
    if not every_row: return m._view(buf, (m.vocab_size,), (at + T - 1 - (R - min(R, ROW_UNIT))) * m.vocab_size)
    if T > ROW_UNIT: raise errors.ActivationExtentInvalid(f"every row's logits: at most {ROW_UNIT} rows, got {T}")
    return [m._view(buf, (m.vocab_size,), (at + i) * m.vocab_size) for i in range(T)]

  def _prefill_inputs(self, inp: np.ndarray, start: int, R: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A prompt's R rows (T real, then zeros as padding: a padding row's values reach no real row), their positions and
    rotary rows, on the host (on the head: the raw embedding rows, gathered from the file's mmap)."""
    m = self.m
    rows = m._embd_rows[np.asarray(inp, dtype=np.uint32)] if m.is_head else np.asarray(inp)
    padded = np.zeros((R, *rows.shape[1:]), rows.dtype)
    padded[:len(rows)] = rows
    pos = np.arange(start, start + R, dtype=np.int32)
    rope = self.rope_host[np.minimum(pos, len(self.rope_host) - 1)]  # padding rows: any finite row
    if m.recurrent: pos[len(rows):] = -1  # a padding row leaves a recurrent state as it was (_recurrent_chunk)
    return padded, pos, rope

  # --- decode: one row for each stream of a window of slots -------------------------------------------
  def _decode_graph(self, inp: Tensor, pos: Tensor, rope: Tensor, at_k: Tensor, at_v: Tensor, W: int, lo: UOp, kv32: UOp) -> Tensor:
    kv = kv32 * KV_UNIT
    tables = self._rope_tables(rope[:W], (W, 1, 1))
    p = pos[:W].reshape(W, 1, 1, 1)
    ak, av = at_k[:W], at_v[:W]
    for b, (kc, vc) in zip(self.m.blk, self.caches, strict=True):
      if isinstance(b, GatedDeltaNetBlock): b.rows_conv, b.rows_rec = kc, vc
      else: b.rows_k, b.rows_v = kc, vc

    def attention(b: TransformerBlock, x: Tensor) -> Tensor:
      if isinstance(b, GatedDeltaNetBlock): return self._recurrent(b, x, lo, W, p)
      q, k, v, gate = self._qkv(b, x, *tables[getattr(b, "rope_table", 0)])
      kc, vc = self._scatter_rows(b.rows_k, b.rows_v, k, v, ak, av)
      return _gated(self._attend_cache(b, q, kc, vc, lo, W, p, kv), gate)
    return self._egress(self._blocks(self._ingress(inp, W, W, 1), attention))

  def _scatter_rows(self, kc: Tensor, vc: Tensor | None, k: Tensor, v: Tensor | None, ak: Tensor, av: Tensor) -> tuple[Tensor, Tensor | None]:
    """The flat caches after each decode row's key and value (k, v: (W, KvH, 1, Hd)) went into its own slot at its own
    position (a filler's into the spare slot): element offsets ak, av."""
    W = k.shape[0]
    kc = _scatter(kc, k.reshape(W, self.kv_heads, self.key_dim), ak, self.key_dim * self.length, self.length)
    if vc is None: return kc, None
    c = self.m.config
    return kc, _scatter(vc, v.reshape(W, c.n_kv_heads, c.head_dim), av, self.length * c.head_dim, 1)

  def window(self, slots: list[int]) -> tuple[int, int]:
    """(first slot, rows) of the decode window holding `slots`: the smallest power of two of consecutive slots from the
    lowest one (at most every slot), moved down where it would run past the last slot."""
    rows = min(self.slots, 1 << (max(slots) - min(slots)).bit_length())
    return min(min(slots), self.slots - rows), rows

  def decode(self, slots: list[int], inp: np.ndarray, positions: list[int], window: tuple[int, int] | None = None) -> Tensor:
    """One decode row for each of `slots` (row i of inp at positions[i]). Returns, realized, (W, 1, dim) or on the tail
    (W, vocab): row r belongs to slot lo + r (`window`, or the one given), the others are fillers. May alias an
    internal buffer."""
    m = self.m
    lo, W = window or self.window(slots)
    for s, p in zip(slots, positions, strict=True): self.reached(s, int(p) + 1)
    _put((self.decode_in, self.decode_pos, self.decode_rope, self.decode_at_k, self.decode_at_v), self._decode_inputs(slots, inp, positions, lo, W))
    with loop_schedules.rows_schedules():
      ret = self.decode_graph(W)(self.decode_in, self.decode_pos, self.decode_rope, self.decode_at_k, self.decode_at_v, W, self.v_lo.bind(lo),
                                 self.v_kv.bind(_round(max(positions) + 1, KV_UNIT) // KV_UNIT))
    return m._view(self._result(ret, W).uop.buf_uop.buffer, (W, m.vocab_size) if m.is_tail else (W, 1, m.dim))

  def _decode_inputs(self, slots: list[int], inp: np.ndarray, positions: list[int], lo: int, W: int) -> tuple[np.ndarray, ...]:
    """A decode window's inputs on the host: each row's input row, position (-1 for a filler), rotary row and cache
    offsets. A filler's row is zeros: it sees no key, computes NaN in its own row only, and writes into the spare slot."""
    m = self.m
    at = np.asarray(slots) - lo
    pos = np.full(W, -1, dtype=np.int32)
    pos[at] = positions
    where = np.full(W, self.slots, dtype=np.int64)  # fillers write into the spare slot, at position 0
    where[at] = slots
    ak, av = self._offsets(where, np.maximum(pos, 0))
    rope = np.zeros((W, self.rope_host.shape[-1]), np.float32)
    rope[at] = self.rope_host[list(positions)]
    if m.is_head:
      rows = np.zeros((W, m._embd_row_bytes), np.uint8)
      rows[at] = m._embd_rows[np.asarray(inp, dtype=np.uint32).reshape(-1)]
    else:
      rows = np.zeros((W, m.dim), DTYPES[m.boundary_dtype])
      rows[at] = np.asarray(inp).reshape(len(at), m.dim)
    return rows, pos, rope, ak, av

  # --- mixed: a decode window and a prompt's rows in one pass over the weights ----------------------------
  def _mixed_graph(self, inp: Tensor, pos: Tensor, rope: Tensor, at_k: Tensor, at_v: Tensor, W: int, lo: UOp, kv32: UOp, rows16: UOp,
                   slot: UOp, start: UOp, kvp32: UOp) -> Tensor:
    """The decode graph's W rows and the prefill graph's R, through the projections and feed-forwards as one batch
    (the weights are read once for both), each part through its own graph's attention. The parts are joined by
    stores into buffers of their own, not by a concatenation (whose symbolic bounds tinygrad's codegen cannot gate)."""
    R, kv, kvp = rows16 * ROW_UNIT, kv32 * KV_UNIT, kvp32 * KV_UNIT
    tables = self._rope_tables(rope[:W + R], (1, 1, W + R))
    pd, pp = pos[:W].reshape(W, 1, 1, 1), pos[W:W + R].reshape(1, 1, R, 1)
    ak, av = at_k[:W + MAX_ROWS], at_v[:W + MAX_ROWS]
    for b, (kc, vc), join in zip(self.m.blk, self.caches, self.joins, strict=True): b.rows_k, b.rows_v, b.rows_join = kc, vc, join

    def attention(b: TransformerBlock, x: Tensor) -> Tensor:
      q, k, v, gate = self._qkv(b, x, *tables[getattr(b, "rope_table", 0)])  # (1, heads, W + R, Hd)
      rows = lambda t: t[:, :, :W].permute(2, 1, 0, 3)  # noqa: E731 - the decode part as the decode graph has it: (W, heads, 1, Hd)
      # every row's key and value through one scatter (a second write into the cache in the same graph, a store, makes
      # tinygrad copy the whole cache first)
      # (a custom kernel takes fixed shapes: the rows, computed, then padded to W + MAX_ROWS, the padding written into the
      # spare slot)
      full = lambda t: t.permute(2, 1, 0, 3).contiguous().pad(((0, MAX_ROWS - R), None, None, None))  # noqa: E731
      kc, vc = self._scatter_rows(b.rows_k, b.rows_v, full(k), None if v is None else full(v), ak, av)
      dec = self._attend_cache(b, rows(q), kc, vc, lo, W, pd, kv)
      pre = self._attend_cache(b, q[:, :, W:W + R], kc, vc, slot, 1, pp, kvp)
      return _gated(_join(b.rows_join, [(dec.reshape(1, W, -1), 0, W), (pre, W, R)]), gate)
    x = self._blocks(self._ingress(inp, W + R, 1, W + R), attention)
    if self.m.is_tail: x = _join(self.tail_join, [(x[:, :W], 0, W), (x[:, W + R - ROW_UNIT:W + R], W, ROW_UNIT)])
    return self._egress(x)

  def mixed(self, slots: list[int], dec_inp: np.ndarray, positions: list[int], slot: int, pre_inp: np.ndarray, start: int,
            every_row: bool = False) -> tuple[Tensor, Tensor]:
    """decode(slots, dec_inp, positions) and prefill(slot, pre_inp, start) in one pass: the same results (bit for bit: the
    same per-row code and sums), in less time than the two apart. Returns (what decode returns, what prefill returns),
    views of one buffer."""
    m = self.m
    T = len(pre_inp)
    if not 1 <= T <= MAX_ROWS: raise errors.ActivationExtentInvalid(f"a prefill call takes 1..{MAX_ROWS} rows, got {T}")
    # always the window of every slot: one mixed graph to prepare, not one per window (a filler row costs little beside
    # a chunk's rows)
    lo, W = 0, self.slots
    R = _round(T, ROW_UNIT)
    for s, p in [*zip(slots, positions, strict=True), (slot, start + R - 1)]: self.reached(s, int(p) + 1)
    d_in, d_pos, d_rope, d_ak, d_av = self._decode_inputs(slots, dec_inp, positions, lo, W)
    p_in, p_pos, p_rope = self._prefill_inputs(pre_inp, start, R)
    # the prompt's rows' cache offsets after the window's, then the padding's (into the spare slot)
    p_ak, p_av = self._offsets(np.r_[np.full(R, slot), np.full(MAX_ROWS - R, self.slots)], np.r_[np.arange(start, start + R), np.zeros(MAX_ROWS - R)])
    # the mixed graph's inputs: the window's rows, then the prompt's, composed on the host and copied once each
    _put((self.mixed_in, self.mixed_pos, self.mixed_rope, self.mixed_at_k, self.mixed_at_v),
         (np.concatenate([d_in, p_in]), np.r_[d_pos, p_pos], np.concatenate([d_rope, p_rope]), np.r_[d_ak, p_ak], np.r_[d_av, p_av]))
    kv, kvp = _round(max(positions) + 1, KV_UNIT) // KV_UNIT, _round(start + R, KV_UNIT) // KV_UNIT
    with loop_schedules.rows_schedules():
      ret = self.mixed_graph(W)(self.mixed_in, self.mixed_pos, self.mixed_rope, self.mixed_at_k, self.mixed_at_v, W, self.v_lo.bind(lo),
                                self.v_kv.bind(kv), self.v_rows.bind(R // ROW_UNIT), self.v_slot.bind(slot), self.v_start.bind(start),
                                self.v_kvp.bind(kvp))
    buf = self._result(ret, W + T).uop.buf_uop.buffer
    if m.is_tail: return m._view(buf, (W, m.vocab_size)), self._tail_rows(buf, T, R, W, every_row)
    return m._view(buf, (W, 1, m.dim)), m._view(buf, (1, T, m.dim), W * m.dim)

  def mixed_rows(self, batch: Tensor, slots: list[int]) -> list[Tensor]:
    """The rows of a mixed step's decode part, in the order of `slots` (its window is every slot, from slot 0)."""
    return self.rows_of(batch, slots, lo=0)

  def mixed_graph(self, W: int) -> TinyJit:
    if (jit := self.mixed_jits.get(W)) is None: jit = self.mixed_jits[W] = self.m._jit("rows-mixed", self._mixed_graph)
    return jit

  def _offsets(self, slots: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's element offset of (slot, kv head 0, dim 0, position) in the flat key cache, and of (slot, 0, position, 0)
    in the value cache (_scatter_rows adds the rest)."""
    c, L = self.m.config, self.length
    slots, positions = np.asarray(slots, np.int64), np.asarray(positions, np.int64)
    return ((slots * self.kv_heads * self.key_dim * L + positions).astype(np.int32),
            (slots * c.n_kv_heads * L * c.head_dim + positions * c.head_dim).astype(np.int32))

  def rows_of(self, batch: Tensor, slots: list[int], lo: int | None = None) -> list[Tensor]:
    """The rows of a decode result, in the order of `slots`, each a realized view (no copy)."""
    buf, row, lo = batch.uop.buffer, prod(batch.shape[1:]), self.window(slots)[0] if lo is None else lo
    return [device_memory.view(buf, batch.shape[1:], (s - lo) * row) for s in slots]
