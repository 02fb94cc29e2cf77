"""Placement of requests without a session id (router/placement.py): least expected TTFT from the published
prefix maps and queued work, near-ties by rendezvous on the matched prefix, failover by the same policy."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from k3serve.engine.block_hash import block_hashes, prefix_key
from k3serve.router.placement import ClusterPicture, cached_tokens, place
from k3serve.router.prefix_map import PrefixMap, decode, encode

BS = 512
IDS = [f"c{i}" for i in range(3)]


def prompt(rng: random.Random, system: list[int], n: int) -> list[int]:
    return system + [rng.randrange(1, 1000) for _ in range(n)]


def test_cached_tokens_is_the_deepest_held_block_end_before_the_last_token():
    hs = list(range(100, 104))  # four full blocks
    assert cached_tokens(hs, {100, 102}, 4 * BS + 7, BS) == 3 * BS
    assert cached_tokens(hs, {103}, 4 * BS, BS) == 0  # a hit must leave the last token to compute
    assert cached_tokens(hs, {103}, 4 * BS + 1, BS) == 4 * BS
    assert cached_tokens([], {1}, 10, BS) == 0


def test_least_expected_ttft_weighs_cache_against_queued_work():
    hs = list(range(10, 18))  # 8 blocks, 4,100 tokens
    n = 8 * BS + 4
    pics = [ClusterPicture("c0", set(hs[:6]), 0, 1000), ClusterPicture("c1", set(), 0, 1000),
            ClusterPicture("c2", set(hs[:2]), 0, 1000)]
    got = place(n, hs, pics, BS)
    assert got.cluster == "c0" and got.cached_tokens == 6 * BS and got.ranked[1:] == ("c2", "c1")
    # the cache-holder is busy with more than what it saves: the empty cluster wins
    busy = [ClusterPicture("c0", set(hs[:6]), 20_000, 1000), pics[1], ClusterPicture("c2", set(), 5_000, 1000)]
    assert place(n, hs, busy, BS).cluster == "c1"
    # a faster cluster is worth its missing cache
    fast = [ClusterPicture("c0", set(hs[:2]), 0, 1000), ClusterPicture("c1", set(), 0, 10_000)]
    assert place(n, hs, fast, BS).cluster == "c1"
    assert place(n, hs, pics, BS, exclude={"c0"}).ranked == ("c2", "c1")  # failover: same policy, the rest


def test_new_conversations_under_one_system_prompt_spread_and_turns_stay():
    """Every cluster holds the system prompt: new conversations are near-ties and spread by rendezvous on their
    own first block; a conversation's next turn is cached deeper on one cluster and goes back there."""
    rng = random.Random(1)
    system = [rng.randrange(1, 1000) for _ in range(2 * BS)]
    seed = prefix_key(42, "")
    sys_hashes = set(block_hashes(system, BS, seed))
    held = {c: set(sys_hashes) for c in IDS}
    where = Counter()
    for _ in range(300):
        p = prompt(rng, system, 3 * BS)
        hs = block_hashes(p, BS, seed)
        got = place(len(p), hs, [ClusterPicture(c, held[c]) for c in IDS], BS)
        assert got.cached_tokens == 2 * BS
        where[got.cluster] += 1
        if len(where) == 3 and sum(where.values()) == 30:
            # one conversation's next turn: its first turn is checkpointed only where it ran
            first = got.cluster
            held[first].update(hs)
            turn2 = p + [7] * 300
            again = place(len(turn2), block_hashes(turn2, BS, seed), [ClusterPicture(c, held[c]) for c in IDS],
                          BS)
            assert again.cluster == first and again.cached_tokens == len(hs) * BS
            held[first] -= set(hs) - sys_hashes
    assert max(where.values()) / (sum(where.values()) / 3) < 1.25  # rendezvous spreads equal clusters


def test_first_block_and_random_baselines():
    rng = random.Random(2)
    system = [5] * BS
    pics = [ClusterPicture(c, set()) for c in IDS]
    firsts = {place(BS + 10, block_hashes(prompt(rng, system, 10), BS, prefix_key(0, "")), pics, BS,
                    policy="first-block").cluster for _ in range(20)}
    assert len(firsts) == 1  # the old routing: one system prompt, one cluster
    picks = Counter(place(BS, [1], pics, BS, policy="random", rng=rng).cluster for _ in range(300))
    assert set(picks) == set(IDS)


