"""OpenAI-compatible HTTP ingress (FastAPI inside Ray Serve): /v1/completions, /v1/chat/completions (SSE streaming
with ``data: [DONE]``), /v1/models, /health, /v1/stats, and the API-key check. Errors use OpenAI's JSON shape. The
request models, their validation and the error body are in deployments/protocol.py.

No ``from __future__ import annotations`` here: FastAPI must see real annotations on Serve's class-based routes.
"""

import asyncio
import hmac
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from ray import serve
from ray.exceptions import TaskCancelledError
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray.serve.handle import DeploymentHandle

from deployments.config import LIMIT_FIELDS, LLMConfig, read_api_key
from deployments.engine.tokenizer import ChatTemplateError
from deployments.engine_client import Delta, EngineClient, RequestStream
from deployments.limits import RequestLimits
from deployments.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    error_response,
    logprobs_body,
)

# (no redirect from /v1/completions/ to /v1/completions: an OpenAI-shaped 404, as for any other unknown path)
app = FastAPI(title="specserve", version="0.1.0", redirect_slashes=False)
logger = logging.getLogger("specserve")


@app.exception_handler(APIError)
async def _api_error(_: Request, e: APIError):
    return error_response(e.status, e.message, e.type, e.param, e.code)


@app.exception_handler(Exception)
async def _unexpected_error(request: Request, e: Exception):
    """A bug of ours, or a failure below: logged with a reference; the body says only that and the reference (no
    traceback, pid, address or path of the install)."""
    if isinstance(e, TaskCancelledError):  # the client went away mid-stream and Serve cancelled its request
        logger.info("client disconnected on %s", request.url.path)
        return error_response(499, "the client closed the request", "client_closed")  # (nobody reads it)
    ref = uuid.uuid4().hex[:12]
    logger.error("internal error on %s (reference %s)", request.url.path, ref, exc_info=e)
    return error_response(500, f"internal error (reference {ref})", "internal_error")


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, e: StarletteHTTPException):
    """What Starlette refuses before our code runs (an unknown route, a method a route does not take)."""
    message = {404: "no such route", 405: "method not allowed on this route"}.get(e.status_code, str(e.detail))
    return error_response(e.status_code, message, "invalid_request_error" if e.status_code < 500 else "internal_error")


class _LimitBody:
    """Refuses a body over ``max_request_body_bytes`` with a 413: at once when its Content-Length says so; a body sent
    without one (chunked) is read here up to the limit first, and refused as soon as its bytes pass it."""

    def __init__(self, asgi_app):
        self.asgi_app = asgi_app

    async def __call__(self, scope, receive, send):
        limit = getattr(scope["app"].state, "max_body_bytes", None) if scope["type"] == "http" else None
        if limit is None:
            return await self.asgi_app(scope, receive, send)
        too_large = error_response(413, f"the request body is larger than {limit} bytes (max_request_body_bytes)",
                                   "invalid_request_error", code="request_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > limit:
                return await too_large(scope, receive, send)
            return await self.asgi_app(scope, receive, send)  # (the server holds the body to its Content-Length)
        events, seen = [], 0
        while True:
            event = await receive()
            events.append(event)
            seen += len(event.get("body", b""))
            if seen > limit:
                return await too_large(scope, receive, send)
            if event["type"] != "http.request" or not event.get("more_body"):
                break

        async def replay():
            return events.pop(0) if events else await receive()

        await self.asgi_app(scope, replay, send)


class _Authenticate:
    """The API key is checked before the body is read: an unauthenticated client learns nothing about the API.
    Every route needs it but /health (probes). A plain ASGI middleware: it adds nothing to a streamed response."""

    def __init__(self, asgi_app):
        self.asgi_app = asgi_app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            # the expected header's bytes (Serve runs a copy of ``app``: ask the running one)
            expected = getattr(scope["app"].state, "auth_header", None)
            given = dict(scope["headers"]).get(b"authorization", b"")
            if (expected is not None and not scope["path"].rstrip("/").endswith("/health")
                    and not hmac.compare_digest(given, expected)):  # constant time: no timing oracle for the key
                response = error_response(401, "invalid or missing API key", "authentication_error",
                                          code="invalid_api_key")
                return await response(scope, receive, send)
        await self.asgi_app(scope, receive, send)


app.add_middleware(_LimitBody)
app.add_middleware(_Authenticate)  # (added last: runs first, before any byte of the body is read)


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, e: RequestValidationError):
    first = e.errors()[0] if e.errors() else {}
    if first.get("type") == "json_invalid":
        return error_response(400, f"the body is not valid JSON: {first.get('msg', '')}", "invalid_request_error")
    loc = ".".join(str(x) for x in first.get("loc", [])[1:]) or None
    # the message names the field, never echoes its value (it may be megabytes)
    return error_response(400, f"{loc}: {first.get('msg', 'invalid request')}" if loc else
                          first.get("msg", "invalid request"), "invalid_request_error", loc)


