"""POSIX shared-memory housekeeping: segment names, opening segments safely, free space in
/dev/shm, unlinking what we created when the process ends (atexit and SIGTERM), and cleaning
segments left behind by dead processes.

/dev/shm is writable by every user, so every entry there is treated as hostile: links are never
followed, no open can block (a FIFO planted under our prefix would otherwise hang us for ever),
and only regular files owned by our effective uid are read, attached or unlinked."""
from __future__ import annotations

import atexit
import os
import signal
import stat
import threading

from pyruntime.errors import ArenaInvalid, ShmSpaceError

SHM_DIR = "/dev/shm"
DEFAULT_PREFIX = "pyruntime"



# Flags for every open of an existing entry: no link is followed (ELOOP instead), a FIFO or device
# cannot block the open, and no terminal becomes ours.
_SAFE_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


# --- names ---------------------------------------------------------------------------------------
def segment_name(name: str) -> str:
  """`name` as a segment name "/x" (the leading "/" is optional), or ArenaInvalid.

  The one check for every name we create, attach, unlink or clean (the rules live in C,
  mo_segment_name_check): a NUL would otherwise cut the name short inside libc (or crash a
  binding), and "/" or ".." would reach outside /dev/shm."""
  from pyruntime._ring import ffi, lib
  if not isinstance(name, str): raise ArenaInvalid(f"a segment name must be a str, not {type(name).__name__}")
  shown = repr(name) if len(name) <= 80 else repr(name[:60]) + f"... ({len(name)} characters)"
  try:
    raw = name.encode()
  except UnicodeEncodeError as e:
    raise ArenaInvalid(f"invalid segment name {shown}: not encodable as UTF-8") from e
  reason = ffi.new("char **")
  if lib.mo_segment_name_check(raw, len(raw), ffi.cast("const char **", reason)) != 0:
    raise ArenaInvalid(f"invalid segment name {shown}: {ffi.string(reason[0]).decode()}")
  return name if name.startswith("/") else "/" + name


def segment_path(name: str) -> str:
  return SHM_DIR + segment_name(name)


def _check_ours(st: os.stat_result, what: str) -> None:
  if not stat.S_ISREG(st.st_mode): raise ArenaInvalid(f"{what}: not a regular file")
  if st.st_uid != os.geteuid(): raise ArenaInvalid(f"{what}: owned by uid {st.st_uid}, not by us ({os.geteuid()})")


def create_segment(name: str, size: int) -> int:
  """Create segment `name` (mode 0600, `size` bytes); returns its fd.  Fails if the name exists
  in any form (O_EXCL never follows a link)."""
  path = segment_path(name)
  fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _SAFE_OPEN, 0o600)
  try:
    os.ftruncate(fd, size)
  except BaseException:
    os.close(fd)
    os.unlink(path)
    raise
  return fd


def open_segment(name: str, writable: bool = True) -> tuple[int, int]:
  """Open an existing segment without following links or blocking; returns (fd, size).
  ArenaInvalid unless it is a regular file owned by our effective uid."""
  name = segment_name(name)
  try:
    fd = os.open(SHM_DIR + name, (os.O_RDWR if writable else os.O_RDONLY) | _SAFE_OPEN)
  except FileNotFoundError as e:
    raise ArenaInvalid(f"{name}: no such shared-memory segment") from e
  except OSError as e:
    raise ArenaInvalid(f"{name}: cannot open: {e.strerror}") from e
  try:
    st = os.fstat(fd)
    _check_ours(st, name)
  except BaseException:
    os.close(fd)
    raise
  return fd, st.st_size


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
  from pyruntime._ring import lib
  return bool(lib.mo_process_alive(pid, start))


# --- unlink on exit ------------------------------------------------------------------------------
_owned: dict[str, int] = {}   # name -> pid of the creating process (a forked child owns nothing)
_lock = threading.Lock()
_atexit_installed = False
_sigterm_installed = False
_prev_sigterm = None


def unlink_quietly(name: str) -> bool:
  """Unlink segment `name`; False if it is not there (or the name is invalid).  Unlinking never
  follows a link and never blocks, whatever the entry is."""
  try:
    os.unlink(segment_path(name))
    return True
  except (OSError, ArenaInvalid):
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
def read_owner(path: str, dir_fd: int | None = None) -> tuple[int, int] | None:
  """(creator pid, creator start time) from an arena's superblock, or None if `path` is not a
  regular file of ours holding one.  Never follows a link, never blocks."""
  try:
    fd = os.open(path, os.O_RDONLY | _SAFE_OPEN, dir_fd=dir_fd)
  except OSError:
    return None
  from pyruntime._ring import ffi, lib
  try:
    _check_ours(os.fstat(fd), path)
    head = os.pread(fd, lib.MO_SUPERBLOCK_FIXED, 0)
  except (OSError, ArenaInvalid):
    return None
  finally:
    os.close(fd)
  # The superblock's layout is C's (mo_arena_creator reads it, magic first), not restated here.
  pid, start = ffi.new("int32_t *"), ffi.new("uint64_t *")
  if lib.mo_arena_creator(ffi.from_buffer(head), len(head), pid, start) != 0: return None
  return pid[0], start[0]


def _stale(entry: str, prefix: str, dfd: int) -> bool:
  """Whether `entry` is a segment of ours whose creator is dead.  Anything that is not a regular
  file owned by our uid is never ours, whatever its name."""
  try:
    _check_ours(os.stat(entry, dir_fd=dfd, follow_symlinks=False), entry)
  except (OSError, ArenaInvalid):
    return False
  owner = read_owner(entry, dir_fd=dfd)  # checks the opened file again: no race with a swap
  if owner is None:
    pid_text = entry[len(prefix) + 1:].split("-", 1)[0]
    if not pid_text.isdigit(): return False
    owner = (int(pid_text), 0)
  pid, start = owner
  return pid > 0 and not process_alive(pid, start)


def cleanup_stale(prefix: str = DEFAULT_PREFIX, directory: str = SHM_DIR) -> list[str]:
  """Unlink the segments `{prefix}-*` whose creator process is dead; returns their names ("/...").

  The creator is read from the arena superblock; a segment without one (a creator that died
  before initialising it) is judged by the pid in its name, `{prefix}-{pid}-{hex}`.  Segments of
  live processes, segments whose owner cannot be told, and every entry that is not a regular
  file owned by our uid (FIFO, link, directory, another user's file) are left alone.  Never
  raises for what it finds in `directory` and never blocks: the SIGTERM path of a stage runs it."""
  segment_name(prefix)
  try:
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
  except OSError:
    return []
  removed = []
  try:
    try:
      entries = sorted(os.listdir(dfd))
    except OSError:
      return []
    for entry in entries:
      if not entry.startswith(prefix + "-"): continue
      if not _stale(entry, prefix, dfd): continue
      try:
        os.unlink(entry, dir_fd=dfd)  # /dev/shm is sticky: nobody else can swap our file meanwhile
        removed.append("/" + entry)
      except OSError:
        pass
  finally:
    os.close(dfd)
  return removed
