#!/usr/bin/env bash
# Command 1 of the README: set up (if needed), fetch SmolLM2-135M-Instruct and compare
# greedy generation with and without lookahead.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m examples.demo "$@"
