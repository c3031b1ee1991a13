"""Quantized exports: int8 decoder linears through torchao, embeddings and head in full precision.

Why torchao: it is PyTorch's own quantization library, installs from PyPI against the torch we use,
runs its int8 layouts on CPU and CUDA, and transformers loads and saves it natively (``TorchAoConfig``;
the tensors are flattened into ordinary safetensors with torchao metadata). So a quantized export loads
with the usual one line (torchao installed: ``pip install 'hybrid-distill[quant]'``)::

    model = AutoModelForCausalLM.from_pretrained("exports/student-int8")

and the serving engine and server take the directory as they take any other (``Engine(dir)``).

What is quantized: every ``nn.Linear`` of the decoder layers (attention and MLP projections). The
input embeddings and the LM head stay in the export's dtype: quantizing them garbles output, and with
tied embeddings the head *is* the embedding matrix. Two schemes:

``int8`` (weight-only, torchao ``Int8WeightOnlyConfig``): int8 weights with one fp32 scale per
output row, activations left in floating point, so the closest to fp32 (demo student, teacher-forced on
the bundled prompts: KL to fp32 0.002 vs 0.026 for W8A8, top-1 agreement 0.95 vs 0.89). transformers
runs it through torchao's linear, which dequantizes at every call; the engine instead runs fused copies
of the int8 weights through ``torch._weight_int8pack_mm`` with the activations rounded to bf16 (its fast
CPU kernel; with fp32 activations it is a slow reference loop): 1.3-1.4x fp32's decode tokens/s on the
demo student (``bench/serve_quant.py``).

``w8a8`` (torchao ``Int8DynamicActivationInt8WeightConfig``): the same int8 weights, and at run time each
token's activations quantized to int8 (symmetric, one scale per token) so the matmul is int8 x int8.
torchao's own CPU linear falls back to a slow integer matmul; the engine runs the same W8A8 math through
oneDNN's int8 GEMM on fused copies of the int8 weights (:mod:`serve.model`): faster prefill than fp32,
about even at decode on the small demo student (the per-token activation quantization is a handful of
small ops per linear). Per-token scales keep every request's numbers independent of what it is batched
with.

int4: torchao's int4 weight-only layout needs its ``mslk`` kernels, which exist for CUDA only (checked
with torchao 0.18 on CPU: ``ImportError: Requires mslk``), so it is refused with a one-line error rather
than exporting a model that cannot run on CPU.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attention.integration import SUPPORTED_MODEL_TYPES as SUPPORTED
from core.config import ConfigError
from serve import export as ex

SCHEMES = ("int8", "w8a8")  # int8 = weight-only; w8a8 = int8 weights and dynamic int8 activations
KEEP_FULL_PRECISION = ("lm_head",)  # embeddings are not linears: torchao leaves them alone by default
_EMBEDDING_KEYS = ("embed_tokens", "lm_head", "wte", "embed_out")
GATE_DIR = "quantization_gate"  # the gate's report files, inside the export


def gate_cache_dir(target: str | Path) -> Path:
    """Where the quantization gate of an export to ``target`` caches its generations: ``.NAME.quant-gate-cache``
    beside it, a fixed path so that a rerun after a killed or failed export generates nothing twice. Entries
    are keyed by each model's content hash (:mod:`eval.fingerprint`), so a changed model never hits a stale
    one. ``recipes/export.py`` removes it once the export is complete."""
    target = Path(target)
    return target.parent / f".{target.name}.quant-gate-cache"


class QuantizeError(ConfigError):
    """A model or scheme that cannot be quantized; the message is one line naming the fix (a recipe's
    command line prints it as one ``error:`` line, like any :class:`core.config.ConfigError`)."""


def _torchao():
    try:
        import torchao.quantization as tq
    except ImportError:
        raise QuantizeError("quantize needs torchao; install it with: pip install 'hybrid-distill[quant]' "
                            "(or pip install torchao)") from None
    return tq


def check_scheme(scheme: str) -> None:
    """Raise :class:`QuantizeError` (one line) unless ``scheme`` is one we export (no model needed)."""
    if scheme == "int4":
        raise QuantizeError("quantize=int4 is not available: torchao's int4 weight-only kernels run on CUDA "
                            "only (they need mslk), and exports must serve on CPU; use quantize=int8")
    if scheme not in SCHEMES:
        raise QuantizeError(f"quantize={scheme} is not supported; use none or {' or '.join(SCHEMES)}")


def check_quantizable(model: nn.Module, scheme: str) -> None:
    """Raise :class:`QuantizeError` (one line) unless ``model`` can be quantized with ``scheme``.

    Called before anything is written, so a refused export leaves nothing behind.
    """
    check_scheme(scheme)
    mt = getattr(model.config, "model_type", None)
    if mt not in SUPPORTED:
        raise QuantizeError(f"quantize={scheme} supports {', '.join(SUPPORTED)} models, not model_type {mt!r}; "
                            "export it unquantized (quantize=none)")
    dtypes = {p.dtype for p in model.parameters()}
    if not dtypes <= {torch.float32, torch.bfloat16}:
        raise QuantizeError(f"quantize={scheme} needs fp32 or bf16 weights, got {sorted(map(str, dtypes))}; "
                            "export with dtype=fp32")
    _torchao()


def torchao_config(scheme: str) -> Any:
    """The transformers ``TorchAoConfig`` for ``scheme`` (decoder linears only)."""
    from transformers import TorchAoConfig

    tq = _torchao()
    quant = {"int8": tq.Int8WeightOnlyConfig, "w8a8": tq.Int8DynamicActivationInt8WeightConfig}[scheme]()
    return TorchAoConfig(quant_type=quant, modules_to_not_convert=list(KEEP_FULL_PRECISION))


def quantize_dir(src: str | Path, out: str | Path, scheme: str, hybrid: dict[str, Any] | None = None,
                 max_shard_size: str = "5GB") -> Any:
    """Load the HF export ``src`` quantized with ``scheme`` and write it to ``out`` (model + tokenizer).

    Returns the quantized model. ``hybrid``: the hybrid-attention spec to restate in ``config.json``;
    ``max_shard_size``: split the safetensors above this size, as an unquantized export does (torchao's
    int8 tensors are flattened per key, so they shard and reload like any other weight).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, out = Path(src), Path(out)
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=torchao_config(scheme))
    model.save_pretrained(out, max_shard_size=max_shard_size)
    for f in out.glob("*.safetensors"):
        sort_safetensors_header(f)
    ex.sanitize_config_json(out / "config.json", hybrid)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return model


