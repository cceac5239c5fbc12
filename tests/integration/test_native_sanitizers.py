"""Build and run the C tests of native/ under sanitizers:
native/tests/test_ring.c with AddressSanitizer + UndefinedBehaviorSanitizer, the two-thread
native/tests/stress_threads.c and the launch loop's native/tests/stress_graph.c with ThreadSanitizer.  A test skips only when the compiler cannot
build or run a program with that sanitizer."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import lane_missing

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "native"
COMMON = ["-std=gnu11", "-g", "-O1", "-Wall", "-Wextra", "-Werror", "-Wno-unknown-warning-option", "-Wno-tsan",
          "-fno-omit-frame-pointer", f"-I{NATIVE}"]
ASAN = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
TSAN = ["-fsanitize=thread"]
ENV = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0", UBSAN_OPTIONS="print_stacktrace=1",
           TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1")


def compilers() -> list[str]:
  found = [os.environ["CC"]] if os.environ.get("CC") else []
  found += [c for c in ("gcc", "clang", "cc") if shutil.which(c)]
  return list(dict.fromkeys(found))


def _run(cmd, **kw) -> subprocess.CompletedProcess:
  return subprocess.run(cmd, capture_output=True, text=True, env=ENV, **kw)


def _no_aslr(cmd: list[str]) -> list[str]:
  """TSan cannot run under the high-entropy ASLR of some kernels; setarch -R turns it off."""
  setarch = shutil.which("setarch")
  return [setarch, platform.machine(), "-R", *cmd] if setarch else cmd


def build_with(flags: list[str], sources: list[Path], out: Path, probe_dir: Path, extra=()) -> tuple[list[str], str]:
  """Compile with the first compiler that can build *and run* a program with `flags`; returns the
  runner prefix (possibly setarch -R) and the compiler, or skips."""
  probe_c = probe_dir / "probe.c"
  probe_c.write_text("int main(void) { return 0; }\n")
  reasons = []
  for cc in compilers():
    probe = probe_dir / f"probe-{Path(cc).name}"
    r = _run([cc, *flags, str(probe_c), "-o", str(probe)])
    if r.returncode != 0:
      reasons.append(f"{cc}: cannot build with {' '.join(flags)}")
      continue
    prefix = None
    for pre in ([], _no_aslr([])):
      if _run([*pre, str(probe)]).returncode == 0:
        prefix = pre
        break
    if prefix is None:
      reasons.append(f"{cc}: a {' '.join(flags)} program does not run here")
      continue
    r = _run([cc, *COMMON, *flags, *map(str, sources), *extra, "-o", str(out)])
    assert r.returncode == 0, f"{cc} failed to build {out.name}:\n{r.stderr}"
    return prefix, cc
  lane_missing("; ".join(reasons) or "no C compiler")


def test_ring_c_asan_ubsan(tmp_path):
  exe = tmp_path / "test_ring"
  # mo_ring_bench.c too: the benchmark loops (not shipped) are held to the same warnings, -Wextra -Werror
  prefix, cc = build_with(ASAN, [NATIVE / "tests" / "test_ring.c", NATIVE / "mo_ring.c",
                                  NATIVE / "mo_ring_extra.c", NATIVE / "mo_ring_bench.c"], exe, tmp_path)
  r = _run([*prefix, str(exe)], timeout=120)
  assert r.returncode == 0, f"[{cc}] test_ring failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
  assert "all checks passed" in r.stdout
  assert "runtime error" not in r.stderr  # UBSan


def test_two_thread_stress_tsan(tmp_path):
  exe = tmp_path / "stress_threads"
  prefix, cc = build_with(TSAN, [NATIVE / "tests" / "stress_threads.c", NATIVE / "mo_ring.c"], exe, tmp_path,
                          extra=["-lpthread"])
  r = _run([*prefix, str(exe), "30000"], timeout=180)
  assert r.returncode == 0, f"[{cc}] stress_threads failed ({r.returncode}):\n{r.stdout}\n{r.stderr[-4000:]}"
  assert "ThreadSanitizer" not in r.stderr
  assert "delivered exactly once" in r.stdout


@pytest.mark.parametrize("helpers,spin_ns", [(3, 0), (1, 100_000)])
def test_launch_loop_stress_tsan(tmp_path, helpers, spin_ns):
  """mo_graph_run with helpers that sleep between launches (spin 0) and that spin: every launch sees what every core
  wrote in the one before, and TSan sees no race."""
  exe = tmp_path / "stress_graph"
  prefix, cc = build_with(TSAN, [NATIVE / "tests" / "stress_graph.c", NATIVE / "mo_graph.c"], exe, tmp_path, extra=["-lpthread"])
  r = _run([*prefix, str(exe), "40", str(helpers), str(spin_ns)], timeout=180)
  assert r.returncode == 0, f"[{cc}] stress_graph failed ({r.returncode}):\n{r.stdout}\n{r.stderr[-4000:]}"
  assert "ThreadSanitizer" not in r.stderr
  assert "every sum right" in r.stdout


def test_stress_optimised(tmp_path):
  """The same stress at -O2 without sanitizers, more records (the TSan build is slow)."""
  cc = next(iter(compilers()), None)
  if cc is None: lane_missing("no C compiler")
  exe = tmp_path / "stress_o2"
  r = _run([cc, "-std=gnu11", "-O2", "-Wall", f"-I{NATIVE}", str(NATIVE / "tests" / "stress_threads.c"),
            str(NATIVE / "mo_ring.c"), "-lpthread", "-o", str(exe)])
  assert r.returncode == 0, r.stderr
  r = _run([str(exe), "300000"], timeout=120)
  assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"


def test_fast_extension_asan_ubsan(tmp_path):
  """pyruntime._ringfast built with ASan + UBSan, loaded into Python (libasan preloaded), driving
  two threads through the fast per-record calls: every record delivered once, in order, intact,
  and no sanitizer report."""
  import shutil as _sh
  import sysconfig
  cc = next((c for c in compilers() if "clang" not in c), None)  # gcc: libasan.so to preload
  if cc is None: lane_missing("needs gcc")
  libasan = _run([cc, "-print-file-name=libasan.so"]).stdout.strip()
  if not os.path.isabs(libasan): lane_missing("gcc has no shared libasan")
  pkg = tmp_path / "pyruntime"
  _sh.copytree(ROOT / "pyruntime", pkg, ignore=_sh.ignore_patterns("_ringfast*", "__pycache__"))
  if not list(pkg.glob("_ring*.so")): lane_missing("pyruntime._ring is not built")
  suffix, include = sysconfig.get_config_var("EXT_SUFFIX"), sysconfig.get_paths()["include"]
  if not (Path(include) / "Python.h").is_file(): lane_missing(f"no Python headers at {include}")
  r = _run([cc, *COMMON, *ASAN, "-shared", "-fPIC", "-fvisibility=hidden", "-Wno-missing-field-initializers",
            "-Wno-cast-function-type", f"-I{include}", str(NATIVE / "mo_fast.c"), "-o", str(pkg / f"_ringfast{suffix}")])
  # the compiler, its libasan and Python's headers are here: a build that fails now is mo_fast.c's fault, the very
  # thing this test exists to catch
  assert r.returncode == 0, f"[{cc}] mo_fast.c does not build with ASan + UBSan:\n{r.stderr[-2000:]}"
  code = """
