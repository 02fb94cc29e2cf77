"""The private redis-server used by tests and by `k3serve serve` when no REDIS_URL is given."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from k3serve.cluster.redis_server import RedisServer, RedisServerError, RedisServerNotFound, connect


REPO = Path(__file__).resolve().parents[2]


def _gone(pid: int) -> bool:
    """No such process, or only a zombie left (an orphan's zombie may linger where PID 1 does not reap)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return any(line.startswith("State:") and "Z" in line.split()[1] for line in status.splitlines())


def test_tcp_server_start_stop(tmp_path):
    server = RedisServer()
    url = server.start(tmp_path)
    assert url == f"redis://:{server._password}@127.0.0.1:{server.port}/0" == server.url
    client = connect(url)
    assert client.ping()
    client.set("k", "v")
    assert client.get("k") == "v"
    assert client.config_get("save")["save"] == ""
    assert client.config_get("appendonly")["appendonly"] == "no"
    assert client.config_get("bind")["bind"] == "127.0.0.1"
    pid = server.pid
    client.close()
    server.stop()
    server.stop()  # idempotent
    assert _gone(pid) and not server.running()
    with pytest.raises(RedisServerError):
        server.url
    assert not list(tmp_path.glob("*.rdb"))  # nothing persisted
    with socket.socket() as s:  # nothing listens on the port any more (REUSEADDR: ignore TIME_WAIT leftovers)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", server.port))


def test_unix_socket_server_and_context_manager(tmp_path):
    with RedisServer(tmp_path, unix_socket=True) as server:
        assert server.url.startswith("unix://") and server.port is None
        assert server.unix_socket_path == str(tmp_path / "redis.sock")
        c = server.client()
        assert c.ping()
        # TCP is off entirely
        assert c.config_get("port")["port"] == "0"
        c.close()
    assert not server.running()


def test_long_socket_dir_falls_back_to_a_short_path(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    with RedisServer(deep, unix_socket=True) as server:
        assert len(server.unix_socket_path) <= 100
        assert server.client().ping()
        short_dir = os.path.dirname(server.unix_socket_path)
    assert not os.path.exists(short_dir)  # the directory we made is removed


def test_two_servers_side_by_side_and_a_default_tmpdir():
    with RedisServer() as a, RedisServer() as b:
        assert a.port != b.port
        ca, cb = a.client(), b.client()
        ca.set("x", "a")
        assert cb.get("x") is None
        ca.close()
        cb.close()


def test_missing_binary_names_the_install_command():
    with pytest.raises(RedisServerNotFound, match="apt-get install -y redis-server"):
        RedisServer(binary="redis-server-that-does-not-exist").start()


def test_startup_failure_reports_the_log(tmp_path):
    with pytest.raises(RedisServerError, match="exited"):
        RedisServer(tmp_path, unix_socket=True, extra_args=("--no-such-option", "1")).start()


def test_start_twice_is_an_error(tmp_path):
    with RedisServer(tmp_path, unix_socket=True) as server:
        with pytest.raises(RedisServerError, match="already started"):
            server.start()


def test_connect_fails_fast_when_nothing_listens(tmp_path):
    client = connect(f"unix://{tmp_path}/none.sock", timeout_s=0.2, retries=0)
    with pytest.raises(redis.ConnectionError):
        client.ping()
    with pytest.raises(ValueError):
        connect("redis://127.0.0.1:1/0", timeout_s=0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
def test_server_dies_with_a_killed_parent(tmp_path):
    code = (
        "import sys, time; from k3serve.cluster.redis_server import RedisServer; "
        f"s = RedisServer({str(tmp_path)!r}, unix_socket=True); s.start(); print(s.pid, flush=True); time.sleep(60)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))  # fmt: skip
    try:
        pid = int(parent.stdout.readline())
        assert not _gone(pid)
        parent.send_signal(signal.SIGKILL)  # no finalizers, no atexit: only PDEATHSIG can stop the server
        parent.wait(5)
        deadline = time.monotonic() + 5
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _gone(pid)
    finally:
        parent.kill()
        parent.wait(5)


@pytest.mark.parametrize("unix_socket", [False, True])
def test_pause_and_resume_keep_the_url_and_drop_the_data(tmp_path, unix_socket):
    with RedisServer(tmp_path, unix_socket=unix_socket) as server:
        url = server.url
        client = connect(url, timeout_s=0.3, retries=0)
        client.set("k", "v")
        server.pause()
        assert not server.running()
        with pytest.raises(redis.ConnectionError):
            client.ping()
        with pytest.raises(RedisServerError):
            server.start()  # paused, not stopped
        assert server.resume() == url
        assert client.ping() and client.get("k") is None  # same URL, the client reconnects; data gone
        assert server.restart() == url
        assert client.ping()
        client.close()
    with pytest.raises(RedisServerError):
        server.resume()


def test_fixed_port(tmp_path):
    with RedisServer() as first:
        port = first.port
    with RedisServer(tmp_path, port=port) as server:
        assert server.port == port and server.client().ping()
        with pytest.raises(RedisServerError):  # taken: a fixed port is not retried elsewhere
            RedisServer(tmp_path / "other", port=port, startup_timeout_s=2).start()


def test_a_redis_password_stays_out_of_the_configs_and_deployments_reprs():
    from k3serve.cluster.deploy import ControlSpec, DeployConfig
    from k3serve.cluster.deployment import Deployment

    url = "redis://:s3cr3t-p4ss@10.0.0.5:6379/0"
    assert "s3cr3t" not in repr(ControlSpec(redis_url=url))
    assert "s3cr3t" not in repr(Deployment(DeployConfig(), redis_url=url))
