"""The launch plan (pyruntime/engine/launch_plan.py) as a pure function: options, header and memory in, split, devices,
weights forms and every stage's role out, with no process, no ring and no tinygrad."""
from __future__ import annotations

import math
import pathlib

import pytest
from tinymodels import TINY_FAMILIES, TINY_GEMMA, TINY_MODELS, write_tiny_gguf

from pyruntime import errors
from pyruntime.engine.launch_plan import LaunchOptions, packed_bytes, plan_launch, recipe_digest
from pyruntime.engine.prefix_cache import BLOCK
from pyruntime.modelfile.gguf import read_header

PLENTY = 1 << 40  # bytes available: everything fits


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> pathlib.Path:
  return write_tiny_gguf(tmp_path_factory.mktemp("launch_plan") / "llama.gguf", **TINY_MODELS["llama_tied"])


@pytest.fixture(scope="module")
def heavy(tmp_path_factory) -> pathlib.Path:
  """A model whose weights outweigh its keys and values at a small context: the weights rule's memory thresholds can be
  met with room left for the rest (fit_context)."""
  return write_tiny_gguf(tmp_path_factory.mktemp("launch_plan") / "heavy.gguf", dim=256, hidden=2048, n_blocks=2, n_heads=4, n_kv_heads=2, context=16)


LEAN = dict(devices="CPU", max_streams=1, prefix_cache=0)  # the least besides the weights


def plan(path: pathlib.Path, memory: int = PLENTY, **options):
  return plan_launch(path, read_header(path), LaunchOptions(**options), memory)


def test_the_split_covers_every_block_once_and_each_stage_gets_its_role(llama):
  p = plan(llama, stages=2, devices="CPU", max_streams=3, prefix_cache=4 * BLOCK, prefill_share=1.5, boundary_dtype="float16")
  assert len(p.split) == 2 and p.split[0][0] == 0 and p.split[-1][1] == p.num_blocks
  assert all(a[1] == b[0] for a, b in zip(p.split, p.split[1:], strict=False))
  for i, (start, end) in enumerate(p.split):
    role = p.role(i)
    assert (role["stage"], role["start"], role["end"]) == (i, start, end)
    assert role["slots"] == 3 and role["boundary_dtype"] == "float16" and role["prefix_blocks"] == 4 and role["block_size"] == BLOCK
    assert role["prefill_share"] == 1.5 and role["max_context"] == p.context_length and role["weights"] == p.weights[i]


def test_an_explicit_split_is_kept_and_a_bad_one_refused_by_name(llama):
  n = read_header(llama).num_blocks
  assert plan(llama, split=[(0, 1), (1, n)], devices="CPU").split == [(0, 1), (1, n)]
  with pytest.raises(errors.PyruntimeError): plan(llama, split=[(0, 1), (2, n)], devices="CPU")
  with pytest.raises(errors.InvalidOption, match="stages"): plan(llama, stages=0, devices="CPU")


def test_auto_weights_follow_the_device_the_memory_and_the_decode_mode(llama, heavy):
  assert plan(llama, devices="CPU").weights == ["packed", "packed"]
  need = packed_bytes(read_header(heavy))  # the file's bytes of the packed matrices, float16 of the rest
  assert 0 < need < 2 * sum(math.prod(t.dims) for t in read_header(heavy).tensors.values())
  assert plan(heavy, memory=2 * need, **LEAN).weights == ["packed", "packed"]
  assert plan(heavy, memory=2 * need - 2, **LEAN).weights == ["quantized", "quantized"]  # the packed copy would not fit
  assert plan(llama, devices="CPU", decode="reference").weights == ["quantized", "quantized"]  # tinygrad's own kernels
  assert plan(llama, devices="CUDA:0,CUDA:1").weights == ["quantized", "quantized"]
  assert plan(llama, devices="CPU", weights="float32").weights == ["float32", "float32"]


def test_packed_weights_count_a_moe_models_experts_at_the_files_size(tmp_path):
  """What `auto` weighs against memory: a MoE file's expert tensors (Q8_0 here) at their codes' size, not float16's."""
  from pyruntime.modelfile.gguf import packed_nbytes
  h = read_header(write_tiny_gguf(tmp_path / "moe.gguf", **TINY_FAMILIES["qwen3moe"]))
  experts = [t for n, t in h.tensors.items() if "_exps." in n]
  saved = sum(2 * math.prod(t.dims) - packed_nbytes(t.ggml_type, math.prod(t.dims)) for t in experts)
  assert experts and saved > 0
  assert 2 * sum(math.prod(t.dims) for t in h.tensors.values()) - packed_bytes(h) >= saved


