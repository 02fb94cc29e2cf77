"""The disaggregated loop: one object drives a prefill engine and a decode engine joined by a state channel.

```
 add(req) ──▶ PrefillEngine ──step()──▶ Handoff (ticket; state exported through the channel)
                                          │ DecodeEngine.submit(ticket) ─▶ first token
 cancel(id) ─▶ whichever engine holds it  ▼
                                   DecodeEngine.step() ─▶ one token per running request
 step() yields StreamEvents in the order they happen: a short request's first token leaves before the
 long requests' share of the same prefill step runs (PrefillEngine.step is a generator).
```
The cluster front (`cluster/front.py`) and the local pipeline (`disagg/pipeline.py`) both run this loop; it is
not thread-safe: one thread owns it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from k3serve.contracts.handoff import StagedState
from k3serve.contracts.requests import PrefillRequest, StreamEvent, TokenEvent
from k3serve.decode.engine import DecodeEngine
from k3serve.prefill.engine import PrefillEngine


@dataclass
class LoopStats:
    """Counters of one loop (read by status and metrics; written only by the loop's thread)."""

    handoffs: int = 0
    prefix_hit_tokens: int = 0
    staged_transfers: int = 0  # handoffs whose state went over a transfer plane (not inline)
    state_bytes: int = 0


class DisaggLoop:
    def __init__(self, prefill: PrefillEngine, decode: DecodeEngine) -> None:
        self.prefill, self.decode = prefill, decode
        self.stats = LoopStats()

    def add(self, request: PrefillRequest) -> None:
        self.prefill.add_request(request)

    def cancel(self, request_id: str) -> bool:
        """Drop the request wherever it is (queued, prefilling, waiting for install, decoding); True if found.
        Its slot, pages and staged state are free when this returns."""
        return self.prefill.cancel(request_id) or self.decode.cancel(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.prefill.has_work or self.decode.has_work or self.prefill.failures or self.decode.failures)

    def step(self) -> Iterator[StreamEvent]:
        """One prefill step (handoffs submitted to decode as they come) and one decode step."""
        yield from self._failures()
        for h in self.prefill.step():
            self.stats.handoffs += 1
            self.stats.prefix_hit_tokens += h.cached_tokens
            self.stats.staged_transfers += isinstance(h.state, StagedState)
            self.stats.state_bytes += h.state_bytes()
            for ev in self.decode.submit(h):
                yield _event(ev, h.cached_tokens)
        for ev in self.decode.step():
            t = self.decode.timings.get(ev.request_id) if ev.finished else None
            if t is not None and t.verify_steps:
                yield StreamEvent(ev.request_id, ev.token_ids, ev.finish_reason, drafted_tokens=t.drafted_tokens,
                                  accepted_tokens=t.accepted_tokens, verify_steps=t.verify_steps,
                                  logprobs=ev.logprobs)
                continue
            yield _event(ev)
        yield from self._failures()

    def _failures(self) -> Iterator[StreamEvent]:
        for f in self.prefill.take_failures() + self.decode.take_failures():
            yield StreamEvent(f.request_id, error=f)


def _event(ev: TokenEvent, cached_tokens: int = -1) -> StreamEvent:
    return StreamEvent(ev.request_id, ev.token_ids, ev.finish_reason, cached_tokens, logprobs=ev.logprobs)
