"""The stage worker's control channel (docs/control-channel.md): named WorkerFatal reasons, clean exits."""
from __future__ import annotations

import os

import pytest
from stageproc import StageProc

from pyruntime.protocol import ABI_VERSION, FLAG_CLOSE, FLAG_ERROR, FLAG_OPEN, Command, Event, decode_json, encode_json, object_id


@pytest.fixture
def stage():
  sp = StageProc()
  yield sp
  sp.close()


def test_ready_and_clean_shutdown(stage):
  stage.send(Command.INITIALIZE_WORKER, device="CPU")
  ready = stage.expect(Event.WORKER_READY)
  assert ready["pid"] == stage.p.pid and ready["abi_version"] == ABI_VERSION
  stage.send(Command.SHUTDOWN_WORKER)
  stage.expect(Event.WORKER_STOPPED)
  assert stage.p.wait(timeout=10) == 0


@pytest.mark.parametrize("lines, reason", [
  (['{"command": "Frobnicate"}'], "UnknownCommand"),
  (["this is not json"], "InvalidCommand"),
  (['{"command": "InitializeWorker", "abi_version": 99}'], "UnsupportedHelperAbi"),
  (['{"command": "LoadWeights", "model": "/nowhere.gguf"}'], "RoleNotConfigured"),
  (['{"command": "ConfigureRole", "stage": 0, "start": 0, "end": 2}', '{"command": "InstallRing", "arena": "/x", "ingress": 0, "egress": 1}'],
   "WeightsNotLoaded"),
  (['{"command": "ConfigureRole", "stage": 0, "start": 0, "end": 2}', '{"command": "LoadWeights", "model": "/nowhere/model.gguf"}'],
   "GgufLocalPathMissing"),
  (['{"command": "ConfigureRole", "stage": 0, "start": 3, "end": 3}'], "LayerRangeInvalid"),
  (['{"command": "ConfigureRole", "stage": 0}'], "InvalidCommand"),
  (['{"command": "EncodePrompt", "prompt": "hi"}'], "WeightsNotLoaded"),
])
def test_named_fatal_and_exit(stage, lines, reason):
  for line in lines: stage.send_raw(line)
  ev = stage.fatal()
  assert ev["reason"] == reason, ev
  assert ev["message"]


# --- the data path on real rings, with a tiny model ---------------------------------------------
import struct  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from tinymodels import write_tiny_gguf  # noqa: E402

from pyruntime import errors  # noqa: E402
from pyruntime.transport.ring import Arena, RingSpec  # noqa: E402

