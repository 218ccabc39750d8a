"""The TCP listening socket that `serve` and a pipeline agent hand to uvicorn (`sockets=`), bound
before the slow start so that a port in use is said at once, and the uvicorn settings every server of
shardstream shares."""

from __future__ import annotations

import errno
import socket

from .errors import InvalidOption

# How long an idle kept-alive connection stays open: longer than the clients and proxies that pool
# connections keep one (httpx and Node 5 s, aiohttp 15 s, load balancers 60 s), so that the client
# always drops it first. With uvicorn's 5 s, a request sent on a pooled connection just as the server
# closed it failed with "Server disconnected without sending a response" (POSTs are not retried).
KEEP_ALIVE_S = 75


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


def listening(host: str, port: int, who: str, port_option: str) -> socket.socket:
    """`tcp_listener`, its failure one sentence saying what `who` ("the agent") could not do and which option
    to change: --host for an address this machine does not have, `port_option` for a port in use."""
    try:
        return tcp_listener(host, port)
    except OSError as error:
        if isinstance(error, socket.gaierror) or error.errno == errno.EADDRNOTAVAIL:
            advice = "give --host an address of this machine (127.0.0.1, 0.0.0.0 for every interface, or one of its own)"
        else:
            advice = f"stop what uses that port or pick another {port_option}"
        raise InvalidOption(f"{who} cannot listen on {host}:{port} ({error.strerror}); {advice}.") from None


def server_config(app, **options):
    """The uvicorn.Config of a shardstream server: warnings only in its log, idle connections kept
    `KEEP_ALIVE_S`; `options` add to these."""
    import uvicorn

    return uvicorn.Config(app, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S, **options)
