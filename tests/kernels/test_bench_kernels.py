from k3serve.bench.kernels import chunk_flops, run_kernel_bench


def test_run_kernel_bench_small():
    r = run_kernel_bench(T=128, H=2, K=16, repeats=1)
    for key in ("chunk_tokens_per_s", "recurrent_tokens_per_s", "speedup", "matmul_gflops",
                "chunk_achieved_fraction"):
        assert r[key] > 0, key
    assert r["sizes"]["T"] == 128 and r["sizes"]["H"] == 2 and r["sizes"]["K"] == 16
    assert r["chunk_flops"] == chunk_flops(1, 128, 2, 16, 16)
