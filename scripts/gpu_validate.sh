#!/usr/bin/env bash
# GPU validation in one command. On the GPU host, after shared/gpu's kit installed vLLM
# (stage it with the test and Ray extras: bash shared/gpu/stage.sh --add pytest --add scipy
# --add matplotlib --add ray), from the repository root:
#
#     bash scripts/gpu_validate.sh [--results DIR] [--model PATH] [STEP ...]
#     bash scripts/gpu_validate.sh --dry-run [STEP ...]    # CPU: same steps, small sizes, .venv
#     PYTHON=.venv-vllm-0.26.0/bin/python bash scripts/gpu_validate.sh --dry-run   # the GPU host's vLLM
#
# Steps (default: all, in this order; each one fits a 10-minute device command):
#   env      install this package next to the kit's vLLM; record GPU, versions, commit
#   v2       vLLM 0.34 (Model Runner V2, async scheduling on by default) on CUDA, first: its
#            registry must hold lookahead (else the import error is the result); then greedy
#            exactness of lookahead against no speculation in float32 with IEEE dot products
#            (asserted), and tokens/s of none / ngram / suffix / lookahead at batch 1
#            (latency) and 16 (throughput), bf16 with vLLM's default CUDA graphs. Run it
#            with the host's vLLM 0.34 (PYTHON=...; stage it as shared/gpu's README says
#            for another vLLM version)
#   exactness  greedy exactness of lookahead's defaults against no speculation as users
#            serve it (CUDA graphs, drafts filled to K, trees, chunked prefill and
#            preemption; batch 8 and 1): float32 with IEEE dot products (identical
#            outputs asserted); bf16, bf16 under VLLM_BATCH_INVARIANT=1 and float32 with
#            Triton's TF32 default (every divergence asserted to be rounding: a flip at
#            a near-tie or within plain decoding's own noise between batch 1 and 8);
#            four configurations at once (benchmarks.exactness: exactness.json, .md)
#   decomposition  latency, bf16 with CUDA graphs, HumanEval: none / ngram / suffix /
#            lookahead / lookahead-unfilled, and ngram and suffix with
#            `cudagraph_mode: FULL` (their best graph mode: FlashAttention 3 replays full
#            graphs of mixed batches); steps by graph mode and ms per step beside S
#   dummy-8b  a Llama-3.1-8B-shaped model with random weights (vLLM load_format dummy,
#            benchmarks.dummy_model: the config and the staged model's tokenizer): step
#            time by tokens per request (1-64) and batch (1-64), FULL vs PIECEWISE
#            (benchmarks.step_cost)
#   dummy-8b-worst  the same model, drafts never accepted: none vs lookahead's defaults
#            at batch 1 (latency) and 64 (throughput), sampled at T 1 (random weights
#            give nearly uniform logits, so sampled tokens are random; greedy output
#            of random weights loops and drafts are all accepted); the start-up table
#            gives the measured free tokens and the trees `auto` decision
#   ray      tests/test_ray.py: the plugin under Ray's executor, offline and served, on
#            the host's GPUs (tensor parallel 2 only where it has two; stage Ray:
#            bash shared/gpu/stage.sh --add ray)
#   mtad     MTAD on CUDA, SmolLM2 as target and auxiliary model, CUDA graphs, greedy
#            and T 1: drafts accepted, the joint rule's acceptance (benchmarks.mtad)
#   requests tests/test_request_matrix.py on CUDA: every request feature with lookahead's
#            defaults against no speculation, float32 with IEEE dot products (asserted) and
#            bf16 (informational: greedy may flip at near-ties)
#   next N   the first N of the open GPU steps (v2 exactness decomposition dummy-8b
#            dummy-8b-worst mtad ray requests) that scripts/gpu_steps_done.txt does not list
#   tree-check  the tree step's start-up self-check on the real model, with CUDA graphs
#            (as users run vLLM), in bf16 and fp16 (the device's own attention backend;
#            the tiny-model tests run float32, which FlashAttention does not take): its
#            verdict and which comparison differed, one engine start each
#   greedy   pytest on the tiny models: greedy exactness in float32 (asserted), sampling
#            distribution
#   greedy-bf16  the greedy tests again in bfloat16 (informational: a k-token verification
#            pass and k one-token passes need not round alike)
#   trees    pytest: the tree step's start-up self-check on the device's attention backend
#            (passes, and fails each deliberately broken piece), tree drafts bit-exact in
#            float32 under chunked prefill and preemption, and the tree sampling test
#   server   pytest: the OpenAI-server tests and the plugin under Ray
#   latency  harness, real model in bf16 with CUDA graphs (as users run it): none / ngram /
#            suffix / lookahead / lookahead-unfilled (`uniform_drafts` off: drafts not filled
#            to K for the full decode graph) (METHODS overrides; suffix is recorded as
#            unavailable without arctic-inference), HumanEval and MT-Bench subsets, batch 1
#   load     the same through the OpenAI server at concurrency 16
#   batch64  offline, 64 HumanEval prompts at once: throughput and the proposer's share of
#            the step at batch 64 (batch 1's share is in the latency table)
# PROMPTS and TOKENS (GPU: 10 and 256) size the harness steps' prompt sets and outputs;
# TREE_DTYPES (GPU: "bfloat16 float16") the tree-check's dtypes.
# PYTEST_WORKERS=N runs the pytest steps' files in N processes at once (pytest-xdist, one
# file per process, each engine taking LOOKAHEAD_TEST_GPU_MEMORY_UTILIZATION of the GPU,
# default 0.08). ARCTIC_SDIST=PATH (arctic-inference 0.1.1's sdist, which has no cp312
# wheel) makes the env step build its suffix tree module for vLLM's `suffix` method.
# Every step appends its command, exit status and time to DIR/summary.md; pytest logs go
# into DIR, and each harness step makes its run folder there (DIR/DATE-MACHINE-MODEL-MODE/:
# results.json, results.md, PNG plots, command.txt). Steps may run in separate calls
# (a device command is limited to 10 minutes): DIR accumulates. Exit status: 1 if any
# asserted step failed.
set -uo pipefail
cd "$(dirname "$0")/.."

