#!/bin/bash
# A/B: main (f38fbc5) vs perf/compiled-learning, HumanEval offline 64, none + lookahead, alternating.
# Checkouts: git worktree add /work/ab/base f38fbc5; git worktree add /work/ab/new ae62f88
for round in 1 2 3 4; do  # run as rounds 1-2, then 3-4
  for tag in base new; do
    cd /work/ab/$tag || exit 1
    pkill -9 -f "VLLM::" ; pkill -f vllm.entrypoints; sleep 2
    echo "== $(date +%T) round $round $tag $(git rev-parse --short HEAD)"
    PYTHONPATH=/work/ab/$tag /work/main/.venv/bin/python -m benchmarks.run --methods none,lookahead --model smollm2-135m \
      --datasets humaneval --num-prompts 64 --max-tokens 64 --mode throughput \
      --dtype float32 --seeds $((30 + round)) --output-dir /work/ab/results \
      --name ab-he-offline-64-$tag-r$round > /work/ab/$tag-r$round.log 2>&1
    echo "rc=$? $(date +%T)"
  done
done
