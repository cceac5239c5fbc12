"""The compute side of a stage: one contiguous block range of a GGUF model, run in tinygrad, exactly.

Exactness is the design constraint: chaining the stages of any split (the residual crossing each cut as float32 bytes)
gives the same tokens, and the tail the same logits bit for bit, as tinygrad's own single-process
`Transformer.from_gguf(path).generate(...)` on the same file, device and dtype. So the stage reuses tinygrad's block
class and mirrors `from_gguf` and `generate` step for step:
- the same `TransformerConfig` derivation, the same fp16 cast of the dequantised weights (HALF=1), the same llama Q/K
  rotary permutation, the same weights left lazy (dequantised inside the kernels, REALIZE=0) or realized (REALIZE=1);
- x = embedding.float() on the head; output_norm + output (the embedding matrix when tied) on the tail;
- chunked prefill (32 tokens) with the symbolic `start_pos` / `toks` variables, T=1 decode steps, both under TinyJit.

What differs is what the stage holds. Each tensor it owns is read from its own byte range of the file (never the whole
file), and the head keeps the token embedding on the host: the rows a step needs are gathered from an mmap of the
file as raw GGML blocks and dequantised on the device by the same tinygrad code as the reference, so the values are
identical while the device holds none of the table.

The modules are built and filled from the file by pyruntime/stage/compute/weights.py (each tensor in the form the weights mode
asks); this module runs them.

KV caches are per slot (one stream each). One pair of JITs serves every slot: the slot's cache tensors are JIT
inputs, swapped in on each call, so a new stream costs no new capture.
"""
from __future__ import annotations

import os
import pathlib
import time
from typing import Any, Callable

import numpy as np
from tinygrad import Device, Tensor, TinyJit, UOp, dtypes, function
from tinygrad.device import Buffer
from tinygrad.helpers import DEV, flat_mv, getenv, prod
from tinygrad.llm.gguf import ggml_data_to_tensor
from tinygrad.llm.model import FFNBlock, GatedDeltaNetBlock, MLATransformerBlock, SSMConfig, TransformerBlock, TransformerConfig
from tinygrad.nn.state import get_state_dict
from tinygrad.uop.ops import Ops

from pyruntime import errors
from pyruntime.modelfile.boundary import DTYPES, MLA_POS, ROUTER, StageBoundary
from pyruntime.modelfile.gguf import GGUFHeader, read_header
from pyruntime.modelfile.plan import check_architecture, num_blocks, output_tensor_name
from pyruntime.options import DECODE_MODES, WEIGHT_MODES
from pyruntime.protocol import MAX_CHUNK, PREFILL_CHUNK
from pyruntime.stage.compute import cpu_graph, cuda_graph, device_memory, loop_schedules
from pyruntime.stage.compute.gemma import gemma_form
from pyruntime.stage.compute.graph_cache import GraphCache
from pyruntime.stage.compute.rows import MAX_ROWS, RECURRENT_ROWS, RECURRENT_SHORT, ROW_UNIT, RowPath
from pyruntime.stage.compute.weights import PROJECTIONS, held_buffers, linears
from pyruntime.stage.compute.weights import load as load_weights

# PREFILL_CHUNK (32) is Transformer.generate's chunk_size; a chunk of any 1..32 tokens runs the same kernels, so where a
# prompt is cut changes no bit (tests/integration/test_model.py::test_where_the_prompt_is_cut_changes_no_bit)
loop_schedules.install()  # before any kernel compiles: the prefill's kernels upcast and threaded (bits unchanged)
cpu_graph.install()  # a CPU's captured graphs replay from a native loop (the same kernels in the same order)
cuda_graph.install()  # CUDA's captured graphs can hold kernels whose launch size is a variable's (tinygrad 0.13 cannot)
BOUNDARY_TENSOR_DTYPES = {"float32": dtypes.float32, "float16": dtypes.float16}  # options.BOUNDARY_DTYPES as tinygrad dtypes