def test_placement_is_deterministic_for_equal_pictures():
    """Router replicas with the same picture decide alike (no process-seeded hash, no dict order)."""
    hs = [11, 12, 13]
    a = place(3 * BS + 1, hs, [ClusterPicture(c, {11}) for c in IDS], BS)
    b = place(3 * BS + 1, hs, [ClusterPicture(c, {11}) for c in reversed(IDS)], BS)
    assert a == b


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="prefill_tps"):
        ClusterPicture("c0", set(), 0, 0)
    with pytest.raises(ValueError, match="queued_tokens"):
        ClusterPicture("c0", set(), -1, 1)
    with pytest.raises(ValueError, match="recent_tokens"):
        ClusterPicture("c0", set(), 0, 1, -1)
    with pytest.raises(ValueError, match="policy"):
        place(1, [], [ClusterPicture("c0", set())], BS, policy="nearest")
    with pytest.raises(ValueError, match="no clusters"):
        place(1, [], [ClusterPicture("c0", set())], BS, exclude={"c0"})


def test_prefix_map_round_trip(rclient, ns):
    pm = PrefixMap(rclient, ns)
    hs = {0, 1, 2**64 - 1, 0xDEADBEEF}
    assert decode(encode(hs)) == hs
    with pytest.raises(ValueError, match="uint64"):
        encode([2**64])
    pm.publish("c0", hs, ttl_s=5)
    rclient.set(pm.key("c2"), "not base64!")
    assert pm.read(["c0", "c1", "c2"]) == {"c0": frozenset(hs), "c1": frozenset(), "c2": frozenset()}
    assert pm.touch("c0", 5) and not pm.touch("c1", 5)
    pm.clear("c0")
    assert pm.read(["c0"]) == {"c0": frozenset()}


def test_placer_counts_its_own_sends_from_the_decision_until_the_first_token(rclient, ns):
    """A heartbeat is up to a beat old: a burst of equal requests spreads because the router counts the prefill
    work it has placed (from the decision on) and not yet seen a first token of; the count goes back to zero."""
    from k3serve.router.anonymous import AnonymousPlacer
    from k3serve.router.membership import ClusterInfo, MembershipSnapshot

    now = [0.0]
    placer = AnonymousPlacer(PrefixMap(rclient, ns), key=prefix_key(0, ""), block_size=BS, clock=lambda: now[0])
    rates = {"c0": {"prefill_tps": 500.0}, "c1": {"prefill_tps": 2000.0}, "c2": {}}  # c2: not measured yet
    snap = MembershipSnapshot(clusters=tuple(ClusterInfo(c, {}, rates[c], 0.0, True) for c in IDS),
                              stale=False, fetched_at=0.0, server_time=0.0)
    placer.refresh(snap)
    p = [1] * 400  # no full block: no prefix to follow
    got = [placer.choose(p, "", IDS, request_id=f"r{i}").cluster for i in range(3)]
    # c2 counts at the fleet's median rate (2000): the two fast clusters take the burst, one each first; then
    # both are past the load bound (1.25 x the mean of 267 placed tokens) and the slow one takes the third
    assert set(got[:2]) == {"c1", "c2"} and got[2] == "c0"
    for i in range(3):
        placer.first_token(f"r{i}")
        placer.first_token(f"r{i}")  # idempotent (the stream's end reports it again)
    now[0] += 3600.0  # the recent load decayed away
    assert placer.choose(p, "", IDS, request_id="r9").cluster == got[0]  # nothing queued any more
    placer.refused("r9")


