#!/usr/bin/env bash
# The GPU checks in one run, for a machine with a CUDA GPU and no network (see CONTRIBUTING, "GPU checks"):
# tests/test_stream_cuda.py, then benchmarks/stream_gpu.py on the reference model, on the Llama-3.2-1B
# shape (4-bit settings with the Triton kernel and with SHARDSTREAM_TRITON=0, bitsandbytes NF4 whole on
# the GPU), and on that shape against AirLLM, plain and 4-bit. The wheels in .whl/ (the pinned
# transformers and bitsandbytes, airllm==4.0.0: scripts/gpu_wheels.sh fetches them) are installed first
# into a folder of their own. Every log and table goes to $OUT (default artifacts/gpu-check).
#   bash scripts/gpu_check.sh [tests] [reference] [llama-3.2-1b] [peers] [profile]     (default: all five)
# Time plan, 9.5 minutes in all (seconds; the times of builds and settings are estimates from the earlier GPU
# runs; a step's settings run in the order below, and those that would start after its budget say "not run"
# in a table printed all the same; `timeout` stops a step that hangs):
#   wheels, machine info  ~15
#   tests          100  TESTS_TIMEOUT     the CUDA tests
#   reference       80  REFERENCE_BUDGET  build ~20, then ~12 a setting: host tier, 4-bit with the kernel,
#                                         gpu, batch-1, batch-32, 4-bit from disk, 4-bit dequantized
#   llama-3.2-1b   170  SHAPE_BUDGET      build ~40, then ~15 a setting, 16 tokens: host tier, whole on the GPU
#                                         without cuDNN attention and with it, 4-bit and bnb-nf4 (the 4-bit
#                                         compute floor), accelerate, 4-bit without the kernel
#   peers          140  PEERS_BUDGET      each AirLLM setting opened once untimed (its split: ~15 each), then
#                                         airllm-4bit beside stream-4bit-direct and airllm beside stream-direct;
#                                         8 tokens, 4 for AirLLM (~2 s a pass, every layer read again)
#   profile         50  PROFILE_BUDGET    the shape's host tier and whole-on-GPU decode under torch.profiler
#                                         (PROFILE_MODES): profile-<setting>.txt, GPU and host time by operator
#   in all        ~555
# `peers` alone builds the shape first: give it PEERS_BUDGET=180.
# Narrower: TESTS_SELECT (pytest -k), REFERENCE_MODES, SHAPE_MODES and PEERS_MODES (benchmarks/stream_gpu.py
# --modes), CHILD_TIMEOUT (seconds one setting may take), BENCH_TIMEOUT (every benchmark step's budget).
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
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
steps=${*:-tests reference llama-3.2-1b peers profile}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; free -g | head -2
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python3 -c "import triton; print('triton', triton.__version__)" 2>/dev/null || echo "triton not installed: no 4-bit kernel"
  python3 -c "import bitsandbytes; print('bitsandbytes', bitsandbytes.__version__)" 2>/dev/null \
    || echo "bitsandbytes not installed: no bnb-nf4 or airllm-4bit"; } \
  2>&1 | tee "$OUT/machine.txt"
bench() {  # budget, log name, stream_gpu.py arguments
  local budget=${BENCH_TIMEOUT:-$1} log=$2; shift 2
  timeout $((budget + 30)) python3 benchmarks/stream_gpu.py --workdir "$WORK/bench" --timeout "${CHILD_TIMEOUT:-90}" \
    --budget "$budget" "$@" 2>&1 | tee "$OUT/$log.md"
}
for step in $steps; do
  case $step in
    tests) timeout "${TESTS_TIMEOUT:-100}" python3 -m pytest tests/test_stream_cuda.py -q -x -p no:cacheprovider \
             ${TESTS_SELECT:+-k "$TESTS_SELECT"} 2>&1 \
             | tail -40 | tee "$OUT/tests.txt" ;;
    reference) bench "${REFERENCE_BUDGET:-80}" reference \
                 --modes "${REFERENCE_MODES:-stream,stream-4bit,gpu,batch-1,batch-32,stream-4bit-direct,stream-4bit-dequant}" ;;
    profile) bench "${PROFILE_BUDGET:-50}" profile --shape llama-3.2-1b --new-tokens 8 --profile "$OUT" \
               --modes "${PROFILE_MODES:-stream,gpu}" ;;
    peers) bench "${PEERS_BUDGET:-140}" peers --shape llama-3.2-1b --new-tokens 8 --airllm-tokens 4 \
             --modes "${PEERS_MODES:-airllm-4bit,stream-4bit-direct,airllm,stream-direct}" ;;
    *) bench "${SHAPE_BUDGET:-170}" "$step" --shape "$step" --new-tokens 16 \
         --modes "${SHAPE_MODES:-stream,gpu-nocudnn,gpu,stream-4bit,bnb-nf4,accelerate,stream-4bit-dequant}" ;;
  esac
done
