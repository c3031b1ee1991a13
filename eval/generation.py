"""Batched, cached generation for the release gate.

Prompts are rendered (chat template or raw text), sorted by length so batches carry little
padding, left-padded by hand, and decoded with ``model.generate`` under an explicit
:class:`transformers.GenerationConfig` built from :class:`GenerationSettings` — never from the
checkpoint's own ``generation_config.json``, whose sampling defaults would make two checkpoints
decode differently.

Every output is cached under a key that hashes the model's fingerprint (content of its files,
see :mod:`eval.fingerprint`), the rendered prompt, the settings and the library versions. A rerun
reads the cache; a changed checkpoint, prompt or setting misses it. The cache is one JSONL file
per model fingerprint in ``<cache_dir>/generations/``.

Who generates is a :class:`Generator`: :class:`TransformersGenerator` (``model.generate``, the default)
or any other backend with the same contract, e.g. the serving engine (``serve.offline.EngineGenerator``,
which the quantized export's gate uses: transformers runs torchao's int8 linears slowly on CPU). The
generator's :meth:`Generator.identity` is part of every cache key, so outputs of different backends
(which may differ in the last bits of the logits, and so in a greedy token) never mix.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from core.models import DTYPES, ModelSourceError, load_causal_lm, resolve_device, resolve_model_path
from eval.fingerprint import DigestMemo, directory_fingerprint, json_hash
from eval.prompt_set import GateInputError, ModelLoadError, Prompt


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = 16
    dtype: str = "auto"  # auto = bf16 on CUDA, fp32 on CPU (bf16 matmul is slow on CPUs)
    device: str = "auto"

    def resolved(self) -> GenerationSettings:
        device = resolve_device(self.device)
        dtype = self.dtype
        if dtype == "auto":
            dtype = "bf16" if device.startswith("cuda") else "fp32"
        return GenerationSettings(**{**asdict(self), "device": device, "dtype": dtype})

    def cache_view(self) -> dict:
        """What can change an output. Batch size is in: left padding perturbs the low bits of logits."""
        d = asdict(self.resolved())
        d["device"] = d["device"].split(":")[0]
        if not self.do_sample:
            d.pop("temperature")
            d.pop("top_p")
        return d


@dataclass
class GenerationRun:
    """Outputs of one model on a prompt set, in prompt order."""

    model_dir: str
    fingerprint: str
    outputs: list[str]
    new_tokens: list[int]
    hit_limit: list[bool]  # stopped by max_new_tokens rather than EOS
    cache_hits: int = 0
    cache_misses: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    backend: dict[str, str] = field(default_factory=dict)  # the generator's identity (part of the cache key)


def check_model_dir(model: str | Path) -> Path:
    """Resolve a model name/dir to a local HF directory or raise a one-line :class:`GateInputError`."""
    try:
        path = Path(resolve_model_path(str(model)))
    except ModelSourceError as err:
        raise GateInputError(str(err)) from None
    if not (path / "config.json").is_file():
        raise GateInputError(f"model {model}: no HF model directory (config.json) there; pass a saved model dir")
    return path


def max_positions(model_dir: Path) -> int | None:
    """``max_position_embeddings`` of a model's ``config.json`` (None: not there or unreadable; the model decides)."""
    try:
        limit = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def check_stored_spec(model_dir: Path, role: str) -> None:
    """One :class:`ModelLoadError` line when the hybrid spec in the model's ``config.json`` (it loads hybrid with it)
    cannot run on the model, before any weights load; a config that cannot be read here is left to the loader."""
    from attention import CONFIG_KEY, HybridAttentionError
    from attention.integration import stored_spec

    try:
        saved = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return
    if isinstance(saved, dict) and saved.get(CONFIG_KEY) is not None:
        try:
            stored_spec(saved, str(Path(model_dir) / "config.json"))
        except HybridAttentionError as err:
            raise ModelLoadError(f"the {role} cannot load hybrid: {err}") from None


def check_prompts_fit(model_dir: Path, prompts: list[Prompt], max_new_tokens: int, default_chat: bool,
                      role: str) -> None:
    """One :class:`GateInputError` line when a rendered prompt and ``max_new_tokens`` outrun the model's
    ``max_position_embeddings`` (a hybrid model refuses such a sequence in the middle of generating, a dense one
    runs past the positions it was trained for). A ``config.json`` without the key is left to the model."""
    limit = max_positions(model_dir)
    if limit is not None:
        prompts_fit(load_tokenizer(model_dir), limit, prompts, max_new_tokens, default_chat, role)


