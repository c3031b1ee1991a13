"""Write the gate's report: ``report.json`` (machines), ``report.md`` + ``scores_hist.png`` (people),
``samples.jsonl`` (every prompt with both outputs, its reference and scores)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from core.fsio import atomic_write, atomic_write_text


def _fmt(x: float | None, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{digits}f}"


def _cell(text: str, limit: int = 80) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def histogram(path: Path, candidate: list[float], baseline: list[float], floor: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lo = min(0.0, min(candidate + baseline))
    bins = [lo + (1.0 - lo) * k / 40 for k in range(41)]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(baseline, bins=bins, alpha=0.55, label="baseline", color="tab:blue")
    ax.hist(candidate, bins=bins, alpha=0.55, label="candidate", color="tab:orange")
    ax.axvline(floor, color="black", linestyle="--", linewidth=1, label=f"floor {floor:g}")
    ax.set_xlabel("BERTScore F1 per prompt")
    ax.set_ylabel("prompts")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    try:
        atomic_write(path, lambda f: fig.savefig(f, dpi=110, format="png"))  # whole or absent, as the text files
    finally:
        plt.close(fig)


def write_samples(path: Path, samples: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in samples))


def write_markdown(path: Path, report: dict) -> None:
    bs = report["bertscore"]
    diff, cand, base = bs["difference"], bs["candidate"], bs["baseline"]
    thr = report["threshold"]
    level = f"{100 * bs.get('confidence', 0.95):g} % interval"  # the run's --confidence, not always 95 %
    lines = [
        f"# Release gate: **{report['verdict'].upper()}**",
        "",
        f"- candidate: `{report['models']['candidate']['dir']}`",
        f"- baseline: `{report['models']['baseline']['dir']}`",
    ]
    if "teacher" in report["models"]:
        lines.append(f"- teacher: `{report['models']['teacher']['dir']}`")
    lines += [
        f"- prompts: `{report['prompts']['path']}` ({report['prompts']['n']} prompts)",
        f"- references: **{report['mode']}** — {report['mode_note']}",
        f"- scorer settings hash: `{bs['settings_hash']}` (layer {bs['settings']['layer']}, "
        f"{'rescaled' if bs['settings']['rescale'] else 'raw'} F1)",
        "",
        "## Verdict",
        "",
    ]
    lines += [f"- {r}" for r in report["reasons"]]
    lines += [
        "",
        f"| | mean | {level} | SE |",
        "|---|---|---|---|",
        f"| candidate F1 | {_fmt(cand['mean'])} | [{_fmt(cand['low'])}, {_fmt(cand['high'])}] | {_fmt(cand['se'])} |",
        f"| baseline F1 | {_fmt(base['mean'])} | [{_fmt(base['low'])}, {_fmt(base['high'])}] | {_fmt(base['se'])} |",
        f"| candidate − baseline | {_fmt(diff['mean'])} | [{_fmt(diff['low'])}, {_fmt(diff['high'])}] | "
        f"{_fmt(diff['se'])} |",
        "",
        f"Rule: pass if the lower bound > −{thr['name']} (−{thr['value']:g}); fail if the upper bound < "
        f"−{thr['value']:g}; otherwise inconclusive. Paired bootstrap over prompts, "
        f"{bs['resamples']} resamples, seed {bs['seed']}.",
        "",
        f"Smallest detectable drop on this prompt set: **{_fmt(bs['min_detectable_drop'])}** "
        f"({bs['min_detectable_formula']}).",
        "",
        "## Floor",
        "",
        f"Floor {report['floor']['value']:g}: candidate below on {len(report['floor']['candidate_below'])} prompts, "
        f"baseline on {len(report['floor']['baseline_below'])}; new below-floor samples (candidate only): "
        f"**{report['floor']['new_below_count']}**"
        + (f" (allowed {report['floor']['max_new_below_floor']})" if report['floor']['max_new_below_floor'] is not None
           else " (not a gate criterion; set --max-new-below-floor)") + ".",
        "",
    ]
    if report["floor"]["new_below"]:
        lines.append("New below-floor ids: " + ", ".join(f"`{i}`" for i in report["floor"]["new_below"]))
        lines.append("")
    if report["long_texts"]:
        lines += [f"**Warning**: {len(report['long_texts'])} texts exceed the scorer's {report['long_text_limit']}-token "
                  "window and were scored on their first 510 word pieces only: "
                  + ", ".join(f"`{t['id']}` ({t['which']}, {t['tokens']})" for t in report["long_texts"][:20]), ""]
    lines += ["![per-prompt scores](scores_hist.png)", "", "## Worst 10 (largest drop first)", "",
              "| id | cand F1 | base F1 | Δ | candidate output | baseline output |", "|---|---|---|---|---|---|"]
    for w in report["worst"]:
        lines.append(f"| `{w['id']}` | {_fmt(w['candidate_f1'], 3)} | {_fmt(w['baseline_f1'], 3)} | "
                     f"{_fmt(w['difference'], 3)} | {_cell(w['candidate'])} | {_cell(w['baseline'])} |")
    lm = report["lm_metrics"]
    lines += ["", "## Language-model metrics", ""]
    if "skipped" in lm:
        lines.append(f"Skipped: {lm['skipped']}.")
    else:
        lines += [f"| metric | model | value | {level} | text |", "|---|---|---|---|---|"]
        for name, entry in lm["metrics"].items():
            for who, iv in entry.items():
                if who == "text":
                    continue
                lines.append(f"| {name} | {who} | {_fmt(iv['mean'])} | [{_fmt(iv['low'])}, {_fmt(iv['high'])}] | "
                             f"{entry['text']} |")
    t = report["timings"]
    backend = report.get("generation", {}).get("backend", {}).get("backend", "transformers")
    lines += ["", "## Timing (s)", "", f"Generated by: `{backend}`.", "", "| stage | seconds |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in t.items()]
    lines += ["", f"Full data: `report.json`, every sample: `samples.jsonl`. Generation cache: `{report['cache_dir']}`."]
    atomic_write_text(path, "\n".join(lines) + "\n")
