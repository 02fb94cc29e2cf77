"""The address a server tells its peers: the host it bound, or, when it bound a wildcard (0.0.0.0, ::), this
machine's address on its outbound interface, so an endpoint handed to another node is one it can dial."""

from __future__ import annotations

import socket

WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def advertised_host(bind_host: str) -> str:
    """bind_host itself unless it is a wildcard; else the IP this machine's default route leaves from."""
    if bind_host not in WILDCARDS:
        return bind_host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # UDP connect sends nothing: it only picks the route's interface
            return s.getsockname()[0]
        except OSError:  # no route at all: the host's own name is the best left
            return socket.gethostbyname(socket.gethostname())
