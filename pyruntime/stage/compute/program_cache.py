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
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from tinygrad.helpers import diskcache_get, diskcache_put

from pyruntime.stage.compute.graph_cache import build_identity

TABLE = "pyruntime_programs"


class ProgramCache(dict):
  """A drop-in for tinygrad's to_program_cache (it calls only get and item assignment) that reads and writes through
  to disk. `schedule` names the loop schedule whose lowerings it holds."""

  def __init__(self, schedule: str):
    super().__init__()
    self.schedule, self.identity = schedule, json.dumps(build_identity(), sort_keys=True)

  def disk_key(self, key: tuple) -> str:
    return hashlib.sha256(f"{self.identity}|{self.schedule}|{key!r}".encode()).hexdigest()

  def get(self, key: tuple, default: Any = None) -> Any:
    if (prg := super().get(key)) is None and (prg := diskcache_get(TABLE, self.disk_key(key))) is not None: super().__setitem__(key, prg)
    return default if prg is None else prg

  def __setitem__(self, key: tuple, prg: Any) -> None:
    super().__setitem__(key, prg)
    diskcache_put(TABLE, self.disk_key(key), prg)
