"""The `pyruntime` command's fast paths: inspect, shm clean, and bad input refused by name."""
from __future__ import annotations

import json
import os
import subprocess
import sys

CLI = [sys.executable, "-m", "pyruntime"]


def test_inspect_json_describes_the_model_and_suggests_splits(smollm2_path):
  out = subprocess.run([*CLI, "inspect", str(smollm2_path), "--json", "--max-stages", "3"], capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  info = json.loads(out.stdout)
  assert info["architecture"] == "llama" and info["blocks"] == 30 and info["tied_embeddings"] is True
  assert sum(info["bytes_per_block"]) + sum(info["non_block_bytes"].values()) == info["weight_bytes"]
  for n in (1, 2, 3):
    for split in info["suggested_split"][f"{n}_stages"].values():
      assert len(split) == n and split[0][0] == 0 and split[-1][1] == 30
      assert all(a[1] == b[0] for a, b in zip(split, split[1:], strict=False))


def test_bad_split_is_refused_by_name_before_anything_starts(smollm2_path):
  out = subprocess.run([*CLI, "generate", "hi", "--model", str(smollm2_path), "--split", "0:10,12:30"],
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 2
  assert "LayerRangeInvalid" in out.stderr and "starts at block 12, expected 10" in out.stderr


def test_missing_model_is_refused_by_name():
  out = subprocess.run([*CLI, "generate", "hi", "--model", "/nowhere/model.gguf"], capture_output=True, text=True, timeout=60)
  assert out.returncode == 2 and "GgufLocalPathMissing" in out.stderr


def test_shm_clean_removes_only_dead_owners_segments():
  from pyruntime.ring import Arena, RingSpec
  # a segment whose creator is dead: made by a child process that exits without cleaning up
  code = ("import os; from pyruntime.ring import Arena, RingSpec; a = Arena.create([RingSpec(4096, 64)]); "
          "print(a.name, flush=True); os._exit(0)")
  dead = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout.strip()
  with Arena.create([RingSpec(4096, 64)]) as alive:
    out = subprocess.run([*CLI, "shm", "clean"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and dead.lstrip("/") in out.stdout
    assert alive.name.lstrip("/") not in out.stdout
    assert not os.path.exists("/dev/shm/" + dead.lstrip("/")) and os.path.exists("/dev/shm/" + alive.name.lstrip("/"))


def test_every_option_of_every_command_shows_its_default():
  import argparse

  from pyruntime.cli import build_parser
  commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
  assert set(commands) == {"generate", "chat", "inspect", "serve", "bench", "shm"}
  for name, p in commands.items():
    fmt = p._get_formatter()
    for action in p._actions:
      if isinstance(action, argparse._HelpAction) or not (action.option_strings or action.nargs == "?"): continue
      text = fmt._get_help_string(action) % {"default": action.default}
      assert "(default: " in text, f"pyruntime {name} {action.option_strings or action.dest}: {text!r}"
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
