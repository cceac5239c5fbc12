"""How a stage's modules are built and filled from the GGUF file (StageModel calls `load` once): each owned tensor's
bytes straight from an mmap of the file to the device, each parameter in the form its weights mode asks (quantized:
the file's bytes, dequantised inside every kernel; float16 / float32: dequantised once; packed: the file's blocks
repacked for the rows path, pyruntime/stage/compute/packed.py), in the reference's order of rows (the Q/K rotary permutation),
and the rows path's column-blocked and fused projection matrices. The loaded values are the reference's, HALF=1:
every weight rounded to float16.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import replace
from typing import Any

import numpy as np
from tinygrad import Tensor, dtypes, nn
from tinygrad.helpers import prod
from tinygrad.llm.gguf import ggml_data_to_tensor
from tinygrad.llm.model import (
  ExpertWeights,
  FFNBlock,
  GatedDeltaNetBlock,
  MLATransformerBlock,
  TransformerBlock,
  TransformerConfig,
  precompute_freqs_cis,
)
from tinygrad.nn.state import get_state_dict

from pyruntime import errors
from pyruntime.modelfile.gguf import TensorInfo, packed_types
from pyruntime.modelfile.plan import FFN_NORM_RENAMED, block_tensor_names, output_tensor_name, stage_tensor_names
from pyruntime.stage.compute import device_memory, int8_product, loop_schedules
from pyruntime.stage.compute.gemma import GemmaBlock, GemmaForm, rope_tables
from pyruntime.stage.compute.packed import PackedMatrix, packable, repack, repack_experts


def new_block(cfg: TransformerConfig, i: int, gemma: GemmaForm | None = None) -> FFNBlock:
  """Block i as `Transformer.__init__` builds it: recurrent or attention (MLA when kv_lora_rank > 0), dense FFN for the
  leading dense blocks, else the config's FFN (experts when it has them); a Gemma 3 block (gemma.py) for a gemma3 file,
  its rotary table 1 (the sliding window's) or 0."""
  if gemma is not None: return GemmaBlock(cfg, gemma.window if gemma.local(i) else 0, int(gemma.local(i)))
  dense = replace(cfg, num_experts=0, num_experts_per_tok=0, shared_expert_dim=0, hidden_dim=cfg.dense_hidden_dim or cfg.hidden_dim)
  if cfg.ssm:
    cfg = replace(cfg, qk_norm=cfg.head_dim)
    if (i + 1) % cfg.full_attention_interval != 0: return GatedDeltaNetBlock(cfg, cfg.ssm)
  return (MLATransformerBlock if cfg.kv_lora_rank > 0 else TransformerBlock)(dense if i < cfg.leading_dense_blocks else cfg)


# Projections that read the same input, kept as one column-blocked matrix: the rows path computes them in one kernel
# (rows._projections). Each output's sum is the one it was alone (same inputs, same order), so the bits do not change.
FUSED = {"rows_qkv": ("attn_q", "attn_k", "attn_v"), "rows_gate_up": ("ffn_gate", "ffn_up"),
         "rows_shexp_gate_up": ("ffn_gate_shexp", "ffn_up_shexp"),
         # latent attention's query (or its low-rank first half) beside the latent and rotary key
         "rows_q_kv_a": ("attn_q", "attn_kv_a_mqa"), "rows_q_a_kv_a": ("attn_q_a", "attn_kv_a_mqa")}


def fuse_projections(b: Any, device: str) -> None:
  """Join each FUSED group's column blocks into one buffer (packed ones, still on the host: one set of buffers on
  `device`); every member's `rows_blocked` and `weight` become views of its part (no second copy)."""
  for attr, names in FUSED.items():
    lins = [getattr(b, n, None) for n in names]
    blocks = [getattr(lin, "rows_blocked", None) for lin in lins]
    if any(w is None for w in blocks) or len({w.shape[1:] for w in blocks}) != 1: continue
    if all(isinstance(w, PackedMatrix) for w in blocks):
      if (fused := PackedMatrix.cat(blocks)) is None: continue
      fused = fused.upload(device)
    elif any(isinstance(w, PackedMatrix) for w in blocks): continue
    else: fused = Tensor.cat(*blocks, dim=0).contiguous().realize()
    at = 0
    for lin, w in zip(lins, blocks, strict=True):
      set_blocks(lin, fused[at:at + w.shape[0]])
      at += w.shape[0]
    setattr(b, attr, fused)


def set_blocks(lin: nn.Linear, blocks: Tensor | PackedMatrix) -> None:
  """A linear's column blocks, and (float blocks) its `weight` a view of them, the matrix it was: tinygrad's own kernels
  read it. A packed linear's `weight` stays the unallocated placeholder `weight` made: packed weights exist only on the
  rows path, which reads `rows_blocked` (rows._linear), and the lazy expression of its values cost ~10 ms of Python a
  matrix at load, a third of a new process's weight load."""
  lin.rows_blocked = blocks
  if isinstance(blocks, PackedMatrix): return
  n, K, vec = blocks.shape
  lin.weight.replace(blocks.permute(1, 0, 2).reshape(K, n * vec).T)


def held_buffers(lin: Any, p: Tensor) -> list[Tensor]:
  """The realized buffers that hold parameter p: its linear's column blocks (or packed buffers) when it has them."""
  held = getattr(lin, "rows_blocked", p)
  return held.buffers() if isinstance(held, PackedMatrix) else [held]


# a MoE block's router and shared expert are dense projections too (its routed experts are not: experts.py), and so are
# latent attention's (its per-head attn_k_b and attn_v_b are not: rows._latent_qk, rows._attend_latent)
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_inp", "ffn_gate_shexp",
               "ffn_up_shexp", "ffn_down_shexp", "attn_q_a", "attn_q_b", "attn_kv_a_mqa")


