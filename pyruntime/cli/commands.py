"""The `pyruntime` command: generate, chat, inspect, serve, warmup, bench, shm."""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

from pyruntime import errors
from pyruntime.engine.prefix_cache import PREFIX_CACHE_TOKENS
from pyruntime.options import PREFIX_STATE_TOKENS, ServeOptions, add_cli_args


def _add_model_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", default=None,
                 help="GGUF path, [hf://]owner/repo/file.gguf[@revision], or 'default' (default: the bundled SmolLM2-135M)")
  p.add_argument("--stages", type=int, default=None, help="number of stages, split balanced by time per decode step (default: 2; with "
                 "--split, its count, and a --stages that differs is refused)")
  p.add_argument("--split", default=None, help="explicit half-open block ranges, e.g. 0:15,15:30 (default: from --stages)")
  p.add_argument("--device", default=None, help="one device for all stages, or one per stage: CUDA:0,CUDA:1 (default: automatic)")
  add_cli_args(p)  # --boundary-dtype, --decode, --weights, --max-streams, --prefix-cache, --prefill-share, the stall bounds
  p.add_argument("--ray", metavar="ADDRESS", default=None, help="run the stages on the nodes of this Ray cluster ('auto': the one this "
                 "machine joined; HOST:PORT), one host agent per node, bridges between hosts (docs/hosts.md; needs pyruntime[ray])")
  p.add_argument("--hosts", type=int, default=None, help="with --ray: how many nodes to spread the stages over (default: as many as "
                 "there are stages, at most the cluster's nodes)")
  p.add_argument("--max-context", type=int, default=None, help="cap on the context in tokens (default: the model's own)")
  p.add_argument("--no-graph-cache", dest="graph_cache", action="store_false",
                 help="capture every graph anew instead of loading the ones kept in $PYRUNTIME_CACHE/graphs (see `pyruntime warmup`)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
  from pyruntime.params import MAX_TOKENS, SAMPLING
  for q in (MAX_TOKENS, *SAMPLING.values()): p.add_argument(q.flag, type=q.kind, default=q.default, help=q.help)
  p.add_argument("--stop", action="append", default=[], help="stop string, repeatable (default: none)")
  p.add_argument("--ignore-eos", action="store_true", help="keep generating through end tokens, up to --max-tokens")


def _sampling(a: argparse.Namespace) -> dict[str, Any]:
  """The generate() options of the command line, checked (pyruntime/params.py) before a model is loaded."""
  from pyruntime.params import SAMPLING, check_request
  sampling = {name: getattr(a, name) for name in SAMPLING}
  check_request(a.max_tokens, sampling, a.stop)
  return dict(max_tokens=a.max_tokens, stop=a.stop, ignore_eos=a.ignore_eos, **sampling)


class Term:
  """What is half-written on the terminal, so that a message (an error, Ctrl-C) starts on a line of its own without
  an empty line before it: the progress bar or spinner on stderr is cleared, a reply left open on stdout is ended."""
  stdout_open = False            # the last text written to stdout did not end with a newline
  status: Any = None             # the LoadProgress / Spinner drawing on stderr now, if any

  @classmethod
  def out(cls, text: str) -> None:
    if not text: return
    sys.stdout.write(text); sys.stdout.flush()
    cls.stdout_open = not text.endswith("\n")

  @classmethod
  def message(cls, text: str) -> None:
    """A line on stderr, after whatever is half-written."""
    if cls.status is not None: cls.status.clear()
    if cls.stdout_open:
      sys.stdout.write("\n"); sys.stdout.flush()
      cls.stdout_open = False
    sys.stderr.write(text + "\n"); sys.stderr.flush()


def _elapsed(t0: float) -> str: return f"{time.monotonic() - t0:.1f} s"


def _graph_name(kind: str) -> str:
  """A stage's graph for people: "prefill", "decode", a decode window "decode-W" as "decode (W rows)" (a short prefill
  "prefill-R" alike)."""
  name, _, rows = kind.partition("-")
  return f"{name} ({rows} row{'s' * (rows != '1')})" if rows else name


class LoadProgress:
  """Progress while the stages load, on stderr. On a terminal, one line redrawn in place (also between events, so the
  clock runs); otherwise one plain line per step: the start, each stage loaded, every HEARTBEAT_S while waiting, the end.
  The stage count is known from the start (the arena has a ring per stage plus one), and every time shown is measured
  from one clock, this object's creation, the moment loading begins."""
  HEARTBEAT_S = 15.0

  def __init__(self, quiet: bool, stream: Any = None) -> None:
    self.stream = stream if stream is not None else sys.stderr
    self.quiet, self.tty = quiet, bool(getattr(self.stream, "isatty", lambda: False)())
    self.loaded, self.total, self.t0 = 0, 0, time.monotonic()
    self.downloading: str | None = None
    self.preparing: dict[int, str] = {}  # stage -> the graph it is preparing now
    self.lock = threading.Lock()
    self.drawn = False           # a bar is on the terminal's current line
    self.done = threading.Event()
    self.ticker: threading.Thread | None = None

  def __call__(self, ev: dict) -> None:
    kind = ev.get("event")
    if kind == "StageWarning":  # always said, even when quiet: something runs degraded
      with self.lock: Term.message(f"pyruntime: stage {ev.get('stage', '?')}: warning: {ev.get('message', '')}")
      return
    if kind in ("ContextReduced", "KVBudgetSet"):  # always said: a smaller context than the file's, or a budget, chosen to fit memory
      with self.lock: Term.message(f"pyruntime: warning: {ev.get('message', '')}")
      return
    if self.quiet: return
    with self.lock:
      if kind == "ArenaCreated":
        self.total = int(ev.get("stages", int(ev.get("rings", 1)) - 1))
        self.downloading = None
        if not self.tty: self.line(f"loading {self.total} stage{'s' * (self.total != 1)}")
        self.start_ticker()
      elif kind == "WeightsLoaded":
        self.loaded += 1
        if not self.tty:
          where = f" (blocks {ev['start']}:{ev['end']})" if "start" in ev and "end" in ev else ""
          self.line(f"stage {ev.get('stage', '?')}{where} loaded [{self.loaded}/{self.total}] {_elapsed(self.t0)}")
      elif kind == "GraphPreparing":
        self.preparing[ev.get("stage", -1)] = _graph_name(str(ev.get("graph", "")))
        if not self.tty: self.line(f"stage {ev.get('stage', '?')}: preparing the {self.preparing[ev.get('stage', -1)]} graph")
      elif kind == "GraphReady":
        what = self.preparing.pop(ev.get("stage", -1), str(ev.get("graph")))
        if not self.tty:
          how = "from the graph cache" if ev.get("cached") else "captured, kept in the graph cache for next time"
          self.line(f"stage {ev.get('stage', '?')}: {what} graph ready in {ev.get('seconds', 0):.1f} s ({how})")
      elif kind == "DownloadProgress" and ev.get("total"):
        pct = ev["bytes"] / ev["total"]
        if self.tty: self.downloading = f"downloading {pct:6.1%}"
        elif pct >= 1 or self.downloading is None: self.downloading = "-"; self.line(f"downloading the model: {pct:.0%}")
        self.start_ticker()
      elif kind == "LauncherReady":
        self.finish(f"loaded {self.total} stage{'s' * (self.total != 1)} in {_elapsed(self.t0)}")
        return
      elif kind in ("StageFailed", "LauncherClosed"):
        self.finish(None)
        return
      else: return
      if self.tty: self.draw()

  def text(self) -> str:
    if self.downloading and self.downloading != "-" and not self.total: return f"{self.downloading}  {_elapsed(self.t0)}"
    bar = "#" * self.loaded + "." * max(0, self.total - self.loaded)
    doing = "; ".join(f"stage {s}: {g} graph" for s, g in sorted(self.preparing.items()))
    return f"loading stages [{bar}] {self.loaded}/{self.total}{'  preparing ' + doing if doing else ''}  {_elapsed(self.t0)}"

  def line(self, text: str) -> None:
    self.stream.write(f"pyruntime: {text}\n"); self.stream.flush()

  def draw(self) -> None:
    self.stream.write("\r\x1b[K" + self.text()); self.stream.flush()
    self.drawn = True
    Term.status = self

  def clear(self) -> None:
    if self.drawn:
      self.stream.write("\r\x1b[K"); self.stream.flush()
      self.drawn = False
    if Term.status is self: Term.status = None

  def finish(self, final: str | None) -> None:
    self.done.set()
    if self.tty: self.clear()
    if final and self.tty: self.stream.write(final + "\n"); self.stream.flush()
    elif final: self.line(final)

  def start_ticker(self) -> None:
    if self.ticker is not None or self.done.is_set(): return
    self.ticker = threading.Thread(target=self.tick, name="load-progress", daemon=True)
    self.ticker.start()

  def tick(self) -> None:
    period = 0.5 if self.tty else self.HEARTBEAT_S
    while not self.done.wait(period):
      with self.lock:
        if self.done.is_set(): return
        if self.tty: self.draw()
        else: self.line(self.waiting_for())

  def waiting_for(self) -> str:
    """What the start waits for now: weights still loading, or (every stage's weights in) the graphs being prepared."""
    if self.loaded < self.total: return f"still loading: {self.loaded}/{self.total} stages have their weights, {_elapsed(self.t0)}"
    graphs = ", ".join(f"stage {s}: the {g} graph" for s, g in sorted(self.preparing.items())) or "the stages' graphs"
    return f"still preparing {graphs} (weights loaded in all {self.total} stages), {_elapsed(self.t0)}"


class Spinner:
  """'thinking' with a turning mark on stderr while a reply has produced no text yet (terminal only)."""
  FRAMES = "|/-\\"

  def __init__(self, label: str = "thinking") -> None:
    self.label, self.stop_ev, self.drawn = label, threading.Event(), False
    self.lock = threading.Lock()
    self.thread: threading.Thread | None = None
    if sys.stderr.isatty():
      self.thread = threading.Thread(target=self.run, name="spinner", daemon=True)
      self.thread.start()

  def run(self) -> None:
    t0, i = time.monotonic(), 0
    while not self.stop_ev.wait(0.1 if i else 0.0):
      with self.lock:
        if self.stop_ev.is_set(): return
        sys.stderr.write(f"\r\x1b[K{self.FRAMES[i % 4]} {self.label} {_elapsed(t0)}"); sys.stderr.flush()
        self.drawn = True
        Term.status = self
      i += 1

  def clear(self) -> None:
    with self.lock:
      if self.drawn:
        sys.stderr.write("\r\x1b[K"); sys.stderr.flush()
        self.drawn = False
      if Term.status is self: Term.status = None

  def stop(self) -> None:
    self.stop_ev.set()
    self.clear()


def _launcher(a: argparse.Namespace, quiet: bool = False, warmup: bool = False) -> Any:
  from pyruntime.engine.launcher import Launcher
  from pyruntime.modelfile.plan import parse_split
  split = parse_split(a.split) if a.split else None
  if split is not None and a.stages is not None and a.stages != len(split):
    raise errors.InvalidOption("stages", f"--stages {a.stages} and a --split of {len(split)} ranges: give one, or the same count")
  stages = a.stages if a.stages is not None else len(split) if split else 2
  from pyruntime.options import CHOICES, NUMBERS
  ray = dict(placement="ray", ray_address=a.ray, hosts=a.hosts) if a.ray else {}
  if a.hosts is not None and not a.ray: raise errors.InvalidOption("hosts", "--hosts needs --ray ADDRESS")
  return Launcher(a.model, stages=stages, split=split, devices=a.device, max_context=a.max_context, warmup=warmup,
                  on_event=LoadProgress(quiet), graph_cache=a.graph_cache, **ray, **{name: getattr(a, name) for name in (*CHOICES, *NUMBERS)})


def cmd_generate(a: argparse.Namespace) -> int:
  from pyruntime.engine.launcher import Delta, Done
  options = _sampling(a)
  with _launcher(a) as lm:  # progress on stderr also with --json (stdout carries only the JSON)
    done = None
    for ev in lm.generate(a.prompt, raw=a.raw, **options):
      if isinstance(ev, Delta) and not a.json: Term.out(ev.text)
      elif isinstance(ev, Done): done = ev
    if a.json:
      print(json.dumps({"model": lm.model_name, "split": [list(r) for r in lm.split], "prompt_token_ids": done.prompt_token_ids,
                        "token_ids": done.token_ids, "text": done.text, "finish_reason": done.finish_reason,
                        "usage": {"prompt_tokens": done.usage.prompt_tokens, "completion_tokens": done.usage.completion_tokens},
                        "timings": {"load_s": done.timings.load_s, "ttft_s": done.timings.ttft_s,
                                    "decode_tokens_per_s": done.timings.decode_tokens_per_s}}))
    else:
      t = done.timings
      sys.stdout.write("\n"); sys.stdout.flush()
      Term.stdout_open = False
      sys.stderr.write(f"[{done.finish_reason}] {done.usage.prompt_tokens} prompt + {done.usage.completion_tokens} completion tokens, "
                       f"load {t.load_s:.1f} s, first token {t.ttft_s:.2f} s, {t.decode_tokens_per_s:.1f} tokens/s\n")
  if os.environ.get("PYRUNTIME_PROFILE"): print_profiles(lm.profile_reports(wait_s=5.0))
  return 0


def print_profiles(reports: list[dict], top: int = 10) -> None:
  """The stages' profiles (PYRUNTIME_PROFILE) on stderr: CPU over wall and the hottest lines of each data loop."""
  for r in reports:
    sys.stderr.write(f"profile of stage {r.get('stage')}: {r.get('samples', 0)} samples over {r.get('wall_s', 0)} s, "
                     f"CPU/wall {r.get('cpu_over_wall', 0)}\n")
    total = max(1, r.get("samples", 0))
    for line in r.get("lines", [])[:top]:
      where = os.path.relpath(line["where"]) if line["where"].startswith("/") else line["where"]
      sys.stderr.write(f"  {100 * line['samples'] / total:5.1f}%  {where}\n")


def cmd_chat(a: argparse.Namespace) -> int:
  from pyruntime.engine.launcher import Delta, Done
  messages: list[dict] = [{"role": "system", "content": a.system}] if a.system else []
  options = _sampling(a)
  with _launcher(a) as lm:
    sys.stderr.write("chat with the model; an empty line or Ctrl-D ends it\n")
    while True:
      try: line = input("> ")
      except EOFError: break
      if not line.strip(): break
      messages.append({"role": "user", "content": line})
      reply = []
      spinner = Spinner()   # until the first text of the reply: the model is working
      try:
        for ev in lm.generate(messages=messages, **options):
          if isinstance(ev, Delta) and ev.text:
            spinner.stop(); Term.out(ev.text); reply.append(ev.text)
          elif isinstance(ev, Done) and ev.finish_reason == "length": spinner.stop(); Term.out(" [length]")
      except errors.ContextLengthExceeded as e:
        Term.message(str(e)); messages.pop(); continue
      finally:
        spinner.stop()
      sys.stdout.write("\n"); sys.stdout.flush()
      Term.stdout_open = False
      messages.append({"role": "assistant", "content": "".join(reply)})
  return 0


def _fits_here(h: Any) -> dict:
  """What a launch with the Launcher's defaults would hold on this host (launch_plan.fit_context): the context it gets
  and the bytes by kind, or the refusal it would meet."""
  from pyruntime.devices import available_memory
  from pyruntime.engine.launch_plan import LaunchOptions, memory_need, plan_launch
  memory, o = available_memory(), LaunchOptions()
  try: p = plan_launch(h.path, h, o, memory)
  except errors.InvalidOption as e: return {"available_bytes": memory, "refused": str(e)}
  return {"available_bytes": memory, "stages": len(p.split), "weights": p.weights, "max_streams": o.max_streams, "context": p.context_length,
          "kv_budget": p.kv_budget,
          "file_context": int(h.get("context_length")), "bytes": memory_need(h, o, p.split, p.devices, p.weights, p.context_length, p.kv_budget)}


def cmd_inspect(a: argparse.Namespace) -> int:
  from pyruntime.modelfile.gguf import read_header
  from pyruntime.modelfile.plan import block_tensor_names, prefix_cache_bytes_per_token, suggest_split, tensor_cost, unservable
  from pyruntime.modelfile.source import resolve_model
  h = read_header(resolve_model(a.model))
  if why := unservable(h):  # said first, and no splits suggested for a file no stage can run
    if a.json: print(json.dumps({"path": str(h.path), "architecture": h.arch, "servable": False, "why": why}, indent=1))
    else: print(f"{h.path}: pyruntime cannot serve this file:\n" + "\n".join(f"  - {w}" for w in why))
    return 2
  cache = prefix_cache_bytes_per_token(h)
  blocks = h.num_blocks
  per_block = [sum(t.nbytes for n, t in h.tensors.items() if n.startswith(f"blk.{i}.")) for i in range(blocks)]
  other = {n: t.nbytes for n, t in h.tensors.items() if not n.startswith("blk.")}
  unused = sum(t.nbytes for n, t in h.tensors.items() if n.startswith("blk.") and int(n.split(".")[1]) >= blocks)
  info = {"path": str(h.path), "architecture": h.arch, "servable": True, "name": h.kv.get("general.name"), "blocks": blocks,
          "dim": h.get("embedding_length"), "heads": h.get("attention.head_count"), "kv_heads": h.get("attention.head_count_kv"),
          "context_length": h.get("context_length"), "vocab_size": len(h.kv.get("tokenizer.ggml.tokens", [])),
          "tied_embeddings": "output.weight" not in h.tensors, "weight_bytes": sum(t.nbytes for t in h.tensors.values()),
          "bytes_per_block": per_block, "non_block_bytes": other,
          "compute_per_block": [tensor_cost(h, block_tensor_names(h, i), "compute") for i in range(blocks)],  # parameters a token touches
          "unused_bytes": unused,  # multi-token-prediction (nextn) layers: in the file, run by nobody
          "prefix_cache_bytes_per_token": cache,  # with recurrent blocks: a share of a state snapshot (PREFIX_STATE_TOKENS)
          "experts": h.get("expert_count", 0), "experts_per_token": h.get("expert_used_count", 0),
          "leading_dense_blocks": h.get("leading_dense_block_count", 0), "kv_lora_rank": h.get("attention.kv_lora_rank", 0),
          # the launcher's default: by time per decode step, from the bytes a step reads (weights as stored: GPUs; as
          # dequantised, float16 or float32: a CPU default); memory and compute for reference
          "suggested_split": {f"{n}_stages": {"by_time": suggest_split(h, n, by="time"), "by_time_float32": suggest_split(h, n, by="time-float32"),
                                              "by_memory": suggest_split(h, n, by="memory"), "by_compute": suggest_split(h, n, by="compute")}
                              for n in range(1, a.max_stages + 1) if n <= blocks}}
  info["fits_here"] = _fits_here(h)
  if a.server: info["expert_load"], info["stages"] = _server_expert_load(a.server), _server_stages(a.server)
  if a.json: print(json.dumps(info, indent=1))
  else:
    w = max(map(len, info))  # the longest key sets the column
    for k, v in info.items():
      if k == "bytes_per_block": v = f"{min(v)}..{max(v)} bytes (total {sum(v)})"
      if k == "compute_per_block": v = f"{min(v)}..{max(v)} parameters per token"
      if k == "prefix_cache_bytes_per_token":
        k, v = "prefix_cache", (f"{v} bytes per token, host memory over all stages ({v * PREFIX_CACHE_TOKENS / 2**20:.0f} MiB for the "
                                f"default {PREFIX_CACHE_TOKENS} tokens" + (f"; with a snapshot of the recurrent state per "
                                f"{PREFIX_STATE_TOKENS} tokens" if h.get("ssm.state_size") else "") + ")")
      if k == "fits_here":
        if "refused" in v: print(f"{k:>{w}}: no, with the launcher's defaults: {v['refused']}")
        else:
          g = lambda n: f"{n / 2**30:.1f}"  # noqa: E731
          b = v["bytes"]
          print(f"{k:>{w}}: with the launcher's defaults ({v['stages']} stages, weights {'/'.join(dict.fromkeys(v['weights']))}, "
                f"{v['max_streams']} streams): context {v['context']} of the file's {v['file_context']}"
                + (f", the streams' keys and values within {v['kv_budget']} positions (kv_budget)" if v.get("kv_budget") else "")
                + f", {g(sum(b.values()))} GiB "
                f"(weights {g(b['weights'])}, keys and values {g(b['kv'])}, prefix cache {g(b['prefix_cache'])}) of "
                f"{g(v['available_bytes'])} GiB available")
        continue
      if k == "suggested_split":
        for n, s in v.items():
          print(f"{'split ' + n:>{w}}: time {s['by_time']}  time with float32 weights {s['by_time_float32']}  memory {s['by_memory']}")
        continue
      if k == "stages":
        from pyruntime.stage.memory_use import describe
        for st in v:
          print(f"{'stage ' + str(st['stage']):>{w}}: {_where(st)}")
          if st.get("memory"): print(f"{'memory':>{w}}: {describe(st['memory'])}")
        continue
      if k == "expert_load":
        if not v: print(f"{k:>{w}}: none counted by {a.server} (a dense model, or no token routed yet)")
        for stage, load in v.items(): print(f"{k:>{w}}: stage {stage}: {_load_summary(load)}")
        continue
      print(f"{k:>{w}}: {v}")
  return 0


def _server_expert_load(url: str) -> dict[int, list[int]]:
  """A running server's per-stage expert load, from its /metrics (what the stages have routed since it started)."""
  import urllib.error
  import urllib.request

  from pyruntime.serving.metrics import parse_expert_load
  try:
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=30) as r: text = r.read().decode()
  except (urllib.error.URLError, OSError, ValueError) as e: raise errors.ServerUnreachable(f"{url}/metrics: {e}") from None
  if "pyruntime_stage_up" not in text: raise errors.ServerUnreachable(f"{url}/metrics is not a pyruntime server's")
  return parse_expert_load(text)


