"""The streamed completions' way in that skips FastAPI (``_StreamedRoute``): the real app driven in-process, its
engine client accepting every request and finishing it with two tokens. A streamed request answered by it gets the
same bytes as through FastAPI (ids and times aside), and never reaches FastAPI's dependency solving; invalid bodies,
errors our handler raises, other content types and non-streamed requests get the same answer either way."""

from __future__ import annotations

import asyncio
import json
import re
import types

import fastapi.routing
import pytest

from bench.common import ROOT
from deployments.config import LIMIT_FIELDS, LLMConfig
from deployments.engine_client import EngineClient
from deployments.ingress import OpenAIIngress, _Served, app
from deployments.limits import RequestLimits


class _Engine(EngineClient):
    """The real client (streams, detokenizing) whose core accepts at once and streams two tokens per request."""

    def __init__(self, tokenizer: str):
        super().__init__(None, "m", tokenizer)
        self.metrics = types.SimpleNamespace(record_tokens=lambda *a: None, record_finish=lambda *a: None,
                                             record_n=lambda n: None)
        self.info = {"max_model_len": 4096, "vocab_size": len(self.tokenizer), "sampling_defaults": {}}
        self.submitted = []

    async def core(self):
        return

    def _route(self, item):
        self.submitted.append(item[:3])
        item[4].set_result(None)
        loop = asyncio.get_running_loop()
        loop.call_soon(self._deliver, [(item[0], [11], None, None, None, None)])
        loop.call_soon(self._deliver, [(item[0], [12], "length", None, None, {"spec": None, "cached_tokens": 0})])

    def abort(self, rid):
        self._streams.pop(rid, None)


@pytest.fixture(scope="module")
def served():
    engine = _Engine(str(ROOT / "models" / "specserve-tiny"))  # (its tokenizer has a chat template)
    ingress = OpenAIIngress.func_or_class.__new__(OpenAIIngress.func_or_class)
    ingress.created = 1
    served = _Served("m", None, engine, RequestLimits(**{k: LLMConfig.model_fields[k].default for k in LIMIT_FIELDS}))
    ingress.models, ingress.default = {"m": served}, served
    import ray.serve

    saved = ray.serve.get_replica_context, getattr(app.state, "ingress", None)
    ray.serve.get_replica_context = lambda: types.SimpleNamespace(servable_object=ingress)  # (Serve's `self`)
    app.state.auth_header, app.state.max_body_bytes = None, None
    yield ingress, engine
    ray.serve.get_replica_context, app.state.ingress = saved


def _call(path: str, body: bytes, headers=None, fast: bool = True, ingress=None) -> tuple[int, bytes, int]:
    """(status, body, FastAPI dependency solves) of one request through the whole app."""
    app.state.ingress = ingress if fast else None
    solves = [0]
    solve = fastapi.routing.solve_dependencies

    async def counted(*args, **kwargs):
        solves[0] += 1
        return await solve(*args, **kwargs)

    async def run():
        sent, status = [], []
        got = [False]
        done = asyncio.Event()

        async def receive():
            if not got[0]:
                got[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            else:
                sent.append(message.get("body", b""))

        hs = [(b"content-type", b"application/json")] if headers is None else headers
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000),
                 "headers": [*hs, (b"content-length", str(len(body)).encode())]}
        await asyncio.wait_for(app(scope, receive, send), 10)
        done.set()
        return status[0], b"".join(sent)

    fastapi.routing.solve_dependencies = counted
    try:
        status, out = asyncio.run(run())
    finally:
        fastapi.routing.solve_dependencies = solve
    # the response's id and creation time differ between calls
    out = re.sub(rb'"(chatcmpl|cmpl)-[0-9a-f]+', rb'"ID', re.sub(rb'"created": ?\d+', b'"created": 0', out))
    return status, out, solves[0]


def _same(served, path: str, body: dict | bytes, headers=None) -> tuple[int, bytes, int]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    fast = _call(path, raw, headers, True, served[0])
    slow = _call(path, raw, headers, False, served[0])
    assert fast[:2] == slow[:2], f"{path} {raw[:120]!r}: the fast path answered {fast[:2]}, FastAPI {slow[:2]}"
    return (*fast, slow[2])


STREAM = {"model": "m", "max_tokens": 2, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
          "ignore_eos": True}


