"""What several test modules share that is not library code."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a subprocess that imports the checkout: ``ROOT`` first on ``PYTHONPATH``, whatever
    the caller's own ``PYTHONPATH`` holds kept after it (replacing it would hide packages installed there)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def write_text_corpus(path, lines: int = 300, words: int = 40) -> str:
    """A .txt corpus of ``lines`` distinct documents (one per line) of ``words`` common words: distinct, so the
    content-hash held-out split puts some on each side."""
    import random

    vocab = "the quick brown fox jumps over the lazy dog and distills a teacher into a student".split()
    path.write_text("\n".join(" ".join(random.Random(i).choices(vocab, k=words)) for i in range(lines)) + "\n")
    return str(path)


def forbid(monkeypatch, message: str, *targets: tuple[object, str]) -> None:
    """Make each ``(module, name)`` callable fail the test when called: bad input must be refused before it."""
    def called(*args, **kwargs):
        raise AssertionError(message)
    for module, name in targets:
        monkeypatch.setattr(module, name, called)


def naive_divergence(s, t, kind: str, beta: float):
    """One token's divergence, of any KD kind, from ``[vocab]`` student and teacher logits (float64 expected):
    textbook formulas on probabilities."""
    import torch

    ps, pt = torch.softmax(s, -1), torch.softmax(t, -1)

    def kl(p, q):
        return (p * (p.log() - q.log())).sum()

    if kind == "forward_kl" or (kind == "jsd" and beta == 0):
        return kl(pt, ps)
    if kind == "reverse_kl" or (kind == "jsd" and beta == 1):
        return kl(ps, pt)
    if kind == "jsd":
        m = beta * pt + (1 - beta) * ps
        return beta * kl(pt, m) + (1 - beta) * kl(ps, m)
    if kind == "skew_kl":  # DistiLLM: KL(p || beta p + (1 - beta) q), textbook form on probabilities
        return kl(pt, beta * pt + (1 - beta) * ps)
    if kind == "skew_reverse_kl":  # DistiLLM: KL(q || beta q + (1 - beta) p)
        return kl(ps, beta * ps + (1 - beta) * pt)
    return 0.5 * (pt - ps).abs().sum()
