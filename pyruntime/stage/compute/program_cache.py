"""Lowered kernels kept on disk, so a stage lowers only the kernels no earlier process has lowered.

tinygrad lowers each kernel (its AST: optimise, linearise, render to source) once per process, in a dict
(`tinygrad.codegen.to_program_cache`), and keeps the compiled binary of each source on disk (its compile cache). The
lowering is most of a new graph's capture: SmolLM2-sized stages and the tests' tiny models alike spend about half of a
warm-up in it, and a stage of another split, slot count or context lowers the same projections, norms and rotations
again. A ProgramCache is that dict backed by tinygrad's own on-disk cache (`diskcache_get`/`diskcache_put`, the
SQLite file that holds its compiled binaries, so it follows tinygrad's CACHELEVEL: 0 turns both off).

The key is tinygrad's own key for the lowering (the kernel's AST, the renderer and its target, the codegen settings),
the loop schedule that lowered it (loop_schedules: "stock" or "rows": the same AST gets other opts under each), and what
every cached build shares (graph_cache.build_identity: tinygrad's version, pyruntime's source, the CPU, the
environment variables that change kernels), so a kernel lowered by other code is never taken for this code's.

Processes that start together (a launcher's stages, the suite's workers) would each lower the same kernels at the
same time: a pipeline's stages hold blocks of one shape. So a key missing from the disk is lowered under a lock of its
own, shared by every process (a byte-range lock on one file beside tinygrad's cache): the first process to miss it
lowers it, the others wait and read it back. A process holds one such lock at a time, from the miss (`get`) to the
store (`__setitem__`), or until its next miss if lowering failed; a waiter gives up after LOCK_WAIT_S and lowers the
kernel itself, so a stuck holder costs time, never a hang.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from typing import Any

from tinygrad import helpers
from tinygrad.helpers import diskcache_get, diskcache_put

from pyruntime.stage.compute.graph_cache import build_identity

TABLE = "pyruntime_programs"
LOCK_WAIT_S = 120.0  # a lowering takes seconds at most; past this a waiter lowers the kernel itself
LOCK_SPAN = 1 << 30  # lock offsets: a key's digest modulo this (distinct kernels share a lock once in ~10^9)


class ProgramCache(dict):
  """A drop-in for tinygrad's to_program_cache (it calls only get and item assignment) that reads and writes through
  to disk. `schedule` names the loop schedule whose lowerings it holds."""

  def __init__(self, schedule: str):
    super().__init__()
    self.schedule, self.identity = schedule, json.dumps(build_identity(), sort_keys=True)

  def disk_key(self, key: tuple) -> str:
    return hashlib.sha256(f"{self.identity}|{self.schedule}|{key!r}".encode()).hexdigest()

  def get(self, key: tuple, default: Any = None) -> Any:
    if (prg := super().get(key)) is None and (prg := self._from_disk(key)) is not None: super().__setitem__(key, prg)
    return default if prg is None else prg

  def __setitem__(self, key: tuple, prg: Any) -> None:
    super().__setitem__(key, prg)
    diskcache_put(TABLE, self.disk_key(key), prg)
    _unlock()

  def _from_disk(self, key: tuple) -> Any:
    """The lowering of `key` from disk, else None with the key's lock held (the caller lowers it and stores it)."""
    digest = self.disk_key(key)
    if (prg := diskcache_get(TABLE, digest)) is not None or helpers.CACHELEVEL < 1: return prg
    _lock(int(digest[:15], 16) % LOCK_SPAN)
    if (prg := diskcache_get(TABLE, digest)) is not None: _unlock()  # lowered by the process that held the lock
    return prg


_held: dict[str, Any] = {}  # the lock file (path, descriptor, opening process) and the offset this process holds, if any


def _lock(offset: int) -> None:
  _unlock()  # a lowering that failed left its lock held: this process moved on
  path = helpers.CACHEDB + ".lowering.lock"  # beside the cache its lowerings go to
  if (_held.get("path"), _held.get("pid")) != (path, os.getpid()):  # a forked child holds none of its parent's locks
    if _held.get("pid") == os.getpid(): os.close(_held["fd"])
    _held.update(path=path, fd=os.open(path, os.O_RDWR | os.O_CREAT, 0o644), pid=os.getpid())
  deadline = time.monotonic() + LOCK_WAIT_S
  while True:
    try:
      fcntl.lockf(_held["fd"], fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
      _held["offset"] = offset
      return
    except OSError:
      if time.monotonic() > deadline: return  # lower it without the lock: duplicated work, never a hang
      time.sleep(0.02)


def _unlock() -> None:
  if (offset := _held.pop("offset", None)) is not None: fcntl.lockf(_held["fd"], fcntl.LOCK_UN, 1, offset)