def prompts_fit(tok, limit: int | None, prompts: list[Prompt], max_new_tokens: int, default_chat: bool,
                role: str) -> None:
    """:func:`check_prompts_fit` for a loaded tokenizer and a model's ``limit`` (None: every prompt renders)."""
    for prompt in prompts:
        n = len(render(tok, prompt, default_chat)[1])
        if limit is not None and n + max_new_tokens - 1 > limit:  # the last new token is never fed back
            raise GateInputError(f"prompt '{prompt.id}' is {n} tokens: with max_new_tokens={max_new_tokens} the {role} "
                                 f"would run to position {n + max_new_tokens - 1}, past its max_position_embeddings="
                                 f"{limit}; shorten the prompt or lower max_new_tokens")


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as err:  # noqa: BLE001 - any loader failure is the same user problem
        raise ModelLoadError(f"cannot load the tokenizer of {model_dir} ({type(err).__name__}: "
                             f"{str(err).splitlines()[0] if str(err) else ''}); save it with the model") from None


def load_model(model_dir: Path, device: str, dtype: str, **load_kwargs):
    """The model as it is served (hybrid attention when its config carries a spec) and its tokenizer.

    ``load_kwargs`` go to :func:`core.models.load_causal_lm` (the engine backend loads ``dense=True``).
    A model that cannot load is one :class:`ModelLoadError` line.
    """
    tok = load_tokenizer(model_dir)
    try:
        model = load_causal_lm(str(model_dir), dtype=DTYPES[dtype], **load_kwargs)
    except Exception as err:  # noqa: BLE001
        raise ModelLoadError(f"cannot load the model in {model_dir} ({type(err).__name__}: "
                             f"{str(err).splitlines()[0] if str(err) else ''}); check its weights and config") from None
    return model.to(device).eval(), tok


def render(tok, prompt: Prompt, default_chat: bool) -> tuple[str, list[int]]:
    """The exact model input as text (for the cache key) and token ids."""
    chat = prompt.chat if prompt.chat is not None else default_chat
    if chat:
        if not getattr(tok, "chat_template", None):
            raise GateInputError(f"prompt '{prompt.id}' asks for a chat template but the tokenizer has none; "
                                 "drop --chat / the 'chat' field or use a chat model")
        text = tok.apply_chat_template([{"role": "user", "content": prompt.prompt}],
                                       add_generation_prompt=True, tokenize=False)
        return text, tok(text, add_special_tokens=False)["input_ids"]
    return prompt.prompt, tok(prompt.prompt, add_special_tokens=True)["input_ids"]


def _versions() -> dict[str, str]:
    import transformers

    return {"torch": torch.__version__.split("+")[0], "transformers": transformers.__version__}


class GenerationCache:
    """One JSONL per model fingerprint: ``{"key", "output", "new_tokens", "hit_limit"}`` per line."""

    def __init__(self, cache_dir: Path | None, fingerprint: str):
        self.path = None if cache_dir is None else Path(cache_dir) / "generations" / f"{fingerprint[:32]}.jsonl"
        self.rows: dict[str, dict] = {}
        if self.path is not None and self.path.is_file():
            for line in self.path.read_text().split("\n"):  # not splitlines(): outputs may hold a raw U+2028
                try:
                    row = json.loads(line)
                    self.rows[row["key"]] = row
                except (json.JSONDecodeError, KeyError):
                    continue  # a torn last line from an interrupted run: regenerate that prompt

    def add(self, rows: list[dict]) -> None:
        for row in rows:
            self.rows[row["key"]] = row
        if self.path is not None and rows:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


Row = tuple[str, int, bool]  # (text, new tokens, hit max_new_tokens) of one prompt
OnRows = Callable[[list[int], list[Row]], None]  # (indices into the ids given, their rows) as they finish


