"""The step-cost benchmark (``benchmarks.step_cost``) and the weightless model folders it
runs on at a real size (``benchmarks.dummy_model``), on the tiny model (CPU: eager)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import dummy_model


def test_a_dummy_model_has_the_shape_and_the_tokenizers_vocabulary(llama_path, tmp_path):
    folder = dummy_model.build("llama-3.1-8b", Path(llama_path), tmp_path / "llama-8b")
    config = json.loads((folder / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (4096, 32)
    assert config["vocab_size"] == 512  # the tiny tokenizer's
    assert (folder / "tokenizer.json").exists()


def test_every_step_computes_the_tokens_asked_and_is_counted_by_graph_mode(llama_path,
                                                                           tmp_path):
    # in a fresh interpreter: its engines run in-process, and vLLM 0.32's CPU platform
    # cannot start one in a process where numba is loaded (worker/kernel_overrides.py)
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.step_cost", "--model", llama_path, "--dtype",
         "float32", "--enforce-eager", "--ks", "3", "--tokens", "1,4", "--batches", "1,2",
         "--steps", "6", "--kv-cache-memory-bytes", str(64 << 20), "--output-dir",
         str(tmp_path), "--name", "cost"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    (folder,) = tmp_path.glob("*-cost")
    rows = json.loads((folder / "results.json").read_text())["rows"]
    assert [(r["engine_k"], r["tokens_per_request"], r["batch"]) for r in rows] == [
        (None, 1, 1), (None, 1, 2), (3, 1, 1), (3, 1, 2), (3, 4, 1), (3, 4, 2)]
    for row in rows:  # eager on CPU: every timed step counted, none in a graph
        modes = row["steps_by_graph_mode"]
        assert modes["NONE"] >= row["decode_steps"] and modes["FULL"] == modes["PIECEWISE"] == 0
        assert row["ms_per_step"] > 0
        # every verified draft had exactly T - 1 tokens: each request computed T a step
        assert row["draft_tokens_per_draft"] == row["tokens_per_request"] - 1
    assert (folder / "step-cost.png").exists() and (folder / "results.md").exists()
