"""The Starlette app: OpenAI-compatible routes over one Engine.

    POST /v1/chat/completions   stream (SSE chunks, `data: [DONE]`) or one JSON completion
    GET  /v1/models             the one model served (GET /v1/models/{id}: that model, or 404)
    GET  /v1/stats              requests, KV reuse, expert cache, memory plan, tok/s
    GET  /health                liveness (never needs the API key)

A completion request's body is read up to `max_body_bytes` (413 beyond), validated
(app.server.request), given the server's system prompt if it has none, its prompt length checked
against the context, then queued on the worker (app.server.worker); 429 with Retry-After when the
queue is full, 503 once the server is shutting down. While a streamed request waits or
prefills, an SSE comment (`: keep-alive`) goes out every `keepalive_s` seconds. A client that
disconnects cancels its job. Errors are OpenAI-style JSON bodies (app.server.errors).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import time
import uuid
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from app.server.errors import ApiError, bad_request, error_body
from app.heap_trim import heap_trimmer
from app.server.pool import SessionPool
from app.server.request import ChatRequest, parse_chat_request
from app.server.worker import SHUTTING_DOWN, Delta, Failed, Finished, Job, Started, Worker
from engine.sampling import SamplingParams


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP layer needs besides the engine."""

    api_key: str | None = None
    max_queue: int = 8  # requests waiting behind the running one; more get 429
    max_sessions: int = 4  # conversations kept for KV reuse (0: no reuse)
    max_state_bytes: int | None = None  # bound on the pooled sessions' state bytes
    keepalive_s: float = 10.0  # SSE comment interval while a streamed request waits or prefills
    trim_heap: bool = True  # give freed heap pages back to the OS when the worker goes idle (app.heap_trim)
    defaults: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    system: str | None = None  # the system prompt of requests that send none (the app's `system` setting)
    max_body_bytes: int | None = None  # None: body_limit(the engine's max_seq_len)


def body_limit(max_seq_len: int) -> int:
    """The default cap on a request body: 1 MiB plus 16 bytes a token of context (a context's worth
    of JSON-escaped text, \\uXXXX for each CJK character, fits; a body far beyond it cannot)."""
    return (1 << 20) + 16 * max_seq_len


def _usage(stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.reused_tokens}}


