"""Hostile input to the ring layer: entries other users plant in /dev/shm, bad segment names, and
sizes near 2**64.  Every case must end in a named error (or be skipped), never in a hang, a crash
or a wrapped-around size."""
from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
import threading

import pytest
from conftest import require

from pyruntime import errors
from pyruntime.transport import shm
from pyruntime.transport.ring import MAX_EXTENT, Arena, RingSpec, cleanup_stale, encode_header

# A private prefix that does NOT start with "pyruntime-": a `pyruntime shm clean` run elsewhere on
# this machine (another checkout, older code) must never meet the FIFOs planted here.
HOSTILE = f"pyrt_hostile{os.getpid()}"
PREFIX = "pyruntime-test"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEAD_PID = 2**22 - 1  # above PID_MAX_LIMIT: never a live process
SUPERBLOCK = struct.Struct("<8sIIQiIQ")  # fixed part of struct mo_superblock (native/mo_ring.h)
U64 = 2**64 - 1


def superblock(pid: int, start: int = 0) -> bytes:
  """The fixed part of an arena superblock naming `pid` as the creator (struct mo_superblock of
  native/mo_ring.h, restated here on purpose: the test checks C's reading against the layout)."""
  return SUPERBLOCK.pack(b"MOARENA\0", 1, 1, 8192, pid, 4096, start)


@pytest.fixture
def planted():
  """Plant entries under HOSTILE in /dev/shm; all of them are removed afterwards."""
  made: list[str] = []

  def plant(kind: str, tag: str, pid: int = DEAD_PID, content: bytes = b"") -> str:
    entry = f"{HOSTILE}-{pid}-{tag}"
    path = os.path.join(shm.SHM_DIR, entry)
    made.append(path)
    if kind == "fifo": os.mkfifo(path, 0o666)
    elif kind == "dir": os.mkdir(path)
    elif kind == "link": os.symlink(os.path.join(shm.SHM_DIR, f"{HOSTILE}-{pid}-fifo"), path)
    elif kind == "file":
      with open(path, "wb") as f: f.write(content)
    else: raise AssertionError(kind)
    return entry

  yield plant
  for path in made:
    if os.path.isdir(path) and not os.path.islink(path): os.rmdir(path)
    elif os.path.lexists(path): os.unlink(path)


def in_child(code: str, timeout: float = 30) -> subprocess.CompletedProcess:
  """Run `code` in a fresh interpreter: a regression that blocks fails on the timeout instead of
  hanging the test session."""
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                        timeout=timeout)


# --- entries other users plant in /dev/shm --------------------------------------------------------
def test_cleanup_skips_fifo_link_and_directory_without_blocking(planted):
  planted("fifo", "fifo")
  planted("link", "link")
  planted("dir", "dir")
  stale = planted("file", "stale", content=superblock(DEAD_PID))  # a real stale segment of ours
  r = in_child(f"""
    from pyruntime.transport.ring import cleanup_stale
    print(cleanup_stale({HOSTILE!r}))
  """)
  assert r.returncode == 0, r.stderr
  assert r.stdout.strip() == str(["/" + stale])  # the one stale regular file, nothing else
  for tag in ("fifo", "link", "dir"):
    assert os.path.lexists(os.path.join(shm.SHM_DIR, f"{HOSTILE}-{DEAD_PID}-{tag}"))


def test_cleanup_skips_files_of_other_users(planted):
  if os.geteuid() != 0: pytest.skip("needs root to chown a file to another uid")
  entry = planted("file", "foreign", content=superblock(DEAD_PID))
  os.chown(os.path.join(shm.SHM_DIR, entry), 65534, 65534)
  assert cleanup_stale(HOSTILE) == []
  assert os.path.exists(os.path.join(shm.SHM_DIR, entry))
  with pytest.raises(errors.ArenaInvalid, match="owned by uid 65534"):
    Arena.attach(entry)


def test_cleanup_of_too_short_files_goes_by_the_name(planted):
  dead = planted("file", "short", content=b"MOAR")
  mine = planted("file", "short", pid=os.getpid(), content=b"MOAR")
  nopid = f"{HOSTILE}-x-short"
  with open(os.path.join(shm.SHM_DIR, nopid), "wb") as f: f.write(b"MOAR")
  try:
    assert cleanup_stale(HOSTILE) == ["/" + dead]
    assert os.path.exists(os.path.join(shm.SHM_DIR, mine))
    assert os.path.exists(os.path.join(shm.SHM_DIR, nopid))
  finally:
    os.unlink(os.path.join(shm.SHM_DIR, nopid))


