"""The fused CPU kernel of the chunked KDA forward (kernels/cpu/kda_cpu.py): results within fp32 rounding of the
naive oracle and the torch path, chunk-composition invariance bit for bit, the state view never written, the dispatch."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3serve.kernels import _dispatch, kda_torch
from k3serve.kernels.cpu import kda_cpu, kda_cpu_kernel
from k3serve.kernels.kda import chunk_backend, chunk_kda, recurrent_kda
from k3serve.kernels.cpu.kda_cpu import chunk_kda_cpu
from k3serve.kernels.kda_naive import naive_recurrent_kda
from k3serve.kernels.kda_torch import _MAX_HALF_SPAN, chunk_kda_torch, recurrent_kda_torch
from tests.kernels.test_kda_torch import (check_bf16_inputs, check_huge_unbounded_decays,
                                          check_state_carry_and_no_mutation)

pytestmark = pytest.mark.skipif(bool(kda_cpu.NUMBA_ERROR), reason=kda_cpu.NUMBA_ERROR or "numba imports")

TOL = dict(atol=1e-5, rtol=0)   # the torch path's tolerance against the oracle (test_kda_torch.py)


def _close(a, b, **tol):
    torch.testing.assert_close(a.float(), b.float(), **(tol or TOL))


def _chunk_kinds(g: torch.Tensor, C: int = kda_cpu.CHUNK, sub: int = 16) -> set[str]:
    """Which diagonal-block path each chunk of g [B, T, H, K] takes (the kernel's per-chunk rule, recomputed
    here: centred iff every |fp32(G_i - G_m)| <= _MAX_HALF_SPAN, G the fp64 cumsum within the chunk, m the middle
    row of i's sub-chunk; zero-padded rows past T)."""
    B, T, H, K = g.shape
    NT = -(-T // C)
    gp = torch.nn.functional.pad(g.double(), (0, 0, 0, 0, 0, NT * C - T))
    G = gp.view(B, NT, C, H, K).cumsum(2).view(B, NT, C // sub, sub, H, K)
    dm = (G - G[:, :, :, sub // 2: sub // 2 + 1]).float().abs().amax(dim=(2, 3, 5))   # [B, NT, H]
    return {"centred" if x <= _MAX_HALF_SPAN else "pairwise" for x in dm.flatten().tolist()}


@pytest.mark.parametrize("gate", ["k3", "kl"])
@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("B,T,H,K,V,seed", [
    (2, 1, 3, 16, 32, 0), (2, 31, 2, 16, 16, 1), (1, 33, 2, 32, 16, 2), (2, 100, 3, 16, 32, 3),
    (1, 300, 2, 64, 48, 4), (2, 77, 2, 20, 24, 5), (1, 130, 1, 128, 128, 6), (3, 64, 2, 32, 64, 7),
])
def test_matches_naive_and_torch(kda_inputs, B, T, H, K, V, seed, with_h0, gate):
    q, k, v, g, beta = kda_inputs(B, T, H, K, V, gate, seed=seed)
    h0 = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(seed)) if with_h0 else None
    ref_o, ref_s = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    t_o, t_s = chunk_kda_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunk_kda_cpu(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.shape == (B, T, H, V) and o.dtype == v.dtype and o.is_contiguous()
    assert s.shape == (B, H, K, V) and s.dtype == torch.float32
    _close(o, ref_o)
    _close(s, ref_s)
    _close(o, t_o)
    _close(s, t_s)


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("gate", ["k3", "kl"])
def test_every_chunk_size(kda_inputs, gate, chunk_size):
    """1, 2 and 4 sub-chunks per chunk (the default 16, the torch path's 32, and 64: earlier sub-chunks up to
    three back)."""
    q, k, v, g, beta = kda_inputs(2, 150, 2, 32, 16, gate, seed=30 + chunk_size)
    h0 = torch.randn(2, 2, 32, 16)
    ref_o, ref_s = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunk_kda_cpu(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk_size)
    _close(o, ref_o)
    _close(s, ref_s)


def test_both_diagonal_paths_in_one_call(kda_inputs):
    """Mild and huge decays side by side: chunks of one call take the centred and the pairwise diagonal blocks
    (decided per chunk), and both agree with the oracle."""
    A_log = torch.tensor([-2.0, 0.0, 4.0])
    q, k, v, g, beta = kda_inputs(2, 200, 3, 16, 16, "kl", seed=12, A_log=A_log)
    assert _chunk_kinds(g) == {"centred", "pairwise"}
    h0 = torch.randn(2, 3, 16, 16)
    ref_o, ref_s = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunk_kda_cpu(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    _close(o, ref_o)
    _close(s, ref_s)


def test_huge_unbounded_decays(kda_inputs):
    check_huge_unbounded_decays(kda_inputs, chunk_kda_cpu)


def test_bf16_inputs(kda_inputs):
    check_bf16_inputs(kda_inputs, chunk_kda_cpu)


@pytest.mark.parametrize("chunk_size", [16, 32])
@pytest.mark.parametrize("gate", ["k3", "kl"])
def test_split_at_multiples_of_64_is_bitwise_one_shot(kda_inputs, gate, chunk_size):
    """A chunk's bits depend only on its rows and the state entering it: prefill split on the 64-token grid with
    the state carried equals the one-shot call exactly (what numerics: deterministic relies on)."""
    B, T, H, K, V = 2, 250, 2, 32, 32
    q, k, v, g, beta = kda_inputs(B, T, H, K, V, gate, seed=21, A_log=torch.tensor([0.0, 5.0]))
    h0 = torch.randn(B, H, K, V)
    o_full, s_full = chunk_kda_cpu(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                   chunk_size=chunk_size)
    outs, state = [], h0
    for a, b in ((0, 64), (64, 192), (192, T)):
        o, state = chunk_kda_cpu(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                 initial_state=state, output_final_state=True, chunk_size=chunk_size)
        outs.append(o)
    assert torch.equal(torch.cat(outs, dim=1), o_full)
    assert torch.equal(state, s_full)


@pytest.mark.parametrize("gate", ["k3", "kl"])
@pytest.mark.parametrize("B,T,H,K,V,chunk_size", [
    (1, 200, 4, 64, 64, 16), (2, 77, 3, 128, 128, 16), (1, 130, 2, 20, 48, 32), (2, 64, 1, 32, 16, 64),
])
def test_narrow_and_wide_register_tiles_give_the_same_bits(kda_inputs, gate, B, T, H, K, V, chunk_size):
    """The sequential stages' 4 x 16 tiles (CPUs without AVX-512) and 8 x 32 tiles (kda_cpu.narrow_tiles) do the
    same FMAs per element in the same order: outputs and final states are equal bit for bit, whichever this CPU
    takes by default."""
    q, k, v, g, beta = kda_inputs(B, T, H, K, V, gate, seed=T + K)
    h0 = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(K))
    got = [chunk_kda_cpu(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk_size,
                         narrow=narrow) for narrow in (True, False)]
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    default = chunk_kda_cpu(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk_size)
    assert torch.equal(default[0], got[0][0])


def test_one_head_alone_equals_inside_a_batch(kda_inputs):
    """Nor on how many heads, batch rows or threads share the call."""
    B, T, H, K, V = 2, 97, 3, 16, 32
    q, k, v, g, beta = kda_inputs(B, T, H, K, V, "kl", seed=22)
    h0 = torch.randn(B, H, K, V)
    o_all, s_all = chunk_kda_cpu(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    for b in range(B):
        for h in range(H):
            sl = (slice(b, b + 1), slice(None), slice(h, h + 1))
            o, s = chunk_kda_cpu(q[sl], k[sl], v[sl], g[sl], beta[sl], initial_state=h0[b:b + 1, h:h + 1],
                                 output_final_state=True)
            assert torch.equal(o, o_all[sl]) and torch.equal(s, s_all[b:b + 1, h:h + 1])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        o1, s1 = chunk_kda_cpu(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(o1, o_all) and torch.equal(s1, s_all)


def test_zero_padding_of_the_last_chunk_is_inert(kda_inputs):
    """T = 100 pads its last chunk with zero rows inside the kernel; the same rows given explicitly as zeros
    (T = 128, which adds a whole chunk of zeros too) change no bit of the first 100 outputs nor of the final
    state."""
    q, k, v, g, beta = kda_inputs(1, 100, 2, 16, 16, "k3", seed=23)
    h0 = torch.randn(1, 2, 16, 16)
    o, s = chunk_kda_cpu(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    pad = [torch.cat((x, x.new_zeros(1, 28, *x.shape[2:])), dim=1) for x in (q, k, v, g, beta)]
    o2, s2 = chunk_kda_cpu(*pad, initial_state=h0, output_final_state=True)
    assert torch.equal(o2[:, :100], o) and torch.equal(s2, s)


def test_state_carry_and_no_mutation(kda_inputs):
    check_state_carry_and_no_mutation(kda_inputs, chunk_kda_cpu)


def test_final_state_is_a_new_tensor(kda_inputs):
    q, k, v, g, beta = kda_inputs(2, 70, 2, 16, 32, "kl", seed=6)
    h0 = torch.randn(2, 3, 2, 16, 32)[:, 1]           # a strided view, as from a state pool
    o, s = chunk_kda_cpu(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert s.data_ptr() != h0.data_ptr() and s.is_contiguous()
    o2, s2 = chunk_kda_cpu(q, k, v, g, beta, initial_state=h0.contiguous(), output_final_state=True)
    assert torch.equal(o2, o) and torch.equal(s2, s)
    o_none, s_none = chunk_kda_cpu(q, k, v, g, beta, initial_state=h0)
    assert s_none is None and torch.equal(o_none, o)


def test_rejects_bad_arguments(kda_inputs):
    q, k, v, g, beta = kda_inputs(1, 8, 2, 16, 16, "k3")
    with pytest.raises(ValueError, match="beta"):
        chunk_kda_cpu(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda_cpu(q, k, v, g, beta, chunk_size=24)
    with pytest.raises(ValueError, match="sub_chunk"):
        chunk_kda_cpu(q, k, v, g, beta, sub_chunk=8)


def test_dispatch(monkeypatch, kda_inputs):
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    cpu = torch.device("cpu")
    assert chunk_backend() == "cpu" and chunk_backend("TORCH") == "torch" and chunk_backend("naive") == "naive"
    assert _dispatch.resolve_backend(None, cpu) == "torch"              # kernels without a fused CPU kernel
    assert _dispatch.resolve_backend("cpu", cpu) == "torch"
    q, k, v, g, beta = kda_inputs(1, 45, 2, 16, 16, "kl", seed=9)
    fused = chunk_kda_cpu(q, k, v, g, beta, output_final_state=True)
    torch_path = chunk_kda_torch(q, k, v, g, beta, output_final_state=True)
    assert not torch.equal(fused[0], torch_path[0])    # the two differ in rounding, so the checks below tell them apart
    for kw, want in ((dict(), fused), (dict(backend="cpu"), fused), (dict(backend="torch"), torch_path)):
        o, s = chunk_kda(q, k, v, g, beta, output_final_state=True, **kw)
        assert torch.equal(o, want[0]) and torch.equal(s, want[1]), kw
    monkeypatch.setenv(_dispatch.ENV_VAR, "torch")
    assert chunk_backend() == "torch"
    assert torch.equal(chunk_kda(q, k, v, g, beta)[0], torch_path[0])
    monkeypatch.setenv(_dispatch.ENV_VAR, "cpu")
    assert chunk_backend() == "cpu"
    o, _ = recurrent_kda(q, k, v, g, beta)                               # no fused recurrent kernel: torch
    assert torch.equal(o, recurrent_kda_torch(q, k, v, g, beta)[0])
    # without numba: the torch path by default, and forcing "cpu" says why it cannot run
    monkeypatch.setattr(kda_cpu, "NUMBA_ERROR", "numba could not be imported (test)")
    monkeypatch.delenv(_dispatch.ENV_VAR)
    assert chunk_backend() == "torch"
    assert torch.equal(chunk_kda(q, k, v, g, beta)[0], torch_path[0])
    with pytest.raises(RuntimeError, match="numba could not be imported"):
        chunk_kda(q, k, v, g, beta, backend="cpu")


def test_autograd_still_takes_the_training_path(kda_inputs):
    q, k, v, g, beta = kda_inputs(1, 40, 2, 16, 16, "k3", seed=10)
    q.requires_grad_(True)
    o, _ = chunk_kda(q, k, v, g, beta)
    assert o.requires_grad
    o.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_without_numba_the_torch_path_runs():
    """A process where numba cannot be imported: the modules import, the dispatch reports "torch", and chunk_kda
    gives the torch path's result."""
    code = (
        "import sys; sys.modules['numba'] = None\n"
        "import torch\n"
        "from k3serve.kernels.cpu import kda_cpu\n"
        "from k3serve.kernels.kda import chunk_backend, chunk_kda\n"
        "from k3serve.kernels.kda_torch import chunk_kda_torch\n"
        "assert kda_cpu.NUMBA_ERROR.startswith('numba could not be imported'), kda_cpu.NUMBA_ERROR\n"
        "assert chunk_backend() == 'torch'\n"
        "x = [torch.randn(1, 40, 2, 16) for _ in range(3)]\n"
        "g, beta = -torch.rand(1, 40, 2, 16), torch.rand(1, 40, 2)\n"
        "assert torch.equal(chunk_kda(*x, g, beta)[0], chunk_kda_torch(*x, g, beta)[0])\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    env.pop(_dispatch.ENV_VAR, None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_the_callers_torch_thread_count_survives_the_kernel():
    """A process capped at 1 torch thread, numba's pool sized for 2: the kernel's calls (the first starts numba's
    OpenMP pool, which resets the shared runtime's thread count) leave torch at 1 thread, and the kernel itself
    runs on 1 thread."""
    code = (
        "import torch; torch.set_num_threads(1)\n"
        "import numba\n"
        "from k3serve.kernels.cpu.kda_cpu import chunk_kda_cpu\n"
        "x = [torch.randn(1, 40, 4, 16) for _ in range(3)]\n"
        "g, beta = -torch.rand(1, 40, 4, 16), torch.rand(1, 40, 4)\n"
        "for _ in range(2):\n"
        "    chunk_kda_cpu(*x, g, beta)\n"
        "    assert torch.get_num_threads() == 1, torch.get_num_threads()\n"
        "    assert numba.get_num_threads() == 1, numba.get_num_threads()\n"
        "print('ok', numba.threading_layer())\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "NUMBA_NUM_THREADS": "2"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr


def test_cached_kernel_is_tied_to_its_sources():
    """numba's cache is invalidated by edits to kda_cpu_kernel.py only: the _simd.py it was compiled against and
    the constants it shares with kda_torch must be recorded there (see kda_cpu_kernel's docstring)."""
    simd = Path(kda_cpu_kernel.__file__).with_name("_simd.py").read_bytes()
    assert hashlib.sha256(simd).hexdigest() == kda_cpu_kernel.SIMD_SHA256, (
        "_simd.py changed: set kda_cpu_kernel.SIMD_SHA256 to its new sha256 (this recompiles the cached kernel)")
    for name in ("_LOG_TINY", "_TINY", "_MAX_HALF_SPAN"):
        assert getattr(kda_cpu_kernel, name) == getattr(kda_torch, name), name


def test_vector_exp_within_one_ulp_and_flushes():
    """_simd.vexp, the kernel's exp: ~1 ulp from the exact exp where it keeps a value, arguments below lo
    clamped to lo, and results <= tiny set to exactly 0."""
    import numba
    import numpy as np

    from k3serve.kernels.cpu._simd import vexp, vload, vstore

    @numba.njit
    def run(x, out, lo, tiny):
        for j in range(0, x.shape[1], 16):
            vstore(out, 0, j, vexp(vload(x, 0, j), lo, tiny))

    x = np.linspace(-87.0, 88.0, 1 << 20, dtype=np.float32)[None, :]
    out = np.empty_like(x)
    run(x, out, np.float32(-87.0), np.float32(0.0))
    exact = np.exp(x.astype(np.float64))
    ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert (np.abs(out - exact) / ulp).max() < 1.01   # measured 1.0006
    lo, tiny = np.float32(kda_cpu_kernel._LOG_TINY - 1.0), np.float32(kda_cpu_kernel._TINY)
    x = np.array([[-1e4, -60.0, -35.0, -34.6, -34.4, -1.0, 0.0] + [0.0] * 9], dtype=np.float32)
    run(x, out[:, :16], lo, tiny)
    want = np.where(np.exp(np.maximum(x, lo).astype(np.float64)) > tiny, np.exp(x.astype(np.float64)), 0.0)
    assert (out[:, :16] == 0).tolist() == (want == 0).tolist()
    np.testing.assert_allclose(out[:, :16], want, rtol=2e-7, atol=0)
