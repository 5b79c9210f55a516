R=benchmarks/results/h200-validate-2026-11-28
mkdir -p $R
bash .gpu/part-03/install.sh --no-smoke > $R/kit-install.log 2>&1; tail -2 $R/kit-install.log
source /tmp/gpu-stage/env.sh; export PYTHONUNBUFFERED=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1 VLLM_LOGGING_LEVEL=WARNING LOOKAHEAD_COMMIT=468b82b
ARCTIC_SDIST=.gpu-extra/arctic_inference-0.1.1.tar.gz timeout 70 bash scripts/gpu_validate.sh --results $R env
timeout ${EXACT_TIMEOUT:-450} bash scripts/gpu_validate.sh --results $R exactness; echo exactness rc=$?
cat $R/exactness/exactness.md | head -40
tar czf $OUT/validate.tgz $R