def test_a_cpu_without_clang_gets_the_weights_its_backend_runs(llama, heavy):
  """tinygrad's X86 backend cannot encode packed weights' shifts and crashes on float16 conversions (both seen)."""
  assert plan(llama, devices="CPU:X86").weights == ["float32", "float32"]
  assert plan(heavy, memory=2 * packed_bytes(read_header(heavy)), **LEAN | {"devices": "CPU:X86"}).weights == ["quantized", "quantized"]
  assert plan(llama, devices="CPU:CLANGJIT").weights == ["packed", "packed"]
  for mode in ("packed", "float16"):
    with pytest.raises(errors.InvalidOption) as e: plan(llama, devices="CPU:X86", weights=mode)
    assert e.value.field == "weights"
  assert plan(llama, devices="CPU:X86", weights="quantized").weights == ["quantized", "quantized"]


def test_tensor_cores_reach_every_role_and_are_refused_where_they_cannot_hold(llama, tmp_path):
  """The tensor-core mode (docs/prompt-path.md): on in every stage's role; auto weights keep float16 values (CPU:X86's
  float32 default gives way to quantized); refused by name with float32 weights, tinygrad's own decode, an unknown
  value or a model off the rows path."""
  p = plan(llama, devices="CPU", tensor_cores="on")
  assert [p.role(i)["tensor_cores"] for i in range(2)] == [True, True] and p.weights == ["packed", "packed"]
  assert plan(llama, devices="CPU").role(0)["tensor_cores"] is False
  assert plan(llama, devices="CPU:X86", tensor_cores="on").weights == ["quantized", "quantized"]
  for bad in ({"weights": "float32"}, {"decode": "reference"}, {"tensor_cores": "yes"}):
    with pytest.raises(errors.InvalidOption) as e: plan(llama, devices="CPU", **{"tensor_cores": "on", **bad})
    assert e.value.field == "tensor_cores"
  for name in ("qwen3moe", "deepseek2"):  # MoE and MLA: on the rows path, the mode holds
    routed = write_tiny_gguf(tmp_path / f"{name}.gguf", **TINY_FAMILIES[name])
    assert plan(routed, devices="CPU", tensor_cores="on").role(0)["tensor_cores"] is True
  hybrid = write_tiny_gguf(tmp_path / "hybrid.gguf", **TINY_FAMILIES["qwen35"])  # tinygrad's own kernels: refused by name
  with pytest.raises(errors.InvalidOption, match="rows path"): plan(hybrid, devices="CPU", tensor_cores="on")


def test_gemma3_plans_the_rows_path_and_refuses_tinygrads_decode(tmp_path):
  """Gemma 3 (pyruntime's own blocks): packed weights on a CPU, the tensor-core mode holds; decode='reference' (tinygrad
  has no Gemma 3 model) is refused by name before any stage is spawned."""
  gemma = write_tiny_gguf(tmp_path / "gemma3.gguf", **TINY_GEMMA)
  p = plan(gemma, devices="CPU", tensor_cores="on")
  assert p.weights == ["packed", "packed"] and p.role(1)["tensor_cores"] is True
  with pytest.raises(errors.InvalidOption) as e: plan(gemma, devices="CPU", decode="reference")
  assert e.value.field == "decode" and "rows path only" in str(e.value)


def test_micro_batches_only_for_stages_on_devices_of_their_own(llama):
  assert plan(llama, devices="CPU").micro_batches == 1
  assert plan(llama, devices="CUDA:0,CUDA:1").micro_batches == 2
  assert plan(llama, devices="CUDA:0,CUDA:0").micro_batches == 1


def test_context_and_recipe(llama):
  h = read_header(llama)
  p = plan(llama, devices="CPU", max_context=64)
  assert p.context_length == min(64, int(h.get("context_length")))
  assert plan(llama, devices="CPU", max_context=1 << 30).context_length == int(h.get("context_length"))
  assert p.recipe == recipe_digest(p.model_name, p.split, "float32", p.template)
  assert p.recipe != plan(llama, split=[(0, 1), (1, h.num_blocks)], devices="CPU").recipe  # another split, another recipe
  assert p.vocab_size == p.tokenizer.vocab_size and p.dim == int(h.get("embedding_length"))


