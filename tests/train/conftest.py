"""Training tests run tiny shapes on one torch thread (tests/conftest.py ``one_thread``)."""

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield
