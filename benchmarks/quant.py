"""``k3serve bench quant``: MXFP4 routed experts against bf16 on the trained tiny model, side by side in one run.

Four checkpoints are made from the shipped ``tiny-trained`` weights (fp32): ``bf16`` (every tensor cast to
bf16: the baseline), ``ptq`` (routed experts MXFP4 by PTQ from the fp32 weights, the rest bf16), ``qat`` (a
``k3serve train qat`` run, given with ``qat_dir`` or run here for ``qat_steps`` steps, the rest cast to bf16)
and the fp32 original. Measured:

* ``expert_bytes_ratio``: routed-expert bytes (packed + scales) / the same experts in bf16 (4.25 / 16 bits);
* ``checkpoint_bytes_ratio``: weight files on disk, ptq / bf16;
* ``bits_per_byte`` {fp32, bf16, ptq, qat} on held-out text (the ``k3serve eval`` windows) and ``kl_to_bf16``
  {ptq, qat}: mean KL(p_bf16 || p_quant) in nats per scored position, from the same windows;
* ``decode_tokens_per_s`` {bf16, mxfp4} by batch: the decode engine (``bench decode``'s harness), the two
  checkpoints measured alternately ``repeats`` times, best of each; ``decode_tokens_per_cpu_s``: the same,
  timed by this thread's CPU time (the local executor runs the model in this thread, one torch thread): what a
  shared, loaded machine disturbs least; ``decode_moe_fraction``: the share of a step in the MoE layers
  (routing, shared and routed experts; torch profiler, the best CPU-timed run); ``decode_weight_bytes_per_token``:
  weight bytes one step reads (non-expert weights once, the expected distinct experts of the batch) / batch;
* ``expert_matmul_us`` {bf16, mxfp4} by rows: one expert's three matmuls alone (CPU microseconds of this
  thread), alternated, best of each: the per-matrix objects (the unfused path, and numerics mode
  ``deterministic``'s);
* ``routed_experts_us`` {bf16, mxfp4, mxfp4_unfused} by rows: the routed-expert part of the first MoE layer of
  the two checkpoints (``MoE._routed_partial``: grouping, the experts, the weighted sum) on `rows` decode
  tokens, bf16 through its stacked grouped GEMM, MXFP4 through the fused CPU kernel (``moe_mxfp4.py``, what
  serving runs) and through the unfused per-expert loop; CPU microseconds, alternated, best of each;
* ``decode_interleaved`` by batch: a bf16 and an MXFP4 decode engine built side by side, their steps
  interleaved one by one (``decode_steps`` x 4 each), CPU and wall milliseconds per step summed over all
  steps, and ``mxfp4_over_bf16`` (tokens per CPU-second, MXFP4 / bf16): both engines see the same background
  load at the same moments, so this ratio scatters far less on a shared machine than separate timed runs.
"""

from __future__ import annotations

import copy
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from benchmarks.decode import _decode_rate, decoding_engine
from k3serve.model.checkpoint import inspect_checkpoint, load_config
from k3serve.model.config import ModelConfig
from k3serve.model.names import SplitKind, checkpoint_specs
from k3serve.model.presets import write_preset_checkpoint
from k3serve.model.quant_check import spec_bytes
from k3serve.model.quantize import cast_checkpoint, quantize_checkpoint

PRESET = "tiny-trained"


def weight_bytes_per_token(cfg: ModelConfig, batch: int) -> float:
    """Weight bytes a decode step of `batch` tokens reads, per token (see module doc)."""
    dense = per_expert = 0
    for s in checkpoint_specs(cfg):
        if s.split.kind is SplitKind.EXPERT:
            if s.split.expert == 0 and ".layers." in s.name:
                per_expert += spec_bytes(s, cfg)
        elif not s.name.endswith("embed_tokens.weight"):
            dense += spec_bytes(s, cfg)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    per_expert //= max(1, moe_layers)  # expert 0 of every MoE layer was summed
    e, k = cfg.num_experts, cfg.num_experts_per_token
    distinct = e * (1 - (1 - k / e) ** batch)
    return (dense + moe_layers * distinct * per_expert) / batch


