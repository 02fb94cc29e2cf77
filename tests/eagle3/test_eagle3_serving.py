"""EAGLE-3 behind the speculative engine: output equals plain decode exactly (greedy and sampled), locally and
prefill TP=2 -> decode TP=1; the session's window follows the verified rows."""

from __future__ import annotations

import pytest
import torch

from k3serve.contracts.requests import PrefillRequest
from k3serve.contracts.sampling import SamplingParams
from k3serve.disagg.pipeline import LocalPipeline
from k3serve.engine.spec.config import SpecConfig, make_drafter
from k3serve.engine.spec.drafter import VerifyOutcome
from k3serve.model.eagle3.config import DrafterConfig
from k3serve.model.eagle3.weights import init_drafter_weights, save_drafter
from k3serve.model.loader import load_weights
from k3serve.model.reference import reference_generate

PROMPTS = [tuple(b"def add(a, b):\n    return a + b\n\ndef add(a, b):\n"), tuple(range(40, 52)), (7,)]


@pytest.fixture(scope="module")
def drafter_dir(tiny_ckpt, tmp_path_factory):
    from k3serve.model.checkpoint import load_config

    cfg = DrafterConfig.for_target(load_config(tiny_ckpt), window=8)
    return str(save_drafter(cfg, init_drafter_weights(cfg, load_weights(tiny_ckpt)), tmp_path_factory.mktemp("d")))


def _requests(params):
    return [PrefillRequest(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("tp", [(1, 1), (2, 1)])
def test_greedy_eagle3_equals_reference(tiny_ckpt, tiny_model, drafter_dir, tp):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    spec = SpecConfig(method="eagle3", num_draft_tokens=3, drafter_dir=drafter_dir)
    with LocalPipeline(tiny_ckpt, *tp, speculative=spec) as pipe:
        outs = pipe.generate(_requests(params))
    for i, p in enumerate(PROMPTS):
        assert outs[f"r{i}"].error is None
        assert outs[f"r{i}"].token_ids == reference_generate(tiny_model, list(p), params).token_ids
    assert sum(o.verify_steps for o in outs.values()) > 0 and sum(o.drafted_tokens for o in outs.values()) > 0


def test_sampled_eagle3_equals_plain_sampling(tiny_ckpt, tiny_model, drafter_dir):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True)
    spec = SpecConfig(method="eagle3", num_draft_tokens=2, drafter_dir=drafter_dir)
    with LocalPipeline(tiny_ckpt, speculative=spec) as pipe:
        outs = pipe.generate(_requests(params))
    for i, p in enumerate(PROMPTS):
        assert outs[f"r{i}"].token_ids == reference_generate(tiny_model, list(p), params).token_ids


def test_session_window_follows_verified_rows(tiny_ckpt, drafter_dir):
    method = make_drafter(SpecConfig(method="eagle3", drafter_dir=drafter_dir))
    d = 256
    s = method.open("r", (1, 2, 3))
    assert len(s.propose((1, 2, 3), 3).tokens) == 3 and s.window is None  # cold start drafts anyway
    feats = {layer: torch.randn(3, d) for layer in method.feature_layers}
    s.observe(VerifyOutcome(3, (3, 9, 8), (9, 8, 5), feats))  # 2 drafts accepted, then 5
    assert s.window.count == 3 and s.window.tokens[-3:].tolist() == [9, 8, 5]
    assert len(s.propose((1, 2, 3, 9, 8, 5), 2).tokens) == 2
    s.observe(VerifyOutcome(6, (5,), (4,), None))  # a plain step: no features, the window goes cold
    assert s.window is None


def test_eagle3_needs_a_matching_drafter(tiny_linear_ckpt, drafter_dir):
    from k3serve.model.checkpoint import load_config

    with pytest.raises(ValueError, match="different target"):
        make_drafter(SpecConfig(method="eagle3", drafter_dir=drafter_dir), load_config(tiny_linear_ckpt))
    with pytest.raises(ValueError, match="drafter_dir"):
        make_drafter(SpecConfig(method="eagle3"))
