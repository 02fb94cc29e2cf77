"""The decode role: install handoffs, continuous batching, token streaming.

One :class:`DecodeEngine` drives one decode TP group. Each step decodes one token for every running request
(up to ``max_batch``); requests join (install) and leave (stop, length, cancel) between steps. A request's
pages for prompt + max_tokens are reserved when it is installed, so a running request never runs out of
memory mid-stream; a handoff that does not fit yet waits for running requests to finish.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from k3serve.engine.allocators import PageAllocator, SlotAllocator
from k3serve.engine.executor import Executor, OpFailed
from k3serve.contracts.handoff import Handoff
from k3serve.engine.ops import DecodeBatch, InstallStaged, InstallState, PoolConfig
from k3serve.contracts.errors import ErrorCode
from k3serve.contracts.requests import RequestFailure, TokenEvent
from k3serve.engine.sampling import is_stop, sample_token
from k3serve.model.config import ModelConfig
from k3serve.transfer.plan import reshard_kda


@dataclass(frozen=True)
class DecodeConfig:
    pools: PoolConfig
    max_batch: int = 64


@dataclass
class _Decoding:
    handoff: Handoff
    slot: int
    pages: list[int]
    generated: list[int]
    installed_s: float = field(default_factory=time.monotonic)
    token_times: list[float] = field(default_factory=list)

    @property
    def next_position(self) -> int:
        """Position of the last generated token, which the next step feeds in."""
        return self.handoff.num_tokens + len(self.generated) - 1


@dataclass(frozen=True)
class _Staged:
    """A request whose state waits, verified, in every rank's transfer staging under `transfer_id`."""

    transfer_id: str
    drop: Callable[[str], object] | None  # frees the staging if the request leaves before install


@dataclass(frozen=True)
class RequestTimings:
    ttft_s: float  # prefill start -> first token
    tpot_s: float  # mean time per output token after the first
    num_tokens: int


