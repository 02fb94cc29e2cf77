"""Starting the private local Ray instance: a raylet that registers late (Ray's fixed 30 s wait, seen on a
loaded 2-core CI machine) is retried, and so is a GCS port-file timeout of a retried start; the processes a failed
start left running are stopped first; any other start error is raised at once."""

import contextlib
import os
import subprocess
import sys
import threading
import time

import pytest
import ray
import psutil  # Ray's copy (ray/thirdparty_files, put on sys.path by `import ray`), as deployment.py uses

from k3serve.cluster.deploy import load_deploy
from k3serve.cluster.deployment import Deployment

_TIMEOUT = "The current node timed out during startup. This could happen because some of the raylet failed"
# what ray._raylet.wait_for_persisted_port raises (Ray 2.60)
_GCS_PORT_TIMEOUT = "Timed out waiting for file /tmp/ray/session_2026-12-03_10-00-00_000000_1/gcs_server_port_ab12"


class _FakeRay:
    def __init__(self, errors, on_init=None):
        self.errors, self.inits, self.shutdowns, self.on_init = list(errors), 0, 0, on_init

    def init(self, **kwargs):
        self.inits += 1
        assert kwargs["_node_ip_address"] == "127.0.0.1"
        if self.on_init is not None:
            self.on_init()
        if self.errors:
            raise self.errors.pop(0)

    def shutdown(self):
        self.shutdowns += 1


def _on_this_thread(fake_fn, real_fn):
    """fake_fn for calls from the test's thread, real_fn for any other: in the full suite a real deployment (the
    package's shared one) is up in this process, and its supervisor thread's ray.wait() calls ray.is_initialized
    and, where that says False, ray.init (seen: a fake start counted an init of that thread's)."""
    test_thread = threading.get_ident()
    return lambda *a, **kw: (fake_fn if threading.get_ident() == test_thread else real_fn)(*a, **kw)


@pytest.fixture
def fake_ray(monkeypatch):
    def make(errors, on_init=None):
        fake = _FakeRay(errors, on_init)
        monkeypatch.setattr(ray, "init", _on_this_thread(fake.init, ray.init))
        monkeypatch.setattr(ray, "shutdown", _on_this_thread(fake.shutdown, ray.shutdown))
        monkeypatch.setattr(ray, "is_initialized", _on_this_thread(lambda: False, ray.is_initialized))
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        return fake
    return make


def _deployment() -> Deployment:
    return Deployment(load_deploy(None))


def test_a_start_that_timed_out_is_shut_down_and_tried_again(fake_ray):
    fake = fake_ray([Exception(_TIMEOUT), Exception(_TIMEOUT)])
    dep = _deployment()
    dep._start_ray()
    assert (fake.inits, fake.shutdowns) == (3, 2)
    assert dep._own_ray


def test_timeouts_past_the_attempts_are_raised(fake_ray):
    fake = fake_ray([Exception(_TIMEOUT)] * 3)
    with pytest.raises(Exception, match="timed out during startup"):
        _deployment()._start_ray()
    assert fake.inits == 3


def test_other_start_errors_are_not_retried(fake_ray):
    fake = fake_ray([ValueError("bad runtime_env")])
    with pytest.raises(ValueError, match="bad runtime_env"):
        _deployment()._start_ray()
    assert fake.inits == 1


def test_other_errors_of_a_retried_start_are_raised_at_once(fake_ray):
    fake = fake_ray([Exception(_TIMEOUT), ValueError("bad runtime_env")])
    with pytest.raises(ValueError, match="bad runtime_env"):
        _deployment()._start_ray()
    assert fake.inits == 2


def test_a_gcs_port_file_timeout_of_a_retried_start_is_retried(fake_ray):
    fake = fake_ray([Exception(_TIMEOUT), RuntimeError(_GCS_PORT_TIMEOUT)])
    dep = _deployment()
    dep._start_ray()
    assert (fake.inits, fake.shutdowns) == (3, 2)
    assert dep._own_ray


def test_a_gcs_port_file_timeout_of_the_first_start_is_raised(fake_ray):
    # the first start's wait is already lengthened to GCS_PORT_WAIT_S on a machine nothing of ours loads
    fake = fake_ray([RuntimeError(_GCS_PORT_TIMEOUT)])
    with pytest.raises(RuntimeError, match="gcs_server_port"):
        _deployment()._start_ray()
    assert fake.inits == 1


def test_the_last_start_s_gcs_port_file_timeout_is_raised(fake_ray):
    fake = fake_ray([Exception(_TIMEOUT), RuntimeError(_GCS_PORT_TIMEOUT), RuntimeError(_GCS_PORT_TIMEOUT)])
    with pytest.raises(RuntimeError, match="gcs_server_port"):
        _deployment()._start_ray()
    assert fake.inits == 3


