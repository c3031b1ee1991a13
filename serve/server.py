"""OpenAI-compatible HTTP server over the continuous-batching engine.

    python -m serve.server --model DIR --host 127.0.0.1 --port 8000 [--max-batch 8] [--max-queue 32]

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``"stream": true`` gives server-sent
events: one event per generated token, a final event with ``finish_reason`` and ``usage``, then
``data: [DONE]``), ``GET /health``, ``GET /metrics`` (Prometheus text).

Why Starlette + uvicorn: the whole server is a handful of routes and one streaming response, so a thin
ASGI toolkit is enough; Starlette is the maintained core FastAPI itself is built on, its
``StreamingResponse`` watches for client disconnects (we stop that request's generation), and uvicorn is
the standard production ASGI server. The model runs in one background engine thread (torch releases the
GIL in its kernels); the event loop only parses requests and forwards token events, so a slow client
never stalls the batch. Each HTTP connection gets ``TCP_NODELAY`` so a small SSE event leaves at once
instead of waiting for Nagle's algorithm to batch it with the next.

Admission: at most ``max_batch`` requests decode together and ``max_queue`` more wait; beyond that the
server answers 503 at once rather than letting latency grow without bound.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import threading
import time
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from serve.engine import Engine, Request
from serve.metrics import Metrics
from serve.sampling import SamplingParams


class NoDelayH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with ``TCP_NODELAY`` set on every accepted connection."""

    def connection_made(self, transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)


class BadRequest(ValueError):
    """A client error: answered 400 with the message."""


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _get(body: dict[str, Any], key: str, types: type | tuple[type, ...], default: Any = None) -> Any:
    """A known field with a type check (``bool`` is not accepted as a number)."""
    if key not in body or body[key] is None:
        return default
    v = body[key]
    numeric = types in (int, float, (int, float))
    if (numeric and isinstance(v, bool)) or not isinstance(v, types):
        names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise BadRequest(f"'{key}' must be {names}, got {type(v).__name__}")
    return v


class AsyncEngine:
    """Bridges the engine thread and the event loop: bounded admission, per-request event queues, metrics."""

    def __init__(self, engine: Engine, max_queue: int = 32) -> None:
        self.engine = engine
        self.capacity = engine.max_batch + max_queue
        self.in_flight = 0
        self._lock = threading.Lock()
        self.metrics = Metrics()
        m = self.metrics
        m.gauge("active_requests", "Requests decoding now.", lambda: engine.num_active)
        m.gauge("queued_requests", "Requests waiting for a batch slot.", lambda: engine.num_waiting)
        m.gauge("kv_cache_bytes", "Bytes of preallocated KV cache.",
                lambda: engine.cache.nbytes() if engine.cache is not None else 0)
        m.gauge("kv_cache_rows_used_ratio", "Fraction of KV cache rows holding a live request.",
                lambda: engine.num_active / engine.max_batch)
        if engine.prefix_cache is not None:  # serve.prefix_cache: bytes / budget / hits / evictions
            for name, (help_, fn) in engine.prefix_cache.gauges().items():
                m.gauge(name, help_, fn)
        engine.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> tuple[Request, asyncio.Queue]:
        """Queue a request; raises ``OverflowError`` when the server is at capacity."""
        with self._lock:
            if self.in_flight >= self.capacity:
                raise OverflowError
            self.in_flight += 1
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        arrival = time.perf_counter()
        last = [arrival]
        metrics = self.metrics

        def on_event(delta: str, token: int | None, finish: str | None) -> None:
            # Runs on the engine thread: time-stamp here, then hand the event to the event loop.
            now = time.perf_counter()
            if token is not None:
                if last[0] == arrival:
                    metrics.observe_ttft(now - arrival)
                else:
                    metrics.observe_token_latency(now - last[0])
                last[0] = now
                metrics.inc("generated_tokens_total")
            else:
                with self._lock:
                    self.in_flight -= 1
                if finish == "error":
                    metrics.inc("request_errors_total")
            loop.call_soon_threadsafe(queue.put_nowait, (delta, token, finish))

        try:
            req = self.engine.submit(prompt_ids, params, on_event)
        except BaseException:
            with self._lock:
                self.in_flight -= 1
            raise
        self.metrics.inc("prompt_tokens_total", len(prompt_ids))
        return req, queue


def _sampling(body: dict[str, Any], n_prompt: int, max_seq_len: int, default_max: int | None) -> SamplingParams:
    room = max_seq_len - n_prompt
    if room < 1:
        raise BadRequest(f"the prompt has {n_prompt} tokens but the model context is {max_seq_len}; "
                         "shorten the prompt")
    max_tokens = _get(body, "max_completion_tokens", int, None)
    max_tokens = _get(body, "max_tokens", int, max_tokens)
    if max_tokens is None:
        max_tokens = min(default_max or room, room)
    if not 1 <= max_tokens <= room:
        raise BadRequest(f"max_tokens must be in [1, {room}] for this prompt of {n_prompt} tokens "
                         f"(context {max_seq_len}), got {max_tokens}")
    temperature = float(_get(body, "temperature", (int, float), 1.0))
    if not 0 <= temperature <= 2:
        raise BadRequest(f"temperature must be in [0, 2], got {temperature}")
    top_p = float(_get(body, "top_p", (int, float), 1.0))
    if not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}")
    top_k = _get(body, "top_k", int, 0)
    if top_k < 0:
        raise BadRequest(f"top_k must be >= 0, got {top_k}")
    if _get(body, "n", int, 1) != 1:
        raise BadRequest("only n=1 is supported; send several requests instead")
    stop = _get(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > 4 or any(not isinstance(s, str) or not s for s in stop):
        raise BadRequest("'stop' must be a non-empty string or a list of at most 4 non-empty strings")
    return SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                          seed=_get(body, "seed", int, None), stop=tuple(stop),
                          ignore_eos=_get(body, "ignore_eos", bool, False))


