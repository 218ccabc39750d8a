"""The C++ kernels' AVX2 build checked on an AVX-512 machine, in a process where torch reports AVX2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardstream.native import find_compiler

needs_avx2 = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512") or find_compiler() is None,
                                reason="no AVX2 here, or no compiler")


def run_as_avx2(code: str, cache: Path) -> str:
    """The stdout of `code` run with ATEN_CPU_CAPABILITY=avx2 and the native parts built afresh into `cache`."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "XDG_CACHE_HOME": str(cache)}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.strip()
