"""The Mooncake data plane (k3serve/transfer/mooncake/): the same plan, CRC32C, manifest, staging and HMAC as
the gRPC plane, with the payload written by the engine into the receiver's registered staging region.

State lands byte-identical to the in-process reshard for every (P, D); faults end in a verified transfer
after retry or a clean failure, with no staging or region range left held; the region is registered once.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from transfer_helpers import make_spec, random_state, send_all
from benchmarks.transfer_faults import SenderFaults
from k3serve.transfer.buffers import RegionBuffers
from k3serve.transfer.chunks import stream_plan
from k3serve.transfer.mooncake.plane import DataPlane, MooncakeConfig
from k3serve.transfer.plan import reshard_kda
from k3serve.transfer.receiver import ReceiverConfig, TransferReceiver
from k3serve.transfer.sender import SendResult, TransferFailed, TransferSender
from k3serve.transfer.staging import StagingLimits

pytestmark = pytest.mark.usefixtures("mooncake_plane")  # tests/conftest.py: skip, or an error

PAIRS = [(1, 1), (2, 1), (1, 2), (2, 2), (2, 4), (4, 2), (4, 1)]
MC = MooncakeConfig(staging_bytes=8 << 20, send_bytes=8 << 20, quarantine_s=0.2, batch_bytes=64 << 10,
                     listen_any=True)


@pytest.fixture(scope="module")
def sender_plane():
    plane = DataPlane(MC)
    region = RegionBuffers(MC.send_bytes, quarantine_s=0.0)
    yield plane, region
    plane.close()


@pytest.fixture(scope="module")
def groups(auth):
    """d -> d receivers, each with its own engine and registered staging region (made on first use)."""
    made: dict[int, list[tuple[TransferReceiver, DataPlane]]] = {}

    def get(d: int) -> list[TransferReceiver]:
        if d not in made:
            made[d] = []
            for r in range(d):
                plane = DataPlane(MC)
                region = RegionBuffers(MC.staging_bytes, quarantine_s=MC.quarantine_s)
                plane.register(region)
                cfg = ReceiverConfig(auth, limits=StagingLimits(ttl_s=30.0), gc_interval_s=0.05).for_rank(r, d)
                made[d].append((TransferReceiver(cfg, region=region, segment=plane.segment), plane))
        return [rx for rx, _ in made[d]]

    yield get
    for group in made.values():
        for rx, plane in group:
            rx.stop(0)
            plane.close()
            assert plane.registered_bytes == 0


def _send_all(rxs, spec, parts, mla, config, sender_plane, faults=None):
    from k3serve.transfer.mooncake.sender import MooncakeSender

    plane, region = sender_plane
    endpoints = [x.endpoint for x in rxs]
    return send_all(lambda r: MooncakeSender(r, endpoints, config, plane, region, faults, MC.batch_bytes),
                    spec, parts, mla)


def _assert_nothing_held(rxs, sender_plane):
    for rx in rxs:
        assert rx.store.occupancy() == (0, 0)
        assert rx.store.region.used_bytes == 0  # quarantined ranges are not held by any transfer
    assert sender_plane[1].used_bytes == 0


@pytest.mark.parametrize("p,d", PAIRS)
def test_state_over_mooncake_is_byte_identical_to_the_inprocess_reshard(p, d, groups, fast_sender, sender_plane):
    rxs = groups(d)
    parts, mla = random_state(p, heads=8, tokens=300, seed=p * 10 + d)
    want = reshard_kda(parts, d)
    for rep in range(2):  # the second transfer reuses the same registered regions
        spec = make_spec(f"mc-{p}-{d}-{rep}", parts, mla, d)
        results = _send_all(rxs, spec, parts, mla, fast_sender, sender_plane)
        assert all(isinstance(r, SendResult) for r in results), results
        assert set().union(*(r.verified_ranks for r in results)) == set(range(d))
        for rank, rx in enumerate(rxs):
            st = rx.store.take(spec.transfer_id)
            assert torch.equal(st.kda, want[rank]) and torch.equal(st.mla, mla)
            rx.store.recycle(st)
    assert all(rx.store.counters.landed == rx.store.counters.chunks for rx in rxs)  # no payload went over gRPC
    assert all(rx.store.counters.place_s == 0.0 for rx in rxs)  # nothing placed from gRPC messages
    _assert_nothing_held(rxs, sender_plane)
    assert sender_plane[0].registrations == 1  # the send region: once, for every transfer of this module


RETRIED = {"drop": SenderFaults(drop_after_chunks=3), "corrupt": SenderFaults(corrupt_chunk=2),
           "delay": SenderFaults(stall_after_chunks=1, stall_s=4.0)}


@pytest.mark.parametrize("fault", sorted(RETRIED))
def test_fault_on_first_attempt_is_retried_to_identical_bytes(fault, groups, fast_sender, sender_plane):
    config = dataclasses.replace(fast_sender, stream_timeout_s=2.0) if fault == "delay" else fast_sender
    rxs = groups(2)
    parts, mla = random_state(2, seed=3)
    spec = make_spec(f"mc-retry-{fault}", parts, mla, 2)
    failures = [rx.store.counters.crc_failures for rx in rxs]
    results = _send_all(rxs, spec, parts, mla, config, sender_plane, RETRIED[fault])
    assert all(isinstance(r, SendResult) for r in results), results
    assert all(s.attempts == 2 for r in results for s in r.streams)
    want = reshard_kda(parts, 2)
    for rank, rx in enumerate(rxs):
        st = rx.store.take(spec.transfer_id)
        assert torch.equal(st.kda, want[rank]) and torch.equal(st.mla, mla)
        rx.store.recycle(st)
    if fault == "corrupt":  # caught by the CRC over the bytes that landed in staging
        assert all(rx.store.counters.crc_failures > f for rx, f in zip(rxs, failures))
    _assert_nothing_held(rxs, sender_plane)


@pytest.mark.parametrize("fault,code", [("drop", "CANCELLED"), ("corrupt", "DATA_LOSS"),
                                        ("delay", "DEADLINE_EXCEEDED")])
def test_persistent_fault_fails_cleanly_and_frees_staging(fault, code, groups, fast_sender, sender_plane):
    config = dataclasses.replace(fast_sender, stream_timeout_s=1.0, max_attempts=2)
    rxs = groups(2)
    parts, mla = random_state(2, seed=4)
    spec = make_spec(f"mc-fail-{fault}", parts, mla, 2)
    results = _send_all(rxs, spec, parts, mla, config, sender_plane,
                        dataclasses.replace(RETRIED[fault], attempts=0))
    assert all(isinstance(r, TransferFailed) for r in results), results
    assert any(r.code == code for r in results), [(r.code, r.message) for r in results]
    for rx in rxs:
        assert rx.store.status(spec.transfer_id) == "cancelled"
        with pytest.raises(Exception, match="not verified"):
            rx.store.take(spec.transfer_id)
    _assert_nothing_held(rxs, sender_plane)
    # a late retry of the cancelled transfer is refused at Open, before any byte is written
    results = _send_all(rxs, spec, parts[:1], mla, fast_sender, sender_plane)
    assert isinstance(results[0], TransferFailed) and results[0].code == "FAILED_PRECONDITION"
    _assert_nothing_held(rxs, sender_plane)


def test_duplicate_open_writes_nothing_and_grpc_only_receivers_refuse_open(groups, receivers, fast_sender,
                                                                            sender_plane):
    (rx,) = groups(1)
    parts, mla = random_state(1, seed=5)
    spec = make_spec("mc-dup", parts, mla, 1)
    (first,) = _send_all([rx], spec, parts, mla, fast_sender, sender_plane)
    chunks = rx.store.counters.chunks
    (again,) = _send_all([rx], spec, parts, mla, fast_sender, sender_plane)
    assert not first.streams[0].duplicate and again.streams[0].duplicate and rx.store.counters.chunks == chunks
    rx.store.recycle(rx.store.take(spec.transfer_id))
    _assert_nothing_held([rx], sender_plane)
    (plain,) = receivers(1)  # a gRPC-plane receiver: no region, so no Open
    (res,) = _send_all([plain], make_spec("mc-plain", parts, mla, 1), parts, mla, fast_sender, sender_plane)
    assert isinstance(res, TransferFailed) and res.code == "FAILED_PRECONDITION" and "data plane" in res.message
    with TransferSender(0, [rx.endpoint], fast_sender) as s:  # and gRPC payloads still work on a Mooncake receiver
        ok = s.send(make_spec("mc-grpc-payload", parts, mla, 1), parts[0], mla)
    assert ok.verified_ranks == {0}
    st = rx.store.take("mc-grpc-payload")
    assert torch.equal(st.kda, parts[0]) and torch.equal(st.mla, mla)
    rx.store.recycle(st)
    _assert_nothing_held([rx], sender_plane)


def test_a_full_region_is_resource_exhausted_and_holds_nothing(auth, fast_sender, sender_plane):
    plane = DataPlane(MC)
    region = RegionBuffers(64 << 10, quarantine_s=0.2)  # smaller than one transfer's staging
    plane.register(region)
    rx = TransferReceiver(ReceiverConfig(auth), region=region, segment=plane.segment)
    try:
        parts, mla = random_state(1, seed=6)
        (res,) = _send_all([rx], make_spec("mc-full", parts, mla, 1), parts, mla,
                           dataclasses.replace(fast_sender, max_attempts=1), sender_plane)
        assert isinstance(res, TransferFailed) and res.code == "RESOURCE_EXHAUSTED"
        assert region.used_bytes == 0 and rx.store.occupancy() == (0, 0)
    finally:
        rx.stop(0)
        plane.close()
    assert plane.registered_bytes == 0 and plane.registrations == 1


def test_a_foreign_engine_cannot_change_or_read_staged_state_after_it_landed(groups, fast_sender, sender_plane):
    """The engine authenticates no peer: any engine that reaches a receiver's port can write and read its
    registered region at the addresses an Open reply names (a second engine here does both, as in the issue's
    reproduction). Each chunk is copied out of the region as it is checked, then its landing bytes are wiped:
    the foreign write lands but never reaches what is installed, and a foreign read finds zeros."""
    (rx,) = groups(1)
    parts, mla = random_state(1, seed=11, tokens=200)
    spec = make_spec("mc-foreign", parts, mla, 1)
    assert all(isinstance(r, SendResult) for r in _send_all([rx], spec, parts, mla, fast_sender, sender_plane))
    kda_addr, mla_addr = rx.store.addresses(spec.transfer_id)  # verified, not yet installed
    n_kda, n_mla = parts[0].numel() * 4, mla.numel() * mla.element_size()
    foreign, scratch = DataPlane(MC), RegionBuffers(1 << 20, quarantine_s=0.0)
    try:
        foreign.register(scratch)
        buf = scratch.alloc((max(n_kda, n_mla),), torch.uint8)
        engine = foreign._engine
        for addr, n in ((kda_addr, n_kda), (mla_addr, n_mla)):
            buf.fill_(0x5A)
            assert engine.transfer_sync_read(rx.segment, buf.data_ptr(), addr, n) == 0  # reads are not refused
            assert int(buf[:n].count_nonzero()) == 0  # but the state already left the region
            buf.fill_(0xAB)
            assert engine.transfer_sync_write(rx.segment, buf.data_ptr(), addr, n) == 0  # nor are writes
            buf.zero_()
            assert engine.transfer_sync_read(rx.segment, buf.data_ptr(), addr, n) == 0
            assert bool((buf[:n] == 0xAB).all())  # the foreign bytes are in the region
        st = rx.store.take(spec.transfer_id)
        assert torch.equal(st.kda, parts[0]) and torch.equal(st.mla, mla)  # and not in what installs
        rx.store.recycle(st)
    finally:
        foreign.close()
    _assert_nothing_held([rx], sender_plane)


def _crc_preserving_mask(n: int) -> np.ndarray:
    """A non-zero XOR mask of n bytes that keeps any n-byte message's CRC32C: its first byte flipped, and bits of
    its last 4 bytes solved for over GF(2) (CRC32C(x ^ m) = CRC32C(x) ^ CRC32C(m) ^ CRC32C(0^n), linear in m)."""
    from k3serve.transfer.wire import crc32c

    zero = crc32c(bytes(n))

    def delta(mask: np.ndarray) -> int:
        return crc32c(mask.tobytes()) ^ zero

    def bit(j: int) -> np.ndarray:
        m = np.zeros(n, np.uint8)
        m[n - 4 + j // 8] = 1 << (j % 8)
        return m

    basis: dict[int, tuple[int, int]] = {}  # highest set bit -> (crc delta, which tail bits make it)
    for j in range(32):
        v, m = delta(bit(j)), 1 << j
        while v and v.bit_length() - 1 in basis:
            bv, bm = basis[v.bit_length() - 1]
            v, m = v ^ bv, m ^ bm
        if v:
            basis[v.bit_length() - 1] = (v, m)
    mask = np.zeros(n, np.uint8)
    mask[0] = 0xFF
    target, chosen = delta(mask), 0
    while target:
        bv, bm = basis[target.bit_length() - 1]
        target, chosen = target ^ bv, chosen ^ bm
    for j in range(32):
        if chosen >> j & 1:
            mask ^= bit(j)
    assert delta(mask) == 0 and mask.any()
    return mask


class _ForeignRewrite:
    """A LandingTap: in the window between a chunk's landing and its header (before the receiver copies it), a
    foreign engine reads the landed chunk and rewrites it keeping its CRC32C (first attempt, first chunk)."""

    def __init__(self, rx, spec, engine, scratch) -> None:
        self.rx, self.spec, self.engine, self.scratch = rx, spec, engine, scratch
        self.read_back: bytes = b""
        self.crc_kept = False

    def active(self, attempt: int, dst: int) -> bool:
        return attempt == 1

    def landed(self, index, chunk, corrupt, cancel_stream, pause) -> bool:
        from k3serve.transfer.chunks import KDA
        from k3serve.transfer.wire import crc32c

        if index == 0:
            kda_addr, mla_addr = self.rx.store.addresses(self.spec.transfer_id)
            addr, n = (kda_addr if chunk.kind == KDA else mla_addr) + chunk.dst_byte, chunk.length
            buf = self.scratch[:n]
            assert self.engine.transfer_sync_read(self.rx.segment, buf.data_ptr(), addr, n) == 0
            landed = buf.numpy().copy()
            self.read_back = landed.tobytes()  # reads are not refused: the state is readable until the copy
            forged = landed ^ _crc_preserving_mask(n)
            self.crc_kept = crc32c(forged.tobytes()) == crc32c(landed.tobytes()) and (forged != landed).any()
            buf.copy_(torch.from_numpy(forged))
            assert self.engine.transfer_sync_write(self.rx.segment, buf.data_ptr(), addr, n) == 0
        return True


def test_a_foreign_rewrite_before_the_copy_keeping_the_crc_fails_the_chunk_mac(groups, fast_sender, sender_plane):
    """Issue 44 item 4: the landing window. A foreign engine rewrites a chunk in the receiver's registered region
    after it landed and before the receiver decrypts it, keeping its CRC32C: the chunk's AEAD tag (deployment
    secret, chunk_seal.py) fails, the stream is retried, and what installs is the sender's
    state. On main such a rewrite passed the CRC and was installed."""
    (rx,) = groups(1)
    parts, mla = random_state(1, seed=12, tokens=200)
    spec = make_spec("mc-forge", parts, mla, 1)
    foreign, scratch_region = DataPlane(MC), RegionBuffers(1 << 20, quarantine_s=0.0)
    try:
        foreign.register(scratch_region)
        tap = _ForeignRewrite(rx, spec, foreign._engine, scratch_region.alloc((1 << 19,), torch.uint8))
        before = dataclasses.replace(rx.store.counters)
        results = _send_all([rx], spec, parts, mla, fast_sender, sender_plane, tap)
        assert tap.crc_kept and tap.read_back  # the forgery kept the CRC; the read saw the landed bytes
        assert all(isinstance(r, SendResult) for r in results), results
        assert [s.attempts for r in results for s in r.streams] == [2]  # the forged attempt failed
        assert rx.store.counters.mac_failures == before.mac_failures + 1
        assert rx.store.counters.crc_failures == before.crc_failures  # the CRC did not see it
        st = rx.store.take(spec.transfer_id)
        assert torch.equal(st.kda, parts[0]) and torch.equal(st.mla, mla)  # the sender's bytes, not the forgery
        rx.store.recycle(st)
    finally:
        foreign.close()
    _assert_nothing_held([rx], sender_plane)
    assert not sender_plane[1].buffer.any()  # the send region was wiped as each range was released


class _ForeignRead:
    """A LandingTap: as each chunk lands (before the receiver decrypts it), a foreign engine reads it from the
    receiver's registered region, and the sender's registered send region is read directly; each read is searched
    for a 64-byte window of the chunk's plaintext state."""

    def __init__(self, rx, spec, engine, scratch, send_region, plain) -> None:
        self.rx, self.spec, self.engine, self.scratch = rx, spec, engine, scratch
        self.send_region, self.plain = send_region, plain  # plain: kind -> the state's bytes (sender's tensor)
        self.reads, self.found = 0, []

    def active(self, attempt: int, dst: int) -> bool:
        return True

    def landed(self, index, chunk, corrupt, cancel_stream, pause) -> bool:
        from k3serve.transfer.chunks import KDA

        kda_addr, mla_addr = self.rx.store.addresses(self.spec.transfer_id)
        addr, n = (kda_addr if chunk.kind == KDA else mla_addr) + chunk.dst_byte, chunk.length
        buf = self.scratch[:n]
        assert self.engine.transfer_sync_read(self.rx.segment, buf.data_ptr(), addr, n) == 0
        window = self.plain[chunk.kind][chunk.src_byte: chunk.src_byte + 64]
        assert len(set(window)) > 16  # distinctive: random state, not a run of zeros
        for where, data in (("landing", buf.numpy().tobytes()), ("send", self.send_region.buffer.numpy().tobytes())):
            if data.find(window) >= 0:
                self.found.append((where, index))
        self.reads += 1
        return True


