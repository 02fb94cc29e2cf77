"""Starting the private local Ray instance: a raylet that registers late (Ray's fixed 30 s wait, seen on a
loaded 2-core CI machine) is retried; any other start error is raised at once."""

import os

import pytest
import ray

from k3serve.cluster.deploy import load_deploy
from k3serve.cluster.deployment import Deployment

_TIMEOUT = "The current node timed out during startup. This could happen because some of the raylet failed"


class _FakeRay:
    def __init__(self, errors):
        self.errors, self.inits, self.shutdowns = list(errors), 0, 0

    def init(self, **kwargs):
        self.inits += 1
        assert kwargs["_node_ip_address"] == "127.0.0.1"
        if self.errors:
            raise self.errors.pop(0)

    def shutdown(self):
        self.shutdowns += 1


@pytest.fixture
def fake_ray(monkeypatch):
    def make(errors):
        fake = _FakeRay(errors)
        monkeypatch.setattr(ray, "init", fake.init)
        monkeypatch.setattr(ray, "shutdown", fake.shutdown)
        monkeypatch.setattr(ray, "is_initialized", lambda: False)
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
    assert (fake.inits, fake.shutdowns) == (1, 0)


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
