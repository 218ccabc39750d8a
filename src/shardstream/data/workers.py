"""How training workers start: forked from a server process that has imported the training code once.

`spawn` made every worker import torch and transformers again, after the parent had. The fork server
imports them once; started by `start_fork_server` before the parent's own imports, it imports beside
the parent, and each worker is a fork of it with nothing left to import. The server never runs a
product or holds a thread, so forking it is safe."""

from __future__ import annotations

import multiprocessing as mp
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import forkserver

CONTEXT = mp.get_context("forkserver")
CONTEXT.set_forkserver_preload(["shardstream.data.launch"])


@contextmanager
def sigint_ignored() -> Iterator[None]:
    """SIGINT ignored meanwhile, and in the processes started meanwhile (which keep it ignored): a terminal's
    Ctrl-C reaches the whole process group, and only the parent should act on it (by stopping the workers)."""
    main = threading.current_thread() is threading.main_thread()   # signal handlers are the main thread's alone
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)


def start_fork_server() -> None:
    """Start the server now (it would start with the first worker): its imports then run beside the caller's."""
    with sigint_ignored():
        forkserver.ensure_running()
