"""PNG plots written beside a run (matplotlib's Agg canvas, headless, no pyplot state)."""

from __future__ import annotations

from pathlib import Path

from core.fsio import atomic_write

# A run plots at every held-out evaluation and checkpoint: above this many steps a series is drawn as the mean of
# equal buckets inside the band of their minimum and maximum (what a line of every point paints at the figure's
# few hundred pixels), so that a plot costs the same at step 100 and at step 1,000,000.
MAX_POINTS = 2000

TERMS = ("loss", "kd", "ce", "focal", "hidden", "attn")


def bucketed(steps: list[float], values: list[float], max_points: int = MAX_POINTS
             ) -> tuple[list[float], list[float], list[float], list[float]] | None:
    """``(steps, means, mins, maxs)`` over at most ``max_points`` equal buckets; None when the series is short."""
    n = len(values)
    if n <= max_points:
        return None
    xs, means, lows, highs = [], [], [], []
    for b in range(max_points):
        lo, hi = b * n // max_points, (b + 1) * n // max_points
        chunk = values[lo:hi]
        xs.append(sum(steps[lo:hi]) / (hi - lo))
        means.append(sum(chunk) / (hi - lo))
        lows.append(min(chunk))
        highs.append(max(chunk))
    return xs, means, lows, highs


def plot_training(history: list[dict], evals: list[dict], path: str | Path, title: str = "",
                  diverged_at: int | None = None) -> None:
    """Loss terms per step (left) and held-out perplexity (right), written atomically to ``path``.

    The PNG is rendered under a temporary name beside ``path`` and renamed over it, so a reader (a user
    watching a run, an export) sees the previous plot or the whole new one, never a torn file.

    Args:
        history: ``[{"step": int, "loss": float, "kd": float, ...}, ...]``.
        evals: ``[{"step": int, "perplexity": float, "top1_agreement": float}, ...]``.
        diverged_at: the step whose loss was not finite (a run that diverged), marked on the loss plot.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    steps = [h["step"] for h in history]
    for key in TERMS:
        values = [h.get(key, 0.0) for h in history]
        if any(v for v in values):
            lw = 2 if key == "loss" else 1
            short = bucketed(steps, values)
            if short is None:  # a lone step as a dot: a line of one point is invisible
                ax1.plot(steps, values, label=key, lw=lw, marker="o" if len(steps) == 1 else None)
            else:
                xs, means, lows, highs = short
                (line,) = ax1.plot(xs, means, label=key, lw=lw)
                ax1.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.2, lw=0)
                for edge in (lows, highs):  # thin edges: a one-step spike stays as visible as in a line of every point
                    ax1.plot(xs, edge, color=line.get_color(), alpha=0.5, lw=0.5)
    if diverged_at is not None:
        ax1.axvline(diverged_at, color="red", ls=":", label=f"diverged (step {diverged_at})")
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
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=100))


def plot_search(candidates: list[dict], winner: dict | None, path: str | Path, title: str = "") -> None:
    """A prune search at a glance: each candidate's KL to the teacher at each stage it reached, written atomically.

    Candidates run along the x axis by depth then widths, as ``search.json`` lists them: KL on one held-out
    block (every candidate), on all the search's held-out blocks (the finalists), after the short distillation
    (the top-k), and the winner.

    Args:
        candidates: ``search.json``'s rows: ``{"arch": str, "layers": int, "kl_init_1block": float | None,
            "kl_init": float | None, "kl_distilled": float | None, ...}``.
        winner: the winning row, or None.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    order = sorted(range(len(candidates)), key=lambda i: (candidates[i]["layers"], candidates[i]["arch"]))
    rows = [candidates[i] for i in order]
    fig = Figure(figsize=(max(6.0, 0.35 * len(rows) + 2), 4.5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    xs = range(len(rows))
    stages = (("kl_init_1block", "at init, 1 held-out block", "o", 0.5),
              ("kl_init", "at init, all search blocks (finalists)", "s", 0.8),
              ("kl_distilled", "after the short distillation (top-k)", "^", 1.0))
    for key, label, marker, alpha in stages:
        pts = [(x, r[key]) for x, r in zip(xs, rows) if r.get(key) is not None]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, alpha=alpha, label=label)
    if winner is not None:
        at = next((x for x, r in zip(xs, rows) if r["arch"] == winner["arch"]), None)
        kl = next((winner[k] for k in ("kl_distilled", "kl_init", "kl_init_1block") if winner.get(k) is not None), None)
        if at is not None and kl is not None:
            ax.scatter([at], [kl], marker="*", s=250, color="gold", edgecolor="black", zorder=3,
                       label=f"winner: {winner['arch']}")
    ax.set_xticks(list(xs), [r["arch"] for r in rows], rotation=75, fontsize=7)
    ax.set_ylabel("KL to the teacher (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=100))
