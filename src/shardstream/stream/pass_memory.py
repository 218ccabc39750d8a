"""Large activations reused within a forward pass, instead of mapped anew for every operation.

The batch engine has glibc map every allocation of 1 MiB or more on its own
(`admission.map_large_allocations`), so that freed memory goes back to the system and admission
measures what is really left. The price is paid by every fresh activation of a prefill pass: the
kernel faults it in and zeroes it. A pass of 32 prompts of 32 tokens through the 4-bit reference
model spent 0.67 s of 3.5 s in elementwise operations, mostly on those faults. glibc's heap would
reuse the memory, but it puts each layer's activations in new places (the pass's peak rose by 244 MiB,
and `serve` was killed under a 600 MiB cap), and no caching allocator (jemalloc, tcmalloc, mimalloc)
installs from the package registry.

So the engine replaces torch's CPU allocator with a small one (`pass_memory.cpp`): during a pass, a
freed block of 1 MiB or more is kept for the next allocation it fits (a model's layers allocate the
same sizes one layer after another), and the kept blocks are freed when the pass ends. Outside
passes it frees at once, as before. Measured under `serve` and that cap, two alternating rounds: the
pass 3.49-3.70 -> 2.82-2.96 s, 32 requests 62.5-66.5 -> 66.8-72.8 tok/s, the same decode steps and
memcap peak; in one process the pass's peak resident memory was 13-18 MiB higher.

It is built with the system's C++ compiler on first use (about a second) into
`$XDG_CACHE_HOME/shardstream` (default `~/.cache/shardstream`). Without a compiler, or with
`SHARDSTREAM_PASS_MEMORY=0`, the engine runs as before; the INFO log says why.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger("shardstream.batching")

SOURCE = Path(__file__).with_name("pass_memory.cpp")
SWITCH = "SHARDSTREAM_PASS_MEMORY"


_installed: ctypes.CDLL | None = None


def install() -> bool:
    """Make the reusing allocator torch's CPU allocator (process-wide, once); False where it cannot be."""
    global _installed
    library = _library()
    if library is not None and _installed is None:
        library.pass_memory_install(int(_huge_pages()))
        _installed = library
    return library is not None


@contextlib.contextmanager
def reusing() -> Iterator[None]:
    """One forward pass: large blocks freed inside are reused inside, and freed when it ends (a no-op
    until `install`)."""
    library = _installed
    if library is None:
        yield
        return
    library.pass_memory_begin()
    try:
        yield
    finally:
        library.pass_memory_end()


def reused_blocks() -> int:
    """How many large allocations were served from a kept block (0 where not installed)."""
    return _installed.pass_memory_reused() if _installed is not None else 0


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get(SWITCH, "1") == "0":
        log.info("pass memory reuse: off (%s=0)", SWITCH)
        return None
    built = _built()
    if built is None:
        return None
    try:
        library = ctypes.CDLL(str(built))
    except OSError as error:
        log.info("pass memory reuse: off (cannot load %s: %s)", built, error)
        return None
    library.pass_memory_install.argtypes = [ctypes.c_int]
    library.pass_memory_reused.restype = ctypes.c_size_t
    return library


def _built() -> Path | None:
    """The compiled library for this source and this torch, built if missing (atomically: a process
    beside us may be building it too)."""
    torch_dir = Path(torch.__file__).parent
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:16]
    target = _cache_dir() / f"pass_memory-{key}.so"
    if target.exists():
        return target
    compiler = find_compiler()
    if compiler is None:
        log.info("pass memory reuse: off (no C++ compiler found; set CXX): prefill passes take about 20% longer")
        return None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(dir=target.parent, prefix=".pass_memory-", suffix=".so")
    except OSError as error:
        log.info("pass memory reuse: off (cannot write to %s: %s; set XDG_CACHE_HOME)", target.parent, error.strerror)
        return None
    os.close(handle)
    command = [compiler, "-O2", "-shared", "-fPIC", "-std=c++17",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               f"-I{torch_dir / 'include'}", str(SOURCE), f"-L{torch_dir / 'lib'}", "-lc10",
               f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", partial]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", None) or str(error)
        log.info("pass memory reuse: off (building %s failed: %s)", SOURCE.name, (detail.strip().splitlines() or [""])[-1])
        Path(partial).unlink(missing_ok=True)
        return None
    os.replace(partial, target)
    return target


def find_compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shardstream"


def _huge_pages() -> bool:
    """Advise huge pages where torch's own allocator would (THP_MEM_ALLOC_ENABLE, see cli.py)."""
    return os.environ.get("THP_MEM_ALLOC_ENABLE", "").lower() in ("1", "true", "yes", "on")
