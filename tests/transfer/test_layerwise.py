"""Layer-wise streaming: a layer's chunks leave as soon as it is marked final, before later layers exist."""

from __future__ import annotations

import time

import pytest
import torch

from transfer_helpers import make_spec, random_state
from k3serve.transfer.chunks import by_layer, stream_plan
from k3serve.transfer.plan import reshard_kda
from k3serve.transfer.sender import TransferSender


def _wait_chunks(rxs, n: int) -> bool:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if all(rx.store.counters.chunks >= n for rx in rxs):
            return True
        time.sleep(0.01)
    return False


def test_layers_stream_as_they_become_final(receivers, fast_sender):
    parts, mla = random_state(1, seed=12)
    rxs = receivers(2)
    spec = make_spec("layerwise", parts, mla, 2)
    layer0 = len(by_layer(stream_plan(spec, 0, 0))[("kda", 0)])
    with TransferSender(0, [r.endpoint for r in rxs], fast_sender) as s:
        session = s.begin(spec, parts[0], mla)
        session.layer_ready("kda", 0)
        assert _wait_chunks(rxs, layer0)  # layer 0 arrived while the others are still "being computed"
        time.sleep(0.1)
        assert all(rx.store.counters.chunks == layer0 for rx in rxs)  # and nothing else left yet
        with pytest.raises(ValueError, match="already"):
            session.layer_ready("kda", 0)
        with pytest.raises(ValueError, match="finish"):
            session.finish()
        for layer in reversed(range(spec.geometry.mla_layers)):  # any order
            session.layer_ready("mla", layer)
        session.all_ready()
        res = session.finish()
    assert res.verified_ranks == {0, 1}
    want = reshard_kda(parts, 2)
    for rank, rx in enumerate(rxs):
        st = rx.store.take(spec.transfer_id)
        assert torch.equal(st.kda, want[rank]) and torch.equal(st.mla, mla)