def sort_safetensors_header(path: str | Path) -> None:
    """Rewrite the JSON header of the safetensors file ``path`` in place with its keys sorted.

    safetensors writes the header's metadata (where torchao records each quantized tensor's layout) from a
    Rust HashMap, in a new order in every process: two quantized exports of one model would differ in bytes,
    and the quantization gate's content-keyed generation cache (:mod:`eval.fingerprint`) would never hit on
    a rerun. Same JSON, same length (padded with spaces as the format allows), same tensor offsets.
    """
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        text = json.dumps(json.loads(f.read(n)), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) <= n:  # always, for the compact JSON safetensors writes; else leave the file as it is
            f.seek(8)
            f.write(text.ljust(n, b" "))


def is_quantized(model: nn.Module) -> bool:
    """Whether any parameter is a tensor subclass (a torchao quantized weight)."""
    return any(type(p) not in (torch.Tensor, nn.Parameter) for p in model.parameters())


def weight_bytes(model_dir: str | Path) -> dict[str, int]:
    """Bytes of the stored weights: ``{"embeddings": .., "other": .., "total": ..}`` from the safetensors.

    ``embeddings`` counts the input embeddings and the LM head; ``other`` everything else (the
    quantized linears with their scales, norms).
    """
    from safetensors import safe_open

    sizes = {"embeddings": 0, "other": 0}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                t = st.get_slice(key)
                n = 1
                for d in t.get_shape():
                    n *= d
                nbytes = n * torch.empty((), dtype=_DTYPES[t.get_dtype()]).element_size()
                sizes["embeddings" if any(e in key for e in _EMBEDDING_KEYS) else "other"] += nbytes
    sizes["total"] = sizes["embeddings"] + sizes["other"]
    return sizes


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8,
           "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64, "F64": torch.float64, "BOOL": torch.bool,
           "I16": torch.int16}


def _gate_lines(gate: dict, gate_note: str) -> list[str]:
    """The card's gate paragraph: verdict, BERTScore of each side, the drop with its interval, who generated."""
    bs = gate.get("bertscore", {})
    cand, base, diff = bs.get("candidate", {}), bs.get("baseline", {}), bs.get("difference", {})
    conf = f"{100 * float(diff.get('confidence', 0.95)):g} %"
    threshold = gate.get("threshold", {})
    backend = gate.get("generation", {}).get("backend", {}).get("backend", "transformers")
    lines = [f"**Release gate against the unquantized model: {str(gate.get('verdict', '?')).upper()}** "
             f"({gate_note}).", ""]
    if diff:
        lines += ["| BERTScore F1 | mean | " + conf + " interval |", "|---|---|---|",
                  f"| quantized | {cand['mean']:.4f} | [{cand['low']:.4f}, {cand['high']:.4f}] |",
                  f"| unquantized | {base['mean']:.4f} | [{base['low']:.4f}, {base['high']:.4f}] |",
                  f"| drop (unquantized − quantized) | {-diff['mean']:.4f} | [{-diff['high']:.4f}, "
                  f"{-diff['low']:.4f}] |", "",
                  f"Threshold: {threshold.get('name')} {threshold.get('value')}. Outputs generated greedily by `{backend}` "
                  f"({gate.get('generation', {}).get('settings', {}).get('max_new_tokens', '?')} new tokens per "
                  f"prompt); gate wall time {gate.get('timings', {}).get('total', float('nan')):.0f} s.", ""]
    lines += ["```json", json.dumps({k: gate.get(k) for k in ("verdict", "mode", "threshold", "reasons")}, indent=2),
              "```"]
    return lines


