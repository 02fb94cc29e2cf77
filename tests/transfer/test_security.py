"""Peers authenticate (HMAC over transfer id + timestamp, freshness window); malformed or oversized chunks are
refused with INVALID_ARGUMENT naming the field; receivers bind the configured interface on a free port."""

from __future__ import annotations

import dataclasses
import time

import grpc
import pytest
import torch

from transfer_helpers import make_spec, random_state
from k3serve.auth import AuthConfig, AuthError, sign, verify
from k3serve.transfer.chunks import stream_plan
from k3serve.transfer.client import ReceiverClient, open_channel
from k3serve.transfer.receiver import PUSH, STATUS, ReceiverConfig, TransferReceiver
from k3serve.transfer.v1 import transfer_pb2 as pb
from k3serve.transfer.wire import byte_view, chunk_header, crc32c, encode, encode_chunk, spec_to_pb


def _push(endpoint: str, messages: list[bytes], metadata) -> pb.PushAck:
    with grpc.insecure_channel(endpoint) as ch:
        return ch.stream_unary(PUSH, None, pb.PushAck.FromString)(iter(messages), timeout=10, metadata=metadata)


def _open(spec, src=0, dst=0) -> bytes:
    return encode(pb.PushMessage(open=pb.StreamOpen(spec=spec_to_pb(spec), src_rank=src, dst_rank=dst)))


@pytest.fixture
def setup(receivers):
    parts, mla = random_state(1, seed=1, tokens=200)
    (rx,) = receivers(1, max_chunk_bytes=16384)
    spec = make_spec("sec-1", parts, mla, 1, chunk_bytes=8192)
    return rx, spec, parts[0], mla


def _code(exc_info) -> grpc.StatusCode:
    return exc_info.value.code()


def test_unknown_secret_stale_signature_and_unknown_peer_are_unauthenticated(setup, auth):
    rx, spec, _, _ = setup
    stranger = AuthConfig("x" * 32, peer="test")
    cases = {
        "bad signature": sign(stranger, PUSH, spec.transfer_id),
        "freshness window": sign(auth, PUSH, spec.transfer_id, now=time.time() - 10 * auth.window_s),
        "missing": (),
        "signed for another method": sign(auth, STATUS, spec.transfer_id, pb.StatusRequest()),
    }
    for why, md in cases.items():
        with pytest.raises(grpc.RpcError) as e:
            _push(rx.endpoint, [_open(spec)], md)
        assert _code(e) == grpc.StatusCode.UNAUTHENTICATED, why
    # signed for one transfer, streaming another
    with pytest.raises(grpc.RpcError) as e:
        _push(rx.endpoint, [_open(spec)], sign(auth, PUSH, "other-transfer"))
    assert _code(e) == grpc.StatusCode.UNAUTHENTICATED and "transfer_id" in e.value.details()
    with ReceiverClient([rx.endpoint], stranger) as bad:
        assert bad.status()[0].state == "unreachable"  # rejected
    assert rx.store.occupancy() == (0, 0)


def test_allowed_peers_rejects_unknown_peer(auth):
    cfg = ReceiverConfig(dataclasses.replace(auth, allowed_peers=frozenset({"prefill-0"})))
    with TransferReceiver(cfg) as rx:
        with open_channel(rx.endpoint, auth) as ch:
            status = ch.unary_unary(STATUS, pb.StatusRequest.SerializeToString, pb.StatusReply.FromString)
            with pytest.raises(grpc.RpcError) as e:
                status(pb.StatusRequest(), timeout=5, metadata=sign(auth, STATUS, "", pb.StatusRequest()))
            assert _code(e) == grpc.StatusCode.UNAUTHENTICATED and "unknown peer" in e.value.details()
            ok = status(pb.StatusRequest(), timeout=5,
                        metadata=sign(dataclasses.replace(auth, peer="prefill-0"), STATUS, "", pb.StatusRequest()))
            assert ok.decode_tp == 1


def test_verify_window_and_tampering(auth):
    md = dict(sign(auth, PUSH, "t-1", now=1000.0))
    assert verify(auth, PUSH, md, now=1000.0 + auth.window_s - 1).subject == "t-1"
    with pytest.raises(AuthError, match="freshness"):
        verify(auth, PUSH, md, now=1000.0 + auth.window_s + 1)
    with pytest.raises(AuthError, match="signature"):
        verify(auth, PUSH, {**md, "x-k3serve-subject": "t-2"}, now=1000.0)
    with pytest.raises(ValueError, match="secret"):
        AuthConfig("short")
    assert auth.secret not in repr(auth)


