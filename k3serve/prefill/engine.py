"""The prefill role: prefix-cache lookup, chunked prefill, first token, handoff.

One :class:`PrefillEngine` drives one prefill TP group through an :class:`~k3serve.engine.executor.Executor`.
Per request:

```
 admit:   lookup (longest hash-block match clamped to the deepest KDA checkpoint)
          slot <- copy of the checkpoint (or zeros); pages <- shared hit pages + fresh pages for the rest
 chunks:  plan_chunks(...) each step; a chunk ending on a checkpoint boundary is followed by
          CopySlot(slot -> new checkpoint slot)
 finish:  sample the first token at position len(prompt); ExportState -> Handoff;
          register full blocks + checkpoints in the prefix cache; release the slot and the request's pages
```
Capacity comes from the pools; a request that does not fit now waits (after evicting cold cache entries); one
that can never fit is refused with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from k3serve.engine import mutation
from k3serve.engine.allocators import PageAllocator, SlotAllocator
from k3serve.engine.chunk_plan import ChunkCandidate, plan_chunks
from k3serve.engine.executor import Executor, OpFailed, WorkerDied
from k3serve.contracts.channel import StateChannel, StateTransferError
from k3serve.contracts.handoff import DraftCapture, DraftFeatures, Handoff
from k3serve.engine.ops import CopySlot, PoolConfig, PrefillChunk, PrefillStreamed, ResetSlots
from k3serve.contracts.prefix_policy import PrefixCachePolicy
from k3serve.engine.prefix_cache import HybridPrefixCache
from k3serve.contracts.errors import ErrorCode
from k3serve.contracts.numerics import DEFAULT_NUMERICS, Numerics
from k3serve.contracts.requests import PrefillRequest, RequestFailure
from k3serve.contracts.sampling import SamplingError
from k3serve.model.sampling import is_stop, sample_token, token_logprob
from k3serve.model.config import ModelConfig
from k3serve.model.reference import PromptError, validate_prompt
from k3serve.transfer.inprocess import InProcessChannel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillConfig:
    pools: PoolConfig
    cache: PrefixCachePolicy = field(default_factory=PrefixCachePolicy)
    step_token_budget: int = 2048
    long_threshold: int = 8192  # uncached prompt tokens from which a request is in the "long" class
    long_min_share: float = 0.25
    long_step_tokens: int | None = None  # most long-prompt tokens per step (None: step_token_budget); see chunk_plan
    enable_prefix_cache: bool = True
    draft_capture: DraftCapture | None = None  # hand the drafter its start state (Handoff.draft); None: none
    numerics: Numerics = DEFAULT_NUMERICS  # deterministic: chunk ends on its grid (the workers get the same value)
    # stream the state of a prompt's last chunk layer by layer while that chunk's forward runs (channels with
    # `layerwise`: gRPC and Mooncake; object_store exports after the forward; docs/transfer.md).
    layerwise_export: bool = False


@dataclass
class _Running:
    req: PrefillRequest
    slot: int
    pages: list[int]
    cached_tokens: int
    num_computed: int
    is_long: bool
    boundaries: list[int]
    checkpoints: dict[int, int] = field(default_factory=dict)
    order: int = 0  # arrival order (add_request)
    hashes: tuple[int, ...] = ()  # the prompt's block hashes (what it registers at its end)
    started_s: float = field(default_factory=time.monotonic)
    captured: list[tuple[int, dict]] = field(default_factory=list)  # (first position, {layer: [r, d]}) per chunk

    @property
    def prompt_len(self) -> int:
        return len(self.req.prompt_ids)


class PrefillEngine:
    def __init__(self, cfg: ModelConfig, executor: Executor, config: PrefillConfig, hash_key: bytes,
                 channel: StateChannel | None = None) -> None:
        """hash_key: the prefix cache's block-hash key (engine/block_hash.prefix_key). channel: how finished
        prefills hand their state to the decode group (default in-process: the tensors travel in the Handoff;
        `transfer.handoff_send.GrpcChannel` streams them over gRPC)."""
        self.channel: StateChannel = channel or InProcessChannel()
        if config.pools.page_size != config.cache.page_size:
            raise ValueError("pool page_size must equal the prefix cache policy's page_size")
        grid = config.numerics.chunk_grid
        if config.cache.block_size % grid:
            raise ValueError(f"prefix_cache block size {config.cache.block_size} must be a multiple of the chunk "
                             f"grid {grid} (numerics: deterministic): cache hits resume on that grid")
        self.cfg, self.executor, self.config = cfg, executor, config
        self.slots = SlotAllocator(config.pools.kda_slots)
        self.pages = PageAllocator(config.pools.mla_pages)
        self.cache = HybridPrefixCache(config.cache, self.pages, self.slots, hash_key)
        self.waiting: deque[PrefillRequest] = deque()
        # waiting request -> (arrival order, its prompt's block hashes once computed: hashed once, not per step)
        self._queued: dict[str, tuple[int, tuple[int, ...] | None]] = {}
        self._arrivals = itertools.count()
        self.running: list[_Running] = []
        self.failures: list[RequestFailure] = []
        self.stats = {"prompt_tokens": 0, "cached_tokens": 0, "computed_tokens": 0, "steps": 0}
        # an observer of the logits `[1, vocab]` that chose a request's first token (tests compare them)
        self.logits_tap: Callable[[str, object], None] | None = None

    # ------------------------------------------------------------------------------------------ intake
    def add_request(self, req: PrefillRequest) -> None:
        """Queue a request; invalid ones are refused at once (see :attr:`failures`)."""
        try:
            validate_prompt(list(req.prompt_ids), self.cfg.vocab_size, self.cfg.max_position_embeddings)
            if req.replay_ids:  # the replayed tokens must fit the vocabulary and the context too
                validate_prompt(list(req.prompt_ids + req.replay_ids), self.cfg.vocab_size,
                                self.cfg.max_position_embeddings)
            req.params.validate(self.cfg.vocab_size)
        except (PromptError, SamplingError) as e:
            self.failures.append(RequestFailure(req.request_id, ErrorCode.INVALID_ARGUMENT, str(e)))
            return
        need = self._pages_for(len(req.prompt_ids))
        if need > self.pages.capacity:
            self.failures.append(RequestFailure(
                req.request_id, ErrorCode.RESOURCE_EXHAUSTED,
                f"prompt of {len(req.prompt_ids)} tokens needs {need} MLA pages; this prefill group has "
                f"{self.pages.capacity}"))
            return
        self._queued[req.request_id] = (next(self._arrivals), None)
        self.waiting.append(req)

    def cancel(self, request_id: str) -> bool:
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                self._queued.pop(request_id, None)
                return True
        for run in self.running:
            if run.req.request_id == request_id:
                self._release(run, keep_checkpoints=False)
                self.running.remove(run)
                return True
        return False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def take_failures(self) -> list[RequestFailure]:
        out, self.failures = self.failures, []
        return out

    # -------------------------------------------------------------------------------------------- step
    def step(self) -> Iterator[Handoff]:
        """Admit what fits and run one budgeted step of chunks, yielding each request as it finishes prefill.

        A generator: the step runs as the caller iterates. Chunks run in plan order (short requests first), so
        a short request's handoff is yielded, and its first token can be streamed, before the long requests'
        share of the same step runs. The caller must not add, cancel or step while it iterates."""
        self._admit()
        if not self.running:
            return
        self.stats["steps"] += 1
        by_id = {r.req.request_id: r for r in self.running}
        cands = [ChunkCandidate(r.req.request_id, r.is_long, r.num_computed, r.prompt_len, tuple(r.boundaries))
                 for r in self.running]
        for work in plan_chunks(cands, self.config.step_token_budget, self.config.long_min_share,
                                self.config.long_step_tokens, self.config.numerics.chunk_grid):
            run = by_id[work.request_id]
            if run not in self.running:
                continue  # failed earlier in this step
            try:
                handoff = self._run_chunk(run, work)
            except OpFailed as e:  # the group is intact: fail this request only, keep serving
                self._fail(run, ErrorCode.INTERNAL, f"prefill failed: {str(e).splitlines()[0]}")
                continue
            except WorkerDied:
                raise
            except Exception as e:  # noqa: BLE001 - raised for this request (its sampling, stop rule): it alone ends
                log.warning("request %s: prefill raised %s: %s", run.req.request_id, type(e).__name__, e)
                self._fail(run, ErrorCode.INTERNAL, f"prefill failed: {type(e).__name__}")
                continue
            if handoff is not None:
                yield handoff

    def _run_chunk(self, run: _Running, work) -> Handoff | None:
        """One planned chunk of `run`; the handoff when it was the last one (None while more remain)."""
        last = work.end == run.prompt_len
        cap = self.config.draft_capture
        rows = min(cap.rows, work.end - max(work.start, run.prompt_len - cap.rows)) if cap else 0
        op = PrefillChunk(run.slot, run.req.prompt_ids[work.start: work.end], work.start,
                          tuple(run.pages), want_logits=last, capture_layers=cap.layers if rows > 0 else (),
                          capture_rows=max(0, rows))
        streamed = None
        if last and self.config.layerwise_export and getattr(self.channel, "layerwise", False):
            job = self.channel.stream_job(run.req.request_id, run.prompt_len)
            try:
                results = self.executor.run(PrefillStreamed(op, run.prompt_len, job))
            except OpFailed:
                self.channel.abandon(job)  # some ranks may have sent their share
                raise
            logits, streamed = results[0][0], (job, [r[1] for r in results])
        else:
            logits = self.executor.run(op)[0]
        if rows > 0:  # this chunk holds some of the prompt's last cap.rows positions
            logits, feats = logits
            run.captured.append((work.end - rows, feats))
        run.num_computed = work.end
        self.stats["computed_tokens"] += work.num_tokens
        if work.end in run.boundaries:
            run.boundaries.remove(work.end)
            self._save_checkpoint(run, work.end)
        return self._finish(run, logits, streamed) if last else None

    def _fail(self, run: _Running, code: ErrorCode, message: str) -> None:
        if run in self.running:
            self._release(run, keep_checkpoints=False)
            self.running.remove(run)
        self.failures.append(RequestFailure(run.req.request_id, code, message))

    def run_to_completion(self) -> list[Handoff]:
        out: list[Handoff] = []
        while self.has_work:
            before = (len(self.waiting), len(self.running))
            out += self.step()
            if not self.running and self.waiting and before == (len(self.waiting), 0):
                raise RuntimeError("prefill made no progress: pools too small for the waiting requests")
        return out

    # ------------------------------------------------------------------------------------------ helpers
    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.config.pools.page_size)

    def _admit(self) -> None:
        """Start waiting requests in arrival order while they fit.

        A long prompt that does not fit yet (pages or slots) does not hold up short ones behind it: they start
        around it, while long prompts keep their order among themselves. A request counts as short here when
        its whole prompt is under the long threshold (its cache hit is not known before the lookup)."""
        long_blocked = False
        for req in list(self.waiting):
            short = len(req.prompt_ids) < self.config.long_threshold
            if long_blocked and not short:
                continue
            if self._follows_running(req):
                continue  # it starts once the prefill ahead of it has registered its checkpoints
            try:
                run = self._try_start(req)
            except OpFailed as e:  # its slot could not be prepared: fail this request only
                self.waiting.remove(req)
                self._queued.pop(req.request_id, None)
                self.failures.append(RequestFailure(req.request_id, ErrorCode.INTERNAL,
                                                    f"prefill failed: {str(e).splitlines()[0]}"))
                continue
            if run is None:
                if short:
                    return  # a short one that does not fit: nothing behind it would
                long_blocked = True
                continue
            self.waiting.remove(req)
            run.order = self._queued.pop(req.request_id, (0, None))[0]
            self.running.append(run)

    def _follows_running(self, req: PrefillRequest) -> bool:
        """Whether a prefill running here, of a request that arrived before this one, will save a checkpoint
        deeper into this prompt than the cache restores now. Starting after it has registered restores that
        much more (SGLang defers a request that shares a prefix within a batch for the same reason); the wait is
        bounded by the prefills that arrived before it."""
        if not self.running or not self.config.enable_prefix_cache:
            return False
        bs = self.cache.policy.block_size
        mine = self._hashes(req)
        have = self.cache.restorable(mine, len(req.prompt_ids))
        limit = (len(req.prompt_ids) - 1) // bs * bs  # a hit leaves the last token to compute
        order = self._queued.get(req.request_id, (0, None))[0]
        for run in self.running:
            if run.order > order:
                continue
            common = next((i for i, (a, b) in enumerate(zip(mine, run.hashes)) if a != b),
                          min(len(mine), len(run.hashes)))
            reach = min(common * bs, limit)
            if any(have < b <= reach for b in (*run.boundaries, *run.checkpoints)):
                return True
        return False

    def _hashes(self, req: PrefillRequest) -> tuple[int, ...]:
        """A waiting request's block hashes, computed on first use and kept while it waits."""
        order, hashes = self._queued.get(req.request_id, (0, None))
        if hashes is None:
            hashes = tuple(self.cache.block_hashes(req.prompt_ids, req.cache_salt))
            self._queued[req.request_id] = (order, hashes)
        return hashes

    def _try_start(self, req: PrefillRequest) -> _Running | None:
        prompt = list(req.prompt_ids)
        hit = self.cache.lookup(prompt, req.cache_salt) if self.config.enable_prefix_cache else None
        cached = mutation.resume_point(hit.num_tokens if hit else 0, self.cache.policy.block_size,
                                       req.request_id)
        fresh = self._pages_for(len(prompt)) - (len(hit.pages) if hit else 0)
        if self.slots.num_free < 1 or self.pages.num_free < fresh:
            self.cache.evict(pages_needed=fresh, slots_needed=1)
        if self.slots.num_free < 1 or self.pages.num_free < fresh:
            if hit:
                self.pages.decref(hit.pages)
                self.cache.release(hit)
            return None
        slot = self.slots.alloc()
        pages = (list(hit.pages) if hit else []) + self.pages.alloc(fresh)
        try:
            if hit and hit.checkpoint_slot is not None:
                self.executor.run(CopySlot(hit.checkpoint_slot, slot))
            else:
                self.executor.run(ResetSlots((slot,)))
        except OpFailed:
            self.slots.free(slot)
            self.pages.decref(pages)
            raise
        finally:
            if hit:
                self.cache.release(hit)
        self.stats["prompt_tokens"] += len(prompt)
        self.stats["cached_tokens"] += cached
        # where the prompt leaves a cached prefix: a checkpoint there lets the next prompt under it resume at its end
        branch = hit.matched_blocks * self.cache.policy.block_size if hit else 0
        bounds = self.cache.checkpoint_boundaries(len(prompt), cached, branch) \
            if self.config.enable_prefix_cache else []
        return _Running(req, slot, pages, cached, cached, len(prompt) - cached >= self.config.long_threshold,
                        list(bounds), hashes=self._hashes(req) if self.config.enable_prefix_cache else ())

    def _save_checkpoint(self, run: _Running, boundary: int) -> None:
        if self.slots.num_free < 1:
            self.cache.evict(slots_needed=1)
        ckpt = self.slots.alloc()
        if ckpt is None:
            return  # no room: the prefix simply stays uncheckpointed
        try:
            self.executor.run(CopySlot(run.slot, ckpt))
        except OpFailed:
            self.slots.free(ckpt)
            raise
        run.checkpoints[boundary] = ckpt

    def _finish(self, run: _Running, logits: object, streamed: tuple | None = None) -> Handoff | None:
        """streamed: (job, every rank's outcome) when the last chunk already streamed the state."""
        req, n = run.req, run.prompt_len
        try:  # what may raise for this request alone comes before its state leaves (nothing to take back)
            first_logprob = None
            if req.replay_ids:  # a resumed request: its next token is already known; decode replays the rest
                first, reason = req.replay_ids[0], ""
            else:
                first = sample_token(logits, req.params, n)
                if req.params.logprobs:
                    first_logprob = token_logprob(logits, first)
                if self.logits_tap is not None:
                    self.logits_tap(req.request_id, logits[None])
                stop = is_stop(first, req.params, self.cfg.eos_token_id)
                reason = "stop" if stop else ("length" if req.params.max_tokens <= 1 else "")
            draft = None if reason else _draft_features(run, first)
        except Exception:
            if streamed is not None:
                self.channel.abandon(streamed[0])
            raise
        state = None
        if reason and streamed is not None:  # a first token that ends the request leaves no state to hand over
            self.channel.abandon(streamed[0])
        elif not reason:
            try:
                state = (self.channel.streamed(*streamed) if streamed is not None else
                         self.channel.export(self.executor, req.request_id, run.slot, tuple(run.pages), n))
            except StateTransferError as e:
                self._release(run, keep_checkpoints=True)
                self.running.remove(run)
                self.failures.append(RequestFailure(req.request_id, ErrorCode.UNAVAILABLE, str(e)))
                return None
        self._release(run, keep_checkpoints=True)
        self.running.remove(run)
        return Handoff(req.request_id, req.session_id, req.prompt_ids, first, req.params, n, run.cached_tokens,
                       state, finished=bool(reason), finish_reason=reason, prefill_started_s=run.started_s,
                       first_token_s=time.monotonic(), draft=draft,
                       replay=req.replay_ids, first_logprob=first_logprob)

    def _release(self, run: _Running, keep_checkpoints: bool) -> None:
        if keep_checkpoints and self.config.enable_prefix_cache:
            self.cache.register(list(run.req.prompt_ids[: run.num_computed]), run.pages, run.checkpoints,
                                run.req.session_id, run.req.cache_salt)
        else:
            for ckpt in run.checkpoints.values():
                self.slots.free(ckpt)
        run.checkpoints = {}
        self.pages.decref(run.pages)
        self.slots.free(run.slot)


def _draft_features(run: _Running, first_token: int) -> DraftFeatures | None:
    """The captured rows of the prompt's last positions (contiguous, ending at the last prompt token)."""
    if not run.captured:
        return None
    start = run.captured[0][0]
    layers = run.captured[0][1].keys()
    feats = {layer: torch.cat([f[layer] for _, f in run.captured]) for layer in layers}
    toks = tuple(run.req.prompt_ids[start + 1:]) + (first_token,)
    return DraftFeatures(start, toks, feats)
