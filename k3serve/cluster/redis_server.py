"""A private redis-server for tests and for ``k3serve serve`` when no ``REDIS_URL`` is given (docs/architecture.md §11, docs/security.md).

The server is ephemeral by construction: no RDB snapshots, no AOF, its files live in a directory we own, and it
listens on 127.0.0.1 (a port the OS picked, or ``port=``) or on a unix socket only (mode 700). It requires a
password generated at start (``requirepass``): Redis is the trust root of routing, so another local process
must not write membership or budgets. The password travels inside the URL; ``redact_url`` hides it wherever a
URL is printed, logged or written. Losing its contents is
survivable by design: heartbeats re-register clusters, reservations are leases, and sessions without a pin go
where HRW sends them (usually where they already were).

    server = RedisServer()
    url = server.start(tmpdir)        # "redis://:PASSWORD@127.0.0.1:PORT/0" or "unix://:PASSWORD@/.../redis.sock?db=0"
    client = connect(url)             # bounded timeouts and retries, see connect()
    ...
    server.pause(); server.resume()   # fault drills: kill it, later start an empty one at the same URL
    server.stop()                     # idempotent; also runs on garbage collection and interpreter exit

``RedisServer`` is also a context manager (``with RedisServer() as server: server.url``).
"""

from __future__ import annotations

import ctypes
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

__all__ = ["RedisServer", "RedisServerError", "RedisServerNotFound", "connect", "redact_url"]

_INSTALL_HINT = (
    "install it with `apt-get install -y redis-server` (the project's setup script does this), "
    "or point REDIS_URL at an existing server"
)
# sun_path is 108 bytes on Linux including the NUL; a longer path makes bind() fail with a cryptic error.
_MAX_UNIX_PATH = 100
_PR_SET_PDEATHSIG = 1


class RedisServerError(RuntimeError):
    """redis-server could not be started (the message carries the tail of its log)."""


class RedisServerNotFound(RedisServerError, FileNotFoundError):
    """The redis-server binary is not installed or not on PATH."""


def connect(url: str, *, timeout_s: float = 1.0, retries: int = 1, **kwargs) -> redis.Redis:
    """A redis-py client for router/agent use: short socket timeouts and few retries.

    redis-py 8's default retries a failed command 10 times with backoff, so a dead Redis would stall every
    routing decision for seconds; the router instead wants to notice at once and fall back to its last known
    membership (router/membership.py). ``decode_responses=True`` because every value we store is text.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if retries < 0:
        raise ValueError(f"retries must be >= 0, got {retries}")
    kwargs.setdefault("decode_responses", True)
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(ExponentialBackoff(cap=min(0.2, timeout_s), base=0.01), retries),
        **kwargs,
    )


_USERINFO = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://[^:@/]*):[^@/]*@")
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` with any password (``scheme://user:PASSWORD@``, ``?password=``) replaced by ``***``."""
    return _QUERY_PASSWORD.sub(r"\1***", _USERINFO.sub(r"\1:***@", url))


def _free_port(host: str) -> int:
    """A port that was free a moment ago; the caller retries if another process grabs it first."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _load_prctl():
    """libc's prctl, resolved once in the parent: the preexec_fn below runs between fork and exec, where loading
    a library (dlopen takes locks another thread may have held at fork time) could deadlock."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM the child when the parent dies, so a crashed test run leaks no redis-server.

    Linux only; PDEATHSIG fires when the *thread* that forked exits, so start the server from a long-lived
    thread (the main thread in tests and in ``k3serve serve``).
    """
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _terminate(proc: subprocess.Popen, owned_dirs: list[str]) -> None:
    """Stop the process (SIGTERM, then SIGKILL) and remove directories we created; safe to call twice."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    _terminate_dirs(owned_dirs)


def _terminate_dirs(owned_dirs: list[str]) -> None:
    for d in owned_dirs:
        shutil.rmtree(d, ignore_errors=True)
    owned_dirs.clear()


