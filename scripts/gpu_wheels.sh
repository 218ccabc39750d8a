#!/usr/bin/env bash
# Fetches the wheels that scripts/gpu_check.sh installs on a GPU machine without network into .whl/ (or
# the folder given): transformers and bitsandbytes at requirements.lock's pins and the peer airllm==4.0.0,
# built for the GPU machine's CPython 3.12 on x86-64 Linux. Run it where there is network, before the GPU run.
# bitsandbytes ships a library for every CUDA version (about 130 MB unpacked); CUDA=130 (the GPU machine's
# torch.version.cuda without the dot; the default) keeps only that one and the CPU's, so the folder stays
# small enough to copy along (CUDA=all keeps them all).
#   bash scripts/gpu_wheels.sh [FOLDER]        (PYTHON: an interpreter with pip; default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
python=${PYTHON:-python3}
pins=$(grep -E '^(transformers|bitsandbytes)==' requirements.lock)
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_24_x86_64 -d "$dest" $pins airllm==4.0.0
if [ "${CUDA:-130}" != all ]; then
  "$python" - "$dest" "${CUDA:-130}" <<'PY'
import re, sys, zipfile
from pathlib import Path
folder, keep = Path(sys.argv[1]), sys.argv[2]
other = re.compile(rf"libbitsandbytes_cuda(?!{keep}\.)\d+\.so")
for wheel in folder.glob("bitsandbytes-*.whl"):
    slim = wheel.with_suffix(".partial")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            if other.search(info.filename):
                continue
            data = source.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"\n".join(line for line in data.split(b"\n") if not other.search(line.decode()))
            target.writestr(info, data)
    slim.replace(wheel)
PY
fi
ls -l "$dest"
