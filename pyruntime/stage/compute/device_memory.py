"""A stage's host <-> device copies and its views into device buffers, the same on every tinygrad backend.

Two facts of tinygrad 0.13.0's backends shape this module:
- **Views.** The CPU, CUDA and the HCQ devices make a view of a buffer by pointer arithmetic (their allocators have
  `_offset`); OpenCL's has none (`offset function required for view`), and an OpenCL sub-buffer cannot stand in for
  one: it may only start at the device's base address alignment (128 bytes on PoCL), and tinygrad, seeing `_offset`,
  would view at any element. So where a backend has views this module views (zero-copy), and where it has none it
  copies: a read is one small copy kernel on the device, a write goes through the whole buffer on the host.
- **Writing part of a buffer.** Where a backend has no views, OpenCL's own write takes a byte offset
  (clEnqueueWriteBuffer; tinygrad 0.13's allocator always writes from 0): a record's rows go to their place in a
  staging buffer in one copy of their own bytes, not the whole buffer read back, patched and written again.
  `copies` counts every host <-> device copy this module makes and its bytes (the launch report's "copies per step").
- **When a copy has read its source.** A stage copies from memory it does not own past the call: a ring slot that goes
  back to its writer once the record is consumed, the model file's mmap, closed after loading. The CPU and the HCQ
  devices copy with memmove, CUDA through a pinned staging buffer, NULL reads nothing: the source is read when copyin
  returns. OpenCL enqueues a non-blocking write from the source itself (at load this was a segmentation fault), so
  there the device is synchronized before the source may go.
"""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
from tinygrad import Device, Tensor, UOp, dtypes
from tinygrad.device import Buffer
from tinygrad.helpers import prod

_SOURCE_READ_ON_RETURN = frozenset({"CPU", "CUDA", "NV", "AMD", "NULL"})
copies = {"count": 0, "bytes": 0}  # host <-> device copies made here, and their bytes (a process's own counts)


def _count(nbytes: int) -> None:
  copies["count"] += 1
  copies["bytes"] += nbytes


def has_views(device: str) -> bool:
  """Whether the backend views a buffer in place (else `view` copies and `write` rewrites the buffer)."""
  return hasattr(Device[device].allocator, "_offset")


def host_bytes(arr: np.ndarray) -> memoryview:
  """A byte memoryview of an array for Buffer.copyin, without copying it when it is C-contiguous: tinygrad's host
  copies take the source's address through ctypes, which refuses read-only memory (a ring payload, an mmap of the
  file), so a read-only array is viewed through a ctypes array at its address (the copy only reads it)."""
  if not arr.flags.c_contiguous: arr = np.ascontiguousarray(arr)
  if arr.flags.writeable or arr.nbytes == 0: return memoryview(arr).cast("B")
  return memoryview((ctypes.c_char * arr.nbytes).from_address(arr.ctypes.data)).cast("B")


def copy_to_device(buf: Buffer, arr: np.ndarray) -> None:
  """arr's bytes (exactly buf's size) into `buf`, done reading `arr` when this returns (module docstring)."""
  buf.ensure_allocated().copyin(host_bytes(arr))
  _count(arr.nbytes)
  if buf.device.split(":")[0] not in _SOURCE_READ_ON_RETURN: Device[buf.device].synchronize()


def _write_at(buf: Buffer, arr: np.ndarray, offset: int) -> bool:
  """arr's bytes into `buf` from byte `offset` with the backend's own offset write, where it has one (OpenCL), blocking
  (done reading arr on return); False elsewhere."""
  if buf.device.split(":")[0] != "CL": return False
  from tinygrad.helpers import from_mv
  from tinygrad.runtime.autogen import opencl as cl
  from tinygrad.runtime.ops_cl import check
  src = host_bytes(arr)
  check(cl.clEnqueueWriteBuffer(Device[buf.device].queue, buf.ensure_allocated()._buf, True, offset, src.nbytes, from_mv(src), 0, None, None))
  _count(src.nbytes)
  return True