def test_a_foreign_read_of_the_registered_regions_finds_no_plaintext(groups, fast_sender, sender_plane):
    """Issue 44: a foreign engine reading the receiver's landing region while chunks wait there, and a read of
    the sender's send region while it is sent, find no 64-byte window of the state: both hold ciphertext only
    (chunk_seal.py). On the branch before, both held the state in plain text. What installs is the state."""
    from k3serve.transfer.wire import byte_view

    (rx,) = groups(1)
    parts, mla = random_state(1, seed=13, tokens=200)
    spec = make_spec("mc-read", parts, mla, 1)
    foreign, scratch_region = DataPlane(MC), RegionBuffers(1 << 20, quarantine_s=0.0)
    try:
        foreign.register(scratch_region)
        plain = {"kda": byte_view(parts[0]).tobytes(), "mla": byte_view(mla).tobytes()}
        tap = _ForeignRead(rx, spec, foreign._engine, scratch_region.alloc((1 << 19,), torch.uint8),
                           sender_plane[1], plain)
        results = _send_all([rx], spec, parts, mla, fast_sender, sender_plane, tap)
        assert all(isinstance(r, SendResult) for r in results), results
        assert tap.reads == len(stream_plan(spec, 0, 0)) and tap.found == []
        st = rx.store.take(spec.transfer_id)
        assert torch.equal(st.kda, parts[0]) and torch.equal(st.mla, mla)
        rx.store.recycle(st)
    finally:
        foreign.close()
    _assert_nothing_held([rx], sender_plane)