def _jsonable(value):
    if dataclasses.is_dataclass(value):
        return {k: _jsonable(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


class Api:
    """Routes bound to one engine, its session pool and its worker."""

    def __init__(self, engine, config: ServerConfig) -> None:
        self.engine, self.config = engine, config
        self.pool = SessionPool(engine, config.max_sessions, config.max_state_bytes)
        self.worker = Worker(engine, self.pool, config.max_queue,
                             on_idle=heap_trimmer() if config.trim_heap else None)
        self.model_id = engine.info["model"]
        self.created = int(time.time())
        self.max_body = config.max_body_bytes or body_limit(engine.config.max_seq_len)

    # ---------------------------------------------------------------- plumbing
    def _authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                                "with the key the server was started with (--api-key)",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _body(self, request: Request) -> bytes:
        """The request body, or a 413 as soon as it is known to exceed `max_body` bytes."""
        too_large = ApiError(413, f"the request body is over {self.max_body:,} bytes, more than the context of "
                                  f"{self.engine.config.max_seq_len:,} tokens can hold; shorten the conversation",
                             code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def _check_context(self, req: ChatRequest) -> None:
        over = self.engine.context_overflow(req.conversation(), req.params.thinking)  # the turn's own rule
        if over is not None:
            raise bad_request(f"the prompt is {over.prompt_tokens} tokens, over the context limit of {over.limit} "
                              "tokens; shorten the conversation (or restart the server with a larger max_seq_len)",
                              param="messages", code="context_length_exceeded")

    def _chunk(self, cid: str, created: int, delta: dict, finish: str | None = None) -> str:
        body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_id,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    # ---------------------------------------------------------------- routes
    async def health(self, request: Request) -> JSONResponse:
        w = self.worker.stats()
        return JSONResponse({"status": "ok" if self.worker.alive else "stopped", "model": self.model_id,
                             "busy": w["busy"], "queued": w["queued"]},
                            status_code=200 if self.worker.alive else 503)

    def _model(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "dsv4-chat"}

    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._model()]})

    async def model(self, request: Request) -> JSONResponse:
        self._authorize(request)
        name = request.path_params["model"]
        if name != self.model_id:
            raise ApiError(404, f"the model {name!r} is not served here; this server serves {self.model_id!r}",
                           param="model", code="model_not_found")
        return JSONResponse(self._model())

    async def stats(self, request: Request) -> JSONResponse:
        self._authorize(request)
        w = self.worker.stats()
        step = w.pop("last_step")
        info = self.engine.info
        body = {"model": self.model_id, "engine": info, "requests": w, "sessions": self.pool.stats()}
        if step is not None:
            body["expert_cache"] = _jsonable(step.cache)
            body["memory"] = {"unified": step.memory.unified, "total": step.memory.total,
                              "parts": dict(step.memory.parts), "page_cache": step.memory.page_cache}
            body["tok_per_s"] = round(step.tok_per_s, 2)
            body["ttft_s"] = step.ttft_s
        return JSONResponse(body)

    async def chat(self, request: Request):
        self._authorize(request)
        req = parse_chat_request(await self._body(request), self.config.defaults)
        if req.system is None and self.config.system:
            req = dataclasses.replace(req, system=self.config.system)
        await run_in_threadpool(self._check_context, req)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(item) -> None:  # called on the worker thread
            with contextlib.suppress(RuntimeError):  # the loop is gone (server shutting down)
                loop.call_soon_threadsafe(events.put_nowait, item)

        job = Job(req, emit)
        if not self.worker.submit(job):
            if self.worker.stopping:
                raise ApiError(503, SHUTTING_DOWN, type="server_error", code="shutting_down")
            wait = self.worker.retry_after()
            raise ApiError(429, f"the server is busy: one request runs and {self.config.max_queue} may wait "
                                f"behind it; retry after {wait} s", type="rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": str(wait)})
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            return StreamingResponse(self._stream(job, events, req, cid, created), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._complete(request, job, events, req, cid, created)

    async def _stream(self, job: Job, events: asyncio.Queue, req: ChatRequest, cid: str, created: int):
        try:
            while True:
                try:
                    item = await asyncio.wait_for(events.get(), self.config.keepalive_s)
                except asyncio.TimeoutError:
                    yield ": keep-alive\n\n"
                    continue
                if isinstance(item, Started):
                    yield self._chunk(cid, created, {"role": "assistant", "content": ""})
                elif isinstance(item, Delta):
                    delta = {"reasoning_content": item.reasoning} if item.reasoning else {"content": item.content}
                    yield self._chunk(cid, created, delta)
                elif isinstance(item, Finished):
                    yield self._chunk(cid, created, {}, item.finish_reason)
                    if req.include_usage:
                        body = {"id": cid, "object": "chat.completion.chunk", "created": created,
                                "model": self.model_id, "choices": [], "usage": _usage(item.stats)}
                        yield f"data: {json.dumps(body)}\n\n"
                    break
                elif isinstance(item, Failed):
                    yield f"data: {json.dumps(error_body(item.message, 'server_error'))}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel.set()  # a disconnected client cancels; after the end this changes nothing

    async def _complete(self, request: Request, job: Job, events: asyncio.Queue, req: ChatRequest, cid: str,
                        created: int) -> JSONResponse:
        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            job.cancel.set()

        watcher = asyncio.create_task(watch())
        try:
            while True:
                item = await events.get()
                if isinstance(item, Finished):
                    break
                if isinstance(item, Failed):
                    raise ApiError(item.status, item.message, type="server_error")
        finally:
            watcher.cancel()
            job.cancel.set()
        if item.finish_reason == "cancelled" and self.worker.stopping:  # cut by the shutdown, not the client
            raise ApiError(503, SHUTTING_DOWN, type="server_error", code="shutting_down")
        message = {"role": "assistant", "content": item.content}
        if req.params.thinking:
            message["reasoning_content"] = item.reasoning
        return JSONResponse({"id": cid, "object": "chat.completion", "created": created, "model": self.model_id,
                             "choices": [{"index": 0, "message": message, "logprobs": None,
                                          "finish_reason": item.finish_reason}],
                             "usage": _usage(item.stats)})


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}", code=code),
                        status_code=exc.status_code, headers=exc.headers)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), status_code=500)


def build_app(engine, config: ServerConfig) -> Starlette:
    """The ASGI app; its lifespan starts the worker thread and stops it (the engine stays open)."""
    api = Api(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        api.worker.start()
        try:
            yield
        finally:
            await run_in_threadpool(api.worker.stop)

    app = Starlette(routes=[
        Route("/health", api.health, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/v1/stats", api.stats, methods=["GET"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
    ], exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error},
        lifespan=lifespan)
    app.state.api = api
    return app