class RedisServer:
    """One private redis-server process.

    ``unix_socket=False`` (default) listens on ``host`` at a free TCP port (found by binding port 0, retried on a
    collision); ``unix_socket=True`` listens only on a socket file (TCP disabled with ``--port 0``), which
    avoids port races entirely but reaches only this machine.
    """

    def __init__(
        self,
        tmpdir: str | os.PathLike | None = None,
        *,
        unix_socket: bool = False,
        host: str = "127.0.0.1",
        port: int | None = None,
        binary: str = "redis-server",
        startup_timeout_s: float = 10.0,
        extra_args: tuple[str, ...] = (),
        password: str | None = None,
    ) -> None:
        """password: required of every client; None generates one (use "" only for tests of an open server)."""
        self._tmpdir = None if tmpdir is None else Path(tmpdir)
        self._unix_socket = unix_socket
        self._host = host
        self._fixed_port = port
        self._binary = binary
        self._startup_timeout_s = startup_timeout_s
        self._extra_args = tuple(extra_args)
        self._password = secrets.token_hex(24) if password is None else password
        if any(c in self._password for c in ":@/?#& \n"):
            raise ValueError("password: use letters and digits only (it is carried inside the URL)")
        self._proc: subprocess.Popen | None = None
        self._url: str | None = None
        self._owned_dirs: list[str] = []
        self._finalizer: weakref.finalize | None = None
        self._paused_url: str | None = None
        self.port: int | None = None
        self.unix_socket_path: str | None = None

    # ---------------------------------------------------------------- lifecycle
    def start(self, tmpdir: str | os.PathLike | None = None) -> str:
        """Start the server (its dir, log and socket go under ``tmpdir``) and return its URL once it answers PING."""
        if self._proc is not None or self._paused_url is not None:
            raise RedisServerError(f"already started at {redact_url(self._url or '')}")
        exe = shutil.which(self._binary)
        if exe is None:
            raise RedisServerNotFound(f"{self._binary!r} not found on PATH; {_INSTALL_HINT}")
        if tmpdir is not None:
            self._tmpdir = Path(tmpdir)
        if self._tmpdir is None:
            self._tmpdir = Path(tempfile.mkdtemp(prefix="k3s-redis-"))
            self._owned_dirs.append(str(self._tmpdir))
        self._tmpdir.mkdir(parents=True, exist_ok=True)

        attempts = 1 if self._unix_socket or self._fixed_port is not None else 5
        for attempt in range(attempts):
            try:
                return self._start_once(exe, self._fixed_port)
            except RedisServerError:
                # Most likely another process took the probed port before redis bound it: try a new port.
                if attempt == attempts - 1:
                    _terminate_dirs(self._owned_dirs)
                    raise
        raise RedisServerError("unreachable")  # the loop either returns or re-raises

    def _start_once(self, exe: str, port: int | None, sock_path: str | None = None) -> str:
        assert self._tmpdir is not None
        log = self._tmpdir / "redis.log"
        auth = f":{self._password}@" if self._password else ""
        args = [
            exe,
            "-",  # read the config (the password) from stdin first
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self._tmpdir),
            "--logfile", str(log),
            "--daemonize", "no",
            "--databases", "16",
            # bounded: past 1 GB, keys with a TTL (pins, session records) go least-recently-used first; budget
            # and membership state has no TTL or is rewritten every beat, so it stays
            "--maxmemory", "1gb",
            "--maxmemory-policy", "volatile-lru",
        ]  # fmt: skip
        if self._unix_socket:
            sock = Path(sock_path) if sock_path else self._tmpdir / "redis.sock"
            if len(str(sock)) > _MAX_UNIX_PATH:
                short = tempfile.mkdtemp(prefix="k3s-rs-")
                self._owned_dirs.append(short)
                sock = Path(short) / "redis.sock"
            args += ["--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700"]
            self.unix_socket_path, self.port = str(sock), None
            url = f"unix://{auth}{sock}?db=0"
        else:
            port = _free_port(self._host) if port is None else port
            args += ["--port", str(port), "--bind", self._host]
            self.port, self.unix_socket_path = port, None
            url = f"redis://{auth}{self._host}:{port}/0"
        args += list(self._extra_args)
        # the password goes to the server on stdin (a config file of one line), never on its command line (ps)
        config = f"requirepass {self._password}\n" if self._password else ""

        # PR_SET_PDEATHSIG fires when the spawning *thread* exits: only tie the server to the main thread, or a
        # server (re)started from a worker thread (a drill restoring Redis) would die with that thread
        main = threading.current_thread() is threading.main_thread()
        preexec = _die_with_parent if _PRCTL is not None and main else None
        # stdout/stderr to a file, not a pipe: nobody would drain a pipe once the server runs. Config errors go
        # there (before --logfile takes effect).
        errfile = self._tmpdir / "redis.stderr"
        with open(errfile, "wb") as err_out:
            proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=err_out, stderr=subprocess.STDOUT,
                                    preexec_fn=preexec)  # fmt: skip
            proc.stdin.write(config.encode())
            proc.stdin.close()
        deadline = time.monotonic() + self._startup_timeout_s
        client = connect(url, timeout_s=0.5, retries=0)
        try:
            while True:
                if proc.poll() is not None:
                    err = errfile.read_text(errors="replace")
                    raise RedisServerError(
                        f"redis-server exited with {proc.returncode} while starting on {redact_url(url)}: "
                        f"{err.strip()} {_tail(log)}".strip()
                    )
                try:
                    # Our process, not whatever else answers on this port (a fixed or raced port may be taken).
                    if int(client.info("server")["process_id"]) == proc.pid:
                        break
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    _terminate(proc, [])
                    raise RedisServerError(
                        f"redis-server did not answer PING on {redact_url(url)} within {self._startup_timeout_s}s: "
                        f"{_tail(log)}"
                    )
                time.sleep(0.02)
        finally:
            client.close()
        self._proc, self._url = proc, url
        # Stop the server even if the caller forgets: on GC and at interpreter exit.
        self._finalizer = weakref.finalize(self, _terminate, proc, self._owned_dirs)
        return url

    def pause(self) -> None:
        """Kill the server process (as if Redis crashed) but keep its address and directory for ``resume``."""
        if self._proc is None or self._finalizer is None:
            raise RedisServerError("pause() needs a running server")
        self._finalizer.detach()
        _terminate(self._proc, [])  # not our directories: resume() uses them
        self._proc = self._finalizer = None
        self._paused_url = self._url

    def resume(self) -> str:
        """Start an empty server at the address ``pause`` left, so clients reconnect with the same URL. All data
        is gone, as after a crash without persistence: heartbeats re-register clusters, pins are recomputed by HRW,
        budgets start empty."""
        if self._paused_url is None:
            raise RedisServerError("resume() needs a paused server")
        exe = shutil.which(self._binary)
        if exe is None:
            raise RedisServerNotFound(f"{self._binary!r} not found on PATH; {_INSTALL_HINT}")
        prev, self._paused_url = self._paused_url, None
        try:
            url = self._start_once(exe, self.port, self.unix_socket_path)
        except RedisServerError:
            _terminate_dirs(self._owned_dirs)
            raise
        if url != prev:
            self.stop()
            raise RedisServerError(f"resumed at {redact_url(url)}, not at the previous {redact_url(prev)}")
        return url

    def restart(self) -> str:
        """``pause()`` then ``resume()``: an empty server at the same address."""
        self.pause()
        return self.resume()

    def stop(self) -> None:
        """Stop the server and delete directories it created; idempotent."""
        if self._finalizer is not None:
            self._finalizer()
        elif self._paused_url is not None:  # paused: only our directories are left to remove
            _terminate_dirs(self._owned_dirs)
        self._proc = self._paused_url = None

    @property
    def pid(self) -> int:
        """The server's process id (drills freeze it with SIGSTOP to simulate a stalled Redis)."""
        if self._proc is None:
            raise RedisServerError("redis-server is not running")
        return self._proc.pid

    @property
    def url(self) -> str:
        if self._url is None or self._proc is None:
            raise RedisServerError("redis-server is not running (call start() first)")
        return self._url

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def client(self, **kwargs) -> redis.Redis:
        """A client for this server (``connect(self.url, **kwargs)``)."""
        return connect(self.url, **kwargs)

    def __enter__(self) -> RedisServer:
        if self._proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RedisServer(url={redact_url(self._url) if self._url else None!r}, running={self.running()})"


def _tail(path: Path, n: int = 10) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "log tail: " + " | ".join(lines[-n:]) if lines else ""