import threading, zlib
from pyruntime.transport import ring
from pyruntime.transport.ring import Arena, RingSpec
assert ring.BINDING == "fast", ring.BINDING
N = 20000
with Arena.create([RingSpec(1 << 12, 512, 1), RingSpec(1 << 12, 64, 8)], prefix="pyruntime-test") as a:
  w, r = a.writer(0), a.reader(0)
  def produce():
    for j in range(N):
      p = bytes([j & 0xff]) * (j % 300)
      if j % 3 == 0:
        w.write(j, p)
      elif j % 3 == 1:
        w.write(j, memoryview(bytearray(p)), flags=j, timeout=30)
      else:
        v = w.reserve(len(p)); v[:] = p; w.commit(j)
    w.close()
  t = threading.Thread(target=produce); t.start()
  j = 0
  for rec in r:
    assert rec.object_id == j and rec.extent == j % 300 and bytes(rec.payload) == bytes([j & 0xff]) * (j % 300), j
    assert rec.tobytes() == bytes([j & 0xff]) * (j % 300), j
    dst = bytearray(300)
    assert rec.readinto(dst) == j % 300 and dst[:j % 300] == rec.tobytes(), j
    j += 1
  t.join()
  assert j == N
  # the other C entry points: read() with a growing pool, read(timeout), read_many, the Record's
  # buffer protocol, batch items, a payload view that outlives the arena's close
  import numpy as np
  w2, r2 = a.writer(1), a.reader(1)
  for j in range(40): w2.write(j, bytes([j]) * 8)
  recs = [r2.read() for _ in range(20)] + [r2.read(timeout=1) for _ in range(20)]
  assert [x.object_id for x in recs] == list(range(40)) and all(bytes(x) == bytes([k]) * 8 for k, x in enumerate(recs))
  assert [x.array(np.uint8)[0] for x in recs[:3]] == [0, 1, 2] and isinstance(recs[0], ring.Record)
  r2.release()
  w2.write_many(np.arange(30), np.zeros((30, 8), np.uint8))
  b = r2.read_many(64)
  assert len(b) == 30 and b[29].object_id == 29 and bytes(b[29].payload) == bytes(8)
  r2.release()
  w2.write(99, b"keepkeep")
  kept = r2.next_record()
  view = kept.payload
  arr = kept.array(np.uint8)
print("fast path ok")
assert bytes(view) == b"keepkeep" and bytes(arr) == b"keepkeep"
"""
  env = dict(ENV, LD_PRELOAD=libasan, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0", PYTHONPATH=str(tmp_path),
             PYTHONMALLOC="malloc")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
  if "ASan runtime does not come first" in r.stderr: pytest.skip("libasan cannot be preloaded here")
  assert r.returncode == 0, f"{r.stdout}\n{r.stderr[-4000:]}"
  assert "fast path ok" in r.stdout
  assert "runtime error" not in r.stderr and "AddressSanitizer" not in r.stderr