def test_every_launch_option_is_a_launcher_keyword_with_the_same_default():
  """Launcher passes its keywords to LaunchOptions by name: the two lists, and their defaults, must be the same (a field
  added to one only, or a default changed in one only, fails here instead of passing silently)."""
  import dataclasses
  import inspect

  from pyruntime.engine.launch_plan import LAUNCH_FIELDS, LaunchOptions
  from pyruntime.engine.launcher import Launcher
  params = {n: p for n, p in inspect.signature(Launcher.__init__).parameters.items() if p.kind is p.KEYWORD_ONLY}
  assert set(params) - {"on_event"} == LAUNCH_FIELDS
  defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory() for f in dataclasses.fields(LaunchOptions)}
  wrong = {n: (params[n].default, d) for n, d in defaults.items() if params[n].default != d and not (params[n].default is None and d == {})}
  assert not wrong or wrong == {"load_timeout_s": (300.0, 900.0)}, wrong  # the suite bounds loads (conftest.bound_launcher_loads)
  lm = Launcher("nowhere.gguf", max_streams=3, draft_tokens=4, stall_timeout=7, stage_env={"A": "1"})
  assert (lm.options.max_streams, lm.options.draft_tokens, lm.options.stall_timeout, lm.options.stage_env) == (3, 4, 7.0, {"A": "1"})


def test_a_context_that_cannot_be_held_is_refused_with_the_numbers_and_a_default_one_cut_to_fit(tmp_path):
  """fit_context: the CPU stages' weights, every slot's keys and values at the full context and the prefix cache's pool
  against the memory available. Where not even one stream's context fits beside the slots' slack, an explicit
  max_context is refused by name, naming the largest that does (which plans, and a step more does not); with none given
  the plan takes the largest multiple of CONTEXT_STEP that fits, as its kv_budget too; with too little for any
  context, a refusal that says what else to lower. GPU stages are not counted."""
  from pyruntime.engine.launch_plan import CONTEXT_STEP, memory_need
  path = write_tiny_gguf(tmp_path / "long.gguf", **TINY_MODELS["llama_tied"] | {"context": 8192})
  full = plan(path, devices="CPU")
  assert full.context_length == 8192
  def need(p) -> int: return sum(memory_need(p.header, p.options, p.split, p.devices, p.weights, p.context_length, p.kv_budget).values())
  memory = need(full) // 3
  with pytest.raises(errors.InvalidOption) as e: plan(path, memory=memory, devices="CPU", max_context=8192)
  assert e.value.field == "max_context" and "8192" in str(e.value) and "GiB" in str(e.value)
  most = int(str(e.value).split("at most max_context=")[1].split()[0])
  assert 0 < most < 8192 and most % CONTEXT_STEP == 0
  assert plan(path, memory=memory, devices="CPU", max_context=most).context_length == most
  with pytest.raises(errors.InvalidOption): plan(path, memory=memory, devices="CPU", max_context=most + CONTEXT_STEP)
  cut = plan(path, memory=memory, devices="CPU")  # no max_context: the largest that fits
  assert cut.context_length == cut.kv_budget == most and need(cut) <= memory
  with pytest.raises(errors.InvalidOption, match="lower max_streams") as e: plan(path, memory=1 << 10, devices="CPU")
  assert e.value.field == "max_context"
  assert plan(path, memory=1 << 10, devices="CUDA:0,CUDA:1", prefix_cache=0).context_length == 8192  # on the GPUs


def test_a_kv_budget_counts_its_positions_not_every_slots_context_and_holds_one_stream(tmp_path):
  """With kv_budget the keys and values are counted at the budget's positions (plus a page of keys and a chunk's padding
  per slot), so a context and a slot count whose product does not fit plan where the budget does; a budget below
  the context cuts a default context to it and refuses an explicit one (a stream alone must fit); a budget that does
  not fit is refused naming it; decode="reference" (whose prompt rows are not its decode rows) refuses a budget."""
  from pyruntime.engine.launch_plan import memory_need
  from pyruntime.modelfile.plan import kv_bytes_per_position
  from pyruntime.protocol import MAX_CHUNK, PAGE_POSITIONS
  path = write_tiny_gguf(tmp_path / "long.gguf", **TINY_MODELS["llama_tied"] | {"context": 8192})
  def kv(p) -> int: return memory_need(p.header, p.options, p.split, p.devices, p.weights, p.context_length)["kv"]
  full, budgeted = (plan(path, devices="CPU", max_streams=16, prefix_cache=0, kv_budget=b) for b in (0, 8192))
  per = sum(kv_bytes_per_position(full.header, *r) for r in full.split)
  assert kv(full) == per * 17 * (8192 + MAX_CHUNK + 31)
  assert kv(budgeted) == per * (8192 + 17 * (PAGE_POSITIONS + MAX_CHUNK + 31)) < kv(full) / 4
  def total(p) -> int: return sum(memory_need(p.header, p.options, p.split, p.devices, p.weights, p.context_length, p.kv_budget).values())
  memory = total(budgeted) + 1
  assert plan(path, memory=memory, devices="CPU", max_streams=16, prefix_cache=0, kv_budget=8192).context_length == 8192
  auto = plan(path, memory=memory, devices="CPU", max_streams=16, prefix_cache=0)  # none given: one that fits, the context kept
  assert auto.context_length == 8192 and 8192 <= auto.kv_budget < 8192 + BLOCK and total(auto) <= memory
  ref = plan(path, memory=memory, devices="CPU", max_streams=16, prefix_cache=0, decode="reference")  # never preempted: cut
  assert ref.context_length < 8192 and ref.kv_budget == 0
  assert plan(path, devices="CPU", kv_budget=1000).context_length == 1000
  with pytest.raises(errors.InvalidOption, match="cannot hold one stream") as e: plan(path, devices="CPU", kv_budget=1000, max_context=2048)
  assert e.value.field == "kv_budget"
  with pytest.raises(errors.InvalidOption, match="lower kv_budget") as e: plan(path, memory=memory // 2, devices="CPU", max_streams=16,
                                                                                prefix_cache=0, kv_budget=8192)
  assert e.value.field == "kv_budget"
  with pytest.raises(errors.InvalidOption, match="rows path") as e: plan(path, devices="CPU", kv_budget=8192, decode="reference")
  assert e.value.field == "kv_budget"
  with pytest.raises(errors.InvalidOption) as e: LaunchOptions(kv_budget=-1)
  assert e.value.field == "kv_budget"


