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


def test_placer_counts_its_own_sends_until_the_first_token(rclient, ns):
    """A heartbeat is up to a beat old: a burst of equal requests spreads because the router counts the prefill
    work it has sent and not yet seen a first token of; the count goes back to zero."""
    from k3serve.router.anonymous import AnonymousPlacer
    from k3serve.router.membership import ClusterInfo, MembershipSnapshot

    placer = AnonymousPlacer(PrefixMap(rclient, ns), key=prefix_key(0, ""), block_size=BS)
    rates = {"c0": {"prefill_tps": 500.0}, "c1": {"prefill_tps": 2000.0}, "c2": {}}  # c2: not measured yet
    snap = MembershipSnapshot(clusters=tuple(ClusterInfo(c, {}, rates[c], 0.0, True) for c in IDS),
                              stale=False, fetched_at=0.0, server_time=0.0)
    placer.refresh(snap)
    p = [1] * 600
    got = []
    for _ in range(3):
        c = placer.choose(p, "", IDS).cluster
        placer.sent(c, len(p))
        got.append(c)
    # c2 counts at the fleet's median rate (2000): the two fast clusters take the burst, one each first; then
    # both are over their share of the recent prefill work (the load bound) and the slow one takes the third
    assert set(got[:2]) == {"c1", "c2"} and got[2] == "c0"
    for c in got:
        placer.first_token(c, len(p))
    assert placer.choose(p, "", IDS).cluster == got[0]  # nothing queued any more


def test_recent_load_halves_every_half_life_and_shared_prefixes_need_two_continuations():
    from k3serve.router.load_bound import RecentLoad, SharedPrefixes

    load = RecentLoad(half_life=4)
    load.add("c0", 1000)
    for _ in range(4):
        load.add("c1", 0)
    assert load.get("c0") == pytest.approx(500) and load.get("c2") == 0
    many = RecentLoad(half_life=1)
    for _ in range(2000):  # renormalises instead of overflowing
        many.add("c0", 1)
    assert many.get("c0") == pytest.approx(2.0)
    shared = SharedPrefixes(capacity=3)
    shared.observe([1, 2, 3])
    shared.observe([1, 2, 3, 4])  # the same conversation going on: nothing shared
    assert 1 not in shared and 2 not in shared and 3 not in shared
    shared.observe([1, 5])  # a second continuation of prefix 1
    assert 1 in shared and len(shared) == 1
    shared.observe([7, 8])
    shared.observe([9, 10])  # LRU of 3 prefix hashes: 2 and 3 forgotten first
    assert 1 in shared
    shared.observe([19, 20])
    assert 1 not in shared


def test_the_load_bound_moves_shared_prefix_requests_and_never_a_conversations_own_turn():
    """c0 holds the system prompt and has taken far more than its share: a new conversation under the (shared)
    system prompt goes to the cheapest cluster under the bound; a turn whose restore is its own history stays."""
    seed = prefix_key(3, "")
    system = [11] * (2 * BS)
    conv = system + [12] * (2 * BS) + [13] * 40
    other = system + [14] * (2 * BS) + [15] * 40
    hs, hs_other = block_hashes(conv, BS, seed), block_hashes(other, BS, seed)
    shared = {hs[1]}  # the system prompt's last block: two different next blocks seen
    held = {"c0": set(hs) | set(hs_other[:2]), "c1": {hs[0]}, "c2": set()}

    def pics(recent):
        return [ClusterPicture(c, held[c], 0, 1000, recent[c]) for c in IDS]

    busy = {"c0": 90_000, "c1": 5_000, "c2": 5_000}
    new = system + [16] * (2 * BS) + [17] * 40
    got = place(len(new), block_hashes(new, BS, seed), pics(busy), BS, shared=shared)
    assert got.cluster == "c1" and got.cached_tokens == BS  # the cheapest under the bound
    assert place(len(new), block_hashes(new, BS, seed), pics(busy), BS, shared=shared, load_slack=None).cluster \
        == "c0"  # without the bound: affinity
    turn = conv + [18] * BS
    again = place(len(turn), block_hashes(turn, BS, seed), pics(busy), BS, shared=shared)
    assert again.cluster == "c0" and again.cached_tokens == 4 * BS  # its own history: never moved
    even = {"c0": 5_500, "c1": 5_000, "c2": 5_000}  # within 1.1x its share
    assert place(len(new), block_hashes(new, BS, seed), pics(even), BS, shared=shared).cluster == "c0"
    # rates: c0 twice as fast as the others takes twice the tokens before it is over the bound
    fast = [ClusterPicture("c0", held["c0"], 0, 2000, 9_000), ClusterPicture("c1", held["c1"], 0, 1000, 5_000),
            ClusterPicture("c2", held["c2"], 0, 1000, 5_000)]
    assert place(len(new), block_hashes(new, BS, seed), fast, BS, shared=shared).cluster == "c0"
