"""Finding agents on the local network by mDNS (zeroconf), an optional dependency, and the address
by which this machine is reached from a peer."""

from __future__ import annotations

import socket
import time

from ..errors import InvalidOption

SERVICE = "_shardstream._tcp.local."


def _zeroconf():
    try:
        import zeroconf
    except ImportError:
        raise InvalidOption("mDNS needs the zeroconf package: pip install 'shardstream[mdns]', or give --urls.") from None
    return zeroconf


def advertise(name: str, port: int, host: str = "0.0.0.0"):
    """Register this agent at the address it listens on (this machine's, when it listens on all);
    returns the Zeroconf instance to close on exit."""
    zeroconf = _zeroconf()
    address = socket.gethostbyname(socket.gethostname()) if host in ("0.0.0.0", "") else host
    info = zeroconf.ServiceInfo(SERVICE, f"{name}.{SERVICE}", port=port, addresses=[socket.inet_aton(address)],
                                properties={"name": name})
    instance = zeroconf.Zeroconf()
    instance.register_service(info)
    return instance


# How long an agent that answered the browse has to give its address and port: mDNS multicasts a record at
# most once a second, and a loaded machine answers later still.
RESOLVE_MS = 3000


def discover(seconds: float) -> list[str]:
    """Agent base URLs advertised within `seconds`."""
    zeroconf = _zeroconf()
    instance = zeroconf.Zeroconf()
    names: list[str] = []
    browser = zeroconf.ServiceBrowser(instance, SERVICE, handlers=[lambda service_type, name, state_change, **_: names.append(name)])
    time.sleep(seconds)
    urls = []
    for name in dict.fromkeys(names):   # answered at once from the browse's records; asked again where not
        info = instance.get_service_info(SERVICE, name, timeout=RESOLVE_MS)
        if info and info.parsed_addresses():
            urls.append(f"http://{info.parsed_addresses()[0]}:{info.port}")
    browser.cancel()
    instance.close()
    return urls


def advertise_host(peer_host: str) -> str:
    """This machine's address as the machine at `peer_host` would reach it (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((peer_host, 9))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"
