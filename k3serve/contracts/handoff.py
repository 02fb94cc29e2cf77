"""The prefill -> decode handoff: the ticket a decode group needs to continue a request.

```
 prefill group ──StateChannel.export──▶ state ref ──┐
                                                    ├─▶ Handoff (ticket) ──▶ DecodeEngine.submit(ticket)
 request metadata (first token, params, timings) ───┘        └─ StateChannel.install(state ref) into the pools
```
What a request's state holds is described once, here: `InlineState` carries the tensors (in-process and
Ray object-store planes); `StagedState` names a verified transfer waiting in every decode rank's staging
(gRPC and Mooncake planes). A feature that adds state to the decode ranks (quantized pages) adds a field to both
and to the channels in `k3serve/transfer/` that move it; drafter features (`DraftFeatures`) are consumed beside
the decode engine, not on its ranks, so they ride on the ticket itself, whichever channel moves the rest.
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
class DraftCapture:
    """What a feature-reading drafter (EAGLE-3) asks of prefill: these layers' hidden states (capture keys of
    ``ForwardBatch.capture_layers``; ``L`` = the final hidden state) for the prompt's last `rows` positions."""

    layers: tuple[int, ...]
    rows: int

    def __post_init__(self) -> None:
        if not self.layers or self.rows < 1:
            raise ValueError(f"DraftCapture needs layers and rows >= 1, got {self.layers}, {self.rows}")


@dataclass(frozen=True)
class DraftFeatures:
    """The drafter's share of a request's decode state, made by prefill, carried by the Handoff ticket.

    Rows are prompt positions start .. start+m-1 (m <= DraftCapture.rows; fewer when a prefix-cache hit skipped
    the earlier ones). next_tokens[i]: the token after position start+i (the last one is the first token).
    features: layer -> `[m, d]` fp32 hidden states of those positions.

    It rides on the ticket, not in the rank-to-rank transfer: the drafter runs beside the decode engine (where
    tickets are submitted), never on the decode ranks the state channel writes to, and the rows come back to
    the prefill engine with the last chunk's logits (the same path the first token takes).
    """

    start: int
    next_tokens: tuple[int, ...]
    features: dict[int, torch.Tensor]

    def __post_init__(self) -> None:
        m = len(self.next_tokens)
        for layer, t in self.features.items():
            if t.dim() != 2 or t.shape[0] != m:
                raise ValueError(f"DraftFeatures.features[{layer}] must be [{m}, d], got {tuple(t.shape)}")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.features.values()) + 8 * len(self.next_tokens)


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
    draft: DraftFeatures | None = None  # the drafter's start state (PrefillConfig.draft_capture), else None
    replay: tuple[int, ...] = ()  # PrefillRequest.replay_ids: first_token is replay[0], not a new token
    first_logprob: float | None = None  # with params.logprobs (and no replay): first_token's log-probability

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
