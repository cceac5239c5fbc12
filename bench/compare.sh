#!/usr/bin/env bash
# The same serving scenarios and a new process's `generate` against two revisions, one after another in one run
# (these machines are noisy: compare within a run). Builds REV in a worktree (native extension in place) and runs
# the server of each side in turn with the working tree's bench/serve.py as the client.
#
#   bash bench/compare.sh [REV] [scenario ...]     # REV: default the commit before the prompt path (ae5d00a)
#   scenarios: prompt chat burst long-prompt levels generate    (default: all)
set -euo pipefail
cd "$(dirname "$0")/.."
REV=${1:-ae5d00a}; shift || true
SCEN=${*:-prompt chat burst long-prompt levels generate}
OLD=${TMPDIR:-/tmp}/pyruntime-compare-$(git rev-parse --short "$REV")
[ -d "$OLD" ] || git worktree add -f --detach "$OLD" "$REV" >/dev/null
(cd "$OLD" && python3 setup.py build_ext --inplace >/dev/null 2>&1)
PORT=${PORT:-8471}
run_side() {  # $1: name, $2: source root, $3: extra bench/serve.py flags
  local name=$1 root=$2 extra=$3
  # from its own root: `python -m` puts the working directory first on the path
  (cd "$root" && exec python3 -m pyruntime serve --port "$PORT" --max-context 4096) >/tmp/compare-$name.log 2>&1 &
  local pid=$!
  until curl -sf "http://127.0.0.1:$PORT/health" | grep -q '"ok"'; do
    kill -0 $pid 2>/dev/null || { echo "$name: server died"; tail -5 /tmp/compare-$name.log; return 1; }; sleep 1; done
  for s in $SCEN; do
    case $s in
      prompt) PYTHONPATH=$PWD python3 bench/serve.py --url "http://127.0.0.1:$PORT" --scenario prompt --json $extra ;;
      chat) PYTHONPATH=$PWD python3 bench/serve.py --url "http://127.0.0.1:$PORT" --scenario chat --conversations 1 --turns 6 \
              --user-tokens 150,150 --json $extra ;;
      burst) PYTHONPATH=$PWD python3 bench/serve.py --url "http://127.0.0.1:$PORT" --scenario burst --json $extra ;;
      long-prompt) PYTHONPATH=$PWD python3 bench/serve.py --url "http://127.0.0.1:$PORT" --scenario long-prompt --json $extra ;;
      levels) PYTHONPATH=$PWD python3 bench/serve.py --url "http://127.0.0.1:$PORT" --concurrency 1,8 --tokens 32 \
                --requests-per-client 2 --json $extra ;;
      generate) ;;
    esac | sed "s/^/$name $s: /"
  done
  kill -TERM $pid; wait $pid || true
  if [[ " $SCEN " == *" generate "* ]]; then
    for i in 1 2; do
      local t0=$EPOCHREALTIME
      (cd "$root" && python3 -m pyruntime generate "What is the capital of France?" --max-tokens 24 >/dev/null 2>&1)
      echo "$name generate: run $i, a new process, $(awk "BEGIN{printf \"%.1f\", $EPOCHREALTIME - $t0}") s"
    done
  fi
}
# a revision from before the prefix cache refuses the request field that turns it off; a later one must get it, or its
# side would answer the burst's repeated prompts from the cache and the other side not
BEFORE_FLAGS=$(git cat-file -e "$REV:pyruntime/engine/prefix_cache.py" 2>/dev/null && echo "" || echo --no-cache-field)
run_side before "$OLD" "$BEFORE_FLAGS"
run_side after "$PWD" ""
