"""Quality of quantized checkpoints against bf16 (held-out bits/byte, KL) and a short QAT run, for
``k3serve bench quant`` (:mod:`benchmarks.quant`)."""

from __future__ import annotations

from pathlib import Path

import torch

from k3serve.model.checkpoint import load_config
from k3serve.model.loader import load_model
from k3serve.train.corpus import eval_windows, load_corpus
from k3serve.train.loop import TrainConfig, run_training
from k3serve.train.step import byte_nll, count_bytes, window_logits


def quality(ckpts: dict[str, str], eval_bytes: int = 32768, context: int = 256, batch: int = 8,
            corpus: str | None = None) -> dict:
    """bits_per_byte per checkpoint and mean KL(p_bf16 || p_k) per scored position for every k but bf16 / fp32,
    on the held-out windows ``k3serve eval`` scores (`ckpts` must hold "bf16"; `corpus` as ``--corpus``)."""
    windows = eval_windows(load_corpus(corpus).heldout, min(context, eval_bytes), eval_bytes)
    models = {k: load_model(p) for k, p in ckpts.items()}
    nats = dict.fromkeys(models, 0.0)
    kl = {k: 0.0 for k in models if k not in ("bf16", "fp32")}
    positions, nbytes = 0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i: i + batch]
        logits = {k: window_logits(m, w, grad=False).float() for k, m in models.items()}
        for k, lg in logits.items():
            nats[k] += float(byte_nll(lg, w).double().sum())
        ref = torch.log_softmax(logits["bf16"][:, :-1].double(), -1)
        for k in kl:
            lq = torch.log_softmax(logits[k][:, :-1].double(), -1)
            kl[k] += float((ref.exp() * (ref - lq)).sum())
        positions += w.shape[0] * (w.shape[1] - 1)
        nbytes += count_bytes(w)
    bpb = {k: v / nbytes / 0.6931471805599453 for k, v in nats.items()}
    return {"bits_per_byte": bpb, "kl_to_bf16": {k: v / positions for k, v in kl.items()},
            "bits_per_byte_gap_vs_bf16": {k: bpb[k] / bpb["bf16"] - 1 for k in kl}, "eval_bytes": nbytes}


def run_qat(full: Path, out: Path, steps: int, rule: str, seed: int) -> Path:
    """A short ``train qat`` of checkpoint `full` into `out` (no progress bar, no matmul probe)."""
    cfg = TrainConfig(load_config(full), f"qat of {full}", str(out), steps=steps, seed=seed, lr=5e-4,
                      warmup_steps=min(5, steps), eval_every_s=1e9, eval_tokens=2048, measure_matmul=False,
                      init_from=str(full), qat_rule=rule)
    run_training(cfg, progress=False)
    return out
