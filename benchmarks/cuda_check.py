"""The CUDA path on a real GPU: rooflines, the Triton kernels' speed, the model's accuracy and decode speed.

``python -m benchmarks.cuda_check --out DIR`` (``scripts/cuda_check.sh`` runs it after the kernel tests)
writes ``DIR/cuda_check.json``. Every part runs on its own: one that raises is recorded with its error and the
others still run, so one device session reports everything it can.

* ``roofline``: what this device measures itself (device-to-device copy GB/s counting read + write; bf16,
  fp32 and TF32 matmul TFLOP/s at 8192^3), the ceilings the figures below are fractions of.
* ``kernels``: chunked KDA (Triton) at T = 4096, K = 64 and 128, at B*H = 4 (the CPU bench's shape: one
  program per head and 64-wide value block, latency-bound on a 132-SM GPU) and at B*H = 256 (enough programs
  to fill it); FLOPs counted as ``k3serve bench kernels`` counts them (``kernels/flops.py``, at the kernel's
  chunk size 32), against the fp32 matmul rate, since the kernel multiplies in IEEE fp32 (``tl.dot``
  ``input_precision="ieee"``), and against bf16's. A recurrent KDA decode step and the paged MLA decode kernel
  against the copy bandwidth (bytes they must read and write).
* ``model``: ``cuda_model.check_preset`` for tiny-trained, tiny-linear and bench.
* ``sweep``: launch configurations of the MLA decode and chunked KDA kernels, timed and checked
  (``cuda_sweep.py``).
* ``decode``: the bench preset's decode step through the engines on CUDA at batch 1 / 8 / 32 (context 256),
  tokens/s and the step-byte model of ``bench decode`` against the copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from k3serve.kernels.flops import chunk_flops
from k3serve.kernels.kda import chunk_kda, recurrent_kda
from k3serve.kernels.mla_decode import mla_decode
from k3serve.model.config_file import load_config
from k3serve.model.presets import write_preset_checkpoint


def cuda_time(fn, repeats: int = 20, warmup: int = 3) -> float:
    """Median seconds of one call of `fn`, by CUDA events after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def roofline(device: torch.device) -> dict:
    n = 1 << 28  # 1 GiB of fp32 each way, many times the 60 MB L2
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    copy_s = cuda_time(lambda: dst.copy_(src))
    del src, dst
    out = {"copy_gbps": 2 * 4 * n / copy_s / 1e9}
    m = 8192
    for name, dtype, tf32 in (("bf16_tflops", torch.bfloat16, False), ("fp32_tflops", torch.float32, False),
                              ("tf32_tflops", torch.float32, True)):
        a = torch.randn(m, m, device=device, dtype=dtype)
        b = torch.randn(m, m, device=device, dtype=dtype)
        before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            out[name] = 2 * m**3 / cuda_time(lambda: a @ b, repeats=10) / 1e12
        finally:
            torch.backends.cuda.matmul.allow_tf32 = before
    return out


def _kda_inputs(B: int, T: int, H: int, K: int, device: torch.device, seed: int = 0):
    """``bench kernels``' inputs (K3 gate, V = K), on `device`."""
    from benchmarks.kernels import _inputs

    return tuple(x.to(device) for x in _inputs(B, T, H, K, -5.0, seed))


CHUNK_SHAPES = ((1, 4, 64), (1, 4, 128), (8, 32, 64), (8, 32, 128))  # (B, H, K)


def chunk_kda_bench(device: torch.device, roof: dict, T: int = 4096, shapes=CHUNK_SHAPES) -> list[dict]:
    rows = []
    for B, H, K in shapes:
        q, k, v, g, beta = _kda_inputs(B, T, H, K, device)
        s = cuda_time(lambda: chunk_kda(q, k, v, g, beta, scale=1.0, output_final_state=True, backend="triton"),
                      repeats=5, warmup=2)
        flops = chunk_flops(B, T, H, K, K, 32)
        tflops = flops / s / 1e12
        rows.append({"B": B, "T": T, "H": H, "K": K, "V": K, "seconds": s, "tokens_per_s": B * T / s,
                     "tflops": tflops, "fraction_of_fp32_matmul": tflops / roof["fp32_tflops"],
                     "fraction_of_bf16_matmul": tflops / roof["bf16_tflops"]})
    return rows


def recurrent_step_bench(device: torch.device, roof: dict, B: int = 32, H: int = 8, K: int = 128) -> dict:
    """One decode token through recurrent KDA: reads and writes the [B, H, K, K] fp32 state."""
    q, k, v, g, beta = _kda_inputs(B, 1, H, K, device)
    h0 = torch.randn(B, H, K, K, device=device)
    s = cuda_time(lambda: recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                        backend="triton"))
    nbytes = 2 * h0.numel() * 4
    return {"B": B, "H": H, "K": K, "seconds": s, "state_bytes_moved": nbytes, "gbps": nbytes / s / 1e9,
            "fraction_of_copy": nbytes / s / 1e9 / roof["copy_gbps"]}