def card_section(scheme: str, sizes: dict[str, int], base_sizes: dict[str, int], gate: dict | None,
                 gate_note: str) -> str:
    """The model card's ``## Quantization`` section: scheme, sizes against the unquantized weights, gate."""
    ratio = sizes["other"] / max(1, base_sizes["other"])
    what = {"int8": "int8 weights, activations in floating point (torchao `Int8WeightOnlyConfig`: one scale per "
                    "weight row; the serving engine rounds activations to bf16 for its int8-weight kernel)",
            "w8a8": "int8 weights and dynamic int8 activations (torchao `Int8DynamicActivationInt8WeightConfig`: "
                    "one scale per weight row, one per token)"}
    lines = ["", "## Quantization", "",
             f"{what.get(scheme, scheme)} on every linear of the decoder layers; embeddings and "
             "LM head kept in full precision. "
             "Load it with `AutoModelForCausalLM.from_pretrained(dir)` (needs `pip install torchao`).", "",
             "| weights | unquantized | quantized | ratio |", "|---|---|---|---|"]
    for k in ("other", "embeddings", "total"):
        name = {"other": "decoder layers", "embeddings": "embeddings + head", "total": "total"}[k]
        lines.append(f"| {name} | {base_sizes[k]:,} B | {sizes[k]:,} B | {sizes[k] / max(1, base_sizes[k]):.3f} |")
    lines += ["", f"Decoder-layer weight bytes: {ratio:.3f}x the unquantized ones.", ""]
    if gate is None:
        lines.append(f"Release gate against the unquantized model: not run ({gate_note}).")
    else:
        lines += _gate_lines(gate, gate_note)
        lines += ["", f"Full gate report: `{GATE_DIR}/report.md` (data: `{GATE_DIR}/report.json`, every prompt's "
                  f"outputs and scores: `{GATE_DIR}/samples.jsonl`, score histogram: `{GATE_DIR}/scores_hist.png`)."]
    return "\n".join(lines) + "\n"


def run_quant_gate(candidate: Path, baseline: Path, out: Path, cfg: Any, generator: Any = None,
                   teacher: str | None = None, cache_dir: Path | None = None) -> dict:
    """The release gate (:mod:`eval.gate`) of the quantized export against the unquantized one.

    With a ``teacher`` (by default the run's own, :func:`recipes.export.gate_teacher`) both models'
    outputs are scored (BERTScore F1) against the teacher's outputs on the same prompts and the gate
    bounds the quality drop ``F1(unquantized) - F1(quantized)`` by ``cfg.quant_max_drop`` with 95 %
    confidence (teacher mode: the gate a student is released under). Without one it runs in drift mode:
    the quantized outputs are scored against the unquantized model's own, which scores 1.0, and the gate
    bounds how far they moved, ``1 - F1``, by ``cfg.quant_max_drift`` — a different quantity (an equally
    good model moves too: greedy text forks at the first flipped token), so it has its own threshold, as
    in :mod:`eval.gate`. ``generator`` generates all sides (an :class:`eval.generation.Generator`; default:
    the serving engine, :class:`serve.offline.EngineGenerator`, which runs the int8 linears as served and
    far faster than transformers does on CPU). The report files (``report.json``, ``report.md``,
    ``samples.jsonl``, ``scores_hist.png``) go to ``out``; the generation cache to ``cache_dir`` (default
    ``out/cache``). Returns the gate report (``report.json``).
    """
    from eval.bertscore import ScorerMissingError
    from eval.gate import GateConfig, run_gate
    from serve.offline import EngineGenerator

    gcfg = GateConfig(candidate=str(candidate), baseline=str(baseline), out=str(out), prompts=cfg.quant_gate_prompts,
                      teacher=teacher, max_drop=cfg.quant_max_drop, max_drift=cfg.quant_max_drift,
                      max_new_tokens=cfg.quant_gate_max_new_tokens, skip_lm_metrics=True, chat=True, device="cpu",
                      cache_dir=None if cache_dir is None else str(cache_dir))
    try:
        return run_gate(gcfg, generator=generator or EngineGenerator()).report
    except ScorerMissingError as e:
        raise QuantizeError(f"{e} (or export with quant_gate=false)") from None


