"""Data parallel on a real Ray Serve application over HTTP: engine replicas (each its own core and worker) behind the
ingress's prefix-aware router, autoscaled from one to two on the engines' load. Then: distinct prompts spread over
both, prompts sharing a prefix land on one, load imbalance falls back to the least loaded, usage carries
cached_tokens, and killing one replica's core keeps the service answering until Serve's replacement joins. The
tests run in order (the first scales up; the kill is last)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.helpers import serve_app

APP = "dp"
SYSTEM = ("You are a careful assistant. Answer in one short sentence, cite no sources, and never repeat the "
          "question. Context: the quick brown fox jumps over the lazy dog while the cat sleeps. ")


@pytest.fixture(scope="module")
def base(tiny_models):
    args = {"model_loading_config": {"model_id": "tiny", "model_source": str(tiny_models["llama"])},
            "engine_kwargs": {"device": "cpu", "page_size": 4, "max_model_len": 512, "max_num_seqs": 8},
            # one engine replica, a second one when the engines carry more than 2 requests each; no downscaling
            # within the test (deployments/autoscaling.py's policy, set by the builder)
            "deployment_config": {"autoscaling_config": {
                "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2, "upscale_delay_s": 0,
                "downscale_delay_s": 600, "look_back_period_s": 2, "metrics_interval_s": 0.5}},
            "request_router": {"imbalanced_threshold": 2, "block_tokens": 4}}
    with serve_app(args, APP, num_cpus=6) as url:
        yield url


def _stats(base: str) -> dict:
    return httpx.get(base + "/v1/stats", timeout=30).json()


def _names(base: str) -> set[str]:
    """The engine cores the ingress routes to (one core's stats come without the per-replica breakdown)."""
    s = _stats(base)
    return set(s["replicas"]) if "replicas" in s else set(s["router"]["in_flight"])


def _requests(base: str) -> dict[str, int]:
    return {name: s["requests"] for name, s in _stats(base)["replicas"].items()}


def _delta(before: dict, after: dict) -> dict[str, int]:
    return {name: n - before.get(name, 0) for name, n in after.items()}


def _complete(base: str, prompt: str, max_tokens: int = 2) -> dict:
    r = httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200, r.text[:300]
    return r.json()


def test_autoscaling_adds_an_engine_replica_under_load(base):
    """Eight long requests on the one engine (load 8 > target 2): Serve's controller adds the second replica, whose
    core the ingress finds and routes to."""
    assert len(_names(base)) == 1

    async def run():
        async with httpx.AsyncClient(base_url=base, timeout=300) as client:
            async def one(i):
                r = await client.post("/v1/completions", json={"prompt": f"Load {i}:", "max_tokens": 480,
                                                               "ignore_eos": True})
                assert r.status_code == 200, r.text[:300]

            load = asyncio.ensure_future(asyncio.gather(*(one(i) for i in range(8))))
            t0 = time.monotonic()
            while len(await asyncio.to_thread(_names, base)) < 2:
                assert time.monotonic() - t0 < 180, "no second engine replica"
                await asyncio.sleep(0.5)
            print(f"the second engine replica joined {time.monotonic() - t0:.1f} s after the load started")
            await load

    asyncio.run(run())


def test_distinct_prompts_spread_over_both_replicas(base):
    before = _requests(base)
    words = ["Alpha", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot", "Golf", "Hotel"]
    for i, word in enumerate(words):  # one after another: equal load, so the replica with the smaller tree takes each
        _complete(base, f"{word} {i * 7919 % 1000} is a number; what is {i * 104729 % 1000} plus three?")
    got = _delta(before, _requests(base))
    assert sorted(got.values()) != [0, 8] and min(got.values()) >= 2, got
    # the engines' host time per step, all replicas together (as one core's stats have it): their sums
    s = _stats(base)
    per = [r["step_time"] for r in s["replicas"].values()]
    assert len(per) == 2 and all(p["steps"] > 0 for p in per), per
    for key in ("steps", "schedule_s", "execute_s", "outputs_s"):
        assert s["step_time"][key] == pytest.approx(sum(p[key] for p in per)), (key, s["step_time"], per)
    assert s["loop"]["busy_s"] == pytest.approx(sum(r["loop"]["busy_s"] for r in s["replicas"].values()))


def test_a_shared_prefix_lands_on_one_replica_and_usage_has_cached_tokens(base):
    before = _requests(base)
    cached = []
    for i in range(6):
        body = _complete(base, SYSTEM + f"Question {i}: name a colour.")
        details = body["usage"]["prompt_tokens_details"]
        assert set(details) == {"cached_tokens"} and 0 <= details["cached_tokens"] < body["usage"]["prompt_tokens"]
        cached.append(details["cached_tokens"])
    got = _delta(before, _requests(base))
    assert sorted(got.values()) == [0, 6], got
    if "prefix_cache_hits" in next(iter(_stats(base)["replicas"].values())):  # an engine with a prefix cache
        # every request after the first found the shared prefix on the replica it was routed to
        assert all(c >= 32 for c in cached[1:]), cached
    # chat, streamed with include_usage: the usage chunk has the same shape
    with httpx.stream("POST", base + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}], "max_tokens": 3,
            "stream": True, "stream_options": {"include_usage": True}}) as r:
        import json

        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0 and usage["completion_tokens"] == 3, usage


