"""Drafter tests run tiny shapes on one torch thread (as tests/train: immune to a loaded machine)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
