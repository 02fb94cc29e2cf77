"""Keep the Mooncake engine's listeners on its host: a preloaded ``bind()`` and a check of this process' sockets.

The Transfer Engine binds its handshake socket to 0.0.0.0 and its TCP transport to ``::`` whatever host it is
given, and it authenticates no peer. It has no setting that changes this (``MC_TCP_BIND_ADDRESS`` only names the
address it advertises), so k3serve confines it from outside:

```
 bind_to_host.c     bind(): a wildcard bind becomes the host in k3serve_bind_host (:: -> ::ffff:host) while set
 build_shim()       cc -> <venv>/lib/k3serve/bind_to_host-<source digest>.so, once per source (atomic)
 process_env(path)  LD_PRELOAD for a rank actor's runtime_env: the library must be in the process from its start
 confined(host)     k3serve_bind_host = host around the engine's initialize; every listener it adds is checked
```
A rank process without the library, or an engine that still opened a wildcard listener, is refused
(``DataPlaneError``) unless the operator opted in to ``listen_any``. Each node needs the library at the same
path: the cluster builds it on its own node; ``python -m k3serve.transfer.mooncake.listeners`` (scripts/setup.sh
with K3SERVE_MOONCAKE) builds it on any other.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import ipaddress
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

SOURCE = Path(__file__).with_name("bind_to_host.c")
HOST_SYMBOL = "k3serve_bind_host"  # the library's char[16]: "" or the IPv4 address wildcard binds go to


class ListenerError(RuntimeError):
    """The engine's listeners cannot be kept on its host here (the text says why and what to do)."""


def shim_path() -> Path:
    """Where this installation keeps the library: the same path on every node of one environment."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    return Path(os.environ.get("K3SERVE_SHIM_DIR") or Path(sys.prefix) / "lib" / "k3serve") / \
        f"bind_to_host-{digest}.so"


def build_shim() -> Path:
    """The library's path, compiled first when this source has not been (needs a C compiler: ``$CC`` or cc)."""
    out = shim_path()
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [os.environ.get("CC", "cc"), "-shared", "-fPIC", "-O2", "-o", tmp, str(SOURCE), "-ldl"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        os.replace(tmp, out)  # concurrent builders each write their own file; the last rename wins, identical
    except FileNotFoundError:
        raise ListenerError(f"no C compiler ({cmd[0]}) to build {out.name}, which keeps the Mooncake engine on its "
                            "host: apt-get install gcc, or set clusters.mooncake.listen_any: true") from None
    except subprocess.CalledProcessError as e:
        raise ListenerError(f"building {out.name} failed: {e.stderr.strip()}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return out


def process_env(path: Path) -> dict[str, str]:
    """Environment for a process that will run an engine confined to its host (set before it starts)."""
    return {"LD_PRELOAD": str(path)}


def shim_loaded() -> bool:
    return hasattr(ctypes.CDLL(None), HOST_SYMBOL)


def ipv4_of(host: str) -> str:
    """The IPv4 address the engine's listeners are kept on (a name resolves; IPv6 is not supported)."""
    try:
        if ipaddress.ip_address(host.strip("[]")).version == 4:
            return host
        raise ListenerError(f"mooncake host {host!r} is IPv6; the engine's listeners can only be kept on an "
                            "IPv4 address (or set clusters.mooncake.listen_any: true)")
    except ValueError:
        return socket.gethostbyname(host)


@contextlib.contextmanager
def confined(host: str) -> Iterator[None]:
    """Wildcard binds made by this process in the block go to ``host``; ListenerError when the library is not
    loaded, or when the block still opened a listener on a wildcard address (the engine changed how it binds)."""
    if not shim_loaded():
        raise ListenerError(
            f"this process was started without {shim_path().name} (LD_PRELOAD), so the Mooncake engine would listen "
            "on every interface: deploy through k3serve (its rank actors preload it; on another node build it with "
            "`python -m k3serve.transfer.mooncake.listeners`), or set clusters.mooncake.listen_any: true")
    before = wide_listeners()
    target = (ctypes.c_char * 16).in_dll(ctypes.CDLL(None), HOST_SYMBOL)
    target.value = ipv4_of(host).encode()
    try:
        yield
    finally:
        target.value = b""
    added = wide_listeners() - before
    if added:
        raise ListenerError(f"the Mooncake engine still listens on {sorted(added)} (not {host})")


def listening() -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket of this process, from /proc (v4-mapped as ::ffff:a.b.c.d)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/self/net/{table}") as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                addr, port = cols[1].split(":")
                raw = b"".join(bytes.fromhex(addr[i:i + 8])[::-1] for i in range(0, len(addr), 8))  # host order
                out.add((socket.inet_ntop(family, raw), int(port, 16)))
    return out


def wide_listeners() -> set[tuple[str, int]]:
    """This process' listeners on a wildcard address (0.0.0.0, ::)."""
    return {(a, p) for a, p in listening() if ipaddress.ip_address(a).is_unspecified}


if __name__ == "__main__":
    print(build_shim())