def test_imbalance_falls_back_to_the_least_loaded_replica(base):
    """Six long requests with one prefix at once: the prefix's replica takes them until it leads the other by more
    than imbalanced_threshold (2), then the other takes some."""
    before = _requests(base)
    decisions = _stats(base)["router"]["decisions"]

    async def run():
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            async def one(i):
                r = await client.post("/v1/completions", json={"prompt": SYSTEM + f"Long answer {i}:",
                                                               "max_tokens": 120, "ignore_eos": True})
                assert r.status_code == 200, r.text[:300]

            await asyncio.gather(*(one(i) for i in range(6)))

    asyncio.run(run())
    got = _delta(before, _requests(base))
    after = _stats(base)["router"]["decisions"]
    assert min(got.values()) >= 2, got
    assert after["imbalanced"] > decisions["imbalanced"], (decisions, after)


def test_killing_one_replicas_core_keeps_the_service_answering(base):
    import ray

    from deployments.controller import CORE_NAMESPACE

    names = sorted(_stats(base)["replicas"])
    victim = ray.get_actor(names[0], namespace=CORE_NAMESPACE)
    ray.kill(victim, no_restart=True)
    t0 = time.monotonic()
    for i in range(6):  # every request is answered: the dead core's share goes to the other
        _complete(base, SYSTEM + f"After the kill {i}:")
    now = _names(base)
    assert names[0] not in now and names[1] in now, now
    # Serve replaces the replica whose core died; its new core joins the router
    while True:
        replicas = _names(base)
        if len(replicas) == 2 and names[0] not in replicas:
            break
        assert time.monotonic() - t0 < 120, replicas
        time.sleep(0.5)
    print(f"the replacement joined {time.monotonic() - t0:.1f} s after the kill")
    before = _requests(base)
    for word in ["India", "Juliet", "Kilo", "Lima"]:  # new prompts: the new replica's tree is the smallest
        _complete(base, f"{word} is a word of the spelling alphabet.")
    (new,) = replicas - {names[1]}
    assert _delta(before, _requests(base))[new] >= 1


def test_a_draining_replica_finishes_its_streams_and_takes_no_new_requests(base):
    """What a replica does when Serve stops it (scaled down, updated; LLMController.__del__): its core refuses new
    requests as draining, the ingress sends them to the other replica, and the stream it runs completes."""
    import ray

    from deployments.controller import CORE_NAMESPACE

    before = _requests(base)

    async def run():
        async with httpx.AsyncClient(base_url=base, timeout=300) as client:
            long = asyncio.ensure_future(client.post("/v1/completions", json={
                "prompt": "Mike is a word of the spelling alphabet.", "max_tokens": 400, "ignore_eos": True}))
            while True:  # until the long request is in an engine
                got = {k: v for k, v in _delta(before, await asyncio.to_thread(_requests, base)).items() if v}
                if got:
                    break
                await asyncio.sleep(0.05)
            (busy,) = got
            drained = ray.get_actor(busy, namespace=CORE_NAMESPACE).drain.remote(120)
            mid = await asyncio.to_thread(_requests, base)
            for word in ["November", "Oscar", "Papa", "Quebec"]:
                r = await client.post("/v1/completions", json={"prompt": f"{word} is a word.", "max_tokens": 2})
                assert r.status_code == 200, r.text[:300]
            after = await asyncio.to_thread(_requests, base)
            r = await long
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 400, r.text[:300]
            assert await asyncio.to_thread(ray.get, drained, timeout=60) is True
            return busy, _delta(mid, after)

    busy, new = asyncio.run(run())
    assert new[busy] == 0 and sum(new.values()) == 4, new
