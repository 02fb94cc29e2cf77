"""The loss-curve PNG written beside a training checkpoint (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a training machine
import matplotlib.pyplot as plt  # noqa: E402

PNG_NAME = "loss_curves.png"


def plot_curves(history: list[dict], out_dir: Path, title: str, unigram_bits: float | None = None) -> Path:
    """history: entries with ``train_s`` and ``train_bpb`` and/or ``heldout_bpb``; writes out_dir/loss_curves.png."""
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    tr = [(h["train_s"] / 60, h["train_bpb"]) for h in history if h.get("train_bpb") is not None]
    ev = [(h["train_s"] / 60, h["heldout_bpb"]) for h in history if h.get("heldout_bpb") is not None]
    if tr:
        ax.plot(*zip(*tr), label="train (running mean)", color="tab:blue", alpha=0.8)
    if ev:
        ax.plot(*zip(*ev), "o-", label="held-out", color="tab:orange")
    if unigram_bits is not None:
        ax.axhline(unigram_bits, ls=":", color="gray", label=f"unigram entropy {unigram_bits:.2f}")
    ax.axhline(3.0, ls="--", color="tab:green", lw=0.8, label="target 3.0")
    ax.set_xlabel("training time (min)")
    ax.set_ylabel("bits per byte")
    ax.set_ylim(0, 8.5)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / PNG_NAME
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
    return path
