"""Captured step graphs kept on disk, without the weights, so a new stage process answers in seconds.

Most of a new stage's first seconds go to tinygrad tracing, scheduling and lowering its graphs (its compiled
kernels are cached on disk by tinygrad already): for SmolLM2's 22-block stage, 13 s to capture the prefill graph and
4 s for a decode window, against 0.04 s to run one. A captured TinyJit is a schedule: the compiled kernels in order
and the buffers each reads and writes. This module pickles it with every buffer replaced by a name:

- a buffer of the model's own (a weight, a KV cache, a staging buffer: the tensors `bound` names) by its name, bound
  again at load to the buffer of that name in the new process: the weights are never written to the cache;
- a buffer the graph writes (activations, its outputs) as a fresh, empty buffer of its size;
- a buffer the graph only reads and the model does not own (a constant tinygrad realized while capturing) with its
  bytes, copied into a fresh buffer at load.

A cache file is keyed by everything that shapes its graph: the model's identity (its GGUF header's digest, the file's
size and modification time: never a hash of gigabytes), the block range, device, slots, context, weights and
boundary modes, the graph's name and shape, tinygrad's version, pyruntime's own source, the CPU (kernels compiled for
this one) and the environment variables that change kernels. The key is also written inside the file and checked.
Files are written atomically (a temporary file, then a rename), the directory is capped in size (least recently used
files go first; `pyruntime warmup --clear` empties it), and since unpickling runs code, a file is read only from a
directory and a file owned by this user and writable by nobody else. Those checks and the opens use one descriptor each:
the directory is opened without following a link (O_NOFOLLOW | O_DIRECTORY) and checked with fstat, then every file
is opened, written, renamed and removed relative to it (dir_fd, O_NOFOLLOW) and checked with fstat before it is read,
so nobody can swap a link in between a check and an open (a shared sticky directory such as /tmp allows that for paths).
A file that cannot be used (corrupt, truncated,
another key, a name the model does not have) is reported once by name, removed and rebuilt; an unwritable directory
means running without the cache, reported once. Neither ever fails a request.
"""
from __future__ import annotations

import errno
import functools
import hashlib
import io
import json
import os
import pathlib
import pickle
import secrets
import stat
from typing import Any, Callable

from tinygrad import Tensor, TinyJit
from tinygrad.uop.ops import Ops, UOp

FORMAT = 1
SUFFIX = ".graph"
DEFAULT_LIMIT = 2 << 30  # bytes of graphs kept on disk (SmolLM2's stages: about 40 MB each)
ENV_KEYS = ("PYRUNTIME_LOOP_OPTS", "BEAM", "HALF", "REALIZE", "THREADS", "CPU_COUNT", "DEV", "CC", "TRANSCENDENTAL", "NOOPT", "JIT")


