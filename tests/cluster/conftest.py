"""A real local deployment (Ray + private redis-server + 3 clusters + 2 routers) shared by the e2e tests."""

from __future__ import annotations

import pytest

from k3serve.cluster.deploy import load_deploy


@pytest.fixture(scope="package")
def deployment():
    from k3serve.cluster.deployment import Deployment

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
