"""Logits against a float64 reference: how far each way of computing the model lands from exact arithmetic.

  python bench/exactness.py [--model PATH | --family llama|qwen3moe|glm4moe|deepseek2|qwen35|qwen35moe] [--tokens 64] [--devices CPU,CL]
                            (a gemma3 file too: its reference is llama.cpp's definition of the family; no tinygrad side)
                            [--no-llama] [--json]

The reference is the model's own arithmetic done in float64 with numpy: the same weight values the stages hold (every
tensor dequantised and rounded to float16, as the reference model tinygrad follows rounds them: HALF=1), embedding,
RMS norms, rotary embedding (partial where the file says), causal grouped-query attention, SwiGLU, the vocabulary's
projection; for mixture-of-experts blocks the routing as tinygrad's model defines it (softmax over the top k or over all
experts, or sigmoid with an expert bias; renormalisation; scale), the chosen experts and the shared expert with its gate;
for latent attention (MLA) the latent and rotary key, each head's keys and values through attn_k_b and attn_v_b; for
hybrids (qwen35) the GatedDeltaNet recurrence position by position and the attention's output gate; for
Gemma 3 the scaled embedding, post norms, GELU and sliding windows (reference_logits). Sides,
on the same tokens (a fixed text, the first `--tokens` of it), each logit of every position compared:

- **pyruntime float32**: the batched path with float32 weights (packed and float16 weights give these bits:
  tests/integration/test_rows.py), float32 activations and sums.
- **pyruntime tensor-cores** (`--tensor-cores on`): each projection's input rounded to float16, products exact, sums in
  float32 (docs/prompt-path.md, "Tensor cores"). Off a GPU with tensor cores the sums run in order; on one, in the
  tile's order: the same rounding of the inputs, so the same size of error (bench/gpu_check.sh times and checks it on
  a lent GPU).
- **pyruntime HALF=0 vs file**: the float32 side with every weight kept as the file's value (`HALF=0`: no float16
  rounding), against the file's float64 arithmetic: what a file-exact contract would give.
- **pyruntime packed-int8 vs file** (on a CPU): the integer products of `--weights packed-int8` (each row's activations
  quantized to int8 per block of 32, llama.cpp's arithmetic; pyruntime/stage/compute/int8_product.py) against the file's
  values, which its Q4_0/Q4_1/Q8_0 products read unrounded (other types stay float16, as in packed).
- **tinygrad's own** (`Transformer.from_gguf`, its blocks over the whole prompt at once, as its `generate` prefills): the
  model pyruntime's contract is measured against, against both references: its weights are dequantised and cast to
  float16 inside the kernels that read them, and there (on the CPU backend, measured) the cast does not round, so its
  logits follow the file's values rather than their float16 rounding. Where the rows path's bits differ from it (every MoE and MLA family's
  do, in the last bits), the rows path must be no further from float64 than it.
- **llama.cpp** (llama-cpp-python, the benchmark-only peer; `--no-llama` leaves it out): its own kernels, which round
  activations to int8 for the quantized weights' dot products. It holds the file's weight values unrounded, so its
  reference is the float64 arithmetic on those.
- **... vs file**: a side against the float64 arithmetic on the file's own unrounded values (the model as its file
  holds it): for pyruntime, its arithmetic's error plus the contract's float16 rounding of every weight.

`--family` writes a random model of that family with bench/families.py (its `small` size: dim 512, 8 blocks, Q8_0)
instead of reading one. For each side: the largest and the root-mean-square difference from the reference over all logits, that RMS as a multiple
of pyruntime float32's, and the share of positions whose likeliest token is the reference's.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
from pyruntime.bench.machine import cpu

TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, lighting the great lamp that guided ships "
        "past the rocks. One stormy night he found a bottle washed up on the shore, and inside it a letter written long ago "
        "by a sailor who had promised to return. He read it by the light of the lamp, and wondered who had written it.")


# --- the float64 reference ----------------------------------------------------------------------------
def weights64(path: str, half: bool = True) -> tuple[dict[str, np.ndarray], dict]:
  """Every tensor of the file as float64 values (of its float16 rounding: `half`, what pyruntime and tinygrad hold), and
  the header's key-values."""
  import gguf
  r = gguf.GGUFReader(path)
  kv = {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("tokenizer.")}
  out = {}
  for t in r.tensors:
    v = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
    out[t.name] = (v.astype(np.float16) if half else v).astype(np.float64)
  return out, kv


