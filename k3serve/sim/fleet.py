"""Replay a trace at N clusters in simulated time, with the project's own placement and prefix-cache code.

Per request: ``router.placement.place`` picks the cluster from what it would see (each cluster's checkpointed
block hashes, its queued prefill tokens, its rate); the cluster's ``HybridPrefixCache`` (real allocators, real
eviction) serves the lookup and takes the registration at the prefill's end, with the checkpoints
``checkpoint_boundaries`` asks for (the branch point included), exactly as ``prefill/engine.py`` drives it. Time
comes from the cost model (cost.py): one FIFO prefill server per cluster.

Above ``PREFILTER_ABOVE`` clusters the placement is given a candidate set instead of the whole fleet, for speed:
up to 16 of the clusters that were sent a prompt with this prompt's deepest known block, plus up to 8 idle (else
least-queued) clusters. It can miss a better cluster only when more than 16 hold that prefix (a system prompt
held everywhere), and then only among near-equal ones.
"""

from __future__ import annotations

import heapq
import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from k3serve.engine.allocators import PageAllocator, SlotAllocator
from k3serve.engine.block_hash import block_hashes, prefix_key
from k3serve.engine.prefix_cache import HybridPrefixCache
from k3serve.contracts.prefix_policy import PrefixCachePolicy
from k3serve.router.load_bound import RecentLoad, SharedPrefixes
from k3serve.router.placement import ClusterPicture, place
from k3serve.router.tenancy import anonymous_identity
from k3serve.sim.cost import CostModel
from k3serve.sim.trace import BLOCK, TraceRequest, ideal_reuse, prompt_tokens

KEY = prefix_key(0x6B33, "")  # the simulated deployment's block-hash key (one tenant, no secret)
VOCAB = 50_000
PREFILTER_ABOVE = 128
NEAR = 16  # at most this many of the clusters that served a prompt's deepest known prefix are candidates
_ARRIVE, _DONE, _KILL = 0, 1, 2


@dataclass(frozen=True)
class FleetSpec:
    clusters: int
    pages: int  # hash blocks of MLA pages per cluster (the simulator uses one page per 512-token block)
    slots: int  # KDA slots per cluster: one for the request in prefill, the rest checkpoints
    policy: PrefixCachePolicy = field(default_factory=lambda: PrefixCachePolicy(page_size=BLOCK))

    def __post_init__(self) -> None:
        for name in ("clusters", "pages"):
            if getattr(self, name) < 1:
                raise ValueError(f"fleet: {name} must be >= 1, got {getattr(self, name)}")
        if self.slots < 2:
            raise ValueError(f"fleet: slots must be >= 2 (one to prefill in, one checkpoint), got {self.slots}")
        if self.policy.block_size != BLOCK:
            raise ValueError(f"fleet: the prefix cache's block must be the trace's {BLOCK} tokens")


class _Held:
    """A cluster's checkpointed block hashes as placement sees them (what the cluster publishes)."""

    __slots__ = ("has",)

    def __init__(self, cache: HybridPrefixCache) -> None:
        self.has = cache.has_checkpoint

    def __contains__(self, h: object) -> bool:
        return self.has(h)


class _Cluster:
    def __init__(self, cid: str, spec: FleetSpec) -> None:
        self.id = cid
        self.pages = PageAllocator(spec.pages * spec.policy.pages_per_block)
        self.slots = SlotAllocator(spec.slots)
        self.cache = HybridPrefixCache(spec.policy, self.pages, self.slots, KEY)
        self.held = _Held(self.cache)
        self.queue: deque[int] = deque()
        self.queued_tokens = 0
        self.busy_until = 0.0
        self.running: tuple | None = None  # (request index, slot, pages, boundaries, cached)
        self.alive = True
        self.computed = 0  # prefill tokens computed here (the load figure)


@dataclass
class _Req:
    trace: TraceRequest
    salt: int
    tokens: list[int] | None = None
    hashes: list[int] | None = None
    cluster: str = ""
    ttft_s: float = -1.0
    cached: int = 0


