"""Which KV heads keep full attention: scores on synthetic needle data (training-free, or learned gates).

Wu et al. 2024 ("Retrieval Head Mechanistically Explains Long-Context Factuality"): while a model
copies a needle from far back in its context, a few heads put their strongest attention on exactly
the needle token being copied. Those heads need the whole context; the others stream with sinks and
a recent window (DuoAttention's split). Here, on the frozen dense model:

1. ``needle_samples``: haystacks from the training text (packed token blocks), a random-digit key
   hidden at a random depth outside the streaming window, the question at the end and the key as the
   answer (teacher-forced: one forward pass per sample, no decoding).
2. A probe attention implementation (registered with ``AttentionInterface`` for the duration, dense
   causal SDPA for the output) reads, for the queries that predict the answer tokens, every query
   head's attention row over all keys.
3. Scores per query head, averaged over answer tokens and samples:

   * ``retrieval``: after Wu et al.'s score, 1 when the head's top-1 key is the needle token that the
     answer token being predicted copies (the one aligned with it), else 0. Stricter than Wu et al.'s,
     which also counts another needle token equal to it (a key with repeated digits);
   * ``mass``: the attention probability the head puts on that aligned needle token (a smooth version
     that needs fewer samples).

   A KV head scores the maximum over the query heads of its GQA group (it must stay full if any of
   them retrieves).
4. ``choose_roles``: the top ``share`` of (layer, KV head) pairs by score keep full attention; the
   spec stores them (``full_heads``) with the scores (``head_scores``). ``plot_head_scores`` draws
   the layer × head map.

The third method, ``gates``, learns DuoAttention's gates on the frozen model (``attention.gates``;
``learn_gates`` builds its single- and multi-key samples here): it measures each head's effect on the
model's output rather than where its attention lands. ``find_head_roles`` runs any of the three.
On the demo model the top-1 score misses heads in layers 5–9 that the pass key needs (a needle at
depth 0.1 of 2K tokens is found only when those layers' streaming heads are made full); the gates
keep them. Measured in the README (``bench/head_roles.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from attention.errors import HybridAttentionError
from attention.integration import attention_swapped
from attention.spec import HybridAttentionConfig

METHODS = ("retrieval", "mass", "gates")
PROBE_IMPLEMENTATION = "hybrid_heads_probe"
NEEDLE = " Note: the secret number is {key}. Keep it in mind."
QUESTION = " Question: what is the secret number? Answer: the secret number is"
# Multi-key samples: several named needles, the question asks for one of them.
NAMED_NEEDLE = " Note: the secret number of {name} is {key}. Keep it in mind."
NAMED_QUESTION = " Question: what is the secret number of {name}? Answer: the secret number of {name} is"
NAMES = ("Anna", "Boris", "Chen", "Dara", "Emil", "Farah", "Gus", "Hana")


@dataclasses.dataclass
class NeedleSample:
    ids: list[int]  # haystack with the needle, question, answer
    answer_start: int  # index of the first answer token in ids
    key_positions: list[int]  # where the key's tokens sit inside the needle (same order as the answer)
    question_start: int = -1  # index of the question's first token (-1: not recorded)


def needle_samples(tokenizer, haystack: torch.Tensor, *, count: int, length: int, min_distance: int,
                   min_start: int = 0, seed: int = 0, keys: int = 1) -> list[NeedleSample]:
    """``count`` samples of ``length`` tokens from ``haystack`` ``[blocks, block_len]`` token ids.

    The key (5 random digits) sits at least ``min_distance`` tokens before the answer and at least
    ``min_start`` tokens into the text, so a head that only sees the sinks and a recent window
    cannot reach it. ``keys > 1``: that many named needles (different keys, all that far back), the
    question asks for one of them (multi-key retrieval: the head must find the right one).
    """
    if keys > 1:
        return _multikey_samples(tokenizer, haystack, count=count, length=length, min_distance=min_distance,
                                 min_start=min_start, seed=seed, keys=keys)
    return _single_key_samples(tokenizer, haystack, count=count, length=length, seed=seed,
                               bounds=lambda n: (min_start, min_distance))


def spec_samples(tokenizer, spec: HybridAttentionConfig, haystack: torch.Tensor, *, count: int, length: int,
                 seed: int = 0, keys: int = 1) -> list[NeedleSample]:
    """:func:`needle_samples` with the needles beyond ``spec``'s sinks and largest window (``needle_bounds``)."""
    if keys > 1:
        min_start, min_distance = needle_bounds(spec, length)
        return _multikey_samples(tokenizer, haystack, count=count, length=length, min_distance=min_distance,
                                 min_start=min_start, seed=seed, keys=keys)
    return _single_key_samples(tokenizer, haystack, count=count, length=length, seed=seed,
                               bounds=functools.partial(needle_bounds, spec))


