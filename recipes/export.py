"""Export a student as a deployable Hugging Face directory.

    python recipes/export.py source=runs/smollm2-kd output_dir=exports/smollm2-kd
    python recipes/export.py source=runs/smollm2-kd checkpoint=latest output_dir=exports/step dtype=bf16
    python recipes/export.py source=path/to/lora-adapter base=path/to/its-base-model output_dir=exports/merged
    python recipes/export.py source=runs/smollm2-kd output_dir=exports/smollm2-int8 quantize=int8

``source`` is a run directory, a ``checkpoints/step-N`` folder, an HF model directory or a LoRA adapter.
The export is the bare student (projectors and teacher stripped, LoRA merged) as safetensors, with its
tokenizer and chat template, generation config, the hybrid-attention spec in ``config.json`` when the
model has one, and a ``README.md`` model card built from the run's config, metrics and gate report.
It loads with plain ``AutoModelForCausalLM.from_pretrained``. The directory appears whole or not at all,
with an ``export.json`` that says what it was made from; ``overwrite=true`` replaces only a folder holding
one (a model folder this recipe did not write is never deleted). A retrofit run exports like any run
(``source=runs/retrofit``): its ``final/`` is already merged, so it is not a LoRA ``base``.

``quantize=int8`` stores the decoder's linears as torchao int8 weights (weight-only; activations stay
floating point), ``quantize=w8a8`` as int8 weights with dynamic int8 activations per token; embeddings and
head stay in full precision (:mod:`serve.quantize`). Either runs the release gate of the quantized model
against the unquantized one and writes the verdict and the sizes into the model card
(``quantization_gate.json`` beside it, the full report in ``quantization_gate/``): by default against the outputs of the teacher the source run was
distilled from (the quality drop, ``quant_max_drop``), else — no run, or ``quant_gate_teacher=none`` —
how far the quantized outputs moved from the unquantized ones (drift, ``quant_max_drift``). The gate
generates every side's outputs through the serving engine (``quant_gate_backend=engine``, as the export
is served; transformers runs torchao's int8 linears far slower on CPU). Its generations are cached beside the
output (``.NAME.quant-gate-cache``) until the export is complete, so a rerun after a killed or failed export
generates only what the cache lacks; a killed export's temp folders (``.NAME.partial-*``, ``.NAME.unquantized-*``)
are removed when the next export to the same output starts.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Python puts a script's folder first on sys.path, and this folder holds distill.py, which would shadow
# the `distill` package: keep the folder off sys.path so imports come from the installed packages.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch

from core.config import ConfigError, check_fields, check_output_dir, field, parse_config, run_cli
from core.environment import environment
from core.rundir import check_replaceable
from eval.generation import (
    Generator,
    TransformersGenerator,
    check_model_dir,
    load_tokenizer,
    max_positions,
    prompts_fit,
)
from eval.prompt_set import GateInputError, default_prompts_path, load_prompts
from serve import export as ex
from serve import quantize as qz
from serve.offline import EngineGenerator

MARKER = "export.json"  # what an export was made from; its presence is what lets overwrite=true replace it


@dataclass
class ExportConfig:
    source: str = field(help="run dir, checkpoints/step-N dir, HF model dir, or LoRA adapter dir to export")
    output_dir: str = field(help="where the exported HF directory is written (must not exist unless overwrite)")
    dtype: str = field("fp32", help="weights dtype: fp32 | bf16 | fp16 | auto (keep the source's)")
    checkpoint: str = field("auto", help="within a run dir: auto (final/ if present, else latest) | final | "
                                         "latest | a step number")
    base: str | None = field(None, help="base model dir for a LoRA adapter (default: the adapter's "
                                        "base_model_name_or_path); may be a run or checkpoint dir")
    max_shard_size: str = field("5GB", help="split safetensors above this size (e.g. 500MB, 2GB)")
    overwrite: bool = field(False, help="replace an existing output_dir")
    threads: int = field(0, ge=0, help="torch CPU threads (0: leave torch's default)")
    # -- quantized export (serve.quantize) --
    quantize: str = field("none", help="none | int8 | w8a8: torchao int8 decoder linears; int8 = int8 weights only "
                                       "(activations stay floating point: closest to fp32, fastest decode in the "
                                       "engine), w8a8 = int8 weights and dynamic int8 activations per token. "
                                       "Embeddings and head stay full precision; needs pip install "
                                       "'hybrid-distill[quant]'")
    quant_gate: bool = field(True, help="with quantize: run the release gate of the quantized model against the "
                                        "unquantized one and put the verdict in the model card")
    quant_gate_teacher: str = field("auto", help="with quant_gate: whose generations are the references: auto (the "
                                    "teacher named in the source run's config; none if it names none), a model dir "
                                    "or name, or none. With a teacher the gate bounds the quality drop "
                                    "F1(unquantized) - F1(quantized) by quant_max_drop; with none, how far the "
                                    "quantized outputs moved from the unquantized ones (1 - F1) by quant_max_drift")
    quant_max_drop: float = field(0.02, gt=0, lt=1, help="with a gate teacher: largest acceptable BERTScore F1 drop")
    quant_max_drift: float = field(0.10, gt=0, lt=1, help="without a gate teacher: largest acceptable mean 1 - F1 of "
                                   "the quantized outputs to the unquantized ones (eval.gate's drift default)")
    quant_gate_prompts: str | None = field(None, help="with quant_gate: prompt JSONL (default: the bundled 100)")
    quant_gate_max_new_tokens: int = field(64, ge=1, help="with quant_gate: tokens generated per prompt")
    quant_gate_backend: str = field("engine", choices=("engine", "transformers"),
                                    help="with quant_gate: who generates both models' outputs: engine (the serving "
                                         "engine, as the export is served; fast int8 on CPU) or transformers "
                                         "(model.generate; torchao's int8 CPU linears are far slower)")

    def __post_init__(self) -> None:
        check_fields(self)  # every field's range/choices, declared above (core.config.field)
        if not str(self.source).strip():
            raise ConfigError("source is empty; pass source=RUN_DIR (or a checkpoint, model or adapter dir)")
        if not str(self.output_dir).strip():
            raise ConfigError("output_dir is empty; pass output_dir=DIR")
        check_output_dir(self.output_dir, "output_dir")  # under a file, or unwritable: now, not after the load
        self.dtype = str(self.dtype).lower()
        if self.dtype not in (*ex.DTYPES, "auto"):
            raise ConfigError(f"dtype={self.dtype} is not supported; use fp32, bf16, fp16 or auto")
        self.checkpoint = str(self.checkpoint).lower()
        if self.checkpoint not in ("auto", "final", "latest") and not self.checkpoint.isdigit():
            raise ConfigError(f"checkpoint={self.checkpoint} is not understood; use auto, final, latest or a step")
        ex.parse_size(self.max_shard_size)
        self.quantize = str(self.quantize).lower()
        if self.quantize != "none":
            qz.check_scheme(self.quantize)  # before the (slow) load
        # A quantization setting nothing reads (no quantize=, or no gate) must not pass as applied; one that asks
        # for nothing (quant_gate_teacher=none: no teacher) agrees with no gate.
        unread = [f.name for f in dataclasses.fields(self) if f.name.startswith("quant_") and f.name != "quant_gate"
                  and getattr(self, f.name) != f.default and str(getattr(self, f.name)).lower() != "none"
                  ] if self.quantize == "none" or not self.quant_gate else []
        if unread:
            raise ConfigError(f"{', '.join(unread)} only appl{'ies' if len(unread) == 1 else 'y'} to a quantized export's "
                              f"gate, which {'quantize=none' if self.quantize == 'none' else 'quant_gate=false'} does "
                              f"not run; drop {'it' if len(unread) == 1 else 'them'} or pass "
                              f"{'quantize=int8 (or w8a8)' if self.quantize == 'none' else 'quant_gate=true'}")
        if self.quantize != "none" and self.quant_gate:
            # A broken prompt file or teacher must fail now, not after the quantization and the baseline's outputs.
            self.quant_gate_teacher = str(self.quant_gate_teacher or "none").strip()
            for key, check in (("quant_gate_prompts", load_prompts), ("quant_gate_teacher", check_model_dir)):
                value = getattr(self, key)
                try:
                    if value and value.lower() not in ("auto", "none"):
                        check(value)
                except GateInputError as err:
                    raise ConfigError(f"{key}: {err}") from None


@dataclass
class ExportResult:
    output_dir: Path
    size_bytes: int
    dtype: torch.dtype
    params: int
    hybrid: dict[str, Any] | None
    shards: int
    source: ex.Source

    def summary(self) -> str:
        attn = "dense attention"
        if self.hybrid:
            h = self.hybrid
            policy = h.get("window_policy")  # it picks the window at every length: spec.window is not served then
            window = ", ".join(f"{w} up to {b}" if b is not None else f"{w} beyond" for b, w in policy) if policy \
                else h.get("window")
            attn = f"hybrid attention (sinks {h.get('sink_tokens')}, window {window}, global every {h.get('global_every')})"
        return "\n".join([
            f"exported {self.source.describe()}",
            f"  -> {self.output_dir}",
            f"  {ex.human_bytes(self.size_bytes)} in {self.shards} safetensors file(s), "
            f"{ex.DTYPE_NAMES.get(self.dtype, self.dtype)}, {ex.human_count(self.params)} parameters, {attn}",
        ])


def _gate_generator(cfg: ExportConfig) -> Generator:
    """Who generates for the quantized export's gate: the serving engine unless asked otherwise."""
    return EngineGenerator() if cfg.quant_gate_backend == "engine" else TransformersGenerator()


