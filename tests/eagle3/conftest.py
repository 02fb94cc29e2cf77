"""Drafter tests run tiny shapes on one torch thread (tests/conftest.py ``one_thread``), as tests/train."""

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield
