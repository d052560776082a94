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
export TAPER_TEST_REDIS_URL="redis://127.0.0.1:$port/0"

.venv/bin/ruff check .
# One pytest process per group: in-process vLLM engines and Ray clients of one group cannot leak into
# the next. Every group runs; the script fails if any group failed.
status=0
for group in "tests/kernels tests/reward_models tests/deploy" "tests/model" "tests/rollout_workers" \
             "tests/rl_service tests/api" "tests/ui tests/test_demo.py tests/test_foundation.py"; do
  echo "==> pytest $group"
  # shellcheck disable=SC2086
  .venv/bin/python -m pytest $group --durations=8 "$@" || status=1
done
exit $status