@pytest.mark.parametrize("kind", ["fifo", "link", "dir"])
def test_attach_refuses_what_is_not_a_regular_file(planted, kind):
  planted("fifo", "fifo")
  entry = planted(kind, kind) if kind != "fifo" else f"{HOSTILE}-{DEAD_PID}-fifo"
  r = in_child(f"""
    from pyruntime import errors
    from pyruntime.transport.ring import Arena
    try: Arena.attach({entry!r})
    except errors.ArenaInvalid as e: print("ArenaInvalid", e)
  """)
  assert r.returncode == 0, r.stderr
  assert r.stdout.startswith("ArenaInvalid"), r.stdout


def test_sigterm_cleanup_with_a_fifo_planted_exits(planted):
  """The stage's SIGTERM path: release rings, clean stale segments, exit.  A FIFO under the prefix
  must not keep the process alive."""
  planted("fifo", "fifo")
  r = in_child(f"""
    import os, signal
    from pyruntime.transport.ring import Arena, RingSpec, cleanup_stale
    a = Arena.create([RingSpec(4096, 64)], prefix={PREFIX!r})
    def on_term(signum, frame):
      a.close()
      cleanup_stale({HOSTILE!r})
      os._exit(128 + signum)
    signal.signal(signal.SIGTERM, on_term)
    os.kill(os.getpid(), signal.SIGTERM)
    signal.pause()
  """)
  assert r.returncode == 128 + 15, r.stderr


# --- names ----------------------------------------------------------------------------------------
BAD_NAMES = ["x\x00y", "/x\x00", "", "/", "..", "/..", ".", "/a/b", "../etc", "a/../b", "x" * 256, "/" + "x" * 300,
             "a\nb", "\udcff"]


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_attach_bad_names(name):
  with pytest.raises(errors.ArenaInvalid, match="invalid segment name"):
    Arena.attach(name)


@pytest.mark.parametrize("prefix", BAD_NAMES + ["x" * 245], ids=repr)
def test_create_bad_prefixes_create_nothing(prefix):
  before = set(os.listdir(shm.SHM_DIR))
  with pytest.raises(errors.ArenaInvalid, match="invalid segment name"):
    Arena.create([RingSpec(4096, 64)], prefix=prefix)
  assert set(os.listdir(shm.SHM_DIR)) <= before


def test_bad_names_elsewhere():
  assert shm.unlink_quietly("x\x00y") is False
  with pytest.raises(errors.ArenaInvalid):
    cleanup_stale("a\x00b")
  with pytest.raises(errors.ArenaInvalid, match="must be a str"):
    Arena.attach(b"/x")  # type: ignore[arg-type]
  assert shm.segment_name("x" * 255) == "/" + "x" * 255
  assert shm.segment_name("/a..b") == "/a..b"


def test_nul_name_does_not_crash_a_process():
  r = in_child("""
    from pyruntime import errors
    from pyruntime.transport.ring import Arena, RingSpec
    for call in (lambda: Arena.attach("x\\x00y"), lambda: Arena.create([RingSpec(4096, 64)], prefix="a\\x00b")):
      try: call()
      except errors.ArenaInvalid: print("ok")
  """)
  assert r.returncode == 0 and r.stdout.split() == ["ok", "ok"], (r.returncode, r.stderr)


# --- sizes near 2**64 -----------------------------------------------------------------------------
def test_max_extent_is_capped_at_what_a_ring_can_hold():
  with Arena.create([RingSpec(4096, U64, alignment=8)], prefix=PREFIX) as a:
    assert a.specs[0].max_extent == MAX_EXTENT == 2**40 - 40
    w = a.writer(0)
    for extent in (2**64 - 8, U64, 2**64, 2**70, -8):
      with pytest.raises(errors.OutputExtentInvalid):
        w.reserve(extent, timeout=0)
    with pytest.raises(errors.OutputRingCapacityExceeded):
      w.reserve(MAX_EXTENT, timeout=0)
    with pytest.raises(errors.OutputRingCapacityExceeded):
      w.reserve(4096 - 32, timeout=0)
    assert a.state(0)["head"] == 0 and w.next_sequence == 0  # nothing published, no sequence used
    mv = w.reserve(4096 - 40, timeout=0)  # exactly the capacity
    assert len(mv) == 4096 - 40
    w.abort()
  with pytest.raises(ValueError):
    RingSpec(4096, 2**64)


