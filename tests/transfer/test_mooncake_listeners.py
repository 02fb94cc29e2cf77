"""The Mooncake engine's listeners kept on its host (k3serve/transfer/mooncake/listeners.py), issue 44 item 2.

Left alone the engine binds 0.0.0.0 and :: whatever host it is given. In a process started with the bind()
library, a plane on 127.0.0.1 listens on loopback only and still moves bytes; without the library a plane is
refused unless listen_any; with listen_any the wildcard listeners are back (so the check can fail).
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from k3serve.transfer.mooncake import listeners
from k3serve.transfer.mooncake.plane import DataPlane, DataPlaneError, MooncakeConfig

pytestmark = pytest.mark.usefixtures("mooncake_plane")  # tests/conftest.py: skip, or an error

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(staging_bytes=1 << 20, send_bytes=1 << 20)

# two planes in one process: b's region receives a's bytes; prints the process' listeners and what landed
SCRIPT = """
import ctypes, json, sys
from types import SimpleNamespace
from k3serve.transfer.mooncake.listeners import listening
from k3serve.transfer.mooncake.plane import DataPlane, MooncakeConfig

cfg = MooncakeConfig(host="127.0.0.1", staging_bytes=1 << 20, send_bytes=1 << 20, listen_any=sys.argv[1] == "any")
a, b = DataPlane(cfg), DataPlane(cfg)
src, dst = ctypes.create_string_buffer(b"k3serve" * 512, 4096), ctypes.create_string_buffer(4096)
a.register(SimpleNamespace(base=ctypes.addressof(src), size=4096))
b.register(SimpleNamespace(base=ctypes.addressof(dst), size=4096))
a.write(b.segment, [(ctypes.addressof(src), ctypes.addressof(dst), 4096)])
print(json.dumps({"landed": dst.raw == src.raw, "listening": sorted(listening())}))
"""


def _run(mode: str, env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, env={**os.environ, **env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _loopback(ip: str) -> bool:
    a = ipaddress.ip_address(ip)
    return (getattr(a, "ipv4_mapped", None) or a).is_loopback


@pytest.mark.slow  # compiles the library; engines in fresh interpreters
def test_a_preloaded_plane_listens_on_its_host_only_and_moves_bytes():
    shim = listeners.build_shim()
    confined = _run("host", listeners.process_env(shim))
    assert confined["landed"]
    ports = confined["listening"]
    assert len(ports) >= 4, ports  # each engine's handshake and data sockets
    assert all(_loopback(ip) for ip, _ in ports), ports
    wide = _run("any", {})  # the engine as it is: the same check fails
    assert wide["landed"] and {"0.0.0.0", "::"} <= {ip for ip, _ in wide["listening"]}, wide


@pytest.mark.slow  # runs the C compiler
def test_the_library_builds_once_per_source_and_a_missing_compiler_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("K3SERVE_SHIM_DIR", str(tmp_path))
    first = listeners.build_shim()
    assert first.parent == tmp_path and first.stat().st_size > 0
    mtime = first.stat().st_mtime_ns
    assert listeners.build_shim() == first and first.stat().st_mtime_ns == mtime  # built once
    monkeypatch.setenv("K3SERVE_SHIM_DIR", str(tmp_path / "other"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(listeners.ListenerError, match="no C compiler .*listen_any"):
        listeners.build_shim()
    assert not any((tmp_path / "other").iterdir())  # no half-built library left


def test_without_the_library_a_plane_is_refused_unless_listen_any():
    assert not listeners.shim_loaded()  # this interpreter was not started with it
    with pytest.raises(DataPlaneError, match=r"LD_PRELOAD.*listen_any"):
        DataPlane(MooncakeConfig(**SMALL))


def test_wildcard_listeners_of_this_process_are_seen():
    with socket.socket() as any4, socket.socket(socket.AF_INET6) as any6, socket.socket() as lo:
        for s, host in ((any4, "0.0.0.0"), (any6, "::"), (lo, "127.0.0.1")):
            s.bind((host, 0))
            s.listen()
        wide = listeners.wide_listeners()
        assert ("0.0.0.0", any4.getsockname()[1]) in wide and ("::", any6.getsockname()[1]) in wide
        assert ("127.0.0.1", lo.getsockname()[1]) in listeners.listening() - wide


def test_an_ipv6_engine_host_is_refused_by_name():
    with pytest.raises(listeners.ListenerError, match="IPv6"):
        listeners.ipv4_of("::1")
    assert listeners.ipv4_of("127.0.0.1") == "127.0.0.1" and listeners.ipv4_of("localhost") == "127.0.0.1"
