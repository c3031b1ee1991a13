"""Prometheus text-format metrics (counters, gauges, histograms) without a client library dependency."""

from __future__ import annotations

import bisect
import threading
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

    def gauge(self, name: str, help: str, fn: Callable[[], float]) -> None:
        self.gauges[name] = (help, fn)

    def render(self) -> str:
        lines: list[str] = []
        with self._lock:
            for name, help in self.COUNTERS.items():
                full = self.prefix + name
                lines += [f"# HELP {full} {help}", f"# TYPE {full} counter", f"{full} {self.counters[name]}"]
            lines += self.ttft.render() + self.tpot.render()
        for name, (help, fn) in self.gauges.items():
            full = self.prefix + name
            lines += [f"# HELP {full} {help}", f"# TYPE {full} gauge", f"{full} {float(fn())}"]
        return "\n".join(lines) + "\n"
