"""SmolLM2-135M (the default model) cut into stages in one process: exactly tinygrad's own single-process tokens."""
from __future__ import annotations

import numpy as np
import pytest
from test_model import bits, chain, decode_rate, load_split, reference_tokens
from tinygrad.llm.model import Transformer

from pyruntime.modelfile.gguf import read_header
from pyruntime.modelfile.plan import model_weight_bytes, stage_weight_bytes, suggest_split
from pyruntime.stage.compute.sampling import Sampler, SamplingParams

# --- SmolLM2-135M (the default model) ----------------------------------------------------------
SMOL_PROMPTS = [
  # <|im_start|>system ... <|im_end|> <|im_start|>user\nWhat is the capital of France?<|im_end|> <|im_start|>assistant\n
  [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 28, 7018, 411, 29297, 2, 198, 1, 4093, 198, 1780, 314, 260,
   3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
  [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30],  # raw text, no template
]
SMOL_NEW = 16
SMOL_CTX = 256


@pytest.fixture(scope="module")
def smol_ref(smollm2_path):
  ref, _ = Transformer.from_gguf(smollm2_path, max_context=SMOL_CTX)
  return [reference_tokens(ref, p, SMOL_NEW) for p in SMOL_PROMPTS]


@pytest.fixture(scope="module")
def smol_two(smollm2_path):
  return load_split(smollm2_path, suggest_split(read_header(smollm2_path), 2, by="memory"), max_context=SMOL_CTX)


@pytest.mark.slow
def test_smollm2_memory_split_holds_at_most_60_percent(smollm2_path, smol_two):
  h = read_header(smollm2_path)
  total = model_weight_bytes(h)
  for s in smol_two:
    share = s.resident_bytes / total
    print(f"\nSmolLM2 stage [{s.start}, {s.end}): {s.resident_bytes / 1e6:.1f} MB on device = {share:.1%} of {total / 1e6:.1f} MB")
    assert s.resident_bytes == stage_weight_bytes(h, s.start, s.end) and share <= 0.60


@pytest.mark.slow
def test_smollm2_two_stages_equal_reference(smol_two, smol_ref):
  times: list[float] = []
  for i, (prompt, want) in enumerate(zip(SMOL_PROMPTS, smol_ref, strict=True)):
    assert chain(smol_two, prompt, SMOL_NEW, times=times if i == len(SMOL_PROMPTS) - 1 else None) == want
  # decode speed of the warmed-up 2-stage chain (numpy round trip between the stages, argmax on the host)
  print(f"\nSmolLM2 2 stages {[(s.start, s.end) for s in smol_two]}: exact; decode {decode_rate(times):.2f} tok/s")
  # the prompt cut as a stage cuts it beside decoding streams (pieces of any size): the same logits, bit for bit
  whole, cut = [], []
  assert chain(smol_two, SMOL_PROMPTS[0], 3, logits=whole) == chain(smol_two, SMOL_PROMPTS[0], 3, logits=cut, piece=7) == smol_ref[0][:3]
  assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(whole, cut, strict=True))


@pytest.mark.slow
def test_smollm2_three_stages_equal_reference(smollm2_path, smol_ref):
  stages = load_split(smollm2_path, suggest_split(read_header(smollm2_path), 3, by="compute"), max_context=SMOL_CTX)
  sampler = Sampler(SamplingParams(), stages[-1].vocab_size, stages[-1].device)  # the tail's own greedy sampler
  for prompt, want in zip(SMOL_PROMPTS, smol_ref, strict=True): assert chain(stages, prompt, SMOL_NEW, sampler=sampler) == want