# --- model description from the header alone ---------------------------------------------------
def model_config(header: GGUFHeader, max_context: int | None = None) -> TransformerConfig:
  """The TransformerConfig `Transformer.from_gguf` derives, field for field, from the header only."""
  kv, arch, tensors = header.kv, header.arch, header.tensors
  try:
    max_context = min(max_context, kv[f"{arch}.context_length"]) if max_context is not None else kv[f"{arch}.context_length"]
    n_heads, n_kv_heads = kv[f"{arch}.attention.head_count"], kv[f"{arch}.attention.head_count_kv"]
    head_dim = kv.get(f"{arch}.attention.key_length_mla", kv.get(f"{arch}.attention.key_length", kv[f"{arch}.embedding_length"] // n_heads))
    rope_dim = kv.get(f"{arch}.rope.dimension_count", head_dim)
    qn = tensors.get("blk.0.attn_q_norm.weight")
    lead = kv.get(f"{arch}.leading_dense_block_count", 0)
    ssm = SSMConfig(**{k: kv[f"{arch}.ssm.{k}"] for k in ("conv_kernel", "state_size", "group_count", "time_step_rank", "inner_size")}) \
      if arch in ("qwen35", "qwen35moe") else None
    return TransformerConfig(
      num_blocks=num_blocks(header), dim=kv[f"{arch}.embedding_length"],
      hidden_dim=kv.get(f"{arch}.expert_feed_forward_length", kv.get(f"{arch}.feed_forward_length", 0)),
      n_heads=n_heads, n_kv_heads=n_kv_heads, norm_eps=kv[f"{arch}.attention.layer_norm_rms_epsilon"],
      vocab_size=len(kv["tokenizer.ggml.tokens"]), head_dim=head_dim, rope_theta=kv[f"{arch}.rope.freq_base"], rope_dim=rope_dim,
      v_head_dim=kv.get(f"{arch}.attention.value_length_mla", kv.get(f"{arch}.attention.value_length", head_dim)),
      max_context=max_context, qk_norm=int(qn.shape[0]) if qn is not None else 0, qkv_bias="blk.0.attn_q.bias" in tensors,
      num_experts=kv.get(f"{arch}.expert_count", 0), num_experts_per_tok=kv.get(f"{arch}.expert_used_count", 0),
      norm_topk_prob=kv.get(f"{arch}.expert_weights_norm", arch in ("qwen3moe", "qwen35moe")),
      kv_lora_rank=kv.get(f"{arch}.attention.kv_lora_rank", 0), q_lora_rank=kv.get(f"{arch}.attention.q_lora_rank", 0),
      leading_dense_blocks=lead,
      shared_expert_dim=kv.get(f"{arch}.expert_shared_feed_forward_length",
                               kv.get(f"{arch}.expert_shared_count", 0) * kv.get(f"{arch}.expert_feed_forward_length", 0)),
      shared_expert_gate=f"blk.{lead}.ffn_gate_inp_shexp.weight" in tensors,
      dense_hidden_dim=kv.get(f"{arch}.feed_forward_length", 0) if lead else 0,
      routed_scaling_factor=kv.get(f"{arch}.expert_weights_scale", 1.0), attn_output_gate=arch in ("qwen35", "qwen35moe"), ssm=ssm,
      full_attention_interval=kv.get(f"{arch}.full_attention_interval", 0),
      expert_bias=f"blk.{lead}.exp_probs_b.bias" in tensors)
  except KeyError as e:
    raise errors.ModelLoadFailed(f"{header.path}: GGUF metadata lacks {e.args[0]!r}") from e


def family(cfg: TransformerConfig) -> str:
  """dense (llama / qwen2 / qwen3 blocks), else what the model adds to them; the rows path serves dense, moe and mla."""
  if cfg.ssm: return "hybrid"
  if cfg.kv_lora_rank: return "mla"
  return "moe" if cfg.num_experts else "dense"


def resolve_device(device: str | None) -> str:
  """The tinygrad device a stage's tensors live on. None: the product's default (pyruntime.devices: the first GPU, else
  the CPU), never whatever tinygrad would pick (with an OpenCL driver installed, tinygrad's own default is CL). A
  device string's renderer (`CPU:X86`, `NULL:1:CUDA:sm_90`) goes into tinygrad's DEV targets for that backend, beside
  the default device's, which stays the default; its index never goes there (pyruntime.devices.parse_device)."""
  from tinygrad.helpers import Target

  from pyruntime.devices import default_devices, nvidia_compilers, parse_device
  spec = parse_device(default_devices(1)[0] if device is None else device)
  nvidia_compilers()
  if spec.renderer:
    first, new = DEV.value[0], Target.parse(spec.target)
    others = [t for t in DEV.value if t.device and t.device != spec.base]
    # tinygrad takes a backend's renderer from the first target naming it or naming no device, and the default device
    # from the first target: that one stays first unless it is this backend's or names none
    DEV.value = [first, new, *others[1:]] if first.device and first.device != spec.base else [new, *others]
  return Device.canonicalize(spec.name)


REWIND_ROWS = RECURRENT_ROWS // 4  # rows a rewind takes again one by one (StageModel.rewind); more go as a chunk


def _copy_rows(dst: Tensor, src: Buffer, s: int, nt: int) -> None:
  """Rows [0, nt) of a (1, *, w) JIT output buffer into rows [s, s+nt) of dst."""
  w, dt = dst.shape[-1], dst.dtype
  device_memory.write(dst.uop.buffer, device_memory.view(src, (nt * w,)).numpy(), s * w * dt.itemsize)


_TRACE_REUSE = bool(getenv("PYRUNTIME_TRACE_REUSE", 1))


def _buffers(u: UOp) -> list[UOp]: return [x for x in u.toposort() if x.op is Ops.BUFFER]


# block attributes a graph sets while it is traced (caches, views of them): not weights, named by their owners instead
_GRAPH_STATE = {"rows_k", "rows_v", "rows_join", "rows_conv", "rows_rec", "cache_kv", "cache_k", "conv_state", "recurrent_state", "batch_kv"}


# --- the stage ----------------------------------------------------------------------------------
class StageModel:
  """Blocks [start, end) of a GGUF model on one device, with `slots` independent KV caches.

  Its length (~570 lines, ~50 attributes) is one tinygrad model instance: its weights, caches and the captured graphs
  that close over those buffers, for every family's path (the dense rows path is RowPath, rows.py; the reference T=1
  decode, MoE, MLA and hybrid paths are here). Cutting it by family would scatter buffers the graphs share."""

  @classmethod
  def load(cls, path: str | os.PathLike, start: int, end: int, *, device: str | None = None, max_context: int | None = None,
           slots: int = 4, boundary_dtype: str = "float32", weights: str | None = None, decode: str = "batched",
           tensor_cores: bool = False, graph_cache: GraphCache | None = None) -> StageModel:
    path = pathlib.Path(path)
    if not path.is_file(): raise errors.GgufLocalPathMissing(f"no GGUF file at {path}")
    try: header = read_header(path)
    except (OSError, ValueError, KeyError, UnicodeDecodeError) as e: raise errors.ModelLoadFailed(f"{path}: {e}") from e
    return cls(header, start, end, device=device, max_context=max_context, slots=slots, boundary_dtype=boundary_dtype, weights=weights,
               decode=decode, tensor_cores=tensor_cores, graph_cache=graph_cache)

  def __init__(self, header: GGUFHeader, start: int, end: int, *, device: str | None = None, max_context: int | None = None,
               slots: int = 4, boundary_dtype: str = "float32", weights: str | None = None, decode: str = "batched",
               tensor_cores: bool = False, graph_cache: GraphCache | None = None):
    check_architecture(header)
    # long (~60 lines): the config read from the header, field by field, in the order tinygrad's Transformer takes it
    L = num_blocks(header)
    if not (isinstance(start, int) and isinstance(end, int)) or isinstance(start, bool) or isinstance(end, bool) \
       or not 0 <= start < end <= L:
      raise errors.LayerRangeInvalid(f"layer range [{start}, {end}) is empty or outside the model's blocks [0, {L})")
    if boundary_dtype not in BOUNDARY_TENSOR_DTYPES:
      raise errors.BoundarySchemaMismatch(f"boundary dtype must be one of {sorted(BOUNDARY_TENSOR_DTYPES)}, not {boundary_dtype!r}")
    if not isinstance(slots, int) or slots < 1: raise errors.SlotInvalid(f"a stage needs at least one KV slot, got {slots!r}")
    if max_context is not None and (not isinstance(max_context, int) or max_context < 2):
      raise errors.InvalidOption("max_context", f"must be an integer >= 2, got {max_context!r}")
    if decode not in DECODE_MODES: raise errors.InvalidOption("decode", f"must be one of {DECODE_MODES}, not {decode!r}")

    self.header, self.path, self.kv, self.arch = header, header.path, header.kv, header.arch
    self.config = cfg = model_config(header, max_context)
    self.num_blocks, self.start, self.end = L, start, end
    self.is_head, self.is_tail = start == 0, end == L
    self.dim, self.vocab_size, self.context_length, self.slots = cfg.dim, cfg.vocab_size, cfg.max_context, slots
    self.device = resolve_device(device)
    self.boundary_dtype = boundary_dtype
    self._bdtype = BOUNDARY_TENSOR_DTYPES[boundary_dtype]
    self.boundary = StageBoundary.for_range(self.arch, start, end, L, cfg.dim, boundary_dtype, experts=cfg.num_experts)
    self.family = family(cfg)
    self.gemma = gemma_form(header)  # Gemma 3's blocks (gemma.py): tinygrad has no model of them, so the rows path only
    if self.gemma is not None and decode != "batched":
      raise errors.InvalidOption("decode", f"{self.arch} runs on the rows path only (decode='batched'): tinygrad has no model of it "
                                 "whose kernels decode='reference' would run")
    # tinygrad's generate prefills one token at a time when any block of the model is recurrent: every stage must cut the
    # prompt where the reference does, attention-only stages too
    self.recurrent = cfg.ssm is not None
    self.on_boundary: Callable[[int, int], None] | None = None  # (slot, positions) at every boundary_every-th position
    self._rewind: dict[int, tuple[int, np.ndarray, list[np.ndarray]]] = {}  # slot -> a verify record's start, rows, state before
    self.boundary_every = 0
    self.chunk = 1 if self.recurrent else PREFILL_CHUNK  # tinygrad's prefill chunk (the rows path takes up to MAX_ROWS)
    # the rows path (pyruntime/stage/compute/rows.py: prompt and decode rows through the same kernels, many streams per step) is
    # written for attention blocks (latent attention included) with a dense or routed feed-forward (experts.py), and for
    # recurrent blocks (RowPath._recurrent: decode rows only, a prompt row by row); decode="reference" runs tinygrad's own
    # prefill and T=1 decode per stream
    self.batched = decode == "batched"
    self.half = bool(getenv("HALF", 1))  # the reference casts every weight to float16 unless HALF=0

    self.weights = weights or ("float16" if getenv("REALIZE", 0) else getenv("PYRUNTIME_WEIGHTS", "quantized"))
    if self.weights not in WEIGHT_MODES: raise errors.InvalidOption("weights", f"must be one of {WEIGHT_MODES}, not {self.weights!r}")
    # the tensor-core mode (docs/prompt-path.md, "Tensor cores"): the rows path's projections of float16 activations
    self.tensor_cores = bool(tensor_cores)
    if self.tensor_cores and (not self.batched or self.recurrent):
      raise errors.InvalidOption("tensor_cores", "needs the rows path's projections (decode='batched' and a dense, MoE, MLA or Gemma "
                                 f"model; this stage: {self.family}, {decode})")
    if self.tensor_cores and (self.weights in ("float32", "packed-int8") or not self.half):
      raise errors.InvalidOption("tensor_cores", "needs float16 weights (weights 'float16', 'packed' or 'quantized', and not HALF=0), "
                                 f"not {self.weights!r}" + ("" if self.half else " with HALF=0"))
    try: load_weights(self)
    except errors.PyruntimeError: raise
    except Exception as e: raise errors.ModelLoadFailed(f"{self.path}: loading blocks [{start}, {end}) failed: {type(e).__name__}: {e}") from e

    self._kv: list[Tensor] | None = None  # per block and state tensor (see _state_specs): every slot's, allocated on first use
    self._pos = [0] * slots
    self._v_start_pos = UOp.variable("start_pos", 0, cfg.max_context - 1)
    self._v_toks = UOp.variable("toks", 1, self.chunk)
    self.graph_cache = graph_cache
    self._graphs: dict[str, TinyJit] = {}  # tinygrad's prefill and T=1 decode: made on first use (see graph)
    # host -> device staging: one prefill chunk of ingress (raw embedding rows on the head, hidden states elsewhere)
    if self.is_head:
      self._stage_in = self._empty((PREFILL_CHUNK, self._embd_row_bytes), dtypes.uint8)
    else:
      self._stage_in = self._empty((1, PREFILL_CHUNK, cfg.dim), self._bdtype)
    self.rows = RowPath(self) if self.batched else None
    self.shape_ms: dict[int, float] = {}  # measured step time of each decode window (warm_up)
    self.on_capture: Callable[[str], None] | None = None  # told the graph it is about to capture (the stage: a Heartbeat)
    # MoE boundaries carry the router logits of the last MoE block before the cut: that block's function returns them too.
    # The tail has no such boundary, but its last MoE block returns them as well, for the expert load below.
    moe = [b for b in self.blk if b.config.num_experts]
    self._router_block = moe[-1] if moe and (ROUTER in self.boundary.egress.tensors or self.is_tail) else None
    # per slot, the router logits (T, experts) of the rows its last forward computed, when the egress carries them
    self.routers: dict[int, np.ndarray] = {}
    # how often that block routed a token to each expert (its top-k, chosen as tinygrad's FFNBlock chooses): the stage's
    # expert load, counted from the router logits it sends (the tail: from those of each forward), so it costs a top-k
    # over (T, experts) on the host per record
    self.expert_load = np.zeros(cfg.num_experts, np.int64) if self._router_block is not None else None
    self._router_bias: np.ndarray | None = None

  # --- loading ----------------------------------------------------------------------------------
  def _empty(self, shape: tuple[int, ...], dtype) -> Tensor:
    t = Tensor.empty(*shape, dtype=dtype, device=self.device)
    t.uop.buffer.ensure_allocated()
    return t


  # --- captured graphs ---------------------------------------------------------------------------
  def _jit(self, name: str, fxn: Callable) -> TinyJit:
    """The TinyJit of one of this stage's graphs: from the graph cache when it has it, else captured on its first call
    (every lazy one-time value, rope table and weights, is realized already, so there is no eager run first)."""
    def captured(*args: Any, **kw: Any) -> Any:  # TinyJit calls its function only while it captures, never on replay
      if self.on_capture is not None: self.on_capture(name)
      return fxn(*args, **kw)
    if self.graph_cache is None:
      j = TinyJit(captured)
      j.cnt = 1
      return j
    return self.graph_cache.jit(captured, self.graph_key(name), self.bound_tensors)

  def graph(self, kind: str) -> TinyJit:
    """tinygrad's "prefill" or "decode" graph, made on first use; on the rows path "prefill", "prefill-R" (a short
    chunk of R rows), "decode-W" (W rows) or "mixed"."""
    if self.rows is not None:
      if kind == "prefill": return self.rows.prefill_graph()
      if kind.startswith("prefill-"): return self.rows.short_graph(int(kind.split("-")[1]))
      return self.rows.mixed_graph(self.rows.slots) if kind == "mixed" else self.rows.decode_graph(int(kind.split("-")[1]))
    if (jit := self._graphs.get(kind)) is None: jit = self._graphs[kind] = self._jit(f"reference-{kind}", self._run)
    return jit

  def graph_key(self, name: str) -> dict:
    """What shapes this stage's graph `name` besides the code and the machine (pyruntime/stage/compute/graph_cache.py)."""
    from pyruntime.stage.compute.graph_cache import model_identity
    return {"graph": name, "model": model_identity(self.path, min(t.offset for t in self.header.tensors.values())),
            "blocks": [self.start, self.end], "device": self.device, "renderer": type(Device[self.device].renderer).__name__,
            "slots": self.slots, "max_context": self.config.max_context, "weights": self.weights, "boundary": self.boundary_dtype,
            "half": self.half, "rows": self.batched, "tensor_cores": self.tensor_cores}

  def bound_tensors(self) -> dict[str, Tensor]:
    """Every realized tensor of this stage a graph may read or write, by a name stable across processes: its staging
    buffers and caches first, then the weights (a buffer seen under several names is named by the first)."""
    out: dict[str, Tensor] = {"stage_in": self._stage_in}
    if self.rows is not None: out.update(self.rows.bound_tensors())
    for i, b in zip(range(self.start, self.end), self.blk, strict=True):
      out.update({f"blk.{i}.{k}": t for k, t in get_state_dict(b).items() if k.split(".")[0] not in _GRAPH_STATE})
    if self.is_tail:  # the output's column blocks (or packed buffers) too: its `weight` may only be a view of them
      out.update({"output_norm.weight": self.output_norm.weight} | {f"output.{k}": t for k, t in get_state_dict(self.output).items()})
    out.update({f"file.{n}": t for n, t in self.raw_tensors.items()})
    return out

  def projection_buffers(self) -> set[UOp]:
    """The buffers holding this stage's dense projections (column blocks, packed buffers, or with quantized weights
    the file's bytes): a kernel that reads one computes a projection (the launch report's measure of threads)."""
    lins = [lin for b in self.blk for lin in linears(b)] + ([self.output] if self.is_tail else [])
    held = [t for lin in lins for t in held_buffers(lin, lin.weight)]
    out = output_tensor_name(self.header) if self.is_tail else None
    held += [t for n, t in self.raw_tensors.items() if n.rsplit(".", 2)[-2] in PROJECTIONS or n == out]
    return {u for t in held if (u := t.uop.base).op is Ops.BUFFER}

  # --- running ----------------------------------------------------------------------------------
  def _run(self, inp: Tensor, start_pos: int | UOp, toks: int | UOp, caches: list[Tensor]) -> Tensor:
    it = iter(caches)
    for b in self.blk:
      for attr, _, _ in self._state_specs(b): setattr(b, attr, next(it))
    if self.is_head:
      x = self._embed(inp, toks)
    else:
      x = inp.float() if self._bdtype != dtypes.float32 else inp
    router: list[Tensor] = []
    def call(b: FFNBlock, h: Tensor) -> Tensor:
      if b is not self._router_block: return b(h, start_pos)
      h, logits = self._block_with_router(b, h, start_pos)
      router.append(logits)
      return h
    x = self._blocks(x, call, fresh=self._router_block)
    # .contiguous(): the JIT's output must be a buffer of its own (not a view into the (T, vocab) logits or a function call)
    if self.is_tail:
      logits = self.output(self.output_norm(x))[:, -1, :].contiguous()
      return (logits, router[0].contiguous()) if router else logits
    x = (x.cast(self._bdtype) if self._bdtype != dtypes.float32 else x).contiguous()
    return (x, router[0].contiguous()) if router else x

  @staticmethod
  def _block_with_router(b: FFNBlock, x: Tensor, start_pos: int | UOp) -> tuple[Tensor, Tensor]:
    """FFNBlock.__call__ that also returns the block's router logits (ffn_gate_inp of the normed residual, the very value
    _feed_forward routes by): the block's output is the same computation, the logits a second output of its function."""
    b._init_state(x)
    @function(precompile=True, allow_implicit=True)
    def _run(x: Tensor, start_pos: int | UOp) -> tuple[Tensor, Tensor]:
      h = x + b._attention(b.attn_norm(x), start_pos)
      n = b.ffn_norm(h)
      return (h + b._feed_forward(n)).contiguous(), b.ffn_gate_inp(n).float().contiguous()
    return _run(x, start_pos)

  def _blocks(self, x: Tensor, call: Callable[[FFNBlock, Tensor], Tensor], fresh: FFNBlock | None = None,
              each: bool = False) -> Tensor:
    """x through this stage's blocks, `call(block, x)` tracing each into a tinygrad function. Tracing a block into its
    tinygrad function costs ~0.5 s of Python; blocks with
    the same tensor types and shapes trace to the same function body, so the first one of each kind is traced and
    the others call that body with their own weights and cache (PYRUNTIME_TRACE_REUSE=0 traces every block). The block
    `fresh` (one whose function has another body: it returns the router logits too) is traced by itself.

    `each`: realize each block's output before the next block is traced (`call` realizes the fresh block's two
    outputs together). The same kernels in the same order of blocks, but scheduled block by block: tinygrad's scheduler
    runs every kernel that depends only on weights first, so in one schedule a packed matrix's staging (rows._values) of
    every block would run ahead of the first block, and the graph's memory planner would hold every block's float16
    copy at once (an arena of ~2.4x the packed weights); block by block it holds one block's."""
    traced: dict[tuple, tuple[UOp, TransformerBlock]] = {}
    for b, sig in zip(self.blk, self._block_sigs, strict=True):
      if b is fresh: x = call(b, x)
      elif _TRACE_REUSE and (t := traced.get(sig)) is not None:
        fn, a = t
        sa, sb = get_state_dict(a), get_state_dict(b)
        bufmap = {ua: ub for k in sa for ua, ub in zip(_buffers(sa[k].uop), _buffers(sb[k].uop), strict=True) if ua is not ub}
        x = Tensor(fn.replace(src=(fn.src[0], x.uop, *(u.substitute(bufmap) for u in fn.src[2:]))).gettuple(0))
      else:
        out = call(b, x)
        fn = out.uop.src[0] if out.uop.op is Ops.GETTUPLE else None
        # reuse only what has the layout we rely on: FUNCTION(body, x, *inputs)
        if fn is not None and fn.op is Ops.FUNCTION and len(fn.src) > 2 and fn.src[1] is x.uop: traced[sig] = (fn, b)
        x = out
      if each: x = x.realize()
    return x

  # --- the rows path (pyruntime/stage/compute/rows.py) ---------------------------------------------------------------
  def _check_batch(self, slots: list[int], inp: np.ndarray, positions: list[int]) -> None:
    if self.rows is None:
      raise errors.InvalidOption("decode", f"this stage decodes per stream (decode='reference'); {self.arch} ({self.family})")
    if not slots: raise errors.ActivationExtentInvalid("a batch needs at least one row")
    if len(set(slots)) != len(slots): raise errors.SlotInvalid(f"a batch names a KV slot twice: {slots}")
    for i, (slot, p) in enumerate(zip(slots, positions, strict=True)):
      self._validate(slot, inp[i:i + 1] if self.is_head else inp[i:i + 1].reshape(1, -1), p)
      if p == 0 and not self.prompt_rows_in_window: raise errors.StreamPositionInvalid(f"slot {slot}: position 0 is a prefill, not a decode step")

  def forward_batch(self, slots: list[int], inp: np.ndarray, positions: list[int]) -> Tensor:
    """One decode step for several streams at once: row i of `inp` (a token id on the head, else a (dim,) hidden state)
    is the next token of the stream in KV slot `slots[i]`, at position `positions[i]`. Returns, realized, the residual
    (rows, 1, dim) or on the tail the logits (rows, vocab) float32, where row r belongs to slot lo + r: the batch is a
    window of consecutive slots from the lowest named one (`rows` picks each slot's row; the window's other rows are
    fillers). May alias an internal buffer."""
    self._check_batch(slots, inp, positions)
    out = self.rows.decode(slots, inp, positions)
    lo = self.rows.window(slots)[0]
    self._keep_routers([(s, s - lo, 1) for s in slots])
    for slot, p in zip(slots, positions, strict=True): self._advance(slot, int(p) + 1)
    return out

  def _advance(self, slot: int, n: int) -> None:
    """The slot holds n positions now; a recurrent stage's state at a block boundary goes to `on_boundary` (the prefix
    cache's keeper, kv_blocks.KVBlocks.mark), once its kernels are done."""
    self._pos[slot] = n
    if self.on_boundary is not None and n % self.boundary_every == 0:
      self.synchronize()
      self.on_boundary(slot, n)

  def forward_mixed(self, slots: list[int], dec_inp: np.ndarray, positions: list[int], slot: int, pre_inp: np.ndarray,
                    start_pos: int, every_row: bool = False) -> tuple[Tensor, Tensor]:
    """forward_batch(slots, dec_inp, positions) and prefill_rows(slot, pre_inp, start_pos) (at most rows.MAX_ROWS rows) in
    one pass over the weights: the same results, bit for bit. Returns both, views of one internal buffer."""
    self._check_batch(slots, dec_inp, positions)
    pre_inp = self._validate(slot, pre_inp, start_pos)
    if slot in slots: raise errors.SlotInvalid(f"slot {slot} both decodes and takes prompt rows in one step")
    if self.recurrent: return self._mixed_row(slots, dec_inp, positions, slot, pre_inp, start_pos, every_row)
    dec, pre = self.rows.mixed(slots, dec_inp, positions, slot, pre_inp, start_pos, every_row)
    self._keep_routers([(s, s, 1) for s in slots] + [(slot, self.rows.slots, len(pre_inp))])  # the window is every slot
    for s, p in zip(slots, positions, strict=True): self._pos[s] = int(p) + 1
    self._pos[slot] = start_pos + len(pre_inp)
    return dec, pre

  def _mixed_row(self, slots: list[int], dec_inp: np.ndarray, positions: list[int], slot: int, pre_inp: np.ndarray,
                 start_pos: int, every_row: bool = False) -> tuple[Tensor, Tensor | list[Tensor]]:
    """A recurrent model's mixed step: the decode rows and the prompt's next row (one: a stream's recurrence takes its
    positions in order) as rows of one decode window of every slot; the prompt's row is a decode row as any other
    (`every_row`: its logits as a list of one, as prefill_rows gives a scored chunk's)."""
    if len(pre_inp) != 1: raise errors.ActivationExtentInvalid(f"a recurrent model takes one prompt row beside decode rows, got {len(pre_inp)}")
    out = self.rows.decode([*slots, slot], np.concatenate([dec_inp, pre_inp]), [*positions, start_pos], window=(0, self.slots))
    self._keep_routers([(s, s, 1) for s in [*slots, slot]])
    for s, p in zip([*slots, slot], [*positions, start_pos], strict=True): self._advance(s, int(p) + 1)
    buf = out.uop.buffer
    row = self._view(buf, (self.vocab_size,) if self.is_tail else (1, 1, self.dim), slot * (self.vocab_size if self.is_tail else self.dim))
    return out, [row] if every_row and self.is_tail else row

  @property
  def prompt_rows_in_window(self) -> bool:
    """A prompt's row is a decode row here (a recurrent model on the rows path: its recurrence takes one position at a
    time), so forward_batch takes prompt rows, position 0 included, beside decode rows: every waiting prompt advances in
    the one step (the scheduler's prompt_rows_in_window; a lone prompt goes in chunks, _prefill_recurrent)."""
    return self.recurrent and self.rows is not None

  def mixes(self, rows: int) -> bool:
    """Whether a chunk of `rows` beside decode rows costs less inside their step (forward_mixed) than apart from it:
    not when the chunk goes in short graphs' calls (RowPath.registers_rows: with packed weights only). The mixed graph, symbolic
    in the chunk's rows, rebuilds every packed weight into a scratch buffer first; a decode step and a short chunk each
    rebuild them in registers (SmolLM2, 7 decode rows beside 8 prompt rows: ~190 ms mixed, ~100 apart). Either way the
    same bits."""
    if self.recurrent: return rows == 1  # a recurrent model's prompt row rides in the decode window (_mixed_row)
    return self.rows is None or rows > self.rows.registers_rows

  def mixed_rows(self, batch: Tensor, slots: list[int]) -> list[Tensor]:
    """The rows of a forward_mixed decode result, in the order of `slots`, each a realized view (no copy)."""
    return self.rows.mixed_rows(batch, slots)

  def prefill_rows(self, slot: int, inp: np.ndarray, start_pos: int, every_row: bool = False) -> Tensor:
    """Prompt rows of the stream in `slot` at positions start_pos... through the rows path, in calls of at most
    RowPath.prompt_rows (where a prompt is cut changes no bit). Returns what `forward` returns: the residual (1, T, dim), or
    on the tail the last row's logits (vocab,); it may alias an internal buffer."""
    if self.rows is None: return self._reference_forward(slot, inp, start_pos, True)
    inp = self._validate(slot, inp, start_pos)
    T = len(inp)
    if self.recurrent: return self._prefill_recurrent(slot, inp, start_pos, every_row)
    # a chunk the short graphs take is cut into their calls (registers_rows), a longer one into the largest calls
    n = self.rows.prompt_rows if T > self.rows.registers_rows else max(self.rows.short_rows, default=T)
    if T <= n:
      out = self.rows.prefill(slot, inp, start_pos, every_row)
      self._keep_routers([(slot, 0, T)])
      self._pos[slot] = start_pos + T
      return out
    res = None if self.is_tail else self._empty((1, T, self.dim), self._bdtype)
    for s in range(0, T, n):
      out = self.rows.prefill(slot, inp[s:s + n], start_pos + s)
      self._keep_routers([(slot, 0, min(n, T - s))], after=s > 0)
      self._pos[slot] = start_pos + min(T, s + n)
      if res is not None: _copy_rows(res, out.uop.buffer, s, min(n, T - s))
    return out if res is None else res

  def _prefill_recurrent(self, slot: int, inp: np.ndarray, start_pos: int, every_row: bool = False) -> Tensor | list[Tensor]:
    """A recurrent model's prompt rows on the rows path: chunks of at most RECURRENT_ROWS (RowPath._recurrent_chunk: the
    bits of the chunk's rows fed one at a time as decode rows), each ending where the prefix cache keeps a state at the
    latest (`on_boundary`). Returns what prefill_rows returns (`every_row`, a scored chunk: at most score_rows = 1 row)."""
    T = len(inp)
    if every_row and self.is_tail and T > RECURRENT_ROWS:
      raise errors.ActivationExtentInvalid(f"every row's logits of a recurrent model: at most {RECURRENT_ROWS} rows at a time, got {T}")
    cuts, p = [], start_pos
    while p < start_pos + T:
      n = min(RECURRENT_ROWS, start_pos + T - p)
      cuts.append((p, n if self.on_boundary is None else min(n, self.boundary_every - p % self.boundary_every)))
      p += cuts[-1][1]
    res = None if self.is_tail or len(cuts) == 1 else self._empty((1, T, self.dim), self._bdtype)
    rows: list = []  # every row's logits (a verify record's, cut at a block boundary: the first cut's copied out)
    for p, n in cuts:
      s = p - start_pos
      out = self.rows.prefill(slot, inp[s:s + n], p, every_row)
      self._keep_routers([(slot, 0, n)], after=s > 0)
      self._advance(slot, p + n)
      if res is not None: _copy_rows(res, out.uop.buffer, s, n)
      if every_row and self.is_tail: rows += out if len(cuts) == 1 else [Tensor(r.numpy(), device=r.device).realize() for r in out]
    return rows if every_row and self.is_tail else out if res is None else res

  def keep_for_rewind(self, slot: int, inp: np.ndarray, start_pos: int) -> None:
    """Before a verify record's rows (speculation, docs/speculation.md) on a stage with recurrent blocks: the slot's
    state at `start_pos` and the rows, so that `rewind` can bring the state back to any position the record covers (a
    recurrent state cannot be recomputed from positions' keys and values). A copy of one stream's state per round."""
    self.synchronize()
    self._rewind[slot] = (start_pos, np.array(inp), [device_memory.slot_region(t, slot, (n,))[0].copy() for t, _, n in self.recurrent_states()])

  def rewind(self, slot: int, pos: int) -> None:
    """A speculative stream goes on from `pos`, after its last kept token. Keys and values need nothing (positions past
    it are overwritten before any row reads them); a recurrent state goes back to the verify record's start
    (keep_for_rewind) and takes the record's first pos - start rows again, the bits the record computed for them (a
    chunk = its rows one by one, docs/prompt-path.md), so the state is the one plain decoding reaches."""
    kept = self._rewind.pop(slot, None)
    if not self.recurrent or pos == self._pos[slot]: return
    if kept is None or not kept[0] <= pos < self._pos[slot]:
      raise errors.StreamPositionInvalid(f"slot {slot} holds {self._pos[slot]} positions of recurrent state and kept none to go back to {pos}")
    start, inp, states = kept
    self.synchronize()
    for (t, _, n), arr in zip(self.recurrent_states(), states, strict=True):
      region, back = device_memory.slot_region(t, slot, (n,))
      region[:] = arr
      if back is not None: back(region)
    self._pos[slot] = start
    if pos - start > REWIND_ROWS: self._prefill_recurrent(slot, inp[:pos - start], start)
    else:  # a few rows: as decode rows (a chunk costs about 6 one-row steps here; the same bits either way)
      for i in range(pos - start): self.forward_batch([slot], inp[i:i + 1], [start + i])
    self.synchronize()

  def _keep_routers(self, parts: list[tuple[int, int, int]], after: bool = False) -> None:
    """After a rows-path call: for each (slot, first row, rows) of its graph, those rows' router logits become the
    slot's (its egress record's router_logits; `after`: appended to the slot's earlier chunks'), or on the tail are
    counted into the expert load. Nothing for a stage without a router block."""
    r = self.rows.router
    if r is None: return
    for slot, at, n in parts:
      if self.is_tail: self._count_routes(r[at:at + n])
      else: self.routers[slot] = np.concatenate([self.routers[slot], r[at:at + n]]) if after else r[at:at + n]

  @property
  def score_rows(self) -> int:
    """The most prompt rows a chunk can have when every row's logits are wanted (a scored prompt: the tail's graph keeps
    the last ROW_UNIT rows' logits; a recurrent model's scored rows go one at a time, decode rows); 0: this stage cannot
    give every row's logits (tinygrad's path)."""
    if self.rows is None: return 0
    return 1 if self.recurrent else ROW_UNIT

  @property
  def max_chunk(self) -> int:
    """The most prompt rows one forward computes at once: the rows path's MAX_ROWS, else tinygrad's chunk; a recurrent
    model's rows path RECURRENT_ROWS (its chunk graph's rows, _prefill_recurrent)."""
    if self.rows is not None and self.recurrent: return RECURRENT_ROWS
    return MAX_ROWS if self.rows is not None else self.chunk

  @property
  def min_chunk(self) -> int:
    """The fewest prompt rows worth a chunk: the rows path sizes chunks in ROW_UNITs (with packed weights a chunk of
    fewer runs in a short graph, RowPath.short_rows)."""
    return ROW_UNIT if self.rows is not None and not self.recurrent else 1

  def batch_window(self, slots: list[int]) -> tuple[int, int]:
    """(first slot, rows) of the decode window that holds `slots`."""
    return self.rows.window(slots)

  def _embed(self, raw: Tensor, toks: int | UOp) -> Tensor:
    """Rows of the token embedding from their raw GGML bytes, with the reference's arithmetic: dequantise, cast to float16,
    then .float(). (nn.Embedding's one-hot masked sum is rewritten by tinygrad into a plain load: values, -0.0 included,
    come through unchanged, which the tests check bit for bit.)"""
    n = PREFILL_CHUNK * self.dim
    w = ggml_data_to_tensor(raw.flatten(), n, self._embd_info.ggml_type).reshape(PREFILL_CHUNK, self.dim)
    if self.half: w = w.cast("float16")
    return w[:toks].reshape(1, toks, self.dim).float()

  # --- per-stream state: one batched tensor per block and state, a contiguous region per slot --------
  @staticmethod
  def _state_specs(b: FFNBlock) -> list[tuple[str, tuple[int, ...], bool]]:
    """(attribute, one stream's shape as the block's _init_state makes it for B=1, zeroed for a new stream): the KV cache,
    MLA's single latent cache, or the recurrent block's conv and recurrent state (which a stream starts from zero)."""
    c = b.config
    if isinstance(b, GatedDeltaNetBlock):
      return [("conv_state", (1, b.ssm_conv_kernel - 1, b.conv_channels), True),
              ("recurrent_state", (1, b.num_v_heads, b.head_v_dim, b.head_v_dim), True)]
    if isinstance(b, MLATransformerBlock): return [("cache_k", (1, 1, c.max_context, c.kv_lora_rank + c.rope_dim), False)]
    return [("cache_kv", (2, 1, c.n_kv_heads, c.max_context, c.head_dim), False)]

  def _specs(self) -> list[tuple[str, tuple[int, ...], bool]]: return [sp for b in self.blk for sp in self._state_specs(b)]

  def _kv_caches(self) -> list[Tensor]:
    if self._kv is None:
      # the reference's state tensors are made per block in the default float dtype with B first (the KV cache: 2, B, ...);
      # with the slot first, each slot's region is exactly that tensor for B=1, so the JITs run on a view of it unchanged.
      # A device without views (OpenCL) gets a tensor per slot instead: the JITs write into it in place
      per = 1 if device_memory.has_views(self.device) else self.slots
      self._kv = []
      for _, shape, zero in self._specs() * per:
        one = list(shape)
        one.remove(1)
        self._kv.append(t := self._empty((self.slots // per, *one), dtypes.default_float))
        if zero: t.uop.buffer.copyin(memoryview(bytearray(t.nbytes())))
    return self._kv

  def _slot_caches(self, slot: int) -> list[Tensor]:
    specs = self._specs()
    if not device_memory.has_views(self.device):
      return [t.reshape(shape) for t, (_, shape, _) in zip(self._kv_caches()[slot * len(specs):(slot + 1) * len(specs)], specs, strict=True)]
    return [device_memory.view(kv.uop.buffer, shape, slot * prod(shape)) for kv, (_, shape, _) in zip(self._kv_caches(), specs, strict=True)]

  def position_states(self) -> list[tuple[Tensor, int, tuple[int, ...], int]] | None:
    """Every state tensor a stream's positions live in, for the prefix cache (pyruntime/stage/compute/kv_blocks.py): (the tensor, its
    slots, one slot's shape, the position axis in it); a recurrent block's state is not a function of positions: on the
    rows path it goes with a prefix as a snapshot (recurrent_states), on tinygrad's path nowhere (None: no prefix)."""
    if self.recurrent and self.rows is None: return None
    if self.rows is None and not device_memory.has_views(self.device): return None  # a tensor per slot (_kv_caches): not yet
    if self.rows is not None: return self.rows.position_states()
    out = []
    for t, (_, shape, _) in zip(self._kv_caches(), self._specs(), strict=True):
      one = list(shape)
      one.remove(1)  # the batch axis, as _kv_caches drops it
      out.append((t, self.slots, tuple(one), one.index(self.config.max_context)))
    return out

  def recurrent_states(self) -> list[tuple[Tensor, int, int]]:
    """The recurrent blocks' state tensors, for the prefix cache's snapshots: (tensor, slots, one slot's elements); none
    without recurrent blocks (or on tinygrad's path, which keeps no prefix)."""
    return self.rows.recurrent_states() if self.recurrent and self.rows is not None else []

  def set_position(self, slot: int, n: int) -> None:
    """The slot holds n positions now (its first n were copied in from the prefix cache)."""
    self._check_slot(slot)
    self._pos[slot] = n
    if self.rows is not None: self.rows.reached(slot, n)

  def _zero_state(self, slot: int) -> None:
    """A new stream on a recurrent stage starts from zero state (the reference's _state_reset_ops)."""
    for t, (_, _, zero) in zip(self._slot_caches(slot), self._specs(), strict=True):
      if zero: t.uop.buffer.copyin(memoryview(bytearray(t.nbytes())))

  def state_tensors(self) -> list[Tensor]:
    """The buffers of every stream's state already allocated: the rows path's caches (keys, values, latent caches,
    recurrent states) and tinygrad's path's (none before their first use)."""
    rows = [t for kv in (self.rows._caches or []) for t in kv if t is not None] if self.rows is not None else []
    return rows + list(self._kv or [])

  @property
  def kv_bytes(self) -> int:
    """Device bytes of the KV caches (every slot's, allocated together on first use)."""
    return sum(t.nbytes() for t in self._kv or []) + (self.rows.cache_bytes if self.rows is not None else 0)

  def reset_slot(self, slot: int) -> None:
    """Forget a stream: the slot's next record must start at position 0 (its cache is overwritten, never read stale)."""
    self._check_slot(slot)
    self._pos[slot] = 0
    if self.rows is not None: self.rows.release(slot)  # a CPU's pages of the slot's cache back to the system
    if self.recurrent and self.rows is not None: self.rows.zero_state(slot)
    elif self.recurrent and self._kv is not None: self._zero_state(slot)

  def position(self, slot: int) -> int:
    self._check_slot(slot)
    return self._pos[slot]

  def _check_slot(self, slot: int) -> None:
    if not isinstance(slot, (int, np.integer)) or isinstance(slot, bool) or not 0 <= slot < self.slots:
      raise errors.SlotInvalid(f"KV slot {slot!r} is not one of this stage's {self.slots} slots")

  def check_rows(self, inp: np.ndarray) -> None:
    """Refuse, by name, ingress this stage cannot compute: the wrong dtype or shape, token ids outside the vocabulary."""
    if not isinstance(inp, np.ndarray): raise errors.BoundarySchemaMismatch(f"ingress must be a numpy array, got {type(inp).__name__}")
    if self.is_head:
      if inp.dtype != np.uint32: raise errors.BoundarySchemaMismatch(f"the head takes uint32 token ids, got {inp.dtype}")
      if inp.ndim != 1 or inp.shape[0] == 0:
        raise errors.ActivationExtentInvalid(f"the head takes a non-empty (T,) array of token ids, got shape {inp.shape}")
      if (bad := int(inp.max())) >= self.vocab_size:
        raise errors.TokenIdInvalid(f"token id {bad} is outside the vocabulary of {self.vocab_size}")
    else:
      if inp.dtype != DTYPES[self.boundary_dtype]:
        raise errors.BoundarySchemaMismatch(f"this stage takes {self.boundary_dtype} hidden states, got {inp.dtype}")
      if inp.ndim != 2 or inp.shape[0] == 0 or inp.shape[1] != self.dim:
        raise errors.ActivationExtentInvalid(f"this stage takes (T, {self.dim}) hidden states, got shape {inp.shape}")

  def _validate(self, slot: int, inp: np.ndarray, start_pos: int) -> np.ndarray:
    self._check_slot(slot)
    self.check_rows(inp)
    if not isinstance(start_pos, (int, np.integer)) or start_pos < 0 or start_pos > self._pos[slot]:
      raise errors.StreamPositionInvalid(f"slot {slot} holds {self._pos[slot]} positions; a record cannot start at {start_pos!r}")
    if self.recurrent and start_pos != self._pos[slot]:
      raise errors.StreamPositionInvalid(f"slot {slot} holds {self._pos[slot]} positions of recurrent state, which cannot go back to {start_pos}")
    if start_pos + inp.shape[0] > self.context_length:
      raise errors.ContextLengthExceeded(int(start_pos + inp.shape[0]), self.context_length)
    return np.ascontiguousarray(inp)

  def _stage_chunk(self, inp: np.ndarray, s: int, nt: int) -> None:
    """One host->device copy of a chunk of the ingress into the staging buffer."""
    buf = self._stage_in.uop.buffer
    if self.is_head:
      rows = self._embd_rows[inp[s:s + nt]]  # gather the raw GGML rows from the mmap'd file
      device_memory.write(buf, rows)
    else:
      device_memory.write(buf, inp[s:s + nt])

  def forward(self, slot: int, inp: np.ndarray, start_pos: int, *, prefill: bool | None = None) -> Tensor:
    """Run this stage's blocks over `inp` at positions [start_pos, start_pos+T) of the slot's stream.

    head: `inp` is (T,) uint32 token ids; otherwise (T, dim) hidden states in the boundary dtype (a view of shared memory
    is fine: it is copied to the device once and not kept). Returns, realized: the residual (1, T, dim) in the boundary
    dtype, or on the tail the last position's logits (vocab,) float32. The returned tensor may alias this stage's
    output buffer: consume it (output_into / sample) before the next forward call.

    On the rows path every record is prompt rows (a decode token computes the same bits as a prompt row: rows.py).
    Otherwise `prefill` picks tinygrad's path: the chunked prefill JIT (symbolic T, a causal mask) or the T=1 decode
    JIT; by default a record of more than one token, or one at position 0, is a prefill, as in `Transformer.generate`."""
    if self.rows is not None: return self.prefill_rows(slot, inp, start_pos)
    return self._reference_forward(slot, inp, start_pos, prefill)

  def _reference_forward(self, slot: int, inp: np.ndarray, start_pos: int, prefill: bool | None) -> Tensor:
    inp = self._validate(slot, inp, start_pos)
    T, caches = inp.shape[0], self._slot_caches(slot)
    if prefill is None: prefill = T > 1 or start_pos == 0
    if not prefill and T != 1: raise errors.ActivationExtentInvalid(f"a decode step takes one token, got {T}")
    multi = T > self.chunk and not self.is_tail
    res = self._empty((1, T, self.dim), self._bdtype) if multi else None
    E = self.config.num_experts
    routed = self._empty((1, T, E), dtypes.float32) if multi and self._router_block is not None else None
    for s in range(0, T, self.chunk):
      nt = min(self.chunk, T - s)
      self._stage_chunk(inp, s, nt)
      sp = self._v_start_pos.bind(int(start_pos + s))
      if prefill:
        toks = self._v_toks.bind(nt)
        ret = self.graph("prefill")(self._stage_in if self.is_head else self._stage_in[:, :toks], sp, toks, caches)
      else:
        ret = self.graph("decode")(self._stage_in if self.is_head else self._stage_in[:, :1], sp, 1, caches)
      self._pos[slot] = int(start_pos + s + nt)
      ret, *rl = ret if isinstance(ret, tuple) else (ret,)
      out = ret.uop.buf_uop.buffer
      if rl and self.is_tail: self._count_routes(self._wrap(rl[0].uop.buf_uop.buffer, (1, nt, E)).numpy().reshape(nt, E))
      elif rl: self.routers[slot] = self._wrap(rl[0].uop.buf_uop.buffer, (1, T, E)).numpy().reshape(T, E)
      if res is not None:
        # a prompt longer than one chunk: the JIT reuses its output buffers, so move each chunk's rows out now
        _copy_rows(res, out, s, nt)
        if routed is not None: _copy_rows(routed, rl[0].uop.buf_uop.buffer, s, nt)
    if routed is not None: self.routers[slot] = routed.numpy().reshape(T, E)
    if res is not None: return res
    return self._wrap(out, (self.vocab_size,) if self.is_tail else (1, T, self.dim))

  def synchronize(self) -> None:
    """Wait for this stage's queued kernels: a forward returns once its kernels are queued (tinygrad runs them on the
    device's own queue), so whoever times a forward must wait for them."""
    Device[self.device].synchronize()

  def _wrap(self, buf: Buffer, shape: tuple[int, ...]) -> Tensor: return self._view(buf, shape)

  @staticmethod
  def _view(buf: Buffer, shape: tuple[int, ...], offset: int = 0) -> Tensor:
    """A realized tensor over `shape` elements of `buf` from element `offset` on (no copy where the device views)."""
    return device_memory.view(buf, shape, offset)

  def warm_up(self, every_window: bool = True, on_graph: Callable[[str, str, float, bool], None] | None = None) -> list[int]:
    """Make every graph a stream can need ready now, so none waits for a capture mid-flight: on the rows path the prefill
    and the decode windows (all of them, or with every_window=False the one-row window a lone stream uses), else
    tinygrad's prefill chunk and T=1 decode. Each comes from the graph cache when it has it, else is captured (and kept
    there). `on_graph(kind, "preparing" | "ready", seconds, from the cache)` reports each. Times the decode windows
    (shape_ms) when it makes all of them. Leaves every slot empty. Returns the decode windows' row counts."""
    report = on_graph or (lambda kind, what, seconds, cached: None)
    zeros = np.zeros(1, np.uint32) if self.is_head else np.zeros((1, self.dim), DTYPES[self.boundary_dtype])

    def run(kind: str, call: Callable[[], Any]) -> None:
      report(kind, "preparing", 0.0, False)
      t0 = time.perf_counter()
      cached = self.graph(kind).cnt >= 2  # loaded from the graph cache (else its first call captures it)
      call()
      report(kind, "ready", time.perf_counter() - t0, cached)

    def step(rows: int) -> float:
      t0 = time.perf_counter()
      self.forward_batch(list(range(rows)), np.repeat(zeros, rows, axis=0), [1] * rows).numpy()
      for slot in range(rows): self._pos[slot] = 1
      return time.perf_counter() - t0
    self.reset_slot(0)
    shapes: list[int] = []
    if self.rows is None:
      run("prefill", lambda: self.forward(0, zeros, 0, prefill=True))
      run("decode", lambda: self.forward(0, zeros, 1, prefill=False))
    else:
      short = RECURRENT_SHORT if self.recurrent else self.rows.short_rows  # (a recurrent model's chunks: 8 and 16 rows)
      # the symbolic prefill graph, unless every prompt goes in short graphs' calls (RowPath.prompt_rows: a MoE block's
      # experts too large to stage): there this run would only run the short graphs below once more
      if not self.recurrent and self.rows.prompt_rows > max(short, default=0):
        # (the fewest rows it takes, given it directly: prefill_rows cuts a chunk up to RowPath.registers_rows into short
        # calls, and a longer one here would only cost the warm-up time)
        run("prefill", lambda: self.rows.prefill(0, np.repeat(zeros, short[-1] + 1 if short else 1, axis=0), 0))
      for R in short:
        self.reset_slot(0)
        run(f"prefill-{R}", lambda R=R: self.prefill_rows(0, np.repeat(zeros, R, axis=0), 0))
      shapes = sorted({self.rows.window(list(range(n)))[1] for n in range(1, self.slots + 1)}) if every_window else [1]
      for slot in range(self.slots): self._pos[slot] = 1
      for rows in shapes: run(f"decode-{rows}", lambda rows=rows: step(rows))
      if every_window: self.shape_ms = {rows: 1e3 * sorted(step(rows) for _ in range(3))[1] for rows in shapes}
      if every_window and self.slots > 1 and not self.recurrent and self.mixes(MAX_CHUNK):  # a prompt's chunk beside decoding streams: the mixed step
        last = self.slots - 1
        self.reset_slot(last)
        run("mixed", lambda: self.forward_mixed(list(range(last)), np.repeat(zeros, last, axis=0), [1] * last, last, zeros, 0))
    for slot in range(self.slots): self.reset_slot(slot)
    if self.expert_load is not None: self.expert_load[:] = 0  # the warm-up's zeros were routed too: count only streams
    return shapes

  def batch_rows(self, batch: Tensor, slots: list[int]) -> list[Tensor]:
    """The rows of a forward_batch(slots) result, in the order of `slots`, each a realized view of its own (no copy)."""
    return self.rows.rows_of(batch, slots)

  @property
  def row_bytes(self) -> int:
    """Bytes of one token's egress record: the residual in the boundary dtype, and what else the family's boundary carries."""
    return self.boundary.egress.token_bytes

  def egress_into(self, t: Tensor, dst: memoryview, start_pos: int, slot: int) -> int:
    """One egress record of the forward that returned `t` (positions start_pos... of the stream in `slot`): the
    boundary's tensors one after the other (docs/wire-format.md): hidden_states, then router_logits (the slot's rows of
    its last forward; zeros when no MoE block precedes the cut: glm4moe's and deepseek2's leading dense blocks), then
    mla_position_state. Returns the bytes written."""
    mv = flat_mv(memoryview(dst))
    off, T = self.output_into(t, mv), prod(t.shape) // self.dim  # (1, T, dim), or a decode row (1, dim)
    for name, (dt, w) in list(self.boundary.egress.tensors.items())[1:]:
      n = T * w * DTYPES[dt].itemsize
      if len(mv) < off + n: raise errors.OutputExtentInvalid(f"{off + n} bytes do not fit in a span of {len(mv)}")
      if name == ROUTER and (r := self.routers.get(slot)) is not None:
        if r.nbytes != n: raise errors.OutputExtentInvalid(f"slot {slot}: router logits of {r.shape[0]} rows for a record of {T}")
        mv[off:off + n] = memoryview(np.ascontiguousarray(r, "<f4")).cast("B")
        self._count_routes(r)
      elif name == ROUTER: mv[off:off + n] = bytes(n)
      elif name == MLA_POS: mv[off:off + n] = np.arange(start_pos, start_pos + T, dtype="<u4").tobytes()
      off += n
    return off

  def _count_routes(self, logits: np.ndarray) -> None:
    """Add a record's routing to expert_load: top-k of the logits, or with an expert bias (glm4moe, deepseek v3) of
    sigmoid(logits) + bias, as FFNBlock._feed_forward selects."""
    b = self._router_block
    if hasattr(b, "exp_probs_b"):
      if self._router_bias is None: self._router_bias = b.exp_probs_b["bias"].float().numpy().reshape(-1)
      logits = 1.0 / (1.0 + np.exp(-logits)) + self._router_bias
    k = b.config.num_experts_per_tok
    np.add.at(self.expert_load, np.argpartition(-logits, k - 1, axis=-1)[:, :k].reshape(-1), 1)

  def output_into(self, t: Tensor, dst: memoryview) -> int:
    """Copy a realized tensor's bytes into a writable buffer (a ring span) with no intermediate host copy.
    Returns the number of bytes written (dst may be larger)."""
    if not t.uop.is_realized: t = t.contiguous().realize()
    buf = t.uop.buffer
    mv = flat_mv(memoryview(dst))
    if mv.readonly: raise ValueError("output_into needs a writable buffer")
    if len(mv) < buf.nbytes: raise errors.OutputExtentInvalid(f"{buf.nbytes} bytes do not fit in a span of {len(mv)}")
    buf.copyout(mv[:buf.nbytes])
    return buf.nbytes

  def __repr__(self) -> str:
    return (f"StageModel({self.arch}, blocks [{self.start}, {self.end}) of {self.num_blocks}, device={self.device}, "
            f"resident={self.resident_bytes / 1e6:.1f} MB, boundary={self.boundary_dtype})")


__all__ = ["StageModel", "model_config", "PREFILL_CHUNK"]