DIM, BLOCKS = 64, 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  return str(write_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", dim=DIM, n_blocks=BLOCKS))


def wired(stage: StageProc, tiny: str, start: int, end: int, ingress_alignment: int = 4, **install) -> tuple[Arena, object, object]:
  """A stage owning [start, end) between two rings of a fresh arena; returns (arena, writer into it, reader after it)."""
  loaded = stage.setup(tiny, start, end, slots=2, max_context=64)
  arena = Arena.create([RingSpec(1 << 16, 16384, ingress_alignment), RingSpec(1 << 16, 16384, 4)], prefix="pyruntime-test")
  stage.send("InstallRing", arena=arena.name, ingress=0, egress=1, **install)
  stage.expect("RingInstalled")
  return arena, arena.writer(0), arena.reader(1), loaded


def open_stream(w, stream: int = 1, slot: int = 0) -> None:
  w.write(object_id(stream, 0), encode_json({"slot": slot, "identity": {"request": stream}, "sampling": {}, "end_ids": []}, 4), FLAG_OPEN)


def header(magic=b"MO01", version=1, header_len=40, oid=0, seq=0, extent=8, flags=0, reserved=0) -> bytes:
  return struct.pack("<4sHHQQQII", magic, version, header_len, oid, seq, extent, flags, reserved)


@pytest.mark.parametrize("raw, reason", [
  (header(magic=b"XX01") + bytes(8), "InvalidObjectMagic"),
  (header(version=2) + bytes(8), "InvalidObjectHeader"),
  (header(reserved=7) + bytes(8), "InvalidObjectHeader"),
  (header(extent=1 << 20) + bytes(8), "ObjectExtentInvalid"),
  (header(extent=6) + bytes(8), "ObjectExtentAlignmentViolation"),
  (header(seq=5) + bytes(8), "SequenceViolation"),
  (b"MO01" + bytes(12), "EofBeforeFullHeader"),
])
def test_bad_record_on_ingress_is_fatal_by_name(stage, tiny, raw, reason):
  arena, w, r, _ = wired(stage, tiny, 0, 2)
  try:
    w._publish_raw(raw)
    ev = stage.fatal()
    assert ev["reason"] == reason, ev
    if reason == "SequenceViolation": assert (ev["expected"], ev["actual"]) == (0, 5)
    with pytest.raises(errors.RingClosed): r.read(timeout=2)  # the stage closed its egress on the way out
  finally:
    arena.close()


def stream_error(r) -> dict:
  """Past the OPEN echo, the ERROR record a stage sends down for one stream."""
  assert r.read(timeout=30).flags == FLAG_OPEN
  r.release()
  rec = r.read(timeout=60)
  assert rec.flags & FLAG_ERROR, rec.flags
  info = decode_json(rec.payload)
  r.release()
  return info


def still_serves(stage, w, r, stream: int, slot: int) -> None:
  """The stage is alive and computes another stream."""
  open_stream(w, stream, slot)
  w.write(object_id(stream, 0), np.array([1, 2, 3], dtype="<u4"))
  assert r.read(timeout=30).flags == FLAG_OPEN
  r.release()
  rec = r.read(timeout=120)
  assert rec.flags == 0 and rec.object_id >> 32 == stream
  r.release()
  assert stage.p.poll() is None


@pytest.mark.parametrize("start, end, payload, reason", [
  (0, 2, np.array([1, 2, 3], dtype="<u2").tobytes(), "PayloadNotU32Aligned"),
  (0, 2, np.array([1, 10**6], dtype="<u4").tobytes(), "TokenIdInvalid"),
  (2, 4, np.zeros(DIM + 1, dtype="<f4").tobytes(), "ActivationExtentInvalid"),
])
def test_bad_payload_ends_that_stream_by_name(stage, tiny, start, end, payload, reason):
  """A record a stage cannot compute ends its stream alone: an ERROR record names the reason, the stage runs on."""
  arena, w, r, _ = wired(stage, tiny, start, end, ingress_alignment=2)
  try:
    open_stream(w)
    w.write(object_id(1, 0), payload)
    info = stream_error(r)
    assert info["reason"] == reason and info["stage"] == 0 and info["message"]
    w.write(object_id(1, 0), b"", FLAG_CLOSE)
    assert r.read(timeout=30).flags == FLAG_CLOSE
    r.release()
    if start == 0: still_serves(stage, w, r, stream=2, slot=0)
  finally:
    arena.close()


def test_stream_rules(stage, tiny):
  arena, w, r, _ = wired(stage, tiny, 0, 2)
  try:
    w.write(object_id(9, 0), np.array([1, 2], dtype="<u4"))  # never opened: the ring's stream order is broken
    assert stage.fatal()["reason"] == "StreamNotOpen"
  finally:
    arena.close()


def test_position_must_follow_the_cache(stage, tiny):
  arena, w, r, _ = wired(stage, tiny, 0, 2)
  try:
    open_stream(w)
    w.write(object_id(1, 3), np.array([1, 2], dtype="<u4"))
    assert stream_error(r)["reason"] == "StreamPositionInvalid"
  finally:
    arena.close()


@pytest.mark.parametrize("upstream, reason", [
  ({"arch": "qwen2", "ingress": {"arch": "qwen2", "point": 0, "tensors": {"token_ids": ["uint32", 1]}},
    "egress": {"arch": "qwen2", "point": 2, "tensors": {"hidden_states": ["float32", DIM]}}}, "BoundaryArchitectureMismatch"),
  ({"arch": "llama", "ingress": {"arch": "llama", "point": 0, "tensors": {"token_ids": ["uint32", 1]}},
    "egress": {"arch": "llama", "point": 2, "tensors": {"hidden_states": ["float32", DIM * 2]}}}, "BoundarySchemaMismatch"),
  ({"arch": "llama", "ingress": {"arch": "llama", "point": 0, "tensors": {"token_ids": ["uint32", 1]}},
    "egress": {"arch": "llama", "point": 1, "tensors": {"hidden_states": ["float32", DIM]}}}, "BoundarySchemaMismatch"),
])
def test_boundary_of_another_schema_is_refused(stage, tiny, upstream, reason):
  stage.setup(tiny, 2, 4)
  arena = Arena.create([RingSpec(1 << 12, 1024), RingSpec(1 << 12, 1024)], prefix="pyruntime-test")
  try:
    stage.send("InstallRing", arena=arena.name, ingress=0, egress=1, ingress_boundary=upstream)
    assert stage.fatal()["reason"] == reason
  finally:
    arena.close()


def test_layer_range_outside_the_model(stage, tiny):
  stage.send("InitializeWorker", device="CPU")
  stage.send("ConfigureRole", stage=0, start=2, end=BLOCKS + 3)
  stage.send("LoadWeights", model=tiny)
  assert stage.fatal()["reason"] == "LayerRangeInvalid"


def test_step_commands_drive_one_record_at_a_time(stage, tiny):
  """RingReadable / ExecuteStep / ReleaseDeviceObject: an outside orchestrator's single steps."""
  from tinygrad.llm.model import Transformer
  arena, w, r, loaded = wired(stage, tiny, 0, BLOCKS, mode="step")
  try:
    assert loaded["is_head"] and loaded["is_tail"]
    stage.send("ExecuteStep")
    assert stage.fatal()["reason"] == "NoObjectLoaded"
  finally:
    arena.close()
  stage.close()
  stage.__init__()
  arena, w, r, loaded = wired(stage, tiny, 0, BLOCKS, mode="step")
  try:
    stage.send("RingReadable", timeout_s=0)
    stage.expect("RingIdle")
    open_stream(w)
    prompt = [5, 17, 42, 7]
    w.write(object_id(1, 0), np.array(prompt, dtype="<u4"))
    for expect_flags in (FLAG_OPEN, 0):
      stage.send("RingReadable", timeout_s=5)
      ev = stage.expect("ObjectLoaded")
      assert ev["flags"] == expect_flags and ev["stream"] == 1 and ev["position"] == 0
      stage.send("ExecuteStep"); stage.expect("StepExecuted")
      stage.send("ReleaseDeviceObject"); stage.expect("ObjectReleased")
    assert r.read(timeout=5).flags == FLAG_OPEN
    r.release()
    token = int(r.read(timeout=5).array("<u4")[0])
    r.release()
    model, _ = Transformer.from_gguf(tiny, max_context=64)
    assert token == next(model.generate(list(prompt)))
    stage.send("UninstallRing"); stage.expect("RingUninstalled")   # the rings go; the weights stay
    stage.send("RingReadable", timeout_s=0)
    assert stage.fatal()["reason"] == "RingNotInstalled"
  finally:
    arena.close()


def test_profiler_samples_the_data_loop_thread(tiny):
  """PYRUNTIME_PROFILE=1: ProfileReport events count samples of the stage's main thread, where its loop runs."""
  sp = StageProc(env=dict(os.environ, PYRUNTIME_PROFILE="1", PYRUNTIME_PROFILE_INTERVAL_MS="2", PYRUNTIME_PROFILE_REPORT_S="0.3"))
  try:
    sp.send(Command.INITIALIZE_WORKER, device="CPU")
    sp.expect(Event.WORKER_READY)
    report = sp.expect(Event.PROFILE_REPORT, timeout=30)
    assert report["samples"] > 0 and report["lines"] and "stage/worker.py" in " ".join(x["where"] for x in report["lines"])
  finally:
    sp.close()


# --- hostile control lines: every one ends the stage with its named reason, never a bare traceback or a hang -------
ROLE = '{"command": "ConfigureRole", "stage": 0, "start": 0, "end": 2}'


@pytest.mark.parametrize("lines, reason", [
  (['{"command": ["InitializeWorker"]}'], "InvalidCommand"),
  (['{"command": {"name": "InitializeWorker"}}'], "InvalidCommand"),
  (['{"command": null}'], "InvalidCommand"),
  (['{"command": 7}'], "InvalidCommand"),
  (['["InitializeWorker"]'], "InvalidCommand"),
  (['"InitializeWorker"'], "InvalidCommand"),
  (["[" * 100_000 + "]" * 100_000], "InvalidCommand"),
  (['{"command": "InitializeWorker", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"], "InvalidCommand"),
  (['{"command": "ConfigureRole", "stage": ' + "9" * 5000 + ', "start": 0, "end": 2}'], "InvalidCommand"),
  (['{"command": "ConfigureRole", "stage": 0, "start": 0, "end": 1e400}'], "InvalidCommand"),
  (['{"command": "ConfigureRole", "stage": 0, "start": 0, "end": NaN}'], "InvalidCommand"),
  (['{"command": "ConfigureRole", "stage": "0", "start": 0, "end": 2}'], "InvalidCommand"),
  (['{"command": "ConfigureRole", "stage": true, "start": 0, "end": 2}'], "InvalidCommand"),
  (['{"command": "ConfigureRole", "stage": 0, "start": 0, "end": 2, "slots": 1e9}'], "InvalidCommand"),
  (['{"command": "ConfigureRole", "stage": 0, "start": 0, "end": 2, "max_context": "big"}'], "InvalidCommand"),
  (['{"command": "ConfigureRole", "stage": 0, "start": 0, "end": 2, "boundary_dtype": ["f"]}'], "InvalidCommand"),
  (['{"command": "ConfigureRole", "stage": 0, "start": 0, "end": 2, "weights": "int4"}'], "InvalidCommand"),
  (['{"command": "ConfigureRole", "stage": 0, "start": 0, "end": 2, "prefill_share": -0.5}'], "InvalidCommand"),
  (['{"command": "ConfigureRole", "stage": 0, "start": 0, "end": 2, "prefill_share": "half"}'], "InvalidCommand"),
  (['{"command": "InitializeWorker", "cpus": "abc"}'], "InvalidCommand"),
  (['{"command": "InitializeWorker", "cpus": [99999]}'], "InvalidCommand"),
  (['{"command": "InitializeWorker", "device": 5}'], "InvalidCommand"),
  (['{"command": "InitializeWorker", "abi_version": "2"}'], "UnsupportedHelperAbi"),
  ([ROLE, '{"command": "LoadWeights", "model": 5}'], "ModelLoadFailed"),
  ([ROLE, '{"command": "LoadWeights", "model": ["a.gguf"]}'], "ModelLoadFailed"),
  ([ROLE, '{"command": "LoadWeights", "model": {"path": "a.gguf"}}'], "ModelLoadFailed"),
  ([ROLE, '{"command": "LoadWeights", "model": "/tmp/a\\u0000b.gguf"}'], "GgufLocalPathMissing"),
  ([ROLE, '{"command": "LoadWeights", "model": "/"}'], "GgufLocalPathMissing"),
  ([ROLE, '{"command": "LoadWeights", "model": "/proc"}'], "GgufLocalPathMissing"),
  ([ROLE, '{"command": "LoadWeights", "model": "/etc/passwd"}'], "ModelLoadFailed"),
  ([ROLE, '{"command": "LoadWeights", "model": "x.gguf", "cache_dir": 3}'], "ModelLoadFailed"),
])
def test_malformed_command_is_named(stage, lines, reason):
  for line in lines: stage.send_raw(line)
  ev = stage.fatal(timeout=60)
  assert ev["reason"] == reason, ev
  assert ev["message"] and "traceback" not in ev, ev


@pytest.mark.parametrize("raw", [b"\xff\xfe{}\n", b'{"command": "InitializeWorker", "device": "\xc3("}\n', b"\xed\xa0\x80\n"])
def test_invalid_utf8_is_a_named_fatal_not_a_hang(raw):
  import os
  sp = StageProc(env=dict(os.environ, PYTHONIOENCODING="utf-8"))
  try:
    sp.p.stdin.buffer.write(raw); sp.p.stdin.flush()
    ev = sp.fatal(timeout=60)
    assert ev["reason"] == "InvalidCommand" and "UTF-8" in ev["message"], ev
  finally:
    sp.close()


def test_valid_utf8_and_blank_lines_still_work(stage):
  stage.send_raw("")
  stage.send_raw("   ")
  stage.send(Command.INITIALIZE_WORKER, device="CPU", note="naïve ✓")
  stage.expect(Event.WORKER_READY)
  stage.send(Command.SHUTDOWN_WORKER)
  stage.expect(Event.WORKER_STOPPED)
  assert stage.p.wait(timeout=10) == 0


@pytest.fixture
def loaded(tiny):
  sp = StageProc()
  sp.setup(tiny, 0, BLOCKS, slots=2, max_context=64)
  yield sp
  sp.close()


@pytest.mark.parametrize("command, args, reason", [
  ("InstallRing", {"ingress": 0, "egress": 1}, "InvalidCommand"),
  ("InstallRing", {"arena": 5, "ingress": 0, "egress": 1}, "InvalidCommand"),
  ("InstallRing", {"arena": "/pyruntime-none-such", "ingress": 0, "egress": 1}, "ArenaInvalid"),
  ("InstallRing", {"arena": "/x", "ingress": "0", "egress": 1}, "InvalidCommand"),
  ("InstallRing", {"arena": "/x", "ingress": 0, "egress": 1, "mode": "fast"}, "InvalidCommand"),
  ("InstallRing", {"arena": "/x", "ingress": 0, "egress": 1, "ingress_boundary": [1]}, "InvalidCommand"),
  ("InstallRing", {"arena": "/x", "ingress": 0, "egress": 1, "ingress_boundary": {"egress": 3}}, "BoundarySchemaMismatch"),
  ("DecodeTokens", {"token_ids": [10**9]}, "TokenIdInvalid"),
  ("DecodeTokens", {"token_ids": [-1]}, "TokenIdInvalid"),
  ("DecodeTokens", {"token_ids": ["1"]}, "TokenIdInvalid"),
  ("DecodeTokens", {"token_ids": [1.0]}, "TokenIdInvalid"),
  ("DecodeTokens", {"token_ids": [True]}, "TokenIdInvalid"),
  ("DecodeTokens", {"token_ids": [None]}, "TokenIdInvalid"),
  ("DecodeTokens", {"token_ids": "12"}, "TokenIdInvalid"),
  ("DecodeTokens", {"token_ids": {"a": 1}}, "TokenIdInvalid"),
  ("EncodePrompt", {"token_ids": [1, 10**9]}, "TokenIdInvalid"),
  ("EncodePrompt", {"token_ids": "1"}, "TokenIdInvalid"),
  ("EncodePrompt", {"prompt": 5}, "InvalidCommand"),
  ("EncodePrompt", {"messages": "hi"}, "InvalidCommand"),
  ("EncodePrompt", {"messages": [1, 2]}, "InvalidOption"),
  ("EncodePrompt", {"messages": [{"role": "user", "content": {"x": [1]}}]}, None),
  ("EncodePrompt", {}, "InvalidOption"),
  ("InferPrompt", {"prompt": "hi", "max_tokens": "4"}, "InvalidCommand"),
  ("InferPrompt", {"prompt": "hi", "sampling": [1]}, "InvalidCommand"),
  ("InferPrompt", {"prompt": "hi", "sampling": {"bogus": 1}}, "InvalidOption"),
  ("InferPrompt", {"token_ids": [1, 99999999]}, "TokenIdInvalid"),
  ("LoadWeights", {"model": "x.gguf"}, "InvalidCommand"),
  ("RingReadable", {}, "RingNotInstalled"),
])
def test_bad_arguments_after_load_are_named(loaded, command, args, reason):
  loaded.send(command, **args)
  ev = loaded.next_event(60)
  if reason is None:  # a valid request after all: answered, then the stage still serves
    assert ev["event"] != "WorkerFatal" or ev["reason"] != "UnhandledWorkerException", ev
    return
  assert ev["event"] == "WorkerFatal" and ev["reason"] == reason, ev
  assert ev["message"] and "traceback" not in ev, ev
  assert loaded.p.wait(timeout=10) != 0


def test_decode_tokens_passes_ids_to_the_tokenizer(loaded):
  loaded.send("DecodeTokens", token_ids=[1, 2, 3])
  assert isinstance(loaded.expect("TokensDecoded")["text"], str)


def test_a_batched_steps_records_are_published_together(stage, tiny):
  """The rows of one batched decode step reach the next ring as one MORE group that becomes visible at once (one
  publishing store: its reader wakes once per step, not once per row)."""
  from pyruntime.protocol import FLAG_MORE
  arena, w, r, _ = wired(stage, tiny, 0, BLOCKS)
  try:
    for sid, slot in ((1, 0), (2, 1)):
      open_stream(w, sid, slot)
      w.write(object_id(sid, 0), np.array([1, 2, 3], dtype="<u4"))
    firsts = {}
    while len(firsts) < 2:  # the OPEN echoes, then each prompt's first token
      rec = r.read(timeout=120)
      if not rec.flags & FLAG_OPEN: firsts[rec.object_id >> 32] = int.from_bytes(rec.payload, "little")
      r.release()
    for rnd in range(3):
      w.write(object_id(1, 3 + rnd), np.array([firsts[1]], dtype="<u4"), FLAG_MORE)
      w.write(object_id(2, 3 + rnd), np.array([firsts[2]], dtype="<u4"))
      first = r.read(timeout=120)
      assert first.flags & FLAG_MORE, first.flags
      second = r.read(timeout=0)  # published with the first: no wait, however long the second row took to sample
      assert not second.flags & FLAG_MORE and {first.object_id >> 32, second.object_id >> 32} == {1, 2}
      firsts = {rec.object_id >> 32: int.from_bytes(rec.payload, "little") for rec in (first, second)}
      r.release()
  finally:
    arena.close()


def test_a_structured_streams_grammar_may_come_after_its_open(stage, tiny):
  """SetGrammar races the OPEN record (control channel against rings): a tail that meets the OPEN first reads ahead in
  its commands for the grammar, runs other commands in their order afterwards, and masks the first token with it."""
  from pyruntime.text.grammar import grammar_for
  from pyruntime.text.tokenizer import Tokenizer
  arena, w, r, _ = wired(stage, tiny, 0, 4)  # the whole tiny model: head and tail
  try:
    schema = {"type": "object", "properties": {"k": {"enum": ["v"]}}, "required": ["k"], "additionalProperties": False}
    w.write(object_id(1, 0), encode_json({"slot": 0, "identity": {"request": 1}, "sampling": {}, "end_ids": [], "grammar": True}, 4),
            FLAG_OPEN)
    w.write(object_id(1, 0), np.array([1, 2, 3], dtype="<u4"))
    time.sleep(0.5)  # the tail is waiting for the grammar now
    stage.send("QueryStats")  # read ahead and kept for after
    stage.send("SetGrammar", stream=1, grammar=grammar_for({"type": "json_schema", "json_schema": {"schema": schema}}))
    assert r.read(timeout=30).flags == FLAG_OPEN
    r.release()
    rec = r.read(timeout=60)
    token = int.from_bytes(rec.payload[:4], "little")
    r.release()
    assert Tokenizer.from_gguf(tiny).token_bytes(token).startswith(b"{")  # what the grammar allows first
    assert stage.expect("StageStats")["stage"] == 0  # the command read ahead still ran
  finally:
    arena.close()
