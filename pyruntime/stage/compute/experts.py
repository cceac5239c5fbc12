"""A mixture-of-experts feed-forward on the rows path (rows.py): routing and the routed experts, row by row.

What a row computes is tinygrad's `FFNBlock._feed_forward` for that row alone, so the rows path's contract holds for
these blocks too (a decode row = a prompt row, a row's bits do not depend on the rows beside it):
- routing reads only the row's own router logits: softmax over the top k (qwen3moe, `norm_topk_prob`) or over every
  expert then gathered, or (glm4moe, DeepSeek v3) top k of sigmoid + the expert bias, the weights from the sigmoid,
  renormalised when the file says so, times `expert_weights_scale`; tinygrad's `pairwise_topk` picks the k, with its
  tie rule (the lower index wins an equal value);
- each of the row's k experts is its own product of that row with that expert's matrices (a gather by the row's
  choice, one sum over the inputs per output, cut as every rows-path sum is: loop_schedules.rows_schedule), and the
  row's k results are summed in the row's order of choice. No sum ever runs over rows, so no capacity, no dropped row,
  and no sum whose length depends on how many rows chose an expert;
- the shared expert (and its sigmoid gate) is a dense feed-forward of the row (rows.py runs it as it runs a dense
  block's).

Everything stays on the device: no host round trip inside a block (the router logits leave the graph only as a second
output, for the boundary and the expert load).
"""
from __future__ import annotations

from typing import Any

from tinygrad import Tensor, dtypes
from tinygrad.llm.model import pairwise_topk

from pyruntime.stage.compute.packed import PackedMatrix


def route(b: Any, logits: Tensor) -> tuple[Tensor, Tensor]:
  """(selected experts (..., k) int32, their weights (..., k) float32) of each row's router logits (..., experts), as
  FFNBlock._feed_forward selects and weighs them."""
  c = b.config
  if hasattr(b, "exp_probs_b"):
    probs = logits.sigmoid()
    _, sel = pairwise_topk(probs + b.exp_probs_b["bias"], c.num_experts_per_tok)
    probs = probs.gather(-1, sel)
    if c.norm_topk_prob: probs = probs / probs.sum(axis=-1, keepdim=True)
  else:
    vals, sel = pairwise_topk(logits, c.num_experts_per_tok)
    probs = vals.softmax(-1) if c.norm_topk_prob else logits.softmax(-1).gather(-1, sel)
  return sel.contiguous(), (probs * c.routed_scaling_factor).contiguous()


def _expert_product(w: Any, sel: Tensor, x: Tensor, staged: bool) -> Tensor:
  """x (..., k or 1, in) times each row's selected experts' matrices: (..., k, out), one sum over `in` per output. From
  the experts' column blocks (experts, out / VEC, in, VEC) when the stage keeps them (weights.load: a kernel streams
  VEC outputs of every input as one run of memory, as a dense projection's; float16, or packed: the file's codes,
  each chosen expert's values rebuilt in the kernel, or with `staged` every expert's dequantised into a scratch buffer
  first, as rows._values does for a prompt chunk, where that copy of every expert fits packed.STAGED_MAX_BYTES), else
  from (experts, out, in). Either way the chosen matrices are read in the kernel by index (tinygrad turns the one-hot
  of `sel` into a load), so a row reads only the k experts it chose, and their values are the same in every form."""
  # clamped (a no-op on a top-k's indices): the kernel then knows every index is in range and loads the chosen block
  # directly, not through a bounds check per load (7x faster on a CPU)
  sel = sel.maximum(0).minimum(w.weight.shape[0] - 1)
  if (wb := getattr(w, "rows_blocked", None)) is None:
    return (x.unsqueeze(-2) * w.weight[sel]).sum(-1, dtype=dtypes.float32).contiguous()
  if isinstance(wb, PackedMatrix): values = wb.matrix(staged=staged)[sel]
  else: values = wb[sel]
  *lead, K = x.shape
  y = (x.reshape(*lead, 1, K, 1) * values).sum(-2, dtype=dtypes.float32)  # (..., k, out / VEC, VEC)
  return y.reshape(*y.shape[:-2], wb.shape[1] * wb.shape[3]).contiguous()


def routed(b: Any, x: Tensor, logits: Tensor, staged: bool = False) -> Tensor:
  """The block's routed experts for the normed rows x (B, T, dim) (a stored buffer), routed by their router logits
  (B, T, experts): (B, T, dim), each row's k experts' outputs weighted and summed in the row's order of choice.
  `staged`: packed experts are dequantised once for the step's many rows (_expert_product)."""
  sel, probs = route(b, logits)
  h = x.unsqueeze(2)  # (B, T, 1, dim): one input row for each of the row's k experts
  gate, up = _expert_product(b.ffn_gate_exps, sel, h, staged), _expert_product(b.ffn_up_exps, sel, h, staged)
  down = _expert_product(b.ffn_down_exps, sel, (gate.silu() * up).contiguous(), staged)  # (B, T, k, dim)
  return (down * probs.unsqueeze(-1)).sum(axis=2)


def shared_gate(b: Any, x: Tensor) -> Tensor:
  """The shared expert's gate of each row (B, T, 1): sigmoid of the row's dot with ffn_gate_inp_shexp, as tinygrad's."""
  return (x * b.ffn_gate_inp_shexp["weight"]).sum(axis=-1, keepdim=True).sigmoid()
