"""Router tests run against a real, private redis-server (one per test session, on a unix socket so there is no
port race); each test gets its own deployment namespace, so tests never see each other's keys."""

from __future__ import annotations

import uuid

import pytest

from k3serve.cluster.redis_server import RedisServer, connect
from tests import tiers
from tests.router.fake_cluster import Rig


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(unix_socket=True)
    with tiers.processes_allowed():  # the fast tier's one helper process: a real Redis, shared by the session
        server.start(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def rclient(redis_server):
    client = connect(redis_server.url, timeout_s=5.0)
    yield client
    client.close()


@pytest.fixture
def new_client(redis_server):
    """Factory of independent clients (one per simulated router replica); all closed at teardown."""
    made = []

    def make():
        c = connect(redis_server.url, timeout_s=5.0)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture
def ns() -> str:
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
def rig(redis_server, ns):
    """Fake cluster fronts and routers over the session's redis-server (fake_cluster.py); all closed at teardown."""
    r = Rig(redis_server.url, ns)
    yield r
    r.close()
