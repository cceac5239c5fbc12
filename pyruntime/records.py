"""What the records on pyruntime's rings mean (the MO01 framing itself lives in native/).

Every record names its stream and position in its `object_id`, so any number of streams can
be in flight without a round trip on the control channel:

    object_id = stream << 32 | position

A stream's life on the rings, head → … → tail → launcher:

    OPEN   flags=FLAG_OPEN, payload = JSON (slot, identity, sampling, end ids), padded with
           spaces to the ring's alignment. Every stage binds the stream to its KV slot and
           forwards the record unchanged; the tail's copy back to the launcher is the ack.
    DATA   position 0 carries the whole prompt; each later record carries one token at
           position prompt_tokens + n - 1. Head ingress: u32 token ids; between stages: the
           residual (tokens x hidden_dim, boundary dtype); tail egress: one u32 token id,
           FLAG_END when it is an end token (or float32 logits when the stream asked for them).
    CLOSE  flags=FLAG_CLOSE, empty payload: every stage frees the slot and forwards it; the
           tail's copy back is the ack that nothing of the stream is left in flight.
"""
from __future__ import annotations

import json

ABI_VERSION = 1

FLAG_END = 1 << 0     # SPEC §1: the tail sampled an end-of-sequence token
FLAG_OPEN = 1 << 1
FLAG_CLOSE = 1 << 2

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
