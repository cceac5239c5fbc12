"""The launch plan: everything the launcher decides before a stage exists (the split, each stage's device, weights form
and role, the context length, the tokenizer), from the GGUF header, the launch options and the memory available.
A pure function of those: tested without a process (tests/unit/test_launch_plan.py), and free of tinygrad and numpy.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

from pyruntime import errors
from pyruntime.engine.prefix_cache import BLOCK, prefix_states
from pyruntime.modelfile.gguf import GGUFHeader, packed_nbytes, packed_types
from pyruntime.options import PREFILL_SHARE, PREFIX_CACHE_TOKENS, STALL_CAPTURE_TIMEOUT_S, STALL_TIMEOUT_S, check_launch
from pyruntime.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class LaunchOptions:
  """Every launch option (the Launcher's keywords), checked when made: InvalidOption naming the first bad one
  (options.check_launch for those the CLI and the stage share). Defaults as options.py's."""
  stages: int = 2
  split: Sequence[tuple[int, int]] | None = None
  devices: str | Sequence[str] | None = None
  boundary_dtype: str = "float32"
  max_streams: int = 8
  decode: str = "batched"
  weights: str = "auto"
  warmup: bool = False                  # capture every batch shape's kernels at start (a server's choice), not on first use
  max_context: int | None = None
  prefill_share: float = PREFILL_SHARE
  prefix_cache: int = PREFIX_CACHE_TOKENS
  kv_budget: int = 0                    # positions all streams' keys and values may hold (0: max_streams whole contexts)
  graph_cache: bool = True              # stages load their captured graphs from disk and keep new ones (graph_cache.py)
  stall_timeout: float = STALL_TIMEOUT_S
  stall_capture_timeout: float = STALL_CAPTURE_TIMEOUT_S
  speculative: str = "off"              # off | ngram | model:PATH (docs/speculation.md)
  draft_tokens: int = 7
  placement: str = "local"              # local | ray (docs/hosts.md)
  ray_address: str | None = None
  hosts: int | None = None
  cache_dir: str | None = None          # where downloaded models go (source.py)
  stage_env: dict[str, str] = field(default_factory=dict)  # added to every stage process's environment
  load_timeout_s: float = 900.0
  tensor_cores: str = "off"             # on: the projections' inputs in float16, for a GPU's tensor cores (docs/prompt-path.md)

  def __post_init__(self) -> None:
    check_launch(boundary_dtype=self.boundary_dtype, max_streams=self.max_streams, decode=self.decode, weights=self.weights,
                 tensor_cores=self.tensor_cores,
                 prefill_share=self.prefill_share, prefix_cache=self.prefix_cache, kv_budget=self.kv_budget, stall_timeout=self.stall_timeout,
                 stall_capture_timeout=self.stall_capture_timeout, speculative=self.speculative, draft_tokens=self.draft_tokens)
    if not isinstance(self.graph_cache, bool): raise errors.InvalidOption("graph_cache", f"must be true or false, got {self.graph_cache!r}")
    if self.placement not in ("local", "ray"): raise errors.InvalidOption("placement", f"must be local or ray, not {self.placement!r:.80}")
    if self.placement == "local" and (self.ray_address is not None or self.hosts is not None):
      raise errors.InvalidOption("placement", "ray_address and hosts need placement='ray'")
    if self.tensor_cores == "on" and (self.decode == "reference" or self.weights in ("float32", "packed-int8")):
      raise errors.InvalidOption("tensor_cores", "needs decode='batched' and float16 values of the weights "
                                                 f"(weights 'auto', 'packed', 'float16' or 'quantized'), not {self.decode!r} and {self.weights!r}")

  @property
  def draft_model(self) -> str | None:
    """The draft model's source, with speculative="model:PATH"."""
    return self.speculative.removeprefix("model:") if self.speculative.startswith("model:") else None


LAUNCH_FIELDS = frozenset(f.name for f in fields(LaunchOptions))  # the Launcher's keywords that are launch options


@dataclass(frozen=True)
class LaunchPlan:
  path: Path
  header: GGUFHeader
  options: LaunchOptions
  model_name: str
  split: list[tuple[int, int]]
  devices: list[str]
  weights: list[str]        # per stage: how it keeps its weights (options.WEIGHT_MODES)
  micro_batches: int
  context_length: int
  tokenizer: Tokenizer
  dim: int
  template: str
  recipe: str               # names what produced a result (recipe_digest)
  kv_budget: int = 0        # positions the open streams may hold (options.kv_budget, or set to fit memory: fit_context)

  @property
  def num_blocks(self) -> int: return self.header.num_blocks

  @property
  def vocab_size(self) -> int: return self.tokenizer.vocab_size

  def role(self, i: int) -> dict[str, Any]:
    """Stage i's ConfigureRole arguments (docs/control-channel.md)."""
    o, (start, end) = self.options, self.split[i]
    return dict(stage=i, start=start, end=end, slots=o.max_streams, boundary_dtype=o.boundary_dtype, max_context=self.context_length,
                decode=o.decode, warmup=o.warmup, weights=self.weights[i], graph_cache=o.graph_cache, micro_batches=self.micro_batches,
                prefill_share=o.prefill_share, prefix_blocks=o.prefix_cache // BLOCK, block_size=BLOCK,
                prefix_states=prefix_states(o.prefix_cache), tensor_cores=o.tensor_cores == "on")


def recipe_digest(model: str, split: Sequence[tuple[int, int]], dtype: str, template: str) -> str:
  """Names what produced a result: model, split, boundary dtype and chat template."""
  return hashlib.sha256(json.dumps([model, [list(r) for r in split], dtype, template]).encode()).hexdigest()[:16]


def packed_bytes(header: GGUFHeader, weights: str = "packed", names: Sequence[str] | None = None) -> int:
  """What a CPU stage holds of the model (or of its tensors `names`) with weights="packed" (or "packed-all", "packed-int8"):
  every matrix and every MoE block's experts (`*_exps`) of a type that mode packs as codes and scales (about the file's
  bytes; packed-int8's matrices hold 5- and 6-bit codes a byte each), two bytes an element of the rest (float16)."""
  kept = packed_types(weights)
  def packs(name: str, t: Any) -> bool: return t.ggml_type in kept and (len(t.dims) == 2 or len(t.dims) == 3 and "_exps." in name)
  tensors = header.tensors.items() if names is None else ((n, header.tensors[n]) for n in names)
  wide = weights == "packed-int8"  # (its matrices' 5- and 6-bit codes a byte each; a MoE block's experts stay split)
  return sum(packed_nbytes(t.ggml_type, math.prod(t.dims), wide and len(t.dims) == 2) if packs(n, t) else 2 * math.prod(t.dims)
             for n, t in tensors)


def held_bytes(header: GGUFHeader, names: Sequence[str], weights: str) -> int:
  """Bytes a stage holds of the tensors `names` in weights mode `weights`: packed as packed_bytes, float16 and float32
  2 and 4 bytes an element, "quantized" (tinygrad's own) the file's bytes."""
  if weights.startswith("packed"): return packed_bytes(header, weights, names)
  per = {"float16": 2, "float32": 4}.get(weights)
  return sum(per * math.prod(header.tensors[n].dims) if per else header.tensors[n].nbytes for n in names)


CONTEXT_STEP = 256  # a default context cut to fit memory is a multiple of this


def memory_need(header: GGUFHeader, options: LaunchOptions, split: Sequence[tuple[int, int]], devices: Sequence[str],
                weights: Sequence[str], context: int, kv_budget: int | None = None) -> dict[str, int]:
  """Host bytes the plan's CPU stages hold once every stream slot is at `context` positions: their weights, their keys
  and values (reserved for max_streams + 1 slots of the context plus one prompt chunk's padding rows, as
  stage/compute/rows.py does; on a CPU the pages become resident as streams reach them; with recurrent blocks each
  slot's state too), and the prefix cache's pool (every stage's, at its token budget; with recurrent blocks also the
  two states each slot keeps aside for it, kv_blocks.KVBlocks.mark, in host memory whatever the device). A GPU stage's
  weights and caches are on its GPU, not counted. Graph buffers and the interpreters (a few hundred MB a stage) come on
  top. With a kv_budget (`kv_budget`, else the options') the keys and values written are at most the budget's
  positions, plus in every slot the rest of a page of keys (which hold a head's positions side by side:
  protocol.PAGE_POSITIONS) and a chunk's padding rows."""
  from pyruntime.devices import parse_device
  from pyruntime.modelfile.plan import kv_bytes_per_position, prefix_cache_bytes_per_token, recurrent_state_bytes, stage_tensor_names
  from pyruntime.protocol import MAX_CHUNK, PAGE_POSITIONS
  host = [i for i, d in enumerate(devices) if parse_device(d).base == "CPU"]
  slots = options.max_streams + 1
  positions = slots * (context + MAX_CHUNK + 31)
  budget = options.kv_budget if kv_budget is None else kv_budget
  if budget: positions = min(positions, budget + slots * (PAGE_POSITIONS + MAX_CHUNK + 31))
  kept = 2 * options.max_streams * recurrent_state_bytes(header, 0, header.num_blocks) if options.prefix_cache >= BLOCK else 0
  return {"weights": sum(held_bytes(header, list(dict.fromkeys(stage_tensor_names(header, *split[i]))), weights[i]) for i in host),
          "kv": sum(kv_bytes_per_position(header, *split[i]) * positions + recurrent_state_bytes(header, *split[i]) * slots for i in host),
          "prefix_cache": options.prefix_cache * prefix_cache_bytes_per_token(header) + kept}


def fit_context(header: GGUFHeader, options: LaunchOptions, split: Sequence[tuple[int, int]], devices: Sequence[str],
                weights: Sequence[str], memory: int) -> tuple[int, int]:
  """The context the stages are given and the kv_budget the driver keeps (0: none), from what the stages would hold
  (memory_need) against the host memory available now. max_context (at most the file's; none given: the file's) when
  every slot's keys and values at it fit. When they do not and streams can be preempted (the rows path), the context
  stays and a budget is set: the positions that fit (Launcher emits KVBudgetSet); where not even one context fits, or
  on tinygrad's own decode path, a given max_context is refused by name with the numbers and a default one cut to the
  largest multiple of CONTEXT_STEP that fits (Launcher emits ContextReduced; with a budget, the budget is that
  context). A kv_budget given is kept, and refused by name where it does not fit. Stages on other hosts
  (placement="ray") are not checked here."""
  from pyruntime.modelfile.plan import ROWS_ARCHS
  most = int(header.get("context_length"))
  want = int(min(options.max_context or most, most))
  if options.kv_budget and options.kv_budget < want:  # a stream alone must fit in the budget: it is never preempted then
    if options.max_context: raise errors.InvalidOption("kv_budget", f"{options.kv_budget} positions cannot hold one stream at "
                                                       f"max_context={want}: give at least the context, or 0 for none")
    want = options.kv_budget
  def need(ctx: int, budget: int | None = None) -> int: return sum(memory_need(header, options, split, devices, weights, ctx, budget).values())
  if options.placement != "local" or need(want) <= memory: return want, options.kv_budget
  gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
  if options.kv_budget:
    parts = memory_need(header, options, split, devices, weights, want)
    raise errors.InvalidOption("kv_budget", f"a budget of {options.kv_budget} positions needs {gib(need(want))} of host memory (weights "
                               f"{gib(parts['weights'])}, keys and values {gib(parts['kv'])}, prefix cache {gib(parts['prefix_cache'])}) "
                               f"and {gib(memory)} is available: lower kv_budget, max_streams or prefix_cache")
  if options.decode != "reference" and header.arch in ROWS_ARCHS:
    # the budget's keys and values grow one position at a time past the per-slot slack (memory_need): solve for it
    fixed, per = need(want, 1), need(want, 2) - need(want, 1)
    budget = 0 if per <= 0 or fixed > memory else ((memory - fixed) // per + 1) // BLOCK * BLOCK
    if budget >= want: return want, budget
    fits = budget // CONTEXT_STEP * CONTEXT_STEP
    if options.max_context is None and fits >= CONTEXT_STEP: return fits, fits
  else:
    fixed, per = need(0), need(1) - need(0)
    fits = 0 if per <= 0 or fixed > memory else (memory - fixed) // per // CONTEXT_STEP * CONTEXT_STEP
    if options.max_context is None and fits >= CONTEXT_STEP: return min(fits, want), 0
  parts = memory_need(header, options, split, devices, weights, want)
  advice = (f"at most max_context={fits} fits" if fits >= CONTEXT_STEP else
            "lower max_streams or prefix_cache, keep smaller weights (weights='quantized'), or put stages on GPUs")
  raise errors.InvalidOption("max_context", f"a context of {want} with max_streams={options.max_streams} needs {gib(need(want))} of "
                             f"host memory (weights {gib(parts['weights'])}, keys and values {gib(parts['kv'])}, prefix cache "
                             f"{gib(parts['prefix_cache'])}) and {gib(memory)} is available: {advice}")


# CPU renderers that compile with clang (loop_schedules' vector rules are written for them); tinygrad's own X86 backend,
# what a machine without clang gets (devices.cpu_device), cannot encode packed weights' integer shifts (SAR) and crashes
# on float16 conversions: there float32 runs (a decode step 1.4x clang's, a 256-row prompt chunk 9.5x) and quantized
# 10x slower still (bench/results/2026-12-04-packed-weights.md)
CLANG_RENDERERS = ("", "CLANG", "CLANGJIT")


def weights_for(options: LaunchOptions, arch: str, device: str, copy_fits: bool, float32_fits: bool = False) -> str:
  """How a stage on `device` keeps its weights. "auto": tinygrad's own "quantized" for reference decoding (its exact
  tokens) and on accelerators; on a CPU, "packed" (Q4_0/Q4_1/Q8_0 projections and routed experts as the file's blocks,
  dequantised in the kernels to float32 mode's bits; any other tensor as float16, which gives the same bits) when that copy of the whole
  model takes at most half of the memory available now, every stage sharing it: at the file's size, as fast as float16
  for one stream and faster for several (bench/results/2026-12-04-packed-weights.md). On a CPU without clang (CPU:X86)
  "float32" when that copy fits, else "quantized"; "packed" and "float16" are refused there by name."""
  from pyruntime.devices import parse_device
  from pyruntime.modelfile.plan import ROWS_ARCHS
  spec = parse_device(device)
  x86 = spec.base == "CPU" and spec.renderer not in CLANG_RENDERERS
  if x86 and options.weights in ("packed", "packed-all", "packed-int8", "float16"):
    raise errors.InvalidOption("weights", f"{options.weights!r} needs clang's CPU kernels; {device} runs 'float32' or 'quantized'")
  if options.weights == "packed-int8" and (spec.base != "CPU" or options.decode == "reference"):
    raise errors.InvalidOption("weights", f"'packed-int8' runs on a CPU's rows path (integer kernels for clang), not {device} with "
                               f"decode {options.decode!r}")
  if options.weights != "auto": return options.weights
  if options.decode == "reference" or spec.base != "CPU" or arch not in ROWS_ARCHS:
    return "quantized"  # the other families decode with tinygrad's own kernels, one stream at a time (ROWS_ARCHS)
  if x86: return "quantized" if options.tensor_cores == "on" or not float32_fits else "float32"
  return "packed" if copy_fits else "quantized"


def preflight(plan: LaunchPlan) -> None:
  """The one check before any stage is spawned, of what the plan (which cannot know it: it is a pure function of the file
  and the options) would meet on this host and can be refused without loading the model or tinygrad: devices that
  cannot open here (devices.check_opens), a file whose architecture no stage runs (modelfile.plan.check_architecture:
  UnsupportedArchitecture; its tokenizer was read while planning). A refusal names its field. The launcher runs it
  right after planning."""
  from pyruntime.devices import check_opens
  from pyruntime.modelfile.plan import check_architecture
  check_architecture(plan.header)
  for d in dict.fromkeys(plan.devices): check_opens(d)


def plan_launch(path: Path, header: GGUFHeader, options: LaunchOptions, memory: int) -> LaunchPlan:
  """The plan for `options` over the model at `path` (its header read), with `memory` bytes available on this host."""
  from pyruntime.devices import parse_device, parse_devices
  from pyruntime.modelfile.plan import OWN_ARCHS, ROWS_ARCHS, SSM_SUPPORTED, plan_split
  if options.decode == "reference" and header.arch in OWN_ARCHS:
    raise errors.InvalidOption("decode", f"{header.arch} runs on the rows path only: tinygrad has no model of it whose kernels "
                               "decode='reference' would run")
  if options.kv_budget and (options.decode == "reference" or header.arch not in ROWS_ARCHS):
    raise errors.InvalidOption("kv_budget", "a preempted stream is resumed exactly only on the rows path, whose prompt rows "
                               f"have its decode rows' bits: not with decode={options.decode!r} on {header.arch}")
  if options.tensor_cores == "on" and (header.arch not in ROWS_ARCHS or header.arch in SSM_SUPPORTED):
    raise errors.InvalidOption("tensor_cores", f"needs the rows path's projections (architectures {sorted(ROWS_ARCHS - SSM_SUPPORTED)}); "
                               f"{header.arch}'s recurrent blocks project with tinygrad's own kernels")
  n = len(options.split) if options.split else options.stages
  if not isinstance(n, int) or isinstance(n, bool) or n < 1: raise errors.InvalidOption("stages", f"must be an integer >= 1, got {n!r}")
  devices = parse_devices(options.devices, n)
  # stages on devices of their own compute at once when the streams are cut into one micro-batch per stage; stages
  # that share the CPU would only take cores from each other
  specs = [parse_device(d) for d in devices]
  own = len({s.name for s in specs}) == len(specs) and not any(s.base == "CPU" for s in specs)
  fits = packed_bytes(header) <= memory // 2
  float32_fits = 4 * sum(math.prod(t.dims) for t in header.tensors.values()) <= memory // 2
  weights = [weights_for(options, header.arch, d, fits, float32_fits) for d in devices]
  # balanced by what a decode step takes on each stage: the bytes it reads of its weights, in the form it holds them
  # (float16 weights cost half of float32's per parameter: the same proportions, so the same split)
  split = plan_split(header, n, options.split, by="time-float32" if all(w in ("float16", "float32") for w in weights) else "time")
  context, kv_budget = fit_context(header, options, split, devices, weights, memory)
  name = header.kv.get("general.name") or path.stem
  template = header.kv.get("tokenizer.chat_template") or ""
  return LaunchPlan(path, header, options, name, split, devices, weights, n if own else 1,
                    context, Tokenizer.from_gguf_kv(header.kv),
                    int(header.get("embedding_length")), template, recipe_digest(name, split, options.boundary_dtype, template),
                    kv_budget)
