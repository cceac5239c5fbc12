"""The server's numbers, from one collector (docs/stats.md): `/metrics` (Prometheus, through prometheus_client), the
JSON `/stats` with its history, `pyruntime top` and the page all read from here.

Two kinds of numbers: what requests observe (counters and histograms, in seconds and tokens, fed from the launcher's
events as they happen) and what the pipeline is doing (streams, stages, rings, prefix cache), sampled from the
launcher once every SAMPLE_S into a history of the last HISTORY_S. A stage's busy fraction and rows per step come from
its Heartbeats (busy seconds and rows since its start, twice a second): no round trip to the stages, so sampling
never waits on a busy one.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

SAMPLE_S = 1.0
HISTORY_S = 300.0
MEMORY_S = 10.0  # how often the sampler asks the stages where their memory goes (a round trip to each)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)  # one token's wait
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)       # a request's phases

PREFIX_METRICS = (  # (metric, key of Launcher.prefix_cache_stats, type, help)
  ("pyruntime_prefix_cache_queries", "queries", "counter", "Prompts looked up in the prefix cache."),
  ("pyruntime_prefix_cache_hits", "hits", "counter", "Prompts that found at least one cached block."),
  ("pyruntime_prefix_cache_hit_tokens", "hit_tokens", "counter", "Prompt tokens served from the prefix cache (not computed)."),
  ("pyruntime_prefix_cache_query_tokens", "prompt_tokens", "counter", "Prompt tokens of the prompts looked up."),
  ("pyruntime_prefix_cache_saved_blocks", "saved_blocks", "counter", "Blocks the stages filled from running streams."),
  ("pyruntime_prefix_cache_evictions", "evictions", "counter", "Blocks given up for newer ones (least recently used first)."),
  ("pyruntime_prefix_cache_blocks", "held_blocks", "gauge", "Blocks holding a cached prefix now."),
  ("pyruntime_prefix_cache_bytes", "bytes_held", "gauge", "Host memory those blocks hold, all stages together."),
  ("pyruntime_prefix_cache_budget_bytes", "bytes_budget", "gauge", "Host memory the prefix cache may hold, all stages together."),
  # models with recurrent blocks (hybrids): the state snapshots kept with cached prefixes (0 for the others)
  ("pyruntime_prefix_cache_saved_states", "saved_states", "counter", "Recurrent-state snapshots the stages kept with cached prefixes."),
  ("pyruntime_prefix_cache_state_evictions", "state_evictions", "counter", "Recurrent-state snapshots given up for newer ones."),
  ("pyruntime_prefix_cache_states", "held_states", "gauge", "Recurrent-state snapshots held now."),
)
EXPERT_METRIC = "pyruntime_expert_routed_tokens"


class Metrics:
  """What requests observe. Thread-safe (prometheus_client's own locks): fed from the event loop and the launcher's
  driver thread."""

  def __init__(self) -> None:
    self.registry = r = CollectorRegistry(auto_describe=True)
    self.requests = Counter("pyruntime_requests", "HTTP requests answered, by route and status (499: the client went away).",
                            ["route", "status"], registry=r)
    self.errors = Counter("pyruntime_request_errors", "Generation requests that ended with an error, by error code (mid-stream too).",
                          ["code"], registry=r)
    self.cancelled = Counter("pyruntime_requests_cancelled", "Generations stopped because their client went away.", registry=r)
    self.prompt_tokens = Counter("pyruntime_prompt_tokens", "Prompt tokens of finished generations.", registry=r)
    self.cached_tokens = Counter("pyruntime_prompt_cached_tokens", "Of those, tokens served from the prefix cache.", registry=r)
    self.completion_tokens = Counter("pyruntime_completion_tokens", "Tokens generated (cancelled and failed generations included).",
                                     registry=r)
    self.ttft = Histogram("pyruntime_time_to_first_token_seconds", "From a request's acceptance (queueing included) to its first token.",
                          buckets=REQUEST_BUCKETS, registry=r)
    self.itl = Histogram("pyruntime_inter_token_latency_seconds", "Between two tokens of one stream.", buckets=TOKEN_BUCKETS, registry=r)
    self.e2e = Histogram("pyruntime_e2e_request_latency_seconds", "From a request's acceptance to its last token.",
                         buckets=REQUEST_BUCKETS, registry=r)
    self.queue_time = Histogram("pyruntime_request_queue_time_seconds", "Waiting for a free stream slot.", buckets=REQUEST_BUCKETS, registry=r)
    self.prefill_time = Histogram("pyruntime_request_prefill_time_seconds", "From a slot to the first token (the prompt's computation).",
                                  buckets=REQUEST_BUCKETS, registry=r)
    self.draft_rounds = Counter("pyruntime_speculative_rounds", "Speculative records verified (docs/speculation.md).", registry=r)
    self.drafted = Counter("pyruntime_speculative_drafted_tokens", "Tokens drafted for verification.", registry=r)
    self.accepted = Counter("pyruntime_speculative_accepted_tokens", "Drafted tokens the model agreed with.", registry=r)
    self.decode_time = Histogram("pyruntime_request_decode_time_seconds", "From the first token to the last.", buckets=REQUEST_BUCKETS,
                                 registry=r)
    self.pipeline: Callable[[], dict] = lambda: {}           # the sampler's latest view (set by the server)
    self.expert_load: Callable[[], list] = lambda: []        # asked of the stages at a scrape (a round trip: off the loop)
    self.stage_memory: Callable[[], list] = lambda: []       # each stage's memory by kind (QueryStats: the sampler, now and then)
    r.register(_PipelineCollector(self))

  def request(self, route: str, status: int) -> None: self.requests.labels(route, str(status)).inc()
  def error(self, code: str) -> None: self.errors.labels(code).inc()

  def done(self, done: Any, accepted: float, now: float) -> None:
    """A finished generation (a launcher Done): its tokens and its phases."""
    u, t = done.usage, done.timings
    self.prompt_tokens.inc(u.prompt_tokens)
    self.cached_tokens.inc(getattr(u, "cached_tokens", 0))
    self.e2e.observe(now - accepted)
    self.queue_time.observe(t.queue_s)
    self.prefill_time.observe(max(0.0, t.ttft_s - t.queue_s))
    if done.token_ids: self.decode_time.observe(max(0.0, t.elapsed_s - t.ttft_s))
    if getattr(t, "draft_rounds", 0):
      self.draft_rounds.inc(t.draft_rounds); self.drafted.inc(t.drafted_tokens); self.accepted.inc(t.accepted_tokens)

  def value(self, name: str, labels: dict[str, str] | None = None) -> float:
    return self.registry.get_sample_value(name, labels) or 0.0

  def render(self) -> bytes: return generate_latest(self.registry)


class _PipelineCollector:
  """The pipeline's gauges at scrape time, from the sampler's latest view (and the stages' expert load)."""

  def __init__(self, metrics: Metrics): self.metrics = metrics

  def describe(self) -> list: return []  # its families depend on the pipeline (a prefix cache, experts): none fixed

  def collect(self) -> Iterator[Any]:
    view = self.metrics.pipeline()
    s = view.get("streams", {})
    for name, value, text in (("pyruntime_queue_depth", s.get("waiting", 0), "Streams waiting for a free stream slot."),
                              ("pyruntime_requests_running", s.get("running", 0), "Streams running in the pipeline now."),
                              ("pyruntime_max_streams", s.get("max", 0), "Streams the pipeline runs at once."),
                              ("pyruntime_batch_size", view.get("batch", {}).get("last", 0), "Streams in the tail's last step."),
                              ("pyruntime_batch_size_mean", view.get("batch", {}).get("mean", 0.0), "Mean streams per tail step since the start."),
                              ("pyruntime_output_tokens_per_second", view.get("tokens_per_s", 0.0), "Tokens generated per second, all streams.")):
      yield GaugeMetricFamily(name, text, value=value)
    kv = view.get("kv", {})
    yield GaugeMetricFamily("pyruntime_kv_positions_held", "Positions the running streams' keys and values hold (the kv_budget's count).",
                            value=kv.get("held", 0))
    yield GaugeMetricFamily("pyruntime_kv_budget_positions", "The kv_budget (0: none).", value=kv.get("budget", 0))
    yield CounterMetricFamily("pyruntime_streams_preempted", "Streams preempted for the kv_budget (each resumed with the same tokens).",
                              value=kv.get("preempted", 0))
    rings = GaugeMetricFamily("pyruntime_ring_occupancy_ratio", "Fill fraction of each ring (ring i feeds stage i; the last carries "
                              "tokens back).", labels=["ring"])
    for i, v in enumerate(view.get("rings", [])): rings.add_metric([str(i)], v)
    yield rings
    up = GaugeMetricFamily("pyruntime_stage_up", "1 while the stage process is alive.", labels=["stage"])
    busy = GaugeMetricFamily("pyruntime_stage_busy_ratio", "Fraction of the last seconds the stage spent computing.", labels=["stage"])
    rows = GaugeMetricFamily("pyruntime_stage_rows_per_step", "Rows (tokens) per step of the stage over the last seconds.", labels=["stage"])
    for st in view.get("stages", []):
      up.add_metric([str(st["stage"])], int(st["alive"]))
      if st.get("busy") is not None: busy.add_metric([str(st["stage"])], st["busy"])
      if st.get("rows_per_step") is not None: rows.add_metric([str(st["stage"])], st["rows_per_step"])
    yield from (up, busy, rows)
    if (pc := view.get("prefix_cache") or {}).get("enabled"):
      for name, key, kind, text in PREFIX_METRICS:
        yield (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, text, value=pc.get(key, 0))
    if (spec := view.get("speculation")) and spec.get("drafted_at"):
      for key, text in (("drafted_at", "Drafted tokens by their position in the draft (0: first)."),
                        ("accepted_at", "Accepted tokens by their position in the draft: how far into a draft the model agrees.")):
        fam = CounterMetricFamily(f"pyruntime_speculative_{key.split('_')[0]}_by_position_tokens", text, labels=["position"])
        for j, n in enumerate(spec[key]): fam.add_metric([str(j)], n)
        yield fam
    if any(load := self.metrics.expert_load()):
      fam = CounterMetricFamily(EXPERT_METRIC, "Tokens a stage's last mixture-of-experts block routed to each expert.",
                                labels=["stage", "expert"])
      for i, per in enumerate(load):
        for e, n in enumerate(per or []): fam.add_metric([str(i), str(e)], int(n))
      yield fam


def parse_expert_load(text: str) -> dict[int, list[int]]:
  """The expert load a server's /metrics text shows: per stage that counts one, tokens routed to each expert."""
  from prometheus_client.parser import text_string_to_metric_families
  out: dict[int, dict[int, int]] = {}
  for fam in text_string_to_metric_families(text):
    if fam.name != EXPERT_METRIC: continue
    for smp in fam.samples:
      if smp.name.endswith("_total"): out.setdefault(int(smp.labels["stage"]), {})[int(smp.labels["expert"])] = int(smp.value)
  return {s: [per.get(e, 0) for e in range(max(per) + 1)] for s, per in out.items()}


# --- the pipeline's view, sampled -------------------------------------------------------------------------------------
class StatsSampler:
  """Reads the pipeline once every SAMPLE_S into `latest` and a history of the last HISTORY_S (a thread of its own,
  ended by `stop`). `read` returns the launcher's raw figures (ServerState.raw_view)."""

  def __init__(self, read: Callable[[], dict], metrics: Metrics, every_s: float = SAMPLE_S, keep_s: float = HISTORY_S):
    self.read, self.metrics, self.every_s = read, metrics, every_s
    self.history: collections.deque[dict] = collections.deque(maxlen=max(1, int(keep_s / every_s)))
    self.latest: dict[str, Any] = {}
    self._beats: dict[int, tuple[int, dict]] = {}  # per stage: (its pid, the Heartbeat the last sample saw)
    self._memory: list = []          # each stage's memory by kind (pyruntime/stage/memory_use.py), asked every MEMORY_S
    self._memory_t = -MEMORY_S
    self._stop = threading.Event()
    self._lock = threading.Lock()
    self._thread: threading.Thread | None = None
    metrics.pipeline = lambda: self.sample(keep=False)

  def start(self) -> StatsSampler:
    self.sample()
    self._thread = threading.Thread(target=self._run, name="stats-sampler", daemon=True)
    self._thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()
    if self._thread is not None and self._thread is not threading.current_thread(): self._thread.join(5)

  def _run(self) -> None:
    while not self._stop.wait(self.every_s):
      try: self.sample()
      except Exception:  # noqa: BLE001 - a launcher being replaced can fail a read; the next sample is the judge
        import logging
        logging.getLogger("pyruntime.metrics").debug("a stats sample failed", exc_info=True)

  def sample(self, keep: bool = True) -> dict[str, Any]:
    """A fresh view; `keep`: also the latest and in the history (the sampler's own beat; a scrape takes a fresh one
    without changing the history's cadence)."""
    raw = self.read()
    now = time.time()
    m = self.metrics
    if keep and time.monotonic() - self._memory_t >= MEMORY_S:  # a round trip to every stage: not at every sample
      self._memory, self._memory_t = list(m.stage_memory()), time.monotonic()
    view = {"t": round(now, 3), "phase": raw.get("phase"), "model": raw.get("model"), "restarts": raw.get("restarts", 0),
            "streams": {"running": raw.get("running", 0), "waiting": raw.get("waiting", 0), "max": raw.get("max_streams", 0)},
            "kv": dict(raw.get("kv") or {"budget": 0, "held": 0, "peak": 0, "preempted": 0}),
            "batch": {"last": raw.get("last_batch", 0), "mean": round(raw.get("mean_batch", 0.0), 3)},
            "tokens_per_s": round(raw.get("tokens_per_s", 0.0), 3), "rings": [round(v, 4) for v in raw.get("rings", [])],
            "stages": [self._stage(st) for st in raw.get("stages", [])], "prefix_cache": self._prefix(raw.get("prefix_cache") or {}),
            "totals": {"requests": int(sum(s.value for f in m.requests.collect() for s in f.samples if s.name.endswith("_total"))),
                       "errors": int(sum(s.value for f in m.errors.collect() for s in f.samples if s.name.endswith("_total"))),
                       "prompt_tokens": int(m.value("pyruntime_prompt_tokens_total")),
                       "cached_tokens": int(m.value("pyruntime_prompt_cached_tokens_total")),
                       "completion_tokens": int(m.value("pyruntime_completion_tokens_total"))},
            "speculation": self._speculation(raw.get("speculation"))}
    if keep:
      with self._lock:
        self.latest = view
        self.history.append(view)
    return view

  def _stage(self, st: dict) -> dict:
    """A stage's figures; its busy fraction and rows per step between the Heartbeat the last sample saw and this one."""
    beat = st.get("beat") or {}
    out = {k: st.get(k) for k in ("stage", "alive", "layers", "device", "resident_bytes", "pid", "host")}
    key, pid, t = st["stage"], st.get("pid"), beat.get("t")
    prev = self._beats.get(key)  # (pid, beat, busy, rows per step)
    busy = rows = None
    if prev is not None and prev[0] == pid and t is not None:
      p = prev[1]
      if t == p["t"]: busy, rows = prev[2], prev[3]  # no Heartbeat since: the figures stand
      elif t > p["t"]:
        busy = round(min(1.0, max(0.0, (beat.get("busy_s", 0.0) - p.get("busy_s", 0.0)) / (t - p["t"]))), 4)
        steps = beat.get("steps", 0) - p.get("steps", 0)
        rows = round((beat.get("tokens", 0) - p.get("tokens", 0)) / steps, 3) if steps > 0 else 0.0
    if t is not None: self._beats[key] = (pid, beat, busy, rows)
    out.update(steps=beat.get("steps"), doing=beat.get("doing"), busy=busy, rows_per_step=rows,
               memory=self._memory[key] if isinstance(key, int) and key < len(self._memory) else None)
    return out

  @staticmethod
  def _speculation(spec: dict | None) -> dict | None:
    if not spec: return None
    return {**spec, "acceptance": round(spec["accepted"] / spec["drafted"], 4) if spec.get("drafted") else 0.0}

  @staticmethod
  def _prefix(pc: dict) -> dict:
    if not pc.get("enabled"): return {"enabled": False, "why": pc.get("why")}
    q = pc.get("prompt_tokens", 0)
    return {**pc, "hit_rate": round(pc.get("hit_tokens", 0) / q, 4) if q else 0.0}

  def stats(self, history: bool = True) -> dict[str, Any]:
    """The /stats body (docs/stats.md): the latest view, and the history oldest first."""
    if not self.latest: self.sample()  # not started (an app not served by uvicorn)
    with self._lock:
      body: dict[str, Any] = {"version": 1, "sample_s": self.every_s, "now": self.latest}
      if history: body["history"] = list(self.history)
    return body