def needle_bounds(spec: HybridAttentionConfig, length: int) -> tuple[int, int]:
    """``(min_start, min_distance)``: outside the sinks and the largest window the spec can use, when the
    sample is long enough."""
    window = max(spec.windows)
    return min(spec.sink_tokens, length // 4), min(window + 16, length // 2)


def _fits(length: int, overhead: int, bounds: Callable[[int], tuple[int, int]]) -> bool:
    """Whether ``length`` tokens hold ``overhead`` tokens of needle, question and answer plus the filler that
    ``bounds(length)`` (``(min_start, min_distance)``) asks for, at least one token."""
    return length - overhead >= max(1, sum(bounds(length)))


def shortest_length(overhead: int, bounds: Callable[[int], tuple[int, int]]) -> int:
    """The shortest sample length from which on every length passes :func:`_fits`.

    ``bounds`` grows with the length up to a cap (``needle_bounds``: the sinks and the window), so every
    length past ``overhead`` plus the capped filler fits; below that, count down while lengths still fit
    (the rule is not monotone: ``length // 4 + length // 2`` can grow by 2 in one step).
    """
    n = overhead + max(1, sum(bounds(1 << 62)))
    while n > 1 and _fits(n - 1, overhead, bounds):
        n -= 1
    return n


def _single_key_samples(tokenizer, haystack: torch.Tensor, *, count: int, length: int, seed: int,
                        bounds: Callable[[int], tuple[int, int]]) -> list[NeedleSample]:
    """:func:`needle_samples` with one key; ``bounds(length)`` gives ``(min_start, min_distance)``."""
    rng = random.Random(seed)
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    q_ids = enc(QUESTION)
    # The keys are drawn before any position: the needles' token counts then do not depend on the length, so
    # the length the error below names is one that a rerun with it really fits.
    keys = ["".join(rng.choice("0123456789") for _ in range(5)) for _ in range(count)]
    parts = []
    for key in keys:
        needle = enc(NEEDLE.format(key=key))
        # The answer's tokens inside the needle (tokenizers may merge the leading space differently).
        a_ids, start = _answer_in(enc, needle, key)
        parts.append((needle, a_ids, start))
    overhead = max((len(needle) + len(q_ids) + len(a_ids) for needle, a_ids, _ in parts), default=0)
    min_start, min_distance = bounds(length)
    if parts and not _fits(length, overhead, bounds):
        raise HybridAttentionError(f"head scoring samples of {length} tokens need at least "
                                   f"{max(1, min_start + min_distance)} filler tokens beside the {overhead} of "
                                   f"needle, question and answer; pick a length of at least "
                                   f"{shortest_length(overhead, bounds)}")
    samples = []
    for i, (needle, a_ids, start) in enumerate(parts):
        fill = length - len(needle) - len(q_ids) - len(a_ids)
        text = _filler(haystack, i, fill)
        at = rng.randint(min_start, fill - min_distance)
        ids = text[:at] + needle + text[at:] + q_ids + a_ids
        samples.append(NeedleSample(ids, len(ids) - len(a_ids), [at + start + j for j in range(len(a_ids))],
                                    len(ids) - len(a_ids) - len(q_ids)))
    return samples


def _answer_in(enc, needle: list[int], key: str) -> tuple[list[int], int]:
    """``(answer ids, where they start in the needle)``: " key" if it tokenizes the same in context, else "key"."""
    for a_ids in (enc(" " + key), enc(key)):
        start = _find(needle, a_ids)
        if start >= 0:
            return a_ids, start
    raise HybridAttentionError("the tokenizer splits the needle's key differently in context; "
                               "head scoring needs a tokenizer that keeps digits stable")


def _multikey_samples(tokenizer, haystack: torch.Tensor, *, count: int, length: int, min_distance: int,
                      min_start: int, seed: int, keys: int) -> list[NeedleSample]:
    """``needle_samples`` with ``keys`` named needles per sample, one of them asked for."""
    if keys > len(NAMES):
        raise HybridAttentionError(f"at most {len(NAMES)} keys per sample, got {keys}")
    rng = random.Random(seed)
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    samples = []
    for i in range(count):
        names = rng.sample(NAMES, keys)
        values = ["".join(rng.choice("0123456789") for _ in range(5)) for _ in names]
        asked = rng.randrange(keys)
        needles = [enc(NAMED_NEEDLE.format(name=n, key=k)) for n, k in zip(names, values)]
        q_ids = enc(NAMED_QUESTION.format(name=names[asked]))
        a_ids, start = _answer_in(enc, needles[asked], values[asked])
        fill = length - sum(map(len, needles)) - len(q_ids) - len(a_ids)
        if fill < max(1, min_distance + min_start):
            raise HybridAttentionError(f"head scoring samples of {length} tokens with {keys} keys need "
                                       f"at least {min_distance + min_start} filler tokens; pick a longer "
                                       "length or fewer keys")
        text = _filler(haystack, i, fill)
        # Every needle ends at least min_distance before the question: cut points in the filler, sorted.
        cuts = sorted(rng.randint(min_start, fill - min_distance) for _ in names)
        ids, key_positions, prev = [], [], 0
        for j, cut in enumerate(cuts):
            ids += text[prev:cut]
            if j == asked:
                key_positions = [len(ids) + start + t for t in range(len(a_ids))]
            ids += needles[j]
            prev = cut
        ids += text[prev:] + q_ids + a_ids
        samples.append(NeedleSample(ids, len(ids) - len(a_ids), key_positions, len(ids) - len(a_ids) - len(q_ids)))
    return samples


def _filler(haystack, i: int, fill: int) -> list[int]:
    """``fill`` tokens of text for sample ``i``: block ``i`` (mod blocks) from its start, running on into
    the next blocks (packed blocks are consecutive text) when one is shorter than ``fill``."""
    blocks, block_len = haystack.shape
    need = -(-fill // block_len)
    if need > blocks:
        raise HybridAttentionError(f"head scoring samples need {fill} filler tokens; the training text has "
                                   f"{blocks * block_len}: use shorter samples or more text")
    rows = [haystack[(i + r) % blocks] for r in range(need)]
    return torch.cat([torch.as_tensor(r) for r in rows])[:fill].tolist()


def _find(seq: list[int], sub: list[int]) -> int:
    for i in range(len(seq) - len(sub) + 1):
        if seq[i:i + len(sub)] == sub:
            return i
    return -1


class _Probe:
    """Collects per-layer attention rows of the last ``rows`` queries during one forward pass."""

    def __init__(self) -> None:
        self.rows = 0
        self.attn: dict[int, torch.Tensor] = {}  # layer -> [heads, rows, k_len] probabilities

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        """``AttentionInterface`` entry (batch 1, no padding): dense causal output, rows recorded."""
        group = query.shape[1] // key.shape[1]
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                             enable_gqa=group > 1)
        q = query[0, :, -self.rows:]  # [heads, rows, d]
        k = key[0].repeat_interleave(group, 0)  # [heads, k_len, d]
        s = (q @ k.transpose(-1, -2)).float() * (scaling if scaling is not None else q.shape[-1] ** -0.5)
        n = key.shape[2]
        pos = torch.arange(n, device=s.device)  # on the model's device (a CPU mask fails on CUDA scores)
        causal = pos <= pos[n - self.rows:].unsqueeze(1)
        self.attn[module.layer_idx] = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)
        return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _probing(model) -> Iterator[_Probe]:
    probe = _Probe()
    with attention_swapped(model, PROBE_IMPLEMENTATION, probe):
        yield probe


