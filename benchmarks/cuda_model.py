"""The model on CUDA against the CPU fp32 reference: logit errors, greedy agreement, the serving path's tokens.

Used by ``benchmarks.cuda_check`` (``scripts/cuda_check.sh``) on a machine with a GPU. For one preset:

* ``fp32``: the fp32 checkpoint on CUDA (the Triton KDA, gate, short-conv kernels; torch matmuls with TF32
  off) against the same checkpoint on the CPU. Teacher-forced: one prefill over prompt + the reference's
  greedy tokens, every position's logits compared (``max_abs_logit_err``); then greedy generation on CUDA
  through the reference generator (chunked prefill, recurrent decode) compared token by token.
* ``bf16``: the same weights rounded to bf16 (the tensors a bf16 checkpoint stores in bf16; A_log, dt_bias,
  conv weights and the router bias stay fp32) run in bf16 on CUDA, against those rounded weights run in fp32
  on the CPU: the error of bf16 compute alone, weights held equal. ``vs_fp32_weights`` adds the rounding.
* ``engine_fp32``: the serving path on CUDA (``LocalPipeline(device="cuda")``: paged pools, the Triton paged
  MLA decode kernel, prefill -> decode handoff) against the CPU reference generator, several prompts in one
  batch.
"""

from __future__ import annotations

import time

import torch

from k3serve.contracts.requests import PrefillRequest
from k3serve.contracts.sampling import SamplingParams
from k3serve.disagg.pipeline import LocalPipeline
from k3serve.model.config_file import load_config
from k3serve.model.init import storage_dtype
from k3serve.model.loader import load_model, load_weights
from k3serve.model.model import HybridModel
from k3serve.model.names import checkpoint_specs
from k3serve.model.reference import reference_generate
from k3serve.model.state import DenseLatentCache, ForwardBatch


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, min(vocab, 256), (length + 7 * i,), generator=g).tolist() for i in range(n)]


def all_logits(model: HybridModel, ids: list[int]) -> torch.Tensor:
    """`[len(ids), vocab]` fp32 CPU: every position's logits of one prefill from a zero state."""
    cfg = model.cfg
    batch = ForwardBatch(model.new_kda_state(1), DenseLatentCache(cfg.num_mla_layers, 1), [0], decode=False)
    with torch.inference_mode():
        out = model.logits(torch.tensor([ids], device=model.device), batch, all_logits=True)[0]
    return out.float().cpu()


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts at the shorter end); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _compare(name: str, model: HybridModel, ref: HybridModel, prompt: list[int], max_tokens: int) -> dict:
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ref_out = reference_generate(ref, prompt, greedy)
    ref_logits = all_logits(ref, prompt + ref_out.token_ids)
    t = time.perf_counter()
    got_logits = all_logits(model, prompt + ref_out.token_ids)
    prefill_s = time.perf_counter() - t
    err = (got_logits - ref_logits).abs()
    top2 = ref_logits.topk(2, dim=-1).values
    out = reference_generate(model, prompt, greedy)
    div = first_divergence(out.token_ids, ref_out.token_ids)
    return {"what": name, "prompt_tokens": len(prompt), "generated": max_tokens,
            "max_abs_logit_err": float(err.max()), "mean_abs_logit_err": float(err.mean()),
            "max_abs_logit_err_prompt_end": float(err[len(prompt) - 1].max()),
            "min_ref_top2_gap": float((top2[:, 0] - top2[:, 1]).min()),
            "greedy_equal": div is None, "first_divergence": div,
            "tokens_equal_before_divergence": len(out.token_ids) if div is None else div,
            "teacher_forced_prefill_s": prefill_s}


def _bf16_weights(ckpt: str, device: str) -> tuple[dict, dict]:
    """(bf16-rounded weights on `device`, the same values in fp32 on the CPU)."""
    cfg = load_config(ckpt)
    wide = load_weights(ckpt)
    bf16_cfg = cfg.replace(torch_dtype="bfloat16")
    keep = {s.name: storage_dtype(s, bf16_cfg) for s in checkpoint_specs(cfg)}
    rounded = {n: (w.to(keep.get(n, w.dtype)) if w.is_floating_point() else w) for n, w in wide.items()}
    return ({n: w.to(device) for n, w in rounded.items()},
            {n: (w.float() if w.dtype == torch.bfloat16 else w) for n, w in rounded.items()})


def _engine_tokens(ckpt: str, device: str, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    pipe = LocalPipeline(ckpt, device=device)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = pipe.generate([PrefillRequest(f"r{i}", tuple(p), params) for i, p in enumerate(prompts)])
    finally:
        pipe.close()
    bad = {rid: str(o.error) for rid, o in outs.items() if o.error is not None}
    if bad:
        raise RuntimeError(f"engine requests failed on {device}: {bad}")
    return {rid: o.token_ids for rid, o in outs.items()}


def check_preset(ckpt: str, device: str, *, prompt_tokens: int = 96, max_tokens: int = 24,
                 engine_prompts: int = 4) -> dict:
    """The three comparisons of the module doc for the checkpoint at `ckpt` (fp32), on `device`."""
    cfg = load_config(ckpt)
    prompt = _prompts(1, prompt_tokens, cfg.vocab_size, seed=1)[0]
    ref = load_model(ckpt)
    result: dict = {"fp32": _compare("fp32 on device vs fp32 on the CPU", load_model(ckpt, device=device), ref,
                                     prompt, max_tokens)}
    on_dev, ref16_w = _bf16_weights(ckpt, device)
    bf16_cfg = cfg.replace(torch_dtype="bfloat16")
    bf16 = HybridModel(bf16_cfg, on_dev)
    result["bf16"] = _compare("bf16 on device vs the bf16-rounded weights in fp32 on the CPU", bf16,
                              HybridModel(cfg, ref16_w), prompt, max_tokens)
    result["bf16"]["vs_fp32_weights"] = _compare("bf16 on device vs the fp32 weights on the CPU", bf16, ref,
                                                 prompt, max_tokens)
    prompts = _prompts(engine_prompts, prompt_tokens, cfg.vocab_size, seed=2)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    want = {f"r{i}": reference_generate(ref, p, greedy).token_ids for i, p in enumerate(prompts)}
    got = _engine_tokens(ckpt, device, prompts, max_tokens)
    result["engine_fp32"] = {"requests": len(prompts),
                             "equal": sum(got[r] == want[r] for r in want),
                             "first_divergence": {r: first_divergence(got[r], want[r]) for r in want}}
    return result
