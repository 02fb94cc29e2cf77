from benchmarks.kernels import chunk_flops, run_kernel_bench
from k3serve.kernels.cpu import kda_cpu
from k3serve.kernels.kda import chunk_backend


def test_run_kernel_bench_small():
    r = run_kernel_bench(T=128, H=2, K=16, repeats=1)
    for key in ("chunk_tokens_per_s", "recurrent_tokens_per_s", "speedup", "matmul_gflops",
                "chunk_achieved_fraction"):
        assert r[key] > 0, key
    assert r["sizes"]["T"] == 128 and r["sizes"]["H"] == 2 and r["sizes"]["K"] == 16
    # each chunk implementation's FLOPs at its own chunk size (the fused CPU kernel's 16, the torch path's 32)
    assert r["chunk_backend"] == chunk_backend()
    assert r["sizes"]["chunk"] == (kda_cpu.CHUNK if r["chunk_backend"] == "cpu" else 32)
    assert r["chunk_flops"] == chunk_flops(1, 128, 2, 16, 16, r["sizes"]["chunk"])
    assert r["torch_chunk_flops"] == chunk_flops(1, 128, 2, 16, 16, 32)
    for key in ("torch_chunk_tokens_per_s", "torch_chunk_achieved_fraction", "chunk_speedup_over_torch"):
        assert r[key] > 0, key
