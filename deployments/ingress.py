"""OpenAI-compatible HTTP ingress (FastAPI inside Ray Serve): /v1/completions, /v1/chat/completions (SSE streaming
with ``data: [DONE]``), /v1/models, /health, /v1/stats, and the API-key check. Errors use OpenAI's JSON shape. The
request models, their validation and the error body are in deployments/protocol.py.

No ``from __future__ import annotations`` here: FastAPI must see real annotations on Serve's class-based routes.
"""

import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    error_response,
    logprobs_body,
)

app = FastAPI(title="specserve", version="0.1.0")


@app.exception_handler(APIError)
async def _api_error(_: Request, e: APIError):
    return error_response(e.status, e.message, e.type, e.param, e.code)


@app.exception_handler(Exception)
async def _unexpected_error(_: Request, e: Exception):  # a bug of ours: still an OpenAI-shaped answer
    return error_response(500, f"internal error: {type(e).__name__}: {e}", "internal_error")


class _Authenticate:
    """The API key is checked before the body is read: an unauthenticated client learns nothing about the API.
    Every route needs it but /health (probes). A plain ASGI middleware: it adds nothing to a streamed response."""

    def __init__(self, asgi_app):
        self.asgi_app = asgi_app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            key = getattr(scope["app"].state, "api_key", None)  # (Serve runs a copy of ``app``: ask the running one)
            given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if key is not None and not scope["path"].rstrip("/").endswith("/health") and given != f"Bearer {key}":
                response = error_response(401, "invalid or missing API key", "authentication_error",
                                          code="invalid_api_key")
                return await response(scope, receive, send)
        await self.asgi_app(scope, receive, send)


app.add_middleware(_Authenticate)


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, e: RequestValidationError):
    first = e.errors()[0] if e.errors() else {}
    loc = ".".join(str(x) for x in first.get("loc", [])[1:]) or None
    return error_response(400, f"{loc}: {first.get('msg', 'invalid request')}" if loc else str(e),
                          "invalid_request_error", loc)


async def _collect(gen) -> tuple[str, list, list, dict]:
    """One choice's whole stream: (text, logprob pairs, their alternatives, its last item)."""
    text, pairs, tops, last = [], [], [], None
    async for item in gen:
        if "error" in item and item.get("status"):
            raise APIError(item["status"], item["error"], item["type"])
        text.append(item["text"])
        pairs += item.get("logprobs") or []
        tops += item.get("top_logprobs") or []
        last = item
    return "".join(text), pairs, tops, last


