"""PNG plots written beside a run (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def plot_training(history: list[dict], evals: list[dict], path: str | Path, title: str = "") -> None:
    """Loss terms per step (left) and held-out perplexity (right).

    Args:
        history: ``[{"step": int, "loss": float, "kd": float, ...}, ...]``.
        evals: ``[{"step": int, "perplexity": float, "top1_agreement": float}, ...]``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [h["step"] for h in history]
    for key in ("loss", "kd", "ce", "focal", "hidden", "attn"):
        values = [h.get(key, 0.0) for h in history]
        if any(v for v in values):
            ax1.plot(steps, values, label=key, lw=2 if key == "loss" else 1)
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss")
    ax1.set_yscale("log")
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax1.set_title("training loss terms")
    if evals:
        ax2.plot([e["step"] for e in evals], [e["perplexity"] for e in evals], "o-", label="student")
        if evals[0].get("teacher_perplexity"):
            ax2.axhline(evals[0]["teacher_perplexity"], color="gray", ls="--", label="teacher")
        ax2.set_yscale("log")
        ax2.legend()
    ax2.set_xlabel("step")
    ax2.set_ylabel("held-out perplexity")
    ax2.grid(alpha=0.3)
    ax2.set_title("held-out perplexity")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
