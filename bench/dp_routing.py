"""Prefix-cache hit rate with data-parallel engine replicas: the ingress's prefix-aware router against least-loaded
routing, on one Ray Serve instance (CPU, a tiny random model).

Workload: P system prompts (~470 tokens each) x Q questions, shuffled, C requests in flight; each policy gets a fresh
application of R engine replicas with the same KV budget. The figure is the prompt tokens the engines found in their
prefix caches (usage.prompt_tokens_details.cached_tokens, and the engines' prefix_cache_hits / _queries), which
needs an engine with a prefix cache.

    python3 -m bench.dp_routing --out bench/results/serving/cpu_dp_routing
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

from bench.common import command, commit, out_path, write_json, write_markdown

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def run_policy(base: str, name: str, model: str, policy: str, args, work, systems) -> dict:
    import httpx
    from ray import serve

    from deployments.app import build_app
    from tests.helpers import wait_healthy

    app = {"model_loading_config": {"model_id": "tiny", "model_source": model},
           "engine_kwargs": {"device": "cpu", "page_size": 4, "max_model_len": 1024, "max_num_seqs": 8,
                             "kv_cache_tokens": args.kv_cache_tokens},
           "deployment_config": {"num_replicas": args.replicas}, "request_router": {"policy": policy}}
    serve.run(build_app(app), name=name, route_prefix=f"/{name}", blocking=False)
    url = f"{base}/{name}"
    wait_healthy(url)
    while len(httpx.get(url + "/v1/stats", timeout=30).json().get("replicas", {})) < args.replicas:
        time.sleep(0.5)

    async def go():
        sem = asyncio.Semaphore(args.concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            async def one(s, i):
                async with sem:
                    r = await client.post("/v1/completions", json={"prompt": systems[s] + f" question {i}?",
                                                                   "max_tokens": 8})
                    return r.json()["usage"]
            return await asyncio.gather(*(one(s, i) for s, i in work))

    t0 = time.time()
    usages = asyncio.run(go())
    wall = time.time() - t0
    stats = httpx.get(url + "/v1/stats", timeout=30).json()
    serve.delete(name)
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    return {"policy": policy, "requests": len(usages), "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": cached / prompt, "wall_s": round(wall, 2),
            "engine_hits": sum(r.get("prefix_cache_hits", 0) for r in stats["replicas"].values()),
            "engine_queries": sum(r.get("prefix_cache_queries", 0) for r in stats["replicas"].values()),
            "per_replica": [r["requests"] for r in stats["replicas"].values()],
            "decisions": stats["router"]["decisions"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--prefixes", type=int, default=16)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--kv-cache-tokens", type=int, default=4096, help="per replica: less than all prefixes need")
    ap.add_argument("--out", default="bench/results/serving/cpu_dp_routing")
    args = ap.parse_args()

    import ray
    from ray import serve

    from deployments.make_tiny import make_tiny
    from tests.helpers import free_port

    rng = random.Random(0)
    systems = [" ".join(rng.choice(WORDS) for _ in range(120)) for _ in range(args.prefixes)]
    work = [(s, i) for i in range(args.questions) for s in range(args.prefixes)]
    rng.shuffle(work)
    model = str(make_tiny("llama", Path(tempfile.mkdtemp()) / "tiny", layers=2, hidden=64, vocab=512,
                          max_position=1024))
    port = free_port()
    ray.init(num_cpus=2 + 2 * args.replicas, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        rows = [run_policy(f"http://127.0.0.1:{port}", policy.replace("_", ""), model, policy, args, work, systems)
                for policy in ("prefix_aware", "least_loaded")]
    finally:
        serve.shutdown()
        ray.shutdown()
    out = out_path(args.out)
    meta = {"commit": commit(), "command": command(), "replicas": args.replicas, "prefixes": args.prefixes,
            "questions": args.questions, "concurrency": args.concurrency, "kv_cache_tokens": args.kv_cache_tokens}
    write_json(out, {**meta, "rows": rows})
    lines = [f"# Prefix hit rate by routing policy ({args.replicas} engine replicas, CPU, tiny random model)", "",
             f"commit {meta['commit']}; `{meta['command']}`; {args.prefixes} system prompts x {args.questions} "
             f"questions, {args.concurrency} in flight, {args.kv_cache_tokens} KV tokens per replica.", "",
             "| policy | cached / prompt tokens | hit rate | requests per replica | decisions | wall s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['cached_tokens']} / {r['prompt_tokens']} | {r['hit_rate']:.1%} | "
                     f"{r['per_replica']} | {r['decisions']} | {r['wall_s']} |")
    write_markdown(out, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