def _server_stages(url: str) -> list[dict]:
  """Where a running server's stages run: from its /stats (layers, device, pid, and the host when not the server's)."""
  import urllib.request
  try:
    with urllib.request.urlopen(url.rstrip("/") + "/stats?history=0", timeout=30) as r: return json.loads(r.read())["now"]["stages"]
  except (OSError, ValueError, KeyError) as e: raise errors.ServerUnreachable(f"{url}/stats: {e}") from None


def _where(st: dict) -> str:
  h = st.get("host")
  place = (f"host {h['index']} (Ray node {h['node'][:12]}, {h['ip']}), model file {h['model_path']}" if h else "the server's host")
  return f"layers {st.get('layers')} on {st.get('device')}, pid {st.get('pid')}, {place}"


def _load_summary(load: list[int]) -> str:
  """One stage's expert load for people: how many routings, the busiest experts' shares, and how uneven it is."""
  total = sum(load)
  if not total: return f"no routings yet over {len(load)} experts"
  top = sorted(range(len(load)), key=lambda e: -load[e])[:3]
  busiest = ", ".join(f"e{e} {100 * load[e] / total:.1f} %" for e in top)
  return (f"{total} routings over {len(load)} experts; busiest {busiest}; busiest/mean {max(load) * len(load) / total:.2f}; "
          f"idle {sum(v == 0 for v in load)}")


