"""The process boundary in one file: what records on the rings mean, and the control channel's names.

The MO01 framing (a 40-byte header, then the payload) is the C library's business (native/mo_ring.h,
docs/wire-format.md); this module says what the launcher and the stages put in it.

Streams. Every record names its stream and position in its `object_id`, so any number of streams
are in flight at once without a round trip on the control channel:

    object_id = stream << 32 | position

A stream's life on the rings, launcher → head → … → tail → launcher:

    OPEN   flags=OPEN, payload = `OpenInfo` as JSON (KV slot, prompt length, request identity, sampling,
           end ids), padded with spaces to the ring's alignment. Every stage binds the stream to its KV
           slot and forwards the record at once; the tail's copy back to the launcher is the ack.
    DATA   head ingress: u32 token ids. Position 0 carries the whole prompt, each later record one token
           at position prompt_tokens + n - 1. Between stages: the residual (tokens x dim, boundary dtype)
           of one prefill chunk (at most MAX_CHUNK tokens, at the chunk's first position) or of one
           decode token. Tail egress: one u32 token id per step, END when it is an end token (or float32
           logits when the stream asked for them), at the position of the input token it came from. A stream
           that asked for log-probabilities (OpenInfo.logprobs = k >= 0) gets `TokenScore` records instead:
           the token, its log-probability and the k most likely tokens' (`logprob_payload`); with
           prompt_logprobs, one more per prompt row before the last (the row at position p scores the
           prompt's token p + 1, a MORE group per chunk), then the first sampled token as usual.
    CLOSE  flags=CLOSE, empty payload: every stage drops what it still holds of the stream, frees the slot
           and forwards the record; the tail's copy back proves nothing of the stream is in flight.
    ERROR  flags=ERROR, payload = JSON {"stage", "reason", "message"}: a stage could not compute a record
           of this stream (a token id outside the vocabulary, a position past the context, ...). It drops
           the stream and forwards the error; later stages drop it too and pass it on; the launcher ends
           that stream alone with the named error. The stream still needs its CLOSE.
    MORE   set on every record of a step's group but the last: the stage below keeps reading until the
           group is complete, so the rows one step produced are computed together in the next stage too.
    CACHE  flags=CACHE, payload = JSON {"save": [[block, position], ...]}: every stage copies those positions of the
           stream's KV slot (all computed: the launcher has their answers) into its prefix-cache blocks and forwards
           the record. An OPEN's `load` names blocks to copy into the new stream's slot before its first record, which
           then starts at position `cached` (pyruntime/engine/prefix_cache.py).

Order: on every ring a stream's records keep the order OPEN, DATA..., CLOSE. Records of different
streams interleave freely.
"""
from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field
from typing import Any

ABI_VERSION = 6  # 2: chunked prefill between stages, ERROR and MORE records, OpenInfo.prompt_tokens; 3: the prefix cache;
#                 4: speculative records (OpenInfo.speculative); 5: log-probabilities (OpenInfo.logprobs, prompt_logprobs);
#                 6: preempted streams resumed (OpenInfo.resumed)

FLAG_END = 1 << 0     # the tail sampled an end-of-sequence token
FLAG_OPEN = 1 << 1
FLAG_CLOSE = 1 << 2
FLAG_ERROR = 1 << 3
FLAG_MORE = 1 << 4
FLAG_CACHE = 1 << 5   # fill prefix-cache blocks from the stream's KV slot (payload: CacheInfo)

PREFILL_CHUNK = 32    # tinygrad's Transformer.generate chunk size: the largest chunk of its prefill (--decode reference)
MAX_CHUNK = 256       # the most prompt rows one record between stages carries (the rows path's largest chunk)
# float32 positions in one 4 KiB page of a key lane (a slot's keys hold each (kv head, dim) lane's positions side by
# side): a CPU stage starts each lane on a page of its own and keeps a short stream's first pages for the next one
# (stage/compute/rows.py), and the launch plan counts that page in every slot (engine/launch_plan.py)
PAGE_POSITIONS = 1024
MAX_VERIFY_ROWS = 16  # a speculative record: the last token and up to 15 drafted ones (one unit of the rows path)
# ConfigureRole's options (prefill_share, weights, decode, the stall bounds) are defined once, in pyruntime/options.py

