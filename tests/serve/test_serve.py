"""End-to-end on loopback: Ray Serve app (ingress → controller → worker actors) with the official openai client."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import mixed_prompts
from tests.serve.conftest import API_KEY, ENV_KEY, second_app


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _stats(server) -> dict:
    return httpx.get(server["base"] + "/v1/stats", headers={"Authorization": f"Bearer {API_KEY}"}).json()


def test_models_and_auth(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    bad = openai.OpenAI(base_url=server["base"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"


def test_completion_matches_offline_engine(server, client):
    from deployments.engine.engine import Engine
    from deployments.engine.request import SamplingParams
    from workers.config import EngineConfig

    offline = Engine(EngineConfig(model=server["target"], device="cpu", max_model_len=256))
    ref = offline.generate(["def main():"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    r = client.completions.create(model="tiny", prompt="def main():", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(ref.prompt_token_ids)
    spec = r.model_extra["spec_decode_stats"]
    assert spec["num_drafts"] > 0 and spec["accept_length"] > 1.0


def test_streaming_equals_non_streaming(client):
    kw = dict(model="tiny", prompt="import os\n", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_and_chat_streaming(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens <= 8
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == r.choices[0].message.content


def test_stop_and_max_tokens(client):
    base = client.completions.create(model="tiny", prompt="x = 1", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base.strip()[1:3] if len(base.strip()) >= 3 else None
    if stop:
        r = client.completions.create(model="tiny", prompt="x = 1", max_tokens=16, temperature=0, stop=[stop],
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "stop" and r.choices[0].text == base[: base.index(stop)]
    r = client.completions.create(model="tiny", prompt="x = 1", max_tokens=1, temperature=0)
    assert r.usage.completion_tokens == 1


@pytest.mark.parametrize("kwargs,status,fragment", [
    (dict(model="nope", prompt="hi"), 404, "does not exist"),
    (dict(model="tiny", prompt="hi", max_tokens=0), 400, "max_tokens"),
    (dict(model="tiny", prompt="hi", temperature=-1), 400, "temperature"),
    (dict(model="tiny", prompt="hi", n=0), 400, "n"),
    (dict(model="tiny", prompt="", max_tokens=4), 400, "empty"),
    (dict(model="tiny", prompt=list(range(5, 300)), max_tokens=4), 400, "maximum context length"),
])
def test_bad_requests(client, kwargs, status, fragment):
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(**kwargs)
    assert e.value.status_code == status
    err = e.value.body
    assert fragment in err["message"] and "type" in err
    # the server keeps serving
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).usage.completion_tokens >= 1


def test_overload_returns_503_and_others_finish(server):
    async def one(c: httpx.AsyncClient):
        return await c.post("/v1/completions", json={"model": "tiny", "prompt": mixed_prompts(1)[0], "max_tokens": 60,
                                                     "ignore_eos": True, "temperature": 0})

    async def burst():
        async with httpx.AsyncClient(base_url=server["base"], timeout=120,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as c:
            return await asyncio.gather(*[one(c) for _ in range(10)])

    codes = [r.status_code for r in asyncio.run(burst())]
    assert set(codes) <= {200, 503} and codes.count(503) >= 1 and codes.count(200) >= 2, codes
    busy = [r for r in asyncio.run(burst()) if r.status_code == 503]
    assert all(r.json()["error"]["type"] == "server_overloaded" for r in busy)


def test_disconnect_frees_kv(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server["base"], timeout=60, headers=headers) as c:
        with c.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "def f():", "max_tokens": 200,
                                                         "stream": True, "ignore_eos": True}) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            assert _stats(server)["running"] + _stats(server)["waiting"] == 1
        # leaving the block closes the connection mid-stream
    for _ in range(100):
        s = _stats(server)
        if s["running"] == 0 and s["waiting"] == 0 and s["kv_usage"] == 0:
            break
        time.sleep(0.1)
    assert (s["running"], s["waiting"], s["kv_usage"]) == (0, 0, 0.0)
    assert s["step_time"]["steps"] > 0 and s["step_time"]["execute_s"] > 0  # the server's own step timing


def test_prometheus_has_spec_counters(server, client):
    client.completions.create(model="tiny", prompt="class A:", max_tokens=12, temperature=0,
                              extra_body={"ignore_eos": True})
    wanted = ["ray_vllm_spec_decode_num_drafts_total", "ray_vllm_spec_decode_num_draft_tokens_total",
              "ray_vllm_spec_decode_num_accepted_tokens_total", "ray_vllm_spec_decode_num_accepted_tokens_per_pos_total",
              "ray_vllm_time_to_first_token_seconds_count", "ray_vllm_inter_token_latency_seconds_count",
              "ray_vllm_e2e_request_latency_seconds_count", "ray_vllm_generation_tokens_total",
              "ray_vllm_kv_cache_usage_perc", "ray_vllm_spec_decode_mean_accept_length"]
    wanted.append("ray_vllm_request_time_per_output_token_seconds_count")
    wanted += [f"ray_vllm_request_{p}_time_seconds_count" for p in ("queue", "prefill", "decode", "inference")]
    wanted += [f"ray_vllm_{h}_count" for h in ("request_prompt_tokens", "request_generation_tokens",
                                                "request_params_max_tokens", "request_params_n",
                                                "iteration_tokens_total")]
    values: dict[str, float] = {}
    reasons: dict[str, float] = {}
    for _ in range(60):
        text = urllib.request.urlopen(server["metrics"]).read().decode()
        values, reasons = {}, {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z0-9_:]+)\{([^}]*)\} ([0-9.e+-]+)$", line)
            if m and 'model_name="tiny"' in m.group(2):
                values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(3))
                reason = re.search(r'finished_reason="(\w+)"', m.group(2))
                if m.group(1) == "ray_vllm_request_success_total" and reason:
                    reasons[reason.group(1)] = float(m.group(3))
        idle = values.get("ray_vllm_num_requests_running") == 0 == values.get("ray_vllm_num_requests_waiting")
        # (the agent exports each process's metrics on its own schedule: the engine core's token counter may trail
        # the ingress's latency samples by an export)
        caught_up = values.get("ray_vllm_generation_tokens_total", 0) - values.get(
            "ray_vllm_time_to_first_token_seconds_count", 0) > values.get("ray_vllm_inter_token_latency_seconds_count", 0)
        if all(values.get(w, 0) > 0 for w in wanted if w != "ray_vllm_kv_cache_usage_perc") and "abort" in reasons \
                and idle and caught_up:  # (the agent exports what the engine set a report interval ago)
            break
        time.sleep(1)
    for w in wanted:
        assert w in values, f"{w} missing from the metrics agent's text: {sorted(values)}"
        if w != "ray_vllm_kv_cache_usage_perc":
            assert values[w] > 0, w
    assert values["ray_vllm_spec_decode_num_accepted_tokens_total"] <= values["ray_vllm_spec_decode_num_draft_tokens_total"]
    # test_disconnect_frees_kv's request ended by the client: counted, and the load gauges came back to zero
    assert reasons.get("abort", 0) >= 1 and reasons.get("length", 0) >= 1, reasons
    assert values["ray_vllm_num_requests_running"] == 0 and values["ray_vllm_num_requests_waiting"] == 0
    # inter-token latency: one sample per step that gave a request tokens (a speculative round is one), as vLLM's;
    # per-token samples would number every generated token but each request's first
    later_tokens = values["ray_vllm_generation_tokens_total"] - values["ray_vllm_time_to_first_token_seconds_count"]
    assert 0 < values["ray_vllm_inter_token_latency_seconds_count"] < later_tokens
    # the engine's phases: one sample each per request it finished (the aborted one has none)
    counts = {values[f"ray_vllm_request_{p}_time_seconds_count"] for p in ("queue", "prefill", "decode", "inference")}
    assert len(counts) == 1 and 0 < counts.pop() <= values["ray_vllm_e2e_request_latency_seconds_count"] - reasons[
        "abort"], values
    # vLLM's request-size histograms: one sample per finished request, aborted ones included
    assert values["ray_vllm_request_prompt_tokens_count"] == values["ray_vllm_request_generation_tokens_count"] == \
        values["ray_vllm_e2e_request_latency_seconds_count"], values
    # max_tokens too, where a request gave none (the context left after its prompt, as vLLM's server fills it in)
    assert values["ray_vllm_request_params_max_tokens_count"] == values["ray_vllm_request_prompt_tokens_count"], values


def test_null_fields_omitted_model_and_auth_before_the_body(server):
    """OpenAI's optional fields accept null, ``model`` may be left out (the served one), and a bad key is refused
    before the body is looked at."""
    h = {"Authorization": f"Bearer {API_KEY}"}
    nulls = {k: None for k in ("temperature", "top_p", "n", "stream", "stop", "seed", "top_k", "min_p", "ignore_eos",
                                 "stop_token_ids", "stream_options", "frequency_penalty", "logit_bias")}
    r = httpx.post(server["base"] + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, **nulls}, headers=h,
                   timeout=120)
    assert r.status_code == 200 and r.json()["model"] == "tiny", r.text
    r = httpx.post(server["base"] + "/v1/chat/completions", headers=h, timeout=120,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **nulls})
    assert r.status_code == 200, r.text
    r = httpx.post(server["base"] + "/v1/completions", json={"prompt": 5, "temperature": "hot"},
                   headers={"Authorization": "Bearer wrong"}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server["base"] + "/v1/stats", timeout=60).status_code == 401
    assert httpx.get(server["base"] + "/health", timeout=60).status_code == 200  # probes need no key


@pytest.mark.parametrize("endpoint,body,status,param", [
    ("completions", {"model": "m" * 200000, "prompt": "hi"}, 404, "model"),
    ("completions", {"model": "tiny", "prompt": "hi", "response_format": {"type": "t" * 200000}}, 400,
     "response_format"),
    ("chat", {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "t" * 200000}]}]}, 400,
     "messages"),
    ("completions", {"model": "tiny", "prompt": "hi", "guided_json": {"type": "t" * 200000}}, 400, "guided_json"),
])
def test_an_error_quotes_only_the_start_of_the_clients_value(server, endpoint, body, status, param):
    """A refusal that names the client's value (an unknown model, an unsupported type, a schema the grammar engine
    refuses) shows its start, not all of it: the value may be megabytes, which the error body would carry back."""
    h = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{server['base']}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}", json=body,
                   headers=h, timeout=120)
    err = r.json()["error"]
    assert (r.status_code, err["param"]) == (status, param), r.text[:500]
    assert "tttttttttt" in err["message"] or "mmmmmmmmmm" in err["message"], err["message"][:300]
    assert len(r.content) < 2000, f"{len(r.content)} bytes: {err['message'][:300]}"


@pytest.mark.parametrize("endpoint,extra,param", [
    ("completions", {"frequency_penalty": 2.5}, "frequency_penalty"),  # out of range: penalties are supported
    ("completions", {"logit_bias": {"5": 101.0}}, "logit_bias"),
    ("completions", {"logit_bias": {"five": 1.0}}, "logit_bias"),
    ("completions", {"logit_bias": {str(i): 1.0 for i in range(301)}}, "logit_bias"),
    ("completions", {"logit_bias": {"99999999": 1.0}}, "logit_bias"),  # not in the vocabulary
    ("completions", {"min_tokens": 3}, "min_tokens"),  # more than max_tokens
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"suffix": "x"}, "suffix"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format"),  # no schema
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format"),  # a schema the grammar engine refuses (the engine's 400)
    ("completions", {"guided_regex": "a["}, "guided_regex"),
    ("completions", {"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),  # two at once
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ("chat", {"presence_penalty": -2.5}, "presence_penalty"),
    ("chat", {"repetition_penalty": 0}, "repetition_penalty"),
    ("chat", {"min_tokens": -1}, "min_tokens"),
    # vLLM's extensions this server does not implement
    ("completions", {"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ("completions", {"guided_grammar": 'root ::= "a"'}, "guided_grammar"),
    ("completions", {"allowed_token_ids": [5, 6]}, "allowed_token_ids"),
    ("completions", {"stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("chat", {"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),
    ("chat", {"echo": True}, "echo"),
    ("chat", {"guided_choice": ["a", "b"], "min_tokens": 2}, "min_tokens"),  # (the grammar decides the end)
])
def test_unsupported_parameters_are_refused_not_ignored(server, endpoint, extra, param):
    h = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "tiny", "max_tokens": 2, **extra}
    body.update({"prompt": "hi"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "hi"}]})
    r = httpx.post(f"{server['base']}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}", json=body,
                   headers=h, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    # their no-op values are fine
    ok = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 0,
          "presence_penalty": 0, "logit_bias": {}, "response_format": {"type": "text"}, "tool_choice": "none",
          "skip_special_tokens": True, "include_stop_str_in_output": False, "echo": False, "no_such_field": 1}
    assert httpx.post(server["base"] + "/v1/chat/completions", json=ok, headers=h, timeout=120).status_code == 200


def test_penalties_and_logit_bias_apply(client):
    """Through the HTTP layer (this app speculates): a +100 logit_bias makes greedy emit that token every time, and
    the penalties are taken."""
    kw = dict(model="tiny", prompt="import os\n", max_tokens=4, temperature=0, logprobs=0)
    lp = client.completions.create(logit_bias={"42": 100}, extra_body={"ignore_eos": True}, **kw).choices[0].logprobs
    assert len(lp.tokens) == 4 and len(set(lp.tokens)) == 1
    r = client.completions.create(frequency_penalty=1.0, presence_penalty=0.5, extra_body={
        "repetition_penalty": 1.3, "min_tokens": 2}, **kw)
    assert r.usage.completion_tokens >= 2


def test_logprobs_of_the_sampled_tokens(client):
    """The sampled token's logprob (from the verify step: this app speculates), streamed or not, in both APIs'
    shapes, with the most likely alternatives when asked for; none when not asked for."""
    kw = dict(model="tiny", prompt="import os\n", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    lp = client.completions.create(logprobs=0, **kw).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 6
    assert all(x <= 0 for x in lp.token_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chunks = [c.choices[0] for c in client.completions.create(stream=True, logprobs=0, **kw) if c.choices]
    streamed = [x for c in chunks if c.logprobs for x in c.logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert client.completions.create(**kw).choices[0].logprobs is None
    msgs = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 5
    assert all(c.logprob <= 0 and c.bytes == list(c.token.encode()) and c.top_logprobs == [] for c in content)
    chunks = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                            stream=True, extra_body={"ignore_eos": True})
    streamed = [x.logprob for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([c.logprob for c in content], abs=1e-5)
    # alternatives: completions' logprobs=N (a dict per token), chat's top_logprobs=N (a list per token)
    assert lp.top_logprobs == [{t: x} for t, x in zip(lp.tokens, lp.token_logprobs)]  # logprobs=0: the token only
    lp3 = client.completions.create(logprobs=3, **kw).choices[0].logprobs
    assert lp3.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-5)
    for token, tlp, top in zip(lp3.tokens, lp3.token_logprobs, lp3.top_logprobs):
        assert 1 <= len(top) <= 4 and max(top.values()) == pytest.approx(tlp, abs=1e-5)  # greedy: the best one
    sampled = client.completions.create(**dict(kw, temperature=2.0, seed=3, logprobs=2)).choices[0].logprobs
    for token, top in zip(sampled.tokens, sampled.top_logprobs):  # the sampled token is always among them
        assert token in top and len(top) <= 3
    chat3 = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                           top_logprobs=3, extra_body={"ignore_eos": True})
    for c in chat3.choices[0].logprobs.content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
        assert [a.logprob for a in c.top_logprobs] == sorted((a.logprob for a in c.top_logprobs), reverse=True)


def test_n_choices(client):
    """n choices, choice i sampled with seed ^ i (so choice 0 is the n=1 answer with the same seed), streamed
    interleaved with their indices; usage counts every choice's tokens once and the prompt once. (This app queues
    at most 2 requests: n=2.)"""
    kw = dict(model="tiny", prompt="import os\n", max_tokens=6, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True})
    r = client.completions.create(n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == client.completions.create(**kw).usage.prompt_tokens
    assert r.choices[0].text == client.completions.create(**kw).choices[0].text
    assert r.choices[1].text == client.completions.create(**dict(kw, seed=7 ^ 1)).choices[0].text
    chunks = list(client.completions.create(n=2, stream=True, stream_options={"include_usage": True}, **kw))
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(2)}
    assert texts == {i: r.choices[i].text for i in range(2)}
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []
    msgs = [{"role": "user", "content": "hello"}]
    stream = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, n=2, stream=True,
                                                 temperature=0, extra_body={"ignore_eos": True}))
    for i in range(2):
        mine = [c.choices[0] for c in stream if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"
    done = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, n=2, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert done.choices[0].message.content == done.choices[1].message.content  # greedy: the same twice


def test_echo(server, client):
    """echo puts the prompt's text before the completion, streamed or not (with logprobs: test_completions_api)."""
    from deployments.engine.tokenizer import load_tokenizer

    kw = dict(model="tiny", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(prompt="import os\n", **kw).choices[0].text
    assert client.completions.create(prompt="import os\n", echo=True, **kw).choices[0].text == "import os\n" + plain
    chunks = client.completions.create(prompt="import os\n", echo=True, stream=True, **kw)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "import os\n" + plain
    ids = [5, 6, 7]
    text = client.completions.create(prompt=ids, echo=True, **kw).choices[0].text
    assert text.startswith(load_tokenizer(server["target"]).decode(ids, skip_special_tokens=True))
    r = client.completions.create(prompt="hi", echo=True, logprobs=0, **kw)
    assert r.choices[0].logprobs.token_logprobs[0] is None


def test_a_llama3_style_model(server, tmp_path):
    """A tokenizer that prepends BOS with a template that starts with it: one BOS; a template's refusal is a 400
    naming messages; generation_config.json's temperature 0 makes unset temperatures greedy; a KV cache of exactly
    the context serves a chat without max_tokens."""
    from deployments.engine.tokenizer import chat_prompt_ids, load_tokenizer
    from tests.helpers import llama3_style

    path = llama3_style(Path(server["target"]), tmp_path / "llama3-style")
    ek = {"device": "cpu", "page_size": 4, "max_model_len": 256, "max_num_seqs": 2, "kv_cache_tokens": 256}
    with second_app(server, "l3", {"engine_kwargs": ek}, model_source=str(path)) as client:
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
        r = client.chat.completions.create(model="l3", messages=msgs)  # to the end of the context (or EOS)
        assert r.usage.prompt_tokens == len(chat_prompt_ids(load_tokenizer(str(path)), msgs))
        assert r.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="l3", messages=[{"role": "tool", "content": "x"}], max_tokens=2)
        assert "tool messages are not supported" in e.value.body["message"] and e.value.body["param"] == "messages"
        kw = dict(model="l3", prompt="def f(", max_tokens=8, extra_body={"ignore_eos": True})
        texts = {client.completions.create(seed=seed, **kw).choices[0].text for seed in (1, 2)}
        assert texts == {client.completions.create(temperature=0, **kw).choices[0].text}


