"""What docs/ cite of the code exists in it: the ABI version the control channel states, every command and event its
tables name, the record flags of the stream docs, and every `module.name` or `file.py` a document cites (a renamed
function leaves the docs pointing at nothing; this fails instead)."""
from __future__ import annotations

import ast
import importlib
import pathlib
import pkgutil
import re

import pyruntime
from pyruntime import protocol

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "bench" / "README.md"]
CITE = re.compile(r"`([a-z_][a-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)(?:\.([A-Za-z_][A-Za-z0-9_]*))?(?:\(\))?`")
# backticked dotted names in the docs that are JSON fields, GGUF keys or OpenAI object types, not our code's names
NOT_CODE = {"tokenizer.chat_template", "chat.completion", "chat.completion.chunk", "logprobs.content", "text.format", "speculation.draft_model"}
FILE_SUFFIXES = {"py", "js", "css", "c", "h", "md", "sh"}


def modules() -> dict[str, str]:
  """Each module of the package by its last name (the name the docs cite it by); the old flat `pyruntime.launcher`
  shim yields to the module that holds the code."""
  found: dict[str, str] = {}
  for m in pkgutil.walk_packages(pyruntime.__path__, "pyruntime."):
    short = m.name.rsplit(".", 1)[-1]
    if short != "__main__" and (short not in found or m.name.count(".") > found[short].count(".")): found[short] = m.name
  return found


def test_the_control_channel_states_the_code_s_abi_version():
  text = (ROOT / "docs" / "control-channel.md").read_text()
  assert (m := re.search(r"`protocol\.ABI_VERSION` = \*\*(\d+)\*\*", text)), "control-channel.md no longer states the ABI version"
  assert int(m.group(1)) == protocol.ABI_VERSION


def test_every_command_and_event_is_in_the_control_channel_tables_and_every_row_is_one():
  text = (ROOT / "docs" / "control-channel.md").read_text()
  rows = set(re.findall(r"^\| `([A-Z][A-Za-z]+)` \|", text, re.M))
  names = {v for c in (protocol.Command, protocol.Event) for k, v in vars(c).items() if k.isupper() and isinstance(v, str)}
  assert not names - rows, f"commands or events with no row in control-channel.md: {sorted(names - rows)}"
  fatal = {r for r in rows if r not in names}  # the WorkerFatal reasons' table
  assert fatal, "control-channel.md's tables were not found"


def test_the_record_flags_the_stream_docs_name_exist():
  text = (ROOT / "docs" / "streams.md").read_text()
  cited = set(re.findall(r"`(FLAG_[A-Z]+)`", text))
  defined = {k for k in vars(protocol) if k.startswith("FLAG_")}
  assert cited and not cited - defined, f"streams.md cites flags the code lacks: {sorted(cited - defined)}"
  assert not defined - cited, f"flags streams.md does not describe: {sorted(defined - cited)}"


def test_every_module_name_and_file_the_docs_cite_exists():
  mods, files = modules(), {p.name for p in ROOT.glob("**/*") if ".git" not in p.parts}
  missing = []
  for doc in DOCS:
    for m in CITE.finditer(doc.read_text()):
      mod, a, b = m.groups()
      if ".".join(x for x in m.groups() if x) in NOT_CODE: continue
      if a in FILE_SUFFIXES and b is None:
        if f"{mod}.{a}" not in files: missing.append(f"{doc.name}: {m.group(0)} (no such file)")
        continue
      if mod not in mods: continue
      obj = importlib.import_module(mods[mod])
      for name in (a, b):
        if name is None: break
        if not hasattr(obj, name):
          missing.append(f"{doc.name}: {m.group(0)}")
          break
        obj = getattr(obj, name)
  assert not missing, "the docs cite what the code does not have:\n" + "\n".join(missing)


CLASS_CITE = re.compile(r"`([A-Z][A-Za-z0-9]*)\.([A-Za-z_][A-Za-z0-9_]*)(?:\(\))?`")


def class_members() -> dict[str, tuple[set[str], set[str]]]:
  """Every class the package defines, by name: (its members: methods, class attributes, attributes its methods set on
  self; its bases' names), read from the source (no module is imported)."""
  out: dict[str, tuple[set[str], set[str]]] = {}
  for path in (ROOT / "pyruntime").rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if not isinstance(node, ast.ClassDef): continue
      members, bases = out.setdefault(node.name, (set(), set()))
      bases |= {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
      for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)): members.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name): members.add(item.target.id)
        elif isinstance(item, ast.Assign):
          for t in item.targets: members |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
      for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self" and isinstance(sub.ctx, ast.Store):
          members.add(sub.attr)
  return out


def test_every_class_member_the_docs_cite_exists():
  """`Class.member` citations of the package's own classes (a method moved to another class, or gone, fails here)."""
  classes, missing = class_members(), []

  def has(cls: str, name: str, seen: frozenset = frozenset()) -> bool:
    if cls not in classes or cls in seen: return False
    members, bases = classes[cls]
    return name in members or any(has(b, name, seen | {cls}) for b in bases)
  for doc in DOCS:
    for m in CLASS_CITE.finditer(doc.read_text()):
      cls, name = m.groups()
      if cls in classes and not has(cls, name): missing.append(f"{doc.name}: {m.group(0)}")
  assert not missing, "the docs cite class members the code does not have:\n" + "\n".join(missing)


def test_the_docs_index_lists_every_page():
  index = (ROOT / "docs" / "README.md").read_text()
  assert [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "README.md" and f"]({p.name})" not in index] == []


PATH_CITE = re.compile(r"`((?:pyruntime|tests|bench|native|docs|\.ci)/[A-Za-z0-9_./-]+?\.(?:py|md|sh|h|c|js|css|toml))(?:::[^`]*)?`")


def test_every_path_the_docs_cite_exists():
  """A backticked path into the repository (`tests/integration/test_rows.py`, `pyruntime/stage/compute/model.py`) names a
  file that is there: a moved or renamed file leaves no page pointing at nothing. Dated results are records of their day
  and are not checked."""
  missing = [f"{doc.name}: {m.group(1)}" for doc in DOCS for m in PATH_CITE.finditer(doc.read_text()) if not (ROOT / m.group(1)).is_file()]
  assert not missing, "the docs cite files that are not there:\n" + "\n".join(missing)
