"""``k3serve train target``: pretrain a preset on a corpus; checkpoints, resume, periodic eval, curves.
``k3serve train qat`` runs the same loop from a trained checkpoint with MXFP4 fake-quantised experts
(:mod:`k3serve.train.qat`; ``init_from`` + ``qat_rule``).

Out dir (a serving checkpoint at every save, loadable as it is)::

    config.json, model.safetensors   the weights, public names, the preset's dtype (serving format)
    train_state.pt                   optimizer moments, step, training seconds, history (for --resume)
    train_log.json                   the run's settings, history and summary (bits/byte, throughput)
    loss_curves.png                  train and held-out bits/byte against training minutes

Time budgets (``--minutes``) count training steps only, not evaluation or saving; the schedule's progress is
the fraction of the budget spent, so a time-budgeted run is not bit-reproducible: ``--steps`` is.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from k3serve.kernels.flops import matmul_gflops
from k3serve.model.checkpoint import CheckpointReader, load_config, save_checkpoint
from k3serve.model.config import ModelConfig
from k3serve.model.names import checkpoint_specs
from k3serve.train.balance import update_biases
from k3serve.train.corpus import Corpus, eval_windows, load_corpus, sample_windows, unigram_entropy_bits
from k3serve.train.evaluate import windows_nll
from k3serve.train.flops import train_flops_per_token
from k3serve.train.params import BIAS_SUFFIX, init_params, model_view, no_decay
from k3serve.train.qat import MASTER_DIR, fake_quant_view, save_mxfp4
from k3serve.train.plot import plot_curves
from k3serve.train.schedule import Schedule
from k3serve.train.step import attach_route_recorder, byte_nll, count_bytes, window_logits

STATE_FILE = "train_state.pt"
LOG_FILE = "train_log.json"


class TrainError(ValueError):
    """A training run that cannot start as asked; the message names the flag."""


@dataclass(frozen=True)
class TrainConfig:
    """One run's settings (flags of ``k3serve train target``)."""

    model: ModelConfig
    preset: str
    out: str
    corpus: str | None = None  # None: the stdlib sources
    steps: int | None = None
    minutes: float | None = None
    seed: int = 0
    batch: int = 8
    context: int = 256
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every_s: float = 60.0
    eval_tokens: int = 8192
    save_every_s: float = 120.0
    resume: bool = False
    measure_matmul: bool = True  # torch.mm GFLOP/s at start and end, the ceiling achieved FLOP/s is set against
    init_from: str | None = None  # start from this checkpoint's weights (QAT: the trained target) instead of init
    qat_rule: str | None = None  # QAT: routed experts fake-quantised to MXFP4 with this scale rule (train/qat.py)

    def __post_init__(self) -> None:
        if (self.steps is None) == (self.minutes is None):
            raise TrainError("give exactly one of --steps and --minutes")
        if self.steps is not None and self.steps < 1:
            raise TrainError(f"--steps must be >= 1, got {self.steps}")
        if self.minutes is not None and self.minutes <= 0:
            raise TrainError(f"--minutes must be > 0, got {self.minutes}")
        if self.batch < 1 or self.context < 2:
            raise TrainError(f"--batch must be >= 1 and --context >= 2 (got {self.batch}, {self.context})")

    def progress(self, step: int, train_s: float) -> float:
        return step / self.steps if self.steps is not None else train_s / (60.0 * self.minutes)

    def settings(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "model"}
        d["model_type"] = self.model.model_type
        return d


@dataclass(frozen=True)
class TrainResult:
    out: str
    steps: int
    train_s: float
    tokens: int
    heldout_bpb: float
    summary: dict


