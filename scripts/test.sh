#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite against real services: redis-server, Ray, vLLM on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test

# A private redis-server on a free 127.0.0.1 port, no persistence, stopped on exit.
port=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --daemonize no >/dev/null &
redis_pid=$!
trap 'kill $redis_pid 2>/dev/null || true' EXIT
for _ in $(seq 100); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done

.venv/bin/ruff check .
# the layer contracts in pyproject.toml: imports flow one way
.venv/bin/lint-imports --no-logo
# One pytest process per group: in-process vLLM engines and Ray clients of one group cannot leak into
# the next. The groups run in three lanes at once: a lane waits on services and subprocesses most of the
# time (the rl_service group keeps about half a core busy), so three lanes fill the two cores where two left
# them part idle; each lane has its own Redis database (tests empty theirs) and starts its own local Ray.
# Lanes are balanced by the groups' measured times (longest first); lane 1's output streams, the others'
# are printed when they end. Every group runs; the script fails if any group failed.
# One OpenMP thread per process: the lanes already fill the two cores, and torch's OpenMP threads
# spin-wait when they outnumber the cores (measured: a tiny-model SFT step 20 s instead of 0.4 s).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
logs=$(mktemp -d)
trap 'kill $redis_pid 2>/dev/null || true; rm -rf "$logs"' EXIT
# One vLLM cache for every group of this run (tests/conftest.py keeps it): vLLM inspects a model class in a
# fresh interpreter (~13 s of CPU) the first time an engine starts with an empty cache; shared, that happens
# once per model class and run instead of once per group.
export VLLM_CACHE_ROOT="$logs/vllm-cache"
run_lane() {
  local db=$1; shift
  for group in "$@"; do
    echo "==> pytest $group"
    # shellcheck disable=SC2086
    TAPER_TEST_REDIS_URL="redis://127.0.0.1:$port/$db" .venv/bin/python -m pytest $group --durations=8 \
      "${pytest_args[@]}" || echo "$group" >>"$logs/failed"
  done
}
pytest_args=("$@")
run_lane 2 "tests/api" "tests/model tests/gpu" "tests/ui tests/test_demo.py" >"$logs/lane2.log" 2>&1 &
lane2=$!
run_lane 3 "tests/kernels tests/reward_models tests/deploy" \
  "tests/test_foundation.py tests/test_docs.py tests/test_curriculum_protocol.py tests/rollout_workers" \
  >"$logs/lane3.log" 2>&1 &
lane3=$!
run_lane 1 "tests/rl_service" "tests/test_guide.py"
wait $lane2 || true
echo "==> lane 2"
cat "$logs/lane2.log"
wait $lane3 || true
echo "==> lane 3"
cat "$logs/lane3.log"
if [ -s "$logs/failed" ]; then
  echo "FAILED groups:"
  cat "$logs/failed"
  exit 1
fi
