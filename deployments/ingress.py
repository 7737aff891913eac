"""OpenAI-compatible HTTP ingress (FastAPI inside Ray Serve): /v1/completions, /v1/chat/completions (SSE streaming
with ``data: [DONE]``), /v1/models, /health, /v1/stats, and the API-key check. Errors use OpenAI's JSON shape. The
request models, their validation and the error body are in deployments/protocol.py.

No ``from __future__ import annotations`` here: FastAPI must see real annotations on Serve's class-based routes.
"""

import asyncio
import ctypes
import dataclasses
import hmac
import json
import logging
import sys
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from ray import serve
from ray.exceptions import TaskCancelledError
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray.serve.handle import DeploymentHandle

from deployments import rayllm
from deployments.config import LIMIT_FIELDS, LLMConfig, read_api_key
from deployments.engine.request import SpecStats
from deployments.engine.tokenizer import ChatTemplateError
from deployments.engine_client import Delta, EngineClient, RequestStream
from deployments.limits import RequestLimits
from deployments.protocol import (
    APIError,
    ChatCompletionRequest,
    ChunkFormat,
    CompletionRequest,
    SamplingFields,
    error_message,
    error_response,
    logprobs_body,
    prompt_logprobs_body,
)

MAX_BATCH_PROMPTS = 1024  # prompts in one completions request (lm-eval sends a batch of its --batch_size)

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


_DONE = "data: [DONE]\n\n"