def simulate(reqs: Sequence[tuple[TraceRequest, int]], spec: FleetSpec, cost: CostModel, routing: str, *,
             slo_s: float = 2.0, kill: tuple[str, float] | None = None, seed: int = 0) -> dict:
    """One replay. ``reqs``: (request, copy salt) in arrival order; ``kill``: (cluster id, time) when one dies
    (its queue fails over by the same policy and its cache is lost). Returns the run's figures."""
    started = time.monotonic()
    clusters = {f"c{i}": _Cluster(f"c{i}", spec) for i in range(spec.clusters)}
    rng = random.Random(seed)
    served_at: dict[int, set[str]] = {}  # block hash -> clusters a prompt with it was sent to (prefilter only)
    first_block: dict[tuple, str] = {}
    recent, shared = RecentLoad(max(2048, 16 * spec.clusters)), SharedPrefixes(1 << 20)  # the router's memory
    rs = [_Req(r, s) for r, s in reqs]
    events: list[tuple[float, int, int, object]] = [(r.trace.arrival_s, i, _ARRIVE, i) for i, r in enumerate(rs)]
    seq = len(events)
    if kill is not None:
        if kill[0] not in clusters:
            raise ValueError(f"kill: no cluster {kill[0]!r} in a fleet of {spec.clusters}")
        events.append((kill[1], seq, _KILL, kill[0]))
        seq += 1
    heapq.heapify(events)
    refused = moved = 0
    computed_at_kill: dict[str, int] = {}

    def candidates(r: _Req, now: float) -> list[_Cluster]:
        alive = [c for c in clusters.values() if c.alive]
        if len(alive) <= PREFILTER_ABOVE:
            return alive
        if routing == "random":
            return [rng.choice(alive)]
        near: list[_Cluster] = []
        for h in reversed(r.hashes or ()):  # the clusters that served this prompt's deepest known prefix
            if h in served_at:
                held = sorted(c for c in served_at[h] if clusters[c].alive)
                near = [clusters[c] for c in (rng.sample(held, NEAR) if len(held) > NEAR else held)]
                break
        idle = [c for c in alive if c.running is None and not c.queue]
        extra = rng.sample(idle, min(8, len(idle))) if idle else heapq.nsmallest(
            8, alive, key=lambda c: c.busy_until + c.queued_tokens / cost.prefill_tps)
        seen = {c.id for c in near}
        return near + [c for c in extra if c.id not in seen]

    def assign(i: int, now: float, exclude: Sequence[str] = ()) -> None:
        nonlocal refused
        r = rs[i]
        if r.hashes is None:  # the prompt itself is rebuilt when it starts: a long queue holds hashes only
            r.hashes = block_hashes(prompt_tokens(r.trace, VOCAB, r.salt), BLOCK, KEY)
        n = r.trace.input_length
        if routing == "first-block":  # rendezvous over the whole fleet, once per first block and fleet
            alive = [c.id for c in clusters.values() if c.alive and c.id not in exclude]
            key = (r.hashes[0] if r.hashes else -i, len(alive), tuple(exclude))  # clusters only ever die
            if key not in first_block and alive:
                first_block[key] = place(n, r.hashes, [ClusterPicture(a, ()) for a in alive], BLOCK,
                                         policy=routing, fallback_key=str(i)).cluster
            pool = [clusters[first_block[key]]] if alive else []
        else:
            pool = [c for c in candidates(r, now) if c.id not in exclude]
        if not pool:
            refused += 1
            return
        pics = [ClusterPicture(c.id, c.held, c.queued_tokens + max(0.0, c.busy_until - now) * cost.prefill_tps,
                               cost.prefill_tps, recent.get(c.id)) for c in pool]
        shared.observe(r.hashes)
        got = place(n, r.hashes, pics, BLOCK, policy=routing, rng=rng, fallback_key=str(i), shared=shared)
        c = clusters[got.cluster]
        recent.add(c.id, n - got.cached_tokens)
        r.cluster = c.id
        if routing == "prefix-load" and len(clusters) > PREFILTER_ABOVE:
            for h in r.hashes:
                served_at.setdefault(h, set()).add(c.id)
        c.queue.append(i)
        c.queued_tokens += n
        if c.running is None:
            start(c, now)

    def start(c: _Cluster, now: float) -> None:
        nonlocal seq, refused
        while c.queue:
            i = c.queue.popleft()
            r = rs[i]
            c.queued_tokens -= r.trace.input_length
            r.tokens = prompt_tokens(r.trace, VOCAB, r.salt)
            hit = c.cache.lookup(r.tokens)
            fresh = -(-len(r.tokens) // c.cache.policy.page_size) - len(hit.pages)
            if c.slots.num_free < 1 or c.pages.num_free < fresh:
                c.cache.evict(pages_needed=fresh, slots_needed=1)
            if c.slots.num_free < 1 or c.pages.num_free < fresh:  # larger than the cluster's whole pool
                c.pages.decref(hit.pages)
                c.cache.release(hit)
                refused += 1
                r.tokens = None
                continue
            slot = c.slots.alloc()
            pages = list(hit.pages) + c.pages.alloc(fresh)
            c.cache.release(hit)
            bounds = c.cache.checkpoint_boundaries(len(r.tokens), hit.num_tokens, hit.matched_blocks * BLOCK)
            r.cached = hit.num_tokens
            c.computed += len(r.tokens) - hit.num_tokens
            done = now + cost.prefill_s(len(r.tokens) - hit.num_tokens, hit.num_tokens)
            c.running, c.busy_until = (i, slot, pages, bounds), done
            heapq.heappush(events, (done, seq, _DONE, c.id))
            seq += 1
            return

    def finish(c: _Cluster, now: float) -> None:
        i, slot, pages, bounds = c.running
        r = rs[i]
        ckpts = {}
        for b in bounds:
            if c.slots.num_free < 1:
                c.cache.evict(slots_needed=1)
            s = c.slots.alloc()
            if s is not None:
                ckpts[b] = s
        c.cache.register(r.tokens, pages, ckpts, anonymous_identity(r.tokens))
        c.pages.decref(pages)
        c.slots.free(slot)
        c.running = None
        r.ttft_s = now - r.trace.arrival_s
        r.tokens = None  # the prompt is rebuilt if it ever fails over again; keeps memory bounded
        start(c, now)

    while events:
        now, _, kind, what = heapq.heappop(events)
        if kind == _ARRIVE:
            assign(what, now)
        elif kind == _DONE:
            c = clusters[what]
            if c.alive:
                finish(c, now)
        else:
            c = clusters[what]
            c.alive = False
            computed_at_kill = {k: v.computed for k, v in clusters.items()}
            lost = ([c.running[0]] if c.running else []) + list(c.queue)
            c.queue.clear()
            c.running = None
            for i in lost:  # failover: the same policy over the survivors, from scratch
                moved += 1
                rs[i].tokens = None
                assign(i, now, exclude=(c.id,))
    return _figures(rs, clusters, spec, routing, slo_s, refused, kill, moved, computed_at_kill,
                    time.monotonic() - started)


def _figures(rs: list[_Req], clusters: dict[str, _Cluster], spec: FleetSpec, routing: str, slo_s: float,
             refused: int, kill, moved: int, computed_at_kill: dict[str, int], wall_s: float) -> dict:
    done = [r for r in rs if r.ttft_s >= 0]
    prompt = sum(r.trace.input_length for r in rs)
    ideal, _ = ideal_reuse(r.trace if not r.salt else _salted(r) for r in rs)
    ttft = np.array([r.ttft_s for r in done]) if done else np.zeros(1)
    loads = [c.computed for c in clusters.values()]
    mean = sum(loads) / len(loads)
    out = {"policy": routing, "clusters": spec.clusters, "requests": len(rs), "completed": len(done),
           "refused": refused, "reuse": round(sum(r.cached for r in done) / prompt, 4),
           "ideal_reuse": round(ideal / prompt, 4),
           "load_max_over_mean": round(max(loads) / mean, 3) if mean else 1.0,
           "ttft_p50_s": round(float(np.percentile(ttft, 50)), 4),
           "ttft_p90_s": round(float(np.percentile(ttft, 90)), 4),
           "ttft_p99_s": round(float(np.percentile(ttft, 99)), 4),
           "slo_s": slo_s, "slo_attainment": round(sum(r.ttft_s <= slo_s for r in done) / len(rs), 4),
           "cache_pages_per_cluster": spec.pages, "checkpoint_slots_per_cluster": spec.slots,
           "wall_s": round(wall_s, 2)}
    out["reuse_of_ideal"] = round(out["reuse"] / out["ideal_reuse"], 4) if out["ideal_reuse"] else None
    if kill is not None:
        gained = [clusters[k].computed - computed_at_kill.get(k, 0) for k in clusters if k != kill[0]]
        g_mean = sum(gained) / len(gained) if gained else 0
        out["spill"] = {"cluster": kill[0], "at_s": kill[1], "requests_moved": moved,
                        "survivor_load_after_max_over_mean": round(max(gained) / g_mean, 3) if g_mean else None}
    return out


def _salted(r: _Req) -> TraceRequest:
    """Copies of the trace share no prefix: their ids made distinct for the ideal."""
    from dataclasses import replace

    return replace(r.trace, hash_ids=tuple((r.salt << 40) | h for h in r.trace.hash_ids))