def mla_decode_bench(device: torch.device, roof: dict, B: int = 32, H: int = 8, context: int = 4096,
                     page: int = 64) -> dict:
    """The paged absorbed MLA decode kernel (latent 512 + rope 64, the bench and K3 geometry): reads every
    request's `context` rows once."""
    Dl, R = 512, 64
    pages = B * context // page
    kv = torch.randn(pages, page, Dl + R, device=device)
    table = torch.randperm(pages, device=device, dtype=torch.int64).view(B, context // page).to(torch.int32)
    lens = torch.full((B,), context, dtype=torch.int32, device=device)
    ql, qp = torch.randn(B, H, Dl, device=device), torch.randn(B, H, R, device=device)
    s = cuda_time(lambda: mla_decode(ql, qp, kv, table, lens, (Dl + R) ** -0.5, backend="triton"))
    nbytes = kv.numel() * 4
    return {"B": B, "H": H, "context": context, "seconds": s, "kv_bytes_read": nbytes, "gbps": nbytes / s / 1e9,
            "fraction_of_copy": nbytes / s / 1e9 / roof["copy_gbps"]}


def decode_bench(ckpt: str, device: str, roof: dict, batches=(1, 8, 32), context: int = 256,
                 steps: int = 16) -> dict:
    from benchmarks.decode import decoding_engine, step_bytes

    cfg = load_config(ckpt)
    out = {}
    for b in batches:
        engine = decoding_engine(ckpt, cfg, b, context, 2 * steps + 4, device=device)
        step_s = cuda_time(engine.step, repeats=steps, warmup=2)  # warm-up: Triton compiles, the allocator
        gbps = step_bytes(cfg, b, context) / step_s / 1e9
        out[str(b)] = {"step_s": step_s, "tokens_per_s": b / step_s, "step_bytes_gbps": gbps,
                       "fraction_of_copy": gbps / roof["copy_gbps"]}
    base = out[str(batches[0])]["tokens_per_s"]
    for b in batches:
        out[str(b)]["batch_scaling"] = out[str(b)]["tokens_per_s"] / base
    return out


def _part(report: dict, name: str, fn) -> None:
    """Run one part; its result or its error (with the traceback's tail) goes into the report."""
    print(f"cuda_check: {name} ...", flush=True)
    try:
        report[name] = fn()
    except Exception as exc:  # a failing part is a finding to report, not a reason to lose the others
        report[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
        print(f"cuda_check: {name} FAILED: {type(exc).__name__}: {exc}", flush=True)


PARTS = ("roofline", "kernels", "model", "decode", "sweep")


def run_cuda_check(out_dir: Path, presets=("tiny-trained", "tiny-linear", "bench"), parts=PARTS) -> dict:
    """The parts named in `parts` (the roofline always: the others are fractions of it); the report is
    rewritten after each part, so a run cut short still leaves what it measured."""
    if not torch.cuda.is_available():
        print("cuda_check: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        raise SystemExit(2)
    import triton

    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here (PyTorch's default, said explicitly)
    props = torch.cuda.get_device_properties(device)
    report: dict = {"device": {"name": props.name, "capability": list(torch.cuda.get_device_capability()),
                               "multiprocessors": props.multi_processor_count,
                               "memory_gib": props.total_memory / 2**30, "torch": torch.__version__,
                               "triton": triton.__version__, "python": platform.python_version()}}
    out_dir.mkdir(parents=True, exist_ok=True)

    def part(name: str, fn, into: dict = report) -> None:
        _part(into, name, fn)
        (out_dir / "cuda_check.json").write_text(json.dumps(report, indent=2))

    part("roofline", lambda: roofline(device))
    roof = report["roofline"] if "error" not in report["roofline"] else None
    if roof is not None and "kernels" in parts:
        part("chunk_kda", lambda: chunk_kda_bench(device, roof))
        part("recurrent_kda_step", lambda: recurrent_step_bench(device, roof))
        part("mla_decode", lambda: mla_decode_bench(device, roof))
    if roof is not None and "sweep" in parts:
        from benchmarks.cuda_sweep import chunk_kda_sweep, mla_decode_sweep

        part("mla_decode_sweep", lambda: mla_decode_sweep(device, roof["copy_gbps"], cuda_time))
        part("chunk_kda_sweep", lambda: chunk_kda_sweep(device, _kda_inputs, cuda_time))
    with tempfile.TemporaryDirectory(prefix="k3serve-cuda-") as d:
        ckpts = {}
        if "model" in parts:
            report["model"] = {}
            for name in presets:
                ckpts[name] = str(write_preset_checkpoint(name, Path(d) / name))
                part(name, lambda n=name: check_preset(ckpts[n], "cuda"), report["model"])
        if roof is not None and "decode" in parts:
            ckpts.setdefault("bench", str(write_preset_checkpoint("bench", Path(d) / "bench")))
            part("decode", lambda: decode_bench(ckpts["bench"], "cuda", roof))
    return report


def check_preset(ckpt: str, device: str) -> dict:
    from benchmarks.cuda_model import check_preset as check

    return check(ckpt, device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for cuda_check.json")
    ap.add_argument("--presets", default="tiny-trained,tiny-linear,bench", help="presets the model part checks")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"a subset of {','.join(PARTS)}")
    args = ap.parse_args(argv)
    parts = tuple(p for p in args.parts.split(",") if p)
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"--parts: unknown {unknown}; expected a subset of {list(PARTS)}")
    report = run_cuda_check(args.out, tuple(p for p in args.presets.split(",") if p), parts)
    failed = [k for k, v in report.items() if isinstance(v, dict) and "error" in v]
    failed += [f"model.{k}" for k, v in report.get("model", {}).items() if "error" in v]
    print(json.dumps({k: v for k, v in report.items() if k not in ("model", "mla_decode_sweep", "chunk_kda_sweep")},
                     indent=1)[:6000])
    print("cuda_check: failed parts:", failed or "none")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
