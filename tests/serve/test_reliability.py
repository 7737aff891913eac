"""Reliability on a real Serve application over HTTP: hostile requests (property-based, with hypothesis), a storm of
dropped streams, an exhausted KV cache, and the API key on every route. The strategies and the checks of an answer
are bench/reliability.py's (its benchmark reports the same figures against `serve run configs/local.yaml`).

(300 concurrent streams with every token once, one disconnect freeing its KV, the key in no log file, and what
Starlette refuses are in test_serve.py.)"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from pathlib import Path

import httpx
import pytest

from bench.reliability import CHAT, COMPLETIONS, Outcome, Probe, fuzz, send
from tests.serve.conftest import API_KEY, second_app

AUTH = {"Authorization": f"Bearer {API_KEY}"}
FUZZ_REQUESTS = 2000


def stats(base: str) -> dict:
    return httpx.get(base + "/v1/stats", headers=AUTH, timeout=30).json()


def wait_idle(base: str, timeout_s: float = 30.0) -> dict:
    """The application's /v1/stats once nothing runs or waits and the KV cache is empty (or the last seen)."""
    deadline = time.time() + timeout_s
    while True:
        s = stats(base)
        if (s["running"], s["waiting"], s["kv_usage"]) == (0, 0, 0.0) or time.time() > deadline:
            return s
        time.sleep(0.1)


@pytest.fixture(scope="module")
def fuzz_app(server):
    """An application with room for the fuzzer's load (a queue deep enough for n=128 at every slot of its
    concurrency, so no request is refused as overload), speculating like the main one, behind the same key. Its KV
    cache holds 192 tokens, less than the context: requests wait for pages and are preempted under load."""
    spec = {"method": "draft", "model": server["target"], "num_steps": 2}
    app = {"api_key_file": server["key_file"], "ingress_deployment_config": {"max_ongoing_requests": 1024},
           "engine_kwargs": {"device": "cpu", "page_size": 4, "max_model_len": 256, "max_num_seqs": 32,
                             "kv_cache_tokens": 192, "max_queue_len": 8192, "speculative_config": spec}}
    with second_app(server, "fz", app):
        yield {"base": f"{server['base']}/fz", "model": "fz", "vocab": 512}


def _report(bad: list[Outcome]) -> str:
    """The distinct problems, each with one request that shows it (to replay as a regression test)."""
    first: dict[str, Outcome] = {}
    for o in bad:
        first.setdefault(o.problem[:60], o)
    return "\n".join(f"{len([b for b in bad if b.problem[:60] == k])}x {o.problem[:300]}\n    {o.probe!r}"
                     for k, o in first.items())


def test_the_fuzzers_hostile_values_hold_no_strategy_inside_a_plain_value():
    """A strategy written inside a literal list (``["a", lone]``) is sent as the object, and only on the run that
    draws it (a TypeError in the fuzzer then, not a finding): every table of values is built with the check on, and
    the check itself refuses one."""
    import hypothesis.strategies as st

    from bench import reliability

    for chat in (False, True):
        reliability.fields(chat, 512)
    reliability.prompts(512)
    reliability.messages()
    with pytest.raises(TypeError, match="strategy inside a plain value"):
        reliability.bad(["a", st.just("x")])
    with pytest.raises(TypeError, match="strategy inside a plain value"):
        reliability.either({"k": [1, st.none()]})


def test_fuzzed_requests_get_a_valid_answer_or_an_openai_error(fuzz_app):
    """2,000 distinct hostile requests (derandomized: the same every run), 32 at a time: each is answered, within the
    client's timeout, with a valid response or stream or an OpenAI-shaped 4xx that leaks nothing; never a 5xx.
    Afterwards nothing runs and the KV cache is empty."""
    t0 = time.perf_counter()
    outcomes = fuzz(fuzz_app["base"], fuzz_app["model"], fuzz_app["vocab"], API_KEY, FUZZ_REQUESTS, concurrency=32,
                    timeout_s=60)
    took = time.perf_counter() - t0
    bad = [o for o in outcomes if o.problem]
    assert not bad, f"{len(bad)} of {len(outcomes)} answers break the property:\n{_report(bad)}"
    kinds = collections.Counter(o.kind for o in outcomes)
    streams = sum(o.status == 200 and o.content_type.startswith("text/event-stream") for o in outcomes)
    print(f"{len(outcomes)} fuzzed requests in {took:.1f}s: {dict(kinds)}, {streams} streams")
    # the strategies reach generation (streamed and not), not only the validation
    assert len(outcomes) == FUZZ_REQUESTS and kinds["2xx"] >= FUZZ_REQUESTS // 5 and streams >= 50, (kinds, streams)
    idle = wait_idle(fuzz_app["base"])
    assert (idle["running"], idle["waiting"], idle["kv_usage"]) == (0, 0, 0.0), idle


def _send_one(base: str, probe: Probe) -> Outcome:
    async def go():
        async with httpx.AsyncClient(timeout=None) as http:
            return await send(http, base, probe, 60)
    return asyncio.run(go())