def upload(arr: np.ndarray, device: str) -> Tensor:
  """A realized tensor on `device` holding arr (one copy, no tinygrad scheduling)."""
  from tinygrad.dtype import _from_np_dtype
  buf = Buffer(device, arr.size, _from_np_dtype(arr.dtype)).allocate()
  copy_to_device(buf, arr)
  return Tensor(UOp.from_buffer(buf)).reshape(arr.shape)


def write(buf: Buffer, arr: np.ndarray, offset: int = 0) -> None:
  """arr's bytes into `buf` from byte `offset` on; the rest of `buf` keeps what it held."""
  n = arr.nbytes
  if offset == 0 and n == buf.nbytes: return copy_to_device(buf, arr)
  if has_views(buf.device): return copy_to_device(buf.view(n, dtypes.uint8, offset), arr)
  if _write_at(buf, arr, offset): return None
  whole = np.frombuffer(buf.ensure_allocated().as_memoryview(), np.uint8).copy()
  _count(whole.nbytes)
  whole[offset:offset + n] = np.frombuffer(host_bytes(arr), np.uint8)
  copy_to_device(buf, whole)


def view(buf: Buffer, shape: tuple[int, ...], offset: int = 0) -> Tensor:
  """A realized tensor over prod(shape) elements of `buf` from element `offset` on: the same memory where the backend
  views, else a copy on the device (read it; what is written into it does not reach `buf`)."""
  n = prod(shape)
  if n == buf.size and not offset: return Tensor(UOp.from_buffer(buf)).reshape(shape)
  if has_views(buf.device):
    return Tensor(UOp.from_buffer(buf.view(n, buf.dtype, offset * buf.dtype.itemsize).ensure_allocated())).reshape(shape)
  return Tensor(UOp.from_buffer(buf))[offset:offset + n].reshape(shape).contiguous().realize()


def slot_region(t: Tensor, slot: int, shape: tuple[int, ...]) -> tuple[np.ndarray, Any]:
  """One slot's region of a float32 state tensor (slots, *shape) as a host array, and how to write it back (None: the
  array is the device's memory itself, a CPU's)."""
  n = prod(shape)
  buf = t.uop.buffer
  if has_views(buf.device):
    v = buf.view(n, dtypes.float32, slot * n * 4).ensure_allocated()
    if hasattr(v.allocator, "_as_buffer") and v.options is None:
      return np.frombuffer(v.as_memoryview(allow_zero_copy=True), dtype=np.float32).reshape(shape), None
  arr = view(buf, (n,), slot * n).numpy().reshape(shape)
  return arr, lambda a: write(buf, a, slot * n * 4)


MADV_REMOVE = 9  # Linux madvise: free a shared mapping's pages and their backing (they read back as zeros)
_libc = None


def release(buf: Buffer, offset: int, size: int) -> int:
  """Give back to the system the whole pages of bytes [offset, offset + size) of a CPU buffer (its contents become
  zeros): tinygrad's CPU buffers are shared anonymous mappings whose pages, once written, stay resident until the
  buffer is freed. The caller has synchronized the device: no kernel may still write there. Returns the bytes
  released; 0 on another device (its memory is the device's, all of it committed) or where the system refuses."""
  global _libc
  import mmap
  hcq = getattr(buf, "_buf", None) if buf.is_allocated() else None
  if not buf.device.startswith("CPU") or (addr := getattr(hcq, "va_addr", None)) is None: return 0
  start = -(-(int(addr) + offset) // mmap.PAGESIZE) * mmap.PAGESIZE
  end = (int(addr) + offset + size) // mmap.PAGESIZE * mmap.PAGESIZE
  if end <= start: return 0
  if _libc is None: _libc = ctypes.CDLL(None, use_errno=True)
  return end - start if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_REMOVE) == 0 else 0
