"""A prefill rank keeps its senders (channels) across requests: send_state with a SenderCache."""

import secrets

import torch

from k3serve.model.presets import preset
from k3serve.auth import AuthConfig
from k3serve.transfer.handoff_send import SenderCache, StateSendJob, send_state
from k3serve.transfer.receiver import ReceiverConfig, TransferReceiver
from k3serve.transfer.sender import SenderConfig
from k3serve.transfer.spec import DTYPES, StateGeometry, TransferSpec


def test_cached_sender_serves_consecutive_requests_with_identical_bytes():
    auth = AuthConfig(secrets.token_hex(16), peer="test")
    g = StateGeometry.of_config(preset("tiny"), 300)
    gen = torch.Generator().manual_seed(0)
    cache = SenderCache()
    with TransferReceiver(ReceiverConfig(auth)) as rx:
        try:
            for i in range(3):
                kda = torch.randn(g.kda_layers, g.kda_heads, g.kda_block_floats, generator=gen)
                mla = torch.rand(g.mla_shape(), generator=gen).to(DTYPES[g.mla_dtype])
                spec = TransferSpec(f"t{i}", f"r{i}", g, 1, 1, page_tokens=64, chunk_bytes=64 << 10)
                job = StateSendJob(spec, (rx.endpoint,), SenderConfig(auth))
                out = send_state(job, 0, kda, mla, cache)
                assert out.error == "" and out.verified_ranks == (0,)
                staged = rx.store.take(spec.transfer_id)
                assert torch.equal(staged.kda, kda) and torch.equal(staged.mla, mla)
                rx.store.recycle(staged)
            assert len(cache) == 1  # one sender (one channel per decode rank) for all three
            assert cache.get(0, (rx.endpoint,), SenderConfig(auth)) is cache.get(0, (rx.endpoint,),
                                                                                 SenderConfig(auth))
        finally:
            cache.close()
    assert len(cache) == 0