class _Streamed(Response):
    """An SSE response written by a plain ASGI send loop (``content``: an async iterator of SSE text, each item one
    ``send``, the last one, ending with ``data: [DONE]``, closing the body) that aborts its requests in the engine
    however it ends. A client that leaves while the response waits on ``send`` cancels it outside our generators,
    which then end only when collected, possibly much later; until then their requests would run on, unread.
    Disconnects are watched as Starlette's StreamingResponse does (a task reading ``receive``) under Serve's own."""

    media_type = "text/event-stream"

    def __init__(self, content, streams: list):
        self.content, self.status_code, self.background = content, 200, None
        self.init_headers(None)
        self._streams = streams

    async def _write(self, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        content = self.content
        try:
            async for text in content:
                last = text.endswith(_DONE)
                await send({"type": "http.response.body", "body": text.encode(), "more_body": not last})
                if last:
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await content.aclose()

    @staticmethod
    async def _listen(receive, writer: asyncio.Task, gone: list) -> None:
        """Cancels the writer when the client disconnects."""
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # noqa: BLE001 - the connection is unusable: as a disconnect
            pass
        gone.append(True)
        writer.cancel()

    async def __call__(self, scope, receive, send):
        # the chunks are written by this task (no task of their own: one turn of the event loop less before the
        # first), a disconnect cancels it
        task, gone = asyncio.current_task(), []
        listener = asyncio.get_running_loop().create_task(self._listen(receive, task, gone))
        try:
            await self._write(send)
        except asyncio.CancelledError:
            if not gone:  # (Serve cancelled the request: its client left)
                raise
            if hasattr(task, "uncancel"):  # (3.11+: the cancel was ours, handled here)
                task.uncancel()
        finally:
            listener.cancel()
            _abandon(self._streams)


def _abandon(streams: list) -> None:
    """The streams still running when their response ends: aborted in the engine, each counted once as an "abort"
    finish (several choices' own generators end later, cancelled, and find them finished already)."""
    for s in streams:
        s.abandon()


_trim_pending = threading.Event()  # one trim at a time: a burst of refused bodies queues one, not one each


def _trim_heap() -> None:
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc
        pass
    finally:
        _trim_pending.clear()


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
                events.clear()
                await too_large(scope, receive, send)
                # the refused chunks were freed, but glibc keeps their heap pages: hand them back to the OS
                if not _trim_pending.is_set():
                    _trim_pending.set()
                    asyncio.get_running_loop().run_in_executor(None, _trim_heap)
                return
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


class _StreamedRoute:
    """A streamed completion's way in without FastAPI's per-request machinery (route matching, the body's
    content-type parse, ``json.loads`` and the validation of the dict, dependency solving: most of an arrival's cost
    before our handler, paid on the one event loop that parses a wave of arrivals one after another). A POST to
    /v1/completions or /v1/chat/completions with a JSON body that validates (pydantic's JSON parser) and asks for a
    stream calls its handler directly; anything else (not JSON, invalid, not streamed) goes through FastAPI with its
    body, so every error and every non-streamed answer stays FastAPI's."""

    HANDLERS = {"/v1/completions": ("completions", CompletionRequest),
                "/v1/chat/completions": ("chat", ChatCompletionRequest)}

    def __init__(self, asgi_app):
        self.asgi_app = asgi_app

    async def __call__(self, scope, receive, send):
        route = self.HANDLERS.get(_route_path(scope)) if scope["type"] == "http" and scope["method"] == "POST" else None
        ingress = getattr(scope["app"].state, "ingress", None) if route is not None else None
        if ingress is None or not _json_content(scope["headers"]):
            return await self.asgi_app(scope, receive, send)
        events, chunks = [], []
        while True:
            event = await receive()
            events.append(event)
            if event["type"] != "http.request":  # (a disconnect: FastAPI's path handles it as before)
                chunks = None
                break
            chunks.append(event.get("body", b""))
            if not event.get("more_body"):
                break
        body = None
        if chunks is not None:
            try:
                body = route[1].model_validate_json(b"".join(chunks))
            except ValueError:  # (pydantic's ValidationError: FastAPI's path says what is wrong, as it always did)
                pass
        if body is None or not body.stream:
            async def replay():
                return events.pop(0) if events else await receive()

            return await self.asgi_app(scope, replay, send)
        try:
            response = await getattr(ingress, route[0])(body)
        except APIError as e:
            response = error_response(e.status, e.message, e.type, e.param, e.code)
        await response(scope, receive, send)


def _route_path(scope) -> str:
    """The path the router matches (the app's root path, Serve's route prefix, taken off)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _json_content(headers) -> bool:
    """Whether the body is declared as JSON (``application/json``, parameters allowed), as FastAPI takes it."""
    for name, value in headers:
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"application/json"
    return False


app.add_middleware(_StreamedRoute)
app.add_middleware(_LimitBody)
app.add_middleware(_Authenticate)  # (added last: runs first, before any byte of the body is read)
# (so the order is _Authenticate, _LimitBody, _StreamedRoute, then FastAPI's routing)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, e: RequestValidationError):
    first = e.errors()[0] if e.errors() else {}
    if first.get("type") == "json_invalid":
        return error_response(400, f"the body is not valid JSON: {first.get('msg', '')}", "invalid_request_error")
    route = _StreamedRoute.HANDLERS.get(_route_path(request.scope))  # (the body's model, where the route has one)
    model = route[1] if route else None
    loc, msg = error_message(model, first.get("loc", [])[1:], first.get("msg", "invalid request"))
    # the message names the field, never echoes its value (it may be megabytes)
    return error_response(400, f"{loc}: {msg}" if loc else msg, "invalid_request_error", loc)


class _Echo:
    """What each completion choice starts with when the request echoes its prompt: the prompt's text and, with
    logprobs, its tokens' (choice i is prompt i // n's)."""

    def __init__(self, texts: list[str] | None, prompts: list[list[int]], n: int, top: int, prompt_logprobs: bool,
                 echo_only: bool, token_text):
        self.texts, self.prompts, self.n, self.top = texts, prompts, n, top
        self.prompt_logprobs, self.echo_only, self.token_text = prompt_logprobs, echo_only, token_text

    def text(self, i: int) -> str:
        return self.texts[i // self.n] if self.texts else ""

    def prompt_pairs(self, i: int, entries: list | None) -> tuple[list, list]:
        if not self.prompt_logprobs:
            return [], []
        ids = self.prompts[i // self.n]
        return prompt_logprobs_body(ids, entries or [None] * len(ids), self.token_text, self.top)


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens the engine found in its prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _error_type(status: int | None) -> str:
    """An engine failure's error type: 503s (the engine is gone or being replaced: retry) or internal errors."""
    return "server_unavailable" if status == 503 else "internal_error"