def _probe(path: str, body: bytes | None, method: str = "POST", headers: dict | None = None) -> Probe:
    hs = {"Content-Type": "application/json", **AUTH, **(headers or {})}
    return Probe(method, path, tuple(hs.items()), body)


# What the fuzzer found (each a request it sent), now answered as it should be
@pytest.mark.parametrize("probe,status,param", [
    # a trailing slash was a 307 redirect with an empty body; now the 404 of any unknown path
    (_probe(COMPLETIONS + "/", b'{"prompt": "hi", "max_tokens": 2}'), 404, None),
    (_probe(CHAT + "/", b"", method="GET", headers={"Accept": "text/event-stream"}), 404, None),
    # a seed outside int64 was refused by the engine without naming the parameter
    (_probe(COMPLETIONS, b'{"prompt": "hi", "max_tokens": 2, "seed": 18446744073709551616}'), 400, "seed"),
    (_probe(CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "seed": -9223372036854775809}'), 400, "seed"),
    # an empty prompt (as text, ids, or a batch of one) likewise
    (_probe(COMPLETIONS, b'{"prompt": "", "max_tokens": 2}'), 400, "prompt"),
    (_probe(COMPLETIONS, b'{"prompt": [[]], "max_tokens": 2}'), 400, "prompt"),
    # batches: a member that is empty or of the other kind; max_tokens 0 without echo (nothing to answer)
    (_probe(COMPLETIONS, b'{"prompt": [[1], []], "max_tokens": 2}'), 400, "prompt"),
    (_probe(COMPLETIONS, b'{"prompt": ["a", ""], "max_tokens": 2}'), 400, "prompt"),
    (_probe(COMPLETIONS, b'{"prompt": "a", "max_tokens": 0}'), 400, "max_tokens"),
    (_probe(COMPLETIONS, b'{"prompt": ["a", "b"], "max_tokens": 0, "echo": true, "logprobs": 2}'), 200, None),
    (_probe("/v1/models/other", None, "GET"), 404, "model"),
])
def test_what_the_fuzzer_found(fuzz_app, probe, status, param):
    out = _send_one(fuzz_app["base"], probe)
    assert out.problem is None and out.status == status, (out.status, out.body[:300])
    if status >= 400:
        assert json.loads(out.body)["error"]["param"] == param


@pytest.mark.xfail(strict=True, reason="Ray Serve's proxy decodes the x-request-id header as UTF-8 before the "
                   "application runs and answers a UnicodeDecodeError with its own plain-text 500 (upstream)")
def test_a_request_id_that_is_not_utf8(fuzz_app):
    probe = _probe(COMPLETIONS, b'{"prompt": "hi", "max_tokens": 2}', headers={"X-Request-Id": "\u00e9"})
    out = _send_one(fuzz_app["base"], probe)
    assert out.problem is None, (out.status, out.body[:200])


def test_a_storm_of_dropped_streams_frees_every_request(fuzz_app):
    """150 streams at once on a server that runs 32: a third dropped as soon as the response starts (most of them
    still waiting), a third after the first tokens, a third after a few chunks. Soon nothing runs or waits, the KV
    cache is empty, and a greedy request still gets the answer it got before the storm."""
    base, model = fuzz_app["base"], fuzz_app["model"]
    greedy = {"model": model, "prompt": "def main():", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    before = httpx.post(base + COMPLETIONS, json=greedy, headers=AUTH, timeout=120).json()["choices"][0]["text"]

    async def one(http, i: int) -> int:
        body = {"model": model, "prompt": f"import mod{i}\n", "max_tokens": 100, "ignore_eos": True, "stream": True}
        chunks = 0
        async with http.stream("POST", base + COMPLETIONS, json=body, headers=AUTH) as resp:
            assert resp.status_code == 200
            if i % 3 == 0:
                return 0
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if chunks >= (1 if i % 3 == 1 else 4):
                        break
        return chunks  # leaving the block closes the connection mid-stream

    async def storm():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=150)) as http:
            return await asyncio.gather(*(one(http, i) for i in range(150)))

    chunks = asyncio.run(storm())
    assert sum(c > 0 for c in chunks) == 100, chunks
    t0 = time.perf_counter()
    idle = wait_idle(base)
    assert (idle["running"], idle["waiting"], idle["kv_usage"]) == (0, 0, 0.0), idle
    print(f"idle {time.perf_counter() - t0:.2f}s after 150 dropped streams")
    after = httpx.post(base + COMPLETIONS, json=greedy, headers=AUTH, timeout=120).json()["choices"][0]["text"]
    assert after == before
    # a client that leaves is no internal error (each was logged as one, with Ray's traceback)
    import ray

    logs = [p for p in Path(ray._private.worker.global_worker.node.get_logs_dir_path()).rglob("*") if p.is_file()]
    errors = [line for p in logs for line in p.read_text(errors="replace").splitlines() if "internal error on" in line]
    assert not errors, errors[:3]


