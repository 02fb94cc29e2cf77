"""Hybrid prefix cache: clamped lookup, checkpoint placement, per-session budget, eviction, ownership."""

import random
from collections import Counter

import pytest

from k3serve.engine.block_hash import prefix_key
from k3serve.engine.allocators import PageAllocator, SlotAllocator
from k3serve.contracts.prefix_policy import PrefixCachePolicy
from k3serve.engine.prefix_cache import HybridPrefixCache, PrefixHit, checkpoint_scores

BS, PS = 8, 4  # tiny hash blocks and pages keep prompts short; 2 pages per block


def make_policy(**kw) -> PrefixCachePolicy:
    base = dict(scheme="k3", hash_block_size=BS, page_size=PS, checkpoint_every_blocks=8,
                max_checkpoints_per_session=4, naive_chunk=32)
    base.update(kw)
    return PrefixCachePolicy(**base)


class Sim:
    """A minimal engine around the cache, recording which prefix each page and slot holds.

    Every hit is checked against those records: a checkpoint slot or page that holds a different prefix than
    the one the hit claims is exactly the silent-corruption bug a clamped lookup must prevent.
    """

    def __init__(self, policy=None, num_pages=256, num_slots=64, seed=7):
        self.policy = policy or make_policy()
        self.pages = PageAllocator(num_pages)
        self.slots = SlotAllocator(num_slots)
        self.cache = HybridPrefixCache(self.policy, self.pages, self.slots, prefix_key(seed, "test-secret"))
        self.page_prefix: dict[int, tuple] = {}
        self.slot_prefix: dict[int, tuple] = {}
        self.running: dict[object, tuple[list[int], int]] = {}

    def check_hit(self, tokens, hit: PrefixHit) -> None:
        assert hit.num_tokens % self.policy.block_size == 0
        assert hit.num_tokens == 0 or hit.num_tokens < len(tokens)
        assert hit.num_tokens <= hit.matched_blocks * self.policy.block_size
        assert len(hit.pages) == hit.num_tokens // PS
        if hit.num_tokens:
            assert self.slot_prefix[hit.checkpoint_slot] == tuple(tokens[:hit.num_tokens])
        else:
            assert hit.checkpoint_slot is None and hit.lease is None
        for i, p in enumerate(hit.pages):
            assert self.page_prefix[p] == tuple(tokens[:(i + 1) * PS])

    def _alloc_pages(self, n):
        got = self.pages.alloc(n)
        if got is None and self.cache.evict(pages_needed=n):
            got = self.pages.alloc(n)
        return got

    def _alloc_slot(self):
        got = self.slots.alloc()
        if got is None and self.cache.evict(slots_needed=1):
            got = self.slots.alloc()
        return got

    def prefill(self, tokens, session, rid=None, boundaries=None, keep=False, salt=""):
        """lookup -> copy checkpoint -> prefill the rest -> register; returns (hit, rejected) or None if full."""
        hit = self.cache.lookup(tokens, salt)
        self.check_hit(tokens, hit)
        slot = self._alloc_slot()
        fresh = self._alloc_pages(-(-len(tokens) // PS) - len(hit.pages)) if slot is not None else None
        if fresh is None:
            self.cache.release(hit)
            self.pages.decref(hit.pages)
            if slot is not None:
                self.slots.free(slot)
            return None
        self.slot_prefix[slot] = tuple(tokens[:hit.num_tokens])  # the copy out of the checkpoint
        self.cache.release(hit)
        pages = list(hit.pages) + fresh
        for i in range(len(hit.pages), len(pages)):
            self.page_prefix[pages[i]] = tuple(tokens[:(i + 1) * PS])
        if boundaries is None:
            boundaries = self.cache.checkpoint_boundaries(len(tokens), hit.num_tokens,
                                                          hit.matched_blocks * self.policy.block_size)
        ckpts = {}
        for b in boundaries:
            s = self._alloc_slot()
            if s is not None:
                self.slot_prefix[s] = tuple(tokens[:b])
                ckpts[b] = s
        rejected = self.cache.register(tokens, pages, ckpts, session, salt)
        assert set(rejected) <= set(ckpts.values())
        assert not any(self.slots.is_used(s) for s in rejected), "rejected slots are freed by the cache"
        rid = object() if rid is None else rid
        self.running[rid] = (pages, slot)
        if not keep:
            self.finish(rid)
        return hit, rejected

    def finish(self, rid):
        pages, slot = self.running.pop(rid)
        self.pages.decref(pages)
        self.slots.free(slot)

    def probe(self, tokens) -> PrefixHit:
        """A lookup whose references are dropped at once (the hit is checked first)."""
        hit = self.cache.lookup(tokens)
        self.check_hit(tokens, hit)
        self.cache.release(hit)
        self.pages.decref(hit.pages)
        return hit

    def drain(self, held) -> None:
        """Release the held hits, finish every running request and clear the cache: all pools back to full."""
        for hit in held:
            self.cache.release(hit)
            self.pages.decref(hit.pages)
        for rid in list(self.running):
            self.finish(rid)
        self.cache.clear()

    def full(self) -> bool:
        return self.pages.num_free == self.pages.capacity and self.slots.num_free == self.slots.capacity


def toks(n, start=1):
    return list(range(start, start + n))


# ------------------------------------------------------------------------------------------------ policy
def test_policy_validation_and_properties():
    p = PrefixCachePolicy()
    assert (p.block_size, p.pages_per_block, p.checkpoint_every_blocks) == (512, 8, 8)
    n = PrefixCachePolicy(scheme="naive")
    assert (n.block_size, n.pages_per_block) == (4096, 64)
    with pytest.raises(ValueError, match="divide"):
        PrefixCachePolicy(page_size=96)
    with pytest.raises(ValueError, match="divide"):
        PrefixCachePolicy(scheme="naive", hash_block_size=512, page_size=64, naive_chunk=4000)
    with pytest.raises(ValueError, match="scheme"):
        PrefixCachePolicy(scheme="lru")
    with pytest.raises(ValueError):
        PrefixCachePolicy(max_checkpoints_per_session=0)
    with pytest.raises(ValueError):
        PrefixCachePolicy(eviction_alpha=-1.0)


def test_checkpoint_boundaries_k3():
    p = PrefixCachePolicy()
    assert p.checkpoint_boundaries(1300, 0) == [1024]  # turn boundary only
    assert p.checkpoint_boundaries(4396, 0) == [4096]  # the 8th block end is also the last one
    assert p.checkpoint_boundaries(5096, 0) == [4096, 4608]
    assert p.checkpoint_boundaries(10000, 0) == [4096, 8192, 9728]
    assert p.checkpoint_boundaries(10000, 8192) == [9728]
    assert p.checkpoint_boundaries(8192, 0) == [4096, 8192]
    assert p.checkpoint_boundaries(1024, 512) == [1024]
    assert p.checkpoint_boundaries(16484, 4096) == [8192, 12288, 16384]
    assert p.checkpoint_boundaries(9728, 9728) == []
    assert p.checkpoint_boundaries(500, 0) == []
    # More candidates than the session budget (4): only the deepest are worth a snapshot.
    assert p.checkpoint_boundaries(40000, 0) == [28672, 32768, 36864, 39936]
    assert PrefixCachePolicy(checkpoint_every_blocks=3).checkpoint_boundaries(5000, 0) == [1536, 3072, 4608]
    cache = HybridPrefixCache(p, PageAllocator(1), SlotAllocator(1), prefix_key(0, ""))
    assert cache.checkpoint_boundaries(10000, 0) == [4096, 8192, 9728]


def test_checkpoint_boundaries_naive():
    p = PrefixCachePolicy(scheme="naive")
    assert p.checkpoint_boundaries(10000, 0) == [4096, 8192]
    assert p.checkpoint_boundaries(3000, 0) == []
    assert p.checkpoint_boundaries(12288, 4096) == [8192, 12288]
    assert p.checkpoint_boundaries(30000, 0) == [16384, 20480, 24576, 28672]


def test_checkpoint_scores_formula():
    # recency in [0, 1] + alpha * depth / max depth
    assert checkpoint_scores([1, 3], [10, 5], 1.0) == [1.0, 1.5]
    assert checkpoint_scores([1, 3], [10, 5], 0.0) == [0.0, 1.0]
    assert checkpoint_scores([2, 2], [8, 4], 2.0) == [3.0, 2.0]
    assert checkpoint_scores([], [], 1.0) == []


# ------------------------------------------------------------------------------------------------ lookup
def test_lookup_clamps_to_deepest_checkpoint_inside_the_match():
    sim = Sim()
    t = toks(5 * BS + 2)
    sim.prefill(t, "a", boundaries=[2 * BS, 4 * BS])
    hit = sim.probe(t + [900, 901, 902])
    assert hit.matched_blocks == 5 and hit.num_tokens == 4 * BS and len(hit.pages) == 4 * BS // PS
    diverged = t[:3 * BS + 3] + [500] * 20  # differs inside block 3: 3 blocks match
    hit = sim.probe(diverged)
    assert hit.matched_blocks == 3 and hit.num_tokens == 2 * BS
    assert sim.full() is False and sim.cache.stats()["checkpoints"] == 2


def test_hit_never_goes_past_the_deepest_checkpoint():
    sim = Sim()
    t = toks(5 * BS + 2)
    sim.prefill(t, "a", boundaries=[2 * BS])
    assert sim.probe(t + [7]).num_tokens == 2 * BS
    sim2 = Sim()
    sim2.prefill(t, "a", boundaries=[])
    before = [sim2.pages.refcount(p) for p in range(sim2.pages.capacity)]
    hit = sim2.cache.lookup(t + [7])
    assert (hit.num_tokens, hit.pages, hit.checkpoint_slot, hit.lease, hit.matched_blocks) == (0, (), None, None, 5)
    assert [sim2.pages.refcount(p) for p in range(sim2.pages.capacity)] == before


def test_prompt_on_a_block_boundary_resumes_strictly_below_its_end():
    t = toks(4 * BS)
    sim = Sim()
    sim.prefill(t, "a", boundaries=[2 * BS, 4 * BS])
    hit = sim.probe(t)
    assert hit.matched_blocks == 4 and hit.num_tokens == 2 * BS  # the engine needs the last token's logits
    assert sim.probe(t + [1]).num_tokens == 4 * BS
    sim2 = Sim()
    sim2.prefill(t, "a", boundaries=[4 * BS])
    assert sim2.probe(t).num_tokens == 0


def test_prompt_shorter_than_a_block_never_hits():
    sim = Sim()
    sim.prefill(toks(BS - 1), "a")
    assert sim.cache.stats()["blocks"] == 0 and sim.cache.stats()["checkpoints"] == 0
    hit = sim.probe(toks(BS - 1))
    assert hit.num_tokens == 0 and hit.matched_blocks == 0
    assert sim.probe([]).num_tokens == 0
    assert sim.full()


def test_second_turn_resumes_at_turn_one_last_block_end():
    sim = Sim()
    turn1 = toks(3 * BS + 5)
    hit1, _ = sim.prefill(turn1, "s")
    assert hit1.num_tokens == 0
    assert [c.num_tokens for c in sim.cache.checkpoints("s")] == [3 * BS]
    turn2 = turn1 + toks(6, 100) + toks(10, 200)  # + reply + next user message
    hit2, _ = sim.prefill(turn2, "s")
    assert hit2.num_tokens == 3 * BS
    turn3 = turn2 + toks(4, 300)
    hit3, _ = sim.prefill(turn3, "s")
    assert hit3.num_tokens == (len(turn2) // BS) * BS


def test_shared_system_prompt_hits_across_sessions():
    sim = Sim()
    system = toks(2 * BS, 1000)
    sim.prefill(system + toks(5, 1), "a")
    hit, _ = sim.prefill(system + toks(6, 50), "b")
    assert hit.num_tokens == 2 * BS
    assert sim.cache.session_of(hit.checkpoint_slot) == "a"  # the registering session keeps the charge
    st = sim.cache.stats()
    assert (st["lookups"], st["hits"], st["hit_tokens"]) == (2, 1, 2 * BS)


def test_naive_scheme_misses_a_short_turn_prefix_that_k3_hits():
    turn1, turn2 = toks(20), toks(28)  # turn 2 extends turn 1; both shorter than naive_chunk = 32
    k3 = Sim(make_policy(scheme="k3"))
    naive = Sim(make_policy(scheme="naive"))
    for sim in (k3, naive):
        sim.prefill(turn1, "s")
    assert k3.prefill(turn2, "s")[0].num_tokens == 16
    assert naive.prefill(turn2, "s")[0].num_tokens == 0
    # Past a whole chunk the naive scheme hits too, at chunk granularity only.
    naive.prefill(toks(40), "s")
    assert naive.prefill(toks(48), "s")[0].num_tokens == 32


def test_lookup_updates_recency_of_used_entries():
    sim = Sim()
    a, b = toks(2 * BS + 1, 1), toks(2 * BS + 1, 500)
    sim.prefill(a, "a")
    sim.prefill(b, "b")
    sim.probe(a + [3])  # a is now the most recent
    ok = sim.cache.evict(pages_needed=sim.pages.num_free + 2)
    assert ok and sim.probe(a + [3]).num_tokens == 2 * BS and sim.probe(b + [3]).num_tokens == 0


# ----------------------------------------------------------------------------------------------- register
def test_duplicate_checkpoint_is_returned_and_freed():
    sim = Sim()
    t = toks(2 * BS + 3)
    sim.prefill(t, "a")
    (kept,) = [c.slot for c in sim.cache.checkpoints()]
    pages = sim.pages.alloc(-(-len(t) // PS))
    dup = sim.slots.alloc()
    assert sim.cache.register(t, pages, {2 * BS: dup}, "b") == [dup]
    assert not sim.slots.is_used(dup) and sim.cache.session_of(kept) == "a" and sim.cache.session_of(dup) is None
    sim.pages.decref(pages)  # the blocks were cached already: the cache took no reference to these
    assert sim.pages.num_used == 2 * BS // PS


def test_register_adds_a_checkpoint_to_an_already_cached_block():
    sim = Sim()
    t = toks(4 * BS + 1)
    sim.prefill(t, "a", boundaries=[BS])
    assert sim.probe(t).num_tokens == BS
    sim.prefill(t, "b")  # resumes at BS, saves the turn boundary 4 * BS on blocks cached by "a"
    assert sim.probe(t).num_tokens == 4 * BS
    assert sim.cache.stats()["blocks"] == 4


def test_register_validation_changes_nothing():
    sim = Sim()
    t = toks(2 * BS + 1)
    pages = sim.pages.alloc(5)
    slot = sim.slots.alloc()
    before = sim.cache.stats()
    bad_calls = [
        (t, pages[:3], {}),  # pages do not cover 2 blocks
        (t, pages, {12: slot}),  # not a block end
        (t, pages, {3 * BS: slot}),  # beyond the full blocks
        (t, pages, {BS: 63}),  # slot not allocated
        (t, pages, {BS: slot, 2 * BS: slot}),  # one slot twice
        (t, [pages[0]] * 5, {}),  # one page for two positions
    ]
    for tokens, pg, ck in bad_calls:
        with pytest.raises(ValueError):
            sim.cache.register(tokens, pg, ck, "a")
    with pytest.raises(ValueError, match="not allocated"):
        sim.cache.register(t, [200] + pages[1:], {}, "a")
    assert sim.cache.stats() == before and all(sim.pages.refcount(p) == 1 for p in pages)
    assert sim.cache.register(t, pages, {2 * BS: slot}, "a") == []
    sim.cache.check_invariants()


def test_per_session_bound_evicts_the_lowest_value_checkpoint():
    sim = Sim(make_policy(max_checkpoints_per_session=2))
    sim.prefill(toks(2 * BS + 1, 5000), "other")
    t1 = toks(BS + 2)
    t2 = t1 + toks(BS, 100)
    t3 = t2 + toks(BS, 200)
    for t in (t1, t2, t3):
        sim.prefill(t, "s")
    assert [c.num_tokens for c in sim.cache.checkpoints("s")] == [2 * BS, 3 * BS]  # oldest and shallowest went
    assert [c.num_tokens for c in sim.cache.checkpoints("other")] == [2 * BS]
    assert sim.slots.num_used == 3  # the evicted checkpoint's slot is back
    assert sim.cache.stats()["evicted_checkpoints"] == 1
    sim.cache.check_invariants()


def test_over_budget_new_checkpoint_is_rejected_when_it_is_the_lowest_value():
    deep, shallow = toks(5 * BS), toks(2 * BS + 1, 700)
    heavy = Sim(make_policy(max_checkpoints_per_session=1, eviction_alpha=10.0))
    heavy.prefill(deep, "s", boundaries=[5 * BS])
    _, rejected = heavy.prefill(shallow, "s")
    assert len(rejected) == 1 and not heavy.slots.is_used(rejected[0])
    assert [c.num_tokens for c in heavy.cache.checkpoints("s")] == [5 * BS]
    assert heavy.cache.stats()["rejected_checkpoints"] == 1
    recent = Sim(make_policy(max_checkpoints_per_session=1, eviction_alpha=0.0))
    recent.prefill(deep, "s", boundaries=[5 * BS])
    assert recent.prefill(shallow, "s")[1] == []
    assert [c.num_tokens for c in recent.cache.checkpoints("s")] == [2 * BS]


# ----------------------------------------------------------------------------------------------- eviction
def _branches(sim, a_ckpt=True, b_ckpt=True):
    trunk = toks(2 * BS, 1)
    a, b = trunk + toks(BS, 100), trunk + toks(BS, 200)
    sim.prefill(a + [1], "a", boundaries=[3 * BS] if a_ckpt else [])
    sim.prefill(b + [1], "b", boundaries=[3 * BS] if b_ckpt else [])
    return trunk, a, b


def test_evict_pages_leaf_first_lru_first():
    sim = Sim()
    trunk, a, b = _branches(sim)
    assert sim.cache.stats()["blocks"] == 4 and sim.pages.num_used == 8
    assert sim.cache.evict(pages_needed=sim.pages.num_free + 2)
    assert sim.cache.stats()["blocks"] == 3  # exactly one block: a's leaf (older leaf; trunk has children)
    assert sim.probe(a + [1]).num_tokens == 0 and sim.probe(b + [1]).num_tokens == 3 * BS
    assert sim.cache.stats()["checkpoints"] == 1 and sim.slots.num_used == 1  # a's checkpoint went with it
    assert sim.cache.evict(pages_needed=sim.pages.num_free + 2)
    assert sim.probe(b + [1]).matched_blocks == 2  # b's leaf went before the trunk
    assert sim.cache.evict(pages_needed=sim.pages.capacity)
    assert sim.cache.stats()["blocks"] == 0 and sim.full()


def test_evict_takes_checkpointless_leaves_first():
    sim = Sim()
    trunk, a, b = _branches(sim, a_ckpt=True, b_ckpt=False)  # b is newer but no hit can end in its leaf
    assert sim.cache.evict(pages_needed=sim.pages.num_free + 2)
    assert sim.probe(a + [1]).num_tokens == 3 * BS and sim.probe(b + [1]).matched_blocks == 2


def test_evict_never_frees_pages_a_running_request_holds():
    sim = Sim()
    trunk = toks(2 * BS, 1)
    a, b = trunk + toks(BS, 100), trunk + toks(BS, 200)
    sim.prefill(a + [1], "a", rid="ra", keep=True)  # still running: shares the pages of trunk + a
    sim.prefill(b + [1], "b")
    assert not sim.cache.evict(pages_needed=sim.pages.capacity)
    assert sim.probe(b + [1]).matched_blocks == 2  # only b's leaf could go
    pages, _ = sim.running["ra"]
    assert all(sim.pages.refcount(p) == 2 for p in pages[:3 * BS // PS])  # cache + request, nothing stolen
    sim.finish("ra")
    assert sim.cache.evict(pages_needed=sim.pages.capacity) and sim.full()


def test_pinned_checkpoint_survives_eviction_until_released():
    sim = Sim()
    t = toks(3 * BS + 1)
    sim.prefill(t, "a")
    hit = sim.cache.lookup(t)
    assert hit.num_tokens == 3 * BS and sim.cache.checkpoints()[0].pinned
    assert not sim.cache.evict(slots_needed=sim.slots.capacity)
    assert sim.slots.is_used(hit.checkpoint_slot) and sim.cache.stats()["pinned"] == 1
    sim.pages.decref(hit.pages)  # even with no page reference left, the pinned block stays, so its chain stays
    assert not sim.cache.evict(pages_needed=sim.pages.capacity)
    assert sim.cache.stats()["blocks"] == 3
    sim.cache.release(hit)
    with pytest.raises(ValueError, match="lease"):
        sim.cache.release(hit)
    assert sim.cache.evict(slots_needed=sim.slots.capacity) and sim.cache.stats()["checkpoints"] == 0
    assert sim.cache.evict(pages_needed=sim.pages.capacity) and sim.full()


def test_evict_slots_lowest_score_first():
    sim = Sim()
    sim.prefill(toks(4 * BS + 1, 1), "a")  # older, deeper
    sim.prefill(toks(BS + 1, 500), "b")  # newer, shallow
    sim.prefill(toks(BS + 1, 900), "c")  # newest, shallow
    # scores: a = 0 + 1 = 1.0, b = 0.5 + 0.25, c = 1 + 0.25: b goes first
    assert sim.cache.evict(slots_needed=sim.slots.num_free + 1)
    assert sorted(c.session_id for c in sim.cache.checkpoints()) == ["a", "c"]
    assert sim.cache.stats()["blocks"] == 6  # slot eviction keeps the pages


def test_clear_returns_everything():
    sim = Sim(num_pages=64, num_slots=16)
    for i in range(5):
        sim.prefill(toks(3 * BS + i, 10 * i), f"s{i}")
    sim.prefill(toks(3 * BS + 2, 10), "s1", rid="r", keep=True)
    hit = sim.cache.lookup(toks(3 * BS + 3, 20))
    assert hit.num_tokens
    with pytest.raises(RuntimeError, match="unreleased"):
        sim.cache.clear()
    sim.cache.release(hit)
    sim.cache.clear()
    st = sim.cache.stats()
    assert (st["blocks"], st["checkpoints"], st["pages_held"], st["sessions"]) == (0, 0, 0, 0)
    sim.pages.decref(hit.pages)
    sim.finish("r")
    assert sim.full()
    assert sim.probe(toks(3 * BS + 3, 20)).num_tokens == 0


# ----------------------------------------------------------------------------------------------- random
def _check_ownership(sim: Sim, held_hits: list[PrefixHit]) -> None:
    sim.cache.check_invariants()
    holders = Counter(sim.cache.held_pages())
    for pages, _ in sim.running.values():
        holders.update(pages)
    for h in held_hits:
        holders.update(h.pages)
    for p in range(sim.pages.capacity):
        assert sim.pages.refcount(p) == holders[p], f"page {p}"
    cache_slots = {c.slot for c in sim.cache.checkpoints()}
    private = {s for _, s in sim.running.values()}
    assert not cache_slots & private
    used = {s for s in range(sim.slots.capacity) if sim.slots.is_used(s)}
    assert used == cache_slots | private, "a slot is both free and held, or leaked"
    for c in sim.cache.checkpoints():
        assert len(sim.slot_prefix[c.slot]) == c.num_tokens  # a checkpoint holds exactly its prefix


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("scheme", ["k3", "naive"])
def test_randomised_sessions_keep_invariants(seed, scheme):
    rng = random.Random(seed)
    sim = Sim(make_policy(scheme=scheme, checkpoint_every_blocks=2, max_checkpoints_per_session=3,
                          naive_chunk=16), num_pages=96, num_slots=20, seed=seed)
    systems = [[], toks(BS, 1), toks(2 * BS + 3, 1), toks(3 * BS, 50)]
    history: dict[str, list[int]] = {}
    held: list[PrefixHit] = []
    for step in range(400):
        op = rng.random()
        if op < 0.55:
            sid = f"s{rng.randrange(12)}"
            prompt = history.get(sid) or list(rng.choice(systems))
            prompt = prompt + [rng.randrange(4) for _ in range(rng.randrange(1, 3 * BS))]
            if len(prompt) > 20 * BS:
                prompt = prompt[:BS]  # restart long conversations to keep the pool busy but bounded
            if sim.prefill(prompt, sid, rid=step, keep=rng.random() < 0.3) is not None:
                history[sid] = prompt + [rng.randrange(4) for _ in range(rng.randrange(0, BS))]
        elif op < 0.7 and sim.running:
            sim.finish(rng.choice(list(sim.running)))
        elif op < 0.8 and history:
            t = rng.choice(list(history.values()))
            hit = sim.cache.lookup(t)
            sim.check_hit(t, hit)
            held.append(hit)  # pinned: a copy in flight
        elif op < 0.9 and held:
            hit = held.pop(rng.randrange(len(held)))
            sim.cache.release(hit)
            sim.pages.decref(hit.pages)
        elif op < 0.98:
            sim.cache.evict(pages_needed=rng.randrange(sim.pages.capacity + 1),
                            slots_needed=rng.randrange(sim.slots.capacity + 1))
        elif not held:
            sim.cache.clear()
        _check_ownership(sim, held)
    sim.drain(held)
    assert sim.full()


# ---- issue 19 #10: tenant isolation ----------------------------------------------------------------------
def test_prefixes_are_shared_only_under_the_same_tenant_salt():
    sim = Sim()
    system = toks(2 * BS, 1000)
    sim.prefill(system + toks(5, 1), "a", salt="tenant-a")
    other, _ = sim.prefill(system + toks(6, 50), "b", salt="tenant-b")
    unsalted, _ = sim.prefill(system + toks(7, 60), "c")
    same, _ = sim.prefill(system + toks(8, 70), "d", salt="tenant-a")
    assert other.num_tokens == 0 and unsalted.num_tokens == 0  # another tenant's prefix is never a hit
    assert same.num_tokens == 2 * BS  # within a tenant it is


def test_a_cache_is_keyed_not_seeded():
    """A bare integer seed (the unkeyed xxh64 chain's) is refused: every cache hashes under a prefix_key."""
    with pytest.raises(ValueError, match="key"):
        HybridPrefixCache(make_policy(), PageAllocator(4), SlotAllocator(2), 7)
