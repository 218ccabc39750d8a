"""OpenMP's wait policy: chosen for torch before it loads, and what it was once it has.

torch's threads and the native kernels' share one libgomp, which reads OMP_WAIT_POLICY and GOMP_SPINCOUNT
once, when torch loads it. `import shardstream` sets OMP_WAIT_POLICY=PASSIVE (threads sleep at a barrier
instead of spinning for it) unless the user set it: spinning wins only on cores nothing else wants; beside
other work (another rank or agent on the machine, a server's threads, any other process) a spinning thread
burns the time slice its peer needs (docs/TROUBLESHOOTING.md). The native kernels then split a decode step's
short products over threads of their own that stay awake between them (stream/work_pool.h), unless `SPINS`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping


def spins(environ: Mapping[str, str], torch_loaded: bool) -> bool:
    """Whether libgomp's threads spin at a barrier: a spin count given (GOMP_SPINCOUNT, which libgomp obeys
    whatever the policy), the ACTIVE policy, or no policy where torch loaded libgomp before shardstream could
    set one (libgomp's default spins a while)."""
    count = environ.get("GOMP_SPINCOUNT", "").strip()
    if count and count != "0":
        return True
    policy = environ.get("OMP_WAIT_POLICY", "").strip().upper()
    return policy == "ACTIVE" or (not policy and torch_loaded)


SPINS = False   # whether libgomp's threads spin: set by `choose`


def choose() -> None:
    """At `import shardstream`: note whether libgomp's threads spin, then ask for PASSIVE unless the user chose."""
    global SPINS
    SPINS = spins(os.environ, "torch" in sys.modules)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
