"""Random llama-shaped models of the sizes people run, with a real tokenizer: what the benchmarks and the size test load.

  python bench/sized_model.py [--size 1b|3b] [--type q4_0|q8_0] [--out PATH]    # prints the file's path

A 135M model hides the costs users meet (memory per weight, prompt arithmetic, graph arenas), and no model hub can be
reached here, so this writes a model of Llama 3.2's block shapes (1B: dim 2048, 16 blocks, 32 heads / 8 KV heads, FFN
8192; 3B: dim 3072, 28 blocks, 24 / 8 heads of 128, FFN 8192; tied embeddings) with the bundled SmolLM2 file's tokenizer
(its 49,152-token byte-level BPE, merges and chat template, copied field by field), so prompts tokenize as a real
model's do. Its weights are random quantized blocks written directly as bytes (no float matrix is ever made: a 3B file
takes seconds): uniform codes, each block's scale of random sign (no common bias) and a magnitude that keeps a
projection's outputs at its inputs' scale (~1/sqrt(inputs)). The answers are noise; the shapes, bytes and arithmetic
are a real 1B's or 3B's. Seeded: the same size and type give the same bytes, kept in the cache
($PYRUNTIME_CACHE, default ~/.cache/pyruntime) under sized/.
"""
from __future__ import annotations

import argparse
import os
import pathlib

import numpy as np

# Llama 3.2's shapes; the context is the bundled model's (8192), which keeps a default launch's KV reservation modest
SIZES = {"1b": dict(dim=2048, blocks=16, heads=32, kv_heads=8, head_dim=64, ffn=8192),
         "3b": dict(dim=3072, blocks=28, heads=24, kv_heads=8, head_dim=128, ffn=8192)}
CONTEXT = 8192
# a block's bytes, its float16 scale first: 32 codes as nibbles (Q4_0, value (q - 8) * d) or int8 (Q8_0, q * d)
TYPES = {"q4_0": (2, 18, 4.61), "q8_0": (8, 34, 73.9)}  # GGML type, block bytes, the std of a code's value over d


def params(size: str, vocab: int = 49152) -> int:
  """The model's parameter count (tied embeddings: counted once)."""
  s = SIZES[size]
  q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
  return s["blocks"] * (s["dim"] * (2 * q + 2 * kv) + 3 * s["dim"] * s["ffn"] + 2 * s["dim"]) + vocab * s["dim"] + s["dim"]


def _blocks(rng: np.random.Generator, rows: int, inputs: int, kind: str, gain: float = 1.0) -> np.ndarray:
  """(rows, inputs / 32 * block bytes) random blocks of `kind`: uniform code bytes, scales of random sign and magnitude
  gain / (std * sqrt(inputs)) within +-25%."""
  _, size, std = TYPES[kind]
  b = rng.integers(0, 256, (rows, inputs // 32, size), dtype=np.uint8)
  d = (rng.uniform(0.75, 1.25, (rows, inputs // 32)) * rng.choice([-1.0, 1.0], (rows, inputs // 32)) * gain / (std * np.sqrt(inputs)))
  b[..., 0:2] = d.astype(np.float16)[..., None].view(np.uint8)
  return b.reshape(rows, -1)


def write(path: str | os.PathLike, size: str = "1b", kind: str = "q4_0", seed: int = 0) -> pathlib.Path:
  """Write the random `size` model with `kind` blocks and the bundled model's tokenizer to `path` (atomically)."""
  import gguf  # the writer: a test and bench dependency, not the product's

  from pyruntime.modelfile.source import resolve_model
  s, qtype = SIZES[size], gguf.GGMLQuantizationType(TYPES[kind][0])
  src = gguf.GGUFReader(resolve_model("default"))
  path = pathlib.Path(path)
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  w = gguf.GGUFWriter(str(tmp), "llama")
  w.add_name(f"random llama {size} ({kind}, tokenizer of the bundled SmolLM2)")
  for k, v in dict(block_count=s["blocks"], context_length=CONTEXT, embedding_length=s["dim"], feed_forward_length=s["ffn"],
                   **{"attention.head_count": s["heads"], "attention.head_count_kv": s["kv_heads"],
                      "rope.dimension_count": s["head_dim"]}).items():
    w.add_uint32(f"llama.{k}", v)
  if s["head_dim"] != s["dim"] // s["heads"]:
    w.add_uint32("llama.attention.key_length", s["head_dim"]); w.add_uint32("llama.attention.value_length", s["head_dim"])
  w.add_float32("llama.rope.freq_base", 500000.0)
  w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
  w.add_uint32("general.file_type", {"q4_0": 2, "q8_0": 7}[kind])
  vocab = 0
  for name, f in src.fields.items():  # the tokenizer, field by field, with its own value types
    if not name.startswith("tokenizer."): continue
    v = f.contents()
    if name == "tokenizer.ggml.tokens": vocab = len(v)
    sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
    w.add_key_value(name, v, f.types[0], sub_type=sub)
  w.add_uint32("llama.vocab_size", vocab)

  rng = np.random.default_rng(seed)
  dim, q, kv = s["dim"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
  norm = lambda: (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)  # noqa: E731
  # a small embedding, so the blocks, not the input token, dominate the residual (else greedy repeats its input)
  w.add_tensor("token_embd.weight", _blocks(rng, vocab, dim, kind, gain=0.3 * np.sqrt(dim)), raw_dtype=qtype)
  for i in range(s["blocks"]):
    p = f"blk.{i}."
    w.add_tensor(p + "attn_norm.weight", norm())
    for n, rows, inputs in (("attn_q", q, dim), ("attn_k", kv, dim), ("attn_v", kv, dim), ("attn_output", dim, q)):
      w.add_tensor(p + n + ".weight", _blocks(rng, rows, inputs, kind), raw_dtype=qtype)
    w.add_tensor(p + "ffn_norm.weight", norm())
    for n, rows, inputs in (("ffn_gate", s["ffn"], dim), ("ffn_up", s["ffn"], dim), ("ffn_down", dim, s["ffn"])):
      w.add_tensor(p + n + ".weight", _blocks(rng, rows, inputs, kind), raw_dtype=qtype)
  w.add_tensor("output_norm.weight", norm())
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
  os.replace(tmp, path)
  return path


def sized_model(size: str = "1b", kind: str = "q4_0") -> pathlib.Path:
  """The cached file of the random `size` model, written on first use."""
  from pyruntime.modelfile.source import cache_root
  path = cache_root() / "sized" / f"llama-{size}-{kind}.gguf"
  if not path.exists():
    path.parent.mkdir(parents=True, exist_ok=True)
    write(path, size, kind)
  return path


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--size", choices=list(SIZES), default="1b")
  ap.add_argument("--type", choices=list(TYPES), default="q4_0")
  ap.add_argument("--out", default=None, help="write here instead of the cache")
  a = ap.parse_args()
  path = write(a.out, a.size, a.type) if a.out else sized_model(a.size, a.type)
  print(f"{path}  ({params(a.size) / 1e9:.2f}B parameters, {path.stat().st_size / 1e6:.0f} MB)")


if __name__ == "__main__":
  main()
