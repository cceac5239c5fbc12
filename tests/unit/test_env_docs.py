"""docs/env.md lists every environment variable the code reads, and nothing the code does not read."""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = [*ROOT.glob("pyruntime/**/*.py"), *ROOT.glob("bench/*.py"), *ROOT.glob("tests/**/*.py"), ROOT / "setup.py"]
# os.environ.get("X"), os.environ["X"], getenv("X", ...), environ.setdefault("X", ...), monkeypatch.setenv("X", ...)
READ = re.compile(r"""(?:environ(?:\.get|\.setdefault)?\s*[(\[]|getenv\()\s*["']([A-Z][A-Z0-9_]+)["']""")
OURS = re.compile(r"\bPYRUNTIME_[A-Z0-9_]+\b")
NOT_VARIABLES: set[str] = set()  # names the patterns catch that are not environment variables


def documented() -> set[str]:
  return set(re.findall(r"`([A-Z][A-Z0-9_]+)`", (ROOT / "docs" / "env.md").read_text()))


def test_every_variable_the_code_reads_is_documented():
  read: dict[str, str] = {}
  for path in SOURCES:
    if path.name == "test_env_docs.py": continue
    text = path.read_text()
    for name in READ.findall(text) + OURS.findall(text): read.setdefault(name, str(path.relative_to(ROOT)))
  missing = {n: where for n, where in read.items() if n not in documented() and n not in NOT_VARIABLES}
  assert not missing, f"read but not in docs/env.md: {missing}"


def test_every_documented_pyruntime_variable_is_read():
  code = "".join(p.read_text() for p in SOURCES if p.name != "test_env_docs.py")
  unread = {n for n in documented() if n.startswith("PYRUNTIME_") and n not in code}
  assert not unread, f"in docs/env.md but read nowhere: {unread}"