def gate_teacher(cfg: ExportConfig, records: ex.RunRecords) -> str | None:
    """The quantized export's gate references: ``quant_gate_teacher``, or with ``auto`` the teacher the
    source run was distilled from (its resolved ``config.yaml``); None = drift mode. A recorded teacher
    that cannot be found is an error naming the two ways out, raised before anything is written."""
    choice = cfg.quant_gate_teacher
    if choice.lower() == "none":
        return None
    if choice.lower() != "auto":
        return choice
    recorded = (records.config or {}).get("teacher")
    if not recorded:
        return None
    try:
        check_model_dir(str(recorded))
    except GateInputError as err:
        raise ConfigError(f"quant_gate_teacher=auto: the source run's teacher {recorded!r} cannot be used ({err}); "
                          "pass quant_gate_teacher=DIR, or quant_gate_teacher=none to gate on drift") from None
    return str(recorded)


def export(cfg: ExportConfig) -> ExportResult:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.output_dir).expanduser().absolute()
    with ex.export_lock(out):  # a second export to out would take this one's temp folders for leftovers
        return _export(cfg, out)


def _export(cfg: ExportConfig, out: Path) -> ExportResult:
    # A killed export left its temp folders (full model copies) beside out: only those named after out go,
    # and an export it was replacing is put back (serve.export.clean_leftovers).
    ex.clean_leftovers(out)
    if cfg.overwrite and out.exists():  # overwrite replaces only an export this recipe wrote (core/rundir.py)
        check_replaceable(out, (out / MARKER).is_file(), f"an export written by recipes/export.py (no {MARKER})")

    # 1. What are we exporting? Refuse a bad target (or gate teacher) before the (slow) load.
    src = ex.resolve_source(cfg.source, cfg.checkpoint)
    if cfg.base and src.kind != "lora":  # else the base would be ignored: the export is the source's own weights
        raise ConfigError(f"base= only applies when source is a LoRA adapter (adapter_config.json), not a "
                          f"{src.describe()}; drop base=")
    # The base an adapter records is usually a local model dir too: overwrite must not delete it.
    base = ex.lora_base(src, cfg.base)
    local_base = base if base and Path(base).expanduser().is_dir() else None
    ex.check_target(out, cfg.overwrite, src.path, cfg.base, local_base)
    records = ex.read_run_records(src)
    teacher = gate_teacher(cfg, records) if cfg.quantize != "none" and cfg.quant_gate else None
    if teacher is not None:  # read by the gate: it must not be the folder the export replaces
        ex.check_target(out, True, teacher)
    print(f"loading {src.describe()}", flush=True)

    # 2. The bare student: projectors and teacher stripped, LoRA merged, in the chosen dtype.
    dtype = None if cfg.dtype == "auto" else ex.DTYPES[cfg.dtype]
    student = ex.load_student(src, dtype=dtype, base=cfg.base)
    dtype = student.model.dtype
    if cfg.quantize != "none":  # refuse before anything is written
        qz.check_quantizable(student.model, cfg.quantize)
    if cfg.quantize != "none" and cfg.quant_gate:  # the gate's prompts as it renders them (chat form), for each model
        try:                                       # that generates: not after the quantization and the generations
            prompts = load_prompts(cfg.quant_gate_prompts or default_prompts_path())
            prompts_fit(student.tokenizer, getattr(student.model.config, "max_position_embeddings", None), prompts,
                        cfg.quant_gate_max_new_tokens, True, "model")
            if teacher is not None:
                path = check_model_dir(teacher)
                prompts_fit(load_tokenizer(path), max_positions(path), prompts, cfg.quant_gate_max_new_tokens, True,
                            "teacher")
        except GateInputError as err:
            raise ConfigError(f"the quantization gate cannot run: {err}; or pass quant_gate=false") from None
    if not getattr(student.tokenizer, "chat_template", None):
        print("warning: the tokenizer has no chat template; chat clients will need one", flush=True)

    # 3. Write everything into a temp dir beside the target; it is renamed into place only when complete.
    with ex.atomic_output_dir(out, overwrite=cfg.overwrite) as tmp:
        if cfg.quantize == "none":
            ex.save_export(student, tmp, max_shard_size=cfg.max_shard_size)
            card = ex.model_card(out.name, student, records, dtype, size_bytes=ex.dir_size(tmp))
        else:  # serve.quantize: the unquantized export goes to a scratch dir, the quantized one to tmp
            card = qz.export_quantized(student, tmp, cfg, records, out.name, _gate_generator(cfg), teacher)
        ex.write_card(tmp, card, records)
        (tmp / MARKER).write_text(json.dumps({"source": str(src.path), "kind": src.kind, "checkpoint": cfg.checkpoint,
                                               "dtype": str(dtype).removeprefix("torch."), "quantize": cfg.quantize,
                                               "environment": environment()}, indent=1) + "\n")
    if cfg.quantize != "none" and cfg.quant_gate:  # the export is whole: no rerun needs its gate's generations
        shutil.rmtree(qz.gate_cache_dir(out), ignore_errors=True)

    result = ExportResult(out, ex.dir_size(out), dtype, student.params, student.hybrid,
                          len(list(out.glob("*.safetensors"))), src)
    print(result.summary(), flush=True)
    return result


def main(argv: list[str] | None = None) -> ExportResult:
    return export(parse_config(ExportConfig, argv))


def gate_exit_code(result: ExportResult) -> int:
    """1 when the export's quantization gate ran and did not pass (the export is kept), else 0."""
    path = result.output_dir / "quantization_gate.json"
    verdict = json.loads(path.read_text()).get("verdict") if path.is_file() else "pass"
    if verdict == "pass":
        return 0
    print(f"error: the quantization gate says {str(verdict).upper()} (see {result.output_dir / 'quantization_gate'}"
          "/report.md and the model card); the export is kept", file=sys.stderr)
    return 1


if __name__ == "__main__":
    run_cli(lambda: sys.exit(gate_exit_code(main())))
