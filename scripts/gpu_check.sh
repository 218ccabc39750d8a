#!/usr/bin/env bash
# The GPU checks in one run, for a machine with a CUDA GPU and no network (see CONTRIBUTING, "GPU checks"):
# tests/test_stream_cuda.py, then benchmarks/stream_gpu.py on the reference model and on the
# Llama-3.2-1B shape (4-bit settings with the Triton kernel and with SHARDSTREAM_TRITON=0). Wheels in .whl/ (the pinned transformers, airllm==4.0.0) are installed first into
# a folder of their own. Every log and table goes to $OUT (default artifacts/gpu-check).
#   bash scripts/gpu_check.sh [tests] [reference] [llama-3.2-1b]     (default: all three)
# Narrower: TESTS_SELECT (pytest -k), REFERENCE_MODES and SHAPE_MODES (benchmarks/stream_gpu.py --modes),
# TESTS_TIMEOUT, BENCH_TIMEOUT and CHILD_TIMEOUT (seconds a step, and one setting, may take).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-artifacts/gpu-check}
WORK=${GPU_CHECK_WORKDIR:-/tmp/shardstream-gpu-check}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl \
    || { echo "could not install the wheels in .whl/" >&2; exit 1; }
  export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src:$PWD/tests:$PYTHONPATH"
steps=${*:-tests reference llama-3.2-1b}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; free -g | head -2
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python3 -c "import triton; print('triton', triton.__version__)" 2>/dev/null || echo "triton not installed: no 4-bit kernel"; } \
  2>&1 | tee "$OUT/machine.txt"
for step in $steps; do
  case $step in
    tests) timeout "${TESTS_TIMEOUT:-200}" python3 -m pytest tests/test_stream_cuda.py -q -x -p no:cacheprovider \
             ${TESTS_SELECT:+-k "$TESTS_SELECT"} 2>&1 \
             | tail -40 | tee "$OUT/tests.txt" ;;
    reference) timeout "${BENCH_TIMEOUT:-320}" python3 benchmarks/stream_gpu.py --workdir "$WORK/bench" --timeout "${CHILD_TIMEOUT:-90}" \
                 ${REFERENCE_MODES:+--modes "$REFERENCE_MODES"} \
                 2>&1 | tee "$OUT/reference.md" ;;
    *) timeout "${BENCH_TIMEOUT:-320}" python3 benchmarks/stream_gpu.py --shape "$step" --workdir "$WORK/bench" \
         --new-tokens 16 --timeout "${CHILD_TIMEOUT:-90}" --modes "${SHAPE_MODES:-stream,stream-direct,stream-4bit,stream-4bit-dequant,stream-4bit-direct,stream-4bit-direct-dequant,accelerate,airllm,gpu}" \
         2>&1 | tee "$OUT/$step.md" ;;
  esac
done