def _chunk_messages(spec, kda, mla, edit=None, payload_edit=None) -> list[bytes]:
    """open + the plan's first chunk (optionally with an edited header or payload)."""
    c = stream_plan(spec, 0, 0)[0]
    payload = byte_view(kda)[c.src_byte: c.src_byte + c.length].tobytes()
    h = chunk_header(spec, c, crc32c(payload))
    if edit:
        edit(h)
    if payload_edit:
        payload = payload_edit(payload)
    return [_open(spec), encode_chunk(h, payload)]


@pytest.mark.parametrize("name,edit,payload_edit,field", [
    ("layer", lambda h: setattr(h, "layer", 99), None, "chunk.layer"),
    ("dtype", lambda h: setattr(h, "dtype", "bfloat16"), None, "chunk.dtype"),
    ("heads", lambda h: setattr(h.heads, "count", 3), None, "chunk.heads"),
    ("kind", lambda h: setattr(h, "kind", pb.KIND_MLA), None, "chunk.kind"),
    ("shape", lambda h: h.shape.append(1), None, "chunk.shape"),
    ("seq", lambda h: setattr(h, "seq", 10_000), None, "chunk.seq"),
    ("transfer id", lambda h: setattr(h, "transfer_id", "another"), None, "chunk.transfer_id"),
    ("short payload", None, lambda p: p[:-1], "payload"),
    ("oversized", lambda h: setattr(h, "length", 20000), lambda p: p * 4, "chunk.length"),
])
def test_malformed_and_oversized_chunks_are_invalid_argument(setup, auth, name, edit, payload_edit, field):
    rx, spec, kda, mla = setup
    with pytest.raises(grpc.RpcError) as e:
        _push(rx.endpoint, _chunk_messages(spec, kda, mla, edit, payload_edit), sign(auth, PUSH, spec.transfer_id))
    assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT, name
    assert field in e.value.details(), e.value.details()


def test_malformed_streams_are_invalid_argument(setup, auth):
    rx, spec, kda, mla = setup
    bad_spec = spec_to_pb(spec)
    bad_spec.decode_tp = 3  # 8 heads over 3 ranks
    cases = {
        "message": [b"\xff\xff\xff"],
        "stream": [encode(pb.PushMessage(manifest=pb.Manifest(transfer_id=spec.transfer_id)))],
        "open.spec": [encode(pb.PushMessage(open=pb.StreamOpen(spec=bad_spec)))],
        "open.dst_rank": [_open(spec, dst=1)],
        "open.src_rank": [_open(spec, src=5)],
        "manifest.num_chunks": [_open(spec), encode(pb.PushMessage(manifest=pb.Manifest(
            transfer_id=spec.transfer_id, num_chunks=1)))],
    }
    for field, msgs in cases.items():
        with pytest.raises(grpc.RpcError) as e:
            _push(rx.endpoint, msgs, sign(auth, PUSH, spec.transfer_id))
        assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details(), (field, e.value)
    with pytest.raises(grpc.RpcError) as e:  # clean end of stream without a manifest
        _push(rx.endpoint, [_open(spec)], sign(auth, PUSH, spec.transfer_id))
    assert _code(e) == grpc.StatusCode.ABORTED
    rx.store.cancel(spec.transfer_id)
    assert rx.store.occupancy() == (0, 0)


def test_receivers_bind_the_configured_interface_on_free_ports(auth):
    with TransferReceiver(ReceiverConfig(auth)) as a, TransferReceiver(ReceiverConfig(auth)) as b:
        assert a.endpoint.startswith("127.0.0.1:") and a.port > 0 and a.port != b.port
    with pytest.raises(ValueError):
        TransferReceiver(ReceiverConfig(auth, rank=2, tp=2))


def test_a_nan_timestamp_never_verifies(auth):
    md = dict(sign(auth, PUSH, "t-nan", now=float("nan")))
    assert md["x-k3serve-ts"] == "nan"  # correctly MAC'd: only the freshness rule can refuse it
    with pytest.raises(AuthError, match="finite"):
        verify(auth, PUSH, md)
    with pytest.raises(AuthError, match="finite"):
        verify(auth, PUSH, {**md, "x-k3serve-ts": "inf"})


