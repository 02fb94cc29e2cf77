"""An MXFP4 checkpoint (PTQ of the shipped tiny-trained model) through the disaggregated serving path: prefill
TP=2 -> decode TP=1 and prefill TP=2 -> decode TP=2 give exactly the tokens of the single-process reference on
the same MXFP4 weights (greedy and seeded). Each TP rank holds only its experts' packed bytes."""

import pytest

from k3serve.contracts.requests import PrefillRequest
from k3serve.contracts.sampling import SamplingParams
from k3serve.disagg.pipeline import LocalPipeline
from k3serve.model.loader import load_model
from k3serve.model.reference import reference_generate
from tests.exactness import SEEDS, References

PROMPTS = ("def parse_args(", "class Stack:\n    def push(self, x):\n", "import os\n")


@pytest.fixture(scope="module")
def mxfp4_ckpt(tiny_trained_mxfp4_ckpt):
    return tiny_trained_mxfp4_ckpt


@pytest.fixture(scope="module")
def cases(mxfp4_ckpt):
    model = load_model(mxfp4_ckpt)
    assert model.layers[1].ffn.experts[0][0].__class__.__name__ == "MXFP4Linear"
    refs = References(model)
    out = []
    for i, text in enumerate(PROMPTS):
        for name, params in (("greedy", SamplingParams(max_tokens=12, ignore_eos=True)),
                             ("seeded", SamplingParams(temperature=0.8, top_p=0.95, seed=3 + i, max_tokens=12,
                                                       ignore_eos=True))):
            ids = list(text.encode())
            out.append((f"{name}-{i}", ids, params, refs))
    return out


@pytest.mark.parametrize("p,d", [(2, 1), (2, 2)])
def test_mxfp4_disaggregated_equals_reference(mxfp4_ckpt, cases, p, d):
    with LocalPipeline(mxfp4_ckpt, prefill_tp=p, decode_tp=d) as pipe:
        outs = pipe.generate([PrefillRequest(rid, tuple(ids), params) for rid, ids, params, _ in cases])
        assert pipe.decode.slots.num_used == 0 and pipe.decode.pages.num_used == 0
    for rid, ids, params, refs in cases:  # equal, or an explained near-tie (tests/exactness.py)
        assert outs[rid].error is None, outs[rid].error
        refs.check(ids, params, outs[rid].token_ids, label=rid)


def test_mxfp4_deterministic_mode_equals_its_reference_bit_for_bit(mxfp4_ckpt):
    """numerics: deterministic on MXFP4 experts (fixed weight-row blocks through the fixed row tiles): prefill
    TP=2 in 64-token chunks -> decode TP=1 at batch 4 gives the deterministic reference's tokens, greedy and
    seeded, for a batch whose composition differs from the reference's one-at-a-time run."""
    from k3serve.contracts.numerics import DETERMINISTIC
    from k3serve.engine.ops import PoolConfig
    from k3serve.prefill.engine import PrefillConfig

    model = load_model(mxfp4_ckpt, numerics=DETERMINISTIC)
    prompts = [list((PROMPTS[1] * 3).encode())] + [list(p.encode()) for p in PROMPTS]
    params = [SamplingParams(max_tokens=6, ignore_eos=True)] + [
        SamplingParams(temperature=0.8, top_p=0.95, seed=7 + s, max_tokens=6, ignore_eos=True) for s in SEEDS]
    want = [reference_generate(model, p, sp).token_ids for p, sp in zip(prompts, params)]
    pcfg = PrefillConfig(PoolConfig(kda_slots=8, mla_pages=128), step_token_budget=64)
    with LocalPipeline(mxfp4_ckpt, prefill_tp=2, decode_tp=1, prefill=pcfg, numerics=DETERMINISTIC) as pipe:
        outs = pipe.generate([PrefillRequest(f"r{i}", tuple(p), sp) for i, (p, sp) in enumerate(zip(prompts, params))])
    assert [outs[f"r{i}"].token_ids for i in range(len(prompts))] == want
