"""Sampling parameters: the one representation, from the public proto to the sampler.

`SamplingParams` is what the router validates, what crosses router -> cluster -> prefill -> decode, and what the
sampler (`model/sampling.py`) reads. The public proto (`k3serve.v1.SamplingParams`) is converted here and only
here, in both directions.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

MAX_TOKENS_LIMIT = 1 << 20
# Every stop id is compared with every sampled token of the request, on the engine thread that serves the whole
# batch: an unbounded list slows everyone (4M ids cost ~39 ms per token). vLLM-style usage needs a handful.
MAX_STOP_TOKEN_IDS = 64
# Bytes of the public GenerateRequest.cache_salt (it is hashed, never stored; a bound keeps the hash cheap).
MAX_CACHE_SALT_BYTES = 256
# A temperature below this is greedy (argmax, the T -> 0 limit), as vLLM's _SAMPLING_EPS: dividing fp32 logits by
# 1e-40 overflows to inf and the softmax to NaN, while at 1e-5 a logit gap of 1e-3 already gives odds of e^-100.
GREEDY_BELOW_TEMPERATURE = 1e-5


class SamplingError(ValueError):
    """Invalid sampling parameters; the message names the field."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # below GREEDY_BELOW_TEMPERATURE (0 included) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: bool = False  # stream each token's model log-probability (raw logits, before temperature/top-k/p)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    def validate(self, vocab_size: int | None = None) -> None:
        if not 0.0 <= self.temperature < float("inf"):
            raise SamplingError(f"sampling.temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError(f"sampling.top_k must be >= 0, got {self.top_k}")
        if not 0 < self.max_tokens <= MAX_TOKENS_LIMIT:
            raise SamplingError(f"sampling.max_tokens must be in [1, {MAX_TOKENS_LIMIT}], got {self.max_tokens}")
        if not 0 <= self.seed < 1 << 64:
            raise SamplingError("sampling.seed must fit in 64 bits")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingError(f"sampling.stop_token_ids has {len(self.stop_token_ids)} ids; at most "
                                f"{MAX_STOP_TOKEN_IDS} are allowed")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise SamplingError(f"sampling.stop_token_ids has ids outside the vocabulary: {bad[:5]}")

    def with_max_tokens(self, max_tokens: int) -> "SamplingParams":
        """The same parameters with another token budget (a resumed request's remaining budget)."""
        return replace(self, max_tokens=max_tokens)

    # ------------------------------------------------------------------------------------------- wire
    @classmethod
    def from_proto(cls, msg) -> "SamplingParams":
        """From a `k3serve.v1.SamplingParams` message. proto3 has no presence: top_p = 0 means unset (1.0).

        No validation here (the router validates public input; clusters validate what they run)."""
        return cls(temperature=float(msg.temperature), top_p=float(msg.top_p) or 1.0, top_k=int(msg.top_k),
                   seed=int(msg.seed), max_tokens=int(msg.max_tokens), stop_token_ids=tuple(msg.stop_token_ids),
                   ignore_eos=bool(msg.ignore_eos), logprobs=bool(msg.logprobs))

    def to_proto(self):
        """As a `k3serve.v1.SamplingParams` message."""
        from k3serve.v1 import router_pb2

        return router_pb2.SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                         seed=self.seed, max_tokens=self.max_tokens,
                                         stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos,
                                         logprobs=self.logprobs)
