"""Launch options defined once, as params.py defines a request's: name, values or bounds, default and help of every
option that chooses how a pipeline runs. The CLI builds its flags from these definitions, `Launcher` checks its
keywords with them and a stage checks its ConfigureRole with them, so the three cannot drift apart.
No tinygrad, no numpy: the launcher, the CLI and the server import it.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from pyruntime import errors
from pyruntime.params import Param

BOUNDARY_DTYPES = ("float32", "float16")
# How a stage keeps its weights. "quantized": as in the file, dequantised inside every kernel by tinygrad's own code
# (tinygrad's default, so `decode="reference"` gives its exact tokens); "packed": the file's Q4_0/Q4_1/Q8_0 blocks
# repacked for the rows path and dequantised in registers to float32 mode's values (its bits at the file's size;
# pyruntime/stage/compute/packed.py), every other type as float16; "packed-all": every type of a Q4_K_M file so
# (Q5_0/Q5_1 and the K-quants too: the smallest memory, and for now a slower decode than float16 holds them,
# bench/results/2026-12-06-packed-k-quants.md); "float16": dequantised once at load (tinygrad's REALIZE=1); "float32":
# those float16 values held as float32 (the same products); "packed-int8": packed-all's types (5- and 6-bit codes a
# byte each), a CPU's products in llama.cpp's arithmetic (each row's activations quantized to int8 per block of 32, integer dot products:
# pyruntime/stage/compute/int8_product.py), faster and further from the file's values
WEIGHT_MODES = ("quantized", "packed", "packed-all", "packed-int8", "float16", "float32")
# "batched" runs a stage's rows path (many streams per step, prompt and decode rows with the same bits,
# pyruntime/stage/compute/rows.py; every family, modelfile.plan.ROWS_ARCHS); "reference" runs tinygrad's own prefill and T=1
# decode kernels, one stream at a time (tinygrad's exact tokens; not for gemma3, which tinygrad has no model of).
DECODE_MODES = ("batched", "reference")


@dataclass(frozen=True)
class Choice:
  name: str
  values: tuple[str, ...]
  default: str
  help: str
  prefixed: tuple[str, ...] = ()  # also allowed: a value of the form PREFIX + something (speculative's "model:PATH")

  @property
  def flag(self) -> str: return "--" + self.name.replace("_", "-")

  def check(self, v: Any, error: type[errors.PyruntimeError] = errors.InvalidOption) -> str:
    """v if it is one of the values, else `error` (InvalidOption naming the option; a stage passes InvalidCommand)."""
    if isinstance(v, str) and (v in self.values or any(v.startswith(p) and len(v) > len(p) for p in self.prefixed)): return v
    text = f"must be one of {', '.join(self.values + tuple(p + '...' for p in self.prefixed))}, not {v!r:.80}"
    raise error(self.name, text) if error is errors.InvalidOption else error(f"{self.name} {text}")


CHOICES = {c.name: c for c in (
  Choice("boundary_dtype", BOUNDARY_DTYPES, "float32", "dtype of activations between stages"),
  Choice("decode", DECODE_MODES, "batched", "batched: many streams per step, batch-invariant tokens; reference: tinygrad's own decode "
         "kernels, one stream at a time, its exact tokens"),
  Choice("weights", ("auto", *WEIGHT_MODES), "auto", "how stages keep the weights: quantized as in the file (tinygrad's own kernels), "
         "packed (the file's Q4_0/Q4_1/Q8_0 blocks dequantised in registers, float32's bits at the file's size), packed-all (every "
         "type of a Q4_K_M file so: the least memory, a slower decode for now), packed-int8 (packed-all's types on a CPU, "
         "activations quantized to int8 per row: llama.cpp's arithmetic and error, integer products), or dequantised once at "
         "load (float16, float32); auto: packed on a CPU when it takes at most half of free memory (float32 on CPU:X86, which has no "
         "clang kernels), quantized on GPUs and with --decode reference"),
  Choice("tensor_cores", ("off", "on"), "off", "on: the projections of the batched path take float16 activations, so a GPU runs "
         "them on its tensor cores (a projection's products exact, its sums in float32; every row through the same padded tile, so "
         "a decode row still equals a prompt row), at float16's rounding of each projection's input (docs/prompt-path.md, 'Tensor "
         "cores'); needs float16 values of the weights (not --weights float32); elsewhere the same numbers, summed in order"),
  Choice("speculative", ("off", "ngram"), "off", "ngram: draft tokens by looking the stream's last tokens up in its prompt and "
         "output; model:PATH: draft them with a smaller GGUF of the same vocabulary, run as a stage of its own; either way verified by "
         "the pipeline in one step each (exactly plain decoding's tokens; greedy streams; docs/speculation.md)", prefixed=("model:",)),
)}

# `pyruntime serve`'s limits on what one client may hold, and its healing (pyruntime/serving/): here, so that the CLI
# builds the serve command's flags without importing the server
MAX_BODY_BYTES = 4 << 20        # a request body beyond this is refused with 413 (read and dropped up to DRAIN_FACTOR times it)
TIMEOUT_REQUEST_HEAD = 10.0     # seconds from connecting (or from the first byte of a keep-alive request) to a complete head
TIMEOUT_REQUEST_BODY = 60.0     # seconds for the whole body, once the head is in
TIMEOUT_KEEP_ALIVE = 5.0        # seconds an idle keep-alive connection is kept
SHUTDOWN_GRACE_S = 30.0         # on SIGTERM, how long running requests may take to finish before they are ended
RESTART_ATTEMPTS = 5            # consecutive failed attempts to restart the pipeline before the server gives up (503 for good)

PREFIX_CACHE_TOKENS = 8192  # the default budget: tokens whose keys and values every stage keeps (SmolLM2: 46 KB each)
# a model with recurrent blocks (hybrid) also keeps their state at cached prefixes' ends: one snapshot per this many
# tokens of the budget (a snapshot is a stream's whole recurrent state, tens of MiB at real sizes; docs/prompt-path.md)
PREFIX_STATE_TOKENS = 64
PREFILL_SHARE = 2.0   # bounds a step that carries a chunk at about 3 decode steps (bench/results/log-through-2026-12-03.md has the trade measured)
# The stall rule (docs/control-channel.md, "Stalls"): a stage with work and no progress (Heartbeat counters) this long,
# or STALL_STEPS of its slowest step if longer, is ended as stalled; while it captures a graph, the larger bound.
STALL_TIMEOUT_S = 20.0
STALL_CAPTURE_TIMEOUT_S = 600.0
STALL_STEPS = 20

NUMBERS = {p.name: p for p in (
  Param("max_streams", int, 8, "streams run through the pipeline at once (KV slots per stage); the rest wait", lo=1, hi=256),
  Param("prefix_cache", int, PREFIX_CACHE_TOKENS, "tokens of prompts and replies whose keys and values the stages keep for later "
        "requests that begin with them (chat turns, shared system prompts), in host memory (`inspect` shows bytes per token); 0: off",
        lo=0, hi=1 << 28),
  Param("kv_budget", int, 0, "keys and values of at most this many positions, all running streams together (on a CPU a stage's "
        "pages follow the streams' positions); past it the stream admitted last is preempted (what it computed goes to the prefix "
        "cache) and resumed when room is back, with the same tokens; at least the context; 0: every stream may hold the whole "
        "context (no preemption)", lo=0, hi=1 << 31),
  Param("prefill_share", float, PREFILL_SHARE, "beside decoding streams, a new prompt's prefill chunks cost about this share of their "
        "step (0: whole 256-token chunks, the fastest first token and the longest stalls for the others)", lo=0.0, hi=16.0),
  Param("draft_tokens", int, 7, "the most tokens a speculative draft holds (its length adapts below this to what the model "
        "accepts)", lo=1, hi=15),
  Param("stall_timeout", float, STALL_TIMEOUT_S, f"a stage with work and no progress this long (or {STALL_STEPS} of its slowest "
        "steps) is ended as stalled", lo=0.5, hi=86400.0),
  Param("stall_capture_timeout", float, STALL_CAPTURE_TIMEOUT_S, "... while it captures a graph that was not prepared at load "
        "(no progress is reported meanwhile)", lo=0.5, hi=86400.0),
)}


# `pyruntime serve`'s own options (the launch options above come beside them): defined once here, the CLI's flags built
# from them, and the server takes a ServeOptions (serving never sees the CLI's argparse namespace)
SERVE_NUMBERS = {p.name: p for p in (
  Param("port", int, 8000, "TCP port", lo=0, hi=65535),
  Param("queue_size", int, 16, "streams waiting beyond the running ones (max_streams) get 429; 0: none wait", lo=0, hi=1 << 20),
  Param("max_body_bytes", int, MAX_BODY_BYTES, "a request body longer than this gets 413", lo=0),
  Param("timeout_request_head", float, TIMEOUT_REQUEST_HEAD, "seconds a connection may take to send a complete request head before "
        "it is closed", lo=0.0, lo_open=True, hi=86400.0),
  Param("timeout_request_body", float, TIMEOUT_REQUEST_BODY, "seconds a request body may take to arrive before it gets 408",
        lo=0.0, lo_open=True, hi=86400.0),
  Param("timeout_keep_alive", float, TIMEOUT_KEEP_ALIVE, "seconds an idle keep-alive connection is kept open", lo=0.0, lo_open=True, hi=86400.0),
  Param("shutdown_grace", float, SHUTDOWN_GRACE_S, "on SIGTERM, seconds running requests get to finish (new ones get 503) before "
        "they are ended", lo=0.0, hi=86400.0),
  Param("restart_attempts", int, RESTART_ATTEMPTS, "when a stage dies, restart the pipeline, giving up after this many failed "
        "attempts in a row; 0: never restart", lo=0, hi=1000),
)}


@dataclass(frozen=True)
class ServeOptions:
  """What `pyruntime serve` runs with besides the launch options: where it listens, who may call it, and SERVE_NUMBERS'
  limits (defaults from there), each checked on construction (InvalidOption naming it)."""
  host: str = "127.0.0.1"
  api_key: str | None = None             # the API, /stats and /metrics need 'Authorization: Bearer KEY'
  allowed_host: tuple[str, ...] = ()     # Host names answered besides loopback and `host` (against DNS rebinding)
  port: int = SERVE_NUMBERS["port"].default
  queue_size: int = SERVE_NUMBERS["queue_size"].default
  max_body_bytes: int = SERVE_NUMBERS["max_body_bytes"].default
  timeout_request_head: float = SERVE_NUMBERS["timeout_request_head"].default
  timeout_request_body: float = SERVE_NUMBERS["timeout_request_body"].default
  timeout_keep_alive: float = SERVE_NUMBERS["timeout_keep_alive"].default
  shutdown_grace: float = SERVE_NUMBERS["shutdown_grace"].default
  restart_attempts: int = SERVE_NUMBERS["restart_attempts"].default

  def __post_init__(self) -> None:
    for name, param in SERVE_NUMBERS.items(): param.check(getattr(self, name))
    if self.api_key is not None and not self.api_key: raise errors.InvalidOption("api_key", "must not be empty")

  @classmethod
  def from_args(cls, ns: argparse.Namespace) -> ServeOptions:
    """From the CLI's parsed flags (add_serve_args)."""
    return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)} | {"allowed_host": tuple(ns.allowed_host or ())})


