"""Sampling parameters and the sampler.

Randomness is keyed by ``(seed, absolute position)``: the token at position p is drawn with a generator seeded
from ``xxh64(seed, p)`` and nothing else, so a request resumed on another cluster, re-prefilled after a
failover, or batched differently draws exactly the same tokens as an uninterrupted single run.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import torch
import xxhash

MAX_TOKENS_LIMIT = 1 << 20


class SamplingError(ValueError):
    """Invalid sampling parameters; the message names the field."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        if not self.temperature >= 0.0:
            raise SamplingError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError(f"sampling.top_k must be >= 0, got {self.top_k}")
        if not 0 < self.max_tokens <= MAX_TOKENS_LIMIT:
            raise SamplingError(f"sampling.max_tokens must be in [1, {MAX_TOKENS_LIMIT}], got {self.max_tokens}")
        if not 0 <= self.seed < 1 << 64:
            raise SamplingError("sampling.seed must fit in 64 bits")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise SamplingError(f"sampling.stop_token_ids has ids outside the vocabulary: {bad[:5]}")


def position_generator(seed: int, position: int) -> torch.Generator:
    """A CPU generator determined by (seed, absolute position) only."""
    key = xxhash.xxh64_intdigest(struct.pack("<QQ", seed & (2**64 - 1), position)) & (2**63 - 1)
    return torch.Generator(device="cpu").manual_seed(key)


def sample_token(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """Pick the token for absolute `position` from logits `[vocab]` (any float dtype)."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    scaled = logits.detach().float().cpu() / params.temperature
    if params.top_k and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token crossing the threshold stays)
        drop = sorted_p.cumsum(-1) - sorted_p >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=position_generator(params.seed, position)).item())


def is_stop(token: int, params: SamplingParams, eos_token_id: int) -> bool:
    return token in params.stop_token_ids or (token == eos_token_id and not params.ignore_eos)
