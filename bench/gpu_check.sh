#!/usr/bin/env bash
# The CUDA path on a lent GPU machine: one H200, 16 cores, Python 3.12, no network, at most 64 MiB carried per call,
# 15 minutes of device time in all. Two halves:
#
#   bash bench/gpu_check.sh prepare          HERE (with a network): wheels for CPython 3.12 that the machine lacks, and a
#                                            <= 50 MB cut of SmolLM2, into gpu_carry/ (git-ignored; carry it)
#   bash bench/gpu_check.sh run [DEVICE]     THERE: installs from gpu_carry/ only, builds the C extension, then the
#                                            steps below on DEVICE (default CUDA), each under its own time bound,
#                                            everything under ${OUT:-./gpu_check_out}
#   bash bench/gpu_check.sh run CL           the same steps here, as a dry run (OpenCL through PoCL); `run NULL` compiles
#                                            for sm_90 without running (tokens meaningless there, completion checked)
#
# Steps: 1 the stage model's GPU tests (the lanes file with DEVICE as its device: splits, cache, speculation, families,
# copies, 32 threads per projection output; and the rows path's contract tests, bit for bit, under the GPU rule and in
# the tensor-core mode, on the device's tensor cores), 2 a 2-stage generation on DEVICE:0,DEVICE:0 (two stage processes
# on one GPU) and 1 stage, token ids against tinygrad's single-process model on the same device, 3 the launch report
# (bench/kernels.py --report), 4 logits against float64, float32 path and tensor-core mode (bench/exactness.py),
# 5 the pipeline benchmark.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-run}; dev=${2:-CUDA}
CARRY=gpu_carry
if [ "$mode" = prepare ]; then
  mkdir -p "$CARRY/wheels"
  # the versions installed here (what the tests ran with), not the newest a platform tag allows: an older llguidance
  # (manylinux_2_28) once came along where the newest is manylinux_2_31, and it lacked a call the code makes
  pins=$(python3 - <<'PY'
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in "tinygrad cffi pycparser posix_ipc starlette uvicorn h11 click llguidance gguf jsonschema jsonschema-specifications referencing rpds-py".split()))
PY
) || exit 1
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 \
    --abi none $(for n in 2014 _2_17 _2_28 _2_31 _2_34; do echo --platform manylinux${n}_x86_64; done) --platform any \
    -d "$CARRY/wheels" $pins || exit 1
  python3 bench/draft_model.py "$CARRY/smollm2-cut.gguf" --blocks 8 >/dev/null || exit 1
  du -sh "$CARRY"; exit 0
fi
OUT=${OUT:-./gpu_check_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log() { echo "== $*" | tee -a "$OUT/steps.txt"; }
step() { local name=$1 limit=$2; shift 2; log "$name (at most ${limit}s)"; timeout -k 10 "$limit" "$@" > "$OUT/$name.txt" 2>&1; local rc=$?
         echo "   rc=$rc" | tee -a "$OUT/steps.txt"; tail -3 "$OUT/$name.txt"; }
if [ -d "$CARRY/wheels" ] && ! python3 -c "import tinygrad" 2>/dev/null; then
  step install 240 python3 -m pip install -q --no-index --find-links "$CARRY/wheels" --no-deps "$CARRY"/wheels/*.whl
fi
step build 240 python3 -m pip install -q --no-build-isolation --no-deps -e .
(nvidia-smi -L 2>/dev/null || echo "no nvidia-smi") > "$OUT/gpus.txt"
model=$CARRY/smollm2-cut.gguf; [ -f "$model" ] || model=$(python3 -c "from pyruntime.modelfile.source import default_model_path as p; print(p())")
case $dev in NULL) export NULL_ALLOW_COPYOUT=1; d0="NULL:0:CUDA:sm_90"; d1="NULL:1:CUDA:sm_90" ;; *) d0="$dev"; d1="$dev" ;; esac
if [ "$dev" = NULL ]; then step lanes 300 python3 -m pytest -q -x -n 2 -p no:cacheprovider tests/integration/test_device_lanes.py -k sm90
else step lanes 360 env PYRUNTIME_LANE_DEVICE="$dev" python3 -m pytest -q -x -n 4 -p no:cacheprovider tests/integration/test_device_lanes.py \
  tests/integration/test_rows.py -k "(cl_ and not smollm2) or warp or ${dev}] or ${dev}-"; fi
step generate 240 python3 - "$model" "$d0,$d1" "$dev" <<'PY'
import itertools, json, sys
from tinygrad.helpers import Context
from pyruntime.launcher import Launcher, Done
from pyruntime.modelfile.plan import num_blocks
from pyruntime.modelfile.gguf import read_header
path, devs, dev = sys.argv[1:]
n, out = num_blocks(read_header(path)), {}
for name, split, d in (("2 stages", [(0, n // 2), (n // 2, n)], devs), ("1 stage", [(0, n)], devs.split(",")[0])):
  with Launcher(path, split=split, devices=d, max_context=512) as lm:
    done = next(ev for ev in lm.generate("What is the capital of France?", max_tokens=32) if isinstance(ev, Done))
  out[name] = {"devices": d, "token_ids": done.token_ids, "ttft_s": done.timings.ttft_s, "decode_tokens_per_s": done.timings.decode_tokens_per_s}
if dev == "NULL": print(json.dumps(out)); sys.exit(0)  # compiled, never run: tokens are meaningless there
from tinygrad.llm.model import Transformer
from pyruntime.stage.compute import cuda_graph
cuda_graph.install()  # tinygrad 0.13's own CUDA graphs fail on their first variable-sized kernel (see that module)
try:  # tinygrad's own model can fail where the stages run (on PoCL its SmolLM2 kernels fail tinygrad's UOp verification)
  with Context(DEV=devs.split(",")[0].replace(":0:", ":")):
    model, _ = Transformer.from_gguf(path, max_context=512)
    ref = list(itertools.islice(model.generate(list(done.prompt_token_ids)), len(done.token_ids)))
  out["equal_to_single_process"] = {k: v["token_ids"] == ref for k, v in list(out.items())}
except Exception as e:
  out["single_process_failed"] = f"{type(e).__name__}: {str(e)[:300]}"
print(json.dumps(out))
sys.exit(0 if out.get("equal_to_single_process") and all(out["equal_to_single_process"].values()) else 1)
PY
step kernels 180 python3 bench/kernels.py --report --device "$d0" --model "$model"
# the tensor-core mode's logits and the float32 path's against float64, on the device (compiled only under NULL)
[ "$dev" != NULL ] && step exactness 240 python3 bench/exactness.py --devices "$d0" --no-llama --model "$model"
# the pipeline benchmark compares with tinygrad's single-process model, which does not run SmolLM2 on PoCL: CUDA only
[ "${dev%%:*}" = CUDA ] && step pipeline 240 env PYRUNTIME_DEVICE="$dev" python3 bench/pipeline.py --json --model "$model"
log "done: results in $OUT"
