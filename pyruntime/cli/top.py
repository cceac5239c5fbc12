"""`pyruntime top URL`: a running server's pipeline in the terminal, from its /stats (docs/stats.md), refreshed every
second, so a user sees whether a split is balanced: per stage its layers, busy %, rows per step and what it does, the
ring between stages, streams, tokens/s, the prefix cache's hit rate and, with a kv_budget, the positions held and the
streams preempted."""
from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any, TextIO

from pyruntime import errors


def fetch(url: str, timeout: float = 10.0) -> dict[str, Any]:
  """The server's latest view (/stats without history). ServerUnreachable naming the URL when it cannot be read."""
  try:
    with urllib.request.urlopen(url.rstrip("/") + "/stats?history=0", timeout=timeout) as r: body = json.loads(r.read())
  except (urllib.error.URLError, OSError, ValueError) as e: raise errors.ServerUnreachable(f"{url}/stats: {e}") from None
  if not isinstance(body, dict) or "now" not in body: raise errors.ServerUnreachable(f"{url}/stats is not a pyruntime server's")
  return body["now"]


def _pct(v: float | None) -> str: return "   -" if v is None else f"{100 * v:3.0f}%"


def _bar(v: float | None, width: int = 20) -> str:
  n = 0 if v is None else round(max(0.0, min(1.0, v)) * width)
  return "[" + "#" * n + "." * (width - n) + "]"


def render(view: dict[str, Any]) -> str:
  """One screen of the view, plain text."""
  s, pc = view.get("streams", {}), view.get("prefix_cache") or {}
  cache = f"prefix cache hit {100 * pc.get('hit_rate', 0.0):.0f}%" if pc.get("enabled") else "prefix cache off"
  kv = view.get("kv") or {}
  budget = f"   kv {kv.get('held', 0)}/{kv['budget']} positions, {kv.get('preempted', 0)} preempted" if kv.get("budget") else ""
  lines = [f"{view.get('model', '?')}  {view.get('phase', '?')}  restarts {view.get('restarts', 0)}",
           f"streams {s.get('running', 0)}/{s.get('max', 0)} running, {s.get('waiting', 0)} waiting   "
           f"{view.get('tokens_per_s', 0.0):.1f} tok/s   batch {view.get('batch', {}).get('last', 0)} "
           f"(mean {view.get('batch', {}).get('mean', 0.0):.2f})   {cache}{budget}", ""]
  rings = view.get("rings", [])
  for st in view.get("stages", []):
    i = st["stage"]
    if i < len(rings): lines.append(f"      ring {i} {_bar(rings[i], 10)} {_pct(rings[i])}")
    layers = st.get("layers") or ["?", "?"]
    rows = "-" if st.get("rows_per_step") is None else f"{st['rows_per_step']:.1f}"
    state = "up" if st.get("alive") else "DOWN"
    lines.append(f"stage {i} {state:4} layers {layers[0]}-{layers[1]} on {st.get('device') or '?'}  busy {_bar(st.get('busy'))} "
                 f"{_pct(st.get('busy'))}  rows/step {rows}  {st.get('doing') or ''}")
  if len(rings) > len(view.get("stages", [])): lines.append(f"      ring {len(rings) - 1} {_bar(rings[-1], 10)} {_pct(rings[-1])} (tokens back)")
  t = view.get("totals", {})
  lines += ["", f"requests {t.get('requests', 0)}  errors {t.get('errors', 0)}  prompt tokens {t.get('prompt_tokens', 0)} "
            f"(cached {t.get('cached_tokens', 0)})  completion tokens {t.get('completion_tokens', 0)}"]
  return "\n".join(lines)


def run(url: str, *, once: bool = False, as_json: bool = False, every_s: float = 1.0, out: TextIO | None = None) -> None:
  """Print the view; refreshing in place on a terminal until Ctrl-C (or once)."""
  out = out or sys.stdout
  live = out.isatty() and not once
  while True:
    view = fetch(url)
    text = json.dumps(view) if as_json else render(view)
    out.write(("\x1b[H\x1b[2J" if live else "") + text + "\n")
    out.flush()
    if once: return
    time.sleep(every_s)