def expert_matmul_us(cfg: ModelConfig, rows: int, iters: int = 200, rounds: int = 5) -> dict[str, float]:
    """CPU microseconds (this thread) for one routed expert's three matmuls (w1, w3, w2 on `rows` tokens), bf16
    weights vs MXFP4 (the serving objects of ``model/layers/expert_weights.py``), alternated `rounds` times, best
    of each."""
    from k3serve.kernels.mxfp4 import quantize_mxfp4
    from k3serve.model.layers.expert_weights import DenseLinear, MXFP4Linear

    g = torch.Generator().manual_seed(0)
    e_in, mi = cfg.expert_input_size, cfg.moe_intermediate_size
    ws = [torch.randn(mi, e_in, generator=g), torch.randn(mi, e_in, generator=g), torch.randn(e_in, mi, generator=g)]
    forms = {"bf16": [DenseLinear(w.bfloat16()) for w in ws], "mxfp4": [MXFP4Linear(*quantize_mxfp4(w)) for w in ws]}
    x = torch.randn(rows, e_in, generator=g).bfloat16()
    best = dict.fromkeys(forms, float("inf"))
    for _ in range(rounds):
        for name, (l1, l3, l2) in forms.items():
            t = time.thread_time()
            for _ in range(iters):
                l2(l1(x) * l3(x))
            best[name] = min(best[name], (time.thread_time() - t) / iters * 1e6)
    return best


def routed_experts_us(bf16: Path, ptq: Path, rows: int, iters: int = 200, rounds: int = 5) -> dict[str, float]:
    """``routed_experts_us`` of the module doc for `rows` decode tokens (one per request)."""
    from k3serve.model.layers.ffn import MoE
    from k3serve.model.loader import load_model

    moes = {name: next(layer.ffn for layer in load_model(path).layers if isinstance(layer.ffn, MoE))
            for name, path in (("bf16", bf16), ("mxfp4", ptq))}
    if moes["mxfp4"].fused is None:
        raise RuntimeError("the MXFP4 checkpoint's MoE layer has no fused kernel (numba missing?)")
    unfused = copy.copy(moes["mxfp4"])  # the same experts (per-expert views of the stacks), without the kernel
    unfused.fused = None
    moes["mxfp4_unfused"] = unfused
    cfg = moes["bf16"].cfg
    g = torch.Generator().manual_seed(0)
    ids, w = moes["bf16"].route(torch.randn(rows, cfg.hidden_size, generator=g).bfloat16())
    z = torch.randn(rows, cfg.expert_input_size, generator=g).bfloat16()
    best = dict.fromkeys(moes, float("inf"))
    for _ in range(rounds):
        for name, moe in moes.items():
            t = time.thread_time()
            for _ in range(iters):
                moe._routed_partial(z, ids, w, rows > 1)
            best[name] = min(best[name], (time.thread_time() - t) / iters * 1e6)
    return best


def interleaved_decode(bf16: Path, ptq: Path, batch: int, context: int, steps: int) -> dict[str, float]:
    """``decode_interleaved`` of the module doc for one batch size."""
    engines = {name: decoding_engine(str(path), load_config(path), batch, context, steps + 4)
               for name, path in (("bf16", bf16), ("mxfp4", ptq))}
    cpu, wall = dict.fromkeys(engines, 0.0), dict.fromkeys(engines, 0.0)
    for e in engines.values():
        e.step()  # warm-up
    for i in range(steps):
        for name in (("bf16", "mxfp4") if i % 2 == 0 else ("mxfp4", "bf16")):  # neither always goes first
            t, w = time.thread_time(), time.perf_counter()
            engines[name].step()
            cpu[name] += time.thread_time() - t
            wall[name] += time.perf_counter() - w
    for e in engines.values():
        e.executor.close()
    return {"bf16_cpu_ms_per_step": cpu["bf16"] / steps * 1e3, "mxfp4_cpu_ms_per_step": cpu["mxfp4"] / steps * 1e3,
            "bf16_wall_ms_per_step": wall["bf16"] / steps * 1e3, "mxfp4_wall_ms_per_step": wall["mxfp4"] / steps * 1e3,
            "mxfp4_over_bf16": cpu["bf16"] / cpu["mxfp4"], "mxfp4_over_bf16_wall": wall["bf16"] / wall["mxfp4"]}