async def _collect(stream: RequestStream) -> Delta:
    """One choice's whole stream as one delta."""
    whole = Delta()
    async for delta in stream:
        whole.extend(delta)
    return whole


async def _indexed(i: int, stream: RequestStream):
    """A choice's deltas, each with the choice's index."""
    async for d in stream:
        yield i, d


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


@dataclasses.dataclass
class _Served:
    """One model behind this ingress: its controller, its engine client and its request limits."""
    model_id: str
    controller: DeploymentHandle
    engine: EngineClient
    limits: RequestLimits


async def _announce_ready(models: list[_Served], timeout_s: float = 3600.0) -> None:
    """Log one line once every model's engine is up: the URL and where Prometheus scrapes the metrics. A task on the
    replica's event loop: a handle may only be used there (under Serve's throughput-optimized mode, a handle called
    from another thread raises), and the blocking lookups go to a thread."""
    import ray

    deadline = time.monotonic() + timeout_s
    for m in models:
        while True:
            try:
                await asyncio.wait_for(m.controller.check_health.remote(), 60)
                break
            except Exception:  # noqa: BLE001 - still starting (or being replaced): ask again
                if time.monotonic() > deadline:
                    return
                await asyncio.sleep(1.0)

    def where() -> tuple[str, str]:
        url = metrics = "?"
        try:
            from ray.serve.context import _get_global_client

            client = _get_global_client()
            app_name = serve.get_replica_context().app_name
            prefix = client.get_serve_details()["applications"][app_name].get("route_prefix") or "/"
            url = client.root_url.rstrip("/") + prefix.rstrip("/") + "/v1"
        except Exception:  # noqa: BLE001 - the line is a convenience: never fail the replica for it
            pass
        try:
            node = ray.get_runtime_context().get_node_id()
            info = next(n for n in ray.nodes() if n["NodeID"] == node)
            metrics = f"http://{info['NodeManagerAddress']}:{info['MetricsExportPort']}/metrics"
        except Exception:  # noqa: BLE001
            pass
        return url, metrics

    url, metrics = await asyncio.to_thread(where)
    line = (f"specserve ready: {url} serving {', '.join(m.model_id for m in models)}; Prometheus metrics of this "
            f"node at {metrics}")
    # the process's own stdout, which serve run shows: Serve may have pointed sys.stdout at its buffered replica log
    sys.__stdout__.write(line + "\n")
    sys.__stdout__.flush()