@torch.inference_mode()
def head_scores(model, samples: list[NeedleSample], *, progress: bool = True) -> dict[str, torch.Tensor]:
    """``{"retrieval": [layers, kv_heads], "mass": [layers, kv_heads]}`` scores on the dense model."""
    from tqdm.auto import tqdm

    cfg = model.config
    layers, heads = cfg.num_hidden_layers, cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    hit = torch.zeros(layers, heads)
    mass = torch.zeros(layers, heads)
    total = 0
    with _probing(model) as probe:
        for s in tqdm(samples, desc="head scores", disable=not progress, dynamic_ncols=True):
            n_ans = len(s.ids) - s.answer_start
            probe.rows = n_ans
            ids = torch.tensor([s.ids[:-1]], device=model.device)  # the last answer token is only predicted
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
            key_pos = torch.tensor(s.key_positions)
            for li in range(layers):
                a = probe.attn[li].cpu()  # [heads, rows, k_len]; row r predicts answer token r (counts on CPU)
                top = a.argmax(-1)  # [heads, rows]
                hit[li] += (top == key_pos.unsqueeze(0)).float().sum(-1)
                mass[li] += a.gather(-1, key_pos.view(1, -1, 1).expand(heads, -1, 1)).squeeze(-1).sum(-1)
            total += n_ans
            probe.attn.clear()
    group = heads // kv_heads
    return {name: (t / total).view(layers, kv_heads, group).amax(-1) for name, t in
            (("retrieval", hit), ("mass", mass))}


