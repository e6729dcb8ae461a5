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


PORT_RANGE_ENV = "RRFP_PORT_RANGE"
"""The ports a rank's ZeroMQ socket may bind, ``LO-HI`` (``rrfp train --port-range`` sets it
in its ranks' environment); unset: a port the OS picks."""


def parse_port_range(spec: str, what: str = "--port-range") -> tuple[int, int]:
    """``"29500-29599"`` -> ``(29500, 29599)``, both ends included.

    Raises:
        ValueError: one line naming ``what`` and the value, and what was expected.
    """
    lo, sep, hi = spec.strip().partition("-")
    if sep and lo.strip().isdigit() and hi.strip().isdigit():
        first, last = int(lo), int(hi)
        if 1 <= first <= last <= 65535:
            return first, last
    raise ValueError(f"{what}={spec!r}: expected LO-HI, two ports 1..65535 with LO <= HI (e.g. 29500-29599)")


def port_range_problem(spec: str | None, ranks: int, what: str = "--port-range") -> str | None:
    """Why ``spec`` cannot serve ``ranks`` ranks on one host (each binds one port of it), or
    None (also for no range)."""
    if not spec:
        return None
    try:
        first, last = parse_port_range(spec, what)
    except ValueError as e:
        return str(e)
    if last - first + 1 < ranks:
        return (f"{what}={spec}: {last - first + 1} port(s) for the {ranks} ranks on this host: each rank binds one "
                "of them, so widen the range")
    return None
