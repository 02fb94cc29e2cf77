"""Shared prefixes in the hybrid prefix cache: branch-point checkpoints, value-based budgeting over the slot pool,
the per-identity cap as a fairness guard only, and an eviction fuzz over many identities sharing prefixes."""

import random

import pytest

from k3serve.contracts.prefix_policy import PrefixCachePolicy
from k3serve.engine.prefix_cache import checkpoint_scores
from tests.engine.test_prefix_cache import Sim, _check_ownership

BS = 512


def real_policy(**kw) -> PrefixCachePolicy:
    return PrefixCachePolicy(**dict(dict(hash_block_size=BS, page_size=4), **kw))  # the Sim's 4-token pages


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 50_000) for _ in range(n)]


def test_branch_point_is_a_boundary_and_survives_the_cap():
    p = PrefixCachePolicy(checkpoint_every_blocks=2, max_checkpoints_per_session=2)
    assert p.checkpoint_boundaries(4096, 0, 1024) == [1024, 4096]  # deepest of 1024..4096 by 2 is cut to 1
    assert p.checkpoint_boundaries(4096, 0, 0) == [3072, 4096]
    assert p.checkpoint_boundaries(4096, 1024, 1024) == [3072, 4096]  # already the hit: nothing to add
    assert p.checkpoint_boundaries(4096, 0, 4096) == [3072, 4096]  # the whole prompt matched: no branch
    assert PrefixCachePolicy(scheme="naive").checkpoint_boundaries(8192, 0, 1024) == [4096, 8192]
    with pytest.raises(ValueError, match="branch_tokens"):
        p.checkpoint_boundaries(10, 0, -1)


def test_third_conversation_under_a_shared_1k_prefix_resumes_at_its_end():
    rng = random.Random(3)
    sim = Sim(real_policy(), num_pages=4 * 1024, num_slots=32)
    shared = rand_tokens(rng, 1024)
    hits = [sim.prefill(shared + rand_tokens(rng, 3072), f"anon{i}")[0].num_tokens for i in range(3)]
    assert hits == [0, 0, 1024]
    shared_ck = [c for c in sim.cache.checkpoints() if c.num_tokens == 1024]
    assert len(shared_ck) == 1 and sim.cache.stats()["shared_checkpoints"] == 1
    sim.cache.check_invariants()


def test_shared_checkpoint_is_not_charged_to_its_registrant():
    """With a cap of one checkpoint per identity, the identity that registered a branch point keeps its own turn
    checkpoint as well: the shared one is charged to nobody, so its later turns cannot evict it."""
    rng = random.Random(4)
    sim = Sim(real_policy(max_checkpoints_per_session=1), num_pages=4 * 1024, num_slots=32)
    shared = rand_tokens(rng, 1024)
    sim.prefill(shared + rand_tokens(rng, 1024), "a")
    convo = shared + rand_tokens(rng, 1024)
    sim.prefill(convo, "b")  # branches after the shared part: the checkpoint at 1024 becomes shared
    for _ in range(3):  # b's next turns, each over b's cap of one
        convo = convo + rand_tokens(rng, 600)
        sim.prefill(convo, "b")
    assert 1024 in {c.num_tokens for c in sim.cache.checkpoints()}
    assert len([c for c in sim.cache.checkpoints("b") if c.num_tokens != 1024]) == 1
    assert sim.probe(shared + rand_tokens(rng, 700)).num_tokens == 1024
    sim.cache.check_invariants()


def test_eviction_keeps_the_checkpoint_that_serves_continuations():
    # equally recent and deep: the one that served more hits is worth more
    s = checkpoint_scores([5, 5], [1024, 1024], 1.0, [0, 9], 1.0)
    assert s[1] > s[0]
    assert checkpoint_scores([5, 5], [1024, 1024], 1.0, [0, 9], 0.0) == [2.0, 2.0]
    with pytest.raises(ValueError, match="differ"):
        checkpoint_scores([1], [1], 1.0, [1, 2], 1.0)
    rng = random.Random(5)
    sim = Sim(real_policy(eviction_alpha=0.0, eviction_beta=2.0), num_pages=8 * 1024, num_slots=8)
    hot = rand_tokens(rng, 1024)
    sim.prefill(hot, "hot")
    for _ in range(4):
        sim.probe(hot + rand_tokens(rng, 100))
    for i in range(3):
        sim.prefill(rand_tokens(rng, 1024), f"cold{i}")
    assert sim.cache.evict(slots_needed=sim.slots.num_free + 3)
    assert sim.probe(hot + [1]).num_tokens == 1024  # the cold, newer ones went first


@pytest.mark.parametrize("seed", range(4))
def test_eviction_fuzz_many_identities_share_prefixes(seed):
    """Anonymous traffic: every request its own identity, prompts under a few shared system prompts that branch
    and continue; tight pools. The cache's invariants and the page/slot ownership hold after every step, no
    identity exceeds its cap, and everything is returned at the end."""
    rng = random.Random(seed)
    bs = 8
    sim = Sim(PrefixCachePolicy(hash_block_size=bs, page_size=4, checkpoint_every_blocks=2,
                                max_checkpoints_per_session=2), num_pages=80, num_slots=12, seed=seed)
    systems = [rand_tokens(rng, bs * k + rng.randrange(bs)) for k in (1, 2, 3)]
    convos: list[list[int]] = []
    held = []
    for step in range(500):
        op = rng.random()
        if op < 0.6:
            if convos and rng.random() < 0.5:
                prompt = rng.choice(convos) + rand_tokens(rng, rng.randrange(1, 2 * bs))
            else:
                prompt = rng.choice(systems) + rand_tokens(rng, rng.randrange(1, 3 * bs))
            prompt = prompt[:12 * bs]
            if sim.prefill(prompt, f"r{step}", rid=step, keep=rng.random() < 0.3) is not None:
                convos.append(prompt)
                convos = convos[-20:]
        elif op < 0.72 and sim.running:
            sim.finish(rng.choice(list(sim.running)))
        elif op < 0.8 and convos:
            t = rng.choice(convos)
            hit = sim.cache.lookup(t)
            sim.check_hit(t, hit)
            held.append(hit)
        elif op < 0.9 and held:
            hit = held.pop(rng.randrange(len(held)))
            sim.cache.release(hit)
            sim.pages.decref(hit.pages)
        else:
            sim.cache.evict(pages_needed=rng.randrange(sim.pages.capacity + 1),
                            slots_needed=rng.randrange(sim.slots.capacity + 1))
        _check_ownership(sim, held)
    assert sim.cache.stats()["hits"] > 0 and sim.cache.stats()["evicted_checkpoints"] > 0
    sim.drain(held)
    assert sim.full()
