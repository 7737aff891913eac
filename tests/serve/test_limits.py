"""Per-request limits (LLMConfig's max_prompt_chars, max_n, max_stop_strings, max_stop_string_chars, and max_tokens
against the context) on a real Ray Serve application over HTTP: a request over a limit gets a 400 in OpenAI's shape
naming the parameter, one just under it is served. Offline, the engine raises InvalidRequest naming the parameter."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serve.conftest import second_app

MAX_MODEL_LEN = 1024
LIMITS = {"max_prompt_chars": 600, "max_n": 3, "max_stop_strings": 2, "max_stop_string_chars": 8}
BODY_LIMIT = 9 << 20  # max_request_body_bytes: every body below fits (the 8 MiB prompt is refused on its length)


@pytest.fixture(scope="module")
def base(server):
    """An application of its own with these limits, on the package's Serve instance."""
    args = {"engine_kwargs": {"device": "cpu", "page_size": 4, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 4},
            "max_request_body_bytes": BODY_LIMIT, **LIMITS}
    with second_app(server, "limits", args):
        yield f"{server['base']}/limits"


def _post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}/v1/{path}", json=body, timeout=120)


def _accepted(base: str, path: str, body: dict) -> int:
    """The status of ``body`` sent as a stream, which is closed at once: a refusal comes before the stream starts,
    and nothing is generated for long (max_tokens near the context would otherwise run to its end)."""
    with httpx.stream("POST", f"{base}/v1/{path}", json={**body, "stream": True}, timeout=120) as r:
        return r.status_code


def _chat(content: str = "hi", **kw) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **kw}


def _completion(prompt="hi", **kw) -> dict:
    return {"prompt": prompt, "max_tokens": 2, **kw}


# (endpoint, body just under or at the limit, the same over it, the parameter named, OpenAI's code)
CASES = {
    "prompt chars": ("completions", _completion("a" * 600), _completion("a" * 601), "prompt",
                     "string_above_max_length"),
    "chat chars": ("chat/completions", _chat("a" * 596), _chat("a" * 597), "messages", "string_above_max_length"),
    # (roles count: many empty messages make a long prompt; 150 would be at the limit, but past the context)
    "many empty messages": ("chat/completions", {"messages": [{"role": "user", "content": ""}] * 100, "max_tokens": 2},
                            {"messages": [{"role": "user", "content": ""}] * 151, "max_tokens": 2}, "messages",
                            "string_above_max_length"),
    "n": ("completions", _completion(n=3), _completion(n=4), "n", "integer_above_max_value"),
    "stop strings": ("chat/completions", _chat(stop=["x", "y"]), _chat(stop=["x", "y", "z"]), "stop",
                     "array_above_max_length"),
    "stop string chars": ("completions", _completion(stop="12345678"), _completion(stop="123456789"), "stop",
                          "string_above_max_length"),
    "stop token ids": ("completions", _completion(stop_token_ids=[1, 2]), _completion(stop_token_ids=[1, 2, 3]),
                       "stop_token_ids", "array_above_max_length"),
    "prompt token ids": ("completions", _completion([5] * (MAX_MODEL_LEN - 3)), _completion([5] * MAX_MODEL_LEN),
                         "prompt", "context_length_exceeded"),
    "max_tokens": ("completions", _completion(max_tokens=MAX_MODEL_LEN - 8),
                   _completion(max_tokens=MAX_MODEL_LEN), "max_tokens", "integer_above_max_value"),
    "max_completion_tokens": ("chat/completions", _chat(max_completion_tokens=3),
                              _chat(max_completion_tokens=10**12), "max_completion_tokens",
                              "integer_above_max_value"),
}


@pytest.mark.parametrize("case", CASES)
def test_over_a_limit_is_a_400_naming_the_parameter_and_under_it_is_served(base, case):
    path, under, over, param, code = CASES[case]
    assert _accepted(base, path, under) == 200
    r = _post(base, path, over)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(r.json()) == {"error"} and set(err) == {"message", "type", "param", "code"}, err
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code), err
    assert len(r.text) < 1000  # the refused value is not echoed


