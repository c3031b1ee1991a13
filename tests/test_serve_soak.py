"""Mixed soak through the real CLI: 200 requests at concurrency 16, good and bad interleaved.

Every good request must equal its solo output (greedy, or seeded sampling), every bad one must get its
own 4xx, and the server's resident memory must stay within 10 % of what it was after a warm-up round.
The server runs as ``python -m serve.server`` in a subprocess on loopback, with the API key from the
environment and the default served model name (the directory's name).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from core.tiny import save_tiny

KEY = "soak-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 64 * 1024
C, CHAT = "/v1/completions", "/v1/chat/completions"
G = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}

# (path, body, streamed)
GOOD = [
    (C, {**G, "prompt": "the quick brown"}, False),
    (C, {**G, "prompt": "distill the teacher"}, False),
    (C, {**G, "prompt": [1, 5, 9, 33, 200]}, False),
    (C, {**G, "prompt": "héllo wörld", "stream": True}, True),
    (C, {**G, "prompt": "the lazy dog", "temperature": 0.8, "seed": 7}, False),
    (CHAT, {**G, "messages": [{"role": "user", "content": "jumps over"}]}, False),
    (CHAT, {**G, "messages": [{"role": "system", "content": "be brief"},
                              {"role": "user", "content": [{"type": "text", "text": "naïve café"}]}]}, False),
    (CHAT, {**G, "messages": [{"role": "user", "content": "fox"}], "stream": True}, True),
]

# (path, body or raw bytes, headers, status, error param, error code)
BAD = [
    (C, {**G, "prompt": "x", "seed": 2**64}, AUTH, 400, "seed", "invalid_value"),
    (C, {**G, "prompt": "x", "temperature": 1e-40}, AUTH, 400, "temperature", "invalid_value"),
    (C, {**G, "prompt": "x", "temperature": 1.0, "top_p": 1e-300}, AUTH, 400, "top_p", "invalid_value"),
    (C, {**G, "prompt": "x"}, {}, 401, None, "invalid_api_key"),
    (C, {**G, "prompt": "x", "model": "gpt-4o"}, AUTH, 404, "model", "model_not_found"),
    (C, {**G, "prompt": "x", "junk": "j" * (BODY_LIMIT + 1)}, AUTH, 413, None, "request_too_large"),
    (C, b'{"prompt": "x", ', AUTH, 400, None, "invalid_json"),
    (CHAT, {**G, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     AUTH, 400, "messages[0].content[0]", "unsupported"),
    (C, {**G, "prompt": "x", "max_tokens": 0}, AUTH, 400, "max_tokens", "invalid_value"),
    (C, {**G, "prompt": "x", "best_of": 3}, AUTH, 400, "best_of", "unsupported"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _send(client: httpx.Client, path: str, body, headers: dict, streamed: bool = False) -> tuple[int, object]:
    """(status, text or error body); a streamed answer is the concatenation of its deltas."""
    kw = {"content": body, "headers": {**headers, "content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body, "headers": headers}
    if streamed:
        text = []
        with client.stream("POST", path, **kw) as r:
            if r.status_code != 200:
                r.read()
                return r.status_code, r.json()
            for line in r.iter_lines():
                if line and line != "data: [DONE]":
                    choice = json.loads(line[len("data: "):])["choices"][0]
                    text.append(choice["delta"].get("content", "") if "delta" in choice else choice["text"])
        return 200, "".join(text)
    r = client.post(path, **kw)
    if r.status_code != 200:
        return r.status_code, r.json()
    choice = r.json()["choices"][0]
    return 200, choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.fixture(scope="module")
def cli_server(tmp_path_factory):
    model_dir = save_tiny(tmp_path_factory.mktemp("soak") / "tiny-soak", arch="qwen2")
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRID_DISTILL_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "serve.server", "--model", str(model_dir), "--port", str(port),
                             "--max-batch", "4", "--max-queue", "32", "--max-seq-len", "128",
                             "--max-body-bytes", str(BODY_LIMIT)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                httpx.get(url + "/health", timeout=5)
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.time() > deadline:
                    raise AssertionError(f"server did not start: {proc.stderr.read().decode()[-2000:]}") from None
                time.sleep(0.2)
        yield proc, url, model_dir
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_cli_names_the_directory_never_the_path(cli_server):
    _, url, model_dir = cli_server
    health = httpx.get(url + "/health").json()  # no key needed
    models = httpx.get(url + "/v1/models", headers=AUTH).json()
    answer = httpx.post(url + C, json={**G, "prompt": "a"}, headers=AUTH).json()
    assert health["model"] == models["data"][0]["id"] == answer["model"] == "tiny-soak"
    assert str(model_dir) not in json.dumps([health, models, answer])
    assert httpx.get(url + "/v1/models").status_code == 401


def test_mixed_soak_200_requests_at_concurrency_16(cli_server):
    proc, url, _ = cli_server
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    with httpx.Client(base_url=url, timeout=120, limits=limits) as client:
        solo = [_send(client, path, body, AUTH, streamed) for path, body, streamed in GOOD]
        assert all(status == 200 and text for status, text in solo), solo
        jobs = []
        for i in range(200):  # every third request is bad, cycling through the bad classes
            if i % 3 == 2:
                jobs.append(("bad", BAD[(i // 3) % len(BAD)]))
            else:
                jobs.append(("good", (i - i // 3) % len(GOOD)))

        def run(job):
            kind, spec = job
            if kind == "good":
                path, body, streamed = GOOD[spec]
                return _send(client, path, body, AUTH, streamed)
            path, body, headers, *_ = spec
            return _send(client, path, body, headers)

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(run, jobs[:48]))  # warm-up: cache rows, allocator pools, thread stacks
            rss_before = _rss_bytes(proc.pid)
            t0 = time.perf_counter()
            results = list(pool.map(run, jobs))
            elapsed = time.perf_counter() - t0
        rss_after = _rss_bytes(proc.pid)
        health = client.get("/health").json()
    for (kind, spec), (status, out) in zip(jobs, results):
        if kind == "good":
            assert (status, out) == solo[spec], (GOOD[spec], out)
        else:
            _, _, _, want_status, param, code = spec
            assert status == want_status, (spec, out)
            assert (out["error"]["param"], out["error"]["code"]) == (param, code)
    assert health["active"] == 0 and health["queued"] == 0
    assert rss_after <= 1.10 * rss_before, f"RSS grew {rss_before / 2**20:.1f} -> {rss_after / 2**20:.1f} MiB"
    print(f"soak: 200 requests in {elapsed:.1f} s; RSS {rss_before / 2**20:.1f} -> {rss_after / 2**20:.1f} MiB")