@serve.deployment(name="OpenAIIngress", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, controller: DeploymentHandle, model_id: str, api_key: str | None = None):
        self.controller = controller
        self.model_id = model_id
        app.state.api_key = api_key  # one ingress per replica process: the middleware reads it
        self.created = int(time.time())
        self._info = None

    async def _model_info(self) -> dict:
        if self._info is None:
            self._info = await self.controller.info.remote()
        return self._info

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_id:
            raise APIError(404, f"The model `{model}` does not exist. Available: {self.model_id}",
                           "invalid_request_error", "model", "model_not_found")

    @app.get("/health")
    async def health(self):
        await self.controller.check_health.remote()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self):
        info = await self._model_info()
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": self.created,
                                             "owned_by": "specserve", "max_model_len": info["max_model_len"]}]}

    @app.get("/v1/stats")
    async def stats(self):
        return await self.controller.stats.remote()

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        self._check_model(body.model)
        body.refuse_unsupported()
        prompt = body.single_prompt()
        echo = ""
        if body.echo:  # the prompt's text before each choice's (its logprobs would need the prompt's: not computed)
            if body.logprobs is not None:
                raise APIError(400, "echo with logprobs (prompt logprobs) is not supported", param="echo")
            echo = prompt if isinstance(prompt, str) else await self.controller.decode.remote(prompt)
        if body.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported", param="best_of")
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        return await self._serve(body, prompt, chat=False, logprobs=body.logprobs is not None, echo=echo,
                                 top=body.logprobs or 0)

    @app.post("/v1/chat/completions")
    async def chat(self, body: ChatCompletionRequest):
        self._check_model(body.model)
        body.refuse_unsupported()
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        prompt = await self.controller.render_chat.remote(body.message_dicts())
        if isinstance(prompt, dict):
            raise APIError(400, prompt["error"], param="messages")
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        return await self._serve(body, prompt, chat=True, logprobs=bool(body.logprobs), top=body.top_logprobs or 0)

    async def _serve(self, body: SamplingFields, prompt, chat: bool, logprobs: bool, echo: str = "",
                     top: int = 0):
        """Generate ``n`` choices (one engine request each; with a seed, choice i samples with seed ^ i) and answer
        with one response or one SSE stream; ``echo`` (completions) comes first in every choice's text."""
        # OpenAI defaults: 16 tokens for completions; chat runs to the end of the context
        info = await self._model_info()
        params = body.sampling_params(None if chat else 16, info.get("sampling_defaults", {}), logprobs, top)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        n = body.n or 1
        gens = [self.controller.options(stream=True).generate.remote(
            prompt, dict(params, seed=None if params["seed"] is None else params["seed"] ^ i),
            rid if n == 1 else f"{rid}-{i}") for i in range(n)]
        try:
            firsts = await asyncio.gather(*(g.__anext__() for g in gens))
        except BaseException:
            for g in gens:
                g.cancel()
            raise
        refused = next((f for f in firsts if "error" in f), None)
        if refused is not None:
            for g in gens:
                g.cancel()
            raise APIError(refused["status"], refused["error"], refused["type"], None, refused.get("code"))
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._sse(gens, rid, created, chat, include_usage, logprobs, echo),
                                     media_type="text/event-stream")
        try:
            results = await asyncio.gather(*(_collect(g) for g in gens))
        finally:
            for g in gens:
                g.cancel()  # no-op when finished
        choices, completion_tokens, prompt_tokens, spec = [], 0, 0, None
        for i, (text, pairs, tops, last) in enumerate(results):
            if last["finish_reason"] == "error":
                raise APIError(500, last.get("error") or "generation failed", "internal_error")
            choice = {"index": i, "finish_reason": last["finish_reason"],
                      "logprobs": logprobs_body(pairs, chat, 0, tops) if logprobs else None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = echo + text
            choices.append(choice)
            prompt_tokens, completion_tokens = last["prompt_tokens"], completion_tokens + last["completion_tokens"]
            spec = spec or last.get("spec")
        resp = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": self.model_id, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}
        if spec is not None:
            resp["spec_decode_stats"] = spec
        return resp

    async def _sse(self, gens: list, rid: str, created: int, chat: bool, include_usage: bool, logprobs: bool,
                   echo: str = ""):
        """The choices' items as SSE chunks in the order they come (each chunk names its choice's index); the usage
        chunk (asked for) and [DONE] once every choice has finished."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        sent = [0] * len(gens)  # characters streamed per choice: where its next tokens start (text_offset)

        def chunk(i: int, delta_text: str | None, finish: str | None, first: bool = False, pairs=None,
                  tops=None) -> str:
            lp = logprobs_body(pairs or [], chat, sent[i], tops) if logprobs and not first else None
            if chat:
                delta = {"role": "assistant", "content": ""} if first else (
                    {"content": delta_text} if delta_text else {})
                choice = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": lp}
            else:
                choice = {"index": i, "text": delta_text or "", "finish_reason": finish, "logprobs": lp}
            payload = {"id": rid, "object": obj, "created": created, "model": self.model_id, "choices": [choice]}
            if include_usage:
                payload["usage"] = None
            return f"data: {json.dumps(payload)}\n\n"

        items: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, gen) -> None:
            try:
                async for item in gen:
                    await items.put((i, item))
            except Exception as e:  # noqa: BLE001 - the controller went away: the stream ends with an error
                await items.put((i, {"error": f"{type(e).__name__}: {e}", "status": 500, "type": "internal_error"}))
            await items.put((i, None))

        pumps = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
        try:
            for i in range(len(gens)) if chat or echo else ():
                yield chunk(i, echo, None, first=True)
            running, prompt_tokens, completion_tokens, spec = len(gens), 0, 0, None
            while running:
                i, item = await items.get()
                if item is None:
                    running -= 1
                    continue
                if "error" in item and item.get("status"):
                    err = {"error": {"message": item["error"], "type": item["type"], "param": None, "code": None}}
                    yield f"data: {json.dumps(err)}\n\n"
                    break
                finish = item["finish_reason"] if item["finished"] else None
                if item["text"] or finish or (logprobs and item.get("logprobs")):
                    yield chunk(i, item["text"], finish, pairs=item.get("logprobs"), tops=item.get("top_logprobs"))
                    sent[i] += len(item["text"])
                if item["finished"]:
                    prompt_tokens, completion_tokens = item["prompt_tokens"], completion_tokens + item[
                        "completion_tokens"]
                    spec = spec or item.get("spec")
            else:
                if include_usage:
                    payload = {"id": rid, "object": obj, "created": created, "model": self.model_id, "choices": [],
                               "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                         "total_tokens": prompt_tokens + completion_tokens}}
                    if spec:
                        payload["spec_decode_stats"] = spec
                    yield f"data: {json.dumps(payload)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for task in pumps:
                task.cancel()
            for g in gens:
                g.cancel()  # no-op when finished; on client disconnect this aborts the request in the controller
