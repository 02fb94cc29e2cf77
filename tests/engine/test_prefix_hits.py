"""Prefix-cache hits give exactly the tokens of a cold run, and never resume past a KDA checkpoint."""

from __future__ import annotations

import pytest
import torch

from k3serve.disagg.pipeline import LocalPipeline
from k3serve.contracts.requests import PrefillRequest
from k3serve.contracts.sampling import SamplingParams
from tests.exactness import SEEDS

PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)


@pytest.fixture(params=SEEDS)
def seed(request, pipe) -> int:
    """Each case runs over SEEDS (prompts drawn from seed * 1000 + the case's own offsets), each from an empty
    prefix cache."""
    pipe.prefill.cache.clear()
    return request.param


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def pipe(tiny_ckpt):
    with LocalPipeline(tiny_ckpt) as p:
        yield p


def _run(pipe, rid, prompt, session):
    out = pipe.generate([PrefillRequest(rid, tuple(prompt), PARAMS, session_id=session)])[rid]
    assert out.error is None
    return out


def _checkpoint_depths(pipe):
    return {c.num_tokens for c in pipe.prefill.cache.checkpoints()}


def test_second_turn_and_shared_system_prompt(pipe, tiny_refs, seed):
    system = _tokens(1100, seed=1 + 1000 * seed)
    turn1 = system + _tokens(60, seed=2 + 1000 * seed)
    out1 = _run(pipe, "a1", turn1, "A")
    assert out1.cached_tokens == 0
    tiny_refs.check(turn1, PARAMS, out1.token_ids, label='out1')
    assert 1024 in _checkpoint_depths(pipe)

    turn2 = turn1 + out1.token_ids + _tokens(30, seed=3 + 1000 * seed)
    out2 = _run(pipe, "a2", turn2, "A")
    assert out2.cached_tokens == 1024
    tiny_refs.check(turn2, PARAMS, out2.token_ids, label='out2')

    other = system + _tokens(40, seed=4 + 1000 * seed)  # another session sharing the system prompt
    out3 = _run(pipe, "b1", other, "B")
    assert out3.cached_tokens == 1024
    tiny_refs.check(other, PARAMS, out3.token_ids, label='out3')


def test_prompt_ending_on_a_block_boundary(pipe, tiny_refs, seed):
    prompt = _tokens(1024, seed=10 + 1000 * seed)
    cold = _run(pipe, "e1", prompt, "E")
    again = _run(pipe, "e2", prompt, "E")
    # the whole prompt is cached, but the engine needs the last token's logits: resume strictly below the end
    assert again.cached_tokens < 1024 and again.cached_tokens % 512 == 0
    assert again.token_ids == cold.token_ids  # the same engine path (a hit at 512 is on both runs' chunk grid)
    tiny_refs.check(prompt, PARAMS, cold.token_ids, label='cold')
    longer = prompt + _tokens(7, seed=11 + 1000 * seed)
    hit = _run(pipe, "e3", longer, "E")
    assert hit.cached_tokens == 1024
    tiny_refs.check(longer, PARAMS, hit.token_ids, label='hit')


def test_prompt_shorter_than_a_block_never_hits(pipe, tiny_refs, seed):
    prompt = _tokens(300, seed=20 + 1000 * seed)
    assert _run(pipe, "s1", prompt, "S").cached_tokens == 0
    out = _run(pipe, "s2", prompt, "S")
    assert out.cached_tokens == 0
    tiny_refs.check(prompt, PARAMS, out.token_ids, label='out')


def test_hit_is_clamped_to_the_deepest_checkpoint(pipe, tiny_refs, seed):
    # a 2600-token prompt caches blocks 0..4 (2560 tokens) but checkpoints only its turn boundary (2560);
    # a prompt sharing only its first 1600 tokens matches 3 blocks, and no checkpoint lies inside them
    base = _tokens(2600, seed=30 + 1000 * seed)
    _run(pipe, "k1", base, "K")
    assert 2560 in _checkpoint_depths(pipe) and 1536 not in _checkpoint_depths(pipe)
    fork = base[:1600] + _tokens(100, seed=31 + 1000 * seed)
    out = _run(pipe, "k2", fork, "K2")
    assert out.cached_tokens == 0
    tiny_refs.check(fork, PARAMS, out.token_ids, label='out')
    # the fork's own turn boundary (1536) is now a checkpoint: a continuation of the fork hits there
    cont = fork + _tokens(10, seed=32 + 1000 * seed)
    out = _run(pipe, "k3", cont, "K2")
    assert out.cached_tokens == 1536
    tiny_refs.check(cont, PARAMS, out.token_ids, label='out')


def test_branch_point_checkpoint_lets_the_third_conversation_hit_the_shared_prefix(pipe, tiny_refs):
    """A shared 1K prefix with distinct suffixes, through the real prefill engine: the first conversation
    checkpoints only its own block ends; the second diverges after the shared part and saves a checkpoint at that
    branch point; the third resumes there, with exactly the tokens of a cold run. (Suffixes of 600 tokens keep
    the CPU run short; test_prefix_sharing.py runs the 1K + 3K case through the cache.)"""
    pipe.prefill.cache.clear()
    seed = 0
    shared = _tokens(1024, seed=11 + 1000 * seed)
    outs = []
    for i in range(3):
        prompt = shared + _tokens(600, seed=12 + i + 1000 * seed)
        outs.append(_run(pipe, f"c{i}", prompt, ""))
        if i == 2:
            tiny_refs.check(prompt, PARAMS, outs[-1].token_ids, label="third")
    assert [o.cached_tokens for o in outs] == [0, 0, 1024]
    assert pipe.prefill.cache.stats()["shared_checkpoints"] == 1


def test_a_prompt_sent_with_the_one_it_continues_waits_for_its_checkpoint(pipe, tiny_refs):
    """Two prompts in one batch, the second extending the first: the second starts after the first registered
    its turn-end checkpoint (1024) and resumes there, with a cold run's tokens; an unrelated third prompt in the
    batch does not wait. Before, all three started together and the second restored nothing."""
    pipe.prefill.cache.clear()
    first = _tokens(1100, seed=21)
    second = first + _tokens(200, seed=22)
    other = _tokens(1100, seed=23)
    reqs = [PrefillRequest(rid, tuple(p), PARAMS) for rid, p in (("first", first), ("second", second),
                                                                 ("other", other))]
    outs = pipe.generate(reqs)
    assert [outs[r].cached_tokens for r in ("first", "second", "other")] == [0, 1024, 0]
    tiny_refs.check(second, PARAMS, outs["second"].token_ids, label="second")
    assert not pipe.prefill.running and not pipe.prefill.waiting and not pipe.prefill._queued
