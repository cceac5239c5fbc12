"""Planning from a GGUF header alone: which architectures we serve, which tensors a stage holds, how to cut the
blocks into stages. Imports neither tinygrad nor numpy, so the launcher and `pyruntime inspect` plan a split
without paying for (or depending on) the compute stack; only the stage processes import tinygrad.
"""
from __future__ import annotations

import math
from typing import Sequence

from pyruntime import errors
from pyruntime.modelfile.gguf import GGUFHeader
from pyruntime.options import PREFIX_STATE_TOKENS

DENSE_ARCHS = frozenset({"llama", "qwen2", "qwen3"})
# the architectures tinygrad 0.13's Transformer.from_gguf runs as they are meant to run (README: the per-family table)
MOE_SUPPORTED = frozenset({"qwen3moe", "glm4moe", "deepseek2"})
MLA_SUPPORTED = frozenset({"deepseek2"})
SSM_SUPPORTED = frozenset({"qwen35", "qwen35moe"})
# architectures tinygrad has no model of, whose blocks pyruntime writes itself (stage/compute/gemma.py): the rows path only
OWN_ARCHS = frozenset({"gemma3"})
SUPPORTED_ARCHS = DENSE_ARCHS | MOE_SUPPORTED | MLA_SUPPORTED | SSM_SUPPORTED | OWN_ARCHS
# the architectures the rows path runs (stage/compute/rows.py, experts.py and gemma.py): many streams per step. Attention
# blocks (latent attention and sliding windows included) with a dense or routed feed-forward also get the prefix cache,
# speculation, scoring and the tensor-core mode; recurrent blocks (SSM_SUPPORTED: their state is not a function of
# positions, and their projections are tinygrad's) take a prompt's rows as decode rows, and get the prefix cache only (their
# state kept as snapshots at cached prefixes' ends)
ROWS_ARCHS = DENSE_ARCHS | MOE_SUPPORTED | MLA_SUPPORTED | OWN_ARCHS | SSM_SUPPORTED
FFN_NORM_RENAMED = frozenset({"qwen35", "qwen35moe", "glm4moe"})  # from_gguf reads their post_attention_norm as ffn_norm


TOKENIZER_MODELS = ("gpt2", "llama")  # tokenizer.ggml.model: byte-level BPE, SentencePiece (pyruntime/text/tokenizer.py)


def support_table() -> str:
  """What a GGUF file may hold and how each architecture runs, as docs/stage-ownership.md shows it (a test keeps the
  two equal): the architectures by family, where they run, the tokenizer models, the tensor types read and packed."""
  from pyruntime.modelfile.gguf import FAST_PACKED_TYPES, GGML_TYPE_NAMES, GGML_TYPES, PACKED_TYPES

  def family(a: str) -> str:
    if a in OWN_ARCHS: return "Gemma 3: sliding windows, post norms, GeGLU (pyruntime's own blocks)"
    if a in SSM_SUPPORTED: return "hybrid: recurrent GatedDeltaNet blocks" + (" and routed experts" if a.endswith("moe") else "")
    if a in MLA_SUPPORTED: return "latent attention (MLA) and routed experts"
    return "routed experts (MoE)" if a in MOE_SUPPORTED else "dense"
  rows = ["| architecture | family | runs on | prefix cache, speculation, tensor cores |", "|---|---|---|---|"]
  for a in sorted(SUPPORTED_ARCHS, key=lambda a: (a not in DENSE_ARCHS, a in SSM_SUPPORTED, a)):
    runs = "the rows path: many streams per step" if a in ROWS_ARCHS else "tinygrad's own kernels, one stream at a time"
    if a in SSM_SUPPORTED: runs += " (a prompt's rows are decode rows)"
    extras = "yes" if a in ROWS_ARCHS else "no"
    if a in SSM_SUPPORTED: extras = "the prefix cache (with state snapshots), speculation (the state taken back); no tensor cores"
    rows.append(f"| `{a}` | {family(a)} | {runs} | {extras} |")
  names = lambda ids: ", ".join(GGML_TYPE_NAMES[t] for t in sorted(ids))  # noqa: E731
  return "\n".join(rows + ["", f"Tokenizer models: {', '.join(f'`{m}`' for m in TOKENIZER_MODELS)} "
                              "(byte-level BPE, SentencePiece), with any architecture.", "",
                              f"Tensor types read: {names(GGML_TYPES)}. Kept as the file's codes on a CPU (`--weights packed`): "
                              f"{names(FAST_PACKED_TYPES)} (multiplied in integers with `--weights packed-int8`); "
                              f"with `--weights packed-all` also {names(set(PACKED_TYPES) - FAST_PACKED_TYPES)}."])


def unservable(header: GGUFHeader) -> list[str]:
  """Why pyruntime cannot serve the file, each reason by name; [] when it can (`pyruntime inspect` says so first, the
  launcher's preflight refuses such a file before any stage is spawned)."""
  why = []
  try: check_architecture(header)
  except errors.UnsupportedArchitecture as e: why.append(str(e))
  if (model := header.kv.get("tokenizer.ggml.model")) not in TOKENIZER_MODELS:
    why.append(f"tokenizer model {model!r} is not supported (supported: {', '.join(TOKENIZER_MODELS)})")
  return why


