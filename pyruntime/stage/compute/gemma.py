"""Gemma 3 (`gemma3`): what its blocks add to the dense ones, as llama.cpp defines the family (tinygrad 0.13 has no
model of it, so there is no tinygrad reference to mirror; the judges are llama.cpp's tokens and a float64 computation of
the file, bench/exactness.py).

- the token embedding is multiplied by sqrt(dim) (a float32 constant) before the first block;
- each block norms its attention's output and its feed-forward's output (`post_attention_norm`, `post_ffw_norm`)
  before adding them to the residual;
- the feed-forward is GeGLU: GELU (tanh-approximated) of the gate times the up projection;
- q and k are RMS-normed per head before the rotary embedding (the rotary halves, NEOX order), the query scaled by
  1/sqrt(head_dim) (1/sqrt(dim / heads) for the 62-block 27B, as llama.cpp has it);
- five of every six blocks attend over a sliding window (a position sees itself and the `sliding_window` - 1 before
  it) with a rotary base of their own (`rope.freq_base_swa`, 10000 when the file does not say); every sixth block
  attends over the whole context with `rope.freq_base`, its positions divided by `rope.scaling.factor` when the file
  sets linear scaling (the 4B-27B files);
- the logits are soft-capped (cap * tanh(logits / cap)) where the file sets `final_logit_softcapping`.
GGUF's Gemma norm weights already hold 1 + w (the converter adds the one), so every norm is a plain RMS norm.

The rows path (rows.py) runs these blocks with its contract unchanged: the window is a mask over the same caches (every
position is kept, so prefix-cache blocks, speculation's rewinds and splits move keys as for any dense model).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tinygrad import Tensor, nn
from tinygrad.llm.model import TransformerBlock, TransformerConfig, precompute_freqs_cis

from pyruntime.modelfile.gguf import GGUFHeader

SWA_PATTERN = 6  # every 6th block (5, 11, 17, ...) attends globally, the others over the sliding window


@dataclass(frozen=True)
class GemmaForm:
  """What a gemma3 file's header says beyond a dense model's TransformerConfig."""
  window: int               # positions a sliding-window block sees (itself included)
  local_theta: float        # the sliding-window blocks' rotary base
  global_scale: float       # the global blocks' positions are multiplied by this (linear rope scaling: 1 / factor)
  embed_scale: float        # sqrt(dim)
  attn_scale: float         # each query's factor
  softcap: float            # the logits' soft cap; 0: none

  def local(self, block: int) -> bool: return (block + 1) % SWA_PATTERN != 0


def gemma_form(header: GGUFHeader) -> GemmaForm | None:
  """The Gemma 3 specifics of a gemma3 file; None for any other architecture."""
  if header.arch != "gemma3": return None
  kv, a = header.kv, header.arch
  dim, heads = kv[f"{a}.embedding_length"], kv[f"{a}.attention.head_count"]
  head_dim = kv.get(f"{a}.attention.key_length", dim // heads)
  linear = kv.get(f"{a}.rope.scaling.type", "linear" if f"{a}.rope.scaling.factor" in kv else "none") == "linear"
  factor = float(kv.get(f"{a}.rope.scaling.factor", 1.0)) if linear else 1.0
  return GemmaForm(window=int(kv.get(f"{a}.attention.sliding_window", 0)) or 1 << 30,
                   local_theta=float(kv.get(f"{a}.rope.freq_base_swa", 10000.0)), global_scale=1.0 / (factor or 1.0),
                   embed_scale=math.sqrt(dim), attn_scale=1.0 / math.sqrt(dim // heads if header.num_blocks == 62 else head_dim),
                   softcap=float(kv.get(f"{a}.final_logit_softcapping", 0.0) or 0.0))


class GemmaBlock(TransformerBlock):
  """A Gemma 3 block: tinygrad's attention block with the two post norms (its projections and q/k norms are the same
  tensors). `window` (0: global) and `rope_table` say how it attends; only the rows path runs it."""
  def __init__(self, config: TransformerConfig, window: int, rope_table: int):
    super().__init__(config)
    self.post_attention_norm = nn.RMSNorm(config.dim, config.norm_eps)
    self.post_ffw_norm = nn.RMSNorm(config.dim, config.norm_eps)
    self.window, self.rope_table = window, rope_table


def rope_tables(form: GemmaForm, cfg: TransformerConfig, device: str) -> list[Tensor]:
  """The global blocks' table, then the sliding-window blocks': each row a position's cos | sin, as tinygrad's
  precompute_freqs_cis makes them (the global one over scaled positions when the file sets linear scaling)."""
  glob = precompute_freqs_cis(cfg.rope_dim, cfg.max_context, cfg.rope_theta, device=device)
  if form.global_scale != 1.0:
    freqs = 1.0 / (cfg.rope_theta ** (Tensor.arange(0, cfg.rope_dim, 2, device=device)[:cfg.rope_dim // 2] / cfg.rope_dim))
    freqs = (Tensor.arange(cfg.max_context, device=device) * form.global_scale).unsqueeze(1) * freqs.unsqueeze(0)
    glob = freqs.cos().cat(freqs.sin(), dim=-1).contiguous()
  return [glob.realize(), precompute_freqs_cis(cfg.rope_dim, cfg.max_context, form.local_theta, device=device).realize()]