def graph_dir(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  from pyruntime.modelfile.source import cache_root
  return cache_root(cache_dir) / "graphs"


@functools.cache
def _source_digest() -> str:
  """pyruntime's own source: a change to the code that builds a graph must not meet a graph built by the old one."""
  h = hashlib.sha256()
  package = pathlib.Path(__file__).resolve().parents[1]
  for p in sorted(package.rglob("*.py")): h.update(p.relative_to(package).as_posix().encode() + p.read_bytes())
  return h.hexdigest()[:16]


def build_identity() -> dict:
  """What every cached build shares: tinygrad's version, pyruntime's own source, the CPU and the environment variables
  that change kernels (the graph cache's and the program cache's keys both start from this)."""
  return {"tinygrad": _tinygrad_version(), "pyruntime": _source_digest(), "cpu": _cpu(),
          "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ}}


def _cpu() -> str:
  """The CPU the kernels were compiled for (clang's -march=native): model name and feature flags."""
  from pyruntime.devices import host_cpu
  return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16] if (lines := host_cpu()) else "unknown"


def model_identity(path: str | os.PathLike, header_bytes: int) -> dict:
  """A cheap identity of a GGUF file: a digest of its header (metadata and tensor table), its size and mtime."""
  p = pathlib.Path(path)
  st = p.stat()
  with open(p, "rb") as f: head = f.read(header_bytes)
  return {"header": hashlib.sha256(head).hexdigest()[:32], "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def base_buffer(u: UOp) -> UOp:
  """The BUFFER under a chain of BUFFER_VIEWs (a captured call's argument)."""
  while u.op is Ops.BUFFER_VIEW: u = u.src[0]
  return u


def _written(linear: UOp) -> set[UOp]:
  """The buffers some call of a captured schedule writes."""
  from tinygrad.engine.realize import get_call_arg_uops, get_call_outs_ins
  out: set[UOp] = set()
  for call in linear.toposort():
    if call.op is not Ops.CALL: continue
    args, (outs, _) = get_call_arg_uops(call), get_call_outs_ins(call)
    out |= {base_buffer(args[k]) for k in outs if k < len(args)}
  return out


class _Pickler(pickle.Pickler):
  def __init__(self, f: io.BufferedIOBase, names: dict[UOp, str], written: set[UOp]):
    super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
    self.names, self.written, self.fresh = names, written, {}

  def persistent_id(self, obj: Any) -> Any:
    if not isinstance(obj, UOp) or obj.op is not Ops.BUFFER: return None
    if (name := self.names.get(obj)) is not None: return ("bound", name)
    n = self.fresh.setdefault(obj, len(self.fresh))
    if obj in self.written or obj.realized is None: return ("fresh", n, obj.device, obj.arg, obj.dtype, None)
    data = bytearray(obj.realized.nbytes)
    obj.realized.copyout(memoryview(data))
    return ("fresh", n, obj.device, obj.arg, obj.dtype, bytes(data))


class _Unpickler(pickle.Unpickler):
  def __init__(self, f: io.BufferedIOBase, bound: dict[str, UOp]):
    super().__init__(f)
    self.bound, self.fresh = bound, {}

  def persistent_load(self, pid: Any) -> Any:
    if pid[0] == "bound":
      if (u := self.bound.get(pid[1])) is None: raise KeyError(f"the graph reads a buffer named {pid[1]!r}, which this model has not")
      return u
    _, n, device, size, dtype, data = pid
    if (u := self.fresh.get(n)) is None:
      u = self.fresh[n] = UOp.new_buffer(device, size, dtype)
      if data is not None: u.buffer.ensure_allocated().copyin(memoryview(bytearray(data)))
    return u


def bound_uops(tensors: dict[str, Tensor]) -> dict[str, UOp]:
  """name -> the BUFFER under each realized tensor (the first name of a buffer several tensors view wins)."""
  out: dict[str, UOp] = {}
  seen: set[UOp] = set()
  for name, t in tensors.items():
    u = t.uop.base
    if u.op is not Ops.BUFFER or u in seen: continue
    seen.add(u)
    out[name] = u
  return out


class _SavingJit(TinyJit):
  """A TinyJit that hands its capture to `on_capture` once (to be written to the cache)."""
  def __init__(self, fxn: Callable, on_capture: Callable[[TinyJit], None]):
    super().__init__(fxn)
    self.on_capture = on_capture

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    capturing = self.cnt == 1
    ret = super().__call__(*args, **kwargs)
    if capturing and self.captured is not None: self.on_capture(self)
    return ret


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC   # NONBLOCK: a FIFO in its place cannot hang us
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def check_private(st: os.stat_result, what: str | os.PathLike, is_dir: bool) -> None:
  """PermissionError unless `st` (an fstat) is a directory (or a regular file) of this user that nobody else may write."""
  if is_dir != stat.S_ISDIR(st.st_mode) or not (is_dir or stat.S_ISREG(st.st_mode)):
    raise PermissionError(f"{what} is not a {'directory' if is_dir else 'regular file'}")
  if st.st_uid != os.getuid(): raise PermissionError(f"{what} belongs to uid {st.st_uid}, not to this user")
  if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH): raise PermissionError(f"{what} is writable by others (mode {stat.filemode(st.st_mode)})")


def open_private_dir(path: str | os.PathLike) -> int:
  """A descriptor of the directory at `path`, opened without following a link there and checked on the descriptor
  (check_private). FileNotFoundError when there is none; PermissionError naming what is wrong."""
  try: fd = os.open(path, _DIR_FLAGS)
  except OSError as e:
    if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path): raise PermissionError(f"{path} is a symbolic link") from None
    raise
  try: check_private(os.fstat(fd), path, is_dir=True)
  except BaseException:
    os.close(fd)
    raise
  return fd