def check_architecture(header: GGUFHeader) -> None:
  """Refuse, by name, what no stage runs: what tinygrad's from_gguf does not run (or would run wrongly), besides the
  architectures pyruntime writes itself (OWN_ARCHS)."""
  arch, kv = header.arch, header.kv
  if arch not in SUPPORTED_ARCHS:
    raise errors.UnsupportedArchitecture(f"architecture {arch!r} is not supported; supported: {', '.join(sorted(SUPPORTED_ARCHS))}")
  if (kv.get(f"{arch}.expert_count", 0) or any(".ffn_gate_exps." in n for n in header.tensors)) and arch not in MOE_SUPPORTED | {"qwen35moe"}:
    # e.g. Mixtral (llama + experts): from_gguf would weight the experts by the softmax over all of them, not over the top k
    raise errors.UnsupportedArchitecture(f"{arch!r} with mixture-of-experts layers is not supported (tinygrad does not route {arch!r} experts)")
  if kv.get(f"{arch}.attention.kv_lora_rank", 0) and arch not in MLA_SUPPORTED:
    raise errors.UnsupportedArchitecture(f"{arch!r} with multi-head latent attention (MLA) is not supported")
  if (kv.get(f"{arch}.ssm.state_size", 0) or kv.get(f"{arch}.full_attention_interval", 0)) and arch not in SSM_SUPPORTED:
    raise errors.UnsupportedArchitecture(f"{arch!r} with recurrent (SSM) layers is not supported")


def num_blocks(header: GGUFHeader) -> int:
  """The model's blocks: `block_count` less the extra prediction layers tinygrad leaves out (GGUFHeader.num_blocks)."""
  return header.num_blocks


def output_tensor_name(header: GGUFHeader) -> str:
  """Models with tied embeddings use the embedding matrix as the output projection."""
  return "output.weight" if "output.weight" in header.tensors else "token_embd.weight"


def block_tensor_names(header: GGUFHeader, i: int) -> list[str]:
  return [n for n in header.tensors if n.startswith(f"blk.{i}.")]


def stage_tensor_names(header: GGUFHeader, start: int, end: int) -> list[str]:
  """The tensors a stage holds on its device (the head's embedding stays on the host)."""
  names = [n for i in range(start, end) for n in block_tensor_names(header, i)]
  if end == num_blocks(header): names += ["output_norm.weight", output_tensor_name(header)]
  return names


def stage_weight_bytes(header: GGUFHeader, start: int, end: int) -> int:
  return sum(header.tensors[n].nbytes for n in dict.fromkeys(stage_tensor_names(header, start, end)))


def model_weight_bytes(header: GGUFHeader) -> int:
  return sum(t.nbytes for t in header.tensors.values())


def kv_bytes_per_position(header: GGUFHeader, start: int, end: int) -> int:
  """Bytes one position of one stream takes in the keys and values of blocks start..end-1 as a stage holds them
  (float32, pyruntime/stage/compute/rows.py): each attention block's key and value rows, MLA's latent and rotary key; a
  recurrent block holds a state per stream instead, not per position (none counted)."""
  t, total = header.tensors, 0
  for i in range(start, end):
    p = f"blk.{i}."
    if any(n.startswith(p + "ssm_") for n in t): continue
    if p + "attn_kv_a_mqa.weight" in t: total += t[p + "attn_kv_a_mqa.weight"].shape[0]
    else: total += t[p + "attn_k.weight"].shape[0] + t[p + "attn_v.weight"].shape[0]
  return 4 * total


