"""Free TCP ports on 127.0.0.1 for the processes shardstream starts itself (agents, DDP ranks)."""

from __future__ import annotations

import socket

_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now, never the same one twice in this process (the kernel may
    offer a just-released port again, and each agent takes two before either is bound)."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
