"""The prefill -> decode handoff: everything a decode group needs to continue a request."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3serve.contracts.sampling import SamplingParams


@dataclass(frozen=True)
class Handoff:
    """A prefilled request.

    kda: one tensor per prefill rank, `[L_kda, H/P, block_floats]` fp32 (head-contiguous blocks).
    mla: `[L_mla, num_tokens, D]` latent rows (the same on every prefill rank; rank 0's copy).
    num_tokens: tokens in the state (the prompt); first_token sits at position num_tokens.
    """

    request_id: str
    session_id: str
    prompt_ids: tuple[int, ...]
    first_token: int
    params: SamplingParams
    num_tokens: int
    cached_tokens: int
    kda: tuple[torch.Tensor, ...]
    mla: torch.Tensor
    finished: bool = False  # the first token already ended the request (stop token or max_tokens == 1)
    finish_reason: str = ""
    prefill_started_s: float = 0.0
    first_token_s: float = 0.0
    transfer_id: str = ""  # set when the state went over k3serve.transfer (kda/mla are then empty)

    @property
    def prefill_tp(self) -> int:
        return len(self.kda)

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kda) + self.mla.numel() * self.mla.element_size()