def cmd_serve(a: argparse.Namespace) -> int:
  from pyruntime.serving.server import serve
  # a server captures every batch shape's kernels before it takes requests
  return serve(ServeOptions.from_args(a), lambda: _launcher(a, warmup=True))


def cmd_warmup(a: argparse.Namespace) -> int:
  """Prepare every graph `serve` (or with --max-streams 1, `generate`) needs, into the graph cache, and stop."""
  from pyruntime.stage.compute.graph_cache import clear, graph_dir
  if a.clear:
    try: n, size = clear()
    except PermissionError as e:  # a link or another user's directory: nothing removed there
      print(f"pyruntime warmup --clear: refused: {e}", file=sys.stderr)
      return 1
    print(f"removed {n} cached graph file{'s' * (n != 1)} ({size / 1e6:.1f} MB) from {graph_dir()}")
    return 0
  t0 = time.monotonic()
  with _launcher(a, warmup=True) as lm:
    stats = [h.info.get("warm_up", {}).get("graph_cache") or {} for h in lm.handles]
  loaded, saved = sum(s.get("loaded", 0) for s in stats), sum(s.get("saved", 0) for s in stats)
  print(f"{loaded + saved} graphs ready for {lm.model_name} in {_elapsed(t0)}: {saved} captured and kept, {loaded} already in "
        f"{graph_dir()}")
  return 0


