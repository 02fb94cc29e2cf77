"""A real local deployment (Ray + private redis-server + 3 clusters + 2 routers) shared by the e2e tests.

Shared deployments start with ``K3SERVE_TEST_MUTATION=per-request`` (k3serve/engine/mutation.py): a request whose
id names a mutation is served with that fault, every other request as in production, so the live mutation
families (test_mutations_live.py, the failover drill) need no deployment of their own."""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest

from k3serve.cluster.deploy import load_deploy


@contextmanager
def per_request_mutations():
    """Start a deployment inside this block: its Ray workers carry the per-request mutation hook."""
    from k3serve.engine import mutation

    old = os.environ.get("K3SERVE_TEST_MUTATION")
    os.environ["K3SERVE_TEST_MUTATION"] = mutation.PER_REQUEST
    try:
        yield
    finally:
        if old is None:
            del os.environ["K3SERVE_TEST_MUTATION"]
        else:
            os.environ["K3SERVE_TEST_MUTATION"] = old


@pytest.fixture(scope="package")
def deployment():
    from k3serve.cluster.deployment import Deployment

    with per_request_mutations():
        dep = Deployment(load_deploy("configs/local.yaml")).start()
    yield dep
    dep.stop()


@pytest.fixture(scope="package")
def reference_model(deployment):
    from k3serve.model.loader import load_model

    return load_model(deployment.checkpoint)


@pytest.fixture(scope="package")
def reference_refs(reference_model):
    """Reference traces of the deployment's model (tests/exactness.py)."""
    from tests.exactness import References

    return References(reference_model)
