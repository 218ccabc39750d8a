"""The TCP listening socket that `serve` and a pipeline agent hand to uvicorn (`sockets=`), bound
before the slow start so that a port in use is said at once."""

from __future__ import annotations

import socket


def tcp_listener(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port); OSError when it cannot be (the caller words it).

    Created with IPPROTO_TCP, not the default 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only
    on connections whose socket says TCP, and with 0 a reply on a kept-alive connection could wait for
    the client's delayed ACK, which a pipeline's planner would take for a hop's latency (its peers time
    an agent's /v1/health as their round trip; docs/BENCHMARKS.md, section "Pipeline").
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError:
        listener.close()
        raise
    return listener
