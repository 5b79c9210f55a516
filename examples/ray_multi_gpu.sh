#!/usr/bin/env bash
# Lookahead on a multi-GPU Ray cluster: tensor parallel 2 (one node) or across nodes.
#
# What is verified: tests/test_ray.py runs in CI on CPU (Ray workers on logical GPUs,
# gloo): the plugin loads in every Ray worker through the vllm.general_plugins entry
# point (nothing more than installing it on every node), tensor parallel 1 and 2,
# offline and the OpenAI server, output identical to plain decoding and every rank
# drafting alike. Not verified: GPU workers, NCCL, several nodes (these commands follow
# vLLM's own Ray instructions; scripts/gpu_validate.sh has the step for a GPU host).
#
#   bash examples/ray_multi_gpu.sh install         # on every node
#   bash examples/ray_multi_gpu.sh head            # on the head node (starts the server)
#   bash examples/ray_multi_gpu.sh worker HEAD_IP  # on every other node, before `head`
#   bash examples/ray_multi_gpu.sh query           # anywhere that reaches the head node
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen2.5-Coder-1.5B-Instruct}
TP=${TP:-2}    # GPUs per model replica; across nodes add PP=<nodes>
PP=${PP:-1}
PORT=${PORT:-8000}

case "${1:-}" in
  install)  # the same on every node, from a checkout of this repository
    pip install "vllm>=0.26,<0.33" "${REPO:-.}[ray]"
    ;;
  worker)
    ray start --address "${2:?head node address}:6379"
    ;;
  head)
    ray start --head --port 6379
    python -m vllm.entrypoints.openai.api_server --model "$MODEL" \
      --tensor-parallel-size "$TP" --pipeline-parallel-size "$PP" \
      --distributed-executor-backend ray \
      --speculative-config '{"method": "lookahead"}' \
      --host 0.0.0.0 --port "$PORT"
    ;;
  query)
    curl -s "http://${HEAD:-127.0.0.1}:$PORT/v1/completions" \
      -H 'Content-Type: application/json' \
      -d "{\"model\": \"$MODEL\", \"prompt\": \"def quicksort(xs):\", \"max_tokens\": 128, \"temperature\": 0}"
    echo
    # the proposer's own counters (pool size, drafts by source, Jacobi harvest, S); they
    # are read from the worker of rank 0, which must run on the head node (Ray's default)
    curl -s "http://${HEAD:-127.0.0.1}:$PORT/metrics" | grep -E '^vllm:(speculative|lookahead)_'
    ;;
  *)
    sed -n '2,14p' "$0"
    exit 2
    ;;
esac
