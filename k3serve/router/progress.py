"""How long requests take: each stream's own progress, and a learned model of durations (the retry-after source).

A retry hint is honest when it says when the budget that refused a request will have room again, i.e. when
the requests holding it are expected to finish. Each admitted request publishes its expected end (Redis
``adm:...:end``, see admission.py), computed here from

* before its first token: the class's learned time to first token, plus ``max_tokens`` x the learned time per
  output token;
* once streaming: the tokens it still may produce x its own measured rate (the learned rate until it has a few
  tokens), which tracks the real load on its cluster.

``max_tokens`` is an upper bound (a stop token ends a request early), so hints err towards waiting longer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

_OWN_RATE_AFTER = 4  # tokens of its own before a stream's measured rate replaces the learned one


@dataclass(frozen=True)
class DurationPriors:
    """What the model assumes before it has seen a request finish (and how fast it forgets: EWMA weight)."""

    ttft_s: float = 0.5
    tpot_s: float = 0.05
    weight: float = 0.2


class DurationModel:
    """Learned time to first token (per request class) and time per output token (per router). Thread-safe."""

    def __init__(self, priors: DurationPriors = DurationPriors()) -> None:
        self.priors = priors
        self._lock = threading.Lock()
        self._ttft: dict[str, float] = {}
        self._tpot = priors.tpot_s

    def ttft_s(self, cls: str) -> float:
        with self._lock:
            return self._ttft.get(cls, self.priors.ttft_s)

    def tpot_s(self) -> float:
        with self._lock:
            return self._tpot

    def expected_s(self, cls: str, max_tokens: int) -> float:
        """Expected duration of a request of ``cls`` that may produce ``max_tokens`` tokens."""
        return self.ttft_s(cls) + max(max_tokens - 1, 0) * self.tpot_s()

    def observe(self, cls: str, ttft_s: float, tokens: int, total_s: float) -> None:
        """A finished stream: its time to first token and, over ``tokens`` outputs, its total time."""
        w = self.priors.weight
        with self._lock:
            self._ttft[cls] = (1 - w) * self._ttft.get(cls, ttft_s) + w * ttft_s
            if tokens > 1:
                self._tpot = (1 - w) * self._tpot + w * (total_s - ttft_s) / (tokens - 1)


class StreamProgress:
    """One client request's progress: tokens streamed (across failovers) and when.

    Written by the request's handler thread, read by the lease renewer and the liveness watchdog; each field is
    one assignment of an immutable value, so readers never see a torn update."""

    def __init__(self, cls: str, max_tokens: int, model: DurationModel,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cls, self.max_tokens, self._model, self._clock = cls, max_tokens, model, clock
        self.started = clock()
        self.first_token_at: float | None = None
        self.last_progress = self.started
        self.tokens = 0
        # the cluster this stream is bound for while it holds a router slot but has not reached admission
        # (Redis does not count it yet; a refusal's hint counts it as a waiter ahead); "" once it has
        self.pending_on = ""

    def advance(self, n: int) -> None:
        now = self._clock()
        if self.first_token_at is None and n:
            self.first_token_at = now
        self.tokens += n
        self.last_progress = now

    def remaining_s(self) -> float:
        """Expected seconds until this request ends (ends early on a stop token: an upper-leaning estimate)."""
        left = max(self.max_tokens - self.tokens, 0)
        first = self.first_token_at
        if first is None:
            waited = self._clock() - self.started
            return max(self._model.ttft_s(self.cls) - waited, 0.0) + max(left - 1, 0) * self._model.tpot_s()
        if self.tokens > _OWN_RATE_AFTER:
            rate = (self.last_progress - first) / (self.tokens - 1)
        else:
            rate = self._model.tpot_s()
        return left * rate

    def finished(self) -> None:
        """Teach the model what this request took."""
        if self.first_token_at is not None:
            self._model.observe(self.cls, self.first_token_at - self.started, self.tokens,
                                self.last_progress - self.started)
