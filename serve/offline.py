"""Offline batched generation through the serving engine: the release gate's engine backend.

    from eval.gate import GateConfig, run_gate
    from serve.offline import EngineGenerator
    run_gate(GateConfig(candidate=..., baseline=..., out=...), generator=EngineGenerator())

Why: the gate's default backend is transformers' ``model.generate``, which runs a torchao int8 (W8A8)
export through torchao's CPU linears at a few tokens per second (47 min for the bundled 100 prompts
on the demo student). The engine (:mod:`serve.engine`) runs the same int8 math through oneDNN's int8
GEMM, and batches continuously (a finished row takes the next prompt at once), so the gate judges the
quantized model as it is served, at serving speed.

Same contract as :class:`eval.generation.TransformersGenerator`: prompt ids in, ``(text, new_tokens,
hit_limit)`` per prompt out, cut at the same EOS ids and decoded by the same
:func:`eval.generation.finish_row`; greedy outputs of an fp32 model are the transformers ones (up to
floating-point ties: the engine's fused weights sum in another order). Sampling (``do_sample``) gives
each request its own generator seeded with ``settings.seed``, so no output depends on its batch;
the sampled tokens are not transformers' (another random stream). The prefix cache is off: a restored
prefix is computed in other chunk shapes, and an output must not depend on which prompts came first.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from core.models import DTYPES
from eval.generation import GenerationSettings, Generator, OnRows, eos_ids, finish_row, load_model
from serve.engine import Engine
from serve.sampling import SamplingParams

_ENGINE_FILES = ("offline.py", "engine.py", "model.py", "kv_cache.py", "sampling.py")


class EngineGenerator(Generator):
    """Generate with :class:`serve.engine.Engine`, ``settings.batch_size`` requests decoding together.

    ``fast_weights``: the engine's option (None: its default, fused oneDNN copies on CPU); it changes the
    summation order of every projection, so it is part of :meth:`identity` and thus of the cache key.
    """

    name = "serve.engine"

    def __init__(self, fast_weights: bool | None = None) -> None:
        self.fast_weights = fast_weights

    def identity(self) -> dict[str, str]:
        # The engine's own code decides its numerics (fused layouts, kernels), so its source is in the key:
        # an engine change regenerates rather than serving outputs of the old code.
        code = hashlib.sha256(b"".join(Path(__file__).with_name(f).read_bytes() for f in _ENGINE_FILES)).hexdigest()
        ident = {"backend": self.name, "fast_weights": str(self.fast_weights), "engine_code": code[:16]}
        try:
            import torchao

            ident["torchao"] = torchao.__version__  # int8 exports run its tensor subclasses
        except ImportError:
            pass
        return ident

    def load(self, model_dir: Path, settings: GenerationSettings) -> tuple[Engine, Any, list[int]]:
        """``(engine, tokenizer, eos ids)`` for ``model_dir``; the engine's length limit is set by :meth:`run`."""
        settings = settings.resolved()
        # dense=True: the engine runs a saved hybrid spec with its own kernels and bounded caches
        model, tok = load_model(model_dir, settings.device, settings.dtype, dense=True, attn_implementation="sdpa")
        engine = Engine(model=model, tokenizer=tok, device=settings.device, dtype=DTYPES[settings.dtype],
                        max_batch=settings.batch_size, fast_weights=self.fast_weights, prefix_cache_bytes=0)
        return engine, tok, eos_ids(model, tok)

    def run(self, loaded: tuple[Engine, Any, list[int]], ids: list[list[int]], settings: GenerationSettings,
            on_rows: OnRows) -> dict[str, float]:
        engine, tok, eos = loaded
        # Exactly the room the longest prompt and its answer need: the cache is allocated at this length
        # for every row (the model's own limit, e.g. 8K, would cost GBs), and no prompt is refused for
        # the model's limit (transformers' generate refuses none either).
        if engine.cache is not None:
            raise RuntimeError("EngineGenerator.run needs a freshly loaded engine")
        engine.max_seq_len = max(map(len, ids)) + settings.max_new_tokens
        params = SamplingParams(max_new_tokens=settings.max_new_tokens,
                                temperature=settings.temperature if settings.do_sample else 0.0,
                                top_p=settings.top_p if settings.do_sample else 1.0, seed=settings.seed,
                                stop_token_ids=tuple(eos))
        steps = 0
        with torch.inference_mode():
            pending = {i: engine.submit(row, params) for i, row in enumerate(ids)}
            while pending:
                engine.step()
                steps += 1
                done = [i for i, r in pending.items() if r.done]
                for i in done:
                    if pending[i].finish_reason not in ("stop", "length"):
                        raise RuntimeError(f"the engine ended prompt {i} with {pending[i].finish_reason!r}; "
                                           "see the log above")
                if done:
                    on_rows(done, [finish_row(tok, pending.pop(i).out_ids, eos, settings.max_new_tokens)
                                   for i in done])
        return {"engine_steps": steps}