class GraphCache:
  """One stage's graph cache. `warn` reports each problem once (the stage sends it to the launcher's terminal)."""

  def __init__(self, directory: str | os.PathLike | None = None, *, limit_bytes: int = DEFAULT_LIMIT,
               warn: Callable[[str], None] = lambda text: None):
    self.dir, self.limit, self.warn = pathlib.Path(directory) if directory else graph_dir(), limit_bytes, warn
    self.enabled, self.common = True, {"format": FORMAT, **build_identity()}
    self.stats = {"loaded": 0, "saved": 0, "rebuilt": 0}
    self.fd = -1   # the directory, held open: every file is reached through it
    try:
      self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
      self.fd = open_private_dir(self.dir)
      probe = f".probe-{secrets.token_hex(8)}"
      os.close(os.open(probe, _CREATE_FLAGS, 0o600, dir_fd=self.fd))
      os.unlink(probe, dir_fd=self.fd)
    except (OSError, ValueError) as e:
      self.close()
      self.enabled = False
      self.warn(f"graph cache {self.dir} is not usable ({e}); running without it (each new process captures its graphs again)")

  def close(self, _close: Callable[[int], None] = os.close) -> None:
    # os.close bound at definition: __del__ may run at interpreter exit, after the os module's globals are gone
    if self.fd >= 0: _close(self.fd)
    self.fd = -1

  def __del__(self) -> None: self.close()

  def name_for(self, key: dict) -> str:
    """The file name (in the cache's directory) of the graph with this key."""
    full = {**self.common, **key}
    return hashlib.sha256(json.dumps(full, sort_keys=True, default=str).encode()).hexdigest()[:32] + SUFFIX

  def jit(self, fxn: Callable, key: dict, tensors: Callable[[], dict[str, Tensor]]) -> TinyJit:
    """The TinyJit of `fxn` for this key: loaded from its file (binding `tensors()`), else one that captures on its first
    call and writes its file then."""
    if not self.enabled:
      j = TinyJit(fxn)
      j.cnt = 1
      return j
    name, full = self.name_for(key), {**self.common, **key}
    if (captured := self._load(name, full, tensors)) is not None:
      j = TinyJit(fxn)
      j.captured, j.cnt = captured, 2
      self.stats["loaded"] += 1
      return j
    j = _SavingJit(fxn, lambda jit: self._save(name, full, jit, tensors))
    j.cnt = 1
    return j

  def _load(self, name: str, key: dict, tensors: Callable[[], dict[str, Tensor]]) -> Any:
    """The captured graph in file `name`, or None (absent; refused, reported; bad, reported and removed)."""
    path = self.dir / name
    try:
      fd = os.open(name, _READ_FLAGS, dir_fd=self.fd)
      f = os.fdopen(fd, "rb")
    except FileNotFoundError: return None
    except OSError as e:  # a link (ELOOP) or anything else in a file's place: never followed, never read
      self.warn(f"graph cache file {path} is not used: {e.strerror or e}")
      return None
    with f:
      try: check_private(os.fstat(f.fileno()), path, is_dir=False)
      except PermissionError as e:
        self.warn(f"graph cache file {path} is not used: {e}")
        return None
      try:
        head = json.loads(f.readline())
        if head != {"key": json.loads(json.dumps(key, sort_keys=True, default=str))}: raise ValueError("it was written for another key")
        captured = _Unpickler(f, bound_uops(tensors())).load()
        if type(captured).__name__ != "CapturedJit": raise ValueError(f"it holds a {type(captured).__name__}, not a captured graph")
        os.utime(f.fileno())  # recently used
        return captured
      except Exception as e:  # noqa: BLE001 - a bad file is rebuilt, never a crash
        self.warn(f"graph cache file {path} cannot be used ({type(e).__name__}: {e}); rebuilding it")
        self.stats["rebuilt"] += 1
        self._unlink(name)
        return None

  def _unlink(self, name: str) -> None:
    try: os.unlink(name, dir_fd=self.fd)
    except FileNotFoundError: pass

  def _save(self, name: str, key: dict, jit: TinyJit, tensors: Callable[[], dict[str, Tensor]]) -> None:
    tmp = f".tmp-{secrets.token_hex(8)}{SUFFIX}"
    try:
      buf = io.BytesIO()
      buf.write(json.dumps({"key": key}, sort_keys=True, default=str).encode() + b"\n")
      _Pickler(buf, {u: n for n, u in bound_uops(tensors()).items()}, _written(jit.captured.linear)).dump(jit.captured)
      with os.fdopen(os.open(tmp, _CREATE_FLAGS, 0o600, dir_fd=self.fd), "wb") as f: f.write(buf.getvalue())
      os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
      self.stats["saved"] += 1
      self._trim()
    except Exception as e:  # noqa: BLE001 - the graph runs anyway; only the next process pays the capture again
      self.warn(f"graph cache: cannot write {self.dir / name} ({type(e).__name__}: {e})")
      try: self._unlink(tmp)
      except OSError: pass

  def _trim(self) -> None:
    files = sorted(_graph_files(self.fd), key=lambda f: f[1].st_mtime)
    total = sum(st.st_size for _, st in files)
    for name, st in files:
      if total <= self.limit: break
      total -= st.st_size
      self._unlink(name)


def _graph_files(dir_fd: int, temporary: bool = False) -> list[tuple[str, os.stat_result]]:
  """The regular files in the directory `dir_fd` that are graphs (or, with `temporary`, leftovers of a write too),
  with their lstat: links and anything else are never followed."""
  out = []
  with os.scandir(dir_fd) as it:
    for e in it:
      if not (e.name.endswith(SUFFIX) and not e.name.startswith(".") or temporary and e.name.startswith(".tmp-")): continue
      try: st = e.stat(follow_symlinks=False)
      except FileNotFoundError: continue
      if stat.S_ISREG(st.st_mode): out.append((e.name, st))
  return out


def _tinygrad_version() -> str:
  from importlib.metadata import PackageNotFoundError, version
  try: return version("tinygrad")
  except PackageNotFoundError: return "unknown"


def clear(cache_dir: str | os.PathLike | None = None) -> tuple[int, int]:
  """Remove every cached graph (and leftover temporary files) from the cache's directory, reached without following a
  link and only when it is this user's, private (PermissionError naming what is wrong: nothing is removed then).
  Returns (files, bytes) removed."""
  try: fd = open_private_dir(graph_dir(cache_dir))
  except FileNotFoundError: return 0, 0
  n = size = 0
  try:
    for name, st in _graph_files(fd, temporary=True):
      try: os.unlink(name, dir_fd=fd)
      except FileNotFoundError: continue
      n, size = n + 1, size + st.st_size
  finally: os.close(fd)
  return n, size