def eos_ids(model, tok) -> list[int]:
    """The token ids that end a generation: the model's generation config, else the tokenizer's EOS."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tok.eos_token_id
    return list(eos) if isinstance(eos, (list, tuple)) else ([] if eos is None else [int(eos)])


def finish_row(tok, new_ids: list[int], eos: list[int], max_new_tokens: int) -> Row:
    """``(text, new_tokens, hit_limit)`` of one generation, cut at its first EOS.

    Every backend ends its rows here, so equal token ids give equal texts whoever generated them.
    """
    n = next((i for i, t in enumerate(new_ids) if t in eos), len(new_ids))
    return tok.decode(new_ids[:n], skip_special_tokens=True).strip(), n, n >= max_new_tokens


class Generator:
    """Who turns token ids into outputs for :func:`generate_outputs` (the gate's injection point).

    Subclasses implement :meth:`load` (raising :class:`ModelLoadError` on a model that cannot load) and
    :meth:`run`; :meth:`identity` names the backend and whatever else changes its outputs besides the
    model, prompt and :class:`GenerationSettings` (it goes into the cache key).
    """

    name = "generator"

    def identity(self) -> dict[str, str]:
        return {"backend": self.name}

    def load(self, model_dir: Path, settings: GenerationSettings) -> Any:
        """Whatever :meth:`run` needs (the model, ready to generate)."""
        raise NotImplementedError

    def run(self, loaded: Any, ids: list[list[int]], settings: GenerationSettings, on_rows: OnRows
            ) -> dict[str, float]:
        """Generate for every row of ``ids`` (prompt token ids, longest first), reporting finished rows
        through ``on_rows`` as they come; returns extra timings or counters (may be empty)."""
        raise NotImplementedError


class TransformersGenerator(Generator):
    """``model.generate`` in left-padded batches of ``settings.batch_size`` (the default backend)."""

    name = "transformers"

    def load(self, model_dir: Path, settings: GenerationSettings) -> Any:
        return load_model(model_dir, settings.device, settings.dtype)

    def run(self, loaded: Any, ids: list[list[int]], settings: GenerationSettings, on_rows: OnRows
            ) -> dict[str, float]:
        model, tok = loaded
        for start in range(0, len(ids), settings.batch_size):
            chunk = list(range(start, min(start + settings.batch_size, len(ids))))
            on_rows(chunk, _generate_batch(model, tok, [ids[i] for i in chunk], settings))
        return {}


@torch.inference_mode()
def _generate_batch(model, tok, ids: list[list[int]], settings: GenerationSettings) -> list[Row]:
    """Left-pad ``ids`` and decode; returns ``(text, new_tokens, hit_limit)`` per row."""
    from transformers import GenerationConfig

    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    eos = eos_ids(model, tok)
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, row in enumerate(ids):
        input_ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    kw = dict(max_new_tokens=settings.max_new_tokens, do_sample=settings.do_sample, pad_token_id=pad,
              eos_token_id=eos or None, bos_token_id=model.generation_config.bos_token_id)
    if settings.do_sample:
        kw.update(temperature=settings.temperature, top_p=settings.top_p, top_k=0)
    config = GenerationConfig(**kw)
    torch.manual_seed(settings.seed)
    out = model.generate(input_ids=input_ids.to(model.device), attention_mask=mask.to(model.device),
                         generation_config=config)
    return [finish_row(tok, row, eos, settings.max_new_tokens) for row in out[:, width:].tolist()]


def generate_outputs(model_dir: str | Path, prompts: list[Prompt], settings: GenerationSettings,
                     cache_dir: Path | None, default_chat: bool = False, memo: DigestMemo | None = None,
                     desc: str = "generate", generator: Generator | None = None) -> GenerationRun:
    """Outputs of the model in ``model_dir`` for ``prompts``, generating only what the cache lacks.

    ``generator``: who generates (default :class:`TransformersGenerator`); its identity is in the keys.
    """
    generator = generator or TransformersGenerator()
    settings = settings.resolved()
    t0 = time.perf_counter()
    path = check_model_dir(model_dir)
    fp = directory_fingerprint(path, memo)
    timings = {"fingerprint_s": time.perf_counter() - t0}
    cache = GenerationCache(cache_dir, fp)
    t1 = time.perf_counter()
    tok = load_tokenizer(path)
    backend = generator.identity()
    base = {"model": fp, "settings": settings.cache_view(), "versions": _versions(), "backend": backend}
    rendered = [render(tok, p, default_chat) for p in prompts]
    keys = [json_hash({**base, "input": text}) for text, _ in rendered]
    todo = [i for i, k in enumerate(keys) if k not in cache.rows]
    timings["render_s"] = time.perf_counter() - t1
    if todo:
        t2 = time.perf_counter()
        loaded = generator.load(path, settings)  # before the bar: a load error stays one line
        timings["load_s"] = time.perf_counter() - t2
        order = sorted(todo, key=lambda i: -len(rendered[i][1]))  # long first: the slowest batch shows early
        bar = tqdm(total=len(order), desc=f"{desc} ({path.name}, {backend['backend']})", unit="prompt")
        produced = 0

        def on_rows(idx: list[int], rows: list[Row]) -> None:
            nonlocal produced
            cache.add([{"key": keys[order[j]], "id": prompts[order[j]].id, "output": text, "new_tokens": n,
                        "hit_limit": lim} for j, (text, n, lim) in zip(idx, rows)])
            produced += sum(n for _, n, _ in rows)
            bar.update(len(idx))
            bar.set_postfix(tok_s=f"{produced / max(time.perf_counter() - t3, 1e-9):.0f}")

        t3 = time.perf_counter()
        try:
            timings.update(generator.run(loaded, [rendered[i][1] for i in order], settings, on_rows))
        finally:
            bar.close()
            del loaded
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        timings["generate_s"] = time.perf_counter() - t3
        timings["generated_tokens"] = produced
        missing = [i for i in todo if keys[i] not in cache.rows]
        if missing:
            raise RuntimeError(f"generator {backend['backend']} returned no output for {len(missing)} prompt(s)")
    rows = [cache.rows[k] for k in keys]
    timings["total_s"] = time.perf_counter() - t0
    return GenerationRun(str(path), fp, [r["output"] for r in rows], [r["new_tokens"] for r in rows],
                         [r["hit_limit"] for r in rows], cache_hits=len(prompts) - len(todo),
                         cache_misses=len(todo), timings=timings, backend=backend)
