"""pyruntime.modelfile.gguf.read_header on corrupt files: every one is refused with ModelLoadFailed, none allocates
more than the file holds, and a good file still reads exactly as the `gguf` package wrote it.

The corruptions are made on a tiny but complete GGUF written with the `gguf` package: every
truncation, targeted fields (key length, value type, array count, alignment, tensor table), and
random byte mutations (hypothesis).
"""
from __future__ import annotations

import pathlib
import struct
import tracemalloc

import numpy as np
import pytest
from conftest import require
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

gguf = require("gguf", "writing test files")

from tinymodels import write_tiny_gguf  # noqa: E402

from pyruntime import errors  # noqa: E402
from pyruntime.modelfile.gguf import GGUFHeader, read_header  # noqa: E402
from pyruntime.text.tokenizer import Tokenizer  # noqa: E402

ARRAY = 9   # the GGUF value type of an array


def write_small(path: pathlib.Path) -> pathlib.Path:
  """A small GGUF with every kind of value: scalars, a string, arrays of ints and strings, two tensors."""
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_uint32("general.alignment", 32)
  w.add_uint32("llama.context_length", 64)
  w.add_float32("llama.rope.freq_base", 10000.0)
  w.add_bool("tokenizer.ggml.add_bos_token", True)
  w.add_string("general.name", "Tiny Test Model")
  w.add_array("tokenizer.ggml.token_type", [1, 1, 3])
  w.add_array("tokenizer.ggml.tokens", ["a", "b", "<s>"])
  w.add_tensor("norm.weight", np.arange(8, dtype=np.float32))
  w.add_tensor("blk.0.w", gguf.quants.quantize(np.ones((2, 32), np.float32), gguf.GGMLQuantizationType.Q8_0),
               raw_dtype=gguf.GGMLQuantizationType.Q8_0)
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
  return path


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> bytes:
  return write_small(tmp_path_factory.mktemp("gguf") / "small.gguf").read_bytes()


def key_at(data: bytes, key: str) -> int:
  """Byte offset of the length field of `key` (its value type follows the key, then the value)."""
  k = key.encode()
  i = data.index(struct.pack("<Q", len(k)) + k)
  return i


def value_at(data: bytes, key: str) -> int:
  return key_at(data, key) + 8 + len(key.encode()) + 4


def tensor_at(data: bytes, name: str) -> int:
  """Offset of a tensor description's name length (n_dims, dims, type and offset follow the name)."""
  return key_at(data, name)


def patch(data: bytes, at: int, fmt: str, value) -> bytes:
  raw = struct.pack("<" + fmt, value)
  return data[:at] + raw + data[at + len(raw):]


def refused(tmp_path: pathlib.Path, data: bytes, match: str | None = None) -> errors.ModelLoadFailed:
  p = tmp_path / "corrupt.gguf"
  p.write_bytes(data)
  with pytest.raises(errors.ModelLoadFailed, match=match) as e: read_header(p)
  return e.value


def test_good_file_reads_as_written(tmp_path, good):
  p = tmp_path / "g.gguf"; p.write_bytes(good)
  h = read_header(p)
  assert h.arch == "llama" and h.get("context_length") == 64 and h.kv["general.name"] == "Tiny Test Model"
  assert h.kv["tokenizer.ggml.tokens"] == ["a", "b", "<s>"] and h.kv["tokenizer.ggml.token_type"] == [1, 1, 3]
  assert h.kv["tokenizer.ggml.add_bos_token"] is True and h.kv["llama.rope.freq_base"] == 10000.0
  norm, w = h.tensors["norm.weight"], h.tensors["blk.0.w"]
  assert norm.shape == (8,) and norm.nbytes == 32 and w.shape == (2, 32) and w.nbytes == 2 * 34
  assert np.array_equal(np.frombuffer(good[norm.offset:norm.offset + 32], np.float32), np.arange(8, dtype=np.float32))


