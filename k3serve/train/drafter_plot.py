"""The drafter run's PNG: losses, per-position acceptance on held-out text, tokens per verify against k."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a training machine
import matplotlib.pyplot as plt  # noqa: E402

DRAFTER_PNG = "drafter_curves.png"


def plot_drafter(history: list[dict], final: dict | None, out_dir: Path, title: str) -> Path:
    """history entries: ``train_s``, ``train_loss`` (running mean) and/or ``heldout_loss``, ``alpha`` (per-position
    acceptance at k = 7); final: ``tokens_per_verify`` {k: value}. Writes out_dir/drafter_curves.png."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), dpi=100)
    ax = axes[0]
    tr = [(h["train_s"] / 60, h["train_loss"]) for h in history if h.get("train_loss") is not None]
    ev = [(h["train_s"] / 60, h["heldout_loss"]) for h in history if h.get("heldout_loss") is not None]
    if tr:
        ax.plot(*zip(*tr), label="train (running mean)", color="tab:blue", alpha=0.8)
    if ev:
        ax.plot(*zip(*ev), "o-", label="held-out", color="tab:orange")
    ax.set_xlabel("training time (min)")
    ax.set_ylabel("loss (mean over the unrolled steps)")
    ax.grid(alpha=0.3)
    if tr or ev:
        ax.legend(fontsize=8)
    ax = axes[1]
    evals = [h for h in history if h.get("alpha")]
    cmap = plt.get_cmap("viridis")
    for i, h in enumerate(evals):
        ax.plot(range(1, len(h["alpha"]) + 1), h["alpha"], "o-", ms=3, color=cmap(i / max(1, len(evals) - 1)),
                label=f"{h['train_s'] / 60:.1f} min")
    ax.set_xlabel("draft position j (k = 7)")
    ax.set_ylabel("acceptance P(j | 1..j-1 accepted)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    if evals:
        ax.legend(fontsize=7)
    ax = axes[2]
    if final and final.get("tokens_per_verify"):
        ks = sorted(int(k) for k in final["tokens_per_verify"])
        ax.plot(ks, [final["tokens_per_verify"][str(k)] for k in ks], "o-", color="tab:green", label="greedy chain")
        ax.axhline(2.5, ls="--", color="gray", lw=0.8, label="target 2.5 at k = 3")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "at the end of the run", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_xlabel("drafts per verify k")
    ax.set_ylabel("tokens per verify (held-out)")
    ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = out_dir / DRAFTER_PNG
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
    return path
