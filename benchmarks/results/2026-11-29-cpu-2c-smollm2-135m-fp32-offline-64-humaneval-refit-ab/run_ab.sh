#!/bin/bash
# A/B: main vs try/refit-new-range, HumanEval offline 64, none + lookahead, alternating.
cd /work/main || exit 1
for round in 1 2; do
  for ref in main try/refit-new-range; do
    git checkout -q "$ref" || exit 1
    tag=$( [ "$ref" = main ] && echo main || echo refit )
    pkill -9 -f "VLLM::" ; pkill -f vllm.entrypoints; sleep 2
    echo "== $(date +%T) round $round $ref $(git rev-parse --short HEAD)"
    .venv/bin/python -m benchmarks.run --methods none,lookahead --model smollm2-135m \
      --datasets humaneval --num-prompts 64 --max-tokens 64 --mode throughput \
      --dtype float32 --seeds $((20 + round)) --output-dir /work/ab/results \
      --name ab-he-offline-64-$tag-r$round > /work/ab/$tag-r$round.log 2>&1
    echo "rc=$? $(date +%T)"
  done
done
git checkout -q try/refit-new-range