def test_real_tiny_models_still_read(tmp_path):
  h = read_header(write_tiny_gguf(tmp_path / "t.gguf"))
  assert h.arch == "llama" and len(h.kv["tokenizer.ggml.tokens"]) == 300 and "blk.3.ffn_down.weight" in h.tensors


def test_ggml_type_table_matches_tinygrad():
  """gguf.py's own table of GGML block sizes (so a header reads without tinygrad) is tinygrad's, which dequantises."""
  from tinygrad.llm.gguf import _GGML_NATIVE, _GGML_QUANT

  from pyruntime.modelfile.gguf import GGML_TYPES
  assert GGML_TYPES == {**{t: (1, dt.itemsize) for t, dt in _GGML_NATIVE.items()}, **_GGML_QUANT}


def test_every_truncation_is_refused(tmp_path, good):
  end_of_data = max(t.offset + t.nbytes for t in read_header(_write(tmp_path, good)).tensors.values())
  for n in range(len(good)):
    p = tmp_path / "cut.gguf"
    p.write_bytes(good[:n])
    if n >= end_of_data:   # only the padding after the last tensor is gone: every byte the header names is there
      assert isinstance(read_header(p), GGUFHeader)
      continue
    with pytest.raises(errors.ModelLoadFailed): read_header(p)


def _write(tmp_path: pathlib.Path, data: bytes) -> pathlib.Path:
  p = tmp_path / "x.gguf"; p.write_bytes(data)
  return p


def test_empty_file_and_not_gguf(tmp_path, good):
  refused(tmp_path, b"", "empty")
  refused(tmp_path, b"GGML" + good[4:], "GGUF")
  refused(tmp_path, patch(good, 4, "I", 1), "version 1")
  refused(tmp_path, patch(good, 4, "I", 4), "version 4")


def test_missing_file_is_named(tmp_path):
  with pytest.raises(errors.GgufLocalPathMissing): read_header(tmp_path / "nope.gguf")


def peak_bytes(fn) -> int:
  tracemalloc.start()
  try:
    fn()
    return tracemalloc.get_traced_memory()[1]
  finally: tracemalloc.stop()


@pytest.mark.parametrize("what", ["key length", "string value length", "string array count", "int array count",
                                  "array string length", "kv count", "tensor count", "tensor name length"])
def test_huge_lengths_and_counts_are_refused_without_allocating(tmp_path, good, what):
  at = {"key length": lambda: key_at(good, "general.name"),
        "string value length": lambda: value_at(good, "general.name"),
        "string array count": lambda: value_at(good, "tokenizer.ggml.tokens") + 4,
        "int array count": lambda: value_at(good, "tokenizer.ggml.token_type") + 4,
        "array string length": lambda: value_at(good, "tokenizer.ggml.tokens") + 12,
        "kv count": lambda: 16, "tensor count": lambda: 8,
        "tensor name length": lambda: tensor_at(good, "norm.weight")}[what]()
  for huge in (2**63 - 1, 2**64 - 1, 2**40, len(good)):
    p = _write(tmp_path, patch(good, at, "Q", huge))
    def read(p: pathlib.Path = p) -> None:
      with pytest.raises(errors.ModelLoadFailed): read_header(p)
    assert peak_bytes(read) < 1 << 20, f"{what}={huge} allocated more than 1 MiB for a {len(good)}-byte file"


def test_unknown_value_types_are_refused(tmp_path, good):
  for typ in (13, 255, 2**31, 2**32 - 1):
    refused(tmp_path, patch(good, value_at(good, "general.name") - 4, "I", typ), "unknown value type")
    refused(tmp_path, patch(good, value_at(good, "tokenizer.ggml.token_type"), "I", typ), "unknown element type")
  refused(tmp_path, patch(good, value_at(good, "tokenizer.ggml.token_type"), "I", ARRAY), "nested")