def _norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
  return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, pos: np.ndarray, theta: float, neox: bool) -> np.ndarray:
  """x (T, heads, head_dim) rotated: pairs (2i, 2i+1) as llama.cpp's llama files have them (their q and k rows are
  permuted for that), or halves (i, i + d/2) for the NEOX families (qwen2, qwen3)."""
  d = x.shape[-1]
  ang = pos[:, None, None] * theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
  cos, sin = np.cos(ang), np.sin(ang)
  a, b = (x[..., :d // 2], x[..., d // 2:]) if neox else (x[..., 0::2], x[..., 1::2])
  ra, rb = a * cos - b * sin, a * sin + b * cos
  return np.concatenate([ra, rb], -1) if neox else np.stack([ra, rb], -1).reshape(x.shape)


def _softmax(s: np.ndarray) -> np.ndarray:
  p = np.exp(s - s.max(-1, keepdims=True))
  return p / p.sum(-1, keepdims=True)


def _silu(x: np.ndarray) -> np.ndarray: return x / (1 + np.exp(-x))


def _gelu(x: np.ndarray) -> np.ndarray:
  """GELU, tanh-approximated (Gemma's feed-forward)."""
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, window: int = 0) -> np.ndarray:
  """Causal attention of q (T, H, d) over k (T, H, d) and v (T, H, dv): (T, H * dv); with a sliding `window`, each
  position sees itself and the window - 1 before it."""
  T = q.shape[0]
  ahead = np.arange(T)[None, :] - np.arange(T)[:, None]  # key position - query position
  hidden = (ahead > 0) | (ahead <= -window) if window else ahead > 0
  s = np.einsum("thd,shd->hts", q, k) * scale + np.where(hidden, -np.inf, 0.0)
  return np.einsum("hts,shd->thd", _softmax(s), v).reshape(T, -1)


def _routed(w: dict[str, np.ndarray], kv: dict, arch: str, b: str, h: np.ndarray) -> np.ndarray:
  """A MoE block's feed-forward of rows h (T, dim) as tinygrad's FFNBlock defines it: the router's choice of k experts
  (top k of the logits, or of sigmoid + expert bias), their weights (softmax over the k or over every expert then
  gathered; sigmoid; renormalised where the file says; times the scale), the experts' SwiGLU products, and the shared
  expert times its sigmoid gate."""
  logits = h @ w[f"{b}.ffn_gate_inp.weight"].T  # (T, E)
  k = int(kv[f"{arch}.expert_used_count"])
  norm, scale = kv.get(f"{arch}.expert_weights_norm", arch in ("qwen3moe", "qwen35moe")), float(kv.get(f"{arch}.expert_weights_scale", 1.0))
  if (bias := w.get(f"{b}.exp_probs_b.bias")) is not None:
    probs = 1 / (1 + np.exp(-logits))
    sel = np.argsort(-(probs + bias), axis=-1, kind="stable")[:, :k]
    p = np.take_along_axis(probs, sel, -1)
    if norm: p = p / p.sum(-1, keepdims=True)
  else:
    sel = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    p = _softmax(np.take_along_axis(logits, sel, -1)) if norm else np.take_along_axis(_softmax(logits), sel, -1)
  p = p * scale
  gate, up, down = (w[f"{b}.ffn_{n}_exps.weight"] for n in ("gate", "up", "down"))  # (E, out, in)
  out = np.zeros_like(h)
  for t in range(len(h)):
    for j, e in enumerate(sel[t]):
      out[t] += p[t, j] * (down[e] @ (_silu(gate[e] @ h[t]) * (up[e] @ h[t])))
  if f"{b}.ffn_gate_shexp.weight" in w:
    shared = (_silu(h @ w[f"{b}.ffn_gate_shexp.weight"].T) * (h @ w[f"{b}.ffn_up_shexp.weight"].T)) @ w[f"{b}.ffn_down_shexp.weight"].T
    if (g := w.get(f"{b}.ffn_gate_inp_shexp.weight")) is not None: shared = shared / (1 + np.exp(-(h @ g.reshape(-1))))[:, None]
    out = out + shared
  return out


def _latent_attention(w: dict[str, np.ndarray], kv: dict, arch: str, b: str, h: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
  """MLA (deepseek2) of rows h (T, dim): the query (through its low-rank half and norm where the file has one), the
  normed latent and the shared rotary key, each head's keys and values from the latent (attn_k_b, attn_v_b), scaled by
  1/sqrt(key length). The rotary parts are in the file's pair order (tinygrad permutes them to halves: the same
  numbers)."""
  eps, H = float(kv[f"{arch}.attention.layer_norm_rms_epsilon"]), int(kv[f"{arch}.attention.head_count"])
  lora, rd = int(kv[f"{arch}.attention.kv_lora_rank"]), int(kv[f"{arch}.rope.dimension_count"])
  T = len(h)
  if f"{b}.attn_q_a.weight" in w:
    q = _norm(h @ w[f"{b}.attn_q_a.weight"].T, w[f"{b}.attn_q_a_norm.weight"], eps) @ w[f"{b}.attn_q_b.weight"].T
  else: q = h @ w[f"{b}.attn_q.weight"].T
  q = q.reshape(T, H, -1)
  nope = q.shape[-1] - rd
  a = h @ w[f"{b}.attn_kv_a_mqa.weight"].T
  latent = _norm(a[:, :lora], w[f"{b}.attn_kv_a_norm.weight"], eps)
  k_rope = np.repeat(_rope(a[:, None, lora:], pos, theta, False), H, axis=1)
  keys = np.concatenate([np.einsum("tc,hcn->thn", latent, w[f"{b}.attn_k_b.weight"]), k_rope], -1)
  values = np.einsum("tc,hvc->thv", latent, w[f"{b}.attn_v_b.weight"])
  q = np.concatenate([q[..., :nope], _rope(q[..., nope:], pos, theta, False)], -1)
  return _attention(q, keys, values, 1 / np.sqrt(q.shape[-1]))


def _gated_delta(w: dict[str, np.ndarray], kv: dict, arch: str, b: str, h: np.ndarray) -> np.ndarray:
  """A GatedDeltaNet block's mixer (qwen35, qwen35moe) of rows h (T, dim) as tinygrad's GatedDeltaNetBlock defines it,
  one position after another from zero state: the qkv projection through a causal depthwise convolution (the last
  conv_kernel inputs) and SiLU; q and k L2-normalised per group (head i uses group i mod groups), q scaled by 1/sqrt(state
  size); the state decayed by exp(softplus(alpha + dt bias) * a) and corrected by the delta rule with weight sigmoid(beta);
  the output read with q, RMS-normed per head, gated by SiLU of the gate projection, projected by ssm_out."""
  g = lambda k: int(kv[f"{arch}.ssm.{k}"])  # noqa: E731
  K, S, G, Hv, inner = g("conv_kernel"), g("state_size"), g("group_count"), g("time_step_rank"), g("inner_size")
  dv, qd, eps = inner // Hv, S * G, float(kv[f"{arch}.attention.layer_norm_rms_epsilon"])
  qkv, gate = h @ w[f"{b}.attn_qkv.weight"].T, h @ w[f"{b}.attn_gate.weight"].T
  beta = 1 / (1 + np.exp(-(h @ w[f"{b}.ssm_beta.weight"].T)))
  alpha = np.exp(np.logaddexp(0, h @ w[f"{b}.ssm_alpha.weight"].T + w[f"{b}.ssm_dt.bias"]) * w[f"{b}.ssm_a"])
  conv_w = w[f"{b}.ssm_conv1d.weight"]  # (channels, kernel)
  conv, state = np.zeros((K - 1, qkv.shape[1])), np.zeros((Hv, dv, dv))
  unit = lambda t: t / np.maximum(np.linalg.norm(t, axis=-1, keepdims=True), 1e-12)  # noqa: E731
  out = np.zeros((len(h), inner))
  for t in range(len(h)):
    window = np.concatenate([conv, qkv[t:t + 1]])
    conv = window[1:]
    c = _silu((window * conv_w.T).sum(0))
    heads = lambda part: np.tile(unit(part.reshape(G, S)), (Hv // G, 1))  # noqa: E731
    q, k, v = heads(c[:qd]) * S ** -0.5, heads(c[qd:2 * qd]), c[2 * qd:].reshape(Hv, dv)
    state = state * alpha[t][:, None, None]
    state = state + np.einsum("hv,hk->hvk", (v - np.einsum("hvk,hk->hv", state, k)) * beta[t][:, None], k)
    o = _norm(np.einsum("hvk,hk->hv", state, q), w[f"{b}.ssm_norm.weight"], eps)
    out[t] = (o * _silu(gate[t].reshape(Hv, dv))).reshape(-1)
  return out @ w[f"{b}.ssm_out.weight"].T


def reference_logits(w: dict[str, np.ndarray], kv: dict, tokens: list[int]) -> np.ndarray:
  """(T, vocab) float64 logits of every position, for a llama, qwen2, qwen3, qwen3moe, glm4moe, deepseek2, qwen35,
  qwen35moe or gemma3 file. Gemma 3 as llama.cpp defines it: the embedding times sqrt(dim), norms after the attention and
  the feed-forward too, GELU (tanh) for SiLU, sliding-window attention with its own rotary base on all but every 6th
  block, the queries scaled by 1/sqrt(head_dim), the logits soft-capped where the file says. Qwen3.5's attention blocks:
  each head's query followed by its output gate in attn_q, the output times sigmoid of the gate; its other blocks
  GatedDeltaNet (_gated_delta)."""
  arch = kv["general.architecture"]
  g = lambda k: kv[f"{arch}.{k}"]  # noqa: E731
  H, KvH, eps = int(g("attention.head_count")), int(g("attention.head_count_kv")), float(g("attention.layer_norm_rms_epsilon"))
  theta, neox = float(kv.get(f"{arch}.rope.freq_base", 10000.0)), arch != "llama"
  gemma, ssm = arch == "gemma3", arch in ("qwen35", "qwen35moe")
  x = w["token_embd.weight"][tokens] * (np.sqrt(float(g("embedding_length"))) if gemma else 1.0)
  T, pos = len(tokens), np.arange(len(tokens), dtype=np.float64)
  lin = lambda name, h: h @ w[f"{name}.weight"].T + (w[f"{name}.bias"] if f"{name}.bias" in w else 0)  # noqa: E731
  for i in range(int(g("block_count"))):
    b = f"blk.{i}"
    local = gemma and (i + 1) % 6 != 0
    h = _norm(x, w[f"{b}.attn_norm.weight"], eps)
    gate = None
    if f"{b}.ssm_a" in w: o = _gated_delta(w, kv, arch, b, h)
    elif f"{b}.attn_kv_a_mqa.weight" in w: o = _latent_attention(w, kv, arch, b, h, pos, theta)
    else:
      q, k, v = (lin(f"{b}.attn_{n}", h) for n in "qkv")
      Hd = k.shape[-1] // KvH
      if ssm: q, gate = q.reshape(T, H, 2, Hd)[:, :, 0], q.reshape(T, H, 2, Hd)[:, :, 1].reshape(T, H * Hd)
      rd = int(kv.get(f"{arch}.rope.dimension_count", Hd))
      q, k, v = q.reshape(T, H, Hd), k.reshape(T, KvH, Hd), v.reshape(T, KvH, Hd)
      if f"{b}.attn_q_norm.weight" in w: q, k = _norm(q, w[f"{b}.attn_q_norm.weight"], eps), _norm(k, w[f"{b}.attn_k_norm.weight"], eps)
      base = float(kv.get(f"{arch}.rope.freq_base_swa", 10000.0)) if local else theta
      at = pos if local or not gemma else pos / float(kv.get(f"{arch}.rope.scaling.factor", 1.0))
      q, k = (np.concatenate([_rope(t[..., :rd], at, base, neox), t[..., rd:]], -1) for t in (q, k))
      o = _attention(q, np.repeat(k, H // KvH, axis=1), np.repeat(v, H // KvH, axis=1), 1 / np.sqrt(Hd),
                     int(g("attention.sliding_window")) if local else 0)
    if f"{b}.ssm_a" not in w: o = lin(f"{b}.attn_output", o if gate is None else o / (1 + np.exp(-gate)))
    x = x + (_norm(o, w[f"{b}.post_attention_norm.weight"], eps) if gemma else o)
    norm = w.get(f"{b}.ffn_norm.weight", w.get(f"{b}.post_attention_norm.weight"))  # glm4moe names it so
    h = _norm(x, norm, eps)
    if f"{b}.ffn_gate_inp.weight" in w: x = x + _routed(w, kv, arch, b, h)
    elif gemma: x = x + _norm(lin(f"{b}.ffn_down", _gelu(lin(f"{b}.ffn_gate", h)) * lin(f"{b}.ffn_up", h)), w[f"{b}.post_ffw_norm.weight"], eps)
    else: x = x + lin(f"{b}.ffn_down", _silu(lin(f"{b}.ffn_gate", h)) * lin(f"{b}.ffn_up", h))
  out = w.get("output.weight", w["token_embd.weight"])
  logits = _norm(x, w["output_norm.weight"], eps) @ out.T
  if cap := float(kv.get(f"{arch}.final_logit_softcapping", 0.0)): logits = cap * np.tanh(logits / cap)
  return logits


# --- the sides --------------------------------------------------------------------------------------
def pyruntime_logits(path: str, tokens: list[int], device: str | None, **kw) -> np.ndarray:
  """(T, vocab) logits of every position from one whole-model stage on the batched path, prompt rows of at most
  score_rows (the tail keeps that many rows' logits) at a time: the same bits as any other cut of the prompt."""
  from pyruntime.modelfile.gguf import read_header
  from pyruntime.stage.compute.model import StageModel
  L = read_header(path).num_blocks
  m = StageModel.load(path, 0, L, device=device, max_context=max(256, len(tokens) + 32), slots=1, **kw)
  m.reset_slot(0)
  out, n = [], m.score_rows
  for s in range(0, len(tokens), n):
    part = np.asarray(tokens[s:s + n], np.uint32)
    out += [row.numpy().copy() for row in m.prefill_rows(0, part, s, every_row=True)]
  return np.stack(out).astype(np.float64)


def file_exact_logits(path: str, tokens: list[int], device: str) -> np.ndarray:
  """pyruntime float32 with HALF=0 (weights kept as the file's values, not rounded to float16: a file-exact mode), in a
  process of its own (tinygrad reads HALF once)."""
  import subprocess
  import sys
  import tempfile
  with tempfile.NamedTemporaryFile(suffix=".npy") as f:
    code = (f"import sys, numpy as np; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); from exactness import "
            f"pyruntime_logits; np.save({f.name!r}, pyruntime_logits({path!r}, {tokens!r}, {device!r}, weights='float32'))")
    subprocess.run([sys.executable, "-c", code], env={**os.environ, "HALF": "0"}, check=True)
    return np.load(f.name)


def tinygrad_logits(path: str, tokens: list[int]) -> np.ndarray:
  """(T, vocab) logits of every position from tinygrad's own model: its blocks over the whole prompt at once."""
  from tinygrad import Tensor
  from tinygrad.llm.model import Transformer
  model, _ = Transformer.from_gguf(path, max_context=max(256, len(tokens) + 32))
  if model.has_recurrent_block:  # its recurrent blocks take one position at a time (as its generate prefills them)
    rows = []
    for i, t in enumerate(tokens):
      x = model.token_embd(Tensor([[t]])).float()
      for blk in model.blk: x = blk(x, i)
      rows.append(model.output(model.output_norm(x))[0, 0].numpy())
    return np.stack(rows).astype(np.float64)
  x = model.token_embd(Tensor([tokens])).float()
  for blk in model.blk: x = blk(x, 0)
  return model.output(model.output_norm(x))[0].numpy().astype(np.float64)


def llama_cpp_logits(path: str, tokens: list[int], threads: int) -> np.ndarray | None:
  try:
    from llama_cpp import Llama
  except ImportError:
    return None
  try: llm = Llama(model_path=path, n_ctx=max(256, len(tokens) + 32), logits_all=True, n_threads=threads, verbose=False)
  except ValueError: return None  # a file llama.cpp cannot load (a random model's tiny vocabulary): no side
  llm.eval(tokens)
  return np.asarray(llm.scores[:len(tokens)], np.float64)


def compare(ref: np.ndarray, got: np.ndarray) -> dict:
  d = got - ref
  return {"max_abs": float(np.abs(d).max()), "rms": float(np.sqrt((d * d).mean())),
          "top1_agree": float((got.argmax(-1) == ref.argmax(-1)).mean())}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default=None, help="GGUF file (default: the default model)")
  ap.add_argument("--family", default=None, help="instead of --model: a random model of this family (bench/families.py, small)")
  ap.add_argument("--tokens", type=int, default=64)
  ap.add_argument("--devices", default="CPU", help="devices of the pyruntime sides, comma-separated (CPU, CL)")
  ap.add_argument("--no-llama", action="store_true")
  ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
  ap.add_argument("--json", action="store_true")
  a = ap.parse_args()
  from pyruntime.modelfile.gguf import read_header
  from pyruntime.modelfile.plan import OWN_ARCHS, SSM_SUPPORTED
  from pyruntime.modelfile.source import default_model_path
  from pyruntime.text.tokenizer import Tokenizer
  if a.family:
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from families import family_model
    path = family_model(a.family)
  else: path = str(a.model or default_model_path())
  tokens = Tokenizer.from_gguf_kv(read_header(path).kv).encode(TEXT, add_special=True)[:a.tokens]  # BOS where the file asks
  w, kv = weights64(path)
  ref = reference_logits(w, kv, tokens)
  # the file's own values, unrounded: what a user's model is; the contract's float16 rounding of every weight (tinygrad's
  # HALF=1) is a distance from it that the float32 side's row against `ref` does not show
  ref_file = reference_logits(*weights64(path, half=False), tokens)
  rows = []
  for dev in a.devices.split(","):
    f32 = pyruntime_logits(path, tokens, dev, weights="float32")
    rows.append((f"pyruntime float32 ({dev})", compare(ref, f32)))
    rows.append((f"pyruntime float32 ({dev}) vs file", compare(ref_file, f32)))
    rows.append((f"pyruntime HALF=0 ({dev}) vs file", compare(ref_file, file_exact_logits(path, tokens, dev))))
    if dev == "CPU":  # integer products: llama.cpp's arithmetic, on the file's values (no float16 rounding of weights)
      rows.append((f"pyruntime packed-int8 ({dev}) vs file", compare(ref_file, pyruntime_logits(path, tokens, dev, weights="packed-int8"))))
    if kv["general.architecture"] not in SSM_SUPPORTED:  # (recurrent blocks project with tinygrad's kernels: no tensor-core mode)
      rows.append((f"pyruntime tensor-cores ({dev})", compare(ref, pyruntime_logits(path, tokens, dev, weights="float16", tensor_cores=True))))
  if kv["general.architecture"] not in OWN_ARCHS:  # (tinygrad has no model of gemma3)
    tg = tinygrad_logits(path, tokens)
    rows.append(("tinygrad's own (CPU)", compare(ref, tg)))
    # its kernels dequantise each weight and cast it to float16 inside the kernel that reads it, and on this backend that
    # cast of a float32 value fused into its consumer does not round (measured: its logits sit at the file's values)
    rows.append(("tinygrad's own (CPU) vs file", compare(ref_file, tg)))
  if not a.no_llama and (lc := llama_cpp_logits(path, tokens, a.threads)) is not None:
    # llama.cpp holds the file's values unrounded: its reference is the same arithmetic on those
    rows.append(("llama.cpp vs file", compare(ref_file, lc)))
  base = rows[0][1]["rms"]
  for _, r in rows: r["rms_x_float32"] = r["rms"] / base
  if a.json:
    print(json.dumps({"cpu": cpu(), "model": os.path.basename(path), "tokens": len(tokens), "sides": dict(rows)}, indent=1))
    return
  print(f"# {cpu()}\n# {os.path.basename(path)}, {len(tokens)} positions x {ref.shape[1]} logits against float64 (|logit| up to "
        f"{np.abs(ref).max():.1f})")
  print(f"{'side':34s} {'max |d|':>10s} {'rms d':>10s} {'rms x f32':>10s} {'top-1 =':>8s}")
  for name, r in rows:
    print(f"{name:34s} {r['max_abs']:10.2e} {r['rms']:10.2e} {r['rms_x_float32']:10.1f} {r['top1_agree']:8.1%}")


if __name__ == "__main__":
  main()
