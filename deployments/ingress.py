"""OpenAI-compatible HTTP ingress (FastAPI inside Ray Serve): /v1/completions, /v1/chat/completions (SSE streaming
with ``data: [DONE]``), /v1/models, /health, /v1/stats. Errors use OpenAI's JSON shape.

No ``from __future__ import annotations`` here: FastAPI must see real annotations on Serve's class-based routes.
"""


import json
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve.handle import DeploymentHandle

app = FastAPI(title="specserve", version="0.1.0")


# ---- protocol ------------------------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(None)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    user: str | None = None
    # extensions (vLLM / SGLang names)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    def sampling_params(self, default_max: int | None) -> dict:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {"max_tokens": self.max_tokens if self.max_tokens is not None else default_max,
                "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "seed": self.seed, "stop": stop, "stop_token_ids": list(self.stop_token_ids or []),
                "ignore_eos": self.ignore_eos}


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = None


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_response(status: int, message: str, type_: str, param=None, code=None) -> JSONResponse:
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": type_, "param": param, "code": code}})


@app.exception_handler(APIError)
async def _api_error(_: Request, e: APIError):
    return error_response(e.status, e.message, e.type, e.param, e.code)


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, e: RequestValidationError):
    first = e.errors()[0] if e.errors() else {}
    loc = ".".join(str(x) for x in first.get("loc", [])[1:]) or None
    return error_response(400, f"{loc}: {first.get('msg', 'invalid request')}" if loc else str(e),
                          "invalid_request_error", loc)


def _message_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise APIError(400, f"unsupported content part type {part.get('type')!r}: only text", param="messages")
        parts.append(part.get("text", ""))
    return "".join(parts)


@serve.deployment(name="OpenAIIngress", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, controller: DeploymentHandle, model_id: str, api_key: str | None = None):
        self.controller = controller
        self.model_id = model_id
        self.api_key = api_key
        self.created = int(time.time())
        self._info = None

    async def _model_info(self) -> dict:
        if self._info is None:
            self._info = await self.controller.info.remote()
        return self._info

    def _check(self, request: Request, model: str | None) -> None:
        if self.api_key is not None:
            auth = request.headers.get("authorization", "")
            if auth != f"Bearer {self.api_key}":
                raise APIError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")
        if model is not None and model != self.model_id:
            raise APIError(404, f"The model `{model}` does not exist. Available: {self.model_id}",
                           "invalid_request_error", "model", "model_not_found")

    @app.get("/health")
    async def health(self):
        await self.controller.check_health.remote()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self, request: Request):
        self._check(request, None)
        info = await self._model_info()
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": self.created,
                                             "owned_by": "specserve", "max_model_len": info["max_model_len"]}]}

    @app.get("/v1/stats")
    async def stats(self, request: Request):
        self._check(request, None)
        return await self.controller.stats.remote()

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        self._check(request, body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "batched prompts are not supported: send one prompt per request", param="prompt")
            prompt = prompt[0]
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        return await self._serve(body, prompt, chat=False, request=request)

    @app.post("/v1/chat/completions")
    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._check(request, body.model)
        messages = [{"role": m.role, "content": _message_text(m.content)} for m in body.messages]
        prompt = await self.controller.render_chat.remote(messages)
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        return await self._serve(body, prompt, chat=True, request=request)

    async def _serve(self, body: _SamplingFields, prompt, chat: bool, request: Request):
        if body.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        # OpenAI defaults: 16 tokens for completions; chat runs to the end of the context
        params = body.sampling_params(default_max=None if chat else 16)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        gen = self.controller.options(stream=True).generate.remote(prompt, params, rid)
        first = await gen.__anext__()
        if "error" in first:
            raise APIError(first["status"], first["error"], first["type"], None, first.get("code"))
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._sse(gen, rid, created, chat, include_usage),
                                     media_type="text/event-stream")
        text, finish, usage, spec, error = [], None, None, None, None
        async for item in gen:
            if "error" in item and item.get("status"):
                raise APIError(item["status"], item["error"], item["type"])
            text.append(item["text"])
            if item["finished"]:
                finish, spec, error = item["finish_reason"], item.get("spec"), item.get("error")
                usage = {"prompt_tokens": item["prompt_tokens"], "completion_tokens": item["completion_tokens"],
                         "total_tokens": item["prompt_tokens"] + item["completion_tokens"]}
        if finish == "error":
            raise APIError(500, error or "generation failed", "internal_error")
        choice = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice["text"] = "".join(text)
        resp = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": self.model_id, "choices": [choice], "usage": usage}
        if spec is not None:
            resp["spec_decode_stats"] = spec
        return resp

    async def _sse(self, gen, rid: str, created: int, chat: bool, include_usage: bool):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta_text: str | None, finish: str | None, first: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else (
                    {"content": delta_text} if delta_text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
            payload = {"id": rid, "object": obj, "created": created, "model": self.model_id, "choices": [choice]}
            if include_usage:
                payload["usage"] = None
            return f"data: {json.dumps(payload)}\n\n"

        try:
            if chat:
                yield chunk(None, None, first=True)
            async for item in gen:
                if "error" in item and item.get("status"):
                    err = {"error": {"message": item["error"], "type": item["type"], "param": None, "code": None}}
                    yield f"data: {json.dumps(err)}\n\n"
                    break
                finish = item["finish_reason"] if item["finished"] else None
                if item["text"] or finish:
                    yield chunk(item["text"], finish)
                if item["finished"] and include_usage:
                    usage = {"prompt_tokens": item["prompt_tokens"], "completion_tokens": item["completion_tokens"],
                             "total_tokens": item["prompt_tokens"] + item["completion_tokens"]}
                    payload = {"id": rid, "object": obj, "created": created, "model": self.model_id, "choices": [],
                               "usage": usage}
                    if item.get("spec"):
                        payload["spec_decode_stats"] = item["spec"]
                    yield f"data: {json.dumps(payload)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            gen.cancel()  # no-op when finished; on client disconnect this aborts the request in the controller