BENCHMARKS = {"ring": "ring throughput and latency against multiprocessing and other Python peers",
              "pipeline": "1/2/3-stage pipelines against tinygrad's single-process model",
              "serve": "the OpenAI server under load: levels, chat, burst, prompt, long-prompt scenarios",
              "launcher": "the launcher's own CPU per token",
              "kernels": "the rows path's prompt rows against numpy's matmuls, decode steps, schedules on and off",
              "restart": "how long serve is away after a stage dies, serving or during the restart's warm-up",
              "structured": "structured output's cost: the same requests free and under a JSON schema, C=1 and C=8"}


def cmd_bench(a: argparse.Namespace) -> int:
  """Run pyruntime.bench.NAME (the bench/ folder, shipped in the package) as a script."""
  import runpy
  sys.argv = [f"pyruntime bench {a.what}", *a.args]
  try: runpy.run_module(f"pyruntime.bench.{a.what}", run_name="__main__", alter_sys=True)
  except ModuleNotFoundError as e:
    if e.name and e.name.split(".")[0] in ("pyruntime", "tinygrad", "numpy"): raise
    raise errors.InvalidOption("bench", f"`pyruntime bench {a.what}` needs {e.name}: pip install 'pyruntime[bench]'") from None
  return 0


def cmd_shm(a: argparse.Namespace) -> int:
  from pyruntime.transport.ring import cleanup_stale
  removed = cleanup_stale()
  print("\n".join(removed) if removed else "no stale segments")
  return 0


