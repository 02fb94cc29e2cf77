"""The prefill side of a handoff over gRPC, as one worker op.

Each prefill rank runs ``SendState`` on its own worker: it reads its KDA heads and the MLA rows of the request
straight from its pools and streams its share (plan.py) to the decode group's receivers. The op returns a
:class:`SendOutcome` instead of raising, so a failed transfer fails one request, not the prefill group.

```
 PrefillEngine._finish ──SendState(slot, pages, n, job)──▶ every prefill rank r
        ◀── SendOutcome(verified decode ranks | error) ───┘   (sender r -> receivers, CRC + manifest)
 DecodeEngine.submit_staged(handoff, transfer_id) ──InstallStaged──▶ decode ranks (verified staging only)
```
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import xxhash

from k3serve.auth import AuthConfig
from k3serve.transfer.client import ReceiverClient
from k3serve.transfer.sender import SenderConfig, TransferFailed, TransferSender
from k3serve.transfer.spec import StateGeometry, TransferSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StateSendJob:
    """What a prefill rank needs to send one request's state (the same on every rank)."""

    spec: TransferSpec
    endpoints: tuple[str, ...]
    config: SenderConfig
    timeout_s: float = 120.0


@dataclass(frozen=True)
class SendOutcome:
    transfer_id: str
    src_rank: int
    verified_ranks: tuple[int, ...] = ()
    bytes_sent: int = 0
    error: str = ""


class SenderCache:
    """A prefill rank's senders, one per (decode endpoints, sender config), kept across requests.

    A sender holds one gRPC channel (one HTTP/2 connection) per decode rank; building it per request took a
    200-token tiny-preset transfer on loopback from ~7 ms to ~11 ms. Channels reconnect on their own after a
    receiver restarts, so a cached sender stays usable; ``close()`` drops them all."""

    def __init__(self) -> None:
        self._senders: dict[tuple, TransferSender] = {}

    def get(self, rank: int, endpoints: tuple[str, ...], config: SenderConfig) -> TransferSender:
        key = (rank, endpoints, config)
        sender = self._senders.get(key)
        if sender is None:
            sender = self._senders[key] = TransferSender(rank, endpoints, config)
        return sender

    def __len__(self) -> int:
        return len(self._senders)

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()


def send_state(job: StateSendJob, rank: int, kda, mla, senders: SenderCache | None = None) -> SendOutcome:
    """Stream this rank's share; kda `[L_kda, H/P, block]` fp32, mla `[L_mla, n, D]` (contiguous copies).

    senders: where to keep this rank's channels between requests (None: a sender for this call only)."""
    own = senders is None
    sender = TransferSender(rank, job.endpoints, job.config) if own else senders.get(rank, job.endpoints,
                                                                                         job.config)
    try:
        res = sender.send(job.spec, kda, mla, timeout=job.timeout_s)
        return SendOutcome(job.spec.transfer_id, rank, tuple(sorted(res.verified_ranks)), res.bytes_sent)
    except TransferFailed as e:
        return SendOutcome(job.spec.transfer_id, rank, error=f"{e.code}: {e}")
    finally:
        if own:
            sender.close()


class GrpcHandoff:
    """A prefill group's view of its decode group's receivers: makes send jobs, cancels transfers."""

    def __init__(self, cluster_id: str, cfg, endpoints: tuple[str, ...], secret: str, prefill_tp: int,
                 decode_tp: int, page_size: int, chunk_bytes: int = 1 << 20) -> None:
        self.cfg, self.endpoints = cfg, endpoints
        self.prefill_tp, self.decode_tp, self.page_size, self.chunk_bytes = prefill_tp, decode_tp, page_size, chunk_bytes
        self.auth = AuthConfig(secret, peer=f"prefill-{cluster_id}")
        self.client = ReceiverClient(endpoints, self.auth)
        self._ids = itertools.count()
        self._tag = cluster_id

    def job(self, request_id: str, num_tokens: int) -> StateSendJob:
        # transfer ids are fresh per attempt: a cancelled id is dead for good on the receivers
        tid = f"{self._tag}-{xxhash.xxh64_hexdigest(request_id.encode())}-{next(self._ids)}"
        spec = TransferSpec(tid, tid, StateGeometry.of_config(self.cfg, num_tokens), self.prefill_tp,
                            self.decode_tp, page_tokens=self.page_size, chunk_bytes=self.chunk_bytes)
        return StateSendJob(spec, self.endpoints, SenderConfig(self.auth))

    def cancel(self, transfer_id: str) -> None:
        """Free the transfer's staging on every decode rank (best effort: the client never raises)."""
        freed = self.client.cancel(transfer_id)
        if None in freed:  # receivers expire abandoned transfers on their own; say which did not answer
            log.info("cancel of transfer %s: %d of %d receivers unreachable (staging expires)", transfer_id,
                     freed.count(None), len(freed))