POSITION_BITS = 32
POSITION_MASK = (1 << POSITION_BITS) - 1


def object_id(stream: int, position: int) -> int:
  assert 0 <= stream < 1 << 31 and 0 <= position <= POSITION_MASK
  return stream << POSITION_BITS | position


def split_object_id(oid: int) -> tuple[int, int]:
  return oid >> POSITION_BITS, oid & POSITION_MASK


def encode_json(obj: dict, alignment: int) -> bytes:
  raw = json.dumps(obj, separators=(",", ":")).encode()
  return raw + b" " * (-len(raw) % alignment)


def decode_json(payload) -> dict:
  return json.loads(bytes(payload))


@dataclass
class OpenInfo:
  """The OPEN record's payload. `history` (the prompt ids) is for the tail's penalties. `load` names the prefix-cache
  blocks holding the prompt's first `cached` positions ([block, position] pairs, positions 0, BLOCK, ...), and `state`
  the snapshot of the recurrent blocks' state after them (models with recurrent blocks)."""
  slot: int
  prompt_tokens: int
  identity: dict = field(default_factory=dict)      # {"request": stream id, "recipe": digest of model, split, dtype, template}
  sampling: dict = field(default_factory=dict)
  history: list[int] = field(default_factory=list)
  end_ids: list[int] = field(default_factory=list)
  logits: bool = False
  cached: int = 0
  load: list[list[int]] = field(default_factory=list)
  grammar: bool = False                              # a structured answer: its grammar came to the tail first (SetGrammar)
  speculative: bool = False                          # drafts come as records of up to MAX_VERIFY_ROWS rows, and may rewind
  logprobs: int = -1                                 # k >= 0: the tail answers with TokenScore records (top k); -1: token ids
  prompt_logprobs: bool = False                      # ... and scores every prompt row too (needs the rows path at the tail)
  state: int | None = None                           # recurrent blocks: the snapshot holding their state at position `cached`
  resumed: int = 0                                   # a preempted stream resumed: its answer so far, the last `resumed` ids of
                                                     # `history`, whose sampler draws and grammar steps the tail replays

  def encode(self, alignment: int) -> bytes: return encode_json(asdict(self), alignment)


MAX_TOP_LOGPROBS = 20  # the most alternatives a TokenScore carries (OpenAI's limit for top_logprobs)


@dataclass
class TokenScore:
  """A token and how likely the model found it: the log-softmax of the tail's raw logits (before penalties, temperature,
  truncation or a grammar's mask), with the `top` most likely tokens, most likely first (ties: lower id first)."""
  token: int
  logprob: float
  top: list[tuple[int, float]] = field(default_factory=list)


def logprob_payload(score: TokenScore, k: int) -> bytes:
  """A TokenScore on the tail's ring: u32 token, f64 logprob, then k x (u32 id, f64 logprob), little-endian."""
  assert len(score.top) == k
  return struct.pack(f"<Id{'Id' * k}", score.token, score.logprob, *(v for pair in score.top for v in pair))


def read_logprob_payload(payload: Any, k: int) -> TokenScore:
  vals = struct.unpack_from(f"<Id{'Id' * k}", payload)
  return TokenScore(vals[0], vals[1], [(vals[2 + 2 * i], vals[3 + 2 * i]) for i in range(k)])


def error_payload(stage: int | None, reason: str, message: str, alignment: int) -> bytes:
  return encode_json({"stage": stage, "reason": reason, "message": message}, alignment)


