"""Tiny GGUF files for tests, written with the `gguf` package.

Each model is random (seeded) but complete: a valid byte-level BPE tokenizer (gpt2-style token list built from the
GPT-2 byte alphabet, merges trained on a small corpus, token types, specials), the architecture's metadata, and
tensors in a mix of GGML types (F32 norms, F16, Q8_0, Q4_0, Q4_1) so the loader's dequantisation paths are exercised.

    path = write_tiny_gguf(tmp_path / "m.gguf", **TINY_MODELS["llama_tied"])
"""
from __future__ import annotations

import collections
import functools
import hashlib
import os
import pathlib

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

VOCAB_SIZE = 300
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CORPUS = """The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs into the
forest. A tiny model has tiny weights, but the tokenizer is real: it merges the most frequent pairs of bytes.
Hello world! Hello there, how are you? I am fine, thank you. What is the answer to the question? The answer is 42.
In the beginning there was the word, and the word was with the model. Stages pass the residual stream along."""
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
  """GPT-2's reversible byte -> printable unicode character map."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
  cs, n = bs[:], 0
  for b in range(256):
    if b not in bs: bs.append(b); cs.append(256 + n); n += 1
  return dict(zip(bs, map(chr, cs), strict=True))


@functools.cache
def tiny_vocab(vocab_size: int = VOCAB_SIZE) -> tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...]]:
  """(tokens, merges, token_types): 256 byte tokens, BPE merges trained on CORPUS, then the special tokens."""
  b2u = bytes_to_unicode()
  tokens = [b2u[b] for b in range(256)]
  n_merges = vocab_size - 256 - len(SPECIALS)
  # pre-tokenise like GPT-2 (roughly): words with their leading space
  words = collections.Counter()
  for i, w in enumerate(CORPUS.replace("\n", " ").split(" ")):
    if w: words[("Ġ" if i else "") + "".join(b2u[b] for b in w.encode())] += 1
  seqs = {w: list(w) for w in words}
  merges: list[str] = []
  while len(merges) < n_merges:
    pairs = collections.Counter()
    for w, n in words.items():
      s = seqs[w]
      for a, b in zip(s, s[1:], strict=False): pairs[(a, b)] += n
    if not pairs: break
    (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
    merges.append(f"{a} {b}"); tokens.append(a + b)
    for w in seqs:
      s, out, i = seqs[w], [], 0
      while i < len(s):
        if i + 1 < len(s) and s[i] == a and s[i + 1] == b: out.append(a + b); i += 2
        else: out.append(s[i]); i += 1
      seqs[w] = out
  assert len(merges) == n_merges, "corpus too small for the requested vocabulary"
  tokens += SPECIALS
  types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)  # NORMAL, CONTROL
  return tuple(tokens), tuple(merges), tuple(types)


def spm_vocab(vocab_size: int = VOCAB_SIZE) -> tuple[tuple[str, ...], tuple[int, ...], tuple[float, ...]]:
  """A SentencePiece vocabulary of exactly `vocab_size` tokens: <unk>, <s>, </s>, the 256 byte tokens, CORPUS's
  characters (spaces as `▁`) and its most frequent adjacent pairs, scored by frequency."""
  text = CORPUS.replace("\n", " ").replace(" ", "\u2581")
  chars = sorted(set(text))
  pairs: dict[str, int] = {}
  for a, b in zip(text, text[1:], strict=False): pairs[a + b] = pairs.get(a + b, 0) + 1
  room = vocab_size - 3 - 256 - len(chars)
  assert room >= 0, "vocab_size too small for a SentencePiece vocabulary"
  top = sorted(pairs, key=lambda p: (-pairs[p], p))[:room]
  tokens = ("<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *chars, *top)
  tokens += tuple(f"<unused{i}>" for i in range(vocab_size - len(tokens)))
  types = (2, 3, 3, *([6] * 256), *([1] * (len(chars) + len(top))), *([5] * (vocab_size - 259 - len(chars) - len(top))))
  scores = (0.0, 0.0, 0.0, *([0.0] * 256), *([-100.0] * len(chars)), *(-float(i) for i in range(len(top))),
            *([0.0] * (vocab_size - 259 - len(chars) - len(top))))
  return tokens, types, scores


K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def k_quantize(x: np.ndarray, kind: Q) -> np.ndarray:
  """`x` (rows, K: a multiple of 256) as GGML Q4_K, Q5_K or Q6_K blocks, (rows, bytes): a plain round-to-nearest
  quantizer (gguf's has none for K-quants), laid out as ggml lays them (what tinygrad and llama.cpp read)."""
  rows = x.shape[0]
  f16 = lambda v: np.asarray(v, np.float16).view(np.uint8).reshape(*np.shape(v), 2)  # noqa: E731
  if kind == Q.Q6_K:
    b = x.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(b).max(-1) / 31 + 1e-12
    d = (scale.max(-1) / 127).astype(np.float16)
    sc = np.clip(np.round(scale / np.maximum(d.astype(np.float32)[:, None], 1e-12)), 1, 127).astype(np.int8)
    eff = d.astype(np.float32)[:, None] * sc
    q = (np.clip(np.round(b / np.where(eff > 0, eff, 1)[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)
    ql = (q[..., :64] & 15) | ((q[..., 64:] & 15) << 4)                                     # (nb, 2, 64)
    hi = (q >> 4).reshape(-1, 2, 4, 32)
    qh = hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)  # (nb, 2, 32)
    out = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), f16(d)], axis=-1)
    return out.reshape(rows, -1)
  top = 15 if kind == Q.Q4_K else 31
  b = x.reshape(-1, 8, 32).astype(np.float32)
  mn_f = np.maximum(0, -b.min(-1))
  scale_f = (b.max(-1) + mn_f) / top + 1e-12
  d, dmin = (scale_f.max(-1) / 63).astype(np.float16), (mn_f.max(-1) / 63 + 1e-12).astype(np.float16)
  sc = np.clip(np.round(scale_f / np.maximum(d.astype(np.float32)[:, None], 1e-12)), 1, 63).astype(np.uint8)
  mn = np.clip(np.round(mn_f / np.maximum(dmin.astype(np.float32)[:, None], 1e-12)), 0, 63).astype(np.uint8)
  eff, off = d.astype(np.float32)[:, None] * sc, dmin.astype(np.float32)[:, None] * mn
  q = np.clip(np.round((b + off[..., None]) / eff[..., None]), 0, top).astype(np.uint8)   # (nb, 8, 32)
  s = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6), (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], -1)
  qs = ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).reshape(-1, 128)
  parts = [f16(d), f16(dmin), s]
  if kind == Q.Q5_K: parts.append(np.bitwise_or.reduce(((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1))
  return np.concatenate([*parts, qs], axis=-1).reshape(rows, -1)


# name -> keyword arguments of write_tiny_gguf
TINY_MODELS: dict[str, dict] = {
  # llama, tied output (the embedding is the output projection), grouped-query attention 4/2, Q8_0 embedding
  "llama_tied": dict(arch="llama", n_blocks=5, n_heads=4, n_kv_heads=2, tied=True,
                     types={"token_embd": Q.Q8_0, "attn": Q.Q4_1, "ffn": Q.Q4_0}),
  # llama, untied output, plain multi-head attention, Q4_0 embedding (negative scales -> -0.0 entries), F16 blocks
  "llama_untied": dict(arch="llama", n_blocks=4, n_heads=4, n_kv_heads=4, tied=False,
                       types={"token_embd": Q.Q4_0, "output": Q.Q8_0, "attn": Q.F16, "ffn": Q.F16}),
  # llama, GQA 8 heads / 2 kv heads (head_dim 8), Q4_1 embedding, tied
  "llama_gqa": dict(arch="llama", n_blocks=6, n_heads=8, n_kv_heads=2, tied=True,
                    types={"token_embd": Q.Q4_1, "attn": Q.Q8_0, "ffn": Q.Q4_1}),
  # llama as a Q4_K_M file holds it: K-quants (inputs a multiple of 256: dim 256), Q6_K for v, ffn_down and the output,
  # Q5_K for ffn_up, a Q4_K embedding; untied
  "llama_kquant": dict(arch="llama", dim=256, n_blocks=2, n_heads=4, n_kv_heads=2, hidden=512, tied=False,
                       types={"token_embd": Q.Q4_K, "output": Q.Q6_K, "attn": Q.Q4_K, "attn_v": Q.Q6_K, "ffn": Q.Q4_K,
                              "ffn_up": Q.Q5_K, "ffn_down": Q.Q6_K}),
  # qwen2: q/k/v biases, no rope permutation, tied
  "qwen2": dict(arch="qwen2", n_blocks=4, n_heads=4, n_kv_heads=2, tied=True, qkv_bias=True, rope_theta=1e6,
                types={"token_embd": Q.F16, "attn": Q.Q8_0, "ffn": Q.Q4_0}),
  # qwen3 dense: per-head q/k RMSNorm, head_dim 32 != dim / n_heads (attention.key_length), untied
  "qwen3": dict(arch="qwen3", n_blocks=5, n_heads=4, n_kv_heads=2, tied=False, qk_norm=True, head_dim=32, rope_theta=1e6,
                types={"token_embd": Q.Q8_0, "output": Q.F16, "attn": Q.Q4_0, "ffn": Q.Q8_0}),
}
# mixture-of-experts and MLA families, as tinygrad's from_gguf runs them
TINY_FAMILIES: dict[str, dict] = {
  # qwen3moe: 8 routed experts, 2 per token, softmax over the top 2 (norm_topk_prob), q/k norm, no shared expert
  "qwen3moe": dict(arch="qwen3moe", n_blocks=4, n_heads=4, n_kv_heads=2, tied=False, qk_norm=True, head_dim=16, rope_theta=1e6,
                   moe=dict(experts=8, used=2, ff=32), types={"token_embd": Q.Q8_0, "output": Q.Q8_0, "attn": Q.Q8_0, "ffn": Q.Q8_0}),
  # glm4moe: a leading dense block, sigmoid routing with expert bias (selection on probability + bias, weights from the
  # unbiased probabilities, renormalised, times expert_weights_scale), a shared expert with its gate, post_attention_norm,
  # q/k/v bias, partial rotary (rope on 8 of 16 dims)
  "glm4moe": dict(arch="glm4moe", n_blocks=4, n_heads=4, n_kv_heads=2, tied=False, qkv_bias=True, head_dim=16, rope_dim=8,
                  post_norm=True, moe=dict(experts=8, used=3, ff=32, shared=1, lead=1, bias=True, scale=2.5, norm=True, shared_gate=True),
                  types={"token_embd": Q.F16, "output": Q.Q8_0, "attn": Q.Q8_0, "ffn": Q.Q4_0}),
  # deepseek2: multi-head latent attention (q_lora and kv_lora, the q_b / kv_a_mqa rotary permutations, one latent cache
  # per block), a leading dense block, softmax routing without renormalisation, scaled, one shared expert, no gate
  "deepseek2": dict(arch="deepseek2", n_blocks=4, n_heads=4, n_kv_heads=1, tied=False,
                    mla=dict(q_lora=32, kv_lora=32, rope=8, nope=16, v=16),
                    moe=dict(experts=8, used=2, ff=32, shared=1, lead=1, scale=1.5, norm=False),
                    types={"token_embd": Q.Q8_0, "output": Q.Q8_0, "attn": Q.Q8_0, "ffn": Q.Q8_0}),
  # qwen35: hybrid, every 2nd block full attention (gated output, q/k norm, partial rotary), the others recurrent
  # GatedDeltaNet blocks (conv + recurrent state per stream), post_attention_norm, dense FFN
  "qwen35": dict(arch="qwen35", n_blocks=4, n_heads=4, n_kv_heads=2, tied=True, head_dim=16, rope_dim=8, post_norm=True,
                 ssm=dict(conv_kernel=4, state_size=16, group_count=2, time_step_rank=4, inner_size=64, interval=2),
                 types={"token_embd": Q.Q8_0, "attn": Q.Q8_0, "ffn": Q.Q8_0}),
  # qwen35moe: the same hybrid with routed experts and a gated shared expert in every block
  "qwen35moe": dict(arch="qwen35moe", n_blocks=4, n_heads=4, n_kv_heads=2, tied=False, head_dim=16, rope_dim=8, post_norm=True,
                    ssm=dict(conv_kernel=4, state_size=16, group_count=2, time_step_rank=4, inner_size=64, interval=2),
                    moe=dict(experts=8, used=2, ff=32, shared=1, shared_gate=True),
                    types={"token_embd": Q.Q8_0, "output": Q.Q8_0, "attn": Q.Q8_0, "ffn": Q.Q8_0}),
}

# Gemma 3 (pyruntime's own blocks, stage/compute/gemma.py; tinygrad has no model of it): 7 blocks, so blocks 0-4 and 6
# attend over a sliding window of 8 positions with the local rotary base and block 5 over everything; q/k norms, a
# single kv head (head_dim 32 > dim / heads), the post norms, a SentencePiece vocabulary, tied output, no chat template
# (a base model); Q5_0 attention (held as float16 by "packed") beside Q8_0 and Q4_0 (packed)
TINY_GEMMA = dict(arch="gemma3", n_blocks=7, n_heads=4, n_kv_heads=1, tied=True, qk_norm=True, head_dim=32, rope_theta=1e6,
                  gemma=dict(window=8), tokenizer="llama", chat_template=None,
                  types={"token_embd": Q.Q8_0, "attn": Q.Q5_0, "attn_v": Q.Q8_0, "ffn": Q.Q4_0})


def write_tiny_gguf(path: str | pathlib.Path, *, arch: str = "llama", dim: int = 64, n_blocks: int = 4, n_heads: int = 4,
                    n_kv_heads: int = 2, hidden: int = 128, context: int = 256, tied: bool = True, qkv_bias: bool = False,
                    qk_norm: bool = False, head_dim: int | None = None, rope_theta: float = 10000.0, seed: int = 0,
                    types: dict | None = None, expert_count: int = 0, pre: str | None = None,
                    chat_template: str | None = CHATML, vocab_size: int = VOCAB_SIZE, nextn: int = 0, rope_dim: int | None = None,
                    moe: dict | None = None, mla: dict | None = None, post_norm: bool = False, ssm: dict | None = None,
                    tokenizer: str = "gpt2", gemma: dict | None = None) -> pathlib.Path:
  """Write a random model of `arch` to `path` and return the path. `nextn` multi-token-prediction layers follow the
  n_blocks blocks (counted in block_count, run by nobody). `moe` makes the FFNs mixtures of experts (see TINY_FAMILIES),
  `mla` the attention multi-head latent attention; `post_norm` names ffn_norm post_attention_norm (glm4moe, qwen35);
  `ssm` makes all but every `interval`-th block a recurrent GatedDeltaNet block (qwen35); `tokenizer="llama"` gives it a
  SentencePiece vocabulary (spm_vocab: Llama 2 and Mistral 7B files are llama blocks with one); `gemma` (arch gemma3:
  `window`, optional `softcap`) adds Gemma 3's sliding window and its post-attention and post-FFN norms (TINY_GEMMA)."""
  path = pathlib.Path(path)
  types = {"token_embd": Q.Q8_0, "output": Q.Q8_0, "attn": Q.Q8_0, "ffn": Q.Q8_0, **(types or {})}
  rng = np.random.default_rng(seed)
  hd = head_dim or dim // n_heads
  tokens, merges, token_types = tiny_vocab(vocab_size)

  w = gguf.GGUFWriter(str(path), arch)
  w.add_uint32(f"{arch}.block_count", n_blocks + nextn)
  if nextn: w.add_uint32(f"{arch}.nextn_predict_layers", nextn)
  w.add_uint32(f"{arch}.context_length", context)
  w.add_uint32(f"{arch}.embedding_length", dim)
  w.add_uint32(f"{arch}.feed_forward_length", hidden)
  w.add_uint32(f"{arch}.attention.head_count", n_heads)
  w.add_uint32(f"{arch}.attention.head_count_kv", n_kv_heads)
  w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
  w.add_float32(f"{arch}.rope.freq_base", rope_theta)
  if mla:
    hd = mla["nope"] + mla["rope"]
    w.add_uint32(f"{arch}.attention.kv_lora_rank", mla["kv_lora"])
    if mla["q_lora"]: w.add_uint32(f"{arch}.attention.q_lora_rank", mla["q_lora"])
    w.add_uint32(f"{arch}.attention.key_length_mla", hd)
    w.add_uint32(f"{arch}.attention.value_length_mla", mla["v"])
    w.add_uint32(f"{arch}.attention.key_length", mla["kv_lora"] + mla["rope"])
    w.add_uint32(f"{arch}.attention.value_length", mla["kv_lora"])
    w.add_uint32(f"{arch}.rope.dimension_count", mla["rope"])
  elif head_dim is not None:
    w.add_uint32(f"{arch}.attention.key_length", hd)
    w.add_uint32(f"{arch}.attention.value_length", hd)
    if rope_dim: w.add_uint32(f"{arch}.rope.dimension_count", rope_dim)
  else: w.add_uint32(f"{arch}.rope.dimension_count", rope_dim or hd)
  if gemma:
    w.add_uint32(f"{arch}.attention.sliding_window", gemma["window"])
    if gemma.get("softcap"): w.add_float32(f"{arch}.final_logit_softcapping", gemma["softcap"])
  if ssm:
    for k in ("conv_kernel", "state_size", "group_count", "time_step_rank", "inner_size"): w.add_uint32(f"{arch}.ssm.{k}", ssm[k])
    w.add_uint32(f"{arch}.full_attention_interval", ssm["interval"])
  if moe:
    w.add_uint32(f"{arch}.expert_count", moe["experts"])
    w.add_uint32(f"{arch}.expert_used_count", moe["used"])
    w.add_uint32(f"{arch}.expert_feed_forward_length", moe["ff"])
    if moe.get("shared"): w.add_uint32(f"{arch}.expert_shared_count", moe["shared"])
    if moe.get("lead"): w.add_uint32(f"{arch}.leading_dense_block_count", moe["lead"])
    if "scale" in moe: w.add_float32(f"{arch}.expert_weights_scale", moe["scale"])
    if "norm" in moe: w.add_bool(f"{arch}.expert_weights_norm", moe["norm"])
  if expert_count:
    w.add_uint32(f"{arch}.expert_count", expert_count)
    w.add_uint32(f"{arch}.expert_used_count", min(2, expert_count))
  w.add_uint32(f"{arch}.vocab_size", len(tokens))
  w.add_uint32("general.file_type", 1)
  if tokenizer == "llama":
    tokens, token_types, scores = spm_vocab(vocab_size)
    w.add_tokenizer_model("llama"); w.add_token_list(list(tokens)); w.add_token_types(list(token_types)); w.add_token_scores(list(scores))
    w.add_unk_token_id(0); w.add_bos_token_id(1); w.add_eos_token_id(2)
  else:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre or ("llama-bpe" if arch == "llama" else "qwen2"))
    w.add_token_list(list(tokens))
    w.add_token_types(list(token_types))
    w.add_token_merges(list(merges))
    w.add_bos_token_id(tokens.index("<|im_start|>") if arch != "llama" else tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_uint32("tokenizer.ggml.padding_token_id", tokens.index("<|endoftext|>"))
    if chat_template: w.add_chat_template(chat_template)

  def add(name: str, arr: np.ndarray, qtype) -> None:
    arr = arr.astype(np.float32)
    if qtype == Q.F32: w.add_tensor(name, arr)
    elif qtype == Q.F16: w.add_tensor(name, arr.astype(np.float16))
    elif qtype in K_QUANTS: w.add_tensor(name, k_quantize(arr, qtype), raw_dtype=qtype)
    else: w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
  def lin(out_f: int, in_f: int, scale: float = 1.0) -> np.ndarray:
    return rng.standard_normal((out_f, in_f)).astype(np.float32) * (scale / np.sqrt(in_f))
  def norm(n: int) -> np.ndarray: return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
  def add_recurrent(p: str, ssm: dict) -> None:
    hv, inner = ssm["time_step_rank"], ssm["inner_size"]
    conv = inner + 2 * ssm["group_count"] * ssm["state_size"]
    add(p + "attn_qkv.weight", lin(conv, dim), types["attn"])
    add(p + "attn_gate.weight", lin(inner, dim), types["attn"])
    add(p + "ssm_alpha.weight", lin(hv, dim), Q.F16)
    add(p + "ssm_beta.weight", lin(hv, dim), Q.F16)
    add(p + "ssm_conv1d.weight", 0.5 * rng.standard_normal((conv, ssm["conv_kernel"])), Q.F32)
    add(p + "ssm_dt.bias", 0.1 * rng.standard_normal(hv), Q.F32)
    add(p + "ssm_a", -np.exp(0.3 * rng.standard_normal(hv)), Q.F32)
    add(p + "ssm_norm.weight", norm(inner // hv), Q.F32)
    add(p + "ssm_out.weight", lin(dim, inner, scale=2.0), types["attn"])

  def add_experts(p: str, moe: dict) -> None:
    E, ff = moe["experts"], moe["ff"]
    add(p + "ffn_gate_inp.weight", lin(E, dim, scale=4.0), Q.F32)  # the router: spread logits, so no top-k ties
    if moe.get("bias"): add(p + "exp_probs_b.bias", 0.3 * rng.standard_normal(E), Q.F32)
    add(p + "ffn_gate_exps.weight", np.stack([lin(ff, dim) for _ in range(E)]), types["ffn"])
    add(p + "ffn_up_exps.weight", np.stack([lin(ff, dim) for _ in range(E)]), types["ffn"])
    add(p + "ffn_down_exps.weight", np.stack([lin(dim, ff, scale=2.0) for _ in range(E)]), types["ffn"])
    if sh := moe.get("shared", 0) * ff:
      add(p + "ffn_gate_shexp.weight", lin(sh, dim), types["ffn"])
      add(p + "ffn_up_shexp.weight", lin(sh, dim), types["ffn"])
      add(p + "ffn_down_shexp.weight", lin(dim, sh, scale=2.0), types["ffn"])
      if moe.get("shared_gate"): add(p + "ffn_gate_inp_shexp.weight", 0.5 * rng.standard_normal(dim), Q.F32)

  # tied: a small embedding so the blocks, not the input token, dominate the residual (else greedy repeats the input)
  add("token_embd.weight", rng.standard_normal((len(tokens), dim)).astype(np.float32) * (0.1 if tied else 1.0), types["token_embd"])
  for i in range(n_blocks + nextn):
    p = f"blk.{i}."
    if i >= n_blocks: add(p + "nextn.eh_proj.weight", lin(dim, 2 * dim), Q.F16)
    add(p + "attn_norm.weight", norm(dim), Q.F32)
    if ssm and (i + 1) % ssm["interval"] != 0:
      add_recurrent(p, ssm)
    elif mla:
      if mla["q_lora"]:
        add(p + "attn_q_a.weight", lin(mla["q_lora"], dim), types["attn"])
        add(p + "attn_q_a_norm.weight", norm(mla["q_lora"]), Q.F32)
        add(p + "attn_q_b.weight", lin(n_heads * hd, mla["q_lora"]), types["attn"])
      else: add(p + "attn_q.weight", lin(n_heads * hd, dim), types["attn"])  # DeepSeek-V2-Lite: no low-rank query
      add(p + "attn_kv_a_mqa.weight", lin(mla["kv_lora"] + mla["rope"], dim), types["attn"])
      add(p + "attn_kv_a_norm.weight", norm(mla["kv_lora"]), Q.F32)
      add(p + "attn_k_b.weight", rng.standard_normal((n_heads, mla["kv_lora"], mla["nope"])) / np.sqrt(mla["nope"]), Q.F16)
      add(p + "attn_v_b.weight", rng.standard_normal((n_heads, mla["v"], mla["kv_lora"])) / np.sqrt(mla["kv_lora"]), Q.F16)
      add(p + "attn_output.weight", lin(dim, n_heads * mla["v"], scale=2.0), types["attn"])
    else:
      add(p + "attn_q.weight", lin(n_heads * hd * (2 if ssm else 1), dim), types.get("attn_q", types["attn"]))  # qwen35: q and its output gate
      add(p + "attn_k.weight", lin(n_kv_heads * hd, dim), types.get("attn_k", types["attn"]))
      add(p + "attn_v.weight", lin(n_kv_heads * hd, dim), types.get("attn_v", types["attn"]))
      if qkv_bias:
        for n, k in (("q", n_heads), ("k", n_kv_heads), ("v", n_kv_heads)):
          add(p + f"attn_{n}.bias", 0.1 * rng.standard_normal(k * hd), Q.F32)
      if qk_norm or ssm:  # qwen35's attention blocks always norm q and k
        add(p + "attn_q_norm.weight", norm(hd), Q.F32)
        add(p + "attn_k_norm.weight", norm(hd), Q.F32)
      add(p + "attn_output.weight", lin(dim, n_heads * hd, scale=2.0), types.get("attn_output", types["attn"]))
    add(p + ("post_attention_norm.weight" if post_norm else "ffn_norm.weight"), norm(dim), Q.F32)
    if gemma:
      add(p + "post_attention_norm.weight", norm(dim), Q.F32)
      add(p + "post_ffw_norm.weight", norm(dim), Q.F32)
    if moe and i >= moe.get("lead", 0): add_experts(p, moe)
    else:
      add(p + "ffn_gate.weight", lin(hidden, dim), types.get("ffn_gate", types["ffn"]))
      add(p + "ffn_up.weight", lin(hidden, dim), types.get("ffn_up", types["ffn"]))
      add(p + "ffn_down.weight", lin(dim, hidden, scale=2.0), types.get("ffn_down", types["ffn"]))
  add("output_norm.weight", norm(dim), Q.F32)
  if not tied: add("output.weight", lin(len(tokens), dim, scale=4.0), types["output"])

  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  # the graph cache knows a model by its header, size and mtime (graph_cache.model_identity): an mtime taken from the
  # bytes gives every copy of one model one identity, so stages of the same model and options share their graphs
  # across the session's tests instead of capturing them again for each fixture's copy
  mtime_ns = int.from_bytes(hashlib.sha256(path.read_bytes()).digest()[:4], "little") * 10**9
  os.utime(path, ns=(mtime_ns, mtime_ns))
  return path


def write_unsupported_gguf(path: str | pathlib.Path, arch: str = "qwen2moe") -> pathlib.Path:
  """A small model of an architecture we refuse (e.g. qwen2moe, mixtral, gpt2): header + a few tensors."""
  path = pathlib.Path(path)
  if arch == "llama_moe":  # llama metadata with experts (Mixtral-style): refused too
    return write_tiny_gguf(path, arch="llama", n_blocks=2, expert_count=4)
  return write_tiny_gguf(path, arch=arch, n_blocks=2, expert_count=4 if "moe" in arch or arch == "mixtral" else 0)