def linears(b: FFNBlock) -> list[nn.Linear]:
  """A block's dense projections (the rows path keeps their matrices in column blocks)."""
  return [m for m in (getattr(b, n, None) for n in PROJECTIONS) if isinstance(m, nn.Linear)]


EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def expert_matrices(b: FFNBlock) -> list[ExpertWeights]:
  """A MoE block's routed experts' matrices (experts, outputs, inputs): the rows path keeps each expert's in column
  blocks too (experts.py)."""
  return [getattr(b, n) for n in EXPERTS if hasattr(b, n)]


_init_lock = threading.Lock()


@contextlib.contextmanager
def no_random_init():
  """Build tinygrad modules without their random initial weights (every one is replaced from the file anyway):
  nn.Linear's lazy Tensor.uniform graphs cost ~0.2 s of Python per block."""
  with _init_lock:
    orig = Tensor.__dict__["uniform"]  # restored exactly as it was defined
    def empty(*shape, low=0.0, high=1.0, dtype=None, device=None, **kwargs): return Tensor.empty(*shape, dtype=dtype, device=device)
    Tensor.uniform = staticmethod(empty)  # type: ignore[assignment]
    try: yield
    finally: Tensor.uniform = orig


def load(m: Any) -> None:
  # long (~60 lines): one pass over the stage's tensors, each kept in the form its weights mode asks, with the checks
  cfg, header = m.config, m.header
  names = list(dict.fromkeys(stage_tensor_names(header, m.start, m.end)))
  if missing := [n for n in names if n not in header.tensors]: raise errors.ModelLoadFailed(f"{m.path}: missing tensors {missing}")
  # each owned tensor's own byte range, straight from (an mmap of) the file into a device buffer: one copy each,
  # nothing else of the file is read, and no tinygrad scheduling is involved
  mm = np.memmap(m.path, dtype=np.uint8, mode="r")
  # projections kept packed are repacked from the mmap below: no device copy of their bytes, no dequantising graph
  m._packed = {n for n in names if keeps_packed(m, n)}
  m._ready: dict[str, Tensor] = {}  # tensors uploaded as the value their parameter holds (host_vector)
  raws: dict[str, Tensor] = {}
  for n in names:
    ti = header.tensors[n]
    if ti.offset + ti.nbytes > mm.shape[0]: raise errors.ModelLoadFailed(f"{m.path}: tensor {n!r} runs past the end of the file")
    if n in m._packed: continue
    # a float vector (a norm, a bias) is converted on the host and uploaded as the value the kernels read: scheduling
    # its conversion on the device cost ~50 ms a block at load
    if (vec := host_vector(m, ti, mm)) is not None: raws[n] = m._ready[n] = device_memory.upload(vec, m.device)
    else: raws[n] = device_memory.upload(mm[ti.offset:ti.offset + ti.nbytes], m.device)
  m.resident_bytes = sum(r.nbytes() for r in raws.values())  # the quantized mode's; the others' are set below
  # each tensor's bytes as in the file: with weights="quantized" the kernels dequantise them (the graph cache names them)
  m.raw_tensors = raws if m.weights == "quantized" else {}
  m.tensor_names = names

  with no_random_init(): m.blk = [new_block(cfg, i, m.gemma) for i in range(m.start, m.end)]
  # blocks of one signature trace to one function body (StageModel._blocks): how a block attends is part of it
  m._block_sigs = [(type(b).__name__, getattr(b, "window", 0), getattr(b, "rope_table", 0))
                   + tuple(sorted((n.split(".", 2)[2], header.tensors[n].ggml_type, header.tensors[n].dims) for n in block_tensor_names(header, i)))
                      for i, b in zip(range(m.start, m.end), m.blk, strict=True)]
  # each block's rotary table (rows path: RowPath.rope_host), one for most models, Gemma's global and local ones
  m.rope_tables = rope_tables(m.gemma, cfg, m.device) if m.gemma else \
    [precompute_freqs_cis(cfg.rope_dim, cfg.max_context, cfg.rope_theta, device=m.device).realize()]
  file_name: dict[int, str] = {}  # a parameter's tensor in the file (packed weights are repacked from its bytes)
  for i, b in zip(range(m.start, m.end), m.blk, strict=True):
    assign(b, {k: weight(m, raws, tensor_name(m, i, k)) for k in get_state_dict(b)}, f"blk.{i}")
    file_name.update({id(v): tensor_name(m, i, k) for k, v in get_state_dict(b).items()})
    # set here, not by the block's _init_state, which only runs without a cache
    if not isinstance(b, GatedDeltaNetBlock): b.freqs_cis = m.rope_tables[getattr(b, "rope_table", 0)]
  if m.is_tail:
    with no_random_init(): m.output_norm, m.output = nn.RMSNorm(cfg.dim, cfg.norm_eps), nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
    assign(m.output_norm, {"weight": weight(m, raws, "output_norm.weight")}, "output_norm")
    assign(m.output, {"weight": weight(m, raws, output_tensor_name(header))}, "output")
    file_name[id(m.output.weight)] = output_tensor_name(header)
  if m.is_head:
    ti = header.tensors["token_embd.weight"]
    if ti.shape[0] != cfg.vocab_size or ti.nbytes % cfg.vocab_size:
      raise errors.ModelLoadFailed(f"token_embd.weight {ti.shape} does not match the vocabulary of {cfg.vocab_size}")
    m._embd_info: TensorInfo = ti
    m._embd_row_bytes = ti.nbytes // cfg.vocab_size
    m._embd_rows = np.memmap(m.path, dtype=np.uint8, mode="r", offset=ti.offset, shape=(cfg.vocab_size, m._embd_row_bytes))
  if m.weights != "quantized":  # dequantised once at load, not inside every kernel
    groups = [list(dict.fromkeys(get_state_dict(b).values())) for b in m.blk]
    if m.is_tail: groups.append([m.output_norm.weight, m.output.weight])
    by_weight = {id(lin.weight): lin for b in m.blk for lin in linears(b)} | ({id(m.output.weight): m.output} if m.is_tail else {})
    by_experts = {id(ew.weight): ew for b in m.blk for ew in expert_matrices(b)} if m.batched else {}
    holders = by_weight | by_experts  # what holds a parameter's buffers (held_buffers)
    # float16 (a CPU's default) and float32 hold the same values (every product is the same); the kernels convert
    # a float16 vector to float32 in one instruction (loop_schedules._keep_half_to_float_vectors), so float16 reads
    # half the bytes for the same bits
    done: set[int] = set()
    row_orders: dict[tuple[str, int], np.ndarray | None] = {}
    for group in groups:  # a block at a time: blocks of one kind schedule alike, and tinygrad reuses the first's schedule
      group = [p for p in group if id(p) not in done]
      done.update(id(p) for p in group)
      for p in group:
        # float32 mode widens the float16 values once stored: a device without float16 arithmetic may skip the
        # rounding of a float16 cast it meets inside one kernel (PoCL's CPU device does), and hold other weights
        w = p.contiguous().float() if m.weights == "float32" else p
        lin = by_weight.get(id(p)) if m.batched else None
        if lin is not None and (name := file_name.get(id(p))) in m._packed:
          # the file's blocks, repacked into column blocks and dequantised inside the kernels (pyruntime/stage/compute/packed.py)
          ti = header.tensors[name]
          if (key := (name.rsplit(".", 2)[-2], p.shape[0])) not in row_orders:  # the same for every block
            rows = Tensor.arange(p.shape[0], device=m.device).reshape(-1, 1)
            # realized only where `rotary` permutes (q and k): each realize is a small schedule, ~60 ms at load
            row_orders[key] = None if (order := rotary(m, name, rows)) is rows else order.numpy()[:, 0]
          lin.rows_blocked = repack(mm[ti.offset:ti.offset + ti.nbytes], ti.ggml_type, p.shape, row_orders[key], loop_schedules.VEC, m.half,
                                    wide=m.weights == "packed-int8")
          lin.rows_blocked.integer = m.weights == "packed-int8" and int8_product.supported(lin.rows_blocked, m.device)
        elif (ew := by_experts.get(id(p))) is not None and (name := file_name.get(id(p))) in m._packed:
          # the experts' codes, each expert repacked as a projection is, one buffer set on the device (experts.py)
          ti = header.tensors[name]
          ew.rows_blocked = repack_experts(mm[ti.offset:ti.offset + ti.nbytes], ti.ggml_type, p.shape, loop_schedules.VEC, m.half).upload(m.device)
        elif (ew := by_experts.get(id(p))) is not None and p.shape[1] % loop_schedules.VEC == 0:
          # each expert's matrix in column blocks, as a projection's (experts, outputs / VEC, inputs, VEC): a row's product
          # with its chosen expert streams VEC outputs of every input as one run of memory (experts.py)
          E, n_out, K = p.shape
          ew.rows_blocked = w.reshape(E, n_out // loop_schedules.VEC, loop_schedules.VEC, K).permute(0, 1, 3, 2).contiguous()
          ew.weight.replace(ew.rows_blocked.permute(0, 1, 3, 2).reshape(E, n_out, K))
        elif lin is not None and p.shape[0] % loop_schedules.VEC == 0:
          # the rows path keeps a projection's matrix in column blocks (outputs / VEC, inputs, VEC): a kernel streams
          # each block's VEC outputs of every input as one run of memory (rows._linear); the block's own
          # `weight` becomes a view of the same bytes, the matrix it was
          set_blocks(lin, w.reshape(p.shape[0] // loop_schedules.VEC, loop_schedules.VEC, p.shape[1]).permute(0, 2, 1).contiguous())
        else: p.replace(w.contiguous())
      Tensor.realize(*[t for p in group for t in held_buffers(holders.get(id(p)), p)])
    if m.batched:
      for b in m.blk: fuse_projections(b, m.device)
    for lin in by_weight.values():  # packed matrices no group took: each on the device alone
      if isinstance(pm := getattr(lin, "rows_blocked", None), PackedMatrix) and pm.on_host: set_blocks(lin, pm.upload(m.device))
    params = [t for g in groups for p in g for t in held_buffers(holders.get(id(p)), p)]
    m.resident_bytes = sum(t.nbytes() for t in dict.fromkeys(params))


def tensor_name(m: Any, i: int, key: str) -> str:
  """The file's tensor for block i's state_dict key: from_gguf reads glm4moe's and qwen35's post_attention_norm as ffn_norm."""
  name = f"blk.{i}.{key}"
  if key == "ffn_norm.weight" and m.arch in FFN_NORM_RENAMED and name not in m.header.tensors:
    return f"blk.{i}.post_attention_norm.weight"
  return name


def weight(m: Any, raws: dict[str, Tensor], name: str) -> Tensor:
  """The reference's state_dict entry for `name`: dequantised (lazily), cast to float16, its rows in the reference's
  order (`rotary`)."""
  if name in m._packed:  # replaced by its packed matrix's values (set_blocks): never realized
    return Tensor.empty(*m.header.tensors[name].shape, dtype=dtypes.float16 if m.half else dtypes.float32, device=m.device)
  if name in m._ready: return m._ready[name]
  if name not in raws: raise errors.ModelLoadFailed(f"{m.path}: tensor {name!r} is missing")
  ti = m.header.tensors[name]
  w = ggml_data_to_tensor(raws[name], prod(ti.dims), ti.ggml_type).reshape(*ti.shape)
  return rotary(m, name, w.cast("float16") if m.half else w)


def host_vector(m: Any, ti: TensorInfo, mm: np.ndarray) -> np.ndarray | None:
  """A float32 or float16 vector of the file as the value its parameter holds once loaded (float16-rounded like every
  weight of the reference unless HALF=0, float32 in float32 mode: numpy and the kernels both round to nearest even), or None where
  the kernels read the file's bytes (quantized mode) or the tensor is not a plain float vector."""
  if m.weights == "quantized" or len(ti.shape) != 1 or (dt := {0: np.float32, 1: np.float16}.get(ti.ggml_type)) is None: return None
  v = mm[ti.offset:ti.offset + ti.nbytes].view(dt)
  v = v.astype(np.float16) if m.half else v.copy()  # without HALF the file's own type, as _weight gives it
  return v.astype(np.float32) if m.weights == "float32" else v


def keeps_packed(m: Any, name: str) -> bool:
  """Whether the stage keeps tensor `name` as the file's blocks (weights="packed", "packed-int8" or "packed-all": the rows path's
  projections and routed experts of the mode's types, modelfile.gguf.packed_types)."""
  if not m.weights.startswith("packed") or not m.batched or m.header.tensors[name].ggml_type not in packed_types(m.weights): return False
  ti, kind = m.header.tensors[name], name.rsplit(".", 2)[-2]
  projection = kind in PROJECTIONS or (m.is_tail and name == output_tensor_name(m.header))
  return (projection and len(ti.shape) == 2 or kind in EXPERTS and len(ti.shape) == 3) and packable(ti.ggml_type, ti.shape, loop_schedules.VEC)


def rotary(m: Any, name: str, w: Tensor) -> Tensor:
  """w (the file's rows of `name`) in the reference's order of rows: from_gguf's permutation of llama's Q/K rotary
  halves, and for MLA of the rotary part of q (q_b) and of the shared key (kv_a_mqa)."""
  cfg = m.config
  if (name.endswith("attn_q.weight") or name.endswith("attn_q_b.weight")) and (m.arch == "llama" or cfg.kv_lora_rank):
    w = w.reshape(cfg.n_heads, w.shape[0] // cfg.n_heads, -1)
    prefix = cfg.head_dim - cfg.rope_dim
    w = w[:, :prefix].cat(w[:, prefix:].rearrange("n (h two) d -> n (two h) d", two=2), dim=1).reshape(-1, w.shape[-1])
  elif m.arch == "llama" and name.endswith("attn_k.weight"):
    w = w.reshape(cfg.n_kv_heads, w.shape[0] // cfg.n_kv_heads, -1)
    w = w.rearrange("n (h two) d -> n (two h) d", two=2).reshape(-1, w.shape[-1])
  elif cfg.kv_lora_rank and name.endswith("attn_kv_a_mqa.weight"):
    w = w[:cfg.kv_lora_rank].cat(w[cfg.kv_lora_rank:].rearrange("(h two) d -> (two h) d", two=2), dim=0)
  return w


def assign(module: Any, weights: dict[str, Tensor], where: str) -> None:
  for k, v in get_state_dict(module).items():
    w = weights[k]
    if v.shape != w.shape: raise errors.ModelLoadFailed(f"{where}.{k}: expected shape {v.shape}, the file has {w.shape}")
    v.replace(w)
