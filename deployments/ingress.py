"""OpenAI-compatible HTTP ingress (FastAPI inside Ray Serve): /v1/completions, /v1/chat/completions (SSE streaming
with ``data: [DONE]``), /v1/models, /health, /v1/stats. Errors use OpenAI's JSON shape.

No ``from __future__ import annotations`` here: FastAPI must see real annotations on Serve's class-based routes.
"""


import asyncio
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
    """Fields both endpoints share. Optional fields accept null (OpenAI marks them nullable); unset ones take the
    model's generation_config.json defaults where it has them, else OpenAI's."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None  # as vLLM: omitted means the served model
    max_tokens: int | None = Field(None)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(None, ge=1, le=128)
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    seed: int | None = None
    user: str | None = None
    # OpenAI parameters this server does not implement: refused when set to anything but their no-op value
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # extensions (vLLM / SGLang names)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None

    def refuse_unsupported(self) -> None:
        """A request for something this server does not do gets 400 naming the parameter, not a silent no-op."""
        unsupported = {
            "frequency_penalty": self.frequency_penalty not in (None, 0),
            "presence_penalty": self.presence_penalty not in (None, 0),
            "repetition_penalty": self.repetition_penalty not in (None, 1),
            "logit_bias": bool(self.logit_bias),
            "response_format": (self.response_format or {}).get("type", "text") != "text",
            "tools": bool(self.tools),
            "tool_choice": self.tool_choice not in (None, "none", "auto"),
        }
        for name, refused in unsupported.items():
            if refused:
                raise APIError(400, f"{name} is not supported by this server", param=name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options can only be set when stream is true", param="stream_options")

    def sampling_params(self, default_max: int | None, defaults: dict, logprobs: bool, top: int = 0) -> dict:
        def pick(name: str, fallback):
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {"max_tokens": self.max_tokens if self.max_tokens is not None else default_max,
                "temperature": pick("temperature", 1.0), "top_p": pick("top_p", 1.0), "top_k": pick("top_k", 0),
                "min_p": pick("min_p", 0.0), "seed": self.seed, "stop": stop,
                "stop_token_ids": list(self.stop_token_ids or []), "ignore_eos": bool(self.ignore_eos),
                "logprobs": logprobs, "top_logprobs": top}


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=20)  # most likely alternatives per token besides the sampled one
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)


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


def _logprobs(pairs: list, chat: bool, text_offset: int = 0, tops: list | None = None) -> dict | None:
    """OpenAI's logprobs object for [(token text, logprob), ...] and, when asked for, each token's alternatives
    [[(token text, logprob), ...], ...]: chat's ``content`` list, or the completions API's parallel lists
    (``text_offset``: where the first token starts in the choice's text)."""
    tops = tops or [[] for _ in pairs]
    if chat:
        entry = lambda t, lp: {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}  # noqa: E731
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top]}
                            for (t, lp), top in zip(pairs, tops)]}
    offsets = []
    for t, _ in pairs:
        offsets.append(text_offset)
        text_offset += len(t)
    # a dict per token, text → logprob: its alternatives, likeliest first, then the sampled token itself (OpenAI's
    # up to logprobs + 1 entries); tokens that decode to the same text keep the likelier one's logprob
    top_dicts = []
    for (token, token_lp), top in zip(pairs, tops):
        top_dicts.append({})
        for t, lp in (*top, (token, token_lp)):
            top_dicts[-1].setdefault(t, lp)
    return {"tokens": [t for t, _ in pairs], "token_logprobs": [lp for _, lp in pairs],
            "top_logprobs": top_dicts, "text_offset": offsets}


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
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "batched prompts are not supported: send one prompt per request", param="prompt")
            prompt = prompt[0]
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
        messages = [{"role": m.role, "content": _message_text(m.content)} for m in body.messages]
        prompt = await self.controller.render_chat.remote(messages)
        if isinstance(prompt, dict):
            raise APIError(400, prompt["error"], param="messages")
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        return await self._serve(body, prompt, chat=True, logprobs=bool(body.logprobs), top=body.top_logprobs or 0)

    async def _serve(self, body: _SamplingFields, prompt, chat: bool, logprobs: bool, echo: str = "",
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
                      "logprobs": _logprobs(pairs, chat, 0, tops) if logprobs else None}
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
            lp = _logprobs(pairs or [], chat, sent[i], tops) if logprobs and not first else None
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
