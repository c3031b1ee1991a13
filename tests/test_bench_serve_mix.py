"""bench/serve_mix.py's report: per-class percentiles and the time-to-first-token split, on records made by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("serve_mix", Path(__file__).resolve().parents[1] / "bench" / "serve_mix.py")
serve_mix = importlib.util.module_from_spec(spec)
spec.loader.exec_module(serve_mix)


def _client(rid, cls, ttft_s, events=3, usage=3, done=True, error=None):
    return {"id": rid, "class": cls, "ttft": ttft_s, "gaps": [0.01, 0.02], "events": events, "usage_tokens": usage,
            "done": done, "error": error, "http_status": 200}


def _server(rid, tok, start, first, sent, n=40, cached=32):
    return {"id": rid, "prompt_tokens": n, "cached_tokens": cached, "tokenized_ms": tok, "prefill_start_ms": start,
            "first_token_ms": first, "first_sent_ms": sent, "done_ms": sent + 50}


def test_ttft_split_joins_by_id_and_splits_each_request():
    entries = [_client("a", "short", 0.100), _client("b", "short", 0.200), _client("c", "medium", 0.300),
               _client("x", "short", 0.500)]  # x has no server record: left out of the split
    server = [_server("a", 2, 10, 60, 61), _server("b", 3, 120, 170, 175), _server("c", 1, 5, 250, 251),
              _server("zzz", 1, 2, 3, 4)]  # a record no client saw: ignored
    split = serve_mix.ttft_split(entries, server)
    short = split["classes"]["short"]
    assert short["joined"] == 2 and split["classes"]["medium"]["joined"] == 1 and split["classes"]["long"]["joined"] == 0
    # Two short requests: wait 8 and 117 ms, prefill 50 and 50, client rest 100-61 = 39 and 200-175 = 25.
    assert (short["wait_p50_ms"], short["wait_p95_ms"]) == (8.0, 117.0)
    assert short["prefill_p50_ms"] == short["prefill_p95_ms"] == 50.0
    assert (short["client_rest_p50_ms"], short["client_rest_p95_ms"]) == (25.0, 39.0)
    assert (short["server_p50_ms"], short["server_p95_ms"]) == (61.0, 175.0)
    # Only b is a short request over 150 ms; its parts add up to its client TTFT.
    [slow] = split["slow_short"]
    assert slow["ttft_ms"] == 200.0
    assert slow["tokenize"] + slow["wait"] + slow["prefill"] + slow["hand_off"] + slow["client_rest"] == 200.0
    assert split["classes"]["long"]["wait_p50_ms"] is None


def test_waited_on_splits_a_wait_by_what_overlapped_it():
    """Request received at t = 10 s, handed over 2 ms later, first forward at 10.122: its 120 ms wait
    overlapped 40 ms of a decode step (starting before it), 60 ms of another prompt's 96-token chunk, and a
    forward wholly outside it counts nothing; the 20 ms left is "neither"."""
    r = {**_server("b", 2, 122, 170, 175), "received_s": 10.0}
    forwards = [{"kind": "decode", "start_s": 9.99, "end_s": 10.042, "tokens": 3, "requests": [1, 2, 3]},
                {"kind": "prefill", "start_s": 10.052, "end_s": 10.112, "tokens": 96, "requests": [4]},
                {"kind": "prefill", "start_s": 10.122, "end_s": 10.17, "tokens": 40, "requests": [5]},
                {"kind": "decode", "start_s": 9.0, "end_s": 9.05, "tokens": 1, "requests": [1]}]
    got = serve_mix.waited_on(r, forwards)
    assert got == {"wait_decode": 40.0, "wait_prefill": 60.0, "wait_prefill_tokens": 96, "wait_other": 20.0}
    assert serve_mix.waited_on(_server("b", 2, 122, 170, 175), forwards) == {}  # an older log: no clock
    entries = [_client("b", "short", 0.2)]
    [slow] = serve_mix.ttft_split(entries, [r], forwards=forwards)["slow_short"]
    assert slow["wait"] == 120.0 and slow["wait_decode"] + slow["wait_prefill"] + slow["wait_other"] == 120.0


def test_summarize_counts_errors_integrity_and_percentiles():
    entries = [_client("a", "short", 0.1), _client("b", "short", 0.3, events=3, usage=2),
               _client("c", "long", 0.5, error="HTTP 503")]
    entries[2]["http_status"] = 503
    out = serve_mix.summarize(entries, elapsed=10.0)
    assert out["errors"] == 1 and out["streams"] == 2 and out["integrity_failures"] == 1
    assert out["events_equal_tokens"] is False and out["tokens"] == 9 and out["tokens_per_s"] == 0.9
    assert out["classes"]["short"]["ttft_p50_ms"] == 100.0 and out["classes"]["short"]["ttft_p95_ms"] == 300.0


def test_cpu_seconds_reads_a_live_process_and_grows_with_its_work():
    import os
    import subprocess
    import sys
    import time

    assert serve_mix.cpu_seconds(2**22 + 12345) is None  # no such process
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.4: pass\ntime.sleep(30)"])
    try:
        deadline = time.time() + 20
        used = 0.0
        while time.time() < deadline and used < 0.39:
            used = serve_mix.cpu_seconds(child.pid) or 0.0
            time.sleep(0.05)
        assert 0.39 <= used < 5.0  # the busy loop's 0.4 s (plus start-up), not wall time
    finally:
        child.kill()
        child.wait()
    assert serve_mix.cpu_seconds(os.getpid()) > 0
