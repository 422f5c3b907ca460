"""The HTTP routes: /v1/completions, /v1/chat/completions (the tokenizer's chat template),
/v1/models, /health, /metrics. Bodies are checked before anything is queued (HTTP 400 naming
the field, 415 for a body that is not JSON, 429 when the queue is full); every error, whatever
its status, is an OpenAI error object; generations stream as server-sent events in OpenAI's
chunk format; a client that goes away, streamed or not, frees its slot."""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
from typing import Any

import anyio
import jinja2
import pydantic
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from jetspec_jax.serve import MAX_BODY_BYTES, protocol
from jetspec_jax.serve.engine import Engine, QueueFull, Request
from jetspec_jax.io.tokenizer import TokenizerError


class BadRequest(Exception):
    """Any error answer: its status, the field it names (param) and its message."""

    def __init__(self, param: str | None, message: str, status: int = 400,
                 headers: dict | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.message, self.status, self.headers = param, message, status, headers
        self.code = code


class Text:
    """A request's text so far from all its tokens (decoding them whole keeps the tokenizer's
    spacing); a trailing U+FFFD (a character cut between tokens) and a tail that may begin a
    stop string are held back until the next tokens settle them."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = 0

    def add(self, ids: list[int], final: bool) -> tuple[str, bool]:
        """-> (new text, whether a stop string ended it)."""
        self.ids += ids
        if self.tokenizer is None:
            return "", False
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s, max(0, self.sent - len(s))) for s in self.stops)
                if i >= 0]
        stopped = bool(hits)
        if stopped:
            text, final = text[:min(hits)], True
        if not final:
            text = text.rstrip("\ufffd")
            text = text[:len(text) - self._held(text)]
        new = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return new, stopped

    def _held(self, text: str) -> int:
        """Length of the longest tail of text that is a proper prefix of a stop string (no
        longer than text: a long stop string costs what the text does)."""
        return max((n for s in self.stops for n in range(1, min(len(s), len(text) + 1))
                    if text.endswith(s[:n])), default=0)


def create_app(engine: Engine, model_name: str, *, max_body_bytes: int = MAX_BODY_BYTES,
               api_key: str | None = None,
               chat_template_kwargs: dict[str, Any] | None = None) -> FastAPI:
    """The routes over `engine`; request bodies past `max_body_bytes` are refused (413); with
    `api_key`, the /v1 routes answer only `Authorization: Bearer <api_key>` (else 401), while
    /health and /metrics stay open to probes; `chat_template_kwargs`: the chat template's
    variables for requests that do not set them (e.g. {"enable_thinking": False})."""
    app = FastAPI(title="JetSpec", docs_url=None, redoc_url=None)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_bearer(api_key))] if api_key else [])
    tokenizer = engine.target.tokenizer

    _answer_errors(app)

    @app.get("/health")
    async def health():
        alive = engine.thread is not None and engine.thread.is_alive()
        return JSONResponse({"status": "ok" if alive else "stopped"}, 200 if alive else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.metrics.text(), media_type="text/plain; version=0.0.4")

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [dict(id=model_name, object="model", created=0,
                                                owned_by="jetspec")]}

    @v1.post("/completions")
    async def completions(http: HTTPRequest):
        body, ids = await _prepare(http, completion_prompt)
        return await _generate(http, body, ids, body.max_tokens, chat=False, field="prompt")

    @v1.post("/chat/completions")
    async def chat(http: HTTPRequest):
        body, ids = await _prepare(http, chat_prompt)
        limit = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await _generate(http, body, ids,
                               max_tokens or max(1, engine.max_len - len(ids)), chat=True,
                               field="messages", limit=limit)

    async def _prepare(http: HTTPRequest, prompt):
        """-> (body, prompt ids): the body read within the size limit, then parsed, checked
        and tokenized by `prompt` in a worker thread, so large bodies stall no other client."""
        raw = await _read(http, max_body_bytes)
        return await anyio.to_thread.run_sync(prompt, raw)

    def completion_prompt(raw: bytes) -> tuple[protocol.CompletionRequest, list[int]]:
        body = _parse(raw, protocol.CompletionRequest)
        _check_model(body.model)
        if not isinstance(body.prompt, str):
            return body, [int(t) for t in body.prompt]
        if tokenizer is None:
            raise BadRequest("prompt", "prompt: this model has no tokenizer; pass token ids")
        return body, tokenizer.encode(body.prompt)

    def chat_prompt(raw: bytes) -> tuple[protocol.ChatRequest, list[int]]:
        body = _parse(raw, protocol.ChatRequest)
        _check_model(body.model)
        if tokenizer is None or not tokenizer.chat_template:
            raise BadRequest("messages", "messages: this model's tokenizer has no chat "
                             "template; use /v1/completions")
        try:
            return body, tokenizer.apply_chat_template(
                [m.model_dump() for m in body.messages],
                **{**(chat_template_kwargs or {}), **body.chat_template_kwargs})
        except (TokenizerError, jinja2.TemplateError) as e:
            raise BadRequest("messages", f"messages: {e}") from None

    def _check_model(name: str) -> None:
        if name != model_name:
            raise BadRequest("model", f"model: unknown model {name!r}; this server serves "
                             f"{model_name!r}")

    async def _generate(http: HTTPRequest, body: protocol.Sampling, ids: list[int],
                        max_tokens: int, *, chat: bool, field: str, limit: str = "max_tokens"):
        try:
            engine.check(ids, max_tokens, field, limit, body.top_k)
        except ValueError as e:
            raise BadRequest(*e.args) from None
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        request = Request(ids, max_tokens,
                          lambda *e: loop.call_soon_threadsafe(events.put_nowait, e),
                          temperature=body.temperature, top_k=max(body.top_k, 0),
                          top_p=body.top_p, seed=body.seed)
        try:
            engine.submit(request)
        except QueueFull as e:
            raise BadRequest(None, f"server busy: {e}; retry later", 429) from None
        rid = protocol.new_id("chatcmpl" if chat else "cmpl")
        text = Text(tokenizer, body.stops)
        pieces = _pieces(request, events, text)
        if body.stream:
            return StreamingResponse(_sse(rid, body, chat, len(ids), request, pieces),
                                     media_type="text/event-stream")
        parts, finish = [], None
        watch = asyncio.create_task(_cancel_when_gone(http, request))
        try:
            async for delta, _, finish in pieces:
                parts.append(delta)
        except RuntimeError as e:
            return _error(BadRequest(None, str(e), 500))
        finally:
            request.cancel()
            watch.cancel()
        token_ids = text.ids if body.return_token_ids else None
        return protocol.completion(rid, model_name, chat, "".join(parts), finish,
                                   _usage(len(ids), len(text.ids), request), token_ids)

    async def _sse(rid, body, chat, prompt_len, request, pieces):
        def event(obj) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        ids = body.return_token_ids
        try:
            if chat:
                yield event(protocol.chunk(rid, model_name, True, "", None, role=True))
            count = 0
            async for delta, new, finish in pieces:
                count += len(new)
                if delta or finish or (ids and new):
                    yield event(protocol.chunk(rid, model_name, chat, delta, finish,
                                               token_ids=new if ids else None))
            yield event(protocol.chunk(rid, model_name, chat, None, None,
                                       used=_usage(prompt_len, count, request)))
        except RuntimeError as e:
            yield event(protocol.error(str(e), kind="server_error"))
        finally:
            request.cancel()  # no-op when finished; frees the slot of a client that left
        yield "data: [DONE]\n\n"

    app.include_router(v1)
    return app


def _bearer(api_key: str):
    """A dependency that refuses (401) a request without `Authorization: Bearer <api_key>`;
    the key is compared in constant time."""
    expected = api_key.encode()

    async def check(http: HTTPRequest) -> None:
        scheme, _, given = http.headers.get("authorization", "").partition(" ")
        if not (scheme.lower() == "bearer"
                and hmac.compare_digest(given.strip().encode(), expected)):
            raise BadRequest(None, "a valid API key is required: send the header "
                             "'Authorization: Bearer <key>'", 401,
                             {"WWW-Authenticate": "Bearer"}, code="invalid_api_key")

    return check


def _usage(prompt: int, completion: int, request: Request) -> dict:
    return protocol.usage(prompt, completion, request.rounds, request.accepted)


async def _cancel_when_gone(http: HTTPRequest, request: Request) -> None:
    """Cancels `request` when its client disconnects (its body is read, so the next message is
    the disconnect): the engine frees its slot at the next round boundary, as for a stream."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    request.cancel()


async def _pieces(request: Request, events: asyncio.Queue, text: Text):
    """-> (new text, new token ids, finish reason or None) as the engine delivers them; a stop
    string ends the request. Raises RuntimeError when the engine failed it."""
    while True:
        ids, finish, error = await events.get()
        if error is not None:
            raise RuntimeError(error)
        delta, stopped = text.add(ids, final=finish is not None)
        if stopped:
            request.cancel("stop")
            yield delta, ids, "stop"
            return
        yield delta, ids, None if finish == "cancelled" else finish
        if finish is not None:
            return


async def _read(http: HTTPRequest, limit: int) -> bytes:
    """The request's body; 415 unless it is JSON, 413 past `limit` bytes: from Content-Length
    before anything is read, and while a chunked body is read."""
    kind = http.headers.get("content-type")
    if kind is not None and not _is_json(kind):
        raise BadRequest(None, f"Content-Type {kind!r} is not supported; send the body as "
                         "application/json", 415)
    size = http.headers.get("content-length", "")
    if size.isdigit() and int(size) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for piece in http.stream():
        body += piece
        if len(body) > limit:
            raise _too_large(limit)
    return bytes(body)


def _too_large(limit: int) -> BadRequest:
    return BadRequest(None, f"the request body exceeds the server's limit of {limit} bytes", 413)


def _parse(raw: bytes, model: type[pydantic.BaseModel]):
    """The JSON body as `model`; BadRequest naming the field that is wrong."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise BadRequest("body", f"malformed JSON: {e}") from None
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or "body"
        msg = err["msg"].removeprefix("Value error, ")
        raise BadRequest(field, f"{field}: {msg}") from None


def _is_json(content_type: str) -> bool:
    kind = content_type.split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/")
                                           and kind.endswith("+json"))


def _answer_errors(app: FastAPI) -> None:
    """Every error in OpenAI's format: BadRequest, Starlette's own (404 unknown path, 405 wrong
    method) and anything unforeseen (500)."""

    @app.exception_handler(BadRequest)
    async def bad(_, exc: BadRequest):
        return _error(exc)

    @app.exception_handler(HTTPException)
    async def http_error(http: HTTPRequest, exc: HTTPException):
        return _error(BadRequest(None, f"{exc.detail}: {http.method} {http.url.path}",
                                 exc.status_code, exc.headers))

    @app.exception_handler(Exception)
    async def unforeseen(_, exc: Exception):
        return _error(BadRequest(None, f"internal error: {type(exc).__name__}", 500))


def _error(exc: BadRequest) -> JSONResponse:
    kind = {429: "rate_limit_error"}.get(exc.status, "server_error" if exc.status >= 500
                                         else "invalid_request_error")
    return JSONResponse(protocol.error(exc.message, exc.param, kind, exc.code), exc.status,
                        exc.headers)


class Server:
    """The app on uvicorn in a background thread (tests, benchmarks): start() returns once it
    listens; stop() shuts it and the engine down. Options go to `create_app`."""

    def __init__(self, engine: Engine, model_name: str, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning", **options):
        self.engine = engine
        config = uvicorn.Config(create_app(engine, model_name, **options), host=host, port=port,
                                log_level=log_level, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="jetspec-http", daemon=True)

    def start(self, timeout: float = 60.0) -> "Server":
        if self.engine.thread is None:
            self.engine.start()
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    @property
    def url(self) -> str:
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()
        self.engine.stop()


def serve(engine: Engine, model_name: str, host: str, port: int, log_level: str = "info",
          **options) -> None:
    """Compiles the engine's programs, then serves until interrupted. Options go to
    `create_app`."""
    engine.start()
    try:
        uvicorn.run(create_app(engine, model_name, **options), host=host, port=port,
                    log_level=log_level)
    finally:
        engine.stop()