class DecodeEngine:
    def __init__(self, cfg: ModelConfig, executor: Executor, config: DecodeConfig) -> None:
        self.cfg, self.executor, self.config = cfg, executor, config
        self.slots = SlotAllocator(config.pools.kda_slots)
        self.pages = PageAllocator(config.pools.mla_pages)
        self.waiting: deque[tuple[Handoff, list[torch.Tensor] | _Staged]] = deque()
        self.running: dict[str, _Decoding] = {}
        self.failures: list[RequestFailure] = []
        self.timings: dict[str, RequestTimings] = {}

    # ------------------------------------------------------------------------------------------ intake
    def pages_needed(self, h: Handoff) -> int:
        total = min(h.num_tokens + h.params.max_tokens, self.cfg.max_position_embeddings)
        return -(-total // self.config.pools.page_size)

    def submit(self, handoff: Handoff, kda_parts: list[torch.Tensor] | None = None) -> list[TokenEvent]:
        """Accept a prefilled request. kda_parts: this group's per-rank KDA state (resharded here if None).

        Returns the first-token event (the prefill's token is the first one the client sees).
        """
        first = TokenEvent(handoff.request_id, (handoff.first_token,), handoff.finished, handoff.finish_reason)
        if handoff.finished:
            self.timings[handoff.request_id] = RequestTimings(
                handoff.first_token_s - handoff.prefill_started_s, 0.0, 1)
            return [first]
        if self.pages_needed(handoff) > self.pages.capacity:
            self.failures.append(RequestFailure(handoff.request_id, ErrorCode.RESOURCE_EXHAUSTED,
                                                f"prompt + max_tokens needs {self.pages_needed(handoff)} pages; "
                                                f"this decode group has {self.pages.capacity}"))
            return []
        parts = kda_parts if kda_parts is not None else reshard_kda(list(handoff.kda), self.executor.tp)
        self.waiting.append((handoff, parts))
        self._admit()
        return [first]

    def submit_staged(self, handoff: Handoff, transfer_id: str,
                      drop: Callable[[str], object] | None = None) -> list[TokenEvent]:
        """Accept a prefilled request whose state is already verified in every rank's transfer staging.

        handoff: the request's metadata (its kda/mla may be empty: the state came over k3serve.transfer).
        Installed with InstallStaged(slot, block_table, transfer_id) once a slot and pages are free. `drop`
        (e.g. ReceiverClient.cancel) is called with transfer_id if the request leaves before install.
        """
        staged = _Staged(transfer_id, drop)
        if handoff.finished or self.pages_needed(handoff) > self.pages.capacity:
            self._drop(staged)  # nothing to install: the first token ended it, or it can never fit
            return self.submit(handoff, kda_parts=[])
        self.waiting.append((handoff, staged))
        self._admit()
        return [TokenEvent(handoff.request_id, (handoff.first_token,), False, "")]

    @staticmethod
    def _drop(staged: object) -> None:
        if isinstance(staged, _Staged) and staged.drop is not None:
            staged.drop(staged.transfer_id)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_batch:
            handoff, parts = self.waiting[0]
            need = self.pages_needed(handoff)
            if self.slots.num_free < 1 or self.pages.num_free < need:
                return
            self.waiting.popleft()
            slot, pages = self.slots.alloc(), self.pages.alloc(need)
            n_pages = -(-handoff.num_tokens // self.config.pools.page_size)
            table = tuple(pages[:n_pages])
            try:
                if isinstance(parts, _Staged):
                    self.executor.run(InstallStaged(slot, table, parts.transfer_id))
                else:
                    self.executor.run_each([InstallState(slot, table, part, handoff.mla) for part in parts])
            except OpFailed as e:  # e.g. staging not verified on some rank: fail this request only
                self.pages.decref(pages)
                self.slots.free(slot)
                self._drop(parts)
                # a staged install that failed is a transfer fault: UNAVAILABLE lets the router fail over
                code = ErrorCode.UNAVAILABLE if isinstance(parts, _Staged) else ErrorCode.INTERNAL
                self.failures.append(RequestFailure(handoff.request_id, code,
                                                    f"install failed: {str(e).splitlines()[0]}"))
                continue
            self.running[handoff.request_id] = _Decoding(handoff, slot, pages, [handoff.first_token])

    def cancel(self, request_id: str) -> bool:
        """Stop a request now; its slot and pages are free when this returns."""
        for item in list(self.waiting):
            if item[0].request_id == request_id:
                self.waiting.remove(item)
                self._drop(item[1])
                return True
        run = self.running.pop(request_id, None)
        if run is None:
            return False
        self._free(run)
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def take_failures(self) -> list[RequestFailure]:
        out, self.failures = self.failures, []
        return out

    # -------------------------------------------------------------------------------------------- step
    def step(self) -> list[TokenEvent]:
        """One token for every running request."""
        self._admit()
        if not self.running:
            return []
        batch = list(self.running.values())
        op = DecodeBatch(tuple(r.slot for r in batch), tuple(r.generated[-1] for r in batch),
                         tuple(r.next_position for r in batch), tuple(tuple(r.pages) for r in batch))
        try:
            logits = self.executor.run(op)[0]
        except OpFailed as e:  # the group is intact: fail this batch's requests, keep serving
            for run in batch:
                self.running.pop(run.handoff.request_id, None)
                self._free(run)
                self.failures.append(RequestFailure(run.handoff.request_id, ErrorCode.INTERNAL,
                                                    f"decode step failed: {str(e).splitlines()[0]}"))
            return []
        now = time.monotonic()
        events = []
        for i, run in enumerate(batch):
            h = run.handoff
            pos = run.next_position + 1
            tok = sample_token(logits[i], h.params, pos)
            run.generated.append(tok)
            run.token_times.append(now)
            reason = ""
            if is_stop(tok, h.params, self.cfg.eos_token_id):
                reason = "stop"
            elif len(run.generated) >= h.params.max_tokens or pos + 1 >= self.cfg.max_position_embeddings:
                reason = "length"
            events.append(TokenEvent(h.request_id, (tok,), bool(reason), reason))
            if reason:
                self._finish(run)
        self._admit()
        return events

    def _finish(self, run: _Decoding) -> None:
        h = run.handoff
        self.running.pop(h.request_id)
        ttft = h.first_token_s - h.prefill_started_s
        steps = run.token_times
        tpot = (steps[-1] - h.first_token_s) / len(steps) if steps else 0.0
        self.timings[h.request_id] = RequestTimings(ttft, tpot, len(run.generated))
        self._free(run)

    def _free(self, run: _Decoding) -> None:
        self.pages.decref(run.pages)
        self.slots.free(run.slot)
