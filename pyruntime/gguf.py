"""GGUF header reading without touching tensor data.

A stage must not materialise layers it does not own, so instead of tinygrad's `gguf_load`
(which copies the whole file to the device) we read the metadata and tensor table here and
let the stage fetch only the byte ranges it needs.
"""
from __future__ import annotations

import io
import pathlib
from dataclasses import dataclass

from tinygrad.helpers import prod, round_up
from tinygrad.llm.gguf import _GGML_NATIVE, _GGML_QUANT, read_int32, read_int64, read_str, read_uint32, read_uint64, readers


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


def tensor_nbytes(dims: tuple[int, ...], ggml_type: int) -> int:
  n = prod(dims)
  if (dt := _GGML_NATIVE.get(ggml_type)) is not None: return n * dt.itemsize
  if (q := _GGML_QUANT.get(ggml_type)) is not None: return (n // q[0]) * q[1]
  raise ValueError(f"GGML type {ggml_type} is not supported")


def read_header(path: str | pathlib.Path) -> GGUFHeader:
  """Parse the metadata and tensor table of a GGUF file (v2/v3). Raises ValueError on a non-GGUF file."""
  path = pathlib.Path(path)
  with open(path, "rb") as f:
    r = io.BufferedReader(f, 1 << 20)  # type: ignore[arg-type]
    magic, version = r.read(4), read_int32(r)
    if magic != b"GGUF" or version not in (2, 3): raise ValueError(f"{path} is not a GGUF v2/v3 file")
    n_tensors, n_kv = read_int64(r), read_int64(r)
    kv = {}
    for _ in range(n_kv):
      k, typ = read_str(r), read_int32(r)
      kv[k] = readers[typ](r)
    infos = [(read_str(r), tuple(read_uint64(r) for _ in range(read_uint32(r))), read_int32(r), read_uint64(r))
             for _ in range(n_tensors)]
    data_start = round_up(r.tell(), kv.get("general.alignment", 32))
  tensors = {name: TensorInfo(name, dims, typ, data_start + off, tensor_nbytes(dims, typ)) for name, dims, typ, off in infos}
  return GGUFHeader(path, kv, tensors)
