"""The HTTP application (Starlette): OpenAI's endpoints over a `service.Service`.

    POST /v1/chat/completions   chat messages through the model's chat template
    POST /v1/completions        a text prompt (or token ids)
    GET  /v1/models             the served model;  GET /v1/models/{id}
    GET  /health                200 {"status": "ok", running / waiting counts}, 503 while draining

Every failure is an OpenAI-shaped JSON error (`errors.ApiError`), unknown paths and methods
included; a failure after a stream has started is an `error` event followed by `[DONE]`. With an
API key every path but /health needs `Authorization: Bearer <key>`, the scheme in any case (health
stays open so a load balancer or a supervisor can probe it without the secret; it reveals counts
and the model name).
A client that goes away, before or during its answer, cancels its row at the next turn.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from selfspec.serving.openai_api import errors
from selfspec.serving.openai_api.engine import Delta, Failed, Finished
from selfspec.serving.openai_api.errors import ApiError
from selfspec.serving.openai_api.protocol import parse_json, parse_request
from selfspec.serving.openai_api.responses import Shape

MAX_BODY = 4 << 20  # bytes; a longer body is a 413 (prompts over the context are a 400, see service.py)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def build_app(service, *, api_key: str | None = None) -> Starlette:
    """The application; starting it (its lifespan) starts the service's engine thread, stopping it
    stops the thread."""
    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", list_models, methods=["GET"]),
              Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
              Route("/health", health, methods=["GET"])]

    @asynccontextmanager
    async def lifespan(app):
        service.start()
        try:
            yield
        finally:
            await service.stop()

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        ApiError: on_api_error, HTTPException: on_http_error, Exception: on_crash})
    app.state.service = service
    if api_key:
        app.add_middleware(RequireKey, key=api_key)
    return app


# -- errors ----------------------------------------------------------------------------------------
def error_response(e: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
    if e.status in (429, 503):
        headers["Retry-After"] = "1"
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def on_api_error(request, e: ApiError):
    return error_response(e)


async def on_http_error(request, e: HTTPException):
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    what = f"{request.method} {request.url.path}"
    message = {404: f"no such endpoint: {what}", 405: f"method not allowed: {what}"}.get(e.status_code, str(e.detail))
    return error_response(ApiError(e.status_code, message, code=code))


async def on_crash(request, e: Exception):
    return error_response(errors.internal(f"internal error ({type(e).__name__}); the server keeps running"))


class RequireKey:
    """ASGI middleware: `Authorization: Bearer <key>` on every path but /health, else a 401. The
    scheme is case-insensitive (RFC 9110: "bearer" and "BEARER" are "Bearer")."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            scheme, _, token = given.partition(b" ")
            right = hmac.compare_digest(token.strip(b" "), self.expected)  # constant time: no key by timing
            if not (right and scheme.lower() == b"bearer"):
                await error_response(errors.unauthorized())(scope, receive, send)
                return
        await self.app(scope, receive, send)


# -- small endpoints -------------------------------------------------------------------------------
def _card(service) -> dict:
    return {"id": service.options.model_id, "object": "model", "created": service.created, "owned_by": "selfspec",
            "max_model_len": service.model.config.max_position_embeddings}


async def list_models(request: Request):
    return JSONResponse({"object": "list", "data": [_card(request.app.state.service)]})


async def get_model(request: Request):
    service = request.app.state.service
    service.check_model(request.path_params["model_id"])
    return JSONResponse(_card(service))


async def health(request: Request):
    service = request.app.state.service
    return JSONResponse(service.health(), status_code=503 if service.draining else 200)


# -- generation ------------------------------------------------------------------------------------
async def chat_completions(request: Request):
    return await _generate(request, "chat")


async def completions(request: Request):
    return await _generate(request, "completion")


async def _generate(request: Request, kind: str):
    service = request.app.state.service
    if service.draining:
        raise errors.shutting_down()
    with service.engine.reading():
        req = parse_request(kind, parse_json(await _body(request)))
        service.check_model(req.model)
        with service.admitting():  # counted against --max-batch / --max-queue before it is tokenized
            ids, params = await service.encode(req)
            job = service.open(req, ids, params)
    handed_over = False
    try:
        first = await _unless_gone(request, service.next_event(job))
        if first is None:
            return Response(status_code=499)  # nobody is there to read it
        if isinstance(first, Failed):
            raise first.error
        shape = Shape(req, service.options.model_id)
        if req.stream:
            handed_over = True
            return EventStream(_events(service, job, shape, first), on_close=lambda: service.close(job),
                               media_type="text/event-stream", headers=SSE_HEADERS)
        answer = await _unless_gone(request, _collect(service, job, first))
        return Response(status_code=499) if answer is None else JSONResponse(shape.full(*answer))
    finally:
        if not handed_over:
            service.close(job)


async def _body(request: Request) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise _too_large()
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY:
                raise _too_large()
            chunks.append(chunk)
    except ClientDisconnect:
        raise errors.invalid("the client went away while sending the request", code="client_disconnected") from None
    return b"".join(chunks)


def _too_large() -> ApiError:
    return ApiError(413, f"the request body is over {MAX_BODY} bytes", code="request_too_large")


async def _unless_gone(request: Request, work):
    """`await work`, or None if the client disconnects first (then `work` is cancelled)."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(service, job, event):
    """The whole answer: (text, finish event, seconds to the first token)."""
    texts, first_token = [], None
    while isinstance(event, Delta):
        first_token = first_token or time.perf_counter() - job.arrived
        texts.append(event.text)
        event = await service.next_event(job)
    if isinstance(event, Failed):
        raise event.error
    return "".join(texts), event, first_token


async def _events(service, job, shape: Shape, event):
    """The stream's `data:` lines: the role (chat), text deltas, the finish, usage, `[DONE]`."""
    first_token, with_ids = None, shape.req.return_token_ids
    if shape.chat:
        yield _sse(shape.chunk(role=True))
    while True:
        if isinstance(event, Delta):
            first_token = first_token or time.perf_counter() - job.arrived
            if event.text or (with_ids and event.ids):
                yield _sse(shape.chunk(event.text, event.ids))
        elif isinstance(event, Finished):
            yield _sse(shape.chunk(fin=event, first_token_seconds=first_token))
            if shape.req.include_usage:
                yield _sse(shape.usage_chunk(event))
            break
        else:
            yield _sse(event.error.body())
            break
        event = await service.next_event(job)
    yield "data: [DONE]\n\n"


def _sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


class EventStream(StreamingResponse):
    """A streamed answer that always releases its job when it ends, however it ends (finished,
    client gone, server stopping): `on_close` cancels the row if it is still running."""

    def __init__(self, content, *, on_close, **kw):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
