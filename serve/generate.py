"""Stream a completion to the terminal.

    python -m serve.generate --model DIR --prompt "Once upon a time" [--chat] [--max-new-tokens 128] \
        [--temperature 0] [--top-k 0] [--top-p 1] [--seed 0] [--stop STR ...] [--json | --json-schema SCHEMA |
        --regex PATTERN]

``--temperature 0`` is greedy. A model whose ``config.json`` carries ``"hybrid_attention"`` decodes
with the bounded KV cache.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from serve.engine import GenerationError, HelpFormatter
from serve.sampling import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m serve.generate", description=__doc__.split("\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help="HF model directory (or smollm2-135m-instruct)")
    p.add_argument("--prompt", required=True, help="prompt text (the user message with --chat)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of this probability mass")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (unset: a fresh one each run)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable; unset: none)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide positive logits of tokens already in the prompt or output by this (1: off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times a token's count in the output from its logit, in [-2, 2] (0: off)")
    structured = p.add_mutually_exclusive_group()
    structured.add_argument("--json", action="store_true", help="answer with a JSON object (structured output)")
    structured.add_argument("--json-schema", default=None, metavar="SCHEMA",
                            help="answer with JSON that matches this schema: a file, or the schema itself as JSON")
    structured.add_argument("--regex", default=None, help="answer with text that matches this regular expression")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="context limit, at most the model's max_position_embeddings (unset: the model's)")
    p.add_argument("--device", default=None, help="auto / cpu / cuda / cuda:N (unset: cuda when available)")
    return p.parse_args(argv)


def grammar_from_args(args: argparse.Namespace):
    """The structured-output grammar the flags ask for (None: free text), checked before any model loads."""
    from serve.structured import Grammar

    if args.json:
        grammar = Grammar.json_object()
    elif args.regex is not None:
        grammar = Grammar.regex(args.regex)
    elif args.json_schema is not None:
        text = args.json_schema
        if not text.lstrip().startswith("{"):
            try:
                text = Path(text).read_text()
            except OSError as e:
                raise ValueError(f"--json-schema {args.json_schema}: {e.strerror}; pass a schema file or the schema "
                                 "as JSON") from None
        try:
            grammar = Grammar.json_schema(json.loads(text))
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-schema is not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    else:
        return None
    grammar.validate()
    return grammar


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from serve.engine import device_problem, max_seq_len_problem

    problem = device_problem(args.device) or max_seq_len_problem(args.model, args.max_seq_len)
    if problem:  # before loading anything: a bad flag costs no model load
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=tuple(args.stop or ()),
                                repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                                grammar=grammar_from_args(args))
        from core.models import resolve_model_path
        from serve.engine import Engine

        engine = Engine(resolve_model_path(args.model), device=args.device, max_batch=1,
                        max_seq_len=args.max_seq_len)
        t0 = time.perf_counter()
        for delta in engine.stream(args.prompt, params, chat=args.chat):
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        kind = "hybrid bounded cache" if engine.spec is not None else "dense cache"
        print(f"[{kind}, {time.perf_counter() - t0:.2f}s]", file=sys.stderr)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except GenerationError as e:  # the text printed is cut: never a success
        sys.stdout.write("\n")
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
