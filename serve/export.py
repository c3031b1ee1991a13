"""Turn whatever a run left behind into one deployable Hugging Face directory.

A *source* is one of

* a run directory (``RUN/config.yaml`` plus ``RUN/final/`` and/or ``RUN/checkpoints/step-N/``),
* a training checkpoint (``model.safetensors`` of the teacher–student module, keys ``student.*`` and
  ``projectors.*``, with the student's HF config and tokenizer under ``student/``; or a DeepSpeed
  ZeRO folder in place of ``model.safetensors``); a retrofit's holds its LoRA layers in place
  (``base_layer`` / ``lora_A`` / ``lora_B``), folded in with the ``lora_alpha`` of its ``config.yaml``,
* a plain HF model directory (``config.json`` + weights), e.g. ``RUN/final/``,
* a peft LoRA adapter (``adapter_config.json``) whose base is any of the above.

:func:`resolve_source` tells them apart, :func:`load_student` returns the bare student (projectors and
teacher stripped, LoRA merged), :func:`save_export` writes it with its tokenizer, generation config and
hybrid-attention spec, and :func:`atomic_output_dir` makes sure a reader never sees half of it.
:func:`model_card` renders ``README.md`` from the run's config, metrics and release-gate report.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import SafetensorError

from attention.integration import BASE_KEY
from attention.spec import CONFIG_KEY, HybridAttentionConfig
from core.checkpoint import complete_checkpoints
from core.config import ConfigError
from core.fsio import fsync_dir, fsync_tree, share_like_umask
from core.models import DTYPES, load_causal_lm
from eval.fingerprint import DigestMemo, directory_fingerprint

DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

# Attention backends every transformers install knows. Anything else in a config.json (a custom
# kernel registered at training time) would make a plain `from_pretrained` fail in a fresh process.
BUILTIN_ATTENTION = {"eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"}
_ATTN_CONFIG_KEYS = ("attn_implementation", "_attn_implementation", "_attn_implementation_internal")

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
_STEP_DIR = re.compile(r"^step-(\d+)$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)\s*$", re.IGNORECASE)
# Folders an export to ``NAME`` makes beside it while it works, removed when it ends but left by a killed one:
# ``.NAME.partial-XXXXXXXX`` (the export being written; tempfile's 8 random characters), ``.NAME.unquantized-XXXXXXXX``
# (serve.quantize's scratch copy), ``.NAME.old-XXXXXXXX`` (the export being replaced, aside until the swap is done).
TEMP_KINDS = ("partial", "unquantized")
# Prefixes wrappers put in front of parameter names: DDP/DeepSpeed engines and torch.compile.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


class SourceError(ConfigError):
    """The export source (or target) is not usable; the message is one line naming the fix."""


@dataclass
class Source:
    """A resolved export source.

    ``kind`` is ``"hf"`` (model directory), ``"checkpoint"`` (module state dict), ``"deepspeed"`` (ZeRO
    folder) or ``"lora"`` (adapter). ``config_dir`` holds the student's ``config.json``, tokenizer and
    generation config; ``run_dir`` is the run the source belongs to, when there is one.
    """

    kind: str
    path: Path
    config_dir: Path
    run_dir: Path | None = None
    step: int | None = None

    def describe(self) -> str:
        what = {"hf": "model directory", "checkpoint": "training checkpoint",
                "deepspeed": "DeepSpeed ZeRO checkpoint", "lora": "LoRA adapter"}[self.kind]
        step = f" (step {self.step})" if self.step is not None else ""
        return f"{what} {self.path}{step}"


@dataclass
class LoadedStudent:
    """The bare student ready to save: ``model`` is a plain ``*ForCausalLM`` in eval mode."""

    model: Any
    tokenizer: Any
    source: Source
    source_dtype: torch.dtype
    hybrid: dict[str, Any] | None
    lora_merged: bool = False

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


# ----------------------------------------------------------------------------------------------
# Recognising sources
# ----------------------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """``"2GB"`` → bytes (decimal units like transformers; ``GiB`` for binary)."""
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(f"size '{text}' is not understood; write it like 500MB, 2GB or 1.5GiB")
    value, unit = float(m.group(1)), m.group(2).upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(value * scale)


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any((path / f).is_file() for f in _WEIGHT_FILES)


def _deepspeed_tag(path: Path) -> str | None:
    """The ZeRO tag sub-folder inside a checkpoint dir, or None when it is not a DeepSpeed checkpoint."""
    if (path / "latest").is_file():
        return (path / "latest").read_text().strip()
    for sub in sorted(p for p in path.iterdir() if p.is_dir()):
        if any(sub.glob("zero_pp_rank_*")) or any(sub.glob("*_model_states.pt")):
            return sub.name
    return None


def _checkpoint_weights(path: Path) -> list[Path]:
    """Module state files written by ``accelerator.save_state`` (``model.safetensors``, ``model_1...``)."""
    files = sorted(path.glob("model*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    return [f for f in files if f.is_file()]


def is_checkpoint_dir(path: Path) -> bool:
    return bool(_checkpoint_weights(path)) or _deepspeed_tag(path) is not None


def list_checkpoints(run_dir: Path) -> dict[int, Path]:
    """``{step: path}`` of the whole ``checkpoints/step-N`` folders (the trainer's one rule)."""
    return {int(p.name.split("-")[1]): p for p in complete_checkpoints(run_dir)}


def is_run_dir(path: Path) -> bool:
    return (path / "final").is_dir() or (path / "checkpoints").is_dir()


def _owning_run(path: Path) -> Path | None:
    """The run directory ``path`` belongs to: itself, or its parent (``RUN/final``, ``RUN/adapter``)."""
    for cand in (path, path.parent):
        if (cand / "config.yaml").is_file() or (cand / "summary.json").is_file():
            return cand
    return None


def _step_of(path: Path) -> int | None:
    state = path / "trainer_state.json"
    if state.is_file():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            return int(json.loads(state.read_text())["step"])
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


_KINDS_HINT = ("point source= at a run directory, a checkpoints/step-N folder, an HF model directory "
               "(config.json + safetensors) or a LoRA adapter (adapter_config.json)")


def resolve_source(source: str | os.PathLike, checkpoint: str = "auto") -> Source:
    """Work out what ``source`` is; ``checkpoint`` (auto|final|latest|N) picks within a run directory."""
    path = Path(source).expanduser()
    if not path.exists():
        raise SourceError(f"source {path} does not exist; {_KINDS_HINT}")
    if not path.is_dir():
        raise SourceError(f"source {path} is a file, not a directory; {_KINDS_HINT}")
    path = path.resolve()
    checkpoint = str(checkpoint).strip().lower()
    if is_run_dir(path) and not is_hf_dir(path) and not is_checkpoint_dir(path):
        return _resolve_in_run(path, checkpoint)
    if checkpoint != "auto":
        raise SourceError(f"checkpoint={checkpoint} only applies when source is a run directory; "
                          f"drop it or point source= at the run that holds {path}")
    return _resolve_leaf(path)


def _resolve_in_run(run: Path, checkpoint: str) -> Source:
    steps = list_checkpoints(run)
    final = run / "final"
    available = (["final"] if final.is_dir() else []) + [str(s) for s in steps]
    if checkpoint in ("auto", "final") and final.is_dir():
        chosen = final
    elif checkpoint == "final":
        raise SourceError(f"run {run} has no final/ (the run did not finish); use checkpoint=latest "
                          f"or one of: {', '.join(available) or 'none'}")
    elif checkpoint in ("auto", "latest"):
        if not steps:
            raise SourceError(f"run {run} has neither final/ nor checkpoints/step-N/; train it first or "
                              "point source= at a model directory")
        chosen = steps[max(steps)]
    elif checkpoint.isdigit():
        if int(checkpoint) not in steps:
            raise SourceError(f"run {run} has no checkpoints/step-{int(checkpoint)}; pick checkpoint= from: "
                              f"{', '.join(available) or 'none'}")
        chosen = steps[int(checkpoint)]
    else:
        raise SourceError(f"checkpoint={checkpoint} is not understood; use final, latest or a step number")
    src = _resolve_leaf(chosen)
    src.run_dir = run
    return src


def _resolve_leaf(path: Path) -> Source:
    run = _owning_run(path)
    if (path / "adapter_config.json").is_file():
        return Source("lora", path, path, run_dir=run)
    if is_hf_dir(path):
        return Source("hf", path, path, run_dir=run, step=_step_of(path))
    if is_checkpoint_dir(path):
        student = path / "student"
        if not (student / "config.json").is_file():
            raise SourceError(f"checkpoint {path} has no student/config.json; copy the student's config.json "
                              f"and tokenizer into {student}/ or export the run's final/ instead")
        kind = "checkpoint" if _checkpoint_weights(path) else "deepspeed"
        if path.parent.name == "checkpoints":
            run = path.parent.parent
        return Source(kind, path, student, run_dir=run, step=_step_of(path))
    if (path / "config.json").is_file():
        raise SourceError(f"{path} has config.json but no weights (model.safetensors); {_KINDS_HINT}")
    raise SourceError(f"{path} is not a known kind of source; {_KINDS_HINT}")


# ----------------------------------------------------------------------------------------------
# Loading the student
# ----------------------------------------------------------------------------------------------


def load_checkpoint_state(src: Source) -> dict[str, torch.Tensor]:
    """The raw module state dict of a training checkpoint (teacher–student keys, not yet stripped)."""
    if src.kind == "deepspeed":
        try:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        except ImportError:
            raise SourceError(f"{src.path} is a DeepSpeed ZeRO checkpoint; pip install deepspeed to export it "
                              "(or export the run's final/)") from None
        tag = None if (src.path / "latest").is_file() else _deepspeed_tag(src.path)
        try:
            return dict(get_fp32_state_dict_from_zero_checkpoint(str(src.path), tag=tag))
        except MemoryError:
            raise
        except Exception as err:  # noqa: BLE001 - zero_to_fp32 raises whatever a torn folder trips on
            raise _unreadable(src, err) from None
    state: dict[str, torch.Tensor] = {}
    for file in _checkpoint_weights(src.path):
        try:
            if file.suffix == ".safetensors":
                from safetensors.torch import load_file

                state.update(load_file(str(file)))
            else:
                state.update(torch.load(file, map_location="cpu", weights_only=True))
        except _UNREADABLE as err:
            raise _unreadable(src, err) from None
    return state


# What reading a weight file cut short or foreign raises: safetensors' header error, torch's zip reader
# (RuntimeError), pickle, a file that ends early or cannot be opened.
_UNREADABLE = (SafetensorError, RuntimeError, pickle.UnpicklingError, EOFError, OSError)


def _unreadable(src: Source, err: Exception) -> SourceError:
    """The one-line error for a checkpoint whose weight files cannot be read back (a rank's shard missing, a
    file cut short by a kill or a full disk, a ``latest`` naming no folder): it names the ways out."""
    detail = (str(err).strip().splitlines() or [""])[0][:300]
    fix = ("save the model there again, or export one of its run's checkpoints (checkpoint=latest)" if src.kind == "hf"
           else "export an older checkpoints/step-N or the run's final/")
    return SourceError(f"{src.describe()} cannot be read ({type(err).__name__}: {detail}); it is incomplete or "
                       f"damaged: {fix}")


def student_state_dict(state: Mapping[str, torch.Tensor], prefix: str = "student.") -> dict[str, torch.Tensor]:
    """Keep the student's weights under their HF names; drop projectors, teacher and anything else.

    A bare student state dict (no ``student.`` key at all) is returned as is, minus wrapper prefixes.
    """
    def unwrap(key: str) -> str:
        changed = True
        while changed:
            changed = False
            for p in _WRAPPER_PREFIXES:
                if key.startswith(p):
                    key, changed = key[len(p):], True
        return key

    clean = {unwrap(k): v for k, v in state.items()}
    if not any(k.startswith(prefix) for k in clean):
        return clean
    return {k[len(prefix):]: v for k, v in clean.items() if k.startswith(prefix)}


_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?:lora_(?P<ab>[AB])\.(?P<adapter>[^.]+)\.weight|base_layer\.(?P<param>.+))$")


