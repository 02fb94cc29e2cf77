"""CRC32C and placement beside grpcio's threads (sender CRC workers, receiver placement workers): the same bytes,
the same checks and error codes as inline; copy_crc32c against its two-pass reference."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch

from k3serve.auth import sign
from k3serve.transfer.copy_crc import copy_crc32c
from k3serve.transfer.placer import StreamPlacer
from k3serve.transfer.plan import reshard_kda
from k3serve.transfer.receiver import PUSH, ReceiverConfig, TransferReceiver
from k3serve.transfer.sender import SendResult, TransferSender
from k3serve.transfer.staging import StagingLimits, TransferRejected
from k3serve.transfer.v1 import transfer_pb2 as pb
from k3serve.transfer.wire import byte_view, chunk_header, crc32c, encode, encode_chunk, spec_to_pb
from k3serve.transfer.chunks import stream_plan
from tests.transfer.transfer_helpers import make_spec, random_state, send_all


@pytest.mark.parametrize("n,block", [(0, 512), (1, 512), (4096, 512), (100_003, 4096), (1 << 20, 512 << 10)])
def test_copy_crc32c_is_a_copy_and_the_crc_of_the_copy(n, block):
    src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    dst = np.zeros(n, dtype=np.uint8)
    assert copy_crc32c(dst, memoryview(src), block) == crc32c(src)  # the two-pass reference
    assert dst.tobytes() == src


def test_copy_crc32c_refuses_a_size_mismatch():
    with pytest.raises(ValueError, match="source bytes"):
        copy_crc32c(np.zeros(8, dtype=np.uint8), b"123")
    with pytest.raises(ValueError, match="block"):
        copy_crc32c(np.zeros(3, dtype=np.uint8), b"123", block=0)


def test_placer_bounds_chunks_in_flight_and_raises_a_placement_error():
    gate, running, peak = threading.Event(), [], [0]
    lock = threading.Lock()

    def place(ok: bool = True):
        with lock:
            running.append(1)
            peak[0] = max(peak[0], len(running))
        gate.wait(5)
        with lock:
            running.pop()
        if not ok:
            raise TransferRejected("DATA_LOSS", "bad chunk")
        return True

    with ThreadPoolExecutor(8) as pool:
        placer = StreamPlacer(pool, depth=2)
        threading.Timer(0.2, gate.set).start()
        for _ in range(5):
            placer.submit(place)
        assert placer.drain() == 5 and peak[0] <= 2
        placer.submit(lambda: place(False))
        with pytest.raises(TransferRejected, match="bad chunk"):
            placer.drain()
        inline = StreamPlacer(pool, depth=0)  # depth 0: in the caller's thread
        inline.submit(lambda: threading.current_thread() is threading.main_thread())
        assert inline.drain() == 1
    with pytest.raises(ValueError):
        StreamPlacer(pool, depth=-1)


@pytest.mark.parametrize("crc_ahead,depth", [(True, 2), (False, 0), (True, 0), (False, 1)])
def test_overlap_and_inline_stage_identical_bytes(auth, fast_sender, crc_ahead, depth):
    parts, mla = random_state(2, tokens=900)
    spec = make_spec(f"ov-{crc_ahead}-{depth}", parts, mla, 2, chunk_bytes=8192)
    cfg = dataclasses.replace(fast_sender, crc_ahead=crc_ahead)
    rx = [TransferReceiver(dataclasses.replace(ReceiverConfig(auth), place_depth=depth).for_rank(r, 2))
          for r in range(2)]
    try:
        eps = [r.endpoint for r in rx]
        out = send_all(lambda r: TransferSender(r, eps, cfg), spec, parts, mla)
        assert all(isinstance(o, SendResult) for o in out), out
        assert set().union(*(o.verified_ranks for o in out)) == {0, 1}
        for r, want in zip(rx, reshard_kda(parts, 2)):
            st = r.store.take(spec.transfer_id)
            assert torch.equal(st.kda, want) and torch.equal(st.mla, mla)
            r.store.recycle(st)
        assert sum(o.crc_s for o in out) > 0  # the CRC time is counted wherever it ran
    finally:
        for r in rx:
            r.stop(0)


def test_a_corrupt_chunk_behind_placement_workers_is_data_loss_and_never_verifies(auth):
    parts, mla = random_state(1, tokens=300)
    spec = make_spec("ov-corrupt", parts, mla, 1, chunk_bytes=8192)
    rx = TransferReceiver(ReceiverConfig(auth, limits=StagingLimits()))
    try:
        views = {"kda": byte_view(parts[0]), "mla": byte_view(mla)}

        def messages():
            yield encode(pb.PushMessage(open=pb.StreamOpen(spec=spec_to_pb(spec), src_rank=0, dst_rank=0)))
            for i, c in enumerate(stream_plan(spec, 0, 0)):
                payload = bytearray(views[c.kind][c.src_byte: c.src_byte + c.length].tobytes())
                crc = crc32c(bytes(payload))
                if i == 1:
                    payload[7] ^= 0xFF  # a bad wire: the header's CRC is the source's
                yield encode_chunk(chunk_header(spec, c, crc), bytes(payload))

        call = grpc.insecure_channel(rx.endpoint).stream_unary(PUSH, None, pb.PushAck.FromString)
        with pytest.raises(grpc.RpcError) as e:
            call(messages(), metadata=sign(auth, PUSH, spec.transfer_id), timeout=10)
        assert e.value.code() == grpc.StatusCode.DATA_LOSS
        assert rx.store.counters.crc_failures == 1 and rx.store.status(spec.transfer_id) == "receiving"
    finally:
        rx.stop(0)
