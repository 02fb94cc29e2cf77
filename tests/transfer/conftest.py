"""Fixtures for the transfer tests: a deployment secret, helper processes, small random states."""

from __future__ import annotations

import secrets

import pytest
import torch

from k3serve.auth import AuthConfig
from k3serve.transfer.receiver import ReceiverConfig, TransferReceiver
from k3serve.transfer.sender import SenderConfig
from k3serve.transfer.staging import StagingLimits


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """These tests run many processes on few cores: two intra-op threads per process only fight (a 300-token
    prefill took 20 s instead of 0.2 s with two threads on a busy 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def auth() -> AuthConfig:
    return AuthConfig(secrets.token_hex(16), peer="test")


@pytest.fixture(scope="session")
def fast_sender(auth) -> SenderConfig:
    """Short backoff and deadlines so retries and failures resolve in well under a second."""
    return SenderConfig(auth, max_attempts=3, backoff_s=0.02, backoff_max_s=0.1, stream_timeout_s=10.0,
                        rpc_timeout_s=2.0)


@pytest.fixture
def receivers(auth):
    """make(d, **limits) -> d in-process receivers (ranks 0..d-1); all stopped after the test."""
    made: list[TransferReceiver] = []

    def make(d: int, **limits) -> list[TransferReceiver]:
        rx = [TransferReceiver(ReceiverConfig(auth, limits=StagingLimits(**limits), gc_interval_s=0.05)
                               .for_rank(r, d)) for r in range(d)]
        made.extend(rx)
        return rx

    yield make
    for r in made:
        r.stop(0)
