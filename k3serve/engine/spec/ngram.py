"""The n-gram (prompt lookup) drafter: no weights; it proposes what followed the last earlier occurrence of the
context's suffix. Strong on agentic and code traffic, which quotes its own context (tool output, code edits).

For n from ``max_n`` down to ``min_n``: if the context's last n tokens occurred earlier (ending at j < L), the
draft is ``context[j : j + k]`` (what followed; past the context's end the repetition continues with period
L - j); the most recent occurrence wins. The
session keeps, per n, a map n-gram -> latest end j, extended incrementally as the context grows (O(max_n) work
per new token, no rescans).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from k3serve.engine.spec.drafter import DraftProposal, VerifyOutcome


@dataclass(frozen=True)
class NgramConfig:
    min_n: int = 2
    max_n: int = 5

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"ngram drafter: need 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")


class NgramSession:
    """Per-request index: for each n, the latest end (exclusive) of every n-gram that has a continuation."""

    def __init__(self, config: NgramConfig) -> None:
        self.config = config
        self._tokens: list[int] = []
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(config.min_n, config.max_n + 1)}

    def _extend(self, context: Sequence[int]) -> None:
        have = len(self._tokens)
        if len(context) < have or (have and context[have - 1] != self._tokens[-1]):
            # not an extension of what was indexed (cheap check on the last indexed token): rebuild
            self._tokens, self._index = [], {n: {} for n in self._index}
            have = 0
        self._tokens.extend(context[have:])
        toks = self._tokens
        # an n-gram ending at e (exclusive) is indexed once a token follows it, i.e. for e <= L - 1
        for e in range(max(1, have), len(toks)):
            for n, table in self._index.items():
                if e >= n:
                    table[tuple(toks[e - n: e])] = e

    def propose(self, context: Sequence[int], k: int) -> DraftProposal:
        self._extend(context)
        toks, length = self._tokens, len(self._tokens)
        if k <= 0:
            return DraftProposal()
        for n in range(self.config.max_n, self.config.min_n - 1, -1):
            if length < n + 1:
                continue
            end = self._index[n].get(tuple(toks[length - n:]))
            if end is not None:
                # what followed the match; where that runs into the context's end, the drafts continue the
                # repetition they are part of (period length - end): x_{L+i} = context[end + i mod period]
                period = length - end
                return DraftProposal(tuple(toks[end + i % period] for i in range(k)))
        return DraftProposal()

    def observe(self, outcome: VerifyOutcome) -> None:
        pass  # the next propose() indexes the new tokens from its context

    def close(self) -> None:
        self._tokens, self._index = [], {}


class NgramDrafter:
    name = "ngram"
    feature_layers: tuple[int, ...] = ()
    capture = None  # reads only tokens: prefill captures nothing for it

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config or NgramConfig()

    def open(self, request_id: str, prompt_ids: Sequence[int], draft=None) -> NgramSession:
        session = NgramSession(self.config)
        session._extend(prompt_ids)
        return session
