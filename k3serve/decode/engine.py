"""The decode role: install handoffs, continuous batching, token streaming.

One :class:`DecodeEngine` drives one decode TP group. Each step decodes one token for every running request
(up to ``max_batch``); requests join (install) and leave (stop, length, cancel) between steps. With
``DecodeConfig.speculative`` set, requests whose class has it on draft up to k tokens each step and are
verified + committed in the same step as the plain ones (`decode/speculative.py`, docs/speculative.md). A request's
pages for prompt + max_tokens are reserved when it is installed, so a running request never runs out of
memory mid-stream; a handoff that does not fit yet waits for running requests to finish.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from torch.profiler import record_function

from k3serve.engine.allocators import PageAllocator, SlotAllocator
from k3serve.engine.executor import Executor, OpFailed
from k3serve.contracts.handoff import Handoff
from k3serve.contracts.channel import StateChannel, StateInstallError
from k3serve.decode import speculative as spec
from k3serve.engine.ops import DecodeBatch, PoolConfig
from k3serve.engine.spec.config import SpecConfig, make_drafter
from k3serve.engine.spec.drafter import Drafter, DraftSession, VerifyOutcome
from k3serve.contracts.errors import ErrorCode
from k3serve.contracts.requests import RequestFailure, TokenEvent
from k3serve.model.sampling import is_stop, sample_token
from k3serve.model.config import ModelConfig
from k3serve.transfer.inprocess import InProcessChannel


TIMINGS_WINDOW = 1024  # finished requests whose timings are kept (benches read them; oldest dropped first)

SAMPLING_LABEL = "k3serve.sampling"  # per-step token sampling (bench decode's breakdown)


@dataclass(frozen=True)
class DecodeConfig:
    """speculative: drafting settings (None: plain decoding); pools.spec_slots/spec_tokens must then hold
    the verify windows (spec_tokens >= num_draft_tokens + 1)."""

    pools: PoolConfig
    max_batch: int = 64
    speculative: SpecConfig | None = None

    def __post_init__(self) -> None:
        sp = self.speculative
        if sp is not None and (self.pools.spec_slots < 1 or self.pools.spec_tokens < sp.num_draft_tokens + 1):
            raise ValueError(f"speculative decoding with k={sp.num_draft_tokens} needs pools.spec_slots >= 1 and "
                             f"pools.spec_tokens >= {sp.num_draft_tokens + 1}; got {self.pools}")


@dataclass
class _Decoding:
    handoff: Handoff
    slot: int
    pages: list[int]
    generated: list[int]
    installed_s: float = field(default_factory=time.monotonic)
    token_times: list[float] = field(default_factory=list)
    session: DraftSession | None = None  # the drafter's state for this request (speculative requests only)
    usage: spec.SpecUsage = field(default_factory=spec.SpecUsage)

    @property
    def next_position(self) -> int:
        """Position of the last generated token, which the next step feeds in."""
        return self.handoff.num_tokens + len(self.generated) - 1


@dataclass(frozen=True)
class RequestTimings:
    ttft_s: float  # prefill start -> first token
    tpot_s: float  # mean time per output token after the first
    num_tokens: int
    drafted_tokens: int = 0  # speculative decoding: drafts verified, accepted, verify steps run
    accepted_tokens: int = 0
    verify_steps: int = 0


class DecodeEngine:
    def __init__(self, cfg: ModelConfig, executor: Executor, config: DecodeConfig,
                 channel: StateChannel | None = None, drafter: Drafter | None = None) -> None:
        """channel: how handoffs' state reaches this group's pools (the same channel the prefill group
        exports through); default in-process (state inline in the ticket).
        drafter: the drafting method when config.speculative is set (default: the one it names)."""
        self.cfg, self.executor, self.config = cfg, executor, config
        self.channel: StateChannel = channel or InProcessChannel()
        self.slots = SlotAllocator(config.pools.kda_slots)
        self.pages = PageAllocator(config.pools.mla_pages)
        self.waiting: deque[Handoff] = deque()
        self.running: dict[str, _Decoding] = {}
        self.failures: list[RequestFailure] = []
        self.timings: dict[str, RequestTimings] = {}
        if config.speculative is not None and drafter is None:
            drafter = make_drafter(config.speculative, cfg)
        self.drafter = drafter if config.speculative is not None else None
        # what the prefill group feeding this engine must capture for the drafter's warm start (Handoff.draft)
        self.draft_capture = self.drafter.capture if self.drafter is not None else None
        self.spec_usage = spec.SpecUsage()  # summed over every request this engine served (Prometheus)
        self.records_in_use = 0  # record buffers held by the verify in flight (they live for one bucket)

    # ------------------------------------------------------------------------------------------ intake
    def speculates(self, h: Handoff) -> bool:
        sp = self.config.speculative
        return sp is not None and sp.enabled_for(h.num_tokens - h.cached_tokens)

    def pages_needed(self, h: Handoff) -> int:
        total = min(h.num_tokens + h.params.max_tokens, self.cfg.max_position_embeddings)
        return -(-total // self.config.pools.page_size)

    def submit(self, handoff: Handoff) -> list[TokenEvent]:
        """Accept a prefilled request (its ticket); its state is installed through the channel once a slot and
        pages are free. Returns the first-token event (the prefill's token is the first one the client sees)."""
        first = TokenEvent(handoff.request_id, (handoff.first_token,), handoff.finished, handoff.finish_reason)
        if handoff.finished or handoff.state is None:
            if handoff.state is not None:
                self.channel.discard(handoff.state)
            self._record(handoff.request_id, RequestTimings(handoff.first_token_s - handoff.prefill_started_s,
                                                            0.0, 1))
            return [first]
        if self.pages_needed(handoff) > self.pages.capacity:
            self.channel.discard(handoff.state)
            self.failures.append(RequestFailure(handoff.request_id, ErrorCode.RESOURCE_EXHAUSTED,
                                                f"prompt + max_tokens needs {self.pages_needed(handoff)} pages; "
                                                f"this decode group has {self.pages.capacity}"))
            return []
        self.waiting.append(handoff)
        self._admit()
        return [first]

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_batch:
            handoff = self.waiting[0]
            need = self.pages_needed(handoff)
            if self.slots.num_free < 1 or self.pages.num_free < need:
                return
            self.waiting.popleft()
            slot, pages = self.slots.alloc(), self.pages.alloc(need)
            n_pages = -(-handoff.num_tokens // self.config.pools.page_size)
            try:
                self.channel.install(self.executor, handoff.state, slot, tuple(pages[:n_pages]))
            except (StateInstallError, OpFailed) as e:  # fail this request only: the group is intact
                self.pages.decref(pages)
                self.slots.free(slot)
                if isinstance(e, OpFailed):  # the channel frees its staging itself when it raises
                    self.channel.discard(handoff.state)
                # an install that found no verified state is a transfer fault: UNAVAILABLE lets the router
                # fail over; an op that raised is INTERNAL
                code = ErrorCode.UNAVAILABLE if isinstance(e, StateInstallError) else ErrorCode.INTERNAL
                self.failures.append(RequestFailure(handoff.request_id, code, str(e).splitlines()[0]))
                continue
            session = self.drafter.open(handoff.request_id, handoff.prompt_ids, draft=handoff.draft) \
                if self.speculates(handoff) else None
            self.running[handoff.request_id] = _Decoding(handoff, slot, pages, [handoff.first_token], session=session)

    def cancel(self, request_id: str) -> bool:
        """Stop a request now; its slot and pages are free when this returns."""
        for handoff in list(self.waiting):
            if handoff.request_id == request_id:
                self.waiting.remove(handoff)
                self.channel.discard(handoff.state)
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
        """One token for every plain running request; up to k + 1 for each speculative one."""
        self._admit()
        if not self.running:
            return []
        plain, drafts = [], []
        for run in self.running.values():
            prop = self._propose(run) if run.session is not None else None
            if prop is None or not prop.tokens:
                plain.append(run)
            else:
                drafts.append(spec.Draft(run, prop, (run.generated[-1],) + prop.tokens))
        events = self._plain_step(plain) if plain else []
        for bucket in spec.buckets(drafts, self.config.pools.spec_slots):
            events += self._spec_step(bucket)
        self._admit()
        return events

    def _propose(self, run: _Decoding):
        h, sp = run.handoff, self.config.speculative
        limit = spec.draft_limit(len(run.generated), h.params.max_tokens, run.next_position,
                                 self.cfg.max_position_embeddings, sp.num_draft_tokens)
        return spec.propose(run.session, h.prompt_ids + tuple(run.generated), limit)

    def _fail_batch(self, runs: list[_Decoding], what: str, e: OpFailed) -> None:
        for run in runs:  # the group is intact: fail these requests, keep serving
            self.running.pop(run.handoff.request_id, None)
            self._free(run)
            self.failures.append(RequestFailure(run.handoff.request_id, ErrorCode.INTERNAL,
                                                f"{what} failed: {str(e).splitlines()[0]}"))

    def _plain_step(self, batch: list[_Decoding]) -> list[TokenEvent]:
        op = DecodeBatch(tuple(r.slot for r in batch), tuple(r.generated[-1] for r in batch),
                         tuple(r.next_position for r in batch), tuple(tuple(r.pages) for r in batch))
        try:
            logits = self.executor.run(op)[0]
        except OpFailed as e:
            self._fail_batch(batch, "decode step", e)
            return []
        with record_function(SAMPLING_LABEL):
            toks = [sample_token(logits[i], run.handoff.params, run.next_position + 1) for i, run in enumerate(batch)]
        events = []
        for run, tok in zip(batch, toks):
            if run.session is not None:
                run.session.observe(VerifyOutcome(run.next_position, (run.generated[-1],), (tok,), None))
            events.append(self._emit(run, (tok,)))
        return events

    def _spec_step(self, bucket: list[spec.Draft]) -> list[TokenEvent]:
        runs = [d.run for d in bucket]
        layers = tuple(self.drafter.feature_layers)
        self.records_in_use = len(bucket)
        try:
            logits, features = self.executor.run(spec.verify_ops(bucket, layers))[0]
            with record_function(SAMPLING_LABEL):
                accs = spec.accept_bucket(bucket, logits)
            self.executor.run(spec.commit_op(bucket, accs))
        except OpFailed as e:
            self._fail_batch(runs, "speculative step", e)
            return []
        finally:
            self.records_in_use = 0
        events = []
        for i, (d, acc) in enumerate(zip(bucket, accs)):
            d.run.usage.add(len(d.proposal.tokens), acc.accepted)
            self.spec_usage.add(len(d.proposal.tokens), acc.accepted)
            d.run.session.observe(spec.outcome(d, acc, features, i))
            events.append(self._emit(d.run, acc.tokens))
        return events

    def _emit(self, run: _Decoding, tokens: tuple[int, ...]) -> TokenEvent:
        """Append a step's tokens (cut at a stop token or the budget) and finish the request if it ended."""
        h, now = run.handoff, time.monotonic()
        out, reason = [], ""
        for tok in tokens:
            pos = run.next_position + 1
            run.generated.append(tok)
            run.token_times.append(now)
            out.append(tok)
            if is_stop(tok, h.params, self.cfg.eos_token_id):
                reason = "stop"
            elif len(run.generated) >= h.params.max_tokens or pos + 1 >= self.cfg.max_position_embeddings:
                reason = "length"
            if reason:
                break
        if reason:
            self._finish(run)
        return TokenEvent(h.request_id, tuple(out), bool(reason), reason)

    def _finish(self, run: _Decoding) -> None:
        h = run.handoff
        self.running.pop(h.request_id)
        ttft = h.first_token_s - h.prefill_started_s
        steps = run.token_times
        tpot = (steps[-1] - h.first_token_s) / len(steps) if steps else 0.0
        u = run.usage
        self._record(h.request_id, RequestTimings(ttft, tpot, len(run.generated), u.drafted_tokens,
                                                  u.accepted_tokens, u.verify_steps))
        self._free(run)

    def _record(self, request_id: str, timing: RequestTimings) -> None:
        """Keep the last TIMINGS_WINDOW requests' timings (bounded: a long-lived engine must not grow)."""
        self.timings[request_id] = timing
        while len(self.timings) > TIMINGS_WINDOW:
            self.timings.pop(next(iter(self.timings)))

    def _free(self, run: _Decoding) -> None:
        if run.session is not None:
            run.session.close()
            run.session = None
        self.pages.decref(run.pages)
        self.slots.free(run.slot)
