"""The ring across processes: closing, and a peer killed with SIGKILL (PeerDead in < 2 s, never a
hang).  The peers are separate interpreters started with subprocess."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from pyruntime import errors
from pyruntime.transport.ring import Arena, RingSpec

pytestmark = pytest.mark.usefixtures("ring_binding")  # every test over both bindings (tests/conftest.py)

PREFIX = "pyruntime-test"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))




def peer(code: str) -> subprocess.Popen:
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_line(proc: subprocess.Popen, want: str) -> None:
  line = proc.stdout.readline().strip()
  if line != want:
    proc.kill()
    raise AssertionError(f"peer said {line!r}, expected {want!r}; stderr:\n{proc.communicate()[1]}")


def kill_later(proc: subprocess.Popen, delay: float, when: list) -> threading.Thread:
  def run():
    time.sleep(delay)
    when.append(time.monotonic())
    proc.send_signal(signal.SIGKILL)
  t = threading.Thread(target=run, daemon=True)
  t.start()
  return t


def test_reader_gets_peer_dead_after_producer_sigkill():
  with Arena.create([RingSpec(4096, 256)], prefix=PREFIX) as a:
    r = a.reader(0)
    p = peer(f"""
      import sys, time
      from pyruntime.transport.ring import Arena
      w = Arena.attach({a.name!r}).writer(0)
      for i in range(3): w.write(i, b"rec%d" % i)
      print("ready", flush=True)
      time.sleep(60)
    """)
    try:
      wait_line(p, "ready")
      assert [bytes(r.read(timeout=5).payload) for _ in range(3)] == [b"rec0", b"rec1", b"rec2"]
      r.release()
      assert r.peer_alive()
      killed = []
      kill_later(p, 0.3, killed)
      with pytest.raises(errors.PeerDead):
        r.read()  # no timeout: only the death of the producer ends this wait
      assert killed and time.monotonic() - killed[0] < 2.0
      assert not r.peer_alive()  # the zombie (not yet reaped by us) counts as dead
    finally:
      p.kill()
      p.wait()


def test_reader_drains_before_peer_dead():
  with Arena.create([RingSpec(4096, 256)], prefix=PREFIX) as a:
    r = a.reader(0)
    p = peer(f"""
      import os, signal
      from pyruntime.transport.ring import Arena
      w = Arena.attach({a.name!r}).writer(0)
      for i in range(5): w.write(i, b"x" * 8)
      os.kill(os.getpid(), signal.SIGKILL)
    """)
    p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL
    assert [r.read(timeout=5).object_id for _ in range(5)] == list(range(5))
    t0 = time.monotonic()
    with pytest.raises(errors.PeerDead):
      r.read(timeout=10)
    assert time.monotonic() - t0 < 2.0
    # a new producer can take over the dead one's side and continue the sequence
    w = a.writer(0)
    assert w.write(9, b"y" * 8) == 5
    assert r.read().sequence == 5


def test_writer_gets_peer_dead_after_consumer_sigkill():
  with Arena.create([RingSpec(1024, 512)], prefix=PREFIX) as a:
    w = a.writer(0)
    p = peer(f"""
      import time
      from pyruntime.transport.ring import Arena
      r = Arena.attach({a.name!r}).reader(0)
      print("ready", flush=True)
      time.sleep(60)
    """)
    try:
      wait_line(p, "ready")
      while True:
        try:
          w.write(0, bytes(200), timeout=0)
        except errors.WouldBlock:
          break
      killed = []
      kill_later(p, 0.3, killed)
      with pytest.raises(errors.PeerDead):
        w.write(1, bytes(200))  # blocked on a full ring
      assert killed and time.monotonic() - killed[0] < 2.0
      assert not w.peer_alive()
    finally:
      p.kill()
      p.wait()


def test_close_across_processes():
  with Arena.create([RingSpec(1 << 16, 1024), RingSpec(4096, 64)], prefix=PREFIX) as a:
    r = a.reader(0)
    back = a.writer(1)
    p = peer(f"""
      from pyruntime.transport.ring import Arena
      with Arena.attach({a.name!r}) as arena:
        w = arena.writer(0)
        r = arena.reader(1)
        for i in range(1000): w.write(i, i.to_bytes(4, "little") * 4)
        w.close()
        try:
          r.read(timeout=10)
        except Exception as e:
          print(type(e).__name__, flush=True)
    """)
    got = []
    for rec in r:  # ends when the producer closes, after every record
      got.append((rec.object_id, int.from_bytes(rec.payload[:4], "little")))
    assert got == [(i, i) for i in range(1000)]
    back.close()  # the peer's read on ring 1 ends with RingClosed
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert out.strip() == "RingClosed"