def test_a_captured_call_cannot_be_replayed_or_carry_another_body(auth):
    """The MAC covers the request's bytes and a single-use nonce: the same metadata twice is refused, and so is
    a signature for one request sent with another (same method, same subject)."""
    from k3serve.transfer.receiver import CANCEL, OPEN

    with TransferReceiver(ReceiverConfig(auth)) as rx, open_channel(rx.endpoint, auth) as ch:
        cancel = ch.unary_unary(CANCEL, pb.CancelRequest.SerializeToString, pb.CancelAck.FromString)
        req = pb.CancelRequest(transfer_id="t-replay")
        md = sign(auth, CANCEL, "t-replay", req)
        assert cancel(req, timeout=5, metadata=md).transfer_id == "t-replay"
        with pytest.raises(grpc.RpcError) as e:
            cancel(req, timeout=5, metadata=md)
        assert _code(e) == grpc.StatusCode.UNAUTHENTICATED and "replayed" in e.value.details()

        opener = ch.unary_unary(OPEN, pb.StreamOpen.SerializeToString, pb.OpenReply.FromString)
        parts, mla = random_state(1, seed=2, tokens=40)
        spec = spec_to_pb(make_spec("t-body", parts, mla, 1))
        signed, sent = pb.StreamOpen(spec=spec, attempt=0), pb.StreamOpen(spec=spec, attempt=7)
        with pytest.raises(grpc.RpcError) as e:
            opener(sent, timeout=5, metadata=sign(auth, OPEN, "t-body", signed))
        assert _code(e) == grpc.StatusCode.UNAUTHENTICATED and "body" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # the signed body itself passes auth (this receiver has no plane)
            opener(signed, timeout=5, metadata=sign(auth, OPEN, "t-body", signed))
        assert _code(e) == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as e:  # a unary call signed as a stream
            opener(signed, timeout=5, metadata=sign(auth, OPEN, "t-body"))
        assert _code(e) == grpc.StatusCode.UNAUTHENTICATED


def test_the_nonce_log_forgets_only_after_the_window():
    from k3serve.auth import NonceLog

    log = NonceLog(window_s=10.0)
    assert log.accept("a" * 32, ts=100.0, now=100.0)
    assert not log.accept("a" * 32, ts=100.0, now=105.0)
    assert log.accept("b" * 32, ts=100.0, now=111.0) and len(log) == 1  # "a" expired: its ts fails the window


def test_internal_tls_refuses_plain_text_and_another_ca(auth):
    """With the deployment's certificates (k3serve/tls.py) a receiver speaks mutual TLS only: a signed call over
    plain text, or over TLS with another CA's certificate, fails the handshake (UNAVAILABLE); one with the
    deployment's certificate passes. A sender under the same certificates streams a whole transfer."""
    from k3serve.tls import generate

    mine = dataclasses.replace(auth, tls=generate())
    others = dataclasses.replace(auth, tls=generate())
    q = pb.StatusRequest()
    with TransferReceiver(ReceiverConfig(mine)) as rx:
        for name, cfg, channel in (("plain text", auth, grpc.insecure_channel(rx.endpoint)),
                                   ("another CA", others, open_channel(rx.endpoint, others)),
                                   ("this CA", mine, open_channel(rx.endpoint, mine))):
            with channel as ch:
                status = ch.unary_unary(STATUS, pb.StatusRequest.SerializeToString, pb.StatusReply.FromString)
                if name == "this CA":
                    assert status(q, timeout=5, metadata=sign(cfg, STATUS, "", q)).decode_tp == 1
                    continue
                with pytest.raises(grpc.RpcError) as e:
                    status(q, timeout=5, metadata=sign(cfg, STATUS, "", q))
                assert _code(e) == grpc.StatusCode.UNAVAILABLE, (name, e.value.details())
        with ReceiverClient([rx.endpoint], others) as stranger, ReceiverClient([rx.endpoint], mine) as peer:
            assert stranger.status()[0].state == "unreachable" and peer.status()[0].state != "unreachable"
        from transfer_helpers import send_all

        from k3serve.transfer.sender import SendResult, SenderConfig, TransferSender

        parts, mla = random_state(1, seed=3, tokens=100)
        spec = make_spec("tls-1", parts, mla, 1, chunk_bytes=8192)
        (result,) = send_all(lambda r: TransferSender(r, [rx.endpoint], SenderConfig(mine)), spec, parts, mla)
        assert isinstance(result, SendResult), result
        st = rx.store.take(spec.transfer_id)
        assert torch.equal(st.kda, parts[0]) and torch.equal(st.mla, mla)
