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
from tests.exactness import SEEDS, References

PROMPTS = [tuple(b"def add(a, b):\n    return a + b\n\ndef add(a, b):\n"), tuple(range(40, 52)), (7,)]


@pytest.fixture(scope="module")
def drafter_dir(tiny_ckpt, tmp_path_factory):
    from k3serve.model.checkpoint import load_config

    cfg = DrafterConfig.for_target(load_config(tiny_ckpt), window=8)
    return str(save_drafter(cfg, init_drafter_weights(cfg, load_weights(tiny_ckpt)), tmp_path_factory.mktemp("d")))


def _requests(params):
    return [PrefillRequest(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]


# every k in one process; each TP pair with one window (k changes only the window, which (1, 1) covers)
@pytest.mark.parametrize("tp,k", [((1, 1), 1), ((1, 1), 3), ((1, 1), 7), ((2, 1), 3), ((1, 2), 7)])
def test_greedy_eagle3_equals_reference(tiny_ckpt, tiny_refs, drafter_dir, tp, k):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    spec = SpecConfig(method="eagle3", num_draft_tokens=k, drafter_dir=drafter_dir)
    with LocalPipeline(tiny_ckpt, *tp, speculative=spec) as pipe:
        outs = pipe.generate(_requests(params))
    for i, p in enumerate(PROMPTS):
        assert outs[f"r{i}"].error is None
        tiny_refs.check(list(p), params, outs[f"r{i}"].token_ids, label=f"r{i}")
    assert sum(o.verify_steps for o in outs.values()) > 0 and sum(o.drafted_tokens for o in outs.values()) > 0


@pytest.mark.parametrize("seed", SEEDS)
def test_sampled_eagle3_equals_plain_sampling(tiny_ckpt, tiny_refs, drafter_dir, seed):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11 + seed, max_tokens=10, ignore_eos=True)
    spec = SpecConfig(method="eagle3", num_draft_tokens=2, drafter_dir=drafter_dir)
    with LocalPipeline(tiny_ckpt, speculative=spec) as pipe:
        outs = pipe.generate(_requests(params))
    for i, p in enumerate(PROMPTS):
        assert outs[f"r{i}"].error is None, outs[f"r{i}"].error
        tiny_refs.check(list(p), params, outs[f"r{i}"].token_ids, label=f"r{i}")
    assert sum(o.verify_steps for o in outs.values()) > 0 and sum(o.drafted_tokens for o in outs.values()) > 0


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


def test_prefill_hands_over_the_window_verified_rows_would_build(tiny_ckpt, tiny_model, drafter_dir):
    """Prefill (chunked, TP=2) captures the last W positions' features; the window they make equals the one
    built from a single-process forward over the prompt, and drafts the same tokens."""
    from k3serve.engine.ops import PoolConfig
    from k3serve.model.eagle3.features import target_features
    from k3serve.model.state import DenseLatentCache, ForwardBatch
    from k3serve.prefill.engine import PrefillConfig

    method = make_drafter(SpecConfig(method="eagle3", drafter_dir=drafter_dir))
    prompt = PROMPTS[0]
    pcfg = PrefillConfig(PoolConfig(kda_slots=8, mla_pages=64), step_token_budget=13, draft_capture=method.capture)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with LocalPipeline(tiny_ckpt, 2, 1, prefill=pcfg) as pipe:
        pipe.prefill.add_request(PrefillRequest("r", prompt, params))
        (handoff,) = pipe.prefill.run_to_completion()
        pipe.decode.submit(handoff)  # hand the state on so the pools drain
        while pipe.decode.has_work:
            pipe.decode.step()
    draft = handoff.draft
    w = method.drafter.cfg.window
    assert draft.start == len(prompt) - w and draft.next_tokens == prompt[-w + 1:] + (handoff.first_token,)
    warm = method.window_of(draft)
    model = tiny_model
    ids = torch.tensor([prompt])
    f = target_features(model, method.drafter.cfg, ids,
                        ForwardBatch(model.new_kda_state(1), DenseLatentCache(model.cfg.num_mla_layers, 1), [0]))
    g = method.drafter.fuse(f.low, f.mid, f.high)[0, -w:]
    torch.testing.assert_close(warm.feats, g, atol=1e-4, rtol=1e-4)
    assert warm.count == w and warm.tokens.tolist() == list(draft.next_tokens)
    s_warm = method.open("r", prompt, draft)
    assert torch.equal(s_warm.window.feats, warm.feats) and s_warm.window.count == w
    assert len(s_warm.propose(prompt + (handoff.first_token,), 3).tokens) == 3 and s_warm.window is not None


def test_shipped_drafter_serves_tiny_trained_exactly():
    """The shipped LK drafter belongs to the shipped target (config and head/embedding copies) and its greedy
    output through the serving path equals the reference, with most drafts accepted on code."""
    from k3serve.model.eagle3.assets import shipped_drafters
    from k3serve.model.eagle3.weights import check_shared, load_drafter_weights
    from k3serve.model.loader import load_model
    from k3serve.model.presets import trained_dir

    tdir = str(trained_dir("tiny-trained"))
    ddir = shipped_drafters("tiny-trained")["eagle3-lk"]
    cfg, w = load_drafter_weights(ddir)
    check_shared(cfg, w, load_weights(tdir))
    model = load_model(tdir)
    prompt = tuple(b"import os\n\n\ndef main(argv):\n    ")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LocalPipeline(tdir, speculative=SpecConfig(method="eagle3", num_draft_tokens=3, drafter_dir=ddir)) as pipe:
        out = pipe.generate([PrefillRequest("r", prompt, params)])["r"]
    References(model).check(list(prompt), params, out.token_ids)
    assert out.accepted_tokens > out.drafted_tokens // 3


def test_pipeline_wires_the_warm_start(tiny_ckpt, tiny_refs, drafter_dir):
    """LocalPipeline with eagle3: prefill captures what the decode engine's drafter asks for, the ticket carries
    it, and every session opens warm from it; the tokens stay the reference's."""
    spec = SpecConfig(method="eagle3", num_draft_tokens=3, drafter_dir=drafter_dir)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    with LocalPipeline(tiny_ckpt, 1, 1, speculative=spec) as pipe:
        assert pipe.prefill.config.draft_capture == pipe.decode.draft_capture is not None
        opened = []
        real_open = pipe.decode.drafter.open

        def spy(request_id, prompt_ids, draft=None):
            opened.append(draft)
            return real_open(request_id, prompt_ids, draft)

        pipe.decode.drafter.open = spy
        out = pipe.generate(_requests(params))
    assert len(opened) == len(PROMPTS) and all(d is not None and d.next_tokens for d in opened)
    for i, p in enumerate(PROMPTS):
        tiny_refs.check(list(p), params, out[f"r{i}"].token_ids, label=f"r{i}")