def create_app(engine: Engine, *, max_queue: int = 32, model_name: str = "hybrid-distill") -> Starlette:
    """The ASGI app; starts the engine's background thread."""
    aengine = AsyncEngine(engine, max_queue=max_queue)

    async def parse(request: HTTPRequest) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"malformed JSON body: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        _get(body, "stream", bool, False)
        _get(body, "model", str, None)
        return body

    def completion_prompt(body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return engine.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                        for t in prompt):
            vocab = engine.model.config.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise BadRequest(f"prompt token ids must be in [0, {vocab})")
            return list(prompt)
        raise BadRequest("'prompt' must be a non-empty string or a list of token ids")

    def chat_prompt(body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list of {role, content} objects")
        for m in messages:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise BadRequest("each message needs a string 'role' and a string 'content'")
        return engine.encode([{"role": m["role"], "content": m["content"]} for m in messages], chat=True)

    async def generate(request: HTTPRequest, chat: bool) -> Response:
        aengine.metrics.inc("requests_total")
        try:
            body = await parse(request)
            prompt_ids = chat_prompt(body) if chat else completion_prompt(body)
            params = _sampling(body, len(prompt_ids), engine.max_seq_len, None if chat else 16)
            req, queue = aengine.submit(prompt_ids, params)
        except BadRequest as e:
            aengine.metrics.inc("request_errors_total")
            return _error(400, str(e))
        except ValueError as e:  # the engine's own limits
            aengine.metrics.inc("request_errors_total")
            return _error(400, str(e))
        except OverflowError:
            aengine.metrics.inc("request_errors_total")
            aengine.metrics.inc("requests_rejected_total")
            return _error(503, f"server at capacity ({aengine.capacity} requests in flight); retry later",
                          "server_busy")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        def usage() -> dict[str, int]:
            n = len(req.out_ids)
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n}

        def choice(text: str, finish: str | None, first: bool = False) -> dict[str, Any]:
            if chat:
                delta: dict[str, str] = {"content": text}
                if first:
                    delta["role"] = "assistant"
                return {"index": 0, "delta": delta, "finish_reason": finish}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

        if body.get("stream"):
            async def events():
                first = True
                try:
                    while True:
                        delta, token, finish = await queue.get()
                        chunk = {"id": rid, "object": obj + (".chunk" if chat else ""), "created": created,
                                 "model": model_name, "choices": [choice(delta, finish, first)]}
                        first = False
                        if finish is not None:
                            chunk["usage"] = usage()
                            yield f"data: {json.dumps(chunk)}\n\n"
                            yield "data: [DONE]\n\n"
                            return
                        yield f"data: {json.dumps(chunk)}\n\n"
                finally:
                    if not req.done:  # the client went away: stop generating for it
                        engine.cancel(req)

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        parts: list[str] = []
        while True:
            try:
                delta, _token, finish = await asyncio.wait_for(queue.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    engine.cancel(req)
                    return Response(status_code=499)
                continue
            parts.append(delta)
            if finish is not None:
                break
        if finish == "error":
            return _error(500, "generation failed; see the server log", "server_error")
        text = "".join(parts)
        msg = {"message": {"role": "assistant", "content": text}} if chat else {"text": text, "logprobs": None}
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": model_name,
                             "choices": [{"index": 0, **msg, "finish_reason": finish}], "usage": usage()})

    async def completions(request: HTTPRequest) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: HTTPRequest) -> Response:
        return await generate(request, chat=True)

    async def health(_: HTTPRequest) -> Response:
        return JSONResponse({"status": "ok", "model": model_name, "hybrid": engine.spec is not None,
                             "active": engine.num_active, "queued": engine.num_waiting})

    async def metrics(_: HTTPRequest) -> Response:
        return PlainTextResponse(aengine.metrics.render(), media_type="text/plain; version=0.0.4")

    async def models(_: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model"}]})

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        engine.stop()

    app = Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ], lifespan=lifespan)
    app.state.engine = aengine
    return app


class ServerThread:
    """uvicorn on a free loopback port in a daemon thread (tests and benchmarks)."""

    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(app, http=NoDelayH11Protocol, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start within 30 s")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serve.server", description="OpenAI-compatible server.")
    p.add_argument("--model", required=True, help="HF model directory (or smollm2-135m-instruct)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together")
    p.add_argument("--max-queue", type=int, default=32, help="requests waiting beyond the batch before 503")
    p.add_argument("--max-seq-len", type=int, default=None, help="context limit (default: the model's)")
    p.add_argument("--device", default=None)
    p.add_argument("--prefix-cache-mb", type=float, default=256, help="prompt-prefix KV cache budget (0: off)")
    p.add_argument("--prefill-budget", type=int, default=None,
                   help="prompt tokens prefilled per engine step, between decode steps (default: 512)")
    p.add_argument("--name", default=None, help="model name reported in responses")
    args = p.parse_args(argv)
    import uvicorn

    from distill.pretrained import resolve_model_path

    try:
        path = resolve_model_path(args.model)
        engine = Engine(path, device=args.device, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                        prefix_cache_bytes=int(args.prefix_cache_mb * 2**20), prefill_budget=args.prefill_budget)
    except (ValueError, OSError) as e:
        print(f"error: {e}")
        return 2
    app = create_app(engine, max_queue=args.max_queue, model_name=args.name or args.model)
    uvicorn.run(app, host=args.host, port=args.port, http=NoDelayH11Protocol, log_level="info")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
