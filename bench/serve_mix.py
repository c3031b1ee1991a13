"""Mixed-traffic load test: the server on loopback, locust headless with bench/locustfile.py, per-class latency.

    python bench/serve_mix.py [--model smollm2-135m-instruct] [--users 4] [--seconds 120] [--threads 2]
    python bench/serve_mix.py --soak 600          # a 10-minute soak: server RSS growth after warm-up

Starts ``python -m serve.server`` in its own process (so its memory is its own), waits for ``/health``,
runs ``locust --headless`` for the given time with ``--users`` users, started ``--spawn-rate`` per second
(the mix and the pauses are in bench/locustfile.py), then reports from every request's own record:

* P50 / P95 / P99 time to first token and inter-token latency per class (short / medium / long);
* generated tokens/s (token events over the wall time), requests, error rate;
* stream integrity: token events == ``usage.completion_tokens`` and ``[DONE]`` on every stream;
* the server's RSS at start (after loading), peak and end, sampled every 0.5 s; with ``--soak`` also
  the growth from the end of the warm-up (the first ``--warmup`` seconds, default 20 %) to the end;
* where the time to first token goes, from the server's ``--request-log`` joined by response id: per
  class, P50 / P95 of the server's share (handler start to the first event handed to HTTP) split into
  tokenize, wait (for the step in flight and earlier prompts), own prefill and hand-off, and the rest
  (client TTFT minus the server's: connection, HTTP, the client's own scheduling); and every short
  request over the 150 ms target with its split, and what the engine ran while it waited (the server's
  ``--step-log``: decode steps, other prompts' prefill, or neither).

Targets (issue 16, demo student, 2 cores): short P95 TTFT <= 150 ms at 4 users, 0 errors, events ==
tokens, soak RSS growth <= 5 %. A table for people, then one JSON line. Without locust it says what to
install and exits 0 with ``{"skipped": ...}``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from core.environment import json_line  # noqa: E402

CLASSES = ("short", "medium", "long")


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a live process has used so far (/proc/PID/stat), None if unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def prefix_cache_bytes(url: str) -> int | None:
    """The server's ``prefix_cache_bytes`` gauge from ``/metrics`` (None when off or unreachable)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=2) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("hd_serve_prefix_cache_bytes "):
                    return int(float(line.split()[1]))
    except OSError:
        return None
    return None