dry_run=0 results="" model="" steps=() next_count=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --results) results=$2; shift ;;
    --model) model=$2; shift ;;
    -h|--help) awk 'NR>1 && /^#/ {sub(/^# ?/, ""); print; next} NR>1 {exit}' "$0"; exit 0 ;;
    env|v2|exactness|decomposition|dummy-8b|dummy-8b-worst|ray|mtad|requests|tree-check|greedy|greedy-bf16|trees|server|latency|load|batch64) steps+=("$1") ;;
    next) next_count=${2:-1}; shift ;;
    *) echo "gpu_validate.sh: unknown argument '$1' (steps: env v2 exactness decomposition dummy-8b dummy-8b-worst ray mtad requests tree-check greedy greedy-bf16 trees server latency load batch64, next N; --dry-run, --results DIR, --model PATH)" >&2; exit 2 ;;
  esac
  shift
done
for step in v2 exactness decomposition dummy-8b dummy-8b-worst mtad ray requests; do  # issues 90, 72
  [ "$next_count" -gt 0 ] || break
  grep -q "^$step " scripts/gpu_steps_done.txt && continue
  steps+=("$step"); next_count=$((next_count - 1))
done
[ ${#steps[@]} -gt 0 ] || steps=(env exactness decomposition tree-check greedy greedy-bf16 trees server latency load batch64)

if [ $dry_run = 1 ]; then
  [ -n "${PYTHON:-}" ] || bash scripts/setup.sh >/dev/null
  python=${PYTHON:-.venv/bin/python}
  model=${model:-smollm2-135m}  # fetched by benchmarks.models (pinned, sha256-checked)
  prompts=2 tokens=32 concurrency=4 batch=8 kv_bytes=$((1 << 30)) tree_dtypes=bfloat16
  engine_args='{"enforce_eager": true}'
  exact_configurations=cpu-fp32 exact_prompts=1 graph_dtype=float32
  dummy_shape="" dummy_cost=(--ks 3 --tokens 1,4 --batches 1,2 --steps 4 --enforce-eager
                             --dtype float32) worst_batch=4
  results=${results:-/tmp/gpu-validate-dry-run}
else
  [ -f /tmp/gpu-stage/env.sh ] && source /tmp/gpu-stage/env.sh
  python=${PYTHON:-python3}
  model=${model:-/tmp/models/SmolLM2-135M-Instruct}
  prompts=${PROMPTS:-10} tokens=${TOKENS:-256} concurrency=16 batch=64 kv_bytes=$((8 << 30))
  tree_dtypes=${TREE_DTYPES:-bfloat16 float16}
  engine_args='{"enforce_eager": false}'
  exact_configurations=${EXACT_CONFIGURATIONS:-fp32-ieee,bf16,bf16-batch-invariant,fp32}
  exact_prompts=4
  graph_dtype=bfloat16
  dummy_shape=llama-3.1-8b dummy_cost=() worst_batch=64
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | awk 'NR==1 {print tolower($2)}')
  results=${results:-benchmarks/results/${gpu:-gpu}-validate-$(date +%F)}
fi
mkdir -p "$results"
summary=$results/summary.md
[ -f "$summary" ] || printf '# GPU validation\n\n| step | command | exit | seconds |\n|---|---|---|---|\n' >"$summary"
export VLLM_ALLOW_INSECURE_SERIALIZATION=1 VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
methods=${METHODS:-none,ngram,suffix,lookahead}
latency_methods=${METHODS:-$methods,lookahead-unfilled}
failed=0
parallel=()
if [ "${PYTEST_WORKERS:-1}" -gt 1 ]; then
  parallel=(-n "$PYTEST_WORKERS" --dist loadfile)
  export LOOKAHEAD_TEST_GPU_MEMORY_UTILIZATION=${LOOKAHEAD_TEST_GPU_MEMORY_UTILIZATION:-0.08}
fi

# run STEP ASSERTED COMMAND...: runs it, logs to DIR/STEP.log, records the outcome.
run() {
  local step=$1 asserted=$2; shift 2
  local start=$SECONDS status shown="$*"
  shown=${shown//|/\\|}
  echo "== $step: $*" >&2
  "$@" >"$results/$step.log" 2>&1
  status=$?
  tail -n 3 "$results/$step.log" >&2
  printf '| %s | `%s` | %s%s | %s |\n' "$step" "$shown" "$status" \
    "$([ "$asserted" = yes ] || echo ' (informational)')" $((SECONDS - start)) >>"$summary"
  if [ $status != 0 ] && [ "$asserted" = yes ]; then failed=1; fi
  return $status
}

missing_modules() {
  "$python" - "$@" <<'EOF'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
EOF
}

harness() {  # harness STEP MODE ENGINE_ARGS_JSON [extra run.py arguments]
  local step=$1 mode=$2 step_engine_args=$3; shift 3
  run "$step" yes "$python" -m benchmarks.run --model "$model" --methods "$methods" \
    --dtype bfloat16 --max-tokens "$tokens" --kv-cache-memory-bytes "$kv_bytes" \
    --engine-args "$step_engine_args" --mode "$mode" --output-dir "$results" \
    --method-config 'lookahead-unfilled={"method": "lookahead", "uniform_drafts": "off"}' "$@"
}

for step in "${steps[@]}"; do
  case $step in
    env)
      if [ $dry_run = 0 ]; then  # next to the kit's vLLM (PYTHONPATH), entry point included
        site=${SITE_DIR:-/tmp/site}
        run install yes "$python" -m pip install --no-deps --no-index --no-build-isolation \
          --upgrade --target "$site" .
        [ -z "${ARCTIC_SDIST:-}" ] || run suffix-build no bash -c '
          set -e; src=$(mktemp -d); tar xzf "$1" -C "$src" --strip-components=1
          cmake -S "$src/csrc/suffix_decoding" -B "$src/build" -DPython_EXECUTABLE="$2"
          cmake --build "$src/build" -j 16
          rm -rf "$3/arctic_inference"; cp -r "$src/arctic_inference" "$3/"
          cp "$src"/build/_C*.so "$3/arctic_inference/suffix_decoding/"
          "$2" -c "from arctic_inference.suffix_decoding import SuffixDecodingCache"' \
          _ "$ARCTIC_SDIST" "$(command -v "$python")" "$site"
      fi
      run env yes "$python" -m benchmarks.machine
      missing=$(missing_modules pytest scipy matplotlib ray openai requests)
      [ -z "$missing" ] || echo "missing modules: $missing (stage them: bash shared/gpu/stage.sh --add NAME)" \
        | tee -a "$results/env.log" >&2
      ;;
    v2)
      run v2-registry yes "$python" -c 'import vllm