def run_quant_bench(quality: Callable[[dict[str, str], int, int], dict], run_qat: Callable[[Path, Path, int, str, int], Path],
                    qat_dir: str | None = None, qat_steps: int = 20, rule: str = "ocp", eval_bytes: int = 32768,
                    context: int = 256, batches: tuple[int, ...] = (1, 8), decode_context: int = 64,
                    decode_steps: int = 16, repeats: int = 2, seed: int = 1, matmul_iters: int = 200) -> dict:
    """The measurements of the module doc. `quality(ckpts, eval_bytes, context)` and `run_qat(full, out, steps,
    rule, seed)` are :func:`k3serve.train.quant_eval.quality` / ``run_qat`` (passed in: ``train`` imports
    ``bench``, so ``bench`` cannot import ``train``)."""
    with tempfile.TemporaryDirectory(prefix="k3serve-bench-quant-") as tmp:
        d = Path(tmp)
        full = write_preset_checkpoint(PRESET, d / "fp32")
        bf16 = cast_checkpoint(full, d / "bf16", "bfloat16")
        ptq = quantize_checkpoint(full, d / "ptq", rule, "bfloat16")
        t0 = time.perf_counter()
        qat_src = Path(qat_dir) if qat_dir else run_qat(full, d / "qat_run", qat_steps, rule, seed)
        qat_s = time.perf_counter() - t0
        qat = cast_checkpoint(qat_src, d / "qat", "bfloat16")
        info_bf16, info_ptq = inspect_checkpoint(bf16), inspect_checkpoint(ptq)
        scores = quality({"fp32": str(full), "bf16": str(bf16), "ptq": str(ptq), "qat": str(qat)}, eval_bytes, context)
        rates: dict[str, dict[str, float]] = {"bf16": {}, "mxfp4": {}}
        cpu_rates: dict[str, dict[str, float]] = {"bf16": {}, "mxfp4": {}}
        moe_share: dict[str, dict[str, float]] = {"bf16": {}, "mxfp4": {}}
        for b in batches:
            for _ in range(repeats):  # alternate, so both see the same background load
                for name, path in (("bf16", bf16), ("mxfp4", ptq)):
                    cfg = load_config(path)
                    for clock, into in ((time.perf_counter, rates), (time.thread_time, cpu_rates)):
                        rate, parts = _decode_rate(str(path), cfg, b, decode_context, decode_steps, clock=clock)
                        if rate > into[name].get(str(b), 0.0):
                            into[name][str(b)] = rate
                            if clock is time.thread_time:
                                moe_share[name][str(b)] = parts["fraction"]["moe"]
        cfg_bf16, cfg_mx = load_config(bf16), load_config(ptq)
        routed = {str(b): routed_experts_us(bf16, ptq, b, iters=matmul_iters) for b in batches}
        interleaved = {str(b): interleaved_decode(bf16, ptq, b, decode_context, 4 * decode_steps) for b in batches}
    matmul = {str(b): expert_matmul_us(cfg_bf16, b, iters=matmul_iters) for b in batches}
    return {
        "preset": PRESET, "scale_rule": rule, "threads": torch.get_num_threads(),
        "expert_bytes_ratio": info_ptq["mxfp4_bytes"] / info_ptq["routed_expert_bf16_bytes"],
        "checkpoint_bytes_ratio": info_ptq["weights_bytes"] / info_bf16["weights_bytes"],
        "checkpoint_bytes": {"bf16": info_bf16["weights_bytes"], "mxfp4": info_ptq["weights_bytes"]},
        **scores,
        "qat": {"source": qat_dir or f"train qat, {qat_steps} steps in this run", "seconds": qat_s},
        "decode_tokens_per_s": rates,
        "decode_mxfp4_over_bf16": {b: rates["mxfp4"][b] / rates["bf16"][b] for b in rates["bf16"]},
        "decode_tokens_per_cpu_s": cpu_rates,
        "decode_cpu_mxfp4_over_bf16": {b: cpu_rates["mxfp4"][b] / cpu_rates["bf16"][b] for b in cpu_rates["bf16"]},
        "decode_moe_fraction": moe_share,
        "decode_weight_bytes_per_token": {
            "bf16": {str(b): weight_bytes_per_token(cfg_bf16, b) for b in batches},
            "mxfp4": {str(b): weight_bytes_per_token(cfg_mx, b) for b in batches}},
        "expert_matmul_us": matmul,
        "routed_experts_us": routed,
        "decode_interleaved": interleaved,
        "decode_context_tokens": decode_context, "decode_steps": decode_steps,
    }