@pytest.fixture
def spawned():
    """Processes a test starts, killed at its end whatever happened."""
    procs = []

    def spawn(script):
        procs.append(subprocess.Popen([sys.executable, "-c", script]))
        return procs[-1]
    yield spawn
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):  # stopped by the code under test
            for kid in psutil.Process(p.pid).children(recursive=True):
                kid.kill()
        p.kill()
        p.wait()


# a child that starts a grandchild and waits for it (as the raylet does its workers)
_PARENT = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); " \
          "time.sleep(300)"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_children(proc, n: int) -> list[int]:
    deadline = time.monotonic() + 30
    while len(kids := psutil.Process(proc.pid).children(recursive=True)) < n:
        assert time.monotonic() < deadline, "the test's grandchild did not start"
        time.sleep(0.05)
    return [k.pid for k in kids]


def test_the_processes_of_a_timed_out_start_are_stopped_before_the_next(fake_ray, spawned):
    """ray.init raises from inside the constructor of Ray's Node, so ray.shutdown() has no node and leaves the
    GCS, raylet and the rest running; they must be gone before the next start."""
    unrelated = spawned("import time; time.sleep(300)")  # a child this process had before the start: kept
    started = []

    def on_init():
        if started:  # the next start: nothing of the last one may still run
            assert not [pid for pid in started if _alive(pid)]
            return
        head = spawned(_PARENT)
        started.extend([head.pid, *_wait_children(head, 1)])

    fake = fake_ray([Exception(_TIMEOUT)], on_init)
    _deployment()._start_ray()
    assert fake.inits == 2
    assert len(started) == 2 and not [pid for pid in started if _alive(pid)]
    assert unrelated.poll() is None


def test_what_an_earlier_child_starts_meanwhile_is_kept(fake_ray, spawned, tmp_path):
    """Only the start's own processes are stopped: a child this process already had (e.g. the raylet of a Ray
    instance already running here, as in this suite) may start processes of its own at any time."""
    go = tmp_path / "go"
    earlier = spawned("import os, subprocess, sys, time\n"
                      f"while not os.path.exists({str(go)!r}): time.sleep(0.02)\n"
                      "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); time.sleep(300)")
    grandchildren = []

    def on_init():
        if not grandchildren:  # during the first, failing start: the earlier child starts a grandchild
            go.touch()
            grandchildren.extend(_wait_children(earlier, 1))

    fake = fake_ray([Exception(_TIMEOUT)], on_init)
    _deployment()._start_ray()
    assert fake.inits == 2
    assert earlier.poll() is None and all(_alive(pid) for pid in grandchildren)


def test_a_start_that_failed_for_good_leaves_no_processes(fake_ray, spawned):
    started = []

    def on_init():
        head = spawned(_PARENT)
        started.extend([head.pid, *_wait_children(head, 1)])

    fake_ray([ValueError("bad runtime_env")], on_init)
    with pytest.raises(ValueError, match="bad runtime_env"):
        _deployment()._start_ray()
    assert len(started) == 2 and not [pid for pid in started if _alive(pid)]


def test_the_gcs_port_wait_is_lengthened_for_the_start_unless_the_operator_set_it(fake_ray, monkeypatch):
    from k3serve.cluster import deployment

    fake = fake_ray([])
    seen = []
    init = fake.init
    monkeypatch.setattr(ray, "init", lambda **kw: (seen.append(os.environ.get(deployment.GCS_PORT_WAIT_ENV)),
                                                   init(**kw)))
    monkeypatch.delenv(deployment.GCS_PORT_WAIT_ENV, raising=False)
    _deployment()._start_ray()
    assert seen == [str(deployment.GCS_PORT_WAIT_S)]  # what Ray reads during ray.init
    assert deployment.GCS_PORT_WAIT_ENV not in os.environ  # and not left behind
    monkeypatch.setenv(deployment.GCS_PORT_WAIT_ENV, "45")
    _deployment()._start_ray()
    assert seen[-1] == "45" and os.environ[deployment.GCS_PORT_WAIT_ENV] == "45"


def test_a_loopback_deployment_keeps_the_local_ray_on_loopback(fake_ray, monkeypatch):
    """Ray resolves a node address of 127.0.0.1 to the machine's outbound address and listens on every interface
    unless its multi-machine mode is off while it starts (tests/cluster/test_mooncake_service.py checks the sockets)."""
    import dataclasses

    from k3serve.cluster import deployment

    fake = fake_ray([])
    seen = []
    init = fake.init
    monkeypatch.setattr(ray, "init", lambda **kw: (seen.append(os.environ.get(deployment.RAY_LOOPBACK_ENV)),
                                                   init(**kw)))
    monkeypatch.delenv(deployment.RAY_LOOPBACK_ENV, raising=False)
    _deployment()._start_ray()  # the default bind_host is 127.0.0.1
    wide = Deployment(dataclasses.replace(load_deploy(None), bind_host="0.0.0.0"))
    wide._start_ray()
    assert seen == ["0", None] and deployment.RAY_LOOPBACK_ENV not in os.environ