@pytest.mark.parametrize("path,body,param", [
    ("completions", _completion(max_tokens=10**12), "max_tokens"),
    ("completions", _completion(max_tokens=10**30), "max_tokens"),
    ("completions", _completion(max_tokens=-1), "max_tokens"),
    ("chat/completions", _chat(max_tokens=0), "max_tokens"),
    ("completions", _completion(seed=2**64), "seed"),
    ("completions", _completion("x" * (8 << 20)), "prompt"),  # refused on its length, before 5 s of tokenizing
])
def test_absurd_values_are_a_400_naming_the_parameter(base, path, body, param):
    r = _post(base, path, body)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    assert r.json()["error"]["param"] == param, r.text
    # the server goes on
    assert _post(base, "completions", _completion()).status_code == 200


def test_default_limits():
    """Unset, the prompt limit follows the context length (16 characters a token: more than any real text needs);
    the other limits have fixed defaults."""
    from deployments.config import LLMConfig
    from deployments.limits import RequestLimits

    cfg = LLMConfig(model_loading_config={"model_id": "m", "model_source": "/m"})
    limits = RequestLimits(**cfg.request_limits())
    assert limits.prompt_chars(2048) == 32768 and limits.prompt_chars(131072) == 2 << 20
    assert (limits.max_n, limits.max_stop_strings, limits.max_stop_string_chars) == (16, 16, 256)
    assert RequestLimits(**LLMConfig(model_loading_config={"model_id": "m", "model_source": "/m"},
                                     max_prompt_chars=100).request_limits()).prompt_chars(2048) == 100
    with pytest.raises(ValueError, match="max_n"):
        LLMConfig(model_loading_config={"model_id": "m", "model_source": "/m"}, max_n=0)


def test_the_offline_engine_names_the_parameter(tiny_models):
    from deployments.engine.engine import Engine
    from deployments.engine.request import InvalidRequest, SamplingParams
    from workers.config import EngineConfig

    engine = Engine(EngineConfig(model=str(tiny_models["llama"]), device="cpu", max_model_len=128))
    for params, param, code in [(SamplingParams(max_tokens=10**12), "max_tokens", "integer_above_max_value"),
                                (SamplingParams(max_tokens=-5), "max_tokens", "integer_below_min_value"),
                                (SamplingParams(top_p=0), "top_p", None),
                                (SamplingParams(seed=2**70), "seed", None)]:
        with pytest.raises(InvalidRequest) as e:
            engine.add_request([5, 6, 7], params)
        assert (e.value.param, e.value.code) == (param, code), e.value
    with pytest.raises(InvalidRequest) as e:
        engine.add_request(list(range(5, 200)), SamplingParams(max_tokens=4))
    assert (e.value.param, e.value.code) == ("prompt", "context_length_exceeded")
    assert not engine.has_work()


def test_a_chunked_body_is_served_under_the_limit_and_refused_over_it(base):
    """A body sent without a Content-Length (chunked) is read up to max_request_body_bytes as it comes: under the
    limit, in small pieces, it is served exactly as the same body with a Content-Length; past it, a 413 in OpenAI's
    shape."""
    headers = {"Content-Type": "application/json"}
    body = json.dumps(_completion("def f(", max_tokens=3, temperature=0.0)).encode()

    def pieces(data: bytes, size: int):  # (a generator: httpx sends it chunked)
        for i in range(0, len(data), size):
            yield data[i:i + size]

    whole = httpx.post(f"{base}/v1/completions", content=body, headers=headers, timeout=120)
    chunked = httpx.post(f"{base}/v1/completions", content=pieces(body, 5), headers=headers, timeout=120)
    assert chunked.status_code == whole.status_code == 200, chunked.text[:300]
    assert chunked.json()["choices"][0]["text"] == whole.json()["choices"][0]["text"]
    assert chunked.json()["usage"]["completion_tokens"] == 3
    big = b'{"prompt": "' + b"a" * BODY_LIMIT + b'", "max_tokens": 2}'
    for content in (big, pieces(big, 64 << 10)):  # with a Content-Length, then chunked
        r = httpx.post(f"{base}/v1/completions", content=content, headers=headers, timeout=120)
        assert r.status_code == 413, r.text[:300]
        assert r.json()["error"]["code"] == "request_too_large" and set(r.json()["error"]) == {
            "message", "type", "param", "code"}
