#!/usr/bin/env bash
# Fetches the wheels that scripts/gpu_check.sh installs on a GPU machine without network into .whl/ (or
# the folder given): transformers and bitsandbytes at requirements.lock's pins and the peer airllm==4.0.0,
# built for the GPU machine's CPython 3.12 on x86-64 Linux. Run it where there is network, before the GPU run.
#   bash scripts/gpu_wheels.sh [FOLDER]        (PYTHON: an interpreter with pip; default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
pins=$(grep -E '^(transformers|bitsandbytes)==' requirements.lock)
"${PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_24_x86_64 -d "$dest" $pins airllm==4.0.0
ls "$dest"