def has_lora_keys(state: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``state`` holds peft LoRA layers in place (``X.base_layer.weight``, ``X.lora_A.default.weight``)."""
    return any(".base_layer." in k or ".lora_" in k for k in state)


def fold_lora(state: Mapping[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """``state`` with each peft LoRA layer folded into a plain weight: ``X.weight = X.base_layer.weight +
    (X.lora_B @ X.lora_A) * alpha / r``, ``r`` being the rank (``lora_A``: ``[r, in]``, ``lora_B``: ``[out, r]``).

    A retrofit checkpoint holds these keys because LoRA is applied in place inside the teacher–student
    module (``recipes/retrofit.py``); this is what its ``merge_and_unload`` does at the end of the run.
    The sum is taken in fp32 and stored in the base weight's dtype. Other LoRA flavours (DoRA's
    magnitude, LoRA on embeddings, several adapters) are refused rather than half-merged.
    """
    out: dict[str, torch.Tensor] = {}
    lora: dict[str, dict[str, torch.Tensor]] = {}
    adapters: set[str] = set()
    for key, value in state.items():
        m = _LORA_KEY.match(key)
        if m is None:
            if ".lora_" in key:
                raise SourceError(f"checkpoint key {key} is a LoRA variant export cannot merge (only plain LoRA on "
                                  "linears); merge it with peft's merge_and_unload and export the merged model")
            out[key] = value
        elif m.group("param") is not None:
            if m.group("param") == "weight":
                lora.setdefault(m.group("module"), {})["W"] = value
            else:  # the wrapped layer's bias (or other parameter) is the plain layer's
                out[f"{m.group('module')}.{m.group('param')}"] = value
        else:
            adapters.add(m.group("adapter"))
            lora.setdefault(m.group("module"), {})[m.group("ab")] = value
    if len(adapters) > 1:
        raise SourceError(f"checkpoint holds {len(adapters)} LoRA adapters ({', '.join(sorted(adapters))}); merge "
                          "the one to ship with peft's merge_and_unload and export the merged model")
    for module, parts in lora.items():
        if set(parts) != {"W", "A", "B"}:
            raise SourceError(f"checkpoint has an incomplete LoRA layer {module} (found {', '.join(sorted(parts))} "
                              "of base_layer, lora_A, lora_B); export the run's final/ instead")
        w, a, b = parts["W"], parts["A"], parts["B"]
        delta = (b.float() @ a.float()) * (float(alpha) / a.shape[0])
        out[f"{module}.weight"] = (w.float() + delta).to(w.dtype)
    return out


def _lora_alpha(src: Source) -> float:
    """``lora_alpha`` from the resolved ``config.yaml`` saved beside the checkpoint (or in its run)."""
    places = [src.path / "config.yaml"] + ([src.run_dir / "config.yaml"] if src.run_dir else [])
    for p in places:
        if p.is_file():
            with contextlib.suppress(yaml.YAMLError, OSError):
                loaded = yaml.safe_load(p.read_text())
                if isinstance(loaded, dict) and isinstance(loaded.get("lora_alpha"), (int, float)):
                    return float(loaded["lora_alpha"])
    raise SourceError(f"{src.describe()} holds LoRA weights but no config.yaml beside it records lora_alpha; add "
                      f"'lora_alpha: VALUE' (the run's value) to {src.path / 'config.yaml'} or export the run's final/")


def _causal_lm_class(config: Any) -> Any:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise SourceError(f"model_type '{config.model_type}' has no causal-LM class in this transformers; "
                          "upgrade transformers or fix config.json") from None


def _first_float_dtype(state: Mapping[str, torch.Tensor]) -> torch.dtype:
    return next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _hybrid_spec(*dirs: Path) -> dict[str, Any] | None:
    """The hybrid spec from the first ``config.json`` that has one, validated."""
    for d in dirs:
        spec = _read_json(d / "config.json").get(CONFIG_KEY)
        if spec is not None:
            try:
                HybridAttentionConfig.from_dict(dict(spec))
            except (TypeError, ValueError) as err:
                raise SourceError(f"{d / 'config.json'} has an invalid '{CONFIG_KEY}' ({err}); fix it") from None
            return dict(spec)
    return None


def _load_tokenizer(*dirs: Path) -> Any:
    from transformers import AutoTokenizer

    for d in dirs:
        if any((d / f).is_file() for f in _TOKENIZER_FILES):
            return AutoTokenizer.from_pretrained(str(d))
    where = " or ".join(str(d) for d in dirs)
    raise SourceError(f"no tokenizer files in {where}; save the student's tokenizer there "
                      "(tokenizer.save_pretrained(DIR))")


def _load_config(config_dir: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(config_dir), attn_implementation="eager")


def _load_weights(src: Source, dtype: torch.dtype | None) -> tuple[Any, torch.dtype, bool]:
    """The bare ``*ForCausalLM`` of a non-LoRA source, cast to ``dtype`` (None: keep the stored one), and
    whether LoRA layers held in place in the checkpoint (a retrofit's) were folded into it."""
    from transformers import GenerationConfig

    if src.kind == "hf":
        # Eager attention on load: the source config may name a kernel that is only registered at
        # training time; the name is not written back, so the export loads anywhere.
        try:
            model = load_causal_lm(str(src.path), dtype="auto" if dtype is None else dtype, dense=True,
                                   attn_implementation="eager")
        except _UNREADABLE as err:
            raise _unreadable(src, err) from None
        stored = _read_json(src.path / "config.json").get("dtype") or _read_json(
            src.path / "config.json").get("torch_dtype")
        source_dtype = getattr(torch, stored, model.dtype) if isinstance(stored, str) else model.dtype
        return model.eval(), source_dtype, False

    state = student_state_dict(load_checkpoint_state(src))
    if not state:
        raise SourceError(f"{src.describe()} holds no student weights; export the run's final/ instead")
    lora = has_lora_keys(state)
    if lora:  # a retrofit checkpoint: LoRA lives inside the student until the run's final merge
        state = fold_lora(state, _lora_alpha(src))
    source_dtype = _first_float_dtype(state)
    config = _load_config(src.config_dir)
    cls = _causal_lm_class(config)
    # A tied pair saved under one name only (safetensors holds no aliases) loads fine: transformers ties.
    model, info = cls.from_pretrained(None, config=config, state_dict=state, output_loading_info=True,
                                      dtype=source_dtype if dtype is None else dtype,
                                      attn_implementation="eager")
    missing = sorted(info.get("missing_keys") or [])
    mismatched = sorted(info.get("mismatched_keys") or [])
    if missing or mismatched:
        bad = missing or [m[0] if isinstance(m, tuple) else m for m in mismatched]
        what = "lacks" if missing else "has wrongly shaped"
        raise SourceError(f"{src.describe()} {what} {len(bad)} student weights (e.g. {bad[0]}); it does not "
                          f"match {src.config_dir / 'config.json'} — export the run's final/ instead")
    if (src.config_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(src.config_dir))
    return model.eval(), source_dtype, lora


def lora_base(src: Source, base: str | None = None) -> str | None:
    """The base a LoRA ``src`` merges into: ``base``, else the adapter's ``base_model_name_or_path``."""
    if src.kind != "lora":
        return None
    return base or _read_json(src.path / "adapter_config.json").get("base_model_name_or_path")


def load_student(src: Source, dtype: torch.dtype | None = torch.float32, base: str | None = None) -> LoadedStudent:
    """The bare student of ``src`` in ``dtype`` (None keeps the source's), LoRA merged, tokenizer attached.

    ``base`` overrides the adapter's ``base_model_name_or_path`` (and may itself be a run, checkpoint or
    model directory).
    """
    if src.kind != "lora":
        model, source_dtype, lora_merged = _load_weights(src, dtype)
        tok_dirs = [src.config_dir] + ([src.run_dir / "final"] if src.run_dir else [])
        return LoadedStudent(model, _load_tokenizer(*tok_dirs), src, source_dtype, _hybrid_spec(src.config_dir),
                             lora_merged=lora_merged)

    base_path = lora_base(src, base)
    if not base_path:
        raise SourceError(f"adapter {src.path} does not name its base model; pass base=PATH")
    if not Path(base_path).expanduser().is_dir():
        raise SourceError(f"LoRA base '{base_path}' is not a local directory; pass base=PATH to the base model")
    base_src = resolve_source(base_path)
    if base_src.kind == "lora":
        raise SourceError(f"LoRA base {base_path} is itself an adapter; pass base= the model it was trained on")
    try:
        from peft import PeftModel
    except ImportError:
        raise SourceError("exporting a LoRA adapter needs peft; pip install peft") from None
    # Merge in fp32 so that W + BA is not rounded twice; cast to the requested dtype afterwards.
    base_model, base_dtype, _ = _load_weights(base_src, torch.float32)
    merged = PeftModel.from_pretrained(base_model, str(src.path)).merge_and_unload()
    target = base_dtype if dtype is None else dtype
    merged = merged.to(target).eval()
    tokenizer = _load_tokenizer(src.path, base_src.config_dir)
    hybrid = _hybrid_spec(src.path, base_src.config_dir)
    return LoadedStudent(merged, tokenizer, src, base_dtype, hybrid, lora_merged=True)


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


def check_target(target: Path, overwrite: bool, *sources: str | os.PathLike | None) -> None:
    """Refuse a target that exists (unless ``overwrite``), is a file, or would swallow a source."""
    target = Path(target).expanduser().absolute()
    for source in sources:
        if source is None:
            continue
        src = Path(source).expanduser().resolve()
        tgt = target.resolve()
        if tgt == src or tgt in src.parents:
            raise SourceError(f"output_dir {target} contains the source {src}; choose another output_dir")
    if target.is_file():
        raise SourceError(f"output_dir {target} is a file; choose a directory path")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise SourceError(f"output_dir {target} already exists; pass overwrite=true to replace it "
                          "or choose another output_dir")


def temp_prefix(target: str | os.PathLike, kind: str) -> str:
    """The name prefix of a temp folder (``kind`` of :data:`TEMP_KINDS`) an export to ``target`` makes beside it."""
    if kind not in TEMP_KINDS:
        raise ValueError(f"unknown temp folder kind {kind!r}")
    return f".{Path(target).name}.{kind}-"


class ExportBusy(ConfigError):
    """Another export to the same output is running."""


@contextlib.contextmanager
def export_lock(target: str | os.PathLike) -> Iterator[Path]:
    """Hold ``.NAME.export.lock`` beside ``target`` for a whole export, or raise :class:`ExportBusy` at once.

    Two exports to one output would each take the other's temp folders for a killed export's leftovers
    (:func:`clean_leftovers`) and delete them mid-write. The lock is an ``flock``: a killed holder releases it.
    The file is removed on release; a process that locked a file just removed (its inode is no longer the
    path's) tries again, so two holders never coexist.
    """
    import fcntl

    target = Path(target).expanduser().absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    path = target.parent / f".{target.name}.export.lock"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ExportBusy(f"another export to {target} is running (pid {holder}, lock {path.name}); wait for it "
                             "to finish or choose another output_dir") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the previous holder removed the file after we opened it: lock the new one
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        os.close(fd)  # closing releases the flock


def clean_leftovers(target: str | os.PathLike) -> list[Path]:
    """Remove the temp folders a killed export to ``target`` left beside it; return the ones handled.

    Only names that an export to this very ``target`` makes (see :data:`TEMP_KINDS`) are touched, never
    another output's or anything else. An export killed between :func:`atomic_output_dir`'s two renames
    left the previous export only under its aside name ``.NAME.old-XXXXXXXX``: with no ``target`` it is
    renamed back, not deleted.
    """
    target = Path(target).expanduser().absolute()
    parent = target.parent
    if not parent.is_dir():
        return []
    kinds = "|".join(TEMP_KINDS)
    ours = re.compile(rf"^\.{re.escape(target.name)}\.(?:(?:{kinds})-[a-z0-9_]{{8}}|old-[0-9a-f]{{8}})$")
    handled = []
    for p in sorted(parent.iterdir()):
        if not ours.match(p.name) or p.is_symlink() or not p.is_dir():
            continue
        if p.name.startswith(f".{target.name}.old-") and not target.exists() and is_hf_dir(p):
            os.replace(p, target)
            fsync_dir(parent)
            print(f"restored {target} from {p.name}, where an interrupted export had moved it", flush=True)
        else:
            shutil.rmtree(p, ignore_errors=True)
            print(f"removed {p.name} beside {target.name}: left by an interrupted export", flush=True)
        handled.append(p)
    return handled


@contextlib.contextmanager
def atomic_output_dir(target: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temp dir beside ``target``; on success it becomes ``target``, on failure it is removed.

    The rename is atomic on one filesystem, which is why the temp dir lives in the target's parent.
    With ``overwrite`` the old directory is moved aside first and put back if the swap fails. What a killed
    process leaves (no ``finally`` runs) is removed by :func:`clean_leftovers` when the next export starts.
    """
    target = Path(target).expanduser().absolute()
    check_target(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(target, "partial"), dir=target.parent))
    try:
        yield tmp
        share_like_umask(tmp)  # mkdtemp's 0700, safetensors' 0600
        fsync_tree(tmp)  # every byte on disk before the rename makes the export visible
        check_target(target, overwrite)
        if target.exists():
            old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
            target.rename(old)
            try:
                tmp.rename(target)
            except BaseException:
                old.rename(target)
                raise
            fsync_dir(target.parent)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(target)
            fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def sanitize_config_json(path: Path, hybrid: dict[str, Any] | None) -> dict[str, Any]:
    """Drop non-builtin attention names and (re)state the hybrid spec in a written ``config.json``."""
    cfg = json.loads(path.read_text())

    def scrub(d: dict[str, Any]) -> None:
        for key in _ATTN_CONFIG_KEYS:
            value = d.get(key)
            if key in d and (not isinstance(value, str) or value not in BUILTIN_ATTENTION):
                del d[key]
        for v in d.values():
            if isinstance(v, dict):
                scrub(v)

    scrub(cfg)
    if hybrid is not None:
        cfg[CONFIG_KEY] = hybrid
    else:
        # A dense export is the base model again: put back the sliding window the retrofit kept aside.
        cfg.pop(CONFIG_KEY, None)
        cfg.update(cfg.pop(BASE_KEY, None) or {})
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return cfg


def save_export(student: LoadedStudent, out_dir: Path, max_shard_size: str = "5GB") -> None:
    """Write weights (safetensors, sharded above ``max_shard_size``), config, generation config, tokenizer."""
    out_dir = Path(out_dir)
    model = student.model
    if student.hybrid is not None:
        setattr(model.config, CONFIG_KEY, student.hybrid)
    # Training turns the KV cache off in the model's config (the recipes save it so into checkpoints/step-N/student/),
    # and a generation config derived from that config, where the source has none of its own, inherits it: HF
    # generate() on the export would then re-run the whole prefix for every token. An export is for serving.
    model.config.use_cache = True
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(generation, "_from_model_config", False) and generation.use_cache is False:
        generation.use_cache = True
    model.save_pretrained(str(out_dir), max_shard_size=max_shard_size)
    sanitize_config_json(out_dir / "config.json", student.hybrid)
    student.tokenizer.save_pretrained(str(out_dir))


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def human_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


# ----------------------------------------------------------------------------------------------
# Model card
# ----------------------------------------------------------------------------------------------


@dataclass
class RunRecords:
    """What a run directory recorded: its config, metrics and last gate report (each may be missing)."""

    config: dict[str, Any] | None = None
    summary: dict[str, Any] | None = None
    gate: dict[str, Any] | None = None
    gate_md: str | None = None
    loss_png: Path | None = None
    gate_stale: str | None = None  # why the run's gate report is not shown (it judged another model)


def read_run_records(src: Source) -> RunRecords:
    rec = RunRecords()
    cfg_paths = ([src.run_dir / "config.yaml"] if src.run_dir else []) + [src.path / "config.yaml"]
    for p in cfg_paths:
        if p.is_file():
            with contextlib.suppress(yaml.YAMLError, OSError):
                loaded = yaml.safe_load(p.read_text())
                if isinstance(loaded, dict):
                    rec.config = loaded
                    break
    if src.run_dir:
        rec.summary = _read_json(src.run_dir / "summary.json") or None
        gate = _read_json(src.run_dir / "gate" / "report.json") or None
        if gate is not None and _judged_another_model(gate, src.run_dir / "final"):
            rec.gate_stale = ("The run's gate report (gate/report.json) judged another model than the run's final/ "
                              "now holds (a later run replaced final/ and its gate did not finish); it is left out. "
                              "Rerun the gate (python -m eval.gate) to judge this model.")
        else:
            rec.gate = gate
            md = src.run_dir / "gate" / "report.md"
            rec.gate_md = md.read_text() if gate is not None and md.is_file() else None
        png = src.run_dir / "loss.png"
        rec.loss_png = png if png.is_file() else None
    return rec


def _judged_another_model(report: dict[str, Any], final: Path) -> bool:
    """Whether a gate report records a candidate (eval.gate's ``models.candidate.fingerprint``) other than
    what ``final`` holds now. A report recording none (not eval.gate's) cannot be checked and counts as a match.

    Cheap on an unchanged ``final``: the gate's own file-digest memo (in its ``cache_dir``) is read, so only a
    file that changed since is hashed again.
    """
    candidate = (report.get("models") or {}).get("candidate") if isinstance(report.get("models"), dict) else None
    recorded = candidate.get("fingerprint") if isinstance(candidate, dict) else None
    if not isinstance(recorded, str):
        return False
    if not is_hf_dir(final):
        return True
    cache = report.get("cache_dir")
    memo = DigestMemo(None)
    if isinstance(cache, str):
        with contextlib.suppress(OSError, ValueError, TypeError):
            memo = DigestMemo(Path(cache) / "file-digests.json")  # read, never written here
            if not isinstance(memo.entries, dict):
                memo = DigestMemo(None)
    try:
        try:
            now = directory_fingerprint(final, memo)
        except (TypeError, IndexError, KeyError, AttributeError):  # a damaged memo: hash every file
            now = directory_fingerprint(final)
    except OSError:  # final/ cannot be read: nothing shows the report is about it
        return True
    return now != recorded


def _measured(key: str, value: Any, gate_stale: bool) -> bool:
    """Whether a summary scalar is a measurement of this model for the card's table: not a path, not the
    environment (its own section), not the verdict of a gate that judged another model."""
    return not (_is_path(key, value) or key.startswith("environment.") or (gate_stale and key.startswith("gate.")))


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v).lower()
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 10_000 else str(v)
    return str(v).replace("|", "\\|").replace("\n", " ")


def _scalars(d: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Flatten nested dicts one level deep into ``(dotted key, scalar)`` rows; lists are skipped."""
    rows: list[tuple[str, Any]] = []
    for k, v in d.items():
        if isinstance(v, Mapping) and not prefix:
            rows += _scalars(v, f"{k}.")
        elif isinstance(v, (int, float, str, bool)) or v is None:
            rows.append((f"{prefix}{k}", v))
    return rows


def _is_path(key: str, value: Any) -> bool:
    """Local paths (``final_dir``) mean nothing to a reader of a published card."""
    return key.endswith(("_dir", "_path", "_file")) or (isinstance(value, str) and os.path.isabs(value))


def _window_words(spec: HybridAttentionConfig) -> str:
    """The sliding window a spec serves, in words: a policy picks it by length, and its own ``window`` is then
    never used."""
    if not spec.window_policy:
        return f"a {spec.window}-token sliding window"
    steps = ", ".join(f"{w} tokens up to a length of {b}" if b is not None else f"{w} beyond"
                      for b, w in spec.window_policy)
    return f"a sliding window set by the input's length ({steps})"


def _table(rows: list[tuple[str, Any]], head: tuple[str, str] = ("", "")) -> list[str]:
    out = [f"| {head[0]} | {head[1]} |", "|---|---|"]
    out += [f"| {k} | {_fmt(v)} |" for k, v in rows]
    return out


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_DATA_KEY = re.compile(r"data|split|text_field|seq_len|max_len|max_steps|batch|tokens|epoch|packing")
# Metrics worth a line of their own in the summary, in this order, when the run recorded them.
_HEADLINE = ("student_ppl_final", "student_ppl_init", "teacher_ppl", "top1_agreement", "final_loss", "steps",
             "tokens_per_s")


def _short(src: Source) -> str:
    """``describe()`` with the path relative to the run's parent: the card should not leak local paths."""
    if src.run_dir is None:
        return src.describe().replace(str(src.path), src.path.name)
    return src.describe().replace(str(src.path), str(src.path.relative_to(src.run_dir.parent)))


SIZE_ROW = "size on disk (weights, config, tokenizer)"


def model_card(name: str, student: LoadedStudent, records: RunRecords, dtype: torch.dtype,
               size_bytes: int | None = None) -> str:
    """``README.md`` for an export: what it is, how it was made, what was measured, how to load it.

    ``size_bytes``: the model's files (weights, config, generation config, tokenizer), measured before the
    card and the run's ``loss.png`` are added.
    """
    cfg = student.model.config
    src = student.source
    hybrid = student.hybrid
    teacher = (records.config or {}).get("teacher")
    lines: list[str] = ["---", "library_name: transformers", "pipeline_tag: text-generation", "tags:",
                        "- distillation"]
    if hybrid:
        lines.append("- hybrid-attention")
    if isinstance(teacher, str) and _HUB_ID.match(teacher) and not Path(teacher).exists():
        lines.append(f"base_model: {teacher}")  # hub metadata: only a hub id, never a local path
    lines += ["---", "", f"# {name}", ""]

    made = "distilled" + (f" from `{teacher}`" if teacher else "")
    lines.append(f"A {cfg.model_type} causal LM ({human_count(student.params)} parameters, "
                 f"{DTYPE_NAMES.get(dtype, str(dtype))}) {made}"
                 f"{', with a merged LoRA adapter' if student.lora_merged else ''}. "
                 f"Exported from the {_short(src)}.")
    lines += ["", "## Model", ""]
    arch = [("architecture", (getattr(cfg, "architectures", None) or [type(student.model).__name__])[0]),
            ("parameters", f"{student.params:,}"), ("layers", getattr(cfg, "num_hidden_layers", None)),
            ("hidden size", getattr(cfg, "hidden_size", None)),
            ("attention heads / KV heads", f"{getattr(cfg, 'num_attention_heads', '?')} / "
                                           f"{getattr(cfg, 'num_key_value_heads', '?')}"),
            ("vocabulary", getattr(cfg, "vocab_size", None)), ("dtype", DTYPE_NAMES.get(dtype, str(dtype))),
            ("chat template", "yes" if getattr(student.tokenizer, "chat_template", None) else "no")]
    if size_bytes is not None:  # measured before this card (and loss.png) are written: say what it counts
        arch.append((SIZE_ROW, human_bytes(size_bytes)))
    lines += _table(arch, ("", ""))
    lines += ["", "## Attention", ""]
    if hybrid:
        spec = HybridAttentionConfig.from_dict(hybrid)
        lines.append(f"Hybrid sparse attention, stored in `config.json` under `{CONFIG_KEY}`: "
                     f"{spec.sink_tokens} sink tokens, " + _window_words(spec)
                     + (f", a global token every {spec.global_every} positions" if spec.global_every else "")
                     + (f" (at most {spec.max_globals})" if spec.max_globals is not None else "")
                     + f". Bounded KV cache: {'yes' if spec.bounded else 'no'}.")
        lines += ["", "```json", json.dumps(hybrid, indent=2, sort_keys=True), "```", "",
                  "Plain `AutoModelForCausalLM.from_pretrained` loads it with dense attention (the weights "
                  "are the same); the project's serving engine reads the spec and runs the sparse pattern."]
    else:
        lines.append("Dense attention (no hybrid spec).")

    lines += ["", "## Training data", ""]
    data_rows = [(k, v) for k, v in _scalars(records.config or {}) if _DATA_KEY.search(k)]
    lines += _table(data_rows, ("key", "value")) if data_rows else ["Not recorded (no run config found)."]

    # Metrics and gate describe the run's final model; say so when this export is an earlier checkpoint.
    run_step = (records.summary or {}).get("steps")
    elsewhere = src.step is not None and run_step is not None and src.step != run_step
    caveat = (f"measured on the run's final model (step {run_step}), not on this export (step {src.step})."
              if elsewhere else "")
    lines += ["", "## Measured", ""]
    if records.summary:
        s = records.summary
        if caveat:
            lines += [f"These numbers were {caveat}", ""]
        head = [(k, s[k]) for k in _HEADLINE if k in s]
        rest = [(k, v) for k, v in _scalars(s) if k not in _HEADLINE and _measured(k, v, bool(records.gate_stale))]
        lines += _table(head + rest, ("metric", "value"))
    else:
        lines.append("No metrics recorded (no summary.json beside the run).")
    if records.loss_png is not None:
        lines += ["", "![training loss](loss.png)"]

    lines += ["", "## Release gate", ""]
    if records.gate:
        verdict = records.gate.get("verdict", "unknown")
        lines += [f"**Verdict: {_fmt(verdict).upper()}**", ""]
        if caveat:
            lines += [f"The gate was {caveat}", ""]
        numbers = [(k, v) for k, v in _scalars(records.gate) if k != "verdict" and not isinstance(v, str)][:12]
        if numbers:
            lines += _table(numbers, ("gate", "value")) + [""]
        if records.gate_md:
            lines += ["<details><summary>Full gate report</summary>", "", records.gate_md.strip(), "",
                      "</details>"]
    else:
        lines.append(records.gate_stale or "The release gate has not been run on this model.")

    env = (records.summary or {}).get("environment")
    if env:  # what the run trained under (core.environment), as HF cards list their framework versions
        versions = [("python", env.get("python")), ("hybrid-distill", env.get("hybrid_distill")),
                    *sorted(env.get("packages", {}).items())]
        lines += ["", "## Framework versions", ""] + _table([(k, v) for k, v in versions if v], ("package", "version"))

    lines += ["", "## Usage", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
              f'model = AutoModelForCausalLM.from_pretrained("{name}")',
              f'tokenizer = AutoTokenizer.from_pretrained("{name}")', "```"]
    if records.config:
        lines += ["", "## Training config", "", "<details><summary>config.yaml</summary>", "", "```yaml",
                  yaml.safe_dump(records.config, sort_keys=False).rstrip(), "```", "", "</details>"]
    return "\n".join(lines) + "\n"


def write_card(out_dir: Path, card: str, records: RunRecords) -> None:
    (Path(out_dir) / "README.md").write_text(card)
    if records.loss_png is not None:
        shutil.copyfile(records.loss_png, Path(out_dir) / "loss.png")
