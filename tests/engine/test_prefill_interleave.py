"""A long prompt in progress delays a short one by at most one step, and the short's first token leaves first.

The prefill engine runs short requests' chunks first in a step and yields each finished request at once, so
the long requests' share of that step runs after the short's handoff is out; long-only steps are capped at
``long_step_tokens`` (chunk_plan.py).
"""

from __future__ import annotations

import torch

from k3serve.engine.block_hash import model_fingerprint, prefix_key
from k3serve.engine.executor import LocalExecutor, WorkerSpec
from k3serve.engine.ops import PoolConfig, PrefillChunk
from k3serve.contracts.requests import PrefillRequest
from k3serve.contracts.sampling import SamplingParams
from k3serve.model.checkpoint import load_config
from k3serve.prefill.engine import PrefillConfig, PrefillEngine

PARAMS = SamplingParams(max_tokens=1, ignore_eos=True)


class RecordingExecutor(LocalExecutor):
    """The real single-rank executor, noting which request slot ran which prefill chunk."""

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec)
        self.chunks: list[tuple[int, int, int]] = []  # (slot, start, tokens)

    def run(self, op: object) -> list[object]:
        if isinstance(op, PrefillChunk):
            self.chunks.append((op.slot, op.start, len(op.token_ids)))
        return super().run(op)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_short_handoff_is_yielded_before_the_long_share_runs(tiny_ckpt, tiny_refs):
    cfg = load_config(tiny_ckpt)
    pools = PoolConfig(kda_slots=8, mla_pages=64, page_size=64)
    ex = RecordingExecutor(WorkerSpec(tiny_ckpt, 1, pools))
    try:
        engine = PrefillEngine(cfg, ex, PrefillConfig(pools, step_token_budget=256, long_threshold=300,
                                                      long_step_tokens=64, enable_prefix_cache=False),
                               prefix_key(model_fingerprint(cfg.to_hf_dict()), ""))
        long_prompt, short_prompt = _tokens(1000, 1), _tokens(100, 2)
        engine.add_request(PrefillRequest("long", tuple(long_prompt), PARAMS))
        for _ in range(2):  # long-only steps: 64 tokens each, not the 256-token budget
            assert list(engine.step()) == []
        assert [c[1:] for c in ex.chunks] == [(0, 64), (64, 64)]
        long_slot = ex.chunks[0][0]

        engine.add_request(PrefillRequest("short", tuple(short_prompt), PARAMS))
        ex.chunks.clear()
        step = engine.step()
        first = next(step)
        assert first.request_id == "short"
        assert all(slot != long_slot for slot, _, _ in ex.chunks), "the long chunk ran before the short's handoff"
        assert list(step) == []
        assert ex.chunks[-1] == (long_slot, 128, 64)  # then the long's share of the same step

        tiny_refs.check(short_prompt, PARAMS, [first.first_token], label="short")  # tests/exactness.py
    finally:
        ex.close()


def test_short_request_starts_around_a_long_one_waiting_for_pages(tiny_ckpt):
    cfg = load_config(tiny_ckpt)
    pools = PoolConfig(kda_slots=8, mla_pages=20, page_size=64)  # 1280 tokens of pages
    ex = RecordingExecutor(WorkerSpec(tiny_ckpt, 1, pools))
    try:
        engine = PrefillEngine(cfg, ex, PrefillConfig(pools, step_token_budget=256, long_threshold=300,
                                                      long_step_tokens=64, enable_prefix_cache=False),
                               prefix_key(model_fingerprint(cfg.to_hf_dict()), ""))
        engine.add_request(PrefillRequest("long-a", tuple(_tokens(900, 3)), PARAMS))  # 15 pages
        engine.add_request(PrefillRequest("long-b", tuple(_tokens(600, 4)), PARAMS))  # 10 pages: must wait
        engine.add_request(PrefillRequest("long-c", tuple(_tokens(400, 6)), PARAMS))  # 7 pages: waits behind b
        engine.add_request(PrefillRequest("short", tuple(_tokens(100, 5)), PARAMS))  # 2 pages: fits now
        done = [h.request_id for h in engine.step()]
        assert done == ["short"]  # served in the first step, around the waiting long prompts
        assert [r.request_id for r in engine.waiting] == ["long-b", "long-c"]  # longs keep their order
        finished = {h.request_id for h in engine.run_to_completion()}
        assert finished == {"long-a", "long-b", "long-c"} and engine.pages.num_free == 20
    finally:
        ex.close()