def test_an_exhausted_kv_cache_preempts_and_every_answer_stays_exact(server, fuzz_app):
    """16 streams at once into a KV cache of 192 tokens (each needs about 50 by its end, with the speculative
    round's lookahead): requests wait for pages and running ones are preempted and recomputed, yet every streamed
    text equals the same prompt's greedy answer from an engine with room for all, with 40 tokens (none lost or
    repeated), and the cache ends empty. A request that could never fit is a 400 at once, not a wait."""
    from deployments.engine.engine import Engine
    from deployments.engine.request import SamplingParams
    from workers.config import EngineConfig

    base = fuzz_app["base"]
    prompts = [f"x{i} = {i} * 7\n" for i in range(16)]
    offline = Engine(EngineConfig(model=server["target"], device="cpu", max_model_len=256, page_size=4))
    refs = [c.text for c in offline.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0,
                                                                     ignore_eos=True))]
    assert offline.scheduler.num_preemptions == 0  # (the answers without preemption)

    async def one(http, i: int) -> tuple[str, int]:
        body = {"model": "fz", "prompt": prompts[i], "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "stream": True, "logprobs": 0}
        text, tokens = [], 0
        async with http.stream("POST", base + COMPLETIONS, json=body, headers=AUTH) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text.append(choice["text"])
                    tokens += len(choice["logprobs"]["tokens"]) if choice["logprobs"] else 0
        return "".join(text), tokens

    async def all_at_once():
        async with httpx.AsyncClient(timeout=300) as http:
            return await asyncio.gather(*(one(http, i) for i in range(16)))

    before = stats(base)["preemptions"]
    results = asyncio.run(all_at_once())
    assert stats(base)["preemptions"] > before
    assert [text for text, _ in results] == refs
    assert [tokens for _, tokens in results] == [40] * 16
    idle = wait_idle(base)
    assert (idle["running"], idle["waiting"], idle["kv_usage"]) == (0, 0, 0.0), idle
    t0 = time.perf_counter()
    r = httpx.post(base + COMPLETIONS, json={"prompt": "hi", "max_tokens": 200}, headers=AUTH, timeout=30)
    assert r.status_code == 400 and "KV pages" in r.json()["error"]["message"], r.text
    assert time.perf_counter() - t0 < 5


# Every route and the forms a key can take. As vLLM: only `Authorization: Bearer <key>`, the scheme as written
# (vLLM compares the whole header too). Unlike vLLM, which checks only paths under /v1, every path but /health
# needs the key (the API docs, unknown paths): an unauthenticated client learns nothing about the routes.
ROUTES = [("POST", COMPLETIONS, 200), ("POST", CHAT, 200), ("GET", "/v1/models", 200), ("GET", "/v1/stats", 200),
          ("GET", "/v1/nothing", 404), ("GET", "/docs", 200), ("GET", "/openapi.json", 200), ("GET", "/metrics", 404),
          ("GET", COMPLETIONS, 405), ("DELETE", "/v1/models", 405)]
KEY_FORMS = {
    "none": ({}, False), "wrong": ({"Authorization": "Bearer wrong"}, False),
    "prefix of the key": ({"Authorization": f"Bearer {API_KEY[:-1]}"}, False),
    "key and more": ({"Authorization": f"Bearer {API_KEY}x"}, False),
    "no scheme": ({"Authorization": API_KEY}, False),
    "lower-case scheme": ({"Authorization": f"bearer {API_KEY}"}, False),
    "two spaces": ({"Authorization": f"Bearer  {API_KEY}"}, False),
    "basic": ({"Authorization": f"Basic {API_KEY}"}, False),
    "x-api-key": ({"X-API-Key": API_KEY}, False), "api-key": ({"api-key": API_KEY}, False),
    "query": ({"__query": f"api_key={API_KEY}"}, False),
    "right": ({"Authorization": f"Bearer {API_KEY}"}, True),
}


@pytest.mark.parametrize("form", sorted(KEY_FORMS))
def test_auth_matrix(server, form):
    headers, accepted = KEY_FORMS[form]
    headers = dict(headers)
    query = headers.pop("__query", None)
    bodies = {COMPLETIONS: {"prompt": "hi", "max_tokens": 1},
              CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}}
    for method, path, ok_status in ROUTES:
        url = server["base"] + path + (f"?{query}" if query else "")
        body = bodies.get(path) if method == "POST" else None
        r = httpx.request(method, url, json=body, headers=headers, timeout=60)
        if accepted:
            assert r.status_code == ok_status, (method, path, r.status_code, r.text[:200])
        else:
            assert r.status_code == 401, (method, path, r.status_code)
            assert r.json() == {"error": {"message": "invalid or missing API key", "type": "authentication_error",
                                          "param": None, "code": "invalid_api_key"}}
        if r.status_code >= 400:
            assert Outcome(Probe(method, path, (), None), r.status_code, "", r.content).problem is None
    assert httpx.get(server["base"] + "/health", headers=headers, timeout=60).status_code == 200  # probes: no key