def add_serve_args(p: argparse.ArgumentParser) -> None:
  """`pyruntime serve`'s own flags, from ServeOptions and SERVE_NUMBERS."""
  p.add_argument("--host", default=ServeOptions.host, help="address to listen on (beyond loopback, use --api-key)")
  p.add_argument("--api-key", default=None, help="the API, /stats and /metrics need 'Authorization: Bearer KEY' (the page asks for it) "
                 "(default: none)")
  p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                 help="a Host name the server answers to besides loopback and --host (repeatable; against DNS rebinding) (default: none)")
  for n in SERVE_NUMBERS.values(): p.add_argument(n.flag, type=n.kind, default=n.default, help=n.help)


def check_launch(**options: Any) -> None:
  """InvalidOption naming the first launch option (CHOICES, NUMBERS) whose value is not allowed."""
  for name, v in options.items():
    if name in CHOICES: CHOICES[name].check(v)
    else: NUMBERS[name].check(v)


def add_cli_args(p: argparse.ArgumentParser) -> None:
  """The launch options as flags, from their definitions."""
  for c in CHOICES.values():  # a prefixed choice is checked by the Launcher, naming the option, before anything loads
    shown = "{" + ",".join(c.values + tuple(x + "PATH" for x in c.prefixed)) + "}"
    if c.prefixed: p.add_argument(c.flag, default=c.default, help=c.help, metavar=shown)
    else: p.add_argument(c.flag, choices=c.values, default=c.default, help=c.help)
  for n in NUMBERS.values():
    metavar = {"prefix_cache": "TOKENS", "kv_budget": "POSITIONS", "stall_timeout": "S", "stall_capture_timeout": "S"}.get(n.name)
    p.add_argument(n.flag, type=n.kind, default=n.default, help=n.help, metavar=metavar)
