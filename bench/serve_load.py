"""Load test: N concurrent streaming clients against the HTTP server on loopback for a bounded time.

    python bench/serve_load.py [--model DIR] [--clients 8] [--seconds 30] [--max-tokens 64]

Without ``--model`` a tiny random model is built (the point is the server, not the model). Each
client loops: one streaming ``/v1/completions`` request after another until the time is up.
Reported: TTFT p50/p95 (request sent → first token event), aggregate generated tokens/s, errors
(non-200, broken streams; target 0) and stream integrity: for every request the number of SSE token
events equals ``usage.completion_tokens`` and the stream ends with ``[DONE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.environment import json_line  # noqa: E402


async def client_loop(url: str, body: dict, deadline: float, stats: dict) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        i = 0
        while time.perf_counter() < deadline:
            i += 1
            t0 = time.perf_counter()
            ttft = None
            token_events = 0
            usage = None
            done = False
            try:
                async with c.stream("POST", "/v1/completions", json={**body, "seed": i}) as r:
                    if r.status_code != 200:
                        stats["errors"] += 1
                        await r.aread()
                        continue
                    async for line in r.aiter_lines():
                        if not line:
                            continue
                        data = line.removeprefix("data: ")
                        if data == "[DONE]":
                            done = True
                            break
                        chunk = json.loads(data)
                        if not chunk["choices"]:  # stream_options.include_usage: the last chunk before [DONE]
                            usage = chunk["usage"]
                        elif chunk["choices"][0]["finish_reason"] is None:
                            token_events += 1
                            if ttft is None:
                                ttft = time.perf_counter() - t0
            except Exception:  # a broken connection counts as an error, the run goes on
                stats["errors"] += 1
                continue
            stats["requests"] += 1
            if ttft is not None:
                stats["ttft"].append(ttft)
            stats["tokens"] += token_events
            if not done or usage is None or usage["completion_tokens"] != token_events:
                stats["integrity_failures"] += 1


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF model dir (default: a tiny random model)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    from serve.engine import Engine
    from serve.server import ServerThread, create_app

    torch.set_num_threads(args.threads)
    path = args.model
    if path is None:
        from core.tiny import save_tiny

        path = save_tiny(tempfile.mkdtemp(prefix="serve-load-"), arch="llama", layers=4, hidden=128)
    engine = Engine(path, max_batch=args.max_batch, max_seq_len=1024)
    body = {"prompt": "the quick brown fox jumps over the lazy dog", "max_tokens": args.max_tokens,
            "temperature": 0.8, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    stats = {"requests": 0, "errors": 0, "tokens": 0, "integrity_failures": 0, "ttft": []}
    with ServerThread(create_app(engine, max_queue=max(args.clients, 1))) as srv:
        t0 = time.perf_counter()
        deadline = t0 + args.seconds

        async def run() -> None:
            await asyncio.gather(*(client_loop(srv.url, body, deadline, stats) for _ in range(args.clients)))

        asyncio.run(run())
        elapsed = time.perf_counter() - t0
    out = {
        "clients": args.clients,
        "seconds": round(elapsed, 2),
        "requests": stats["requests"],
        "ttft_p50_s": round(pct(stats["ttft"], 0.5), 4),
        "ttft_p95_s": round(pct(stats["ttft"], 0.95), 4),
        "tokens_per_s": round(stats["tokens"] / elapsed, 1),
        "errors": stats["errors"],
        "integrity_failures": stats["integrity_failures"],
        "stream_integrity": stats["integrity_failures"] == 0 and stats["requests"] > 0,
    }
    print(f"{args.clients} streaming clients for {elapsed:.1f}s on {srv.url}: {stats['requests']} requests, "
          f"{stats['tokens']} tokens")
    print(f"{'TTFT p50':<22}{out['ttft_p50_s']:>10.3f} s")
    print(f"{'TTFT p95':<22}{out['ttft_p95_s']:>10.3f} s")
    print(f"{'mean TTFT':<22}{statistics.fmean(stats['ttft']) if stats['ttft'] else float('nan'):>10.3f} s")
    print(f"{'tokens/s (aggregate)':<22}{out['tokens_per_s']:>10.1f}")
    print(f"{'errors':<22}{out['errors']:>10}")
    print(f"{'integrity failures':<22}{out['integrity_failures']:>10}")
    print(json_line(out))


if __name__ == "__main__":
    main()