def recurrent_state_bytes(header: GGUFHeader, start: int, end: int) -> int:
  """Bytes one stream's recurrent state takes in blocks start..end-1 (float32, as tinygrad's GatedDeltaNet block holds
  it): each recurrent block's last conv_kernel - 1 conv inputs and its (v heads, v head dim, v head dim) state."""
  t = header.tensors
  if not any(f"blk.{i}.ssm_a" in t for i in range(start, end)): return 0
  kernel, inner, heads = header.get("ssm.conv_kernel"), header.get("ssm.inner_size"), header.get("ssm.time_step_rank")
  channels = inner + 2 * header.get("ssm.group_count") * header.get("ssm.state_size")
  one = (kernel - 1) * channels + heads * (inner // heads) ** 2
  return 4 * one * sum(f"blk.{i}.ssm_a" in t for i in range(start, end))


def prefix_cache_bytes_per_token(header: GGUFHeader) -> int:
  """Host bytes one cached position takes in the whole pipeline's prefix cache (pyruntime/stage/compute/kv_blocks.py):
  every attention block's key and value rows (MLA: its latent and rotary key), as float32, and with recurrent blocks
  a PREFIX_STATE_TOKENS-th of a recurrent-state snapshot (the budget keeps one per that many tokens; rounded up)."""
  L = num_blocks(header)
  return kv_bytes_per_position(header, 0, L) + -(-recurrent_state_bytes(header, 0, L) // PREFIX_STATE_TOKENS)


SPLIT_BY = ("memory", "compute", "time", "time-float32")


def tensor_cost(header: GGUFHeader, names: list[str], by: str) -> int:
  """by="memory": their bytes; by="compute": the parameters a token touches, of routed experts (`*_exps`) only the
  expert_used_count of expert_count it goes through; by="time": the bytes a decode step reads of them, which is what
  it takes on every device we run (a decode step streams its weights): stored bytes, of routed experts the used share;
  "time-float32": the same for weights held dequantised, 4 bytes a parameter (--weights float32; float16, a CPU's
  default, costs 2: the same proportions, so the same split)."""
  used, experts = header.get("expert_used_count", 0), header.get("expert_count", 0)
  def cost(name: str) -> int:
    t = header.tensors[name]
    if by == "memory": return t.nbytes
    n = {"compute": 1, "time-float32": 4}.get(by, 0) * math.prod(t.dims) or t.nbytes
    return n * used // experts if experts and "_exps." in t.name else n
  return sum(cost(n) for n in names)


def suggest_split(header: GGUFHeader, n_stages: int, by: str = "memory") -> list[tuple[int, int]]:
  """Contiguous [start, end) ranges covering every block once, balancing the stages' on-device weight bytes
  (by="memory": the tail also holds output_norm + output, the head nothing extra), their compute
  (by="compute": parameters touched per token, so the output projection counts on the tail, and of an MoE block's
  routed experts only the expert_used_count of expert_count a token goes through), or their time per decode step
  (by="time" / "time-float32": the bytes a step reads, see tensor_cost; the head's embedding rows cost nothing)."""
  L = num_blocks(header)
  if not isinstance(n_stages, int) or not 1 <= n_stages <= L:
    raise errors.LayerRangeInvalid(f"cannot cut {L} blocks into {n_stages} non-empty stages")
  if by not in SPLIT_BY: raise ValueError(f"by must be one of {', '.join(SPLIT_BY)}, not {by!r}")
  blk = [tensor_cost(header, block_tensor_names(header, i), by) for i in range(L)]
  tail_extra = tensor_cost(header, ["output_norm.weight", output_tensor_name(header)], by)
  prefix = [0]
  for c in blk: prefix.append(prefix[-1] + c)
  def stage_cost(s: int, e: int) -> int: return prefix[e] - prefix[s] + (tail_extra if e == L else 0)
  # best[k][e]: the smallest possible max stage cost cutting blocks [0, e) into k stages; ties prefer earlier cuts
  INF = float("inf")
  best = [[INF] * (L + 1) for _ in range(n_stages + 1)]
  cut = [[0] * (L + 1) for _ in range(n_stages + 1)]
  best[0][0] = 0
  for k in range(1, n_stages + 1):
    for e in range(k, L + 1):
      for s in range(k - 1, e):
        if (v := max(best[k - 1][s], stage_cost(s, e))) < best[k][e]: best[k][e], cut[k][e] = v, s
  ranges, e = [], L
  for k in range(n_stages, 0, -1):
    s = cut[k][e]
    ranges.append((s, e))
    e = s
  return ranges[::-1]


def check_split(split: Sequence[tuple[int, int]], num_blocks: int) -> None:
  """Ranges must be non-empty, contiguous, and cover 0..L-1 exactly once (docs/stage-ownership.md)."""
  if not split: raise errors.LayerRangeInvalid("the split has no stages")
  expect = 0
  for i, (start, end) in enumerate(split):
    if start != expect:
      raise errors.LayerRangeInvalid(f"stage {i} starts at block {start}, expected {expect} (ranges must be contiguous, no overlap)")
    if end <= start: raise errors.LayerRangeInvalid(f"stage {i} range [{start}, {end}) is empty")
    expect = end
  if expect != num_blocks:
    raise errors.LayerRangeInvalid(f"the split ends at block {expect}, but the model has {num_blocks} blocks")


def parse_split(text: str) -> list[tuple[int, int]]:
  """"0:15,15:30" → [(0, 15), (15, 30)]"""
  try: return [(int(a), int(b)) for a, b in (part.split(":") for part in text.split(","))]
  except ValueError: raise errors.InvalidOption("split", f"expected START:END,START:END..., got {text!r}") from None


def plan_split(header: GGUFHeader, stages: int, split: Sequence[tuple[int, int]] | None = None,
               by: str = "time") -> list[tuple[int, int]]:
  """The split a pipeline runs: the one asked for, checked, or for `stages` stages the one that balances their time
  per decode step (`by`: "time-float32" when the stages hold float32 weights). A stage's memory is its devices' to
  hold: the launcher takes float16 weights only where a float16 copy of the whole model fits."""
  ranges = [tuple(r) for r in (split or suggest_split(header, stages, by=by))]
  check_split(ranges, num_blocks(header))
  return ranges  # type: ignore[return-value]
