import pytest
import torch

from k3serve.kernels import _dispatch
from k3serve.kernels.kda import chunk_kda, recurrent_kda
from k3serve.kernels.kda_naive import naive_recurrent_kda


def test_default_backend_on_cpu_is_torch(monkeypatch):
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    assert _dispatch.resolve_backend(None, torch.device("cpu")) == "torch"
    assert _dispatch.resolve_backend("NAIVE", torch.device("cpu")) == "naive"


def test_env_var_forces_backend(monkeypatch, kda_inputs):
    monkeypatch.setenv(_dispatch.ENV_VAR, "naive")
    assert _dispatch.resolve_backend(None, torch.device("cpu")) == "naive"
    # The keyword wins over the environment.
    assert _dispatch.resolve_backend("torch", torch.device("cpu")) == "torch"
    q, k, v, g, beta = kda_inputs(1, 5, 1, 16, 16, "k3")
    o, _ = chunk_kda(q, k, v, g, beta)
    torch.testing.assert_close(o, naive_recurrent_kda(q, k, v, g, beta)[0])


def test_unknown_backend_and_triton_without_interpreter(monkeypatch):
    with pytest.raises(ValueError):
        _dispatch.resolve_backend("cuda-magic", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError):
        _dispatch.resolve_backend("triton", torch.device("cpu"))


@pytest.mark.parametrize("fn", [chunk_kda, recurrent_kda])
@pytest.mark.parametrize("backend", ["naive", "torch", None])
def test_public_api_matches_naive(kda_inputs, fn, backend):
    q, k, v, g, beta = kda_inputs(2, 37, 2, 16, 16, "kl", seed=11)
    h0 = torch.randn(2, 2, 16, 16)
    ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend=backend)
    torch.testing.assert_close(o, ref[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(s, ref[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["naive", "torch"])
def test_recurrent_inplace_state_updates_the_given_state(kda_inputs, backend):
    q, k, v, g, beta = kda_inputs(2, 9, 2, 16, 16, "k3", seed=5)
    pool = torch.randn(2, 2, 16 * 16 + 7)            # a strided view of a pool, as the model passes
    h0 = pool[..., : 16 * 16].unflatten(-1, (16, 16))
    ref_o, ref_s = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0.clone(), output_final_state=True)
    o, s = recurrent_kda(q, k, v, g, beta, initial_state=h0, inplace_state=True, backend=backend)
    assert s is h0
    torch.testing.assert_close(o, ref_o, atol=1e-5, rtol=0)
    torch.testing.assert_close(h0, ref_s, atol=1e-5, rtol=0)
