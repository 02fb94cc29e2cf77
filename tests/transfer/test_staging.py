"""StagingStore without gRPC: verification rules, idempotency, cancel, expiry, budgets."""

from __future__ import annotations

import pytest
import torch

from transfer_helpers import make_spec, random_state
from k3serve.transfer.chunks import stream_plan
from k3serve.transfer.staging import StagingLimits, StagingStore, TransferRejected
from k3serve.transfer.v1 import transfer_pb2 as pb
from k3serve.transfer.wire import byte_view, chunk_header, crc32c, digest_crcs


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _stream(store, spec, src, dst, kda, mla, *, skip=(), manifest_edit=None):
    """Feed one sender's stream straight into the store; returns the state after the manifest."""
    views = {"kda": byte_view(kda), "mla": byte_view(mla)}
    plan = stream_plan(spec, src, dst)
    store.open(spec, src, dst)
    crcs = []
    for c in plan:
        payload = memoryview(views[c.kind][c.src_byte: c.src_byte + c.length])
        crcs.append(crc32c(payload))
        if c.seq not in skip:
            store.write(spec, src, chunk_header(spec, c, crcs[-1]), payload)
    m = pb.Manifest(transfer_id=spec.transfer_id, src_rank=src, dst_rank=dst, num_chunks=len(plan),
                    num_bytes=sum(c.length for c in plan), crc32c=digest_crcs(crcs))
    if manifest_edit:
        manifest_edit(m)
    return store.finish(spec, src, m)


def test_verified_only_after_every_sender_and_take_drops():
    parts, mla = random_state(2)
    spec = make_spec("s-1", parts, mla, 1)
    store = StagingStore(0, 1)
    assert _stream(store, spec, 0, 0, parts[0], mla) == "receiving"
    with pytest.raises(TransferRejected, match="not verified"):
        store.take(spec.transfer_id)
    assert _stream(store, spec, 1, 0, parts[1], mla) == "verified"
    st = store.take(spec.transfer_id)
    assert torch.equal(st.kda, torch.cat(parts, dim=1)) and torch.equal(st.mla, mla)
    assert store.occupancy() == (0, 0) and store.status(spec.transfer_id) == "installed"
    assert store.open(spec, 0, 0) == "installed"  # a late duplicate: acknowledged, nothing re-staged
    assert store.occupancy() == (0, 0)


def test_missing_chunk_or_bad_manifest_is_data_loss():
    parts, mla = random_state(1)
    spec = make_spec("s-2", parts, mla, 1)
    store = StagingStore(0, 1)
    with pytest.raises(TransferRejected, match="never arrived") as e:
        _stream(store, spec, 0, 0, parts[0], mla, skip={1})
    assert e.value.code == "DATA_LOSS"
    with pytest.raises(TransferRejected, match="manifest.crc32c") as e:
        _stream(store, spec, 0, 0, parts[0], mla, manifest_edit=lambda m: setattr(m, "crc32c", m.crc32c ^ 1))
    assert e.value.code == "DATA_LOSS" and store.status(spec.transfer_id) == "receiving"
    assert _stream(store, spec, 0, 0, parts[0], mla) == "verified"  # the retry completes it


def test_corrupt_payload_is_not_applied():
    parts, mla = random_state(1)
    spec = make_spec("s-3", parts, mla, 1)
    store = StagingStore(0, 1)
    store.open(spec, 0, 0)
    c = stream_plan(spec, 0, 0)[0]
    payload = bytearray(byte_view(parts[0])[c.src_byte: c.src_byte + c.length].tobytes())
    h = chunk_header(spec, c, crc32c(bytes(payload)))
    payload[7] ^= 1
    with pytest.raises(TransferRejected, match="crc32c") as e:
        store.write(spec, 0, h, memoryview(bytes(payload)))
    assert e.value.code == "DATA_LOSS" and store.counters.crc_failures == 1 and store.counters.chunks == 0


def test_cancel_and_expiry_free_staging_and_refuse_late_streams():
    parts, mla = random_state(2)
    clock = Clock()
    store = StagingStore(0, 1, StagingLimits(ttl_s=10.0, tombstone_s=100.0), clock=clock)
    a, b = make_spec("s-4a", parts, mla, 1), make_spec("s-4b", parts, mla, 1)
    _stream(store, a, 0, 0, parts[0], mla)
    _stream(store, b, 0, 0, parts[0], mla)
    assert store.occupancy()[0] == 2
    assert store.cancel(a.transfer_id) and not store.cancel(a.transfer_id)
    clock.now = 11.0
    assert store.expire() == [b.transfer_id]
    assert store.occupancy() == (0, 0)
    for spec, state in ((a, "cancelled"), (b, "expired")):
        with pytest.raises(TransferRejected, match=state) as e:
            store.open(spec, 1, 0)
        assert e.value.code == "FAILED_PRECONDITION"
    clock.now = 200.0
    store.expire()
    assert store.status(a.transfer_id) == "unknown"  # tombstones are bounded in time


def test_budget_and_misrouted_streams():
    parts, mla = random_state(1)
    spec = make_spec("s-5", parts, mla, 2)
    need = spec.geometry.rank_bytes(2)
    store = StagingStore(1, 2, StagingLimits(max_staging_bytes=need + 10))
    store.open(spec, 0, 1)
    with pytest.raises(TransferRejected) as e:
        store.open(make_spec("s-6", parts, mla, 2), 0, 1)
    assert e.value.code == "RESOURCE_EXHAUSTED"
    with pytest.raises(TransferRejected, match="open.dst_rank"):
        store.open(spec, 0, 0)
    small = StagingStore(0, 1, StagingLimits(max_staging_bytes=4096))
    with pytest.raises(TransferRejected, match="open.spec") as e:
        small.open(make_spec("s-7", parts, mla, 1), 0, 0)
    assert e.value.code == "INVALID_ARGUMENT"
    with pytest.raises(TransferRejected, match="open.spec.chunk_bytes"):
        StagingStore(0, 1, StagingLimits(max_chunk_bytes=8192)).open(make_spec("s-9", parts, mla, 1), 0, 0)
    other = StagingStore(0, 2, expect_geometry=(1, 2, 3, 4, 5, "float32"))
    with pytest.raises(TransferRejected, match="geometry"):
        other.open(spec, 0, 0)


def test_staging_buffers_are_recycled_within_the_pool_bound():
    parts, mla = random_state(1)
    store = StagingStore(0, 1)
    a = make_spec("s-8a", parts, mla, 1)
    _stream(store, a, 0, 0, parts[0], mla)
    st = store.take(a.transfer_id)
    assert st.recyclable and store.pooled_bytes == 0
    ptrs = {st.kda.data_ptr(), st.mla.data_ptr()}
    store.recycle(st)
    assert store.pooled_bytes == a.geometry.rank_bytes(1) and store.occupancy() == (0, 0)
    b = make_spec("s-8b", parts, mla, 1)
    assert _stream(store, b, 0, 0, parts[0], mla) == "verified"  # reuses the pooled buffers, fully rewritten
    st = store.take(b.transfer_id)
    assert {st.kda.data_ptr(), st.mla.data_ptr()} == ptrs and store.pooled_bytes == 0
    assert torch.equal(st.kda, parts[0]) and torch.equal(st.mla, mla)
    none = StagingStore(0, 1, StagingLimits(pool_bytes=0))
    _stream(none, a, 0, 0, parts[0], mla)
    none.cancel(a.transfer_id)
    assert none.pooled_bytes == 0
