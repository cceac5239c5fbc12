"""GGUF header reading without touching tensor data.

A stage must not materialise layers it does not own, so instead of tinygrad's `gguf_load`
(which copies the whole file to the device) we read the metadata and tensor table here and
let the stage fetch only the byte ranges it needs.

The file is untrusted: `read_header` checks every length, count, type and offset against what
the file can hold before acting on it, and refuses a corrupt file with `ModelLoadFailed` naming
the field and its byte offset. It never allocates more than the file's own size (a key length or
array count of 2**63 is refused, not attempted), and it never reads tensor data.
"""
from __future__ import annotations

import mmap
import os
import pathlib
import struct
from dataclasses import dataclass
from typing import Any

from pyruntime.errors import GgufLocalPathMissing, ModelLoadFailed

GGML_MAX_DIMS = 4                  # ggml.h: a tensor has at most 4 dimensions
DEFAULT_ALIGNMENT = 32
INT64_MAX = (1 << 63) - 1

# GGML tensor types we can read: id -> (elements per block, bytes per block), ggml.c's type_traits. Plain types
# are blocks of one element. Kept here so reading a header needs no tinygrad; tests/unit/test_gguf.py checks it against
# tinygrad's own tables (tinygrad.llm.gguf), which is what dequantises the data.
GGML_TYPES: dict[int, tuple[int, int]] = {
  0: (1, 4), 1: (1, 2), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 30: (1, 2),  # F32 F16 I8 I16 I32 I64 F64 BF16
  2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 39: (32, 17), 41: (128, 18),   # Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 MXFP4 Q1_0
  12: (256, 144), 13: (256, 176), 14: (256, 210),                                                 # Q4_K Q5_K Q6_K
  18: (256, 98), 21: (256, 110), 22: (256, 82), 23: (256, 136),                                  # IQ3_XXS IQ3_S IQ2_S IQ4_XS
}

