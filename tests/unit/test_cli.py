"""The `pyruntime` command's fast paths: inspect, shm clean, and bad input refused by name."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "pyruntime"]


def test_inspect_json_describes_the_model_and_suggests_splits(smollm2_path):
  out = subprocess.run([*CLI, "inspect", str(smollm2_path), "--json", "--max-stages", "3"], capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  info = json.loads(out.stdout)
  assert info["architecture"] == "llama" and info["blocks"] == 30 and info["tied_embeddings"] is True
  assert sum(info["bytes_per_block"]) + sum(info["non_block_bytes"].values()) + info["unused_bytes"] == info["weight_bytes"]
  for n in (1, 2, 3):
    for split in info["suggested_split"][f"{n}_stages"].values():
      assert len(split) == n and split[0][0] == 0 and split[-1][1] == 30
      assert all(a[1] == b[0] for a, b in zip(split, split[1:], strict=False))
  # what the launcher's defaults would hold here: SmolLM2's keys and values are 46,080 bytes a position, every slot's
  fits = info["fits_here"]
  assert fits["context"] == min(fits["file_context"], 8192) and fits["weights"] == ["packed", "packed"]
  assert fits["bytes"]["kv"] == 46080 * (fits["max_streams"] + 1) * (fits["context"] + 256 + 31)
  assert sum(fits["bytes"].values()) <= fits["available_bytes"]


def test_bad_split_is_refused_by_name_before_anything_starts(smollm2_path):
  out = subprocess.run([*CLI, "generate", "hi", "--model", str(smollm2_path), "--split", "0:10,12:30"],
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 2
  assert "LayerRangeInvalid" in out.stderr and "starts at block 12, expected 10" in out.stderr


def test_missing_model_is_refused_by_name():
  out = subprocess.run([*CLI, "generate", "hi", "--model", "/nowhere/model.gguf"], capture_output=True, text=True, timeout=60)
  assert out.returncode == 2 and "GgufLocalPathMissing" in out.stderr


def test_shm_clean_removes_only_dead_owners_segments():
  from pyruntime.transport.ring import Arena, RingSpec
  # a segment whose creator is dead: made by a child process that exits without cleaning up
  code = ("import os; from pyruntime.transport.ring import Arena, RingSpec; a = Arena.create([RingSpec(4096, 64)]); "
          "print(a.name, flush=True); os._exit(0)")
  dead = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout.strip()
  with Arena.create([RingSpec(4096, 64)]) as alive:
    out = subprocess.run([*CLI, "shm", "clean"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and dead.lstrip("/") in out.stdout
    assert alive.name.lstrip("/") not in out.stdout
    assert not os.path.exists("/dev/shm/" + dead.lstrip("/")) and os.path.exists("/dev/shm/" + alive.name.lstrip("/"))


def test_every_option_of_every_command_shows_its_default():
  import argparse

  from pyruntime.cli.commands import build_parser
  commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
  assert set(commands) == {"generate", "chat", "inspect", "serve", "warmup", "bench", "shm", "top"}
  for name, p in commands.items():
    fmt = p._get_formatter()
    for action in p._actions:
      if isinstance(action, argparse._HelpAction) or not (action.option_strings or action.nargs == "?"): continue
      text = fmt._get_help_string(action) % {"default": action.default}
      flag = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))  # on or off: no default to show
      assert ("(default: " in text) != flag, f"pyruntime {name} {action.option_strings or action.dest}: {text!r}"
  out = subprocess.run([*CLI, "serve", "--help"], capture_output=True, text=True, timeout=60)
  help_text = " ".join(out.stdout.split())
  for shown in ("--port PORT TCP port (default: 8000)", "(default: 4194304)", "(default: 10.0)", "(default: 60.0)", "(default: 5.0)",
                "(default: the bundled SmolLM2-135M)", "(default: 16)", "(default: float32)"):
    assert shown in help_text, shown


def test_bad_serve_limits_are_refused_before_loading_the_model():
  for option, value in (("--timeout-request-head", "0"), ("--timeout-keep-alive", "-1"), ("--max-body-bytes", "-5"),
                        ("--timeout-request-body", "0")):
    out = subprocess.run([*CLI, "serve", "--model", "/nowhere/model.gguf", option, value], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "InvalidOption" in out.stderr and option[2:].replace("-", "_") in out.stderr, out.stderr


def test_bad_prefill_share_is_refused_before_loading_the_model():
  out = subprocess.run([*CLI, "generate", "hi", "--model", "/nowhere/model.gguf", "--prefill-share", "-1"], capture_output=True,
                       text=True, timeout=60)
  assert out.returncode == 2 and "InvalidOption" in out.stderr and "prefill_share" in out.stderr, out.stderr


def test_errors_print_on_their_own_line_without_an_empty_one_first():
  out = subprocess.run([*CLI, "generate", "hi", "--model", "/nowhere/model.gguf"], capture_output=True, text=True, timeout=60)
  assert out.returncode == 2
  assert out.stderr.startswith("pyruntime: GgufLocalPathMissing: "), repr(out.stderr)
  assert "\n\n" not in out.stderr and out.stdout == ""


def test_load_progress_without_a_terminal_is_a_line_per_step():
  import io

  from pyruntime.cli.commands import LoadProgress

  class Pipe(io.StringIO):
    def isatty(self) -> bool: return False
  err = Pipe()
  p = LoadProgress(False, err)
  p.HEARTBEAT_S = 0.05
  p({"event": "StageSpawned", "stage": 0, "pid": 1})
  p({"event": "ArenaCreated", "name": "/x", "rings": 4})   # a ring per stage, plus the tail's: 3 stages, known at once
  import time
  time.sleep(0.3)
  for i in (2, 0, 1): p({"event": "WeightsLoaded", "stage": i, "start": i, "end": i + 1})
  p({"event": "LauncherReady", "load_s": 99.0})
  lines = err.getvalue().splitlines()
  assert lines[0] == "pyruntime: loading 3 stages"
  assert any(line.startswith("pyruntime: still loading: 0/3 stages have their weights, ") for line in lines[1:-4])   # not silence while it waits
  loaded = [line for line in lines if " loaded [" in line]
  assert [line.split(" loaded ")[0] for line in loaded] == ["pyruntime: stage 2 (blocks 2:3)", "pyruntime: stage 0 (blocks 0:1)",
                                                            "pyruntime: stage 1 (blocks 1:2)"]
  assert [line.split("[")[1].split("]")[0] for line in loaded] == ["1/3", "2/3", "3/3"]   # the total never changes
  assert lines[-1].startswith("pyruntime: loaded 3 stages in ") and "99" not in lines[-1]  # one clock: its own, not load_s
  assert "\r" not in err.getvalue() and "\x1b" not in err.getvalue()
  n = len(err.getvalue())
  time.sleep(0.2)
  assert len(err.getvalue()) == n   # the heartbeat stopped with the load


@pytest.mark.integration
def test_generate_without_a_terminal_shows_progress_then_a_clean_error(tmp_path):
  """A real load of a tiny model with stderr a pipe: a line per stage, then an error (the prompt cannot fit) on its own line."""
  from tinymodels import TINY_MODELS, write_tiny_gguf
  path = write_tiny_gguf(tmp_path / "tiny.gguf", **TINY_MODELS["llama_tied"])
  out = subprocess.run([*CLI, "generate", "word " * 200, "--model", str(path), "--split", "0:2,2:5", "--max-context", "32", "--raw"],
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 2, out.stderr
  lines = out.stderr.splitlines()
  assert lines[0] == "pyruntime: loading 2 stages", out.stderr
  assert sorted(line.split(" loaded ")[0] for line in lines if " loaded [" in line) == \
    ["pyruntime: stage 0 (blocks 0:2)", "pyruntime: stage 1 (blocks 2:5)"]
  assert any(line.startswith("pyruntime: loaded 2 stages in ") for line in lines)
  assert lines[-1].startswith("pyruntime: ContextLengthExceeded: "), out.stderr
  assert "" not in lines and out.stdout == ""


@pytest.mark.parametrize("arch", ["qwen2moe", "gemma3x"])
def test_inspect_and_generate_say_first_that_a_file_cannot_be_served(tmp_path, arch):
  """A file no stage runs: inspect says so first, by name, and suggests no splits (exit 2); generate refuses it before
  any stage is spawned (the preflight), naming the architecture."""
  from tinymodels import write_unsupported_gguf
  path = write_unsupported_gguf(tmp_path / f"{arch}.gguf", arch)
  out = subprocess.run([*CLI, "inspect", str(path), "--json"], capture_output=True, text=True, timeout=120)
  info = json.loads(out.stdout)
  assert out.returncode == 2 and info["servable"] is False and arch in info["why"][0] and "suggested_split" not in info, out
  text = subprocess.run([*CLI, "inspect", str(path)], capture_output=True, text=True, timeout=120).stdout
  assert text.splitlines()[0].endswith("pyruntime cannot serve this file:") and "suggested" not in text, text
  out = subprocess.run([*CLI, "generate", "--model", str(path), "hi"], capture_output=True, text=True, timeout=120)
  assert out.returncode != 0 and "UnsupportedArchitecture" in out.stderr and "stage" not in out.stderr.lower(), out.stderr


def test_inspect_counts_blocks_without_nextn_layers(tmp_path):
  """A file with nextn_predict_layers: inspect shows the blocks tinygrad runs, the nextn layers' bytes apart."""
  from tinymodels import TINY_MODELS, write_tiny_gguf
  path = write_tiny_gguf(tmp_path / "nextn.gguf", **{**TINY_MODELS["qwen3"], "n_blocks": 4}, nextn=1)
  out = subprocess.run([*CLI, "inspect", str(path), "--json", "--max-stages", "4"], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  info = json.loads(out.stdout)
  assert info["blocks"] == 4 and len(info["bytes_per_block"]) == 4 and info["unused_bytes"] > 0
  assert sum(info["bytes_per_block"]) + sum(info["non_block_bytes"].values()) + info["unused_bytes"] == info["weight_bytes"]
  assert all(s[-1][1] == 4 for split in info["suggested_split"].values() for s in split.values())


def test_inspect_moe_counts_experts_in_bytes_and_used_experts_in_compute(tmp_path):
  """glm4moe: a block's bytes hold all 8 experts; its compute per token only the 3 a token is routed to."""
  from tinymodels import TINY_FAMILIES, write_tiny_gguf

  from pyruntime.modelfile.gguf import read_header
  path = write_tiny_gguf(tmp_path / "moe.gguf", **TINY_FAMILIES["glm4moe"])
  out = subprocess.run([*CLI, "inspect", str(path), "--json", "--max-stages", "3"], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  info = json.loads(out.stdout)
  h = read_header(path)
  exps = [n for n in h.tensors if n.startswith("blk.1.") and "_exps." in n]
  rest = [n for n in h.tensors if n.startswith("blk.1.") and n not in exps]
  params = {n: math.prod(t.dims) for n, t in h.tensors.items()}
  assert info["experts"] == 8 and info["experts_per_token"] == 3 and info["leading_dense_blocks"] == 1
  assert info["bytes_per_block"][1] == sum(h.tensors[n].nbytes for n in exps + rest)
  assert info["compute_per_block"][1] == sum(params[n] for n in rest) + sum(params[n] * 3 // 8 for n in exps)
  assert info["suggested_split"]["3_stages"]["by_compute"][-1][1] == 4


def test_inspect_names_a_server_that_is_not_there(tmp_path):
  from tinymodels import TINY_MODELS, write_tiny_gguf
  path = write_tiny_gguf(tmp_path / "tiny.gguf", **TINY_MODELS["llama_tied"])
  out = subprocess.run([*CLI, "inspect", str(path), "--server", "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60)
  assert out.returncode == 2 and "ServerUnreachable" in out.stderr and "127.0.0.1:9/metrics" in out.stderr, out.stderr


def test_inspect_text_keeps_its_column_and_counts_a_hybrid_models_state_snapshots(tmp_path):
  from tinymodels import TINY_FAMILIES, write_tiny_gguf

  from pyruntime.modelfile.gguf import read_header
  from pyruntime.modelfile.plan import kv_bytes_per_position, recurrent_state_bytes
  from pyruntime.options import PREFIX_STATE_TOKENS
  path = write_tiny_gguf(tmp_path / "hybrid.gguf", **TINY_FAMILIES["qwen35"])
  out = subprocess.run([*CLI, "inspect", str(path)], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert len({ln.index(": ") for ln in lines}) == 1, out.stdout  # every value starts in the same column
  h = read_header(path)
  per_token = kv_bytes_per_position(h, 0, h.num_blocks) + -(-recurrent_state_bytes(h, 0, h.num_blocks) // PREFIX_STATE_TOKENS)
  assert recurrent_state_bytes(h, 0, h.num_blocks) > 0
  assert any(ln.split(": ", 1)[0].strip() == "prefix_cache" and ln.split(": ", 1)[1].startswith(f"{per_token} bytes per token")
             and "snapshot of the recurrent state" in ln for ln in lines), out.stdout


def test_serve_on_a_port_in_use_says_so_before_loading_anything(tmp_path):
  import socket

  from tinymodels import TINY_MODELS, write_tiny_gguf
  path = write_tiny_gguf(tmp_path / "tiny.gguf", **TINY_MODELS["llama_tied"])
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0)); taken.listen()
    port = taken.getsockname()[1]
    out = subprocess.run([*CLI, "serve", "--model", str(path), "--port", str(port)], capture_output=True, text=True, timeout=120)
  assert out.returncode != 0
  assert "AddressInUse" in out.stderr and f"127.0.0.1:{port}" in out.stderr, out.stderr
  assert "loading" not in out.stderr and "stage" not in out.stderr, out.stderr  # nothing was spawned


def test_stages_and_split_agree_or_are_refused_by_name(tmp_path):
  """One rule whatever the numbers: --stages beside --split must give the split's count."""
  for stages, split in (("2", "0:1,1:3,3:5"), ("3", "0:2,2:5"), ("1", "0:2,2:5")):
    out = subprocess.run([*CLI, "generate", "hi", "--stages", stages, "--split", split, "--model", str(tmp_path / "none.gguf")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "InvalidOption" in out.stderr and "--stages" in out.stderr, out.stderr


def test_bench_runs_from_the_package_and_names_the_extra_it_lacks():
  """`pyruntime bench` runs pyruntime.bench.NAME (shipped in the package); a missing benchmark dependency is one line
  naming the `bench` extra, not a traceback."""
  helps = subprocess.run([*CLI, "bench", "--help"], capture_output=True, text=True, timeout=60).stdout
  for name in ("ring", "pipeline", "serve", "launcher", "kernels"): assert name in helps, helps
  pipeline = subprocess.run([*CLI, "bench", "pipeline", "--help"], capture_output=True, text=True, timeout=60)
  assert pipeline.returncode == 0 and "(default: 1,2,3)" in pipeline.stdout and "stage counts" in pipeline.stdout
  code = ("import sys; sys.modules['httpx'] = None\n"
          "from pyruntime.cli.commands import main\n"
          "sys.exit(main(['bench', 'serve', '--url', 'http://127.0.0.1:9']))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert out.returncode == 2 and "pyruntime[bench]" in out.stderr and "httpx" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_every_help_renders(capsys):
  """`pyruntime --help` and each subcommand's: argparse %-formats help strings, so a stray "%" once crashed them all."""
  import argparse

  from pyruntime.cli.commands import build_parser
  parser = build_parser()
  names = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
  assert {"generate", "serve", "warmup", "top"} <= set(names)
  for argv in ([], *([n] for n in names)):
    with pytest.raises(SystemExit) as e: build_parser().parse_args([*argv, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: pyruntime" in out and "(default: True)" not in out and "(default: False)" not in out  # flags say no default


def test_serve_options_are_defined_once_and_reach_flag_field_and_check():
  """Every SERVE_NUMBERS entry is a `serve` flag with its default and a ServeOptions field; the flags parse into a
  ServeOptions as given; a bad value is refused by ServeOptions naming the option (before anything listens or loads)."""
  from dataclasses import fields

  from pyruntime import errors
  from pyruntime.cli.commands import build_parser
  from pyruntime.options import SERVE_NUMBERS, ServeOptions
  names = {f.name for f in fields(ServeOptions)}
  assert set(SERVE_NUMBERS) <= names and names - set(SERVE_NUMBERS) == {"host", "api_key", "allowed_host"}
  defaults = build_parser().parse_args(["serve"])
  assert ServeOptions.from_args(defaults) == ServeOptions()
  for name, param in SERVE_NUMBERS.items(): assert getattr(defaults, name) == param.default == getattr(ServeOptions(), name)
  given = build_parser().parse_args(["serve", "--queue-size", "0", "--port", "9", "--shutdown-grace", "1.5", "--allowed-host", "a",
                                     "--allowed-host", "b", "--api-key", "k"])
  o = ServeOptions.from_args(given)
  assert (o.queue_size, o.port, o.shutdown_grace, o.allowed_host, o.api_key) == (0, 9, 1.5, ("a", "b"), "k")
  for bad in (["--queue-size", "-1"], ["--timeout-keep-alive", "0"], ["--port", "65536"], ["--api-key", ""]):
    with pytest.raises(errors.InvalidOption) as e: ServeOptions.from_args(build_parser().parse_args(["serve", *bad]))
    assert e.value.field == bad[0][2:].replace("-", "_")


def test_top_shows_the_kv_budget_only_where_there_is_one():
  """`pyruntime top`'s streams line: with a kv_budget, the positions held against it and the streams preempted."""
  from pyruntime.cli.top import render
  view = {"model": "m", "phase": "ok", "streams": {"running": 3, "waiting": 2, "max": 8}, "stages": [], "rings": []}
  assert "kv " not in render(view) and "kv " not in render(view | {"kv": {"budget": 0, "held": 0, "preempted": 0}})
  assert "kv 900/1024 positions, 4 preempted" in render(view | {"kv": {"budget": 1024, "held": 900, "peak": 1024, "preempted": 4}})
