"""Faults follow their request: what one request's parameters, sampling or drafter raise ends that request alone
(INTERNAL), its neighbours finish with the reference's tokens and the pools come back to zero."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.contracts.errors import ErrorCode
from k3serve.contracts.requests import PrefillRequest
from k3serve.contracts.sampling import GREEDY_BELOW_TEMPERATURE, SamplingError, SamplingParams
from k3serve.disagg.pipeline import LocalPipeline
from k3serve.engine.ops import DecodeBatch
from k3serve.engine.spec.config import SpecConfig
from k3serve.engine.spec.ngram import NgramConfig, NgramDrafter
from tests.exactness import random_prompt

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
# the live case: as a proto float keeps them (1e-45 is the smallest subnormal, 1.4e-45)
TINY = tuple(float(np.float32(t)) for t in (1e-40, 1e-38, 1e-30, 1e-45))


def _idle(pipe: LocalPipeline) -> None:
    d, p = pipe.decode, pipe.prefill
    assert not d.running and not d.waiting and d.slots.num_used == 0 and d.pages.num_used == 0
    assert not p.running and not p.waiting


def test_temperature_rule():
    assert SamplingParams(temperature=TINY[0]).greedy and SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=GREEDY_BELOW_TEMPERATURE / 2).greedy
    assert not SamplingParams(temperature=GREEDY_BELOW_TEMPERATURE).greedy
    for bad in (float("inf"), float("nan"), -1e-45):
        with pytest.raises(SamplingError, match="sampling.temperature"):
            SamplingParams(temperature=bad).validate()


def test_tiny_temperatures_are_greedy_beside_greedy_requests(tiny_ckpt, tiny_refs):
    """Temperatures 1e-40 .. 1e-45 used to overflow `logits / T` and raise in torch.multinomial, on the engine
    thread that serves every request of the cluster."""
    reqs = [PrefillRequest(f"tiny{i}", tuple(random_prompt(12 + i, 300 + i)),
                           SamplingParams(temperature=t, seed=7, max_tokens=6, ignore_eos=True))
            for i, t in enumerate(TINY)]
    reqs += [PrefillRequest(f"greedy{i}", tuple(random_prompt(20 + i, 400 + i)), GREEDY) for i in range(6)]
    with LocalPipeline(tiny_ckpt) as pipe:
        out = pipe.generate(reqs)
        _idle(pipe)
    for r in reqs:
        assert out[r.request_id].error is None, out[r.request_id].error
        tiny_refs.check(list(r.prompt_ids), GREEDY, out[r.request_id].token_ids, label=r.request_id)


class _NanRowExecutor:
    """The real executor, with the decode logits row of one request replaced by NaN (a sampling that raises for
    that request: torch.multinomial refuses NaN probabilities)."""

    def __init__(self, inner, pipe: LocalPipeline, victim: str) -> None:
        self.inner, self.pipe, self.victim, self.tp, self.hits = inner, pipe, victim, inner.tp, 0

    def run(self, op):
        out = self.inner.run(op)
        run = self.pipe.decode.running.get(self.victim)
        if isinstance(op, DecodeBatch) and run is not None and run.slot in op.slots:
            logits = out[0].clone()
            logits[op.slots.index(run.slot)] = float("nan")
            out = [logits] + list(out[1:])
            self.hits += 1
        return out

    def run_each(self, ops):
        return self.inner.run_each(ops)

    def close(self):
        self.inner.close()


def test_sampling_that_raises_fails_its_request_alone(tiny_ckpt, tiny_refs):
    victim = PrefillRequest("victim", tuple(random_prompt(16, 1)),
                            SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True))
    others = [PrefillRequest(f"ok{i}", tuple(random_prompt(18 + i, 10 + i)), GREEDY) for i in range(3)]
    with LocalPipeline(tiny_ckpt) as pipe:
        pipe.decode.executor = _NanRowExecutor(pipe.decode.executor, pipe, "victim")
        out = pipe.generate([victim] + others)
        assert pipe.decode.executor.hits >= 1
        _idle(pipe)
        again = pipe.generate([PrefillRequest("after", others[0].prompt_ids, GREEDY)])  # the engine still serves
    err = out["victim"].error
    assert err is not None and err.code is ErrorCode.INTERNAL and "sampling" in err.message
    for r in others:
        assert out[r.request_id].error is None
        tiny_refs.check(list(r.prompt_ids), GREEDY, out[r.request_id].token_ids, label=r.request_id)
    assert again["after"].token_ids == out["ok0"].token_ids


class _FailingDrafter(NgramDrafter):
    """The real n-gram drafter whose session raises for one request id after its first proposal."""

    def __init__(self, victim: str) -> None:
        super().__init__(NgramConfig(min_n=1, max_n=3))
        self.victim = victim

    def open(self, request_id, prompt_ids, draft=None):
        session = super().open(request_id, prompt_ids, draft)
        if request_id != self.victim:
            return session
        inner_propose, calls = session.propose, []

        def propose(context, k):
            calls.append(k)
            if len(calls) > 1:
                raise KeyError("drafter index corrupted")
            return inner_propose(context, k)

        session.propose = propose
        return session


def test_drafter_that_raises_fails_its_request_alone(tiny_ckpt, tiny_refs):
    reqs = [PrefillRequest(f"s{i}", tuple(random_prompt(14 + i, 50 + i)), GREEDY) for i in range(3)]
    with LocalPipeline(tiny_ckpt, speculative=SpecConfig(num_draft_tokens=2, ngram=NgramConfig(min_n=1, max_n=3)),
                       drafter=_FailingDrafter("s1")) as pipe:
        out = pipe.generate(reqs)
        _idle(pipe)
    err = out["s1"].error
    assert err is not None and err.code is ErrorCode.INTERNAL and "drafter" in err.message
    for rid in ("s0", "s2"):
        assert out[rid].error is None
        tiny_refs.check(list(reqs[int(rid[1])].prompt_ids), GREEDY, out[rid].token_ids, label=rid)