def test_stream_interval_gathers_tokens(server):
    """stream_interval (as SGLang's): the first tokens go at once, then a send carries at least that many new
    tokens, the last one whatever is left; the streamed text still equals the non-streamed one."""
    with second_app(server, "si", {"stream_interval": 4, "stream_batching_interval_ms": 0}) as client:
        kw = dict(model="si", prompt="import os\n", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
        full = client.completions.create(**kw).choices[0]
        chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
        assert "".join(c.choices[0].text for c in chunks) == full.text and full.finish_reason == "length"
        # one token first, then sends of >= 4 tokens: 1 + 4 + 4 + 1 (the last one goes when the request finishes)
        assert 2 <= len(chunks) <= 4, [c.choices[0].text for c in chunks]


def test_stream_batching_interval_caps_sends(server):
    """stream_batching_interval_ms (as Ray Serve LLM's): after a send, a stream waits that long before the next one,
    so a stream of T seconds sends at most 2 + T / interval items (first and last at once); text unchanged."""
    interval_s = 0.1
    with second_app(server, "sb", {"stream_batching_interval_ms": interval_s * 1000}) as client:
        kw = dict(model="sb", prompt="import os\n", max_tokens=60, temperature=0, extra_body={"ignore_eos": True})
        full = client.completions.create(**kw).choices[0]
        t0 = time.perf_counter()
        chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
        took = time.perf_counter() - t0
        texts = [c.choices[0].text for c in chunks]
        assert "".join(texts) == full.text and full.finish_reason == "length", (texts, full)
        # (one send is possible: a fast machine can finish all 60 tokens before the stream's first send)
        assert 1 <= len(chunks) <= 2 + took / interval_s, (len(chunks), took, texts)
        assert len(chunks) < 60, texts  # tokens were gathered


def test_the_serving_benchmark_client_counts_every_token(server):
    """bench.serving's plain-HTTP client against the real server: at concurrency 2 (the server's max_num_seqs), every
    request streams exactly its fixed length (ignore_eos), its first token comes before its end, and the server's
    own step counters are read through the API key."""
    from bench.serving import run_rate, server_stats

    base = server["base"] + "/v1"
    prompts = [[5 + i, 9, 11 + i] for i in range(4)]
    before = server_stats(base, API_KEY)
    row = asyncio.run(run_rate(base, "tiny", prompts, [6] * 4, float("inf"), 2, API_KEY))
    after = server_stats(base, API_KEY)
    assert row["num_requests"] == 4 and row["output_tok_s"] > 0 and row["concurrency"] == 2, row
    assert 0 < row["ttft"]["median_ms"] <= row["ttft"]["p99_ms"], row
    assert row["accept_length"] > 1.0, row  # the target drafts for itself: its drafts are accepted
    assert after["step_time"]["steps"] > before["step_time"]["steps"], (before, after)


def test_a_stream_that_falls_behind_gets_the_missed_steps_together(server):
    """A RequestStream whose consumer was away while three steps came in gives them as one delta (text decoded
    once, in order); the last delta carries the totals. A consumer that keeps up gets each step on its own."""
    from deployments.engine.tokenizer import load_tokenizer
    from deployments.engine_client import EngineClient, RequestStream

    client = EngineClient(None, "tiny")
    client.tokenizer = load_tokenizer(server["target"])
    ids = client.tokenizer.encode("def main():\n    return 1\n", add_special_tokens=False)

    async def run(keep_up: bool) -> list:
        stream = RequestStream(client, "r", 5, [], time.time(), 1, 0.0)
        client._streams["r"] = stream
        got = []
        steps = [ids[:2], ids[2:5], ids[5:]]
        if not keep_up:
            for k, step in enumerate(steps):
                stream.put(("r", step, "length" if k == 2 else None, None, None,
                            {"spec": None, "error": None} if k == 2 else None))
        it = stream.__aiter__()
        for k, step in enumerate(steps):
            if keep_up:
                stream.put(("r", step, "length" if k == 2 else None, None, None, {} if k == 2 else None))
            got.append(await it.__anext__())
            if not keep_up:
                break
        return got

    behind = asyncio.run(run(False))
    assert len(behind) == 1 and behind[0].token_ids == ids and behind[0].finish_reason == "length"
    assert behind[0].text == client.tokenizer.decode(ids, skip_special_tokens=True)
    assert (behind[0].prompt_tokens, behind[0].completion_tokens) == (5, len(ids))
    kept = asyncio.run(run(True))
    assert [d.token_ids for d in kept] == [ids[:2], ids[2:5], ids[5:]]
    assert "".join(d.text for d in kept) == behind[0].text and kept[-1].completion_tokens == len(ids)


def test_a_stop_string_found_in_the_ingress_ends_the_request_in_the_engine(server, client):
    """The ingress finds stop strings (the engine deals in token ids): the text ends before the stop, nothing after
    it is sent, and the engine drops the request within a step or two instead of decoding to max_tokens."""
    kw = dict(model="tiny", prompt="def main():", temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(max_tokens=24, **kw).choices[0].text
    stop = full[8:11]
    assert stop and full.index(stop) >= 1, full
    before = _stats(server)
    r = client.completions.create(max_tokens=200, stop=[stop], **kw)
    streamed = [c for c in client.completions.create(max_tokens=200, stop=[stop], stream=True, **kw) if c.choices]
    after = _stats(server)
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "stop"
    # two requests of about 24 tokens (rounds of up to 3), not of 200
    assert after["step_time"]["steps"] - before["step_time"]["steps"] < 2 * 24, (before, after)
    deadline = time.time() + 10
    while _stats(server)["kv_usage"] > 0 and time.time() < deadline:
        time.sleep(0.1)
    assert _stats(server)["kv_usage"] == 0.0


def test_300_concurrent_streams_get_every_token_once(server):
    """300 streams at once (a queue deep enough for them) through two ingress replicas into one engine core (each
    replica's outputs pushed to it): each streams exactly its 8 tokens, its text equals the same prompt's
    non-streamed greedy text, usage counts 8, and the KV cache is empty afterwards."""
    import httpx

    app = {"engine_kwargs": {"device": "cpu", "page_size": 4, "max_model_len": 256, "max_num_seqs": 32,
                             "max_queue_len": 512},
           "ingress_deployment_config": {"max_ongoing_requests": 512, "num_replicas": 2}}
    prompts = [f"import mod{i}\n" for i in range(10)]
    with second_app(server, "many", app) as client:
        refs = [client.completions.create(model="many", prompt=p, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text for p in prompts]

        async def one(http, i: int) -> tuple[int, str, int]:
            body = {"model": "many", "prompt": prompts[i % 10], "max_tokens": 8, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            text, usage = [], None
            async with http.stream("POST", f"{server['base']}/many/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        text += [c["text"] for c in chunk["choices"]]
                        usage = chunk.get("usage") or usage
            return i, "".join(text), usage["completion_tokens"]

        async def all_at_once():
            limits = httpx.Limits(max_connections=300)
            async with httpx.AsyncClient(timeout=300, limits=limits) as http:
                return await asyncio.gather(*(one(http, i) for i in range(300)))

        results = asyncio.run(all_at_once())
        assert all(n == 8 for _, _, n in results)
        wrong = [(i, t) for i, t, _ in results if t != refs[i % 10]]
        assert not wrong, wrong[:3]
        stats = httpx.get(f"{server['base']}/many/v1/stats", timeout=30).json()
        assert stats["kv_usage"] == 0.0 and stats["running"] == 0, stats
        assert stats["loop"]["clients"] == 2, stats  # both ingress replicas joined the core


def test_the_api_key_comes_from_a_file_or_the_environment_and_never_reaches_the_logs(server):
    """The key is read where the ingress runs (a file, or the environment variable api_key_env names), compared in
    constant time, refused in the application args (Serve logs those), and absent from every log file of the Ray
    session after requests with it and with wrong keys."""
    from deployments.config import LLMConfig

    with pytest.raises(ValueError, match="api_key in the application args would be written to Serve's logs"):
        LLMConfig(model_loading_config={"model_id": "m", "model_source": "/x"}, api_key="k")
    with second_app(server, "envkey", {"api_key_env": "SPECSERVE_TEST_KEY_ENV"}):
        url = f"{server['base']}/envkey/v1/models"
        assert httpx.get(url, timeout=30).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer " + ENV_KEY[:-1]}, timeout=30).status_code == 401
        assert httpx.get(url, headers={"Authorization": f"Bearer {ENV_KEY}"}, timeout=30).status_code == 200
    assert httpx.get(server["base"] + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"},
                     timeout=30).status_code == 200
    import ray

    logs = [p for p in Path(ray._private.worker.global_worker.node.get_logs_dir_path()).rglob("*") if p.is_file()]
    assert any(b"OpenAIIngress" in p.read_bytes() for p in logs)  # the replicas' logs are among those read
    leaked = [str(p) for p in logs if any(k.encode() in p.read_bytes() for k in (API_KEY, ENV_KEY))]
    assert not leaked, leaked


def test_what_starlette_refuses_is_answered_in_openai_shape(server):
    """Unknown routes (404), wrong methods (405), a body that is not JSON (400), and a body over
    max_request_body_bytes (413, refused on its Content-Length before it is read, or as its bytes come in when it is
    sent without one): every answer is OpenAI's error object, and none echoes the body."""
    h = {"Authorization": f"Bearer {API_KEY}"}
    base = server["base"]

    def error_of(r: httpx.Response, status: int) -> dict:
        assert r.status_code == status, (r.status_code, r.text[:300])
        body = r.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        return body["error"]

    assert "no such route" in error_of(httpx.get(base + "/v1/nothing", headers=h, timeout=30), 404)["message"]
    assert "method" in error_of(httpx.get(base + "/v1/completions", headers=h, timeout=30), 405)["message"]
    as_json = {**h, "Content-Type": "application/json"}
    bad = error_of(httpx.post(base + "/v1/completions", content=b'{"prompt": "x", ', headers=as_json, timeout=30), 400)
    assert "not valid JSON" in bad["message"] and bad["param"] is None
    huge = b'{"prompt": "' + b"a" * (17 << 20) + b'"}'  # over the 16 MiB default
    t0 = time.perf_counter()
    big = error_of(httpx.post(base + "/v1/completions", content=huge, headers=h, timeout=60), 413)
    assert big["code"] == "request_too_large" and time.perf_counter() - t0 < 10

    def chunks():  # no Content-Length: the limit applies to the bytes as they come
        for _ in range(20):
            yield b"a" * (1 << 20)

    error_of(httpx.post(base + "/v1/completions", content=chunks(), headers=h, timeout=60), 413)
    long_value = "x" * 100_000  # a field's bad value is named, not echoed back
    r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "temperature": long_value}, headers=h, timeout=30)
    assert error_of(r, 400)["param"] == "temperature" and len(r.text) < 2000


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"prompt": "\\ud800 lone", "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
     "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": null}]}]}',
     "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [5]}]}', "messages"),
    ("/v1/completions", '{"model": "\\ud800", "prompt": "hi"}', "model"),
    ("/v1/completions", '{"prompt": [-1], "echo": true, "max_tokens": 1}', "prompt"),
    ("/v1/completions", '{"prompt": [8589934592], "echo": true, "max_tokens": 1}', "prompt"),
])
def test_inputs_that_used_to_give_500s_get_a_400_or_404_naming_the_parameter(server, path, body, param):
    """Lone surrogates (which JSON's \\u escapes can carry) in a prompt, a chat message or the model name, and chat
    content parts that are not text objects: an OpenAI-shaped 4xx naming the parameter, never a 500."""
    r = httpx.post(server["base"] + path, content=body.encode(), timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code in (400, 404), (r.status_code, r.text[:300])
    assert r.json()["error"]["param"].split(".")[0] == param, r.text  # (a field's path within it, if known)


def test_stop_token_text_is_not_output_and_min_tokens_defers_stop_strings(server, client):
    """As vLLM: a stop_token_ids token counts in usage but its text is not output (streamed or not); with
    min_tokens, a stop string found before the output has more than min_tokens tokens does not end it."""
    from deployments.engine.engine import Engine
    from deployments.engine.request import SamplingParams
    from workers.config import EngineConfig

    kw = dict(model="tiny", prompt="import os\n", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    free = client.completions.create(**kw).choices[0].text
    # the served greedy tokens (lossless speculation: the target's own greedy ones), from the engine in-process
    eng = Engine(EngineConfig(model=server["target"], device="cpu", max_model_len=256))
    prompt = eng.tokenizer.encode("import os\n", add_special_tokens=True)
    ids = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    eng.shutdown()
    tok = eng.tokenizer
    assert tok.decode(ids, skip_special_tokens=True) == free
    j = next(i for i in range(2, len(ids)) if tok.decode([ids[i]]) and ids[i] not in ids[:i])
    r = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "stop_token_ids": [ids[j]]}})
    before = tok.decode(ids[:j], skip_special_tokens=True)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == before, (r.choices[0].text, before)
    assert r.usage.completion_tokens == j + 1 and r.choices[0].model_extra["stop_reason"] == ids[j]
    chunks = [c.choices[0] for c in client.completions.create(
        stream=True, **{**kw, "extra_body": {"ignore_eos": True, "stop_token_ids": [ids[j]]}}) if c.choices]
    assert "".join(c.text for c in chunks) == before and chunks[-1].model_extra["stop_reason"] == ids[j]
    stop = free[1:3]  # a stop string inside the first tokens' text
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    held = client.completions.create(stop=[stop], **{**kw, "extra_body": {"ignore_eos": True, "min_tokens": 6}})
    assert cut.text == free[:1] and cut.finish_reason == "stop" and cut.model_extra["stop_reason"] == stop
    assert held.choices[0].text.startswith(free[:3]) and held.usage.completion_tokens >= 6


def test_spec_decode_stats_cover_every_choice(client):
    """n choices are n engine requests: the response's spec_decode_stats sum all of their rounds (one choice's
    rounds can hold at most max_tokens - 1 drafted or accepted tokens), streamed or not."""
    kw = dict(model="tiny", prompt="import os\n", max_tokens=12, temperature=0, n=2, extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    spec = r.model_extra["spec_decode_stats"]
    assert r.usage.completion_tokens == 24
    assert 11 < spec["num_drafts"] + spec["num_accepted_tokens"] <= 22, spec
    assert sum(spec["accepted_per_position"]) == spec["num_accepted_tokens"]
    last = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))[-1]
    assert last.model_extra["spec_decode_stats"] == spec


def test_a_non_finite_number_is_refused_as_such(server):
    """NaN or Infinity (JSON extensions Python writes) in a float field: a 400 naming the field, saying it must be
    finite (not that it is out of range)."""
    h = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    for value in ("NaN", "Infinity"):
        r = httpx.post(server["base"] + "/v1/completions", headers=h, timeout=120,
                       content='{"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": %s}' % value)
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
        assert "finite" in r.json()["error"]["message"], r.text
