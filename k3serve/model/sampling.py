"""The sampler (parameters: `k3serve.contracts.sampling.SamplingParams`).

Randomness is keyed by ``(seed, absolute position)``: the token at position p is drawn with a generator seeded
from ``xxh64(seed, p)`` and nothing else, so a request resumed on another cluster, re-prefilled after a
failover, or batched differently draws exactly the same tokens as an uninterrupted single run.
"""

from __future__ import annotations

import struct

import torch
import xxhash

from k3serve.contracts.sampling import SamplingParams


def position_generator(seed: int, position: int) -> torch.Generator:
    """A CPU generator determined by (seed, absolute position) only."""
    key = xxhash.xxh64_intdigest(struct.pack("<QQ", seed & (2**64 - 1), position)) & (2**63 - 1)
    return torch.Generator(device="cpu").manual_seed(key)


def sample_token(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """Pick the token for absolute `position` from logits `[vocab]` (any float dtype)."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    probs = sampling_probs(logits, params)
    return int(torch.multinomial(probs, 1, generator=position_generator(params.seed, position)).item())


def token_logprob(logits: torch.Tensor, token: int) -> float:
    """The model's log-probability of `token` under logits `[vocab]`: log-softmax of the raw logits, before
    temperature, top-k and top-p (what SamplingParams.logprobs streams; comparable across sampling settings)."""
    return float(torch.log_softmax(logits.detach().float().cpu(), -1)[token])


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy `params` samples from: logits `[vocab]` -> probs `[vocab]` fp32 (CPU),
    after temperature, top-k and top-p (the speculative acceptance rule compares drafts against it)."""
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
    return probs


def is_stop(token: int, params: SamplingParams, eos_token_id: int) -> bool:
    return token in params.stop_token_ids or (token == eos_token_id and not params.ignore_eos)
