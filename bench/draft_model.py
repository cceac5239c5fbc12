"""A draft model cut from the target itself: its first K blocks, the output norm and head (a layer-skipping
"self-speculative" drafter, as LayerSkip and draft&verify do). Its vocabulary is the target's by construction, so it
passes the identity gate; it is the one draft model at hand on a machine with one model and no downloads.

    python bench/draft_model.py OUT.gguf [--model PATH] [--blocks K]
    python bench/speculative.py --speculative model:OUT.gguf      # then measure it on and off

Tensors are copied as they are in the file (quantized bytes unchanged), so block i of the draft is block i of the
target, and the metadata is the target's but for `{arch}.block_count`.
"""
from __future__ import annotations

import argparse
import re


def truncate(src: str, out: str, blocks: int) -> str:
  import gguf
  reader = gguf.GGUFReader(src)
  arch = str(reader.fields["general.architecture"].contents())
  count_key = f"{arch}.block_count"
  n = int(reader.fields[count_key].contents())
  if not 1 <= blocks < n: raise SystemExit(f"--blocks must be in 1..{n - 1}: the target has {n} blocks")
  writer = gguf.GGUFWriter(out, arch, endianess=reader.endianess)
  for field in reader.fields.values():  # as gguf's own gguf_new_metadata.py copies them
    if field.name == "general.architecture" or field.name.startswith("GGUF."): continue
    vtype = field.types[0]
    sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
    value = blocks if field.name == count_key else field.contents()
    writer.add_key_value(field.name, value, vtype, sub_type=sub)
  kept = [t for t in reader.tensors if not (m := re.match(r"blk\.(\d+)\.", t.name)) or int(m.group(1)) < blocks]
  for t in kept: writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_ti_data_to_file()
  for t in kept: writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
  writer.close()
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("out")
  ap.add_argument("--model", default=None, help="the target GGUF (default: the bundled SmolLM2-135M)")
  ap.add_argument("--blocks", type=int, default=8)
  a = ap.parse_args()
  from pyruntime.modelfile.source import resolve_model
  print(truncate(str(resolve_model(a.model)), a.out, a.blocks))


if __name__ == "__main__":
  main()
