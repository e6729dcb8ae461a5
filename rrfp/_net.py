"""This host's address in a job (standard library only).

One rule for the daemon and its ranks: a node's address is ``--node-addr`` when given, else
the local address of the interface that routes to the master (node 0); on one machine
(a loopback master) it is ``127.0.0.1``. The daemon hands it to its ranks in
:data:`NODE_ADDR_ENV`, so torch's agent advertises it, the ranks bind it, and gloo and NCCL
use its interface (:func:`interface_of`).
"""

from __future__ import annotations

import ipaddress
import os
import socket

NODE_ADDR_ENV = "RRFP_NODE_ADDR"
"""Set by ``rrfp node`` in its ranks' environment: the address this node's ranks bind."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, or ``localhost``) is a loopback address."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def route_to(host: str, port: int) -> str:
    """The local address of the interface that routes to ``host``; ``127.0.0.1`` for an
    empty or loopback ``host``. The route is found by connecting a UDP socket, which sends
    nothing.

    Raises:
        OSError: ``host`` does not resolve, or no route leads to it.
    """
    if not host or is_loopback(host):
        return "127.0.0.1"
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return str(s.getsockname()[0])


def interface_of(addr: str) -> str | None:
    """The name of the local network interface holding ``addr`` (``lo`` for 127.0.0.1),
    or None when no interface holds it (or it is not an address). Linux: IPv4 through
    ``SIOCGIFADDR``, IPv6 through ``/proc/net/if_inet6``."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return None
    if ip.version == 6:
        try:
            with open("/proc/net/if_inet6") as f:
                for line in f:
                    hexaddr, *_, name = line.split()
                    if ipaddress.ip_address(bytes.fromhex(hexaddr)) == ip:
                        return name
        except OSError:
            pass
        return None
    import fcntl
    import struct

    SIOCGIFADDR = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(raw[20:24]) == addr:
                return name
    if ip.is_loopback:
        return next((name for _, name in socket.if_nameindex() if name == "lo"), None)
    return None


def socket_ifname_env(addr: str, environ: dict | None = None) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` naming ``addr``'s interface, each
    only where ``environ`` (default ``os.environ``) does not set it already: gloo binds the
    interface its host name resolves to otherwise, loopback in many containers and network
    namespaces. Empty when no interface holds ``addr``."""
    environ = os.environ if environ is None else environ
    name = interface_of(addr)
    if name is None:
        return {}
    return {var: name for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if not environ.get(var)}