class _Help(argparse.ArgumentDefaultsHelpFormatter):
  """Every option's help ends with its default, '(default: X)', unless the help already says what it is."""
  def _get_help_string(self, action: argparse.Action) -> str:
    text = action.help or ""
    # a flag's default says nothing a reader can use ("--no-graph-cache (default: True)" reads as "off by default")
    flag = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
    if "(default:" in text or "%(default)" in text or action.default is argparse.SUPPRESS or flag \
       or not (action.option_strings or action.nargs in ("?", "*")):
      return text
    return text + " (default: %(default)s)"


def cmd_top(a: argparse.Namespace) -> int:
  from pyruntime.cli import top
  try: top.run(a.url, once=a.once, as_json=a.json, every_s=a.every)
  except KeyboardInterrupt: pass
  return 0


def build_parser() -> argparse.ArgumentParser:
  # long (~65 lines): one declaration per subcommand and flag, a table more than logic
  from pyruntime import options
  ap = argparse.ArgumentParser(prog="pyruntime", description="Serve an LLM split across the devices of one host over shared-memory rings.",
                               formatter_class=_Help)
  ap.add_argument("--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                  help="what the launcher and server log on stderr (a consumer callback that raised, a close that failed, ...)")
  sub = ap.add_subparsers(dest="cmd", required=True)
  def command(name: str, help: str) -> argparse.ArgumentParser:  # argparse %-formats a help string: a plain "%" must be doubled
    return sub.add_parser(name, help=help.replace("%", "%%"), description=help, formatter_class=_Help)
  p = command("generate", "generate a completion for one prompt")
  p.add_argument("prompt", help="the prompt text (a user message unless --raw)")
  _add_model_args(p); _add_sampling_args(p)
  p.add_argument("--raw", action="store_true", help="no chat template: the prompt is the model's input as is")
  p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming text")
  p.set_defaults(fn=cmd_generate)
  p = command("chat", "an interactive conversation")
  _add_model_args(p); _add_sampling_args(p)
  p.add_argument("--system", default=None, help="a system message (default: the chat template's own, if any)")
  p.set_defaults(fn=cmd_chat)
  p = command("inspect", "describe a model and suggest splits")
  p.add_argument("model", nargs="?", default=None, help="GGUF path, hf source or 'default' (default: the bundled SmolLM2-135M)")
  p.add_argument("--max-stages", type=int, default=4, help="suggest splits for 1 to this many stages")
  p.add_argument("--json", action="store_true", help="print JSON instead of text")
  p.add_argument("--server", default=None, metavar="URL",
                 help="also show the expert load a running `pyruntime serve` of this model counted (per stage: tokens routed to each expert)")
  p.set_defaults(fn=cmd_inspect)
  p = command("serve", "an OpenAI-compatible HTTP server")
  _add_model_args(p)
  options.add_serve_args(p)
  p.set_defaults(fn=cmd_serve)
  p = command("top", "a running server's pipeline, live: per stage busy %, rows per step, rings, streams, tokens/s, cache hits")
  p.add_argument("url", nargs="?", default="http://127.0.0.1:8000", help="the server (`pyruntime serve`)")
  p.add_argument("--once", action="store_true", help="print one view and exit")
  p.add_argument("--json", action="store_true", help="print the raw view (/stats, docs/stats.md) instead of text")
  p.add_argument("--every", type=float, default=1.0, help="seconds between refreshes")
  p.set_defaults(fn=cmd_top)
  p = command("warmup", "prepare the stages' graphs ahead of time, into the graph cache (what serve, generate and chat use)")
  _add_model_args(p)
  p.add_argument("--clear", action="store_true", help="remove every cached graph instead")
  p.set_defaults(fn=cmd_warmup)
  p = command("bench", "benchmarks: " + " | ".join(BENCHMARKS))
  p.add_argument("what", choices=list(BENCHMARKS), metavar="NAME",
                 help="which benchmark: " + "; ".join(f"{k}: {v}" for k, v in BENCHMARKS.items()))
  p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark (try --help)")
  p.set_defaults(fn=cmd_bench)
  p = command("shm", "shared-memory housekeeping")
  p.add_argument("action", choices=["clean"], help="clean: unlink segments of ours whose creator is dead")
  p.set_defaults(fn=cmd_shm)
  return ap


def main(argv: list[str] | None = None) -> int:
  a = build_parser().parse_args(argv)
  import logging
  logging.basicConfig(level=a.log_level, format="pyruntime: %(levelname)s %(name)s: %(message)s")
  try:
    return a.fn(a)
  except errors.PyruntimeError as e:
    Term.message(f"pyruntime: {e.code}: {e}")
    return 2
  except KeyboardInterrupt:
    Term.message("interrupted")
    return 130
