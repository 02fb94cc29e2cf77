"""Layer-wise export on the Mooncake plane (WorkerHooks.begin_send of a Mooncake prefill rank).

```
 worker (PrefillStreamed): kda [L_kda, H/P, block], mla [L_mla, n, D] host buffers, filled layer by layer
 begin_send: region kda / mla = ranges of the registered send region (same shapes); LandingSession over them
 layer_ready(kind, i): session.layer_ready(kind, i): that layer's chunks are encrypted from host[i] into
                       region[i] (chunk_seal.py) and written by the engine while later layers compute
 finish / abort: the session's outcome; the region ranges are released once no write reads them
```
The engine reads only registered memory, and any engine peer can read it, so the worker's host buffers are
encrypted into the send region per chunk once their layer is ready; a ready layer is final (nothing later in the
forward writes it), so the bytes are those ExportState returns after the forward, as on the gRPC plane.
"""

from __future__ import annotations

import torch

from k3serve.transfer.handoff_send import SendOutcome, SenderCache, StateSendJob
from k3serve.transfer.mooncake.sender import MooncakeSender
from k3serve.transfer.sender import TransferFailed


class RegionStreamedSend:
    """One rank's layer-wise send over Mooncake: the worker's LayerSend (layer_ready / abort / finish)."""

    def __init__(self, job: StateSendJob, rank: int, sender: MooncakeSender, kda: torch.Tensor,
                 mla: torch.Tensor) -> None:
        """kda `[L_kda, H/P, block]` fp32 and mla `[L_mla, n, D]`: the worker's buffers, filled layer by layer."""
        self.job, self.rank, self.sender = job, rank, sender
        self._host = {"kda": kda, "mla": mla}
        self._region: dict[str, torch.Tensor] = {}
        try:
            for name, t in self._host.items():
                out = sender.region.alloc(tuple(t.shape), t.dtype)
                if out is None:
                    raise TransferFailed(job.spec.transfer_id, "RESOURCE_EXHAUSTED", "send region full: no room "
                                         f"for {t.numel() * t.element_size()} bytes of {name} (mooncake.send_bytes "
                                         f"{sender.region.size})")
                self._region[name] = out
            # the region ranges receive only ciphertext, encrypted from the host buffers chunk by chunk
            self.session = sender.begin(job.spec, self._region["kda"], self._region["mla"], (kda, mla))
        except BaseException:
            self._release()
            raise

    def layer_ready(self, kind: str, layer: int) -> None:
        self.session.layer_ready(kind, layer)

    def abort(self, reason: str) -> None:
        try:
            self.session.abort(reason)
        finally:
            self._release()

    def finish(self) -> SendOutcome:
        tid = self.job.spec.transfer_id
        try:
            res = self.session.finish(self.job.timeout_s)
            return SendOutcome(tid, self.rank, tuple(sorted(res.verified_ranks)), res.bytes_sent)
        except TransferFailed as e:
            return SendOutcome(tid, self.rank, error=f"{e.code}: {e}")
        finally:
            self._release()

    def _release(self) -> None:
        for t in self._region.values():  # our own ranges: the engine reads them only inside a session's writes
            self.sender.region.release(t.zero_(), False)  # ciphertext, wiped all the same
        self._region = {}


def begin_send(job: StateSendJob, rank: int, kda: torch.Tensor, mla: torch.Tensor,
               senders: SenderCache) -> RegionStreamedSend:
    """Start a layer-wise send of this rank's share through its cached MooncakeSender."""
    sender = senders.get(rank, job.endpoints, job.config)
    return RegionStreamedSend(job, rank, sender, kda, mla)