def _optimizer(params: dict[str, torch.Tensor], cfg: TrainConfig) -> torch.optim.AdamW:
    names = [s.name for s in checkpoint_specs(cfg.model) if params[s.name].requires_grad]  # stable order
    groups = [{"params": [params[n] for n in names if not no_decay(n)], "weight_decay": cfg.weight_decay},
              {"params": [params[n] for n in names if no_decay(n)], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def _load_params(out: Path, model: ModelConfig) -> dict[str, torch.Tensor]:
    if load_config(out).to_hf_dict() != model.to_hf_dict():
        raise TrainError(f"{out} holds weights of a different model config")
    with CheckpointReader(out) as r:
        return {s.name: r.read(s.name).float().clone().requires_grad_(not s.name.endswith(BIAS_SUFFIX))
                for s in checkpoint_specs(model)}


def _view(params: dict[str, torch.Tensor], cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """What the forward sees: the leaves, or for QAT the leaves with fake-quantised routed experts."""
    return params if cfg.qat_rule is None else fake_quant_view(params, cfg.qat_rule)


def _heldout_bpb(params: dict[str, torch.Tensor], cfg: TrainConfig, windows: torch.Tensor) -> float:
    return windows_nll(model_view(cfg.model, _view(params, cfg)), windows).bits_per_byte


def load_train_state(path: Path) -> dict:
    """A run's saved optimizer state and counters, unpickled as tensors and plain data only (weights_only): a
    state file from elsewhere cannot run code on resume. TrainError when it holds anything else."""
    try:
        state = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise TrainError(f"{path} holds more than tensors and plain data; refusing to resume from it "
                         f"({str(e).splitlines()[0]})") from None
    if not isinstance(state, dict) or not {"optimizer", "step", "train_s", "tokens", "history"} <= state.keys():
        raise TrainError(f"{path} is not a training state (optimizer, step, train_s, tokens, history)")
    return state


class _Run:
    """Mutable state of one run (kept out of module scope)."""

    def __init__(self, cfg: TrainConfig, corpus: Corpus) -> None:
        self.cfg, self.corpus = cfg, corpus
        self.out = Path(cfg.out)
        self.sched = Schedule(cfg.lr, cfg.warmup_steps)
        self.eval_set = eval_windows(corpus.heldout, cfg.context, cfg.eval_tokens)
        self.step, self.train_s, self.tokens, self.history = 0, 0.0, 0, []
        if cfg.resume:
            if not (self.out / STATE_FILE).is_file():
                raise TrainError(f"--resume: {self.out} has no {STATE_FILE}")
            self.params = _load_params(self._weights_dir(), cfg.model)
            self.opt = _optimizer(self.params, cfg)
            state = load_train_state(self.out / STATE_FILE)
            self.opt.load_state_dict(state["optimizer"])
            self.step, self.train_s, self.tokens = state["step"], state["train_s"], state["tokens"]
            self.history = state["history"]
        else:
            if (self.out / STATE_FILE).exists():
                raise TrainError(f"--out {self.out} already holds a training run; pass --resume to continue it")
            self.params = (init_params(cfg.model, cfg.seed) if cfg.init_from is None
                           else _load_params(Path(cfg.init_from), cfg.model))
            self.opt = _optimizer(self.params, cfg)
        self.recent: list[float] = []  # last steps' train bits/byte (running mean for the curve)
        self.balance = 1.0

    def _weights_dir(self) -> Path:
        """Where the full-precision weights are saved: `out` itself, or `out/master` for QAT (out holds MXFP4)."""
        return self.out if self.cfg.qat_rule is None else self.out / MASTER_DIR

    def done(self) -> bool:
        return self.cfg.progress(self.step, self.train_s) >= 1.0

    def train_step(self) -> float:
        cfg = self.cfg
        lr = self.sched.lr(self.step, cfg.progress(self.step, self.train_s))
        for g in self.opt.param_groups:
            g["lr"] = lr
        x = sample_windows(self.corpus.train, cfg.batch, cfg.context + 1, cfg.seed, self.step)
        model = model_view(cfg.model, _view(self.params, cfg))
        records = attach_route_recorder(model)
        nll = byte_nll(window_logits(model, x, grad=True), x)
        loss = nll.sum() / max(1, count_bytes(x))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in self.params.values() if p.requires_grad], cfg.grad_clip)
        self.opt.step()
        stats = update_biases(self.params, records, cfg.model.name_prefix, cfg.model.num_experts_per_token)
        self.balance = stats.max_load_over_fair
        self.step += 1
        self.tokens += x[:, 1:].numel()
        return float(loss.detach()) / 0.6931471805599453

    def record(self, heldout_bpb: float | None) -> None:
        mean = sum(self.recent) / len(self.recent) if self.recent else None
        self.history.append({"step": self.step, "tokens": self.tokens, "train_s": round(self.train_s, 2),
                             "train_bpb": mean, "heldout_bpb": heldout_bpb,
                             "max_expert_load_over_fair": round(self.balance, 3)})

    def save(self, summary: dict) -> None:
        save_checkpoint(self.cfg.model, self.params, self._weights_dir())
        if self.cfg.qat_rule is not None:
            save_mxfp4(self.cfg.model, self.params, self.out, self.cfg.qat_rule)
        tmp = self.out / (STATE_FILE + ".tmp")
        torch.save({"optimizer": self.opt.state_dict(), "step": self.step, "train_s": self.train_s,
                    "tokens": self.tokens, "history": self.history}, tmp)
        tmp.replace(self.out / STATE_FILE)
        log = {"settings": self.cfg.settings(), "summary": summary, "history": self.history}
        (self.out / LOG_FILE).write_text(json.dumps(log, indent=2) + "\n")
        what = "target" if self.cfg.qat_rule is None else "qat (MXFP4 experts)"
        plot_curves(self.history, self.out, f"k3serve train {what}: {self.cfg.preset} on {self.corpus.source}",
                    summary.get("unigram_entropy_bits"))


def run_training(cfg: TrainConfig, progress: bool = True) -> TrainResult:
    """Train `cfg.model` from scratch (or resume) and leave a serving checkpoint in `cfg.out`."""
    corpus = load_corpus(cfg.corpus)
    run = _Run(cfg, corpus)
    run.out.mkdir(parents=True, exist_ok=True)
    mm_start = matmul_gflops() if cfg.measure_matmul else float("nan")
    flops_tok = train_flops_per_token(cfg.model, cfg.context)
    summary = {"corpus": corpus.source, "train_tokens": corpus.train.numel(), "heldout_tokens": corpus.heldout.numel(),
               "train_docs": corpus.train_docs, "heldout_docs": corpus.heldout_docs,
               "unigram_entropy_bits": unigram_entropy_bits(corpus.train),
               "heldout_unigram_entropy_bits": unigram_entropy_bits(corpus.heldout),
               "eval_bytes": count_bytes(run.eval_set), "threads": torch.get_num_threads(),
               "train_flops_per_token": flops_tok, "matmul_gflops_start": mm_start}
    if not run.history:
        run.record(_heldout_bpb(run.params, cfg, run.eval_set))
    bar = tqdm(total=cfg.steps if cfg.steps is not None else round(60 * cfg.minutes), initial=0,
               unit="step" if cfg.steps is not None else "s", disable=not progress, mininterval=2.0,
               dynamic_ncols=True)
    last_eval, last_save = run.train_s, run.train_s
    session_s, session_tokens = 0.0, 0
    while not run.done():
        t0 = time.perf_counter()
        bpb = run.train_step()
        dt = time.perf_counter() - t0
        run.train_s += dt
        session_s += dt
        session_tokens += cfg.batch * cfg.context
        run.recent = (run.recent + [bpb])[-20:]
        bar.n = run.step if cfg.steps is not None else min(bar.total, round(run.train_s))
        bar.set_postfix_str(f"tok/s {session_tokens / session_s:,.0f} loss {bpb:.3f} bpb "
                            f"held-out {run.history[-1]['heldout_bpb']:.3f}", refresh=False)
        bar.update(0)
        if run.train_s - last_eval >= cfg.eval_every_s or run.done():
            run.record(_heldout_bpb(run.params, cfg, run.eval_set))
            last_eval = run.train_s
        if run.train_s - last_save >= cfg.save_every_s and not run.done():
            run.save(summary)
            last_save = run.train_s
    bar.close()
    final = run.history[-1]["heldout_bpb"]
    tok_s = session_tokens / session_s if session_s else 0.0
    mm_end = matmul_gflops() if cfg.measure_matmul else float("nan")
    summary.update({"steps": run.step, "train_s": run.train_s, "tokens_trained": run.tokens,
                    "heldout_bpb": final, "tokens_per_s": tok_s, "matmul_gflops_end": mm_end,
                    "achieved_gflops": tok_s * flops_tok / 1e9,
                    "achieved_fraction_of_matmul": tok_s * flops_tok / 1e9 / max(1e-9, (mm_start + mm_end) / 2)})
    run.save(summary)
    return TrainResult(str(run.out), run.step, run.train_s, run.tokens, final, summary)
