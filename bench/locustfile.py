"""Mixed chat traffic for locust against ``python -m serve.server`` (streaming, the classic user profile).

    python -m serve.server --model smollm2-135m-instruct --port 8000 &
    locust -f bench/locustfile.py --headless -u 4 -r 4 -t 2m --host http://127.0.0.1:8000

Each simulated user pauses 0.5-3 s between requests and picks, by weight:

* 30 % **short**: a question under 100 words, ``max_tokens`` 64;
* 50 % **medium**: 100-500 words of context and a question, ``max_tokens`` 256;
* 20 % **long**: 500-1500 words and a question, ``max_tokens`` 2048.

All go to ``/v1/chat/completions`` with ``"stream": true`` behind one shared system prompt (as a chat
deployment sends). Per request it records the time to the first token event, every gap between token
events, the token events against ``usage.completion_tokens`` and the ``[DONE]`` terminator. Locust's own
table then shows, per class, ``TTFT`` and ``ITL`` (inter-token latency) rows next to the whole requests;
a stream that breaks or miscounts is a failure. With ``SERVE_MIX_LOG=FILE`` every request is also
appended as one JSON line, with the response id (``bench/serve_mix.py`` reads it for exact percentiles and
joins it with the server's ``--request-log``).

locust is an optional bench dependency: ``pip install 'hybrid-distill[bench]'``.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time

try:
    from locust import HttpUser, between, task
except ImportError:  # run by hand without locust: say what to install instead of a traceback
    if __name__ == "__main__":
        raise SystemExit("locust is not installed; pip install 'hybrid-distill[bench]' (or pip install locust)")  # noqa: B904
    raise

SYSTEM = ("You are a helpful assistant for a small engineering team. Answer precisely and briefly, say when "
          "you are unsure, and prefer concrete examples over general advice.")
WORDS = ("the model cache token prompt server memory latency window layer student teacher distill attention "
         "batch stream request engine weight export gate score sample decode prefill queue user answer "
         "question system river mountain city garden music paper window light table history language "
         "number simple small large early later quickly slowly because before after while during").split()
CLASSES = {"short": ((5, 99), 64), "medium": ((100, 500), 256), "long": ((500, 1500), 2048)}
_log_lock = threading.Lock()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_prompt(rng: random.Random, cls: str) -> tuple[str, int]:
    """A user message of the class's word count (the question included) and its ``max_tokens``."""
    (lo, hi), max_tokens = CLASSES[cls]
    n = rng.randint(lo, hi)
    question = "Question: what is the main point of the text above, in two sentences?"
    body = words(rng, max(0, n - len(question.split())))
    return f"{body}\n\n{question}" if body else question, max_tokens


def record(entry: dict) -> None:
    path = os.environ.get("SERVE_MIX_LOG")
    if path:
        with _log_lock, open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


class ChatUser(HttpUser):
    wait_time = between(0.5, 3.0)

    def on_start(self) -> None:
        self.rng = random.Random(hash((id(self), time.time())))

    def _chat(self, cls: str) -> None:
        content, max_tokens = make_prompt(self.rng, cls)
        body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}],
                "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
                "temperature": 0.7, "seed": self.rng.randrange(2**31)}
        entry = {"class": cls, "words": len(content.split()), "max_tokens": max_tokens, "start": time.time()}
        events_hook = self.environment.events.request

        def fire(kind: str, name: str, seconds: float) -> None:
            # As each token arrives: firing a long stream's 2,000 gaps at its end would stall this process's
            # event loop for tens of ms, and with it the other users' clocks (their TTFT would read late).
            events_hook.fire(request_type=kind, name=name, response_time=seconds * 1000, response_length=0,
                             exception=None, context={})

        t0 = time.perf_counter()
        last = None
        ttft, gaps, events, usage, done, error, rid = None, [], 0, None, False, None, None
        with self.client.post("/v1/chat/completions", json=body, stream=True, catch_response=True,
                              name=cls) as r:
            try:
                if r.status_code != 200:
                    error = f"HTTP {r.status_code}"
                else:
                    for raw in r.iter_lines():
                        if not raw:
                            continue
                        data = raw.decode() if isinstance(raw, bytes) else raw
                        data = data.removeprefix("data: ")
                        if data == "[DONE]":
                            done = True
                            break
                        chunk = json.loads(data)
                        if "error" in chunk:  # the server ended the stream with an error event (e.g. its timeout)
                            err = chunk["error"]
                            error = f"error event: {err.get('code') or err.get('type')}: {err.get('message', '')[:120]}"
                            break
                        now = time.perf_counter()
                        rid = rid or chunk.get("id")
                        if not chunk["choices"]:  # stream_options.include_usage: the last chunk before [DONE]
                            usage = chunk.get("usage")
                        elif chunk["choices"][0]["finish_reason"] is None:
                            events += 1
                            if ttft is None:
                                ttft = now - t0
                                fire("TTFT", cls, ttft)
                            else:
                                gaps.append(now - last)
                                fire("ITL", cls, gaps[-1])
                            last = now
                if error is None and not done:
                    error = "stream ended without [DONE]"
                elif error is None and (usage is None or usage["completion_tokens"] != events):
                    error = f"{events} token events but usage says {usage and usage['completion_tokens']}"
            except Exception as e:  # a broken stream is a failed request, the user goes on
                error = f"{type(e).__name__}: {e}"
            if error:
                r.failure(error)
            else:
                r.success()
        entry.update(id=rid, http_status=r.status_code, ttft=ttft, gaps=gaps, events=events, usage_tokens=usage and usage["completion_tokens"],
                     done=done, error=error, seconds=time.perf_counter() - t0)
        record(entry)

    @task(3)
    def short(self) -> None:
        self._chat("short")

    @task(5)
    def medium(self) -> None:
        self._chat("medium")

    @task(2)
    def long(self) -> None:
        self._chat("long")
