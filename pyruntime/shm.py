"""POSIX shared-memory housekeeping: free space in /dev/shm, unlinking what we created when the
process ends (atexit and SIGTERM), and cleaning segments left behind by dead processes."""
from __future__ import annotations

import atexit
import os
import signal
import struct
import threading

import posix_ipc

from .errors import ShmSpaceError

SHM_DIR = "/dev/shm"
DEFAULT_PREFIX = "pyruntime"

# The superblock's fixed part (native/mo_ring.h, struct mo_superblock).
SUPERBLOCK = struct.Struct("<8sIIQiIQ")
ARENA_MAGIC = b"MOARENA\0"


def check_free_space(size: int, directory: str = SHM_DIR) -> None:
  """Raise ShmSpaceError when `directory` (a tmpfs) cannot hold `size` more bytes.

  Without this check an arena larger than the free space maps fine and dies with SIGBUS on the
  first touch of a page the tmpfs cannot back."""
  try: st = os.statvfs(directory)
  except OSError: return  # no /dev/shm to ask (shm_open still works, or fails clearly)
  free = st.f_bavail * st.f_frsize
  if size > free: raise ShmSpaceError(space_message(size, free, directory))


def space_message(size: int, free: int | None, directory: str = SHM_DIR) -> str:
  have = f"has {free / 2**20:.1f} MiB free" if free is not None else "is full"
  need_gib = max(1, -(-size * 2 // 2**30))  # twice the arena, in GiB, at least 1
  return (f"{directory} {have} but the arena needs {size / 2**20:.1f} MiB. Enlarge it, e.g. "
          f"`sudo mount -o remount,size={need_gib}G {directory}` (in Docker: `docker run --shm-size={need_gib}g`), "
          f"or ask for smaller rings.")


def process_alive(pid: int, start: int = 0) -> bool:
  """True unless process `pid` is gone (or a zombie, or a different process with a recycled pid
  when `start`, its /proc start time, is given)."""
  from ._ring import lib
  return bool(lib.mo_process_alive(pid, start))


# --- unlink on exit ------------------------------------------------------------------------------
_owned: dict[str, int] = {}   # name -> pid of the creating process (a forked child owns nothing)
_lock = threading.Lock()
_atexit_installed = False
_sigterm_installed = False
_prev_sigterm = None


def unlink_quietly(name: str) -> bool:
  try:
    posix_ipc.unlink_shared_memory(name)
    return True
  except posix_ipc.ExistentialError:
    return False


def register_owned(name: str) -> None:
  with _lock:
    _owned[name] = os.getpid()
  _install_handlers()


def unregister_owned(name: str) -> None:
  with _lock:
    _owned.pop(name, None)


def cleanup_owned() -> list[str]:
  """Unlink every segment this process created and has not closed yet."""
  me = os.getpid()
  with _lock:
    mine = [n for n, pid in _owned.items() if pid == me]
    for n in mine: del _owned[n]
  return [n for n in mine if unlink_quietly(n)]


def _on_sigterm(signum, frame):
  cleanup_owned()
  prev = _prev_sigterm
  if callable(prev):
    prev(signum, frame)
  elif prev == signal.SIG_IGN:
    return
  else:  # SIG_DFL (or a handler installed outside Python): die of SIGTERM as we would have
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_handlers() -> None:
  """atexit, plus a SIGTERM handler that chains to the one it replaces.  Signal handlers can only
  be set from the main thread: until an arena is created there, we rely on atexit (and
  cleanup_stale after a SIGKILL)."""
  global _atexit_installed, _sigterm_installed, _prev_sigterm
  if not _atexit_installed:
    _atexit_installed = True
    atexit.register(cleanup_owned)
  if not _sigterm_installed and threading.current_thread() is threading.main_thread():
    try:
      prev = signal.getsignal(signal.SIGTERM)
      if prev is not _on_sigterm:
        _prev_sigterm = prev
        signal.signal(signal.SIGTERM, _on_sigterm)
      _sigterm_installed = True
    except (ValueError, OSError):
      pass


# --- stale segments ------------------------------------------------------------------------------
def read_owner(path: str) -> tuple[int, int] | None:
  """(creator pid, creator start time) from an arena's superblock, or None if it is not one."""
  try:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
  except OSError:
    return None
  try:
    head = os.pread(fd, SUPERBLOCK.size, 0)
  finally:
    os.close(fd)
  if len(head) < SUPERBLOCK.size: return None
  magic, _version, _count, _size, pid, _sbsize, start = SUPERBLOCK.unpack(head)
  if magic != ARENA_MAGIC: return None
  return pid, start


def cleanup_stale(prefix: str = DEFAULT_PREFIX, directory: str = SHM_DIR) -> list[str]:
  """Unlink the segments `{prefix}-*` whose creator process is dead; returns their names ("/...").

  The creator is read from the arena superblock; a segment without one (a creator that died
  before initialising it) is judged by the pid in its name, `{prefix}-{pid}-{hex}`.  Segments of
  live processes, and segments whose owner cannot be told, are left alone."""
  try:
    entries = sorted(os.listdir(directory))
  except OSError:
    return []
  removed = []
  for entry in entries:
    if not entry.startswith(prefix + "-"): continue
    path = os.path.join(directory, entry)
    owner = read_owner(path)
    if owner is None:
      pid_text = entry[len(prefix) + 1:].split("-", 1)[0]
      if not pid_text.isdigit(): continue
      owner = (int(pid_text), 0)
    pid, start = owner
    if pid <= 0 or process_alive(pid, start): continue
    if unlink_quietly("/" + entry): removed.append("/" + entry)
  return removed
