"""Training tests run tiny shapes: one torch thread is as fast there and immune to a loaded machine's
oversubscription (two threads on a busy 2-core box ran these 20-50x slower)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