@pytest.mark.parametrize("alignment", [0, 3, 24, 2**32 - 1])
def test_bad_alignment_is_refused(tmp_path, good, alignment):
  refused(tmp_path, patch(good, value_at(good, "general.alignment"), "I", alignment), "alignment")


def test_alignment_of_the_wrong_type_is_refused(tmp_path, good):
  at = value_at(good, "general.alignment")
  refused(tmp_path, patch(good, at - 4, "I", 6), "alignment")   # float32 bits: 4.5e-44, not an integer


def test_duplicate_key_and_missing_architecture(tmp_path, good):
  n = struct.pack("<Q", 20)
  refused(tmp_path, good.replace(n + b"llama.rope.freq_base", n + b"llama.context_length", 1), "twice")
  refused(tmp_path, good.replace(b"general.architecture", b"general.architectura", 1), "architecture")


def test_bad_utf8_key_is_refused(tmp_path, good):
  at = key_at(good, "general.name") + 8
  refused(tmp_path, good[:at] + b"\xff" + good[at + 1:], "UTF-8")


def test_bad_tensor_descriptions_are_refused(tmp_path, good):
  at = tensor_at(good, "norm.weight") + 8 + len("norm.weight")
  refused(tmp_path, patch(good, at, "I", 5), "dimensions")                 # n_dims > GGML_MAX_DIMS
  refused(tmp_path, patch(good, at + 4, "Q", 2**62), "past the end")       # more elements than the file holds
  refused(tmp_path, patch(good, at + 4 + 8, "I", 99), "GGML type")        # unknown tensor type
  refused(tmp_path, patch(good, at + 4 + 8 + 4, "Q", 4), "alignment")     # data offset not aligned
  refused(tmp_path, patch(good, at + 4 + 8 + 4, "Q", 2**40), "past the end")
  w = tensor_at(good, "blk.0.w") + 8 + len("blk.0.w")
  refused(tmp_path, patch(good, w + 4, "Q", 33), "block size")            # a Q8_0 row of 33 elements
  refused(tmp_path, patch(good, w + 4 + 16, "I", 0), "past the end")     # F32 instead of Q8_0: 4x the bytes


def test_duplicate_tensor_is_refused(tmp_path):
  w = gguf.GGUFWriter(str(tmp_path / "d.gguf"), "llama")
  w.add_tensor("a.weight", np.zeros(8, np.float32)); w.add_tensor("b.weight", np.zeros(8, np.float32))
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
  data = (tmp_path / "d.gguf").read_bytes()
  assert isinstance(read_header(tmp_path / "d.gguf"), GGUFHeader)
  refused(tmp_path, data.replace(b"b.weight", b"a.weight", 1), "twice")


INTERESTING = [b"\xff", b"\x00", b"\xff" * 8, b"\x00" * 4, b"\x09\x00\x00\x00", b"\x08\x00\x00\x00", struct.pack("<Q", 2**63), b"\x80"]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_mutations_never_escape_as_another_error(tmp_path, good, data):
  """Overwrite a few bytes anywhere: the result is a header or ModelLoadFailed, nothing else."""
  buf = bytearray(good)
  for _ in range(data.draw(st.integers(1, 3))):
    at = data.draw(st.integers(0, len(buf) - 1))
    raw = data.draw(st.one_of(st.sampled_from(INTERESTING), st.binary(min_size=1, max_size=8)))
    buf[at:at + len(raw)] = raw
  buf = bytes(buf[:len(good)])
  p = _write(tmp_path, buf)
  try: h = read_header(p)
  except errors.ModelLoadFailed: return
  assert isinstance(h, GGUFHeader)


def test_tokenizer_from_a_corrupt_file_is_model_load_failed(tmp_path):
  good = write_tiny_gguf(tmp_path / "t.gguf").read_bytes()
  p = _write(tmp_path, patch(good, value_at(good, "tokenizer.ggml.tokens") + 4, "Q", 2**62))
  with pytest.raises(errors.ModelLoadFailed): Tokenizer.from_gguf(p)
