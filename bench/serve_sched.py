"""Where a short request's time to first token goes, and what the engine's prefill scheduling does to it.

    python bench/serve_sched.py [--model smollm2-135m-instruct] [--users 4] [--seconds 60] [--rounds 2] \
        [--overtake 160] [--step-ms 0]

In one process, without HTTP: the engine's background loop (as the server runs it) serves ``--users``
closed-loop users with the issue's mix (30 % short prompts of 10-130 tokens with 64 new tokens, 50 %
medium of 130-650 with 256, 20 % long of 650-2000 with ``--long-new`` new tokens; a 0.5-3 s pause
between requests; the same seeded schedule for every arm). The arms alternate in blocks of
``--seconds`` for ``--rounds`` rounds, so machine noise hits them alike. Every arm pins the engine's
``overtake_tokens`` (its default turns overtaking on, at a threshold that grows with the chunk), so that
the arms differ only in what their names say:

* ``chunk 512``: 512 prompt tokens per step in one forward (the engine's default before this bench's
  second version), no overtaking: a short prompt that arrives mid-step waits for all of it;
* ``chunk 128``: the same 512-token budget in 128-token forwards, arrivals admitted between them, no
  overtaking (``Engine(prefill_chunk=128, overtake_tokens=0)``): the short prompt goes after the forward
  in flight;
* ``chunk 128 overtake N`` (``--overtake N``, default 160, the engine's default for a 128-token chunk;
  0: no such arm): as ``chunk 128``, but a waiting prompt of at most N tokens (at 160: every short one
  and the shortest medium ones) is prefilled between two layers of the forward in flight (the engine's
  default scheduling);
* with ``--step-ms MS``, also ``chunk 128 timed MS``: as ``chunk 128``, the step's prefill sized by
  measured time (``Engine(prefill_step_s=...)``, off by default in the engine).

Per arm: short-prompt TTFT P50/P95 split into the wait (arrival to its first prefill forward: the step
in flight, earlier prompts) and its own prefill (first forward to first token), plus the medium and
long TTFT P50 and the decode inter-token P95 (what the long prompts' prefill costs everyone else). HTTP,
tokenization and the client are not in these numbers: ``bench/serve_mix.py`` has the end-to-end ones.
A table, then one JSON line (also each arm's count of overtaking prefills).
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.environment import json_line  # noqa: E402

CLASSES = {"short": ((10, 130), 64, 3), "medium": ((130, 650), 256, 5), "long": ((650, 2000), None, 2)}


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_arm(engine, seconds: float, users: int, seed: int, long_new: int, vocab: int) -> list[dict]:
    """Closed-loop users against ``engine`` (its loop running) for ``seconds``; one record per request."""
    from serve.sampling import SamplingParams

    records: list[dict] = []
    lock = threading.Lock()
    stop_at = time.perf_counter() + seconds

    def user(u: int) -> None:
        rng = random.Random(seed * 1000 + u)
        names = [c for c, (_, _, w) in CLASSES.items() for _ in range(w)]
        while time.perf_counter() < stop_at:
            time.sleep(rng.uniform(0.5, 3.0))
            cls = rng.choice(names)
            (lo, hi), new, _ = CLASSES[cls]
            prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))]
            done = threading.Event()
            gaps: list[float] = []
            last = [None]

            def on_event(_d, token, finish, gaps=gaps, last=last, done=done):
                now = time.perf_counter()
                if token is not None:
                    if last[0] is not None:
                        gaps.append(now - last[0])
                    last[0] = now
                if finish is not None:
                    done.set()

            req = engine.submit(prompt, SamplingParams(max_new_tokens=new or long_new, ignore_eos=True,
                                                       temperature=0.7, seed=rng.randrange(2**31)), on_event)
            done.wait()
            with lock:
                records.append({"class": cls, "tokens": len(prompt), "gaps": gaps,
                                "ttft": req.first_token_at - req.arrival,
                                "wait": req.prefill_start - req.arrival,
                                "own": req.first_token_at - req.prefill_start})

    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


def summarize(recs: list[dict]) -> dict:
    out = {}
    short = [r for r in recs if r["class"] == "short"]
    ms = lambda v: None if v is None else round(v * 1000, 1)  # noqa: E731
    for key in ("ttft", "wait", "own"):
        xs = [r[key] for r in short]
        out[f"short_{key}_p50_ms"], out[f"short_{key}_p95_ms"] = ms(pct(xs, 0.5)), ms(pct(xs, 0.95))
    for c in ("medium", "long"):
        out[f"{c}_ttft_p50_ms"] = ms(pct([r["ttft"] for r in recs if r["class"] == c], 0.5))
    out["itl_p95_ms"] = ms(pct([g for r in recs for g in r["gaps"]], 0.95))
    out["requests"] = {c: sum(r["class"] == c for r in recs) for c in CLASSES}
    return out


def arms(overtake: int, step_ms: float) -> dict[str, dict]:
    """The arms' names and their ``Engine`` keyword arguments (beside the model and the shared budget)."""
    out = {"chunk 512": {"prefill_chunk": 512, "overtake_tokens": 0},
           "chunk 128": {"prefill_chunk": 128, "overtake_tokens": 0}}
    if overtake > 0:
        out[f"chunk 128 overtake {overtake}"] = {"prefill_chunk": 128, "overtake_tokens": overtake}
    if step_ms > 0:
        out[f"chunk 128 timed {step_ms:g} ms"] = {"prefill_chunk": 128, "overtake_tokens": 0,
                                                  "prefill_step_s": step_ms / 1000}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=60.0, help="seconds per arm per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--overtake", type=int, default=160, help="also run chunk 128 with overtaking of prompts of at "
                    "most this many tokens (default: the engine's for that chunk, 128 + 128 // 4; 0: no such arm)")
    ap.add_argument("--step-ms", type=float, default=0.0,
                    help="also run a timed arm with this prefill_step_s, in ms (0: no timed arm)")
    ap.add_argument("--long-new", type=int, default=256, help="new tokens of a long request (the mix says 2048)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    from core.models import load_causal_lm, load_tokenizer, resolve_model_path
    from serve.engine import Engine

    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    model, tok = load_causal_lm(str(path), dtype=torch.float32, dense=True, attn_implementation="sdpa"), \
        load_tokenizer(str(path))
    engines = {name: Engine(model=model, tokenizer=tok, max_batch=args.users, max_seq_len=4096, prefix_cache_bytes=0,
                            prefill_budget=512, **kw)
               for name, kw in arms(args.overtake, args.step_ms).items()}
    vocab = min(tok.vocab_size, model.config.vocab_size)
    recs: dict[str, list[dict]] = {name: [] for name in engines}
    for rnd in range(args.rounds):
        for name, engine in engines.items():
            engine.start()
            recs[name] += run_arm(engine, args.seconds, args.users, seed=rnd, long_new=args.long_new, vocab=vocab)
            engine.stop()
            print(f"round {rnd + 1}/{args.rounds} {name}: {len(recs[name])} requests so far", flush=True)
    res = {name: summarize(r) for name, r in recs.items()}
    cols = ("short_ttft_p50_ms", "short_ttft_p95_ms", "short_wait_p95_ms", "short_own_p95_ms", "medium_ttft_p50_ms",
            "long_ttft_p50_ms", "itl_p95_ms")
    print(f"{'arm':<26}" + "".join(f"{c.removesuffix('_ms'):>19}" for c in cols) + "  (ms)")
    for name, r in res.items():
        print(f"{name:<26}" + "".join(f"{'-' if r[c] is None else r[c]:>19}" for c in cols))
    print(json_line({"model": str(args.model), "users": args.users, "seconds_per_arm": args.seconds * args.rounds,
                     "threads": args.threads, "long_new_tokens": args.long_new,
                     "overtakes": {name: e.overtakes for name, e in engines.items()}, "arms": res}))


if __name__ == "__main__":
    main()
