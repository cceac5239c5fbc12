"""Device strings (pyruntime/devices.py): one reading, BASE[:INDEX][:RENDERER[:ARCH]], and DEV never carries the index."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pyruntime import errors
from pyruntime.devices import DeviceSpec, check_opens, parse_device, parse_devices, tinygrad_backends


@pytest.mark.parametrize("text,want,name,target", [
  ("CUDA", DeviceSpec("CUDA", None), "CUDA", "CUDA"),
  ("CUDA:1", DeviceSpec("CUDA", 1), "CUDA:1", "CUDA"),
  ("cuda:0", DeviceSpec("CUDA", 0), "CUDA", "CUDA"),
  ("CUDA:PTX", DeviceSpec("CUDA", None, "PTX"), "CUDA", "CUDA:PTX"),
  ("CUDA:3:ptx", DeviceSpec("CUDA", 3, "PTX"), "CUDA:3", "CUDA:PTX"),
  ("NULL:CUDA:sm_90", DeviceSpec("NULL", None, "CUDA", "sm_90"), "NULL", "NULL:CUDA:sm_90"),
  ("NULL:2:CUDA:sm_90", DeviceSpec("NULL", 2, "CUDA", "sm_90"), "NULL:2", "NULL:CUDA:sm_90"),
  ("CPU:X86", DeviceSpec("CPU", None, "X86"), "CPU", "CPU:X86"),
  ("CPU:1:CLANGJIT:x86_64,x86-64-v3", DeviceSpec("CPU", 1, "CLANGJIT", "x86_64,x86-64-v3"), "CPU:1", "CPU:CLANGJIT:x86_64,x86-64-v3"),
  ("CPU:CLANGJIT:arm64,apple-m1,-sve", DeviceSpec("CPU", None, "CLANGJIT", "arm64,apple-m1,-sve"), "CPU", "CPU:CLANGJIT:arm64,apple-m1,-sve"),
])
def test_a_numeric_second_field_is_an_index_anything_else_a_renderer(text, want, name, target):
  spec = parse_device(text)
  assert spec == want and spec.name == name and spec.target == target
  assert parse_device(str(spec)) == spec  # the canonical string reads back the same


@pytest.mark.parametrize("text", ["", ":1", "CUDA::PTX", "CUDA:1:2", "CUDA:1:PTX:sm_90:x", "CUDA:a:b:c", "x+CUDA", "CU DA", "1:CUDA",
                                  "CPU:x86,a", "CPU:1:a-b", "CPU:a,b:c"])
def test_a_malformed_device_is_refused_by_name(text):
  with pytest.raises(errors.InvalidOption, match="device"): parse_device(text)


def test_parse_devices_checks_every_stage_and_counts():
  assert parse_devices("CPU:0,CPU:1", 2) == ["CPU:0", "CPU:1"]
  assert parse_devices("NULL:CUDA:sm_90", 3) == ["NULL:CUDA:sm_90"] * 3
  with pytest.raises(errors.InvalidOption, match="3 devices given for 2 stages"): parse_devices("CPU,CPU,CPU", 2)
  with pytest.raises(errors.InvalidOption, match="device"): parse_devices("CPU,CUDA::1", 2)


def test_a_cpu_target_with_features_is_one_device_not_two():
  """The example of the module's docstring and of parse_device's own error: a comma inside a CPU target's ARCH."""
  assert parse_devices("CPU:CLANGJIT:x86_64,x86-64-v3", 2) == ["CPU:CLANGJIT:x86_64,x86-64-v3"] * 2
  assert parse_devices("CPU:CLANGJIT:x86_64,x86-64-v3,+avx2,CL", 2) == ["CPU:CLANGJIT:x86_64,x86-64-v3,+avx2", "CL"]
  assert parse_devices("CPU,CL", 2) == ["CPU", "CL"]


@pytest.mark.parametrize("device,why", [("FOO", "no backend 'FOO'"), ("CUDA:0", "no NVIDIA GPU"), ("NV", "no NVIDIA GPU")])
def test_a_device_that_cannot_open_here_is_refused_before_anything_runs(monkeypatch, device, why):
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # as on a machine without an NVIDIA GPU
  with pytest.raises(errors.InvalidOption, match=why) as e: check_opens(device)
  assert e.value.field == "device"


def test_the_devices_that_open_here_pass_the_check():
  assert {"CPU", "CL", "CUDA", "NULL", "NV"} <= tinygrad_backends()
  check_opens("CPU")
  check_opens("NULL")


@pytest.mark.integration
def test_the_launcher_refuses_a_device_before_spawning_a_stage(monkeypatch, tmp_path):
  from tinymodels import TINY_MODELS, write_tiny_gguf

  from pyruntime.engine.launcher import Launcher
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
  path = str(write_tiny_gguf(tmp_path / "tiny.gguf", **TINY_MODELS["llama_tied"]))
  seen: list[dict] = []
  lm = Launcher(path, stages=2, devices="CUDA:0,CUDA:1", on_event=seen.append)
  with pytest.raises(errors.InvalidOption, match="no NVIDIA GPU") as e: lm.start()
  assert e.value.field == "device" and not [ev for ev in seen if ev.get("event") == "StageSpawned"], seen
  lm.close()


def test_a_stage_with_an_index_compiles_its_kernels():
  """What a stage on `CPU:1` does to tinygrad (pyruntime/stage/worker.py: DEV from the device string, then resolve_device),
  in a fresh process: a kernel compiles and runs on the indexed device. DEV=CPU:1 failed (`CPU has no renderer '1'`)."""
  code = ("import os; from pyruntime.devices import parse_device; os.environ['DEV'] = parse_device('CPU:1').target\n"
          "from pyruntime.stage.compute.model import resolve_device; from tinygrad import Tensor\n"
          "d = resolve_device('CPU:1'); print(d, (Tensor([1.0, 2.0], device=d) * 3).tolist())")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ, "DEV": ""})
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split() == ["CPU:1", "[3.0,", "6.0]"]


def test_clang_kernels_ask_for_512_bit_vectors_exactly_where_the_host_has_avx512():
  """loop_schedules makes every clang CPU compiler prefer 512-bit vectors on an AVX-512 host (one instruction per VEC-wide
  operation where -march=native alone gives two 256-bit ones), and keys tinygrad's compile cache by it; an explicit
  preference in the device's features is left alone."""
  from tinygrad.runtime.support.compiler_cpu import ClangJITCompiler

  from pyruntime.stage.compute import loop_schedules
  loop_schedules.install()
  plain, chosen = ClangJITCompiler(["x86_64", "native"]), ClangJITCompiler(["x86_64", "native", "prefer-vector-width=256"])
  with open("/proc/cpuinfo") as f: avx512 = any("avx512f" in ln.split() for ln in f if ln.startswith("flags"))
  assert (loop_schedules.WIDE_FLAG in plain.args) == avx512 and plain.cachekey.endswith(loop_schedules.WIDE_FLAG) == avx512
  assert loop_schedules.WIDE_FLAG not in chosen.args and "-mprefer-vector-width=256" in chosen.args