def ring_bytes(context_length: int, dim: int, itemsize: int, vocab_size: int, max_streams: int) -> dict[str, int]:
  """The largest record of each ring, and how many bytes each ring must hold so no writer waits on a reader that
  waits on it. In flight at once per stream: its OPEN, one data record (a prompt, a chunk or a token), two CACHE
  records (after the prompt, at the end) and its CLOSE; the launcher never sends a stream's next token before the tail
  answered the last one.

  head ingress: a whole prompt as u32 ids, or an OPEN (whose history repeats the prompt as JSON, at most 11 bytes an id,
  and whose prefix-cache blocks take at most 2 bytes a position: a [block, position] pair per 16), or a CACHE record
  between stages: one prefill chunk of residual rows, or an OPEN or CACHE record
  tail egress: one token (or the logits, or a TokenScore), an OPEN or CACHE echo, or an ERROR."""
  open_max = 1024 + 13 * context_length
  head = max(4 * context_length, open_max)
  mid = max(MAX_CHUNK * dim * itemsize, open_max)
  tail = max(4 * vocab_size, open_max)
  # + one record more: a record never splits across the ring's end, so the wrap-around can waste up to one record
  return {"head": head, "mid": mid, "tail": tail,
          "head_capacity": (4 * max_streams + 1) * (head + 64), "mid_capacity": (5 * max_streams + 1) * (mid + 64),
          "tail_capacity": (5 * max_streams + 1) * (tail + 64)}


class Command:
  """Control channel commands (JSON lines on a stage's stdin)."""
  INITIALIZE_WORKER = "InitializeWorker"
  CONFIGURE_ROLE = "ConfigureRole"
  LOAD_WEIGHTS = "LoadWeights"
  INSTALL_RING = "InstallRing"
  UNINSTALL_RING = "UninstallRing"
  RING_READABLE = "RingReadable"
  EXECUTE_STEP = "ExecuteStep"
  RELEASE_DEVICE_OBJECT = "ReleaseDeviceObject"
  ENCODE_PROMPT = "EncodePrompt"
  SET_GRAMMAR = "SetGrammar"  # the tail: a structured stream's grammar, sent before its OPEN (pyruntime/text/grammar.py)
  DECODE_TOKENS = "DecodeTokens"
  INFER_PROMPT = "InferPrompt"
  QUERY_STATS = "QueryStats"
  SHUTDOWN_WORKER = "ShutdownWorker"



class Event:
  """Control channel events (JSON lines on a stage's stdout)."""
  WORKER_READY = "WorkerReady"
  ROLE_CONFIGURED = "RoleConfigured"
  WEIGHTS_LOADED = "WeightsLoaded"
  WARMED_UP = "WarmedUp"
  GRAPH_PREPARING = "GraphPreparing"  # a graph is being loaded from the graph cache or captured
  GRAPH_READY = "GraphReady"
  STAGE_WARNING = "StageWarning"      # something runs degraded (an unusable graph cache file, say); the stage goes on
  DOWNLOAD_PROGRESS = "DownloadProgress"
  RING_INSTALLED = "RingInstalled"
  RING_UNINSTALLED = "RingUninstalled"
  RING_IDLE = "RingIdle"
  OBJECT_LOADED = "ObjectLoaded"
  STEP_EXECUTED = "StepExecuted"
  OBJECT_RELEASED = "ObjectReleased"
  PROMPT_ENCODED = "PromptEncoded"
  TOKENS_DECODED = "TokensDecoded"
  FIRST_TOKEN_READY = "FirstTokenReady"
  TOKEN_PROGRESS = "TokenProgress"
  PROMPT_COMPLETED = "PromptCompleted"
  STAGE_STATS = "StageStats"
  DATA_LOOP_STOPPED = "DataLoopStopped"
  PROFILE_REPORT = "ProfileReport"
  WORKER_STOPPED = "WorkerStopped"
  WORKER_FATAL = "WorkerFatal"
  HEARTBEAT = "Heartbeat"             # from the data loop's own thread: its progress counters (the launcher's stall rule)