def test_placer_follows_a_prefix_it_sent_before_the_cluster_publishes_it(rclient, ns):
    """The clusters' maps lag a heartbeat and a refresh: a conversation's second request right behind its first
    goes where the first was sent (its prefix pending there), until the publish lag has passed."""
    from k3serve.router.anonymous import AnonymousPlacer
    from k3serve.router.membership import ClusterInfo, MembershipSnapshot

    now = [0.0]
    placer = AnonymousPlacer(PrefixMap(rclient, ns), key=prefix_key(0, ""), block_size=BS, publish_lag_s=2.0,
                             clock=lambda: now[0])
    snap = MembershipSnapshot(clusters=tuple(ClusterInfo(c, {}, {"prefill_tps": 1000.0}, 0.0, True) for c in IDS),
                              stale=False, fetched_at=0.0, server_time=0.0)
    placer.refresh(snap)
    rng = random.Random(5)
    for trial in range(6):
        first = [rng.randrange(1, 1000) for _ in range(4 * BS + 10)]
        a = placer.choose(first, "", IDS, request_id=f"a{trial}")
        placer.first_token(f"a{trial}")
        now[0] += 1.0  # within the publish lag: nothing published yet
        b = placer.choose(first + [3] * BS, "", IDS, request_id=f"b{trial}")
        assert b.cluster == a.cluster and b.cached_tokens == 4 * BS
        placer.first_token(f"b{trial}")
        now[0] += 60.0
        c = placer.choose(first + [4] * BS, "", IDS, request_id=f"c{trial}")
        assert c.cached_tokens == 0  # past the lag and never published: the record is gone
        placer.first_token(f"c{trial}")


def test_recent_sends_bookkeeping():
    from k3serve.router.recent_sends import RecentSends

    rs = RecentSends(half_life_s=10.0, publish_lag_s=1.0)
    rs.sent("r1", "c0", 1000, [7, 8], 600, now=0.0)
    rs.sent("r2", "c0", 500, [7], 500, now=0.0)
    assert rs.queued("c0") == 1500 and 8 in rs.held("c0", frozenset()) and 9 in rs.held("c0", {9})
    assert rs.recent("c0", 10.0) == pytest.approx(550) and rs.recent_total(10.0) == pytest.approx(550)
    rs.sent("r2", "c1", 500, [7], 500, now=0.0)  # a failover's choice replaces the first
    assert rs.queued("c0") == 1000 and rs.queued("c1") == 500
    rs.prefilled("r1", now=2.0)
    assert rs.queued("c0") == 0 and 7 in rs.held("c0", frozenset())
    rs.expire(2.5)
    assert 8 in rs.held("c0", frozenset())
    rs.expire(3.0)
    assert 7 not in rs.held("c0", frozenset()) and 7 in rs.held("c1", frozenset())
    rs.forget("r2")
    assert rs.queued("c1") == 0 and 7 not in rs.held("c1", frozenset())
    rs.drop_cluster("c0", now=10.0)
    assert rs.recent("c0", 10.0) == 0 and rs.recent_total(10.0) == pytest.approx(250)
    with pytest.raises(ValueError, match="half_life_s"):
        RecentSends(half_life_s=0)


def test_bounded_load_spills_a_hot_prefix_to_clusters_below_the_bound():
    """A cluster whose recent prefill tokens plus this request's would pass load_bound x the mean (plus the least
    the request adds anywhere) is no candidate: requests under its hot prefix go to the best cluster within the
    bound, and when none is within it, to the one left least loaded."""
    hs = list(range(20, 28))  # 8 blocks
    n = 8 * BS + 4
    hot = ClusterPicture("c0", set(hs[:4]), 0, 1000, recent_tokens=30_000)
    cold = [ClusterPicture("c1", set(), 0, 1000, 10_000), ClusterPicture("c2", set(hs[:1]), 0, 1000, 11_000)]
    # mean 17,000: cap 1.1 x 17,000 + 2,052 (uncached on c0) = 20,752; c0 would reach 32,052
    got = place(n, hs, [hot, *cold], BS)
    assert got.cluster == "c2" and got.cached_tokens == BS  # within the bound, the most cached
    assert place(n, hs, [hot, *cold], BS, load_bound=None).cluster == "c0"  # unbounded: the cache wins
    assert place(n, hs, [hot, *cold], BS, load_bound=2.0).cluster == "c0"  # cap 36,052
    # above the mean but within the bound, a cluster keeps what it has cached
    warm = ClusterPicture("c0", set(hs), 0, 1000, recent_tokens=12_000)
    assert place(n, hs, [warm, *cold], BS).cluster == "c0"
    # nobody within the bound (a fleet mean given): the least loaded after this request
    assert place(n, hs, [hot, *cold], BS, mean_recent=1.0).cluster == "c1"
    # nothing placed lately: no bound (the queue-aware choice stands)
    idle = [ClusterPicture("c0", set(hs[:4]), 0, 1000), ClusterPicture("c1", set(), 0, 1000)]
    assert place(n, hs, idle, BS).cluster == "c0"
    with pytest.raises(ValueError, match="load_bound"):
        place(n, hs, [hot], BS, load_bound=0.9)
