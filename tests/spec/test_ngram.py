"""The n-gram (prompt lookup) drafter: longest suffix match, latest occurrence, incremental index."""

import pytest

from k3serve.engine.spec.ngram import NgramConfig, NgramDrafter


def test_proposes_the_continuation_of_the_latest_longest_match():
    d = NgramDrafter(NgramConfig(min_n=2, max_n=3))
    ctx = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 6, 2, 3]
    s = d.open("r", ctx)
    # suffix (2, 3): its latest earlier end is after "1 2 3" at index 9 -> continuation 7, 8, 6
    assert s.propose(ctx, 3).tokens == (7, 8, 6)
    ctx2 = ctx + [7]  # suffix (2, 3, 7) of length 3 wins over the shorter ones
    assert s.propose(ctx2, 2).tokens == (8, 6)


def test_no_match_and_periodic_continuation_at_the_context_end():
    s = NgramDrafter(NgramConfig(min_n=2, max_n=2)).open("r", [1, 2, 3])
    assert s.propose([1, 2, 3], 4).tokens == ()
    ctx = [5, 6, 5, 6]
    s = NgramDrafter(NgramConfig(min_n=2, max_n=2)).open("r", ctx)
    assert s.propose(ctx, 4).tokens == (5, 6, 5, 6)  # what followed (5, 6) at 0..1, then its repetition


def test_incremental_equals_fresh_and_a_rewritten_context_rebuilds():
    import random

    rng = random.Random(0)
    ctx = [rng.randrange(4) for _ in range(60)]
    inc = NgramDrafter().open("a", ctx[:10])
    for n in range(10, 60):
        fresh = NgramDrafter().open("b", ctx[:n])
        assert inc.propose(ctx[:n], 5) == fresh.propose(ctx[:n], 5)
    other = [3, 3, 1, 0, 2, 1, 0, 2]
    assert inc.propose(other, 3) == NgramDrafter().open("c", other).propose(other, 3)


def test_bad_config_names_the_fields():
    with pytest.raises(ValueError, match="min_n"):
        NgramConfig(min_n=3, max_n=2)
