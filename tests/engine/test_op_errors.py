"""An op that raised fails its request(s) with INTERNAL and the group keeps serving; a dead rank is WorkerDied.

(`OpFailed` and `WorkerDied` are different types: the front fails the whole group only on `WorkerDied`.)"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from k3serve.contracts.errors import ErrorCode
from k3serve.contracts.requests import PrefillRequest
from k3serve.contracts.sampling import SamplingParams
from k3serve.engine.executor import MultiprocExecutor, OpFailed, WorkerDied, WorkerSpec
from k3serve.engine.ops import DecodeBatch, PoolConfig, PrefillChunk, ResetSlots
from k3serve.disagg.pipeline import LocalPipeline

PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)


def _prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


class _Faulty:
    """An executor that raises OpFailed (as a rank would) for ops `match` picks, once each time it matches."""

    def __init__(self, inner, match) -> None:
        self.inner, self.match, self.tp, self.raised = inner, match, inner.tp, 0

    def run(self, op):
        return self.run_each([op] * self.tp)

    def run_each(self, ops):
        if self.match(ops[0]):
            self.raised += 1
            raise OpFailed(f"{type(ops[0]).__name__} raised on rank 0: injected")
        return self.inner.run_each(ops)

    def close(self):
        self.inner.close()


def test_decode_op_that_raised_fails_its_batch_only(tiny_ckpt, tiny_refs):
    bad, good = PrefillRequest("bad", _prompt(40, 1), PARAMS), PrefillRequest("good", _prompt(50, 2), PARAMS)
    with LocalPipeline(tiny_ckpt) as pipe:
        calls = {"n": 0}

        def second_decode_step(op) -> bool:
            if isinstance(op, DecodeBatch):
                calls["n"] += 1
                return calls["n"] == 2
            return False

        pipe.decode.executor = _Faulty(pipe.decode.executor, second_decode_step)
        out = pipe.generate([bad])
        assert out["bad"].error is not None and out["bad"].error.code is ErrorCode.INTERNAL
        assert "injected" in out["bad"].error.message
        assert pipe.decode.slots.num_used == 0 and pipe.decode.pages.num_used == 0 and not pipe.decode.running
        out = pipe.generate([good])  # the group is intact: the next request is served
    assert out["good"].error is None
    tiny_refs.check(list(good.prompt_ids), PARAMS, out["good"].token_ids, label="good")
    assert ErrorCode.INTERNAL.grpc_status.name == "INTERNAL"


def test_prefill_op_that_raised_fails_that_request_only(tiny_ckpt, tiny_refs):
    reqs = [PrefillRequest(f"r{i}", _prompt(30 + 20 * i, 10 + i), PARAMS) for i in range(3)]
    victim = reqs[1].prompt_ids
    with LocalPipeline(tiny_ckpt) as pipe:
        pipe.prefill.executor = _Faulty(
            pipe.prefill.executor, lambda op: isinstance(op, PrefillChunk) and op.token_ids == victim)
        out = pipe.generate(reqs)
        assert pipe.prefill.executor.raised == 1
        assert not pipe.prefill.running and pipe.decode.slots.num_used == 0
    assert out["r1"].error.code is ErrorCode.INTERNAL and out["r1"].token_ids == []
    for r in (reqs[0], reqs[2]):
        assert out[r.request_id].error is None
        tiny_refs.check(list(r.prompt_ids), PARAMS, out[r.request_id].token_ids, label=r.request_id)


def test_multiproc_op_failed_vs_worker_died(tiny_ckpt):
    ex = MultiprocExecutor(WorkerSpec(tiny_ckpt, 2, PoolConfig(kda_slots=4, mla_pages=16)))
    try:
        with pytest.raises(OpFailed) as info:
            ex.run(ResetSlots((10 ** 6,)))  # out of range on every rank: raises, every rank answers
        assert not isinstance(info.value, WorkerDied) and "rank 0" in str(info.value)
        ex.run(ResetSlots((0,)))  # still in step
        os.kill(ex.pids[1], signal.SIGKILL)
        ex._procs[1].join(timeout=10)
        with pytest.raises(WorkerDied, match="rank 1"):
            ex.run(ResetSlots((0,)))
    finally:
        ex.close()
