"""The prefill -> decode handoff: the ticket a decode group needs to continue a request.

```
 prefill group ──StateChannel.export──▶ state ref ──┐
                                                    ├─▶ Handoff (ticket) ──▶ DecodeEngine.submit(ticket)
 request metadata (first token, params, timings) ───┘        └─ StateChannel.install(state ref) into the pools
```
What a request's state holds is described once, here: `InlineState` carries the tensors (in-process and
Ray object-store planes); `StagedState` names a verified transfer waiting in every decode rank's staging
(gRPC plane). A feature that adds state (drafter features, quantized pages) adds a field to both and to the
channels in `k3serve/transfer/` that move it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3serve.contracts.sampling import SamplingParams


@dataclass(frozen=True)
class InlineState:
    """A request's state as tensors.

    kda: one tensor per prefill rank, `[L_kda, H/P, block_floats]` fp32 (head-contiguous blocks).
    mla: `[L_mla, num_tokens, D]` latent rows (the same on every prefill rank; rank 0's copy).
    """

    kda: tuple[torch.Tensor, ...]
    mla: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kda) + self.mla.numel() * self.mla.element_size()


@dataclass(frozen=True)
class StagedState:
    """A request's state, verified (CRC32C per chunk + manifest), in every decode rank's transfer staging."""

    transfer_id: str
    nbytes: int = 0


StateRef = InlineState | StagedState


@dataclass(frozen=True)
class Handoff:
    """A prefilled request: the ticket decode submits.

    num_tokens: tokens in the state (the prompt); first_token sits at position num_tokens.
    state: where the state is; None when the first token already ended the request (nothing to install).
    """

    request_id: str
    session_id: str
    prompt_ids: tuple[int, ...]
    first_token: int
    params: SamplingParams
    num_tokens: int
    cached_tokens: int
    state: StateRef | None
    finished: bool = False  # the first token already ended the request (stop token or max_tokens == 1)
    finish_reason: str = ""
    prefill_started_s: float = 0.0
    first_token_s: float = 0.0
    replay: tuple[int, ...] = ()  # PrefillRequest.replay_ids: first_token is replay[0], not a new token

    # convenience views of the state (empty when it is not inline)
    @property
    def kda(self) -> tuple[torch.Tensor, ...]:
        return self.state.kda if isinstance(self.state, InlineState) else ()

    @property
    def mla(self) -> torch.Tensor:
        return self.state.mla if isinstance(self.state, InlineState) else torch.empty(0)

    @property
    def transfer_id(self) -> str:
        return self.state.transfer_id if isinstance(self.state, StagedState) else ""

    def state_bytes(self) -> int:
        return self.state.nbytes if self.state is not None else 0
