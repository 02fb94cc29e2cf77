"""The allocator tuning senders and receivers apply to their process (k3serve/transfer/memory.py)."""

import platform

import pytest

from k3serve.transfer.memory import tune_allocator


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt tuning is glibc only")
def test_tune_allocator_is_taken_and_repeatable():
    assert tune_allocator() is True
    assert tune_allocator() is True  # a second sender/receiver in the same process changes nothing
    blocks = [bytes(1 << 20) for _ in range(8)]  # ~MiB blocks still allocate and free normally
    assert sum(map(len, blocks)) == 8 << 20
