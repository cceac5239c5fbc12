"""The program cache (pyruntime/stage/compute/program_cache.py): a kernel lowered once is read back from disk by a later
process, under its own loop schedule and build only."""
from __future__ import annotations

import numpy as np
import pytest
from tinygrad import Tensor, codegen, helpers

from pyruntime.stage.compute import loop_schedules, program_cache
from pyruntime.stage.compute.program_cache import ProgramCache


@pytest.fixture
def cachedb(tmp_path, monkeypatch):
  """tinygrad's on-disk cache in a file of this test's own (a fresh connection, no table made yet)."""
  monkeypatch.setattr(helpers, "CACHEDB", str(tmp_path / "cache.db"))
  monkeypatch.setattr(helpers, "_db_connection", None)
  monkeypatch.setattr(helpers, "_db_tables", set())
  yield tmp_path / "cache.db"
  if helpers._db_connection is not None: helpers._db_connection.close()


def test_a_lowering_comes_back_under_its_schedule_and_build_only(cachedb, monkeypatch):
  key = (b"ast digest", "renderer", "target")
  ProgramCache("rows")[key] = "lowered"
  assert cachedb.exists()
  assert ProgramCache("rows").get(key) == "lowered"  # a new cache: what a new process starts with
  assert ProgramCache("stock").get(key) is None and ProgramCache("rows").get(key[:2]) is None
  monkeypatch.setattr(program_cache, "build_identity", lambda: {"pyruntime": "other source"})
  assert ProgramCache("rows").get(key) is None


def test_a_real_kernel_is_lowered_once(cachedb, monkeypatch):
  loop_schedules.install()
  assert isinstance(codegen.to_program_cache, ProgramCache)
  lowered = []
  stock = codegen.do_to_program
  monkeypatch.setattr(codegen, "do_to_program", lambda ast, renderer: lowered.append((ast, renderer)) or stock(ast, renderer))
  a = np.arange(35, dtype=np.float32).reshape(5, 7)  # a shape no other test lowers, so nothing in memory has it
  got = (Tensor(a, device="CPU") * 3 + 1).sum(axis=1).numpy()
  assert np.array_equal(got, (a * 3 + 1).sum(axis=1)) and lowered
  ast, renderer = lowered[-1]
  first = codegen.to_program(ast, renderer)
  dict.clear(codegen.to_program_cache)  # the memory of this process gone: only the disk has it
  n = len(lowered)
  again = codegen.to_program(ast, renderer)
  assert len(lowered) == n and again is first  # read back, not lowered again (UOps are interned: equal means the same)


CHILD = """
import sys, time
from pyruntime.stage.compute import program_cache
program_cache.LOCK_WAIT_S = float(sys.argv[1])
t = time.monotonic()
got = program_cache.ProgramCache("rows").get((b"ast digest", "renderer", "shared"))
print(repr(got), round(time.monotonic() - t, 2))
"""


@pytest.mark.parametrize("wait_s", [60.0, 0.3])
def test_a_kernel_missing_from_disk_is_lowered_by_one_process_while_the_others_wait(cachedb, wait_s):
  """Two processes miss the same key: the first holds its lock until it stores the lowering; the second waits and reads
  that lowering back instead of lowering it again; with a waiter's bound shorter than the lowering, it gives up and
  lowers it itself (None: a miss), never hangs."""
  import os
  import subprocess
  import sys
  import time
  key = (b"ast digest", "renderer", "shared")
  mine = ProgramCache("rows")
  assert mine.get(key) is None  # a miss: this process lowers it, holding the key's lock
  child = subprocess.Popen([sys.executable, "-c", CHILD, str(wait_s)], stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "CACHEDB": str(cachedb)})
  if wait_s < 3:  # the child gives up while this process still holds the lock
    got, waited = child.communicate(timeout=60)[0].split()
    assert got == "None" and float(waited) < 3.0, (got, waited)
    mine[key] = "lowered"
  else:
    time.sleep(3.0)  # the child imports tinygrad (~1 s) and waits at the lock
    mine[key] = "lowered"  # stored: the lock is released
    got, waited = child.communicate(timeout=60)[0].split()
    assert got == "'lowered'" and float(waited) > 0.5, (got, waited)
  assert ProgramCache("rows").get(key) == "lowered"
