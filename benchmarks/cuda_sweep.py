"""Launch configurations of the Triton kernels, timed and checked on a GPU (part of ``cuda_check``).

For the paged MLA decode kernel: context splits x tokens per block x warps, at the bench/K3 latent geometry
(rank 512 + rope 64) for a batch of short-context requests and for one long-context request. For chunked KDA:
chunk size x V block x warps at T = 4096, B * H = 256 and head size 128. Every configuration's output is compared with a
reference on the same device (the torch path for KDA, the default launch's merge-free single split for MLA),
so a configuration is only worth adopting if it is both faster and right; one that fails to compile (shared
memory, registers) is recorded with its error.
"""

from __future__ import annotations

import itertools

import torch


def _entry(config: dict, fn, ref: torch.Tensor, time_fn) -> dict:
    try:
        out = fn()
        torch.cuda.synchronize()
        return {**config, "seconds": time_fn(fn), "max_abs_err": float((out - ref).abs().max())}
    except Exception as exc:  # a configuration that does not compile or launch is a result of the sweep
        return {**config, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}


MLA_SHAPES = ((32, 8, 4096), (1, 96, 32768))   # (B, H, context): a decode batch; one long request, K3's heads
KDA_SHAPES = ((8, 32, 128),)                    # (B, H, K)


def mla_decode_sweep(device: torch.device, copy_gbps: float, time_fn, shapes=MLA_SHAPES, page: int = 64) -> list[dict]:
    from k3serve.kernels.mla_decode_triton import choose_splits, mla_decode_triton

    Dl, R = 512, 64
    rows = []
    for B, H, context in shapes:
        pages = B * context // page
        kv = torch.randn(pages, page, Dl + R, device=device)
        table = torch.randperm(pages, device=device).view(B, context // page).to(torch.int32)
        lens = torch.full((B,), context, dtype=torch.int32, device=device)
        ql, qp = torch.randn(B, H, Dl, device=device), torch.randn(B, H, R, device=device)
        scale = (Dl + R) ** -0.5
        ref = mla_decode_triton(ql, qp, kv, table, lens, scale, num_splits=1)
        auto = choose_splits(B, H, context, device)
        nbytes = kv.numel() * 4
        for splits, bn, warps in itertools.product(sorted({1, 4, 16, auto}), (16, 32), (4, 8)):
            cfg = {"B": B, "H": H, "context": context, "splits": splits, "auto_splits": auto, "block_tokens": bn,
                   "num_warps": warps}
            row = _entry(cfg, lambda: mla_decode_triton(ql, qp, kv, table, lens, scale, num_splits=splits,
                                                        block_tokens=bn, num_warps=warps), ref, time_fn)
            if "seconds" in row:
                row["fraction_of_copy"] = nbytes / row["seconds"] / 1e9 / copy_gbps
            rows.append(row)
        del kv
    return rows


def chunk_kda_sweep(device: torch.device, inputs, time_fn, T: int = 4096, shapes=KDA_SHAPES) -> list[dict]:
    from k3serve.kernels import kda_triton
    from k3serve.kernels.kda import chunk_kda

    rows = []
    for B, H, K in shapes:
        q, k, v, g, beta = inputs(B, T, H, K, device)
        ref_o, ref_s = chunk_kda(q, k, v, g, beta, scale=1.0, output_final_state=True, backend="torch")
        ref = torch.cat([ref_o.flatten(), ref_s.flatten()])
        for bt, bv, warps in itertools.product((16, 32), (16, 32, 64), (2, 4, 8)):
            def run(bt=bt, bv=bv, warps=warps):
                o, s = kda_triton._launch(kda_triton._chunk_kda_kernel, q, k, v, g, beta, 1.0, None, True,
                                          block_v=bv, BT=bt, num_warps=warps)
                return torch.cat([o.flatten(), s.flatten()])
            rows.append(_entry({"B": B, "H": H, "K": K, "T": T, "chunk": bt, "block_v": bv, "num_warps": warps},
                               run, ref, lambda fn: time_fn(fn, repeats=3, warmup=1)))
    return rows