def choose_roles(spec: HybridAttentionConfig, scores: torch.Tensor, share: float, *, method: str,
                 tiebreak: torch.Tensor | None = None, extra: dict[str, Any] | None = None) -> HybridAttentionConfig:
    """``spec`` with the top ``share`` of (layer, KV head) pairs by ``scores`` ``[layers, kv_heads]`` full.

    Ties (many heads never retrieve: top-1 scores are mostly 0) are broken by ``tiebreak`` (same
    shape, e.g. the attention mass), then by the earlier pair.
    """
    if not 0.0 <= share <= 1.0:
        raise HybridAttentionError(f"full_head_share must be in [0, 1], got {share}")
    layers, kv_heads = scores.shape
    count = round(share * layers * kv_heads)
    order = torch.arange(layers * kv_heads)
    if tiebreak is not None:
        order = order[torch.argsort(tiebreak.flatten()[order], descending=True, stable=True)]
    order = order[torch.argsort(scores.flatten()[order], descending=True, stable=True)][:count].tolist()
    full: dict[int, list[int]] = {}
    for flat in sorted(order):
        full.setdefault(flat // kv_heads, []).append(flat % kv_heads)
    rounded = lambda m: [[round(float(x), 5) for x in row] for row in m]  # noqa: E731
    record = {**(extra or {}), "method": method, "full_head_share": share, "full_heads": count,
              "scores": rounded(scores)}
    if tiebreak is not None:  # kept so that the whole ranking, not just the chosen top, is saved
        record["tiebreak"] = rounded(tiebreak)
    return dataclasses.replace(spec, full_heads=full or None, full_layers=None, head_scores=record)


def reshare(spec: HybridAttentionConfig, share: float) -> HybridAttentionConfig:
    """``spec`` with the top ``share`` of heads full by the ranking saved in its ``head_scores``.

    A retrofit saves its scores (and tiebreak) with the roles, so another share of the same ranking
    needs no new scoring or gate training, e.g. to trade retrieval at long lengths against KV bytes.
    """
    record = spec.head_scores or {}
    if "scores" not in record:
        raise HybridAttentionError("this spec has no saved head scores to re-rank; run the retrofit's head "
                                   "scoring (full_head_share > 0) first")
    tiebreak = torch.tensor(record["tiebreak"]) if "tiebreak" in record else None
    # choose_roles writes method, share, count, scores and tiebreak over the old record's; the rest carries over
    return choose_roles(spec, torch.tensor(record["scores"]), share, method=record["method"], tiebreak=tiebreak,
                        extra=record)


def spread_roles(spec: HybridAttentionConfig, layers: int, kv_heads: int, share: float) -> HybridAttentionConfig:
    """``spec`` with ``round(share * pairs)`` evenly spaced (layer, KV head) pairs full (benchmarks: the
    cost depends on how many heads are full, not which)."""
    if not 0.0 <= share <= 1.0:  # past 1 the spacing repeats pairs: silently every head full
        raise HybridAttentionError(f"full head share must be in [0, 1] (0: every head streams), got {share}")
    pairs = layers * kv_heads
    count = round(share * pairs)
    full: dict[int, list[int]] = {}
    for i in range(count):
        flat = (i * pairs) // count
        full.setdefault(flat // kv_heads, []).append(flat % kv_heads)
    return dataclasses.replace(spec, full_heads=full or None, full_layers=None, head_scores=None)


def find_head_roles(model, tokenizer, spec: HybridAttentionConfig, haystack: torch.Tensor, *, share: float,
                    method: str = "retrieval", samples: int = 12, length: int = 1536, seed: int = 0,
                    progress: bool = True, gate_steps: int = 120, gate_lr: float = 0.05, gate_l1: float = 0.05,
                    gate_window: int | None = None, gate_context: str = "gated") -> HybridAttentionConfig:
    """Score the heads of the dense ``model`` on needle samples and return ``spec`` with roles.

    Args:
        model: the dense (frozen) causal LM; its attention implementation is restored afterwards.
        haystack: ``[blocks, block_len]`` token ids of training text.
        share: fraction of (layer, KV head) pairs that keep full attention.
        method: ``"retrieval"`` (top-1 copy hits), ``"mass"`` (attention mass on the needle) or
            ``"gates"`` (DuoAttention-style gates learned on the frozen model, ``attention.gates``;
            half the samples single-key, half with 3 named keys).
        samples, length: how many samples of how many tokens.
        gate_steps, gate_lr, gate_l1: the gate training (``method="gates"`` only).
        gate_window: the streaming window while the gates train (None: ``spec``'s window for ``length``,
            its ``window_policy``'s when it has one; given, it replaces the policy while the gates train). A
            smaller one puts more of each sample beyond the window at the same cost, so the gates also
            learn which heads need the tokens between it and the serving window; the roles apply to
            ``spec`` as given.
        gate_context: ``attention.gates.train_gates``' ``context`` (``"dense"``: only the question and answer
            run gated, so long samples cost little).
    """
    if method not in METHODS:
        raise HybridAttentionError(f"unknown head score {method!r}; use one of {', '.join(METHODS)}")
    if not 0.0 <= share <= 1.0:
        raise HybridAttentionError(f"full_head_share must be in [0, 1] (0: every head streams), got {share}")
    if share == 0.0:
        return spec.streaming()
    extra: dict[str, Any] = {"samples": samples, "sample_len": length}
    if method == "gates":
        # gate_window replaces the policy too (else the policy's window would silently win); the record
        # names the window the gates really trained under (a policy's for the sample length).
        trained = spec if gate_window is None else spec.with_window(gate_window)
        result = learn_gates(model, tokenizer, trained, haystack, samples=samples, length=length, seed=seed,
                             steps=gate_steps, lr=gate_lr, l1=gate_l1, progress=progress, context=gate_context)
        extra.update(steps=gate_steps, lr=gate_lr, l1=gate_l1, multikey=result.multikey, context=gate_context,
                     final_mse=round(result.history[-1]["mse"], 6), window=trained.window_for(length))
        return choose_roles(spec, result.gates, share, method=method, tiebreak=result.pressure, extra=extra)
    data = spec_samples(tokenizer, spec, haystack, count=samples, length=length, seed=seed)
    scores = head_scores(model, data, progress=progress)
    other = scores["mass" if method == "retrieval" else "retrieval"]
    return choose_roles(spec, scores[method], share, method=method, tiebreak=other, extra=extra)


def learn_gates(model, tokenizer, spec: HybridAttentionConfig, haystack: torch.Tensor, *, samples: int = 12,
                length: int = 1024, seed: int = 0, steps: int = 120, lr: float = 0.05, l1: float = 0.05,
                progress: bool = True, context: str = "gated"):
    """``attention.gates.train_gates`` on needle samples from ``haystack``: half single-key, half with 3
    named keys (the question asks for one; 2, or none, when ``length`` cannot hold 3), all beyond the
    streaming horizon. Returns its ``GateResult`` (``multikey``: the named keys used)."""
    from attention.gates import train_gates

    single = samples - samples // 2
    data = spec_samples(tokenizer, spec, haystack, count=single, length=length, seed=seed)
    multikey = 0
    rest = haystack[single:] if haystack.shape[0] > single else haystack  # other blocks where there are enough
    for keys in (3, 2) if samples // 2 else ():  # as many named keys as the length holds (short test models)
        try:
            data += spec_samples(tokenizer, spec, rest, count=samples // 2, length=length, seed=seed + 1, keys=keys)
        except HybridAttentionError:
            continue
        multikey = keys
        break
    if samples // 2 and not multikey:  # too short for several needles: single-key samples only
        data += spec_samples(tokenizer, spec, rest, count=samples // 2, length=length, seed=seed + 1)
    result = train_gates(model, data, spec, steps=steps, lr=lr, l1=l1, seed=seed, progress=progress,
                         context=context)
    return dataclasses.replace(result, multikey=multikey)


def plot_head_scores(spec: HybridAttentionConfig, path: str | Path, title: str = "") -> None:
    """Layer × KV head map of ``spec.head_scores`` with the full heads outlined, as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rec = spec.head_scores or {}
    scores = torch.tensor(rec.get("scores", []), dtype=torch.float32)
    if scores.ndim != 2:
        raise HybridAttentionError("the spec has no head scores to plot; run find_head_roles first")
    layers, kv_heads = scores.shape
    fig, ax = plt.subplots(figsize=(1.6 + 0.5 * kv_heads, 1.0 + 0.22 * layers))
    im = ax.imshow(scores.numpy(), cmap="viridis", aspect="auto")
    for layer in range(layers):
        for h in spec.full_kv_heads(layer, kv_heads):
            ax.add_patch(plt.Rectangle((h - 0.5, layer - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.5))
    ax.set_xlabel("KV head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(kv_heads))
    fig.colorbar(im, ax=ax, label=f"{rec.get('method', 'score')} score")
    ax.set_title(title or f"full heads (red): {rec.get('full_heads', '?')} of {layers * kv_heads}", fontsize=9)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