def test_the_launcher_says_when_it_set_a_budget_or_cut_the_context(tmp_path, monkeypatch):
  """Launcher.plan() (before any stage is spawned) emits KVBudgetSet when the slots' contexts do not fit and a budget
  does, ContextReduced with the two contexts when it cut the context (here on tinygrad's own decode path, which never
  preempts); an explicit max_context that cannot fit is refused there, before anything is spawned."""
  import pyruntime.engine.launcher as launcher_module
  from pyruntime.engine.launcher import Launcher
  path = write_tiny_gguf(tmp_path / "long.gguf", **TINY_MODELS["llama_tied"] | {"context": 8192})
  monkeypatch.setattr(launcher_module, "available_memory", lambda: 40 << 20)
  seen: list[dict] = []
  p = Launcher(path, stages=1, devices="CPU", on_event=seen.append).plan()
  assert p.context_length == 8192 and p.kv_budget >= 8192
  assert [(ev["kv_budget"], ev["context"]) for ev in seen if ev["event"] == "KVBudgetSet"] == [(p.kv_budget, 8192)]
  assert not [ev for ev in seen if ev["event"] == "ContextReduced"]
  seen.clear()
  p = Launcher(path, stages=1, devices="CPU", decode="reference", on_event=seen.append).plan()
  assert p.context_length < 8192 and p.kv_budget == 0
  assert [(ev["context"], ev["file_context"]) for ev in seen if ev["event"] == "ContextReduced"] == [(p.context_length, 8192)]
  with pytest.raises(errors.InvalidOption, match="max_context"):
    Launcher(path, stages=1, devices="CPU", decode="reference", max_context=8192).start()


def test_a_hybrids_recurrent_state_is_counted_per_slot_and_its_kept_copies_with_the_prefix_cache(tmp_path):
  """memory_need for a model with recurrent blocks: every slot's state (max_streams + 1: the rows path's filler slot)
  with the keys and values, and with the prefix cache on, its snapshots (inside the token budget) and the two states
  each stream slot keeps aside for them; ConfigureRole carries the snapshot count."""
  from pyruntime.engine.launch_plan import memory_need
  from pyruntime.engine.prefix_cache import prefix_states
  from pyruntime.modelfile.plan import kv_bytes_per_position, prefix_cache_bytes_per_token, recurrent_state_bytes
  from pyruntime.protocol import MAX_CHUNK
  path = write_tiny_gguf(tmp_path / "hybrid.gguf", **TINY_FAMILIES["qwen35"])
  h = read_header(path)
  state = recurrent_state_bytes(h, 0, h.num_blocks)
  assert state > 0 and recurrent_state_bytes(read_header(write_tiny_gguf(tmp_path / "dense.gguf", **TINY_MODELS["llama_tied"])), 0, 2) == 0
  on, off = (plan(path, stages=1, devices="CPU", max_streams=3, prefix_cache=c) for c in (1024, 0))
  need = lambda p: memory_need(p.header, p.options, p.split, p.devices, p.weights, 0)  # noqa: E731
  assert need(off)["kv"] == need(on)["kv"] == kv_bytes_per_position(h, 0, h.num_blocks) * 4 * (MAX_CHUNK + 31) + 4 * state
  assert need(off)["prefix_cache"] == 0 and need(on)["prefix_cache"] == 1024 * prefix_cache_bytes_per_token(h) + 2 * 3 * state
  assert on.role(0)["prefix_states"] == prefix_states(1024) == 16 and off.role(0)["prefix_states"] == 0
