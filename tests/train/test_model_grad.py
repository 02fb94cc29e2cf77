"""The whole serving model is differentiable: autograd gradients agree with finite differences, and the
training forward computes the serving forward's logits."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from k3serve.model.presets import preset  # noqa: E402
from k3serve.train.params import init_params, model_view  # noqa: E402
from k3serve.train.step import byte_nll, window_logits  # noqa: E402

# one tensor of each kind the forward touches: KDA projections, conv taps, decay gate, MLA latent, Block
# AttnRes pseudo-query, a routed expert, the shared expert, the router, norms, embedding and head
PROBES = [
    "layers.1.self_attn.q_proj.weight",
    "layers.1.self_attn.k_conv1d.weight",
    "layers.2.self_attn.A_log",
    "layers.2.self_attn.dt_bias",
    "layers.1.self_attn.b_proj.weight",
    "layers.3.self_attn.kv_b_proj.weight",
    "layers.7.self_attn.q_a_layernorm.weight",
    "layers.4.self_attention_res_proj.weight",
    "layers.5.block_sparse_moe.shared_experts.up_proj.weight",
    "layers.5.block_sparse_moe.gate.weight",
    "layers.5.block_sparse_moe.routed_expert_down_proj.weight",
    "embed_tokens.weight",
]


def _loss(cfg, params, x):
    """Summed next-byte NLL (accumulated in fp64, so the sum adds no rounding of its own)."""
    return byte_nll(window_logits(model_view(cfg, params), x, grad=True), x).double().sum()


@pytest.fixture(scope="module")
def setup():
    cfg = preset("tiny")
    params = init_params(cfg, seed=3)
    x = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    return cfg, params, x


def test_probes_exist(setup):
    cfg, params, _ = setup
    assert all(cfg.name_prefix + p in params for p in PROBES)


def test_finite_differences_match_autograd(setup):
    """Directional derivative of each probed tensor, (L(w+eps d) - L(w-eps d)) / 2eps against <grad, d>, along
    d = the gradient's direction plus a random unit vector (a large derivative to measure, random components
    checked too). The model computes in fp32 (its layers cast to fp32), which bounds the agreement to about 1%
here; a wrong or missing gradient path is off by far more."""
    cfg, params, x = setup
    names = [cfg.name_prefix + n for n in PROBES]
    loss = _loss(cfg, params, x)
    grads = dict(zip(names, torch.autograd.grad(loss, [params[n] for n in names])))
    gen = torch.Generator().manual_seed(1)
    rows = []
    with torch.no_grad():
        for name in names:
            w = params[name]
            r = torch.randn(w.shape, generator=gen)
            if name.endswith("A_log"):
                r[cfg.kda_num_heads:] = 0  # K3's zero padding is not a parameter
            d = grads[name] / grads[name].norm() + r / r.norm()
            d = d / d.norm()
            # a step that moves the loss by ~1e-4 of itself: far above fp32 noise, small enough that
            # curvature stays negligible; capped relative to the tensor so no expert choice flips: 1e-3 of
            # the router's weights (the one discrete choice), 1e-2 elsewhere (at 1e-3, A_log's small
            # derivative moved the loss by ~1e-6 of itself and fp32 noise made the difference 1-3% off on
            # an AVX-512 CPU)
            cap = 1e-3 if name.endswith("block_sparse_moe.gate.weight") else 1e-2
            eps = min(1e-4 * abs(float(loss)) / float(grads[name].norm()), cap * float(w.norm()))
            base = w.clone()
            w.copy_(base + eps * d)
            up = float(_loss(cfg, params, x))
            w.copy_(base - eps * d)
            down = float(_loss(cfg, params, x))
            w.copy_(base)
            fd = (up - down) / (2 * eps)
            ad = float((grads[name] * d).sum())
            rows.append((name, fd, ad))
    print("\n".join(f"{n}: fd {fd:.6g} autograd {ad:.6g}" for n, fd, ad in rows))
    for name, fd, ad in rows:
        assert abs(fd - ad) <= 1e-2 * abs(ad), (name, fd, ad)


def test_training_logits_equal_serving_logits(setup):
    cfg, params, x = setup
    model = model_view(cfg, params)
    with torch.no_grad():
        serving = window_logits(model, x, grad=False)
    training = window_logits(model, x, grad=True)
    assert training.requires_grad
    torch.testing.assert_close(training.detach(), serving, atol=1e-4, rtol=0)
