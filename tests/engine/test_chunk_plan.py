import pytest

from k3serve.engine.chunk_plan import ChunkCandidate, ChunkWork, plan_chunks


def test_short_requests_go_first_and_long_keeps_a_share():
    long = ChunkCandidate("long", True, 0, 100_000, ())
    shorts = [ChunkCandidate(f"s{i}", False, 0, 600, ()) for i in range(5)]
    plan = plan_chunks([long, *shorts], token_budget=2048, long_min_share=0.25)
    assert sum(w.num_tokens for w in plan) == 2048
    served = [w.request_id for w in plan]
    # 1536 tokens for shorts: s0 s1 whole, s2 partially; long gets its 512 reserve
    assert served[:3] == ["s0", "s1", "s2"]
    assert plan[2] == ChunkWork("s2", 0, 336)
    assert plan[-1] == ChunkWork("long", 0, 512)


def test_long_gets_only_its_share_when_shorts_ran():
    long = ChunkCandidate("long", True, 0, 100_000, ())
    plan = plan_chunks([long, ChunkCandidate("s", False, 0, 100, ())], token_budget=2048, long_min_share=0.25)
    assert plan == [ChunkWork("s", 0, 100), ChunkWork("long", 0, 512)]


def test_long_gets_leftover_budget_when_alone():
    plan = plan_chunks([ChunkCandidate("long", True, 1000, 100_000, ())], token_budget=2048)
    assert plan == [ChunkWork("long", 1000, 3048)]


def test_chunks_stop_at_checkpoint_boundaries():
    c = ChunkCandidate("r", False, 100, 1300, (512, 1024))
    plan = plan_chunks([c], token_budget=4096)
    assert plan == [ChunkWork("r", 100, 512), ChunkWork("r", 512, 1024), ChunkWork("r", 1024, 1300)]


def test_budget_exhaustion_resumes_next_step():
    c = ChunkCandidate("r", False, 0, 5000, ())
    assert plan_chunks([c], token_budget=2048) == [ChunkWork("r", 0, 2048)]



def test_long_step_tokens_caps_long_only_steps():
    c = ChunkCandidate("long", True, 4000, 100_000, ())
    assert plan_chunks([c], token_budget=2048, long_step_tokens=64) == [ChunkWork("long", 4000, 4064)]


def test_long_step_tokens_caps_the_share_next_to_shorts_and_shorts_get_the_rest():
    long = ChunkCandidate("long", True, 0, 100_000, ())
    short = ChunkCandidate("s", False, 0, 5000, ())
    plan = plan_chunks([long, short], token_budget=2048, long_min_share=0.25, long_step_tokens=64)
    assert plan == [ChunkWork("s", 0, 1984), ChunkWork("long", 0, 64)]


def test_long_step_tokens_must_be_positive():
    import pytest

    with pytest.raises(ValueError, match="long_step_tokens"):
        plan_chunks([ChunkCandidate("long", True, 0, 10, ())], token_budget=16, long_step_tokens=0)


def test_grid_puts_every_unfinished_chunk_end_on_it():
    """numerics: deterministic: chunk ends on multiples of the grid, except where the prompt ends."""
    c = ChunkCandidate("a", False, 0, 300, ())
    assert [(w.start, w.end) for w in plan_chunks([c], 100, grid=64)] == [(0, 64)]
    c = ChunkCandidate("a", False, 256, 300, ())
    assert [(w.start, w.end) for w in plan_chunks([c], 100, grid=64)] == [(256, 300)]
    with pytest.raises(ValueError, match="grid"):
        plan_chunks([c], 32, grid=64)
