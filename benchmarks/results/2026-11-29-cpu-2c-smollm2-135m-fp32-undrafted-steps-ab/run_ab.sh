#!/bin/bash
# A/B: 71898ed (base) vs 5fecab4 (undrafted steps), HumanEval offline 64, none + lookahead, alternating.
# Checkouts: git worktree add /work/ab/base-dz 71898ed; /work/main at 5fecab4
for round in 1 2; do
  for tag in base new; do
    if [ $tag = base ]; then P=/work/ab/base-dz; else P=/work/main; fi
    cd $P || exit 1
    pkill -9 -f "VLLM::" ; pkill -f vllm.entrypoints; sleep 2
    echo "== $(date +%T) round $round $tag $(git rev-parse --short HEAD)"
    PYTHONPATH=$P /work/main/.venv/bin/python -m benchmarks.run --methods none,lookahead --model smollm2-135m \
      --datasets humaneval --num-prompts 64 --max-tokens 64 --mode throughput \
      --dtype float32 --seeds $((40 + round)) --output-dir /work/ab/dzab/results \
      --name ab-he-offline-64-$tag-r$round > /work/ab/dzab/$tag-r$round.log 2>&1
    echo "rc=$? $(date +%T)"
  done
done
