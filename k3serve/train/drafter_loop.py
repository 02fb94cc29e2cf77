"""``k3serve train drafter``: train an EAGLE-3 drafter for a frozen target (docs/speculative.md, EAGLE-3).

Per step: one target forward (no autograd) over a batch of corpus windows gives its distributions p and the
features the drafter fuses; the drafter is unrolled for ``ttt_steps`` on its own output features (training-time
test, k3serve.model.eagle3.attention) and each step's q is scored against the target's p at that position with
the LK loss (or KL). Only the drafter's tensors are trained; its copies of the target's embedding and head
stay frozen.

Out dir (a drafter checkpoint at every save)::

    config.json, model.safetensors   the drafter (k3serve.model.eagle3.weights)
    train_log.json                   settings, history (losses, held-out acceptance), final tokens/verify k = 1..7
    drafter_curves.png               losses, per-position acceptance, tokens per verify against k
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from k3serve.model.checkpoint import load_config
from k3serve.model.eagle3.config import DEFAULT_WINDOW, DrafterConfig
from k3serve.model.eagle3.drafter import Eagle3Drafter
from k3serve.model.eagle3.features import target_features
from k3serve.model.eagle3.weights import drafter_specs, init_drafter_weights, is_frozen, save_drafter
from k3serve.model.loader import load_model, load_weights
from k3serve.model.model import HybridModel
from k3serve.model.state import DenseLatentCache, ForwardBatch
from k3serve.train.corpus import eval_windows, load_corpus, sample_windows
from k3serve.model.eagle3.chain_eval import EvalSet, chain_stats, make_eval_set
from k3serve.train.drafter_loss import DrafterLoss, acceptance, drafter_loss
from k3serve.train.drafter_plot import plot_drafter
from k3serve.train.loop import TrainError
from k3serve.train.schedule import Schedule

LOG_FILE = "train_log.json"
EVAL_KS = tuple(range(1, 8))


@dataclass(frozen=True)
class DrafterTrainConfig:
    """One run's settings (flags of ``k3serve train drafter``)."""

    target: str  # checkpoint directory of the target
    out: str
    loss: DrafterLoss = DrafterLoss.LK
    ttt_steps: int = 7
    minutes: float | None = None
    steps: int | None = None
    seed: int = 0
    batch: int = 8
    context: int = 256
    lr: float = 2e-3
    warmup_steps: int = 20
    window: int = DEFAULT_WINDOW
    corpus: str | None = None
    eval_every_s: float = 120.0
    eval_prompts: int = 16
    eval_prompt_len: int = 128
    eval_gen_len: int = 64
    eval_tokens: int = 4096  # held-out teacher-forced loss windows

    def __post_init__(self) -> None:
        if (self.steps is None) == (self.minutes is None):
            raise TrainError("give exactly one of --steps and --minutes")
        if self.ttt_steps < 1:
            raise TrainError(f"--ttt-steps must be >= 1, got {self.ttt_steps}")
        if self.batch < 1 or self.context <= self.ttt_steps + 1:
            raise TrainError(f"--batch must be >= 1 and --context > ttt steps + 1 (got {self.batch}, {self.context})")

    def progress(self, step: int, train_s: float) -> float:
        return step / self.steps if self.steps is not None else train_s / (60.0 * self.minutes)

    def settings(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["loss"] = self.loss.value
        return d


def unrolled_losses(drafter: Eagle3Drafter, target: HybridModel, x: torch.Tensor, steps: int,
                    kind: DrafterLoss) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """x `[B, L]` windows -> per step j: (mean loss, mean sum_x min(p, q)) over its valid query positions."""
    b = x.shape[0]
    batch = ForwardBatch(target.new_kda_state(b), DenseLatentCache(target.cfg.num_mla_layers, b), [0] * b)
    f = target_features(target, drafter.cfg, x, batch)
    p = f.logits.softmax(-1)  # [B, L, V]
    g = drafter.fuse(f.low, f.mid, f.high)
    un = drafter.unroll(x[:, 1:], g[:, :-1], steps)  # query p predicts x_{p+2}: target probs at p + 1
    losses, accs = [], []
    for j, lg in enumerate(un.logits, start=1):
        pj, qj = p[:, 1:][:, j - 1:], lg[:, j - 1:]
        losses.append(drafter_loss(kind, pj, qj).mean())
        accs.append(acceptance(pj, qj.detach()).mean())
    return losses, accs


def target_dir(target: str) -> Path:
    path = Path(target)
    if path.is_dir():
        return path
    from k3serve.model.presets import TRAINED, trained_dir

    if target in TRAINED:
        return trained_dir(target)
    raise TrainError(f"--target {target}: not a checkpoint directory (nor a trained preset: {sorted(TRAINED)})")


class _Run:
    def __init__(self, cfg: DrafterTrainConfig) -> None:
        self.cfg, self.out = cfg, Path(cfg.out)
        tdir = target_dir(cfg.target)
        self.target = load_model(tdir)
        self.dcfg = DrafterConfig.for_target(load_config(tdir), cfg.window)
        self.params = {n: t.requires_grad_(not is_frozen(self.dcfg, n)) for n, t in
                       init_drafter_weights(self.dcfg, load_weights(tdir), cfg.seed).items()}
        self.drafter = Eagle3Drafter(self.dcfg, self.params)
        names = [s.name for s in drafter_specs(self.dcfg) if not is_frozen(self.dcfg, s.name)]
        decay = [self.params[n] for n in names if self.params[n].dim() >= 2]
        flat = [self.params[n] for n in names if self.params[n].dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": flat, "weight_decay": 0.0}],
                                     lr=cfg.lr, betas=(0.9, 0.95))
        self.sched = Schedule(cfg.lr, cfg.warmup_steps)
        self.step, self.train_s, self.history, self.recent = 0, 0.0, [], []

    def train_step(self, x: torch.Tensor) -> tuple[float, list[float]]:
        cfg = self.cfg
        lr = self.sched.lr(self.step, cfg.progress(self.step, self.train_s))
        for grp in self.opt.param_groups:
            grp["lr"] = lr
        losses, accs = unrolled_losses(self.drafter, self.target, x, cfg.ttt_steps, cfg.loss)
        loss = torch.stack(losses).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([t for t in self.params.values() if t.requires_grad], 1.0)
        self.opt.step()
        self.step += 1
        return float(loss.detach()), [float(a) for a in accs]

    def evaluate(self, es: EvalSet, heldout: torch.Tensor, ks: tuple[int, ...]) -> dict:
        with torch.no_grad():
            losses, accs = unrolled_losses(self.drafter, self.target, heldout, self.cfg.ttt_steps, self.cfg.loss)
        stats = {k: chain_stats(self.drafter, es, k) for k in ks}
        top = stats[max(ks)]
        return {"heldout_loss": float(torch.stack(losses).mean()), "heldout_overlap": [round(float(a), 4) for a in accs],
                "alpha": [round(a, 4) for a in top.position_acceptance()],
                "tokens_per_verify": {str(k): round(s.tokens_per_verify, 4) for k, s in stats.items()}}

    def record(self, ev: dict | None) -> None:
        mean = sum(self.recent) / len(self.recent) if self.recent else None
        self.history.append({"step": self.step, "train_s": round(self.train_s, 2), "train_loss": mean, **(ev or {})})

    def save(self, summary: dict, final: dict | None) -> None:
        save_drafter(self.dcfg, self.params, self.out)
        log = {"settings": self.cfg.settings(), "summary": summary, "final": final, "history": self.history}
        (self.out / LOG_FILE).write_text(json.dumps(log, indent=2) + "\n")
        plot_drafter(self.history, final, self.out,
                     f"k3serve train drafter: {self.cfg.loss.value.upper()} loss, {self.cfg.ttt_steps} unrolled steps, "
                     f"target {self.cfg.target}")


def run_drafter_training(cfg: DrafterTrainConfig, progress: bool = True) -> dict:
    """Train a drafter for cfg.target; leaves a drafter checkpoint, log and PNG in cfg.out; returns the summary."""
    run = _Run(cfg)
    run.out.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus(cfg.corpus)
    t0 = time.perf_counter()
    es = make_eval_set(run.target, run.dcfg, corpus.heldout, cfg.eval_prompts, cfg.eval_prompt_len, cfg.eval_gen_len)
    heldout = eval_windows(corpus.heldout, cfg.context + 1, cfg.eval_tokens)
    summary = {"corpus": corpus.source, "eval_set_s": round(time.perf_counter() - t0, 1),
               "eval_sequences": es.seqs.shape[0], "threads": torch.get_num_threads()}
    run.record(run.evaluate(es, heldout, (max(EVAL_KS),)))
    bar = tqdm(total=cfg.steps if cfg.steps is not None else round(60 * cfg.minutes), unit="step" if cfg.steps
               else "s", disable=not progress, mininterval=2.0, dynamic_ncols=True)
    last_eval = 0.0
    while cfg.progress(run.step, run.train_s) < 1.0:
        x = sample_windows(corpus.train, cfg.batch, cfg.context + 1, cfg.seed, run.step)
        t = time.perf_counter()
        loss, accs = run.train_step(x)
        run.train_s += time.perf_counter() - t
        run.recent = (run.recent + [loss])[-20:]
        bar.n = run.step if cfg.steps is not None else min(bar.total, round(run.train_s))
        h = run.history[-1]
        bar.set_postfix_str(f"loss {loss:.3f} overlap@1 {accs[0]:.3f} @{len(accs)} {accs[-1]:.3f} held-out "
                            f"alpha1 {h.get('alpha', [0])[0]:.2f} tpv@7 {h.get('tokens_per_verify', {}).get('7', 0):.2f}",
                            refresh=False)
        bar.update(0)
        if run.train_s - last_eval >= cfg.eval_every_s and cfg.progress(run.step, run.train_s) < 1.0:
            run.record(run.evaluate(es, heldout, (max(EVAL_KS),)))
            run.save(summary, None)
            last_eval = run.train_s
    bar.close()
    final = run.evaluate(es, heldout, EVAL_KS)
    run.record(final)
    summary.update({"steps": run.step, "train_s": round(run.train_s, 1),
                    "tokens_trained": run.step * cfg.batch * cfg.context,
                    "tokens_per_verify": final["tokens_per_verify"], "alpha_k7": final["alpha"],
                    "heldout_loss": final["heldout_loss"]})
    run.save(summary, final)
    return {"out": str(run.out), **summary}
