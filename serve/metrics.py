"""Prometheus text-format metrics (counters, gauges, histograms) without a client library dependency."""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cum = 0
        for b, c in zip(self.buckets, self.counts):
            cum += c
            lines.append(f'{self.name}_bucket{{le="{b}"}} {cum}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines += [f"{self.name}_sum {self.sum}", f"{self.name}_count {self.count}"]
        return lines


class Metrics:
    """Serving metrics; ``gauges`` are read at scrape time from callables."""

    COUNTERS = {
        "requests_total": "Requests received on the generation endpoints.",
        "request_errors_total": "Requests answered with an error status (4xx/5xx) or failed mid-stream.",
        "requests_rejected_total": "Requests refused with 503 because the queue was full.",
        "prompt_tokens_total": "Prompt tokens of admitted requests.",
        "generated_tokens_total": "Tokens generated.",
    }

    def __init__(self, prefix: str = "hd_serve_") -> None:
        self.prefix = prefix
        self._lock = threading.Lock()
        self.counters = dict.fromkeys(self.COUNTERS, 0)
        self.ttft = Histogram(prefix + "time_to_first_token_seconds", "Arrival to first generated token.")
        self.tpot = Histogram(prefix + "inter_token_latency_seconds", "Time between consecutive tokens.")
        self.gc_pause = Histogram(prefix + "gc_full_collection_seconds",
                                  "Full (generation 2) Python garbage collections: each stops every Python thread.")
        self._gc_started: float | None = None
        self.gauges: dict[str, tuple[str, Callable[[], float]]] = {}

    def inc(self, name: str, by: int = 1) -> None:
        with self._lock:
            self.counters[name] += by

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def observe_token_latency(self, seconds: float) -> None:
        with self._lock:
            self.tpot.observe(seconds)

    def watch_gc(self) -> None:
        """Time full garbage collections into ``gc_pause`` (a collector callback; :meth:`unwatch_gc` removes it).

        A full collection walks every tracked object under the GIL: with torch and transformers loaded
        that is ~400K objects and a few hundred ms in which no token is produced or sent. The server
        freezes what it loaded (``gc.freeze()``, :func:`serve.server.main`), so these should stay rare and short.
        """
        import gc

        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def unwatch_gc(self) -> None:
        import gc

        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            pause, self._gc_started = time.perf_counter() - self._gc_started, None
            with self._lock:
                self.gc_pause.observe(pause)

    def gauge(self, name: str, help: str, fn: Callable[[], float]) -> None:
        self.gauges[name] = (help, fn)

    def render(self) -> str:
        lines: list[str] = []
        with self._lock:
            for name, help in self.COUNTERS.items():
                full = self.prefix + name
                lines += [f"# HELP {full} {help}", f"# TYPE {full} counter", f"{full} {self.counters[name]}"]
            lines += self.ttft.render() + self.tpot.render() + self.gc_pause.render()
        for name, (help, fn) in self.gauges.items():
            full = self.prefix + name
            lines += [f"# HELP {full} {help}", f"# TYPE {full} gauge", f"{full} {float(fn())}"]
        return "\n".join(lines) + "\n"


class RequestLog:
    """One JSON line per finished request: where its time went (``--request-log FILE``).

    Times are milliseconds from the moment its handler started (the request head and body read):
    ``tokenized_ms`` (body checked and tokenized, handed to the engine), ``prefill_start_ms`` (its first
    prefill forward began: the wait for the step in flight and for earlier prompts), ``first_token_ms``
    (its first token sampled), ``first_sent_ms`` (that token's SSE event handed to the HTTP layer) and
    ``done_ms``; plus ``received_s`` (that start, ``time.perf_counter`` seconds: the step log's clock),
    ``engine_id`` (the engine's request id), ``id`` (the response id, also in every SSE chunk), ``prompt_tokens``,
    ``cached_tokens`` (restored from the prefix cache), ``completion_tokens``, ``finish_reason``. Written
    by the event loop after the response ends; appends, one lock, flushed per line.
    """

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the server
        self._lock = threading.Lock()

    def write(self, record: dict) -> None:
        import json

        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            self._file.write(line)

    def close(self) -> None:
        with self._lock:
            self._file.close()


class StepLog(RequestLog):
    """One JSON line per engine forward (``--step-log FILE``; :attr:`serve.engine.Engine.on_forward`):
    ``kind`` ("prefill" or "decode"), ``start_s`` / ``end_s`` (``time.perf_counter`` seconds, the clock of
    the request log's ``received_s``), ``tokens`` and ``requests`` (engine request ids, the request log's
    ``engine_id``). Joined with the request log, it says what ran while a request waited for its first
    forward. Written by the engine thread; a line costs a few microseconds."""

    def forward(self, kind: str, start_s: float, end_s: float, tokens: int, requests: list[int]) -> None:
        self.write({"kind": kind, "start_s": round(start_s, 6), "end_s": round(end_s, 6), "tokens": tokens,
                    "requests": requests})