@pytest.mark.parametrize("extent", [2**64 - 8, 2**64 - 40, 2**63, MAX_EXTENT + 8, 4096])
def test_reader_refuses_headers_claiming_huge_extents(extent):
  with Arena.create([RingSpec(4096, U64, alignment=8)], prefix=PREFIX) as a:
    w, r = a.writer(0), a.reader(0)
    w._publish_raw(encode_header(1, 0, extent) + bytes(8))
    for _ in range(2):  # reported every time; the cursor does not move
      with pytest.raises(errors.ObjectExtentInvalid):
        r.read(timeout=0)
      assert r.position == 0 and r.expected_sequence == 0


def test_record_check_does_not_wrap_without_max_extent():
  from pyruntime._ring import ffi, lib
  for extent in (2**64 - 8, 2**64 - 40, 2**64 - 47):
    rec = encode_header(1, 0, extent) + bytes(8)
    assert lib.mo_record_check(rec, len(rec), U64, 1, 0, ffi.NULL) == lib.MO_OBJECT_EXTENT_INVALID
    assert lib.mo_record_size(extent) == 0 or lib.mo_record_size(extent) > len(rec)


def test_arena_with_a_huge_max_extent_is_refused():
  with Arena.create([RingSpec(4096, 64)], prefix=PREFIX) as a:
    off = 4096 + 512 + 16  # ring 0's control block, config line, max_extent (native/mo_ring.h)
    buf = a.buffer()
    assert struct.unpack_from("<Q", buf, off)[0] == 64
    struct.pack_into("<Q", buf, off, U64)
    with pytest.raises(errors.ArenaInvalid, match="max_extent"):
      Arena.attach(a.name)


def test_huge_timeouts_wait_instead_of_overflowing():
  with Arena.create([RingSpec(4096, 64)], prefix=PREFIX) as a:
    w, r = a.writer(0), a.reader(0)
    got = []
    t = threading.Thread(target=lambda: got.append(r.read(timeout=1e300).object_id))
    t.start()
    w.write(5, b"abcd", timeout=float("inf"))
    t.join(30)
    assert got == [5]
    with pytest.raises(ValueError):
      r.read(timeout=float("nan"))


def test_the_fast_bindings_types_take_no_address_from_python():
  """pyruntime._ringfast's Producer, Consumer and Record take their memory from a buffer they hold (checked for size
  and alignment), never from an int: constructing them with junk raises, in a process of its own so a crash shows."""
  code = textwrap.dedent("""
    from pyruntime import _ringfast as f
    bad = [(f.Record, (8, None, b"x" * 64)), (f.Record, (8, 0, b"x")), (f.Record, (bytearray(8), 0, b"x")),
           (f.Record, (bytearray(4096), 10**9, b"x")), (f.Record, (bytearray(4096), -1, b"x")), (f.Record, ()),
           (f.Producer, (8, None)), (f.Producer, (8,)), (f.Producer, (b"x" * 4096,)), (f.Producer, (bytearray(8),)),
           (f.Consumer, (8, None)), (f.Consumer, (0,)), (f.Consumer, (bytearray(8),)), (f.Consumer, ())]
    for t, args in bad:
      try: t(*args)
      except (TypeError, ValueError, BufferError, IndexError, OverflowError): continue
      raise SystemExit(f"{t.__name__}{args!r:.60} was constructed")
    r = f.Record(bytearray(4096), 1, memoryview(b"y" * 64))  # junk views inside a real buffer: bounds-checked reads
    try: bytes(r)
    except BufferError: pass
    print("ok")
  """)
  require("pyruntime._ringfast", "the ring's fast binding, built by pip install -e .")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
  assert out.returncode == 0 and out.stdout.strip() == "ok", (out.returncode, out.stdout, out.stderr[-800:])