GGML_TYPE_NAMES = {0: "F32", 1: "F16", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 30: "BF16", 2: "Q4_0", 3: "Q4_1",
                   6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 39: "MXFP4", 41: "Q1_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K",
                   18: "IQ3_XXS", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS"}

# The block types a CPU stage can keep as codes (pyruntime/stage/compute/packed.py), every Q4_K_M file's types among them:
# id -> (inputs per scale, bits per code, bias subtracted from a code, whether a scale has an offset beside it, whether
# it is a K-quant (a sub-block's scale and offset are integers, times its super-block's float16 d and dmin), and k: an
# offset of k times the scale, computed in the kernel as the reference does (Q5_0's q * d + (-16 * d))).
PACKED_TYPES: dict[int, tuple[int, int, int, bool, bool, int]] = {
  2: (32, 4, 8, False, False, 0), 3: (32, 4, 0, True, False, 0), 6: (32, 5, 0, False, False, -16), 7: (32, 5, 0, True, False, 0),
  8: (32, 8, 128, False, False, 0), 12: (32, 4, 0, True, True, 0), 13: (32, 5, 0, True, True, 0), 14: (16, 6, 32, False, True, 0),
}  # Q4_0 Q4_1 Q5_0 Q5_1 / Q8_0 Q4_K Q5_K Q6_K
SUPER_BLOCK = 256  # a K-quant's inputs per float16 d (and dmin)
# what weights="packed" keeps packed: the types whose kernels decode at least as fast as float16 holding them (measured,
# bench/results/2026-12-06-packed-k-quants.md); "packed-all" keeps every PACKED_TYPES type, and so does "packed-int8",
# whose projections multiply in integers
FAST_PACKED_TYPES = frozenset({2, 3, 8})


def packed_types(weights: str) -> frozenset[int]:
  """The GGML types a stage keeps as codes in weights mode `weights` (none outside the packed modes)."""
  return frozenset(PACKED_TYPES) if weights in ("packed-all", "packed-int8") else FAST_PACKED_TYPES if weights == "packed" else frozenset()


def packed_nbytes(ggml_type: int, elements: int, wide: bool = False) -> int:
  """Bytes a stage holds of `elements` weights of a PACKED_TYPES type: the codes (5- and 6-bit ones a byte each when
  `wide`: packed.repack's), and a scale (and offset) per block: float16, or for a K-quant an integer byte per block and
  a float16 per super-block; about the file's own size."""
  block, bits, _, offset, k_quant, _ = PACKED_TYPES[ggml_type]
  if wide and bits > 4: bits = 8
  per_block = 1 if k_quant else 2  # bytes of a block's scale
  scales = elements // block * per_block + (elements // SUPER_BLOCK * 2 if k_quant else 0)
  return elements * bits // 8 + scales * (2 if offset else 1)


# GGUF value types: id -> (name, struct code or None for string/array, byte size of one fixed-size value)
STRING, ARRAY = 8, 9
_SCALARS: dict[int, tuple[str, str, int]] = {
  0: ("uint8", "B", 1), 1: ("int8", "b", 1), 2: ("uint16", "H", 2), 3: ("int16", "h", 2), 4: ("uint32", "I", 4),
  5: ("int32", "i", 4), 6: ("float32", "f", 4), 7: ("bool", "?", 1), 10: ("uint64", "Q", 8), 11: ("int64", "q", 8),
  12: ("float64", "d", 8),
}


@dataclass(frozen=True)
class TensorInfo:
  name: str
  dims: tuple[int, ...]      # GGUF order (fastest-varying first), as stored
  ggml_type: int
  offset: int                # absolute byte offset in the file
  nbytes: int

  @property
  def shape(self) -> tuple[int, ...]: return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GGUFHeader:
  path: pathlib.Path
  kv: dict
  tensors: dict[str, TensorInfo]

  @property
  def arch(self) -> str: return self.kv["general.architecture"]
  def get(self, key: str, default=None): return self.kv.get(f"{self.arch}.{key}", default)
  @property
  def num_blocks(self) -> int:
    """The blocks the model runs: `block_count` counts the multi-token-prediction (nextn) layers too, which
    tinygrad's `from_gguf` neither builds nor runs; every count of blocks (stages, splits, inspect) uses this one."""
    return int(self.get("block_count")) - int(self.get("nextn_predict_layers", 0))


def tensor_nbytes(dims: tuple[int, ...], ggml_type: int) -> int:
  n = 1
  for d in dims: n *= d
  if (bt := GGML_TYPES.get(ggml_type)) is not None: return (n // bt[0]) * bt[1]
  raise ModelLoadFailed(f"GGML type {ggml_type} is not supported")


class _Cursor:
  """Bounds-checked little-endian reads from a buffer; every failure is a ModelLoadFailed."""
  def __init__(self, buf: Any, path: pathlib.Path):
    self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

  def fail(self, what: str, at: int | None = None) -> ModelLoadFailed:
    return ModelLoadFailed(f"{self.path} is not a valid GGUF file: {what} (at byte {self.pos if at is None else at} of {self.size})")

  def need(self, n: int, what: str) -> None:
    if n < 0 or n > self.size - self.pos:
      raise self.fail(f"{what} needs {n} bytes but only {self.size - self.pos} remain (file truncated or length corrupt)")

  def unpack(self, code: str, size: int, what: str) -> Any:
    self.need(size, what)
    v = struct.unpack_from("<" + code, self.buf, self.pos)[0]
    self.pos += size
    return v

  def u32(self, what: str) -> int: return self.unpack("I", 4, what)
  def u64(self, what: str) -> int: return self.unpack("Q", 8, what)

  def string(self, what: str) -> str:
    at = self.pos
    n = self.u64(f"the length of {what}")
    self.need(n, f"{what} ({n} bytes)")
    raw = bytes(self.buf[self.pos:self.pos + n])
    self.pos += n
    try: return raw.decode("utf-8")
    except UnicodeDecodeError as e: raise self.fail(f"{what} is not UTF-8 ({e.reason})", at) from None

  def strings(self, n: int, what: str) -> list[str]:
    """n strings in a row (a vocabulary: tens of thousands), with `string`'s checks in one tight loop."""
    buf, pos, size, out = self.buf, self.pos, self.size, []
    unpack = struct.Struct("<Q").unpack_from
    for i in range(n):
      if pos + 8 > size: self.pos = pos; raise self.fail(f"the length of {what}[{i}] runs past the end of the file (truncated?)")
      k = unpack(buf, pos)[0]
      if k > size - pos - 8: self.pos = pos; raise self.fail(f"{what}[{i}] needs {k} bytes but only {size - pos - 8} remain")
      try: out.append(buf[pos + 8:pos + 8 + k].decode("utf-8"))
      except UnicodeDecodeError as e: raise self.fail(f"{what}[{i}] is not UTF-8 ({e.reason})", pos) from None
      pos += 8 + k
    self.pos = pos
    return out

  def value(self, typ: int, what: str, in_array: bool = False) -> Any:
    if (s := _SCALARS.get(typ)) is not None: return self.unpack(s[1], s[2], what)
    if typ == STRING: return self.string(what)
    if typ == ARRAY and not in_array: return self.array(what)
    raise self.fail(f"{what} has {'nested array' if typ == ARRAY else f'unknown value type {typ}'}", self.pos - 4)

  def array(self, what: str) -> list:
    typ = self.u32(f"the element type of {what}")
    n = self.u64(f"the element count of {what}")
    if (s := _SCALARS.get(typ)) is not None:
      self.need(n * s[2], f"{what} ({n} {s[0]} values)")   # before allocating anything
      out = list(struct.unpack_from(f"<{n}{s[1]}", self.buf, self.pos))
      self.pos += n * s[2]
      return out
    if typ == STRING:
      self.need(n * 8, f"{what} ({n} strings of at least 8 bytes each)")
      return self.strings(n, what)
    raise self.fail(f"{what} has {'nested arrays' if typ == ARRAY else f'unknown element type {typ}'}", self.pos - 12)


def read_header(path: str | pathlib.Path) -> GGUFHeader:
  """Parse the metadata and tensor table of a GGUF file (v2/v3).

  Raises ModelLoadFailed for anything that is not a well-formed GGUF file (GgufLocalPathMissing when
  there is no file)."""
  path = pathlib.Path(path)
  try:
    with open(path, "rb") as f:
      if os.fstat(f.fileno()).st_size == 0: raise ModelLoadFailed(f"{path} is not a valid GGUF file: it is empty")
      with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:   # pages in only the header's bytes
        return _parse(_Cursor(mm, path))
  except FileNotFoundError: raise GgufLocalPathMissing(f"no GGUF file at {path}") from None
  except (OSError, ValueError) as e: raise ModelLoadFailed(f"{path}: cannot read it: {e}") from e


def _parse(c: _Cursor) -> GGUFHeader:
  magic = bytes(c.buf[0:4])
  if magic != b"GGUF": raise c.fail(f"it starts with {magic!r}, not b'GGUF'", 0)
  c.pos = 4
  version = c.u32("the version")
  if version not in (2, 3): raise c.fail(f"version {version} is not supported (only 2 and 3)", 4)
  n_tensors, n_kv = c.u64("the tensor count"), c.u64("the key/value count")
  # every entry takes some bytes: a count the file cannot hold is refused before looping over it
  if n_kv > (c.size - c.pos) // 13: raise c.fail(f"{n_kv} key/value pairs cannot fit in the file", 16)
  kv: dict[str, Any] = {}
  for i in range(n_kv):
    at = c.pos
    key = c.string(f"key #{i}")
    if key in kv: raise c.fail(f"key {key!r} appears twice", at)
    kv[key] = c.value(c.u32(f"the value type of {key!r}"), f"the value of {key!r}")
  if not isinstance(kv.get("general.architecture"), str): raise c.fail("general.architecture (a string) is missing")
  alignment = kv.get("general.alignment", DEFAULT_ALIGNMENT)
  if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
    raise c.fail(f"general.alignment must be a positive power of two, got {alignment!r}")

  if n_tensors > (c.size - c.pos) // 24: raise c.fail(f"{n_tensors} tensor descriptions cannot fit in the file", 8)
  infos: list[tuple[str, tuple[int, ...], int, int, int]] = []
  names: set[str] = set()
  for i in range(n_tensors):
    at = c.pos
    name = c.string(f"the name of tensor #{i}")
    if name in names: raise c.fail(f"tensor {name!r} appears twice", at)
    names.add(name)
    n_dims = c.u32(f"the dimension count of {name!r}")
    if n_dims > GGML_MAX_DIMS: raise c.fail(f"tensor {name!r} has {n_dims} dimensions (at most {GGML_MAX_DIMS})", c.pos - 4)
    dims = tuple(c.u64(f"dimension {d} of {name!r}") for d in range(n_dims))
    typ = c.u32(f"the type of {name!r}")
    offset = c.u64(f"the data offset of {name!r}")
    n = 1
    for d in dims:
      n *= d
      if n > INT64_MAX: raise c.fail(f"tensor {name!r} has dimensions {dims}: more than 2**63 elements", at)
    # a quantized type packs its first dimension in blocks (a scalar, with no dimension, has none to pack)
    if typ in GGML_TYPES and (block := GGML_TYPES[typ][0]) > 1 and (not dims or dims[0] % block):
      raise c.fail(f"tensor {name!r}: its first dimension {dims[0] if dims else '(none: a scalar)'} is not a multiple of the block "
                   f"size {block} of GGML type {typ}", at)
    if typ not in GGML_TYPES: raise c.fail(f"tensor {name!r} has unknown or unsupported GGML type {typ}", at)
    if offset % alignment: raise c.fail(f"tensor {name!r} starts at data offset {offset}, not a multiple of the alignment {alignment}", at)
    infos.append((name, dims, typ, offset, tensor_nbytes(dims, typ)))
  data_start = -(-c.pos // alignment) * alignment
  for name, _, _, offset, nbytes in infos:
    if data_start + offset + nbytes > c.size:
      raise c.fail(f"tensor {name!r} ({nbytes} bytes at {data_start + offset}) extends past the end of the file (truncated?)")
  return GGUFHeader(c.path, kv, {name: TensorInfo(name, dims, typ, data_start + off, nbytes) for name, dims, typ, off, nbytes in infos})