@pytest.mark.parametrize("path,extra", [
    ("/v1/completions", {"prompt": [5, 6, 7]}),
    ("/v1/completions", {"prompt": "<5> <6>"}),
    ("/v1/completions", {"prompt": [[5, 6], [7]], "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "<5> <6>"}]}),
])
def test_streamed_requests_skip_fastapi_with_the_same_answer(served, path, extra):
    status, out, solves, reference_solves = _same(served, path, {**STREAM, **extra})
    assert status == 200 and out.endswith(b"data: [DONE]\n\n") and b'"usage"' in out, out[-300:]
    assert solves == 0 and reference_solves > 0, "a valid streamed request went through FastAPI's dependency solving"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {**STREAM, "prompt": [5], "temperature": 5}, "temperature"),  # pydantic refuses
    ("/v1/completions", {**STREAM, "prompt": [5, 9999999]}, "prompt"),  # our handler refuses (ids' range)
    ("/v1/completions", {**STREAM, "prompt": [5], "n": 100000}, "n"),
    ("/v1/completions", {**STREAM, "prompt": "x", "stop": ["a"] * 1000}, "stop"),  # our limits
    ("/v1/chat/completions", {**STREAM, "messages": []}, "messages"),
    ("/v1/chat/completions", {**STREAM, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs"),
    ("/v1/completions", b'{"prompt": "\\ud800", "stream": true}', "prompt"),  # a lone surrogate: only json.loads
])
def test_refusals_are_the_same_openai_errors(served, path, body, param):
    status, out, *_ = _same(served, path, body)
    err = json.loads(out)["error"]
    assert status == 400 and err["param"] == param and err["type"] == "invalid_request_error", (status, err)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {**STREAM, "prompt": "x", "guided_json": 5}, "guided_json"),
    ("/v1/completions", {**STREAM, "prompt": [5, "a"]}, "prompt"),
    ("/v1/completions", {**STREAM, "prompt": "x", "stop": 5}, "stop"),
    ("/v1/completions", {**STREAM, "prompt": "x", "stop": ["a", 5]}, "stop"),
    ("/v1/completions", {**STREAM, "prompt": "x", "tool_choice": 5}, "tool_choice"),
    ("/v1/completions", {**STREAM, "prompt": "x", "structured_outputs": 5}, "structured_outputs"),
    ("/v1/completions", {**STREAM, "prompt": "x", "response_format": 5}, "response_format"),
    ("/v1/chat/completions", {**STREAM, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("/v1/chat/completions", {**STREAM, "messages": [{"role": "bot", "content": "x"}]}, "messages.0.role"),
    # a dict's keys are the client's data, not the parameter's name (pydantic's location: logit_bias.<the key>)
    ("/v1/completions", {**STREAM, "prompt": "x", "logit_bias": {"1": "x"}}, "logit_bias"),
    ("/v1/completions", {**STREAM, "prompt": "x", "logit_bias": {"5": 1.0, "client-data" * 20: []}}, "logit_bias"),
])
def test_a_refused_union_field_is_named_not_its_member_type(served, path, body, param):
    """Pydantic's location of an error in a union-typed field ends with the member type it tried (guided_json.str),
    and one in a dict-typed field with the key (logit_bias.1): the error names the field (the path down to it),
    which is the parameter the client sent."""
    status, out, *_ = _same(served, path, body)
    err = json.loads(out)["error"]
    assert status == 400 and err["param"] == param and err["type"] == "invalid_request_error", (status, err)


@pytest.mark.parametrize("path,body,message", [
    ("/v1/completions", {**STREAM, "prompt": [[1, "a"]]},
     "prompt: Input should be a string, a list of integers, a list of strings or a list of lists of integers"),
    ("/v1/completions", {**STREAM, "prompt": [5, "a"]},
     "prompt: Input should be a string, a list of integers, a list of strings or a list of lists of integers"),
    ("/v1/completions", {**STREAM, "prompt": "x", "stop": ["a", 5]},
     "stop: Input should be a string or a list of strings"),
    ("/v1/completions", {**STREAM, "prompt": "x", "guided_json": 5},
     "guided_json: Input should be a string or an object"),
    ("/v1/chat/completions", {**STREAM, "messages": [{"role": "user", "content": 5}]},
     "messages.0.content: Input should be a string or a list of objects"),
])
def test_a_refused_union_field_says_what_it_accepts(served, path, body, message):
    """Pydantic's message for a union-typed field is its first member's failure alone ("Input should be a valid
    string" for a prompt of token-id lists with a string in one): the message says what the field accepts."""
    status, out, *_ = _same(served, path, body)
    err = json.loads(out)["error"]
    assert status == 400 and err["message"] == message, (status, err)


@pytest.mark.parametrize("path,body,headers", [
    ("/v1/completions", b'{"prompt": [5], "stream": tru', None),  # not JSON
    ("/v1/completions", b'[1, 2]', None),  # not an object
    ("/v1/completions", json.dumps({**STREAM, "prompt": [5]}).encode(), []),  # no content type
    ("/v1/completions", json.dumps({**STREAM, "prompt": [5]}).encode(), [(b"content-type", b"text/plain")]),
    ("/v1/completions", json.dumps({"model": "m", "max_tokens": 2, "prompt": [5, 6]}).encode(), None),  # not streamed
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), None),
    ("/v1/completions/", json.dumps({**STREAM, "prompt": [5]}).encode(), None),  # no such route
])
def test_everything_else_goes_through_fastapi(served, path, body, headers):
    status, *_ = _same(served, path, body, headers)
    assert status in (200, 400, 404, 422), status


def test_charset_parameter_takes_the_fast_path(served):
    status, out, solves, _ = _same(served, "/v1/completions", {**STREAM, "prompt": [5]},
                                [(b"content-type", b"application/json; charset=utf-8")])
    assert status == 200 and solves == 0
