"""A private two-node Ray cluster on this machine: ``ray start --head`` plus ``ray start --address`` (the way
a user joins a second machine), each node with its own custom resource, in a private temp dir and on ports
picked free, so it never meets another Ray instance of this machine.

Cleanup kills only what it started: each ``ray start`` runs in its own session (process group), and Ray's
daemons and workers stay in it; whatever still names the private temp dir, on its command line or in an open
file (Ray's agents rename themselves ``ray::DashboardAgent`` and keep their logs there open), is killed too.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# Ray declares a node dead after period x threshold of failed health checks (3 s x 5 by default): shorter here
FAST_NODE_DEATH = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "1000",
                   "RAY_health_check_failure_threshold": "4", "RAY_health_check_initial_delay_ms": "1000"}


def free_ports(n: int) -> list[int]:
    """n distinct free ports: each socket stays bound until all are picked (closed one by one, the OS may hand
    out the same port twice, which `ray start` refuses)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class TwoNodeRay:
    head_resource: str = "k3_node_a"
    worker_resource: str = "k3_node_b"
    cpus: int = 4
    address: str = ""
    temp_dir: str = ""
    _groups: list[int] = field(default_factory=list)  # process group ids of our `ray start` runs
    # Ray 2.60's `ray start --head` wants token auth: a private token, passed to nodes and drivers by env
    token: str = field(default_factory=lambda: secrets.token_hex(32))

    @property
    def env(self) -> dict[str, str]:
        """What a driver (or node) of this cluster needs in its environment."""
        return {"RAY_ADDRESS": self.address, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}

    def _ray(self, *args: str, env: dict[str, str] | None = None) -> None:
        """Run `ray start ARGS` in a new session (process group), on ports picked free."""
        ray_bin = str(Path(sys.executable).with_name("ray"))
        ports = ["--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
                 "--metrics-export-port", "--node-manager-port", "--object-manager-port"]
        cmd = [ray_bin, "start", *args, "--node-ip-address=127.0.0.1", f"--num-cpus={self.cpus}",
               f"--temp-dir={self.temp_dir}", "--disable-usage-stats", "--include-log-monitor=false",
               "--object-store-memory=100000000", *[f"{p}={n}" for p, n in zip(ports, free_ports(len(ports)))]]
        proc = subprocess.Popen(cmd, env={**os.environ, **FAST_NODE_DEATH, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token,
                                     **(env or {})}, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._groups.append(proc.pid)  # the session's id: its daemons keep it after `ray start` exits
        out, _ = proc.communicate(timeout=180)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-3000:]}")

    def start(self) -> "TwoNodeRay":
        self.temp_dir = tempfile.mkdtemp(prefix="k3n-", dir="/tmp")  # short: Unix socket paths are <= 107 bytes
        port, dash, client = free_ports(3)
        try:
            self._ray("--head", f"--port={port}", "--include-dashboard=false", f"--dashboard-port={dash}",
                      f"--ray-client-server-port={client}", f'--resources={{"{self.head_resource}": 100}}')
            self.address = f"127.0.0.1:{port}"
            self.add_worker()
        except BaseException:
            self.stop()
            raise
        return self

    def add_worker(self) -> None:
        """Join (again) the worker node with its resource, as `ray start --address` on a second machine."""
        self._ray(f"--address={self.address}", f'--resources={{"{self.worker_resource}": 100}}')

    def stop(self) -> None:
        kill_ray_session(self.temp_dir, self._groups)
        self._groups.clear()


def kill_ray_session(temp_dir: str, groups: list[int]) -> list[int]:
    """SIGKILL the process groups ``groups`` (our ``ray start`` sessions) and every process that names
    ``temp_dir`` (``_pids_naming``), then remove the temp dir. Returns the pids still naming it afterwards
    (none expected: test_drain_live asserts it, so a leaked Ray daemon fails the test that leaked it instead of slowing
    every test after it)."""
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:  # that group is gone already (e.g. the killed node's)
            pass
    left: list[int] = []
    if temp_dir:
        deadline = time.monotonic() + 10
        while (left := _pids_naming(temp_dir)) and time.monotonic() < deadline:
            for pid in left:  # anything that left our groups but is ours
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        shutil.rmtree(temp_dir, ignore_errors=True)
    return left


def _pids_naming(text: str) -> list[int]:
    """Processes (not this one, not zombies) whose command line or open files name ``text``."""
    out, needle = [], text.encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[-1].split()[0] == b"Z":
                    continue  # a zombie holds nothing; its parent reaps it
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if needle in f.read():
                    out.append(int(name))
                    continue
            if any(target.startswith(text) for target in _open_files(int(name))):
                out.append(int(name))
        except OSError:  # exited since listdir
            continue
    return out


def _open_files(pid: int) -> list[str]:
    """The paths of ``pid``'s open file descriptors (those that close meanwhile left out)."""
    fds, out = f"/proc/{pid}/fd", []
    for fd in os.listdir(fds):
        try:
            out.append(os.readlink(f"{fds}/{fd}"))
        except OSError:  # closed since listdir
            continue
    return out
