"""The committed generated code is current, and the hand-framed payload is plain protobuf."""

from __future__ import annotations

from pathlib import Path

import torch

from k3serve.proto.gen import REPO_ROOT, generate
from k3serve.transfer.v1 import transfer_pb2 as pb
from k3serve.transfer.wire import byte_view, decode, encode_chunk

GENERATED = ("transfer_pb2.py", "transfer_pb2.pyi", "transfer_pb2_grpc.py")


def test_generated_transfer_code_is_current(tmp_path):
    generate(tmp_path)
    for name in GENERATED:
        rel = Path("k3serve/transfer/v1") / name
        fresh, committed = tmp_path / rel, REPO_ROOT / rel
        assert fresh.exists(), f"{rel} is no longer generated"
        assert committed.read_bytes() == fresh.read_bytes(), f"{rel} is stale: run scripts/gen_proto.sh"


def test_generated_code_imports_under_the_package_path():
    assert pb.DESCRIPTOR.package == "k3serve.transfer.v1"
    assert pb.DESCRIPTOR.name == "k3serve/transfer/v1/transfer.proto"
    assert set(pb.DESCRIPTOR.services_by_name["Transfer"].methods_by_name) == {"Push", "Cancel", "Status", "Open"}


def test_hand_framed_payload_parses_as_protobuf_and_back():
    t = torch.randn(300, dtype=torch.bfloat16)
    payload = byte_view(t)[10:410]
    header = pb.ChunkHeader(transfer_id="t", layer=2, kind=pb.KIND_MLA, length=400, crc32c=7)
    header.tokens.start, header.tokens.count = 5, 1
    data = encode_chunk(header, payload)
    std = pb.PushMessage.FromString(data)  # any protobuf parser reads it
    assert std.chunk == header and std.payload == payload.tobytes()
    msg, view = decode(data)
    assert msg.chunk == header and bytes(view) == payload.tobytes() and msg.payload == b""
    msg2, view2 = decode(pb.PushMessage(chunk=header, payload=b"xyz").SerializeToString())  # and the reverse
    assert msg2.chunk == header and bytes(view2) == b"xyz"