def relabel_paths(value: Any, labels: list[tuple[Path, str]]) -> Any:
    """``value`` (a JSON-like report) with every mention of a path in ``labels`` replaced by its label.

    The gate runs on directories that do not outlive the export (the partial export dir before its
    rename, the deleted scratch copy): a report naming them would send its reader nowhere. Put nested
    paths before their parents; each path is matched as given and resolved.
    """
    if isinstance(value, dict):
        return {k: relabel_paths(v, labels) for k, v in value.items()}
    if isinstance(value, list):
        return [relabel_paths(v, labels) for v in value]
    if isinstance(value, str):
        for path, label in labels:
            for form in dict.fromkeys((str(path), str(Path(path).resolve()))):
                value = label if value == form else value.replace(form, label)
        return value
    return value


def gate_note(gate: dict, cfg: Any) -> str:
    """One sentence for the model card: what the gate compared and what passing means."""
    n = gate.get("prompts", {}).get("n", "?")
    if gate.get("mode") == "drift":
        return (f"drift mode, no teacher known: the quantized model's outputs scored by BERTScore F1 against the "
                f"unquantized model's on {n} prompts; pass = mean drift 1 - F1 < {cfg.quant_max_drift} with 95 % "
                "confidence")
    refs = "teacher's outputs" if gate.get("mode") == "teacher" else "given references"
    return (f"{gate.get('mode')} mode: both models' outputs scored by BERTScore F1 against the {refs} on {n} "
            f"prompts; pass = mean drop F1(unquantized) - F1(quantized) < {cfg.quant_max_drop} with 95 % confidence")


def export_quantized(student: Any, out_dir: Path, cfg: Any, records: Any, name: str, generator: Any = None,
                     teacher: str | None = None) -> str:
    """Write the quantized export of ``student`` into ``out_dir``; return its model card.

    The unquantized export is written to a scratch dir beside ``out_dir`` (the gate's baseline and the
    size reference) and deleted afterwards; the gate's generation cache is :func:`gate_cache_dir` of the
    export's target (``out_dir.parent / name``), kept until the export is complete. The gate's verdict goes to
    ``out_dir/quantization_gate.json`` and its report files (``report.md``, ``report.json``,
    ``samples.jsonl``, ``scores_hist.png``) to ``out_dir/quantization_gate/``, so a failing gate can be
    read in the export it judged; they call the two models "this export" and "the unquantized export",
    not the directories the gate ran on. ``generator`` and ``teacher``: see :func:`run_quant_gate`.
    """
    import tempfile

    from eval.report import write_markdown

    out_dir = Path(out_dir)
    gate_dir = out_dir / GATE_DIR
    cache = gate_cache_dir(out_dir.parent / name)
    # Named after the target, so that what a killed export leaves is found (serve.export.clean_leftovers).
    with tempfile.TemporaryDirectory(prefix=ex.temp_prefix(name, "unquantized"), dir=out_dir.parent) as scratch:
        base = Path(scratch) / "model"
        ex.save_export(student, base, max_shard_size=cfg.max_shard_size)
        quantize_dir(base, out_dir, cfg.quantize, student.hybrid, max_shard_size=cfg.max_shard_size)
        sizes, base_sizes = weight_bytes(out_dir), weight_bytes(base)
        size_on_disk = ex.dir_size(out_dir)  # the model's files, before the gate adds its report
        gate, note = None, "quant_gate=false"
        if cfg.quant_gate:
            gate = run_quant_gate(out_dir, base, gate_dir, cfg, generator, teacher, cache_dir=cache)
            gate = relabel_paths(gate, [(gate_dir, f"{GATE_DIR}/ (in this export)"),
                                        (cache, "not kept (deleted once the export was complete)"),
                                        (base, "the unquantized export"), (Path(scratch), "a deleted scratch dir"),
                                        (out_dir, "this export")])
            note = gate_note(gate, cfg)
            text = json.dumps(gate, indent=2, default=str) + "\n"
            (gate_dir / "report.json").write_text(text)
            write_markdown(gate_dir / "report.md", gate)
            (out_dir / "quantization_gate.json").write_text(text)
    card = ex.model_card(name, student, records, student.model.dtype, size_bytes=size_on_disk)
    print(f"quantized {cfg.quantize}: decoder-layer weights {sizes['other']:,} B vs {base_sizes['other']:,} B "
          f"({sizes['other'] / max(1, base_sizes['other']):.3f}x); gate: "
          f"{gate.get('verdict') if gate else 'not run'}" + (f" ({gate.get('mode')} mode)" if gate else ""),
          flush=True)
    return card + card_section(cfg.quantize, sizes, base_sizes, gate, note)