def _error_type(status: int | None) -> str:
    """An engine failure's error type: 503s (the engine is gone or being replaced: retry) or internal errors."""
    return "server_unavailable" if status == 503 else "internal_error"


async def _collect(stream: RequestStream) -> Delta:
    """One choice's whole stream as one delta."""
    whole = Delta()
    async for delta in stream:
        whole.extend(delta)
    return whole


async def _interleave(gens: list):
    """Items of several async generators in the order they come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(gen) -> None:
        try:
            async for item in gen:
                await queue.put(item)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(g)) for g in gens]
    try:
        running = len(gens)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


@serve.deployment(name="OpenAIIngress", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, controller: DeploymentHandle, model_id: str, api_key_env: str = "SPECSERVE_API_KEY",
                 api_key_file: str | None = None, stream_interval: int = 1, stream_batching_interval_ms: float = 0.0,
                 tokenizer: str | None = None, max_request_body_bytes: int | None = None, limits: dict | None = None):
        self.controller = controller
        self.model_id = model_id
        # read here, in the replica's own environment: the key never travels in (logged) arguments
        key = read_api_key(api_key_env, api_key_file)
        app.state.auth_header = None if key is None else f"Bearer {key}".encode()  # the middlewares read these
        app.state.max_body_bytes = max_request_body_bytes
        self.created = int(time.time())
        self.limits = RequestLimits(**(limits or {k: LLMConfig.model_fields[k].default for k in LIMIT_FIELDS}))
        self.engine = EngineClient(controller, model_id, tokenizer, stream_interval, stream_batching_interval_ms)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_id:
            # (the name as JSON escapes it: a lone surrogate in it must not break the answer)
            raise APIError(404, f"The model {json.dumps(model)} does not exist. Available: {self.model_id}",
                           "invalid_request_error", "model", "model_not_found")

    @app.get("/health")
    async def health(self):
        try:
            await asyncio.wait_for(self.controller.check_health.remote(), EngineClient.CONNECT_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - failed, or being replaced: not an error of ours
            raise APIError(503, "the engine is not healthy", "server_unavailable") from None
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self):
        info = await self.engine.model_info()
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": self.created,
                                             "owned_by": "specserve", "max_model_len": info["max_model_len"]}]}

    @app.get("/v1/stats")
    async def stats(self):
        return await self.engine.stats()

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        arrival = time.time()
        self._check_model(body.model)
        body.refuse_unsupported()
        self.limits.check_fields(body)
        prompt = body.single_prompt()
        info = await self.engine.model_info()
        self.limits.check_prompt(prompt, info["max_model_len"])  # before tokenizing, or sending ids to the engine
        if isinstance(prompt, list):  # token ids: in range before anything decodes them (echo) or the engine sees them
            vocab = info["vocab_size"]
            if any(not 0 <= t < vocab for t in prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        echo = ""
        if body.echo:  # the prompt's text before each choice's (its logprobs would need the prompt's: not computed)
            if body.logprobs is not None:
                raise APIError(400, "echo with logprobs (prompt logprobs) is not supported", param="echo")
            await self.engine.core()
            echo = prompt if isinstance(prompt, str) else self.engine.decode(prompt)
        if body.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported", param="best_of")
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        prompt_ids = await self.engine.encode(prompt) if isinstance(prompt, str) else prompt
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        return await self._serve(body, prompt_ids, arrival, chat=False, logprobs=body.logprobs is not None,
                                 echo=echo, top=body.logprobs or 0)

    @app.post("/v1/chat/completions")
    async def chat(self, body: ChatCompletionRequest):
        arrival = time.time()
        self._check_model(body.model)
        body.refuse_unsupported()
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        self.limits.check_fields(body)
        messages = body.message_dicts()
        self.limits.check_messages(messages, (await self.engine.model_info())["max_model_len"])  # before the template
        try:
            prompt_ids = await self.engine.render_chat(messages)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from None
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        return await self._serve(body, prompt_ids, arrival, chat=True, logprobs=bool(body.logprobs),
                                 top=body.top_logprobs or 0)

    async def _serve(self, body: SamplingFields, prompt_ids: list[int], arrival: float, chat: bool, logprobs: bool,
                     echo: str = "", top: int = 0):
        """Generate ``n`` choices (one engine request each; with a seed, choice i samples with seed ^ i) and answer
        with one response or one SSE stream; ``echo`` (completions) comes first in every choice's text."""
        # OpenAI defaults: 16 tokens for completions; chat runs to the end of the context
        info = await self.engine.model_info()
        params = body.sampling_params(None if chat else 16, info.get("sampling_defaults", {}), logprobs, top)
        params["guided"] = body.guided_spec()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        n = body.n or 1
        added = await asyncio.gather(*(self.engine.add(
            rid if n == 1 else f"{rid}-{i}", prompt_ids,
            dict(params, seed=None if params["seed"] is None else params["seed"] ^ i), arrival)
            for i in range(n)), return_exceptions=True)
        refused = next((a for a in added if isinstance(a, BaseException)), None)
        if refused is not None:
            for a in added:
                if isinstance(a, RequestStream):
                    self.engine.abort(a.rid)
            if chat and isinstance(refused, APIError):  # the engine's names for what a chat request calls otherwise
                named = getattr(body, "max_completion_tokens", None) is not None
                tokens = "max_completion_tokens" if named else "max_tokens"
                refused.param = {"prompt": "messages", "max_tokens": tokens}.get(refused.param, refused.param)
            raise refused
        streams: list[RequestStream] = list(added)
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._sse(streams, rid, created, chat, include_usage, logprobs, echo),
                                     media_type="text/event-stream")
        try:
            results = await asyncio.gather(*(_collect(s) for s in streams))
        finally:
            for s in streams:
                if not s.finished:
                    s.finished = True
                    self.engine.abort(s.rid)
        choices, completion_tokens, prompt_tokens, spec = [], 0, 0, None
        for i, r in enumerate(results):
            if r.finish_reason == "error":
                raise APIError(r.error_status or 500, r.error or "generation failed", _error_type(r.error_status))
            choice = {"index": i, "finish_reason": r.finish_reason,
                      "logprobs": logprobs_body(r.logprobs, chat, 0, r.top_logprobs) if logprobs else None}
            if chat:
                choice["message"] = {"role": "assistant", "content": r.text}
            else:
                choice["text"] = echo + r.text
            choices.append(choice)
            prompt_tokens, completion_tokens = r.prompt_tokens, completion_tokens + r.completion_tokens
            spec = spec or r.spec
        resp = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": self.model_id, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}
        if spec is not None:
            resp["spec_decode_stats"] = spec
        return resp

    async def _sse(self, streams: list[RequestStream], rid: str, created: int, chat: bool, include_usage: bool,
                   logprobs: bool, echo: str = ""):
        """The choices' deltas as SSE chunks in the order they come (each chunk names its choice's index); the
        usage chunk (asked for) and [DONE] once every choice has finished."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        sent = [0] * len(streams)  # characters streamed per choice: where its next tokens start (text_offset)
        head = {"id": rid, "object": obj, "created": created, "model": self.model_id}

        def chunk(i: int, delta_text: str | None, finish: str | None, first: bool = False, pairs=None,
                  tops=None) -> str:
            lp = logprobs_body(pairs or [], chat, sent[i], tops) if logprobs and not first else None
            if chat:
                delta = {"role": "assistant", "content": ""} if first else (
                    {"content": delta_text} if delta_text else {})
                choice = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": lp}
            else:
                choice = {"index": i, "text": delta_text or "", "finish_reason": finish, "logprobs": lp}
            payload = {**head, "choices": [choice]}
            if include_usage:
                payload["usage"] = None
            return f"data: {json.dumps(payload)}\n\n"

        async def one(i: int, stream: RequestStream):  # a choice's chunks
            async for d in stream:
                if d.finish_reason == "error":
                    err = {"error": {"message": d.error or "generation failed", "type": _error_type(d.error_status),
                                     "param": None, "code": None}}
                    yield f"data: {json.dumps(err)}\n\n", d
                    return
                if d.text or d.finish_reason or (logprobs and d.logprobs):
                    yield chunk(i, d.text, d.finish_reason, pairs=d.logprobs, tops=d.top_logprobs), d
                    sent[i] += len(d.text)

        if len(streams) == 1:
            merged = one(0, streams[0])
        else:
            merged = _interleave([one(i, s) for i, s in enumerate(streams)])
        try:
            for i in range(len(streams)) if chat or echo else ():
                yield chunk(i, echo, None, first=True)
            prompt_tokens, completion_tokens, spec, failed = 0, 0, None, False
            async for text, d in merged:
                yield text
                if d.finish_reason == "error":
                    failed = True
                    break
                if d.finish_reason:
                    prompt_tokens, completion_tokens = d.prompt_tokens, completion_tokens + d.completion_tokens
                    spec = spec or d.spec
            if include_usage and not failed:
                payload = {**head, "choices": [],
                           "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                     "total_tokens": prompt_tokens + completion_tokens}}
                if spec:
                    payload["spec_decode_stats"] = spec
                yield f"data: {json.dumps(payload)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await merged.aclose()
            for s in streams:  # on client disconnect: the engine drops what is still running
                if not s.finished:
                    s.finished = True
                    self.engine.abort(s.rid)
