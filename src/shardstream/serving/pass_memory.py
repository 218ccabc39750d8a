"""Large activations reused within a forward pass, instead of mapped anew for every operation.

The engine (the streaming model, and the batch engine over it) has glibc map every allocation of 1 MiB
or more on its own (`admission.map_large_allocations`), so that freed memory goes back to the system
and admission measures what is really left. The price is paid by every fresh activation of a prefill
pass: the kernel faults it in and zeroes it, a large share of a prefill pass. glibc's heap would reuse
the memory, but it puts each layer's activations in new places, so a pass's peak outgrows what
admission planned, and no caching allocator (jemalloc, tcmalloc, mimalloc) installs from the package
registry.

So the engine replaces torch's CPU allocator with a small one (`pass_memory.cpp`): during a pass, a
freed block of 1 MiB or more is kept for the next allocation it fits (a model's layers allocate the
same sizes one layer after another), and the kept blocks are freed when the pass ends. Outside
passes it frees at once, so other code sees glibc's behaviour. What it gains and costs:
docs/BENCHMARKS.md, section "Many tokens per weight read".

It is built with the system's C++ compiler on first use (see native.py). Without a compiler, or with
`SHARDSTREAM_PASS_MEMORY=0`, torch's own allocator stays in place; the INFO log says why.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from .. import native
from ..switches import PASS_MEMORY

log = logging.getLogger("shardstream.batching")

SOURCE = Path(__file__).with_name("pass_memory.cpp")


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
    begin()
    try:
        yield
    finally:
        end()


def begin() -> None:
    """A forward pass begins (`reusing`, for a pass whose end is seen elsewhere: a module's forward hooks)."""
    if _installed is not None:
        _installed.pass_memory_begin()


def end() -> None:
    """The pass `begin` began has ended; the last one running frees the kept blocks."""
    if _installed is not None:
        _installed.pass_memory_end()


def reused_blocks() -> int:
    """How many large allocations were served from a kept block (0 where not installed)."""
    return _installed.pass_memory_reused() if _installed is not None else 0


@functools.cache
def _library() -> ctypes.CDLL | None:
    if PASS_MEMORY.off():
        log.info("pass memory reuse: off (%s=0)", PASS_MEMORY.name)
        return None
    library = native.build(SOURCE, [], ["c10"], log, "pass memory reuse", "prefill passes take longer (docs/BENCHMARKS.md)")
    if library is not None:
        library.pass_memory_install.argtypes = [ctypes.c_int]
        library.pass_memory_reused.restype = ctypes.c_size_t
    return library


def _huge_pages() -> bool:
    """Advise huge pages where torch's own allocator would (THP_MEM_ALLOC_ENABLE, see cli.py)."""
    return os.environ.get("THP_MEM_ALLOC_ENABLE", "").lower() in ("1", "true", "yes", "on")