def scrape(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """The named samples (full names, as in the exposition) from the server's ``/metrics``; missing ones left out."""
    out: dict[str, float] = {}
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                name, _, value = line.partition(" ")
                if name in names:
                    out[name] = float(value)
    except OSError:
        pass
    return out


class RssWatch(threading.Thread):
    """Samples a process's RSS every ``every`` seconds: ``samples`` = [(seconds since start, bytes)].

    With ``url``, also the server's prefix-cache bytes every ``metrics_every`` seconds: ``cache`` =
    [(seconds, bytes)]. The prefix cache grows by design until its byte budget (then it evicts), so
    the soak reports the RSS both as is and net of it.
    """

    def __init__(self, pid: int, every: float = 0.5, url: str | None = None, metrics_every: float = 5.0) -> None:
        super().__init__(daemon=True)
        self.pid, self.every, self.url, self.metrics_every = pid, every, url, metrics_every
        self.samples: list[tuple[float, int]] = []
        self.cache: list[tuple[float, int]] = []
        self._halt = threading.Event()
        self.t0 = time.perf_counter()

    def run(self) -> None:
        next_metrics = 0.0
        while not self._halt.is_set():
            r = rss_bytes(self.pid)
            now = time.perf_counter() - self.t0
            if r is not None:
                self.samples.append((now, r))
            if self.url and now >= next_metrics:
                c = prefix_cache_bytes(self.url)
                if c is not None:
                    self.cache.append((now, c))
                next_metrics = now + self.metrics_every
            self._halt.wait(self.every)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"error: the server exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"error: the server was not healthy within {timeout:.0f} s")


def summarize(entries: list[dict], elapsed: float) -> dict:
    out: dict = {"requests": len(entries)}
    errors = [e for e in entries if e["error"]]
    out["errors"] = len(errors)
    out["error_rate"] = round(len(errors) / max(1, len(entries)), 4)
    out["error_examples"] = sorted({e["error"] for e in errors})[:3]
    # Integrity is a property of the streams the server accepted (a 400 or 503 has no stream).
    streams = [e for e in entries if e.get("http_status") == 200]
    out["streams"] = len(streams)
    out["integrity_failures"] = sum(1 for e in streams if not e["done"] or e["usage_tokens"] != e["events"])
    out["events_equal_tokens"] = bool(streams) and out["integrity_failures"] == 0
    out["tokens"] = sum(e["events"] for e in entries)
    out["tokens_per_s"] = round(out["tokens"] / elapsed, 1)
    per = {}
    for c in CLASSES:
        es = [e for e in entries if e["class"] == c]
        ttft = [e["ttft"] for e in es if e["ttft"] is not None]
        gaps = [g for e in es for g in e["gaps"]]
        per[c] = {"requests": len(es), "errors": sum(1 for e in es if e["error"]),
                  **{f"ttft_p{q}_ms": _ms(pct(ttft, q / 100)) for q in (50, 95, 99)},
                  **{f"itl_p{q}_ms": _ms(pct(gaps, q / 100)) for q in (50, 95, 99)}}
    out["classes"] = per
    return out


SPLIT = (("tokenize", None, "tokenized_ms"), ("wait", "tokenized_ms", "prefill_start_ms"),
         ("prefill", "prefill_start_ms", "first_token_ms"), ("hand_off", "first_token_ms", "first_sent_ms"))


def waited_on(r: dict, forwards: list[dict]) -> dict:
    """What the engine ran while request ``r`` (a request-log line) waited for its first forward: ms of
    decode steps and of other prompts' prefill overlapping that wait, and the rest of it (the engine's own
    Python between forwards, or a core taken by another thread); ``forwards``: the step log."""
    if r.get("received_s") is None or r.get("prefill_start_ms") is None:
        return {}
    a, b = r["received_s"] + r["tokenized_ms"] / 1000, r["received_s"] + r["prefill_start_ms"] / 1000
    out = {"wait_decode": 0.0, "wait_prefill": 0.0, "wait_prefill_tokens": 0}
    for f in forwards:
        overlap = min(b, f["end_s"]) - max(a, f["start_s"])
        if overlap > 0:
            out["wait_" + f["kind"]] += overlap * 1000
            if f["kind"] == "prefill":
                out["wait_prefill_tokens"] += f["tokens"]
    out["wait_other"] = (b - a) * 1000 - out["wait_decode"] - out["wait_prefill"]
    return {k: round(v, 1) for k, v in out.items()}


def ttft_split(entries: list[dict], server: list[dict], slow_ms: float = 150.0,
               forwards: list[dict] | None = None) -> dict:
    """Join client records with the server's request log by response id; per class, P50 / P95 (ms) of
    each part of the time to first token; and the short requests slower than ``slow_ms`` with their parts
    (with the step log, ``forwards``, also what their wait overlapped: :func:`waited_on`)."""
    by_id = {r["id"]: r for r in server}
    pairs = []  # (row, its request-log line)
    for e in entries:
        r = by_id.get(e.get("id"))
        if r is None or e["ttft"] is None or r.get("first_sent_ms") is None:
            continue
        parts = {name: r[b] - (r[a] if a else 0.0) for name, a, b in SPLIT}
        parts["server"] = r["first_sent_ms"]
        parts["client_rest"] = e["ttft"] * 1000 - r["first_sent_ms"]
        pairs.append(({"class": e["class"], "ttft_ms": round(e["ttft"] * 1000, 1), "prompt_tokens": r["prompt_tokens"],
                       "cached_tokens": r.get("cached_tokens"), **{k: round(v, 1) for k, v in parts.items()}}, r))
    rows = [x for x, _ in pairs]
    names = [n for n, _, _ in SPLIT] + ["server", "client_rest"]
    per = {}
    for c in CLASSES:
        cr = [x for x in rows if x["class"] == c]
        per[c] = {"joined": len(cr), **{f"{n}_p{q}_ms": _ms(pct([x[n] / 1000 for x in cr], q / 100))
                                        for n in names for q in (50, 95)}}
    slow = sorted(((x, r) for x, r in pairs if x["class"] == "short" and x["ttft_ms"] > slow_ms),
                  key=lambda p: -p[0]["ttft_ms"])
    for x, r in slow if forwards else ():  # the step log is scanned for these only
        x.update(waited_on(r, forwards))
    return {"classes": per, "slow_short": [x for x, _ in slow]}


def soak_net_of_prefix_cache(rss: list[tuple[float, int]], cache: list[tuple[float, int]], warmup: float) -> dict:
    """RSS growth after warm-up net of the prefix cache's own bytes (bounded by its budget, by design).

    Uses the cache samples nearest the warm-up end and the soak end; empty without cache samples.
    """
    if not rss or not cache:
        return {}
    at = lambda series, t: min(series, key=lambda s: abs(s[0] - t))[1]  # noqa: E731
    t_wu = next((t for t, _ in rss if t >= warmup), rss[-1][0])
    t_end = rss[-1][0]
    c_wu, c_end = at(cache, t_wu), at(cache, t_end)
    r_wu, r_end = at(rss, t_wu), at(rss, t_end)
    return {"prefix_cache_after_warmup_mb": round(c_wu / 2**20, 1), "prefix_cache_end_mb": round(c_end / 2**20, 1),
            "rss_growth_after_warmup_net_of_prefix_cache": round((r_end - c_end) / max(1, r_wu - c_wu) - 1, 4)}


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1000, 1)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="HF model dir or the demo name")
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--spawn-rate", type=float, default=1.0,
                    help="users started per second (locust -r). A ramp: with all users started at once their first "
                         "requests land within the same millisecond, a burst no real traffic of paused users has")
    ap.add_argument("--seconds", type=float, default=120.0, help="test length (ignored with --soak)")
    ap.add_argument("--soak", type=float, default=None, metavar="SECONDS", help="soak for this long and report "
                                                                                "RSS growth after warm-up")
    ap.add_argument("--warmup", type=float, default=None, help="soak warm-up seconds (default: 20%% of the soak)")
    ap.add_argument("--threads", type=int, default=2, help="server torch threads (OMP_NUM_THREADS)")
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--prefill-chunk", type=int, default=None, help="server --prefill-chunk")
    ap.add_argument("--prefill-budget", type=int, default=None, help="server --prefill-budget")
    ap.add_argument("--prefill-step-ms", type=float, default=None, help="server --prefill-step-ms (0: fixed budget)")
    ap.add_argument("--overtake-tokens", type=int, default=None,
                    help="server --overtake-tokens (0: short prompts wait for the forward in flight)")
    ap.add_argument("--prefix-cache-mb", type=float, default=256)
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--out", default=None, help="keep the request log and locust CSVs here")
    args = ap.parse_args()

    if importlib.util.find_spec("locust") is None or shutil.which("locust") is None:
        msg = "locust is not installed; pip install 'hybrid-distill[bench]' (or pip install locust)"
        print(msg)
        print(json.dumps({"skipped": msg}))
        return 0
    seconds = args.soak if args.soak else args.seconds
    warmup = (args.warmup if args.warmup is not None else 0.2 * seconds) if args.soak else 0.0
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="serve-mix-"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "requests.jsonl"
    log.unlink(missing_ok=True)
    server_log = work / "server_requests.jsonl"
    server_log.unlink(missing_ok=True)
    step_log = work / "server_steps.jsonl"
    step_log.unlink(missing_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
    server_cmd = [sys.executable, "-m", "serve.server", "--model", args.model, "--port", str(port),
                  "--max-batch", str(args.max_batch), "--max-queue", str(4 * args.users),
                  "--max-seq-len", str(args.max_seq_len), "--prefix-cache-mb", str(args.prefix_cache_mb),
                  "--request-log", str(server_log), "--step-log", str(step_log)]
    if args.prefill_chunk:
        server_cmd += ["--prefill-chunk", str(args.prefill_chunk)]
    if args.prefill_budget:
        server_cmd += ["--prefill-budget", str(args.prefill_budget)]
    if args.prefill_step_ms is not None:
        server_cmd += ["--prefill-step-ms", str(args.prefill_step_ms)]
    if args.overtake_tokens is not None:
        server_cmd += ["--overtake-tokens", str(args.overtake_tokens)]
    server = subprocess.Popen(server_cmd, env=env, cwd=REPO, stdout=open(work / "server.log", "w"),
                              stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, server)
        watch = RssWatch(server.pid, url=url)
        watch.start()
        locust_cmd = ["locust", "-f", str(REPO / "bench" / "locustfile.py"), "--headless", "-u", str(args.users),
                      "-r", f"{args.spawn_rate:g}", "-t", f"{int(seconds)}s", "--host", url, "--csv", str(work / "locust"),
                      "--only-summary", "--stop-timeout", "30", "--exit-code-on-error", "0"]
        t0 = time.perf_counter()
        server_cpu0 = cpu_seconds(server.pid)
        children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        lenv = {**os.environ, "SERVE_MIX_LOG": str(log), "OMP_NUM_THREADS": "1"}
        subprocess.run(locust_cmd, env=lenv, cwd=REPO, stdout=open(work / "locust.log", "w"), stderr=subprocess.STDOUT,
                       check=False)
        elapsed = time.perf_counter() - t0
        children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        server_cpu1 = cpu_seconds(server.pid)
        watch.stop()
        gc_stats = scrape(url, ("hd_serve_gc_full_collection_seconds_count", "hd_serve_gc_full_collection_seconds_sum",
                                "hd_serve_overtakes"))
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    entries = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    out = summarize(entries, elapsed)
    served = [json.loads(line) for line in server_log.read_text().splitlines()] if server_log.exists() else []
    forwards = [json.loads(line) for line in step_log.read_text().splitlines()] if step_log.exists() else []
    out["ttft_split"] = ttft_split(entries, served, forwards=forwards)
    out["server_full_gc"] = {"collections": int(gc_stats.get("hd_serve_gc_full_collection_seconds_count", -1)),
                             "seconds": round(gc_stats.get("hd_serve_gc_full_collection_seconds_sum", float("nan")), 4)}
    out["overtakes"] = int(gc_stats.get("hd_serve_overtakes", -1))
    rss = watch.samples
    out["rss_start_mb"] = round(rss[0][1] / 2**20, 1) if rss else None
    out["rss_peak_mb"] = round(max(r for _, r in rss) / 2**20, 1) if rss else None
    out["rss_end_mb"] = round(rss[-1][1] / 2**20, 1) if rss else None
    if args.soak and rss:
        after = [r for t, r in rss if t >= warmup] or [rss[-1][1]]
        out["soak_seconds"], out["warmup_seconds"] = round(elapsed, 1), round(warmup, 1)
        out["rss_after_warmup_mb"] = round(after[0] / 2**20, 1)
        out["rss_growth_after_warmup"] = round(after[-1] / after[0] - 1, 4)
        out.update(soak_net_of_prefix_cache(rss, watch.cache, warmup))
    # Cores each side kept busy on average: the client shares the server's cores, so its share is time
    # the server's torch threads could not run (a parallel region waits for its slowest thread).
    client_cpu = (children1.ru_utime + children1.ru_stime) - (children0.ru_utime + children0.ru_stime)
    out["client_cores"] = round(client_cpu / elapsed, 3) if elapsed else None
    out["server_cores"] = (round((server_cpu1 - server_cpu0) / elapsed, 3)
                           if elapsed and server_cpu0 is not None and server_cpu1 is not None else None)
    out.update(users=args.users, spawn_rate=args.spawn_rate, seconds=round(elapsed, 1), threads=args.threads, model=args.model,
               max_batch=args.max_batch, prefill_step_ms=args.prefill_step_ms, logs=str(work))
    short_p95 = out["classes"]["short"]["ttft_p95_ms"]
    out["targets"] = {"short_ttft_p95_le_150ms": short_p95 is not None and short_p95 <= 150,
                      "zero_errors": out["errors"] == 0, "events_equal_tokens": out["events_equal_tokens"]}
    if args.soak:
        out["targets"]["rss_growth_le_5pct"] = out.get("rss_growth_after_warmup", 1) <= 0.05

    print(f"{args.users} users, {elapsed:.0f} s, {out['requests']} requests, {out['tokens']} tokens "
          f"({out['tokens_per_s']} tokens/s), errors {out['errors']} ({out['error_rate']:.2%}), "
          f"events == tokens: {out['events_equal_tokens']}")
    print(f"{'class':<8}{'n':>5}{'TTFT p50':>10}{'p95':>8}{'p99':>8}{'ITL p50':>9}{'p95':>8}{'p99':>8}  (ms)")
    for c in CLASSES:
        s = out["classes"][c]
        cols = [s[k] for k in ("ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p95_ms", "itl_p99_ms")]
        print(f"{c:<8}{s['requests']:>5}" + "".join(f"{'-' if v is None else f'{v:.0f}':>{w}}"
                                                     for v, w in zip(cols, (10, 8, 8, 9, 8, 8))))
    split = out["ttft_split"]
    print("where the time to first token goes (ms, P50 / P95; server = handler start to first event handed to HTTP):")
    print(f"{'class':<8}{'n':>4}" + "".join(f"{n:>14}" for n in ("tokenize", "wait", "prefill", "hand_off", "server",
                                                                   "client_rest")))
    for c in CLASSES:
        s = split["classes"][c]
        cells = [f"{_fmt(s[f'{n}_p50_ms'])} / {_fmt(s[f'{n}_p95_ms'])}"
                 for n in ("tokenize", "wait", "prefill", "hand_off", "server", "client_rest")]
        print(f"{c:<8}{s['joined']:>4}" + "".join(f"{x:>14}" for x in cells))
    print(f"CPU cores busy on average: server {out['server_cores']}, load generator (locust) {out['client_cores']}")
    print(f"server full GC collections: {out['server_full_gc']['collections']} "
          f"({out['server_full_gc']['seconds'] * 1000:.0f} ms in all); prompts that overtook a forward in flight: "
          f"{out['overtakes']}")
    for x in split["slow_short"]:
        print(f"  slow short: TTFT {x['ttft_ms']:.0f} ms = tokenize {x['tokenize']:.0f} + wait {x['wait']:.0f} + prefill "
              f"{x['prefill']:.0f} ({x['prompt_tokens']} tokens, {x['cached_tokens']} cached) + hand-off "
              f"{x['hand_off']:.0f} + client {x['client_rest']:.0f}"
              + (f"; its wait overlapped decode {x['wait_decode']:.0f}, other prompts' prefill {x['wait_prefill']:.0f} "
                 f"({x['wait_prefill_tokens']} tokens), neither {x['wait_other']:.0f}" if "wait_decode" in x else ""))
    (work / "rss.csv").write_text("seconds,rss_bytes\n" + "".join(f"{t:.1f},{r}\n" for t, r in rss))
    (work / "prefix_cache.csv").write_text("seconds,bytes\n" + "".join(f"{t:.1f},{b}\n" for t, b in watch.cache))
    print(f"server RSS MB: start {out['rss_start_mb']}, peak {out['rss_peak_mb']}, end {out['rss_end_mb']}"
          + (f"; after warm-up {out['rss_after_warmup_mb']} -> growth {out['rss_growth_after_warmup']:.2%}"
             if args.soak and rss else ""))
    if "prefix_cache_end_mb" in out:
        print(f"prefix cache MB: after warm-up {out['prefix_cache_after_warmup_mb']}, end {out['prefix_cache_end_mb']} "
              f"(budget {args.prefix_cache_mb}); RSS growth after warm-up net of it: "
              f"{out['rss_growth_after_warmup_net_of_prefix_cache']:.2%}")
    print(json_line(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