@serve.deployment(name="OpenAIIngress", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, controller: DeploymentHandle, model_id: str, api_key_env: str = "SPECSERVE_API_KEY",
                 api_key_file: str | None = None, stream_interval: int = 1, stream_batching_interval_ms: float = 0.0,
                 tokenizer: str | None = None, max_request_body_bytes: int | None = None, limits: dict | None = None,
                 more_models: list[dict] | None = None, router: dict | None = None, output_channel: str = "push"):
        # read here, in the replica's own environment: the key never travels in (logged) arguments
        key = read_api_key(api_key_env, api_key_file)
        app.state.auth_header = None if key is None else f"Bearer {key}".encode()  # the middlewares read these
        app.state.max_body_bytes = max_request_body_bytes
        app.state.ingress = self  # (_StreamedRoute calls the streamed routes' handlers on it)
        self.created = int(time.time())
        first = dict(controller=controller, model_id=model_id, stream_interval=stream_interval,
                     stream_batching_interval_ms=stream_batching_interval_ms, tokenizer=tokenizer, limits=limits,
                     router=router, output_channel=output_channel)
        # every model this ingress serves (build_openai_app: several), by name; the first answers a request naming none
        self.models: dict[str, _Served] = {}
        for m in [first, *(more_models or [])]:
            limits_m = RequestLimits(**(m["limits"] or {k: LLMConfig.model_fields[k].default for k in LIMIT_FIELDS}))
            engine = EngineClient(m["controller"], m["model_id"], m["tokenizer"], m["stream_interval"],
                                  m["stream_batching_interval_ms"], m.get("router"),
                                  m.get("output_channel", "push"))
            self.models[m["model_id"]] = _Served(m["model_id"], m["controller"], engine, limits_m)
        self.default = self.models[model_id]
        # (Serve runs the constructor on the replica's event loop; the task is kept so it is not collected)
        self._announce = asyncio.get_running_loop().create_task(_announce_ready(list(self.models.values())))

    def __del__(self):
        """(Serve calls it as the replica stops, on its event loop) the engine clients' sockets closed."""
        for m in getattr(self, "models", {}).values():
            m.engine.close()

    # The request's model (set by _check_model) is a context variable, so a handler's self.engine, self.model_id,
    # self.limits and self.controller are its model's without passing it around.
    @property
    def served(self) -> "_Served":
        return rayllm.CURRENT_MODEL.get(None) or self.default

    @property
    def engine(self) -> EngineClient:
        return self.served.engine

    @property
    def model_id(self) -> str:
        return self.served.model_id

    @property
    def limits(self) -> RequestLimits:
        return self.served.limits

    @property
    def controller(self) -> DeploymentHandle:
        return self.served.controller

    def _check_model(self, model: str | None) -> None:
        served = self.default if model is None else self.models.get(model)
        if served is None:
            # (the name as JSON escapes it: a lone surrogate in it must not break the answer; cut, as it may be
            # megabytes)
            shown = json.dumps(model)
            shown = shown if len(shown) <= 80 else shown[:80] + '..."'
            raise APIError(404, f"The model {shown} does not exist. Available: "
                           f"{', '.join(self.models)}", "invalid_request_error", "model", "model_not_found")
        rayllm.CURRENT_MODEL.set(served)

    @app.get("/health")
    async def health(self):
        try:
            # (each model's engine replicas, asked directly: healthy while one of them serves; a core restarting its
            # workers passes Serve's check, not this probe)
            await asyncio.wait_for(asyncio.gather(*(m.engine.check_health() for m in self.models.values())),
                                   2 * EngineClient.CONNECT_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - failed, or being replaced: not an error of ours
            raise APIError(503, "the engine is not healthy", "server_unavailable") from None
        return {"status": "ok"}

    async def _model_object(self, served) -> dict:
        info = await served.engine.model_info()
        return {"id": served.model_id, "object": "model", "created": self.created, "owned_by": "specserve",
                "max_model_len": info["max_model_len"]}

    @app.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": list(await asyncio.gather(*map(self._model_object, self.models.values())))}

    @app.get("/v1/models/{model_id:path}")  # (ids may hold slashes: org/name)
    async def model(self, model_id: str):
        self._check_model(model_id)
        return await self._model_object(self.models[model_id])

    @app.get("/v1/stats")
    async def stats(self):
        return await self.engine.stats()

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        arrival = time.time()
        self._check_model(body.model)
        body.refuse_unsupported()
        self.limits.check_fields(body)
        prompts = body.prompt_list()
        if len(prompts) > MAX_BATCH_PROMPTS:
            raise APIError(400, f"prompt: at most {MAX_BATCH_PROMPTS} prompts per request, got {len(prompts)}",
                           param="prompt", code="array_above_max_length")
        info = await self.engine.model_info()
        for prompt in prompts:
            self.limits.check_prompt(prompt, info["max_model_len"])  # before tokenizing, or sending ids to the engine
            if isinstance(prompt, list):  # token ids: in range before anything decodes them (echo) or the engine sees them
                vocab = info["vocab_size"]
                if prompt and (min(prompt) < 0 or max(prompt) >= vocab):  # (C loops: no Python per id)
                    raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        if body.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported", param="best_of")
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        # max_tokens 0 with echo (as vLLM): the prompt alone, with its logprobs if asked; the engine samples one token,
        # which is not sent
        echo_only = body.max_tokens == 0 and bool(body.echo)
        if echo_only:
            body.max_tokens = 1
        prompt_ids = [await self.engine.encode(p) if isinstance(p, str) else p for p in prompts]
        if not all(prompt_ids):
            raise APIError(400, "the prompt is empty", param="prompt")
        echo = None
        if body.echo:  # the prompt's text before each choice's, and with logprobs the prompt's (from the prefill)
            echo = [p if isinstance(p, str) else self.engine.decode(p) for p in prompts]
        return await self._serve(body, prompt_ids, arrival, chat=False, logprobs=body.logprobs is not None,
                                 echo=echo, top=body.logprobs or 0,
                                 prompt_logprobs=bool(body.echo) and body.logprobs is not None, echo_only=echo_only)

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
        return await self._serve(body, [prompt_ids], arrival, chat=True, logprobs=bool(body.logprobs),
                                 top=body.top_logprobs or 0)

    async def _serve(self, body: SamplingFields, prompts: list[list[int]], arrival: float, chat: bool,
                     logprobs: bool, echo: list[str] | None = None, top: int = 0, prompt_logprobs: bool = False,
                     echo_only: bool = False):
        """Generate ``n`` choices per prompt (one engine request each; with a seed, a prompt's choice j samples with
        seed ^ j; prompt i's choices are indices i*n .. i*n+n-1, as OpenAI orders them) and answer with one response
        or one SSE stream. Completions: ``echo`` (per prompt) comes first in every choice's text, with the prompt's
        logprobs when ``prompt_logprobs``; ``echo_only`` sends no generated token (max_tokens 0)."""
        # OpenAI defaults: 16 tokens for completions; chat runs to the end of the context
        info = await self.engine.model_info()
        params = body.sampling_params(None if chat else 16, info.get("sampling_defaults", {}), logprobs, top)
        if prompt_logprobs:
            params["prompt_logprobs"] = top
        params["guided"] = body.guided_spec()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        n = body.n or 1
        total = n * len(prompts)
        if total == 1:  # (awaited here: no task, and no turn of the event loop, for the one request)
            try:
                added = [await self.engine.add(rid, prompts[0], params, arrival)]
            except Exception as e:  # noqa: BLE001 - as gather's return_exceptions: handled below
                added = [e]
        else:
            adds = [asyncio.ensure_future(self.engine.add(
                f"{rid}-{i}", prompts[i // n],
                dict(params, seed=None if params["seed"] is None else params["seed"] ^ (i % n)), arrival))
                for i in range(total)]
            try:
                added = await asyncio.gather(*adds, return_exceptions=True)
            except asyncio.CancelledError:  # the client left: the choices accepted already would run unread
                _abandon([a.result() for a in adds if a.done() and not a.cancelled() and a.exception() is None])
                raise
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
        for _ in prompts:
            self.engine.metrics.record_n(n)
        created = int(time.time())
        echo_view = _Echo(echo, prompts, n, top, prompt_logprobs, echo_only, self.engine.token_text)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _Streamed(self._sse(streams, rid, created, chat, include_usage, logprobs, echo_view), streams)
        try:
            results = await asyncio.gather(*(_collect(s) for s in streams))
        finally:
            _abandon(streams)
        choices, completion_tokens, prompt_tokens, spec = [], 0, 0, []
        cached = [0] * len(prompts)  # per prompt: the most any of its choices found cached
        for i, r in enumerate(results):
            if r.finish_reason == "error":
                raise APIError(r.error_status or 500, r.error or "generation failed", _error_type(r.error_status))
            if echo_only:
                r.text, r.logprobs, r.top_logprobs, r.completion_tokens = "", [], [], 0
            lp = None
            if logprobs:
                pairs, tops = echo_view.prompt_pairs(i, r.prompt_logprobs)
                pairs, tops = pairs + r.logprobs, tops + (r.top_logprobs or [[] for _ in r.logprobs])
                lp = logprobs_body(pairs, chat, 0, tops)
            choice = {"index": i, "finish_reason": r.finish_reason, "stop_reason": r.stop_reason, "logprobs": lp}
            if chat:
                choice["message"] = {"role": "assistant", "content": r.text}
            else:
                choice["text"] = echo_view.text(i) + r.text
            choices.append(choice)
            if i % n == 0:  # each prompt counts once, whatever its n
                prompt_tokens += r.prompt_tokens
            cached[i // n] = max(cached[i // n], r.cached_tokens)
            completion_tokens += r.completion_tokens
            spec += [r.spec] if r.spec else []
        resp = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": self.model_id, "choices": choices,
                "usage": _usage(prompt_tokens, completion_tokens, sum(cached))}
        if spec:  # every choice's rounds (each an engine request)
            resp["spec_decode_stats"] = SpecStats.summed(spec)
        return resp

    async def _sse(self, streams: list[RequestStream], rid: str, created: int, chat: bool, include_usage: bool,
                   logprobs: bool, echo: _Echo):
        """The choices' deltas as SSE chunks in the order they come (each chunk names its choice's index); the
        usage chunk (asked for) and [DONE] once every choice has finished, in the same item as the last choice's
        last chunk (one write). An echoed prompt goes first in each choice, at once, or with its logprobs when they
        come (with the choice's first tokens). One choice's stream is read directly, several through a queue."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        sent = [0] * len(streams)  # characters streamed per choice: where its next tokens start (text_offset)
        head = {"id": rid, "object": obj, "created": created, "model": self.model_id}
        fmt = ChunkFormat(head, chat, include_usage)

        def chunk(i: int, delta_text: str | None, finish: str | None, first: bool = False, pairs=None,
                  tops=None, stop_reason=None) -> str:
            lp = logprobs_body(pairs or [], chat, sent[i], tops) if logprobs and not first else None
            sent[i] += len(delta_text or "")
            return fmt.sse(i, delta_text, finish, lp, first, stop_reason)

        cached = [0] * len(echo.prompts)  # per prompt: the most any of its choices found cached
        echoed = [not echo.prompt_logprobs] * len(streams)
        single = len(streams) == 1
        source = (streams[0].__aiter__() if single else
                  _interleave([_indexed(i, s) for i, s in enumerate(streams)]))
        try:
            opening = "".join(chunk(i, echo.text(i), None, first=True) for i in range(len(streams))
                              if chat or (echo.texts and not echo.prompt_logprobs))
            if opening:  # (chat: every choice's role; completions: every echoed prompt) in one write
                yield opening
            completion_tokens, spec, left, text = 0, [], len(streams), ""
            async for item in source:
                i, d = (0, item) if single else item
                if d.finish_reason == "error":
                    err = {"error": {"message": d.error or "generation failed", "type": _error_type(d.error_status),
                                     "param": None, "code": None}}
                    yield f"data: {json.dumps(err)}\n\n{_DONE}"
                    return
                text = ""
                if not echoed[i]:  # the prompt and its logprobs, which came with this first delta
                    echoed[i] = True
                    pairs, tops = echo.prompt_pairs(i, d.prompt_logprobs)
                    text = chunk(i, echo.text(i), None, pairs=pairs, tops=tops)
                if echo.echo_only:  # (max_tokens 0: the token sampled is not sent)
                    d.text, d.logprobs, d.top_logprobs, d.completion_tokens = "", [], [], 0
                if d.text or d.finish_reason or (logprobs and d.logprobs):
                    text += chunk(i, d.text, d.finish_reason, pairs=d.logprobs, tops=d.top_logprobs,
                                  stop_reason=d.stop_reason)
                if d.finish_reason:
                    cached[i // echo.n] = max(cached[i // echo.n], d.cached_tokens)
                    completion_tokens += d.completion_tokens
                    spec += [d.spec] if d.spec else []
                    left -= 1
                    if not left:
                        break
                if text:
                    yield text
            else:  # (every stream ends with its finish reason: not reached but on a bug)
                text = ""
            if include_usage:
                # each prompt counts once, whatever its n
                prompt_tokens = sum(len(p) for p in echo.prompts)
                payload = {**head, "choices": [], "usage": _usage(prompt_tokens, completion_tokens, sum(cached))}
                if spec:
                    payload["spec_decode_stats"] = SpecStats.summed(spec)
                text += f"data: {json.dumps(payload)}\n\n"
            yield text + _DONE
        finally:
            await source.aclose()
            _abandon(streams)  # on client disconnect: the engine drops what is still running
