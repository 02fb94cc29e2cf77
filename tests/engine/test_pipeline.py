"""Prefill(P) -> handoff -> decode(D) against the single-process reference (issue: engines)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from k3serve.disagg.pipeline import LocalPipeline
from k3serve.contracts.requests import PrefillRequest
from k3serve.contracts.sampling import SamplingParams
from tests.exactness import SEEDS

LENGTHS = (1, 511, 512, 513, 2100)  # 2100: over the 2048-token step budget (two chunks)
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=77, max_tokens=6, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def cases(tiny_refs):
    """Every length x {greedy, seeded} x SEEDS (prompt seed; the sampling seed moves with it)."""
    out = []
    for seed in SEEDS:
        for i, n in enumerate(LENGTHS):
            p = _prompt(n, seed=1000 + i + 10_000 * seed)
            for name, params in (("greedy", GREEDY), ("seeded", replace(SEEDED, seed=SEEDED.seed + seed))):
                tiny_refs.trace(p, params)
                out.append((f"{name}-{n}-s{seed}", p, params))
    return out


# TP 4 -> 2 is the reshard of (2, 1) at twice the degree: its bytes and tokens are checked by the transfer's
# loopback tests ((4, 2), (4, 1)) and bit for bit by tests/engine/test_deterministic_paths.py
@pytest.mark.parametrize("p,d", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_disaggregated_equals_reference(tiny_ckpt, tiny_refs, cases, p, d):
    with LocalPipeline(tiny_ckpt, prefill_tp=p, decode_tp=d) as pipe:
        outs = pipe.generate([PrefillRequest(rid, tuple(prompt), params) for rid, prompt, params in cases])
        assert pipe.decode.slots.num_used == 0 and pipe.decode.pages.num_used == 0
    for rid, prompt, params in cases:
        assert outs[rid].error is None, outs[rid].error
        tiny_refs.check(prompt, params, outs[rid].token_ids, label=f"{rid} P={p} D={d}")


@pytest.mark.parametrize("seed", SEEDS)
def test_thirty_two_concurrent_requests_equal_single_runs(tiny_ckpt, tiny_refs, seed):
    g = torch.Generator().manual_seed(5 + 1000 * seed)
    lens = torch.randint(1, 200, (32,), generator=g).tolist()
    reqs = [PrefillRequest(f"r{i}", tuple(_prompt(n, seed=i + 1000 * seed)),
                           SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.7 * (i % 2), seed=i))
            for i, n in enumerate(lens)]
    with LocalPipeline(tiny_ckpt) as pipe:
        # all 32 prefill before decode starts, so every decode step batches all of them
        for r in reqs:
            pipe.prefill.add_request(r)
        handoffs = pipe.prefill.run_to_completion()
        got = {h.request_id: [h.first_token] for h in handoffs}
        for h in handoffs:
            pipe.decode.submit(h)
        assert len(pipe.decode.running) == 32
        while pipe.decode.has_work:
            for ev in pipe.decode.step():
                got[ev.request_id] += list(ev.token_ids)
        assert pipe.decode.slots.num_used == 0 and pipe.decode.pages.num_used == 0
    for r in reqs:
        tiny_refs.check(list(r.prompt_ids), r.params, got[r.request_id], label=f"{r.request_id} seed {seed}")


def test_cancel_mid_stream_frees_slots_and_pages(tiny_ckpt):
    with LocalPipeline(tiny_ckpt) as pipe:
        for i in range(4):
            pipe.prefill.add_request(PrefillRequest(f"c{i}", tuple(_prompt(100 + i, seed=i)),
                                                    SamplingParams(max_tokens=50, ignore_eos=True)))
        for h in pipe.prefill.run_to_completion():
            pipe.decode.submit(h)
        pipe.decode.step()
        pipe.decode.step()
        used_before = pipe.decode.pages.num_used
        assert pipe.decode.cancel("c1")
        assert pipe.decode.pages.num_used < used_before and pipe.decode.slots.num_used == 3
        assert not pipe.decode.cancel("c1")
        while pipe.decode.has_work:
            assert all(ev.request_id != "c1" for ev in pipe.decode.step())
        assert pipe.decode.slots.num_used == 0 and pipe.decode.pages.num_used == 0
        # prefill side: only the prefix cache holds anything, and clearing it empties both pools
        assert pipe.prefill.slots.num_used == pipe.prefill.cache.stats()["checkpoints"]
        pipe.prefill.cache.clear()
        assert pipe.prefill.slots.num_used == 0 and pipe.prefill.pages.num_used == 0


def test_bad_requests_fail_cleanly(tiny_ckpt):
    from k3serve.engine.ops import PoolConfig
    from k3serve.prefill.engine import PrefillConfig

    small = PrefillConfig(PoolConfig(kda_slots=4, mla_pages=8))
    with LocalPipeline(tiny_ckpt, prefill=small) as pipe:
        outs = pipe.generate([
            PrefillRequest("empty", (), GREEDY),
            PrefillRequest("vocab", (1, 2, 9999), GREEDY),
            PrefillRequest("temp", (1, 2), SamplingParams(temperature=-1.0)),
            PrefillRequest("toolong", tuple(_prompt(8 * 64 + 1, seed=3)), GREEDY),
            PrefillRequest("fine", (1, 2, 3), GREEDY),
        ])
    assert outs["empty"].error.code == "INVALID_ARGUMENT" and "empty" in outs["empty"].error.message
    assert outs["vocab"].error.code == "INVALID_ARGUMENT" and "9999" in outs["vocab"].error.message
    assert outs["temp"].error.code == "INVALID_ARGUMENT" and "temperature" in outs["temp"].error.message
    assert outs["toolong"].error.code == "RESOURCE_EXHAUSTED"
    assert outs["fine"].error is None and len(outs["fine"].token_ids) == GREEDY.max_tokens
