// The page of `pyruntime serve` (docs/page.md): a chat over the server's own /v1/chat/completions (SSE) and the
// pipeline, live, from /stats. Everything shown is put in with textContent: model output is text, never markup.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { messages: [], controller: null, key: sessionStorage.getItem("pyruntime-key") || "", model: "default" };

function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (state.key) h["Authorization"] = "Bearer " + state.key;
  return h;
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

// Text with ``` fenced blocks shown as code: split into nodes, each filled with textContent.
function renderText(node, text) {
  node.replaceChildren();
  const parts = text.split("```");
  parts.forEach((part, i) => {
    if (i % 2 === 1) {
      const nl = part.indexOf("\n");
      const pre = el("pre");
      pre.appendChild(el("code", null, nl >= 0 ? part.slice(nl + 1) : part));
      node.appendChild(pre);
    } else if (part) node.appendChild(document.createTextNode(part));
  });
}

function addMessage(role, text) {
  const box = el("div", "msg " + role);
  const body = el("div", "body");
  renderText(body, text);
  box.appendChild(body);
  $("messages").appendChild(box);
  $("messages").scrollTop = $("messages").scrollHeight;
  return box;
}

function needKey(message) {
  $("key-row").hidden = false;
  addMessage("error", message || "This server needs an API key: enter it below.");
}

async function send(ev) {
  ev.preventDefault();
  const text = $("input").value;
  if (!text.trim() || state.controller) return;
  $("input").value = "";
  state.messages.push({ role: "user", content: text });
  addMessage("user", text);
  const box = addMessage("assistant", "");
  const body = box.querySelector(".body");
  const meta = el("div", "meta", "…");
  box.appendChild(meta);
  const req = { model: state.model, messages: state.messages, stream: true, stream_options: { include_usage: true },
                temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value) };
  if ($("seed").value !== "") req.seed = Number($("seed").value);
  state.controller = new AbortController();
  $("stop").disabled = false; $("send").disabled = true;
  let answer = "", finish = null, usage = null, first = null;
  const t0 = performance.now();
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", body: JSON.stringify(req), signal: state.controller.signal,
                                                    headers: headers({ "Content-Type": "application/json" }) });
    if (!r.ok) {
      const err = (await r.json().catch(() => ({}))).error || {};
      if (r.status === 401) needKey(err.message);
      throw new Error((err.code || r.status) + ": " + (err.message || r.statusText));
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const line = buf.slice(0, cut).trim();
        buf = buf.slice(cut + 2);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error((chunk.error.code || "error") + ": " + chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        for (const c of chunk.choices || []) {
          if (c.delta && c.delta.content) {
            if (first === null) first = performance.now();
            answer += c.delta.content;
            renderText(body, answer);
          }
          if (c.finish_reason) finish = c.finish_reason;
        }
        $("messages").scrollTop = $("messages").scrollHeight;
      }
    }
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else { box.classList.add("error"); meta.textContent = String(e.message || e); }
  }
  if (!box.classList.contains("error")) {
    const n = usage ? usage.completion_tokens : null;
    const secs = first !== null ? (performance.now() - first) / 1000 : 0;
    const rate = n && secs > 0 && n > 1 ? ((n - 1) / secs).toFixed(1) + " tok/s" : "";
    meta.textContent = [finish || "", n !== null ? n + " tokens" : "", rate, ((performance.now() - t0) / 1000).toFixed(1) + " s"]
      .filter(Boolean).join(" · ");
    if (answer) state.messages.push({ role: "assistant", content: answer });
  }
  state.controller = null;
  $("stop").disabled = true; $("send").disabled = false;
}

// --- the pipeline -------------------------------------------------------------------------------------------------
const PLOTS = [
  ["tokens/s", (v) => v.tokens_per_s],
  ["streams running", (v) => v.streams.running],
  ["streams waiting", (v) => v.streams.waiting],
  ["prefix-cache hit rate", (v) => (v.prefix_cache && v.prefix_cache.enabled ? v.prefix_cache.hit_rate : null)],
  ["speculation acceptance", (v) => (v.speculation ? v.speculation.acceptance : null)],
];

function pct(x) { return x === null || x === undefined ? "–" : Math.round(100 * x) + " %"; }