from vllm_lookahead import plugin
plugin.register()
from vllm.v1.worker.gpu.spec_decode.speculator_config import registered_speculative_methods
assert "lookahead" in registered_speculative_methods(), registered_speculative_methods()
print("vLLM", vllm.__version__, "registered:", registered_speculative_methods())' || continue
      LOOKAHEAD_TEST_GPU_MEMORY_UTILIZATION=${LOOKAHEAD_TEST_GPU_MEMORY_UTILIZATION:-0.2} \
        run v2-exactness yes "$python" -m benchmarks.exactness --model "$model" \
        --output-dir "$results/v2-exactness" --configurations fp32-ieee --jobs 1 \
        --datasets humaneval,mt_bench --num-prompts "$exact_prompts" --max-tokens "$tokens"
      for mode in latency throughput; do
        count=$([ $mode = latency ] && echo "$prompts" || echo 16)
        run "v2-$mode" yes "$python" -m benchmarks.run --model "$model" \
          --methods none,ngram,suffix,lookahead --dtype "$graph_dtype" --max-tokens "$tokens" \
          --kv-cache-memory-bytes "$kv_bytes" --engine-args "$engine_args" --mode "$mode" \
          --datasets humaneval --num-prompts "$count" --output-dir "$results/v2-$mode"
      done
      ;;
    exactness)
      LOOKAHEAD_TEST_GPU_MEMORY_UTILIZATION=${LOOKAHEAD_TEST_GPU_MEMORY_UTILIZATION:-0.2} \
        run exactness yes "$python" -m benchmarks.exactness --model "$model" \
        --output-dir "$results/exactness" --configurations "$exact_configurations" --jobs 4 \
        --datasets humaneval,mt_bench --num-prompts "$exact_prompts" --max-tokens "$tokens"
      ;;
    decomposition)
      full='{"compilation_config": {"cudagraph_mode": "FULL"}}'
      run decomposition yes "$python" -m benchmarks.run --model "$model" \
        --methods none,ngram,suffix,lookahead --dtype "$graph_dtype" --max-tokens "$tokens" \
        --kv-cache-memory-bytes "$kv_bytes" --engine-args "$engine_args" --mode latency \
        --output-dir "$results/decomposition" --datasets humaneval --num-prompts "$prompts" \
        --method-config 'lookahead-unfilled={"method": "lookahead", "uniform_drafts": "off"}' \
        --method-config 'ngram-full={"method": "ngram"}' \
        --method-config 'suffix-full={"method": "suffix"}' \
        --method-engine-args "ngram-full=$full" --method-engine-args "suffix-full=$full"
      ;;
    dummy-8b|dummy-8b-worst)
      dummy=$model  # dry run: the small model's own config, random weights
      [ -d "$dummy" ] || dummy=$("$python" -c 'import sys; from benchmarks.models import fetch; print(fetch(sys.argv[1]))' "$model")
      if [ -n "$dummy_shape" ]; then
        dummy=/tmp/models/$dummy_shape-shape
        run dummy-model yes "$python" -m benchmarks.dummy_model --shape "$dummy_shape" \
          --tokenizer "$model" --output "$dummy"
      fi
      if [ "$step" = dummy-8b ]; then
        run dummy-8b yes "$python" -m benchmarks.step_cost --model "$dummy" --load-format dummy \
          --output-dir "$results" --name "$(basename "$dummy")-step-cost" "${dummy_cost[@]}"
      else
        for mode in latency throughput; do
          count=$([ $mode = latency ] && echo 2 || echo "$worst_batch")
          run "dummy-8b-worst-$mode" yes "$python" -m benchmarks.run --model "$dummy" \
            --methods none,lookahead --dtype "$graph_dtype" --max-tokens 128 --temperature 1 \
            --kv-cache-memory-bytes "$kv_bytes" --mode "$mode" --datasets humaneval \
            --num-prompts "$count" --output-dir "$results" \
            --engine-args "${engine_args%\}}, \"load_format\": \"dummy\", \"max_num_seqs\": $worst_batch}"
        done
      fi
      ;;
    ray)
      run ray yes "$python" -m pytest -q -rs --junitxml "$results/ray.xml" tests/test_ray.py
      ;;
    requests)
      TRITON_F32_DEFAULT=ieee run requests-fp32 yes "$python" -m pytest -q -rs \
        --junitxml "$results/requests-fp32.xml" \
        tests/test_request_matrix.py
      LOOKAHEAD_TEST_DTYPE=bfloat16 run requests-bf16 no "$python" -m pytest -q -rs \
        --junitxml "$results/requests-bf16.xml" tests/test_request_matrix.py
      ;;
    mtad)
      for temperature in 0 1; do
        run "mtad-t$temperature" yes "$python" -m benchmarks.mtad --target "$model" \
          --draft "$model" --methods none,mtad_joint --humaneval "$prompts" \
          --mt-bench "$prompts" --max-tokens "$tokens" --temperature "$temperature" \
          --dtype "$graph_dtype" --engine-args "$engine_args" --output-dir "$results" \
          --name "$(basename "$model")-mtad-t$temperature"
      done
      ;;
    tree-check)
      path=$model  # a folder, or a name benchmarks.models fetches (pinned, sha256-checked)
      [ -d "$path" ] || path=$("$python" -c 'import sys; from benchmarks.models import fetch; print(fetch(sys.argv[1]))' "$model")
      for dtype in $tree_dtypes; do
        VLLM_LOGGING_LEVEL=INFO run "tree-check-$dtype" yes "$python" scripts/gpu_tree_check.py "$path" "$dtype"
      done
      ;;
    greedy)
      run greedy-fp32 yes "$python" -m pytest -q "${parallel[@]}" -k "not tree" --junitxml "$results/greedy-fp32.xml" \
        tests/test_greedy_exact.py tests/test_greedy_qwen2.py tests/test_sampling.py
      ;;
    greedy-bf16)
      LOOKAHEAD_TEST_DTYPE=bfloat16 run greedy-bf16 no "$python" -m pytest -q "${parallel[@]}" -k "not tree" \
        --junitxml "$results/greedy-bf16.xml" tests/test_greedy_exact.py tests/test_greedy_qwen2.py
      ;;
    trees)
      run trees yes "$python" -m pytest -q -rs "${parallel[@]}" --junitxml "$results/trees.xml" \
        tests/test_tree_check.py tests/test_tree_graph_mode.py tests/test_tree.py
      ;;
    server)
      run server yes "$python" -m pytest -q -rs --junitxml "$results/server.xml" \
        tests/test_server.py tests/test_ray.py
      ;;
    latency)
      methods=$latency_methods harness latency latency "$engine_args" --datasets humaneval,mt_bench \
        --num-prompts "$prompts"
      ;;
    load)
      harness load server "$engine_args" --datasets humaneval --num-prompts $((2 * concurrency)) \
        --concurrency "$concurrency"
      ;;
    batch64)
      harness batch64 throughput "${engine_args%\}}, \"max_num_seqs\": $batch}" \
        --datasets humaneval --num-prompts "$batch"
      ;;
  esac
done
cat "$summary" >&2
exit $failed
