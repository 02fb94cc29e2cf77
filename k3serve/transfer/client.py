"""Driver-side calls to a decode group's receivers: Status and Cancel (both signed, both with deadlines)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from k3serve.transfer.v1 import transfer_pb2 as pb
from k3serve import tls
from k3serve.auth import AuthConfig, sign
from k3serve.transfer.receiver import CANCEL, STATUS
from k3serve.transfer.wire import STATE_NAMES

UNREACHABLE = "unreachable"


def open_channel(endpoint: str, auth: AuthConfig, max_message_bytes: int = 64 << 20) -> grpc.Channel:
    """A channel to a receiver: mutual TLS when `auth.tls` is set (k3serve/tls.py)."""
    return tls.open_channel(endpoint, auth.tls, options=[
        ("grpc.max_send_message_length", max_message_bytes), ("grpc.max_receive_message_length", 1 << 20),
        ("grpc.enable_retries", 0)])  # retries are ours (sender.py): whole streams, with backoff


@dataclass(frozen=True)
class ReceiverStatus:
    endpoint: str
    state: str  # staging.{RECEIVING, VERIFIED, ...} or UNREACHABLE
    staged_transfers: int
    staged_bytes: int


class ReceiverClient:
    """Status / Cancel on every receiver of a decode group (rank order)."""

    def __init__(self, endpoints: Sequence[str], auth: AuthConfig, timeout_s: float = 5.0) -> None:
        self.endpoints, self._auth, self._timeout = tuple(endpoints), auth, timeout_s
        self._channels = [open_channel(e, auth) for e in self.endpoints]
        self._status = [c.unary_unary(STATUS, pb.StatusRequest.SerializeToString, pb.StatusReply.FromString)
                        for c in self._channels]
        self._cancel = [c.unary_unary(CANCEL, pb.CancelRequest.SerializeToString, pb.CancelAck.FromString)
                        for c in self._channels]

    def status(self, transfer_id: str = "") -> list[ReceiverStatus]:
        out = []
        for ep, call in zip(self.endpoints, self._status):
            try:
                q = pb.StatusRequest(transfer_id=transfer_id)
                r = call(q, timeout=self._timeout, metadata=sign(self._auth, STATUS, transfer_id, q))
                out.append(ReceiverStatus(ep, STATE_NAMES.get(r.state, "unknown"), r.staged_transfers,
                                          r.staged_bytes))
            except grpc.RpcError:
                out.append(ReceiverStatus(ep, UNREACHABLE, 0, 0))
        return out

    def cancel(self, transfer_id: str) -> list[bool | None]:
        """Best effort on every receiver: True freed staging, False had none, None unreachable."""
        out: list[bool | None] = []
        for call in self._cancel:
            try:
                q = pb.CancelRequest(transfer_id=transfer_id)
                out.append(call(q, timeout=self._timeout, metadata=sign(self._auth, CANCEL, transfer_id, q)).freed)
            except grpc.RpcError:
                out.append(None)
        return out

    def verified_everywhere(self, transfer_id: str) -> bool:
        return all(s.state == "verified" for s in self.status(transfer_id))

    def close(self) -> None:
        for c in self._channels:
            c.close()

    def __enter__(self) -> "ReceiverClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
