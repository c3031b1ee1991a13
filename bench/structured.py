"""Structured output's cost: decode time per token with and without a JSON-schema grammar, on the demo model.

    python bench/structured.py [--model smollm2-135m-instruct] [--batch 4] [--new-tokens 64] [--reps 3]

One engine answers the same chat prompts two ways, alternately so that machine noise hits both alike: free text,
and constrained to a JSON schema (serve/structured.py). For the timing every row runs the whole budget (free rows
ignore the stop token; the timed schema holds one long string, so no reply is whole before it), so both arms
decode the same number of tokens with full batches and the difference is the grammar's. Reported: seconds per
generated token of each arm and their ratio, the grammar's own time per token (the mask of allowed tokens made
into logits, timed apart), and, untimed, how many replies to the same prompts under a record schema (city,
country, population) end whole and parse with the required keys. Sampled at temperature 1 with fixed seeds. No
target: the number to watch is the per-token overhead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.environment import json_line  # noqa: E402

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                           "country": {"type": "string", "maxLength": 40},
                                           "population": {"type": "integer", "minimum": 0}},
          "required": ["city", "country", "population"], "additionalProperties": False}
# Timed: a string longer than any budget here, so every constrained row decodes every token it may.
LONG = {"type": "object", "properties": {"text": {"type": "string", "minLength": 4000}}, "required": ["text"]}
QUESTIONS = ["Give the capital of France as JSON with city, country and population.",
             "Describe Tokyo as a JSON record: city, country, population.",
             "Return JSON with the city, country and population of Cairo.",
             "As JSON (city, country, population), tell me about Lima.",
             "JSON please: city, country and population of Oslo.",
             "Answer in JSON with city, country, population: Nairobi.",
             "Give Madrid's city, country and population as a JSON object.",
             "Which city is the capital of Canada? JSON: city, country, population."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="HF model dir or the demo name")
    ap.add_argument("--batch", type=int, default=4, help="requests decoded together")
    ap.add_argument("--new-tokens", type=int, default=64, help="most tokens per reply")
    ap.add_argument("--reps", type=int, default=3, help="rounds; each runs both arms")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    from core.models import resolve_model_path
    from serve.engine import Engine
    from serve.sampling import SamplingParams
    from serve.structured import Grammar

    torch.set_num_threads(args.threads)
    engine = Engine(resolve_model_path(args.model), max_batch=args.batch, max_seq_len=512)
    prompts = [engine.encode(QUESTIONS[i % len(QUESTIONS)], True) for i in range(args.batch)]
    grammar, long = Grammar.json_schema(SCHEMA), Grammar.json_schema(LONG)
    arms = {"free": None, "json_schema": long}
    seconds = {k: [] for k in arms}
    tokens = {k: [] for k in arms}
    engine.generate(prompts, SamplingParams(max_new_tokens=4, grammar=long))  # compile, warm the kernels
    for rep in range(args.reps):
        for name, g in arms.items():
            params = [SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=100 * rep + i, grammar=g,
                                     ignore_eos=g is None) for i in range(args.batch)]
            t0 = time.perf_counter()
            done = engine.generate(prompts, params)
            seconds[name].append(time.perf_counter() - t0)
            tokens[name].append(sum(len(c.token_ids) for c in done))
    if tokens["free"] != tokens["json_schema"]:
        raise SystemExit(f"the arms decoded {sum(tokens['free'])} and {sum(tokens['json_schema'])} tokens: a timed "
                         "reply ended early, so the comparison would not be of equal work")
    outputs = []
    for rep in range(args.reps):  # untimed: does the record schema give whole, valid replies?
        outputs += engine.generate(prompts, [SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0,
                                                            seed=100 * rep + i, grammar=grammar)
                                             for i in range(args.batch)])

    def valid(text: str) -> bool:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return False
        return isinstance(obj, dict) and set(SCHEMA["required"]) <= set(obj)

    whole = [c for c in outputs if c.finish_reason == "stop"]
    n_valid = sum(valid(c.text) for c in whole)
    # The grammar's own work, replayed on the constrained outputs: a mask per generated token.
    mask_s, masked = 0.0, 0
    logits = torch.zeros(engine.model.config.vocab_size)
    for c in outputs:
        constraint = engine.grammars.constraint(grammar)
        for token in c.token_ids:
            t0 = time.perf_counter()
            constraint(logits)
            mask_s += time.perf_counter() - t0
            constraint.consume(token)
            masked += 1
    per_token = {k: sum(seconds[k]) / max(1, sum(tokens[k])) for k in arms}
    print(f"{'arm':<12} {'tokens':>7} {'seconds':>8} {'ms/token':>9}")
    for k in arms:
        print(f"{k:<12} {sum(tokens[k]):>7} {sum(seconds[k]):>8.2f} {1e3 * per_token[k]:>9.2f}")
    mask_ms = 1e3 * mask_s / max(1, masked)
    print(f"constrained replies whole: {len(whole)}/{len(outputs)}, of those valid JSON with the required keys: "
          f"{n_valid}/{len(whole)}; grammar mask {mask_ms:.3f} ms/token "
          f"(median round {statistics.median(seconds['json_schema']):.2f}s constrained vs "
          f"{statistics.median(seconds['free']):.2f}s free)")
    print(json_line({"model": args.model, "batch": args.batch, "new_tokens": args.new_tokens, "reps": args.reps,
                     "ms_per_token_free": 1e3 * per_token["free"],
                     "ms_per_token_json_schema": 1e3 * per_token["json_schema"],
                     "overhead_ratio": per_token["json_schema"] / per_token["free"],
                     "grammar_mask_ms_per_token": mask_ms, "replies": len(outputs), "replies_whole": len(whole),
                     "replies_valid": n_valid}))


if __name__ == "__main__":
    main()
