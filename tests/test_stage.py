"""The stage worker's control channel (SPEC §3): named WorkerFatal reasons, clean exits."""
from __future__ import annotations

import pytest
from stageproc import StageProc


@pytest.fixture
def stage():
  sp = StageProc()
  yield sp
  sp.close()


def test_ready_and_clean_shutdown(stage):
  stage.send("InitializeWorker", device="CPU")
  ready = stage.expect("WorkerReady")
  assert ready["pid"] == stage.p.pid and ready["abi_version"] == 1
  stage.send("ShutdownWorker")
  stage.expect("WorkerStopped")
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