function drawStages(now) {
  const root = $("stages");
  root.replaceChildren();
  const rings = now.rings || [];
  (now.stages || []).forEach((s, i) => {
    if (i < rings.length) root.appendChild(el("div", "ring", "ring " + i + " → " + pct(rings[i]) + " full"));
    const box = el("div", "stage" + (s.alive ? "" : " down"));
    box.dataset.stage = String(s.stage);
    const layers = s.layers ? "blocks " + s.layers[0] + "–" + s.layers[1] : "";
    const mem = s.resident_bytes ? (s.resident_bytes / 1048576).toFixed(0) + " MiB" : "";
    box.appendChild(el("div", "title", "stage " + s.stage + " · " + [s.device || "", layers, mem].filter(Boolean).join(" · ")
                                           + (s.alive ? "" : " · DOWN")));
    const bar = el("div", "bar"); const fill = el("div"); fill.style.width = Math.round(100 * (s.busy || 0)) + "%";
    bar.appendChild(fill); box.appendChild(bar);
    box.appendChild(el("div", "figures", "busy " + pct(s.busy) + " · rows/step "
                                         + (s.rows_per_step === null || s.rows_per_step === undefined ? "–" : s.rows_per_step)
                                         + " · " + (s.doing || "")));
    root.appendChild(box);
  });
  if (rings.length > (now.stages || []).length) root.appendChild(el("div", "ring", "ring " + (rings.length - 1) + " (tokens back) " + pct(rings[rings.length - 1]) + " full"));
}

function drawPlots(history) {
  const root = $("plots");
  root.replaceChildren();
  for (const [label, get] of PLOTS) {
    const values = history.map(get);
    if (values.every((v) => v === null || v === undefined)) continue;
    const wrap = el("div", "plot");
    const last = values[values.length - 1];
    wrap.appendChild(el("div", "label", label + ": " + (last === null || last === undefined ? "–" : Number(last).toFixed(2))));
    const c = el("canvas"); c.width = 400; c.height = 60;
    wrap.appendChild(c); root.appendChild(wrap);
    const g = c.getContext("2d");
    const max = Math.max(1e-9, ...values.filter((v) => typeof v === "number"));
    g.strokeStyle = "#1565c0"; g.beginPath();
    values.forEach((v, i) => {
      const x = (i / Math.max(1, values.length - 1)) * (c.width - 2) + 1, y = c.height - 2 - ((v || 0) / max) * (c.height - 4);
      i ? g.lineTo(x, y) : g.moveTo(x, y);
    });
    g.stroke();
  }
}

async function poll() {
  try {
    const r = await fetch("/stats", { headers: headers() });
    if (r.status === 401) { $("phase").textContent = "needs API key"; $("key-row").hidden = false; return; }
    if (!r.ok) throw new Error(String(r.status));
    const body = await r.json();
    const now = body.now;
    state.model = now.model || state.model;
    $("model").textContent = now.model || "";
    $("phase").textContent = now.phase + (now.restarts ? " · restarts " + now.restarts : "");
    $("phase").className = "phase " + now.phase;
    const pc = now.prefix_cache && now.prefix_cache.enabled ? "prefix cache hit " + pct(now.prefix_cache.hit_rate) : "prefix cache off";
    const spec = now.speculation ? " · speculation acceptance " + pct(now.speculation.acceptance) : "";
    $("summary").textContent = "streams " + now.streams.running + "/" + now.streams.max + " running, " + now.streams.waiting
      + " waiting · " + now.tokens_per_s.toFixed(1) + " tok/s · " + pc + spec;
    drawStages(now);
    drawPlots(body.history || []);
  } catch (e) {
    $("phase").textContent = "unreachable, retrying"; $("phase").className = "phase unreachable";  // a restart: poll on
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("composer").addEventListener("submit", send);
  $("input").addEventListener("keydown", (e) => { if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); } });
  $("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
  $("clear").addEventListener("click", () => { state.messages = []; $("messages").replaceChildren(); });
  $("api-key").value = state.key;
  $("api-key").addEventListener("change", () => { state.key = $("api-key").value; sessionStorage.setItem("pyruntime-key", state.key); });
  poll();
  setInterval(poll, 1000);
});
