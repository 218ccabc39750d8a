"""Small C++ parts of the runtime, compiled with the system's compiler on first use.

torch's allocator interface and hand-written SIMD kernels are C++, and building them at first use
instead of at install time keeps shardstream installable and runnable on a machine without a
compiler: each part then says in the INFO log what runs in its place. A library is built once per
source, flags and torch version into `$XDG_CACHE_HOME/shardstream` (default `~/.cache/shardstream`),
atomically, since a process beside us may be building it too.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from . import openmp
from .switches import WORK_POOL, Switch

# Compiler flags per torch CPU capability: a vector kernel is built for the widest vectors the CPU has.
ISA_FLAGS = {"AVX512": ["-mavx512f", "-mfma"], "AVX2": ["-mavx2", "-mfma", "-mf16c"]}


def build(source: Path, flags: list[str], libraries: list[str], log: logging.Logger, what: str,
          without: str) -> ctypes.CDLL | None:
    """`source` compiled against torch's headers and `libraries` (e.g. "c10"), and loaded; None where it
    cannot be, after an INFO line "`what`: off (why)[: `without`]" says what runs instead."""
    torch_dir = Path(torch.__file__).parent
    headers = b"".join(header.read_bytes() for header in sorted(source.parent.glob("*.h")))   # those it may include
    key = hashlib.sha256(source.read_bytes() + headers + " ".join(flags).encode()
                         + torch.__version__.encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if not target.exists():
        compiler = find_compiler()
        if compiler is None:
            log.info("%s: off (no C++ compiler found; set CXX): %s", what, without)
            return None
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            handle, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{source.stem}-", suffix=".so")
        except OSError as error:
            log.info("%s: off (cannot write to %s: %s; set XDG_CACHE_HOME): %s", what, target.parent, error.strerror, without)
            return None
        os.close(handle)
        command = [compiler, "-O2", "-shared", "-fPIC", "-std=c++17", *flags,
                   f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                   f"-I{torch_dir / 'include'}", f"-I{source.parent}", str(source), f"-L{torch_dir / 'lib'}",
                   *(f"-l{name}" for name in libraries), f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", partial]
        try:
            subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as error:
            detail = getattr(error, "stderr", None) or str(error)
            log.info("%s: off (building %s failed: %s): %s", what, source.name,
                     (detail.strip().splitlines() or [""])[-1], without)
            Path(partial).unlink(missing_ok=True)
            return None
        os.replace(partial, target)
    try:
        library = ctypes.CDLL(str(target))
    except OSError as error:
        log.info("%s: off (cannot load %s: %s): %s", what, target, error, without)
        return None
    if hasattr(library, "work_pool_use"):   # it includes stream/work_pool.h
        library.work_pool_use(int(use_work_pool()))
    return library


def build_vector_kernel(source: Path, switch: Switch, log: logging.Logger, what: str, without: str,
                        flags: tuple[str, ...] = (), libraries: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """`source` built (`build`) for the widest vectors torch's CPU capability reports (ISA_FLAGS), with `flags`,
    and loaded; None where `switch` is "0" in the environment, the CPU has neither AVX-512 nor AVX2, or it
    cannot be built, after an INFO line "`what`: off (why): `without`"."""
    if switch.off():
        log.info("%s: off (%s=0): %s", what, switch.name, without)
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ISA_FLAGS:
        log.info("%s: off (this CPU has neither AVX-512 nor AVX2: torch reports %s): %s", what, capability, without)
        return None
    return build(source, ["-O3", *ISA_FLAGS[capability], *flags], list(libraries), log, what, without)


def use_work_pool() -> bool:
    """Whether the kernels split a decode step's products over threads of their own (stream/work_pool.h):
    where OpenMP's threads sleep (openmp.py), unless $SHARDSTREAM_WORK_POOL=0."""
    return not openmp.SPINS and not WORK_POOL.off()


def row_addresses(x: torch.Tensor, count: int) -> ctypes.Array:
    """The addresses of the rows of the 2-D, row-contiguous `x`, one for each of `count` products: its one row for
    all, or a row each (a kernel that takes one input row a product); ValueError for any other number of rows,
    whose reads would miss rows or run past `x`."""
    if len(x) not in (1, count):
        raise ValueError(f"rows takes one row of x, or one for each of the {count} weights, not {len(x)}")
    step = x.stride(0) * x.element_size() if len(x) > 1 else 0
    return (ctypes.c_void_p * count)(*(x.data_ptr() + i * step for i in range(count)))


def find_compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shardstream"
