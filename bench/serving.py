"""Serving benchmark: an OpenAI-compatible endpoint under load, as vLLM's / SGLang's serving benchmarks drive one.

Requests with random prompt and output lengths (uniform within ±range-ratio) arrive as a Poisson process at each
request rate (inf = all at once), at most --max-concurrency in flight; each streams a completion with the official
openai client. Per rate: request and output-token throughput, TTFT, TPOT (time per output token after the first) and
ITL (gaps between streamed chunks; with speculation a chunk may carry several tokens), mean / median / p99.

    python bench/serving.py --config configs/local.yaml --request-rates 2,8,inf --out bench/results/cpu_serving
    python bench/serving.py --url http://HOST:8000/v1 --model-id M --vocab-size 128256 ...   # a running server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine_vs_hf import commit  # noqa: E402


def start_app(config: Path) -> tuple[str, str, int, str]:
    """Run the config's first application in this process (Ray Serve); returns (base url, model id, vocab, device)."""
    import httpx
    from ray import serve

    from deployments.app import build_app

    spec = yaml.safe_load(config.read_text())
    app = spec["applications"][0]
    http = spec.get("http_options", {})
    host, port = http.get("host", "127.0.0.1"), http.get("port", 8000)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(app["args"]), name=app.get("name", "default"), route_prefix=app.get("route_prefix", "/"))
    base = f"http://{host}:{port}"
    while httpx.get(base + "/health", timeout=5).status_code != 200:
        time.sleep(0.5)
    args = app["args"]
    source = Path(args["model_loading_config"]["model_source"])
    source = source if source.is_absolute() else ROOT / source
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    return base + "/v1", args["model_loading_config"]["model_id"], vocab, args.get("engine_kwargs", {}).get("device",
                                                                                                        "auto")


async def one_request(client, model: str, prompt: list[int], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    stamps, tokens = [], 0
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    stamps = stamps or [end]  # no visible text at all: the first token is taken to arrive with the end
    return {"ttft": stamps[0] - t0, "e2e": end - t0, "tokens": tokens,
            "tpot": (end - stamps[0]) / max(tokens - 1, 1), "itl": [b - a for a, b in zip(stamps, stamps[1:])]}


async def run_rate(base: str, model: str, prompts, out_lens, rate: float, max_concurrency: int) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(max_concurrency)
    rng = random.Random(0)

    async def limited(p, n):
        async with gate:
            return await one_request(client, model, p, n)

    tasks = []
    t0 = time.perf_counter()
    for p, n in zip(prompts, out_lens):
        tasks.append(asyncio.create_task(limited(p, n)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    await client.close()

    def stats(values: list[float]) -> dict:
        v = sorted(values) or [float("nan")]
        return {"mean_ms": round(statistics.fmean(v) * 1e3, 2), "median_ms": round(statistics.median(v) * 1e3, 2),
                "p99_ms": round(v[min(len(v) - 1, int(0.99 * len(v)))] * 1e3, 2)}

    out_tokens = sum(r["tokens"] for r in results)
    return {"request_rate": rate if rate != float("inf") else "inf", "num_requests": len(results),
            "duration_s": round(wall, 2), "request_throughput": round(len(results) / wall, 3),
            "output_tok_s": round(out_tokens / wall, 1), "ttft": stats([r["ttft"] for r in results]),
            "tpot": stats([r["tpot"] for r in results]), "itl": stats([g for r in results for g in r["itl"]])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None, help="a serve config whose first application is started here")
    ap.add_argument("--url", default=None, help="or an OpenAI base URL of a running server")
    ap.add_argument("--model-id", default=None)
    ap.add_argument("--vocab-size", type=int, default=None)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--request-rates", default="2,8,inf")
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.config:
        base, model, vocab, device = start_app(Path(args.config))
    else:
        base, model, vocab, device = args.url, args.model_id, args.vocab_size, "remote"
    rng = random.Random(1)
    lens = lambda n: [rng.randint(int(n * (1 - args.range_ratio)), int(n * (1 + args.range_ratio)))  # noqa: E731
                      for _ in range(args.num_prompts)]
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(n)] for n in lens(args.input_len)]
    out_lens = lens(args.output_len)
    rows = []
    asyncio.run(run_rate(base, model, prompts[:4], [8] * 4, float("inf"), 4))  # warm-up
    for rate in [float(r) for r in args.request_rates.split(",")]:
        rows.append(asyncio.run(run_rate(base, model, prompts, out_lens, rate, args.max_concurrency)))
        print(rows[-1], flush=True)
    import platform

    meta = {"device": device if device != "cpu" else f"CPU {platform.machine()}", "commit": commit(),
            "command": "python " + " ".join(sys.argv), "config": args.config, "model_id": model,
            "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
            "range_ratio": args.range_ratio, "max_concurrency": args.max_concurrency, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2))
    md = [f"# Serving benchmark ({meta['device']})", "", f"commit `{meta['commit']}` · command `{meta['command']}`", "",
          f"{args.num_prompts} requests per rate, input {args.input_len} / output {args.output_len} tokens "
          f"(±{args.range_ratio:.0%}), at most {args.max_concurrency} in flight, greedy, streamed", "",
          "| rate (req/s) | req/s | output tok/s | TTFT median / p99 ms | TPOT median / p99 ms | ITL median / p99 ms |",
          "|---|---|---|---|---|---|"]
    md += [f"| {r['request_rate']} | {r['request_throughput']} | {r['output_tok_s']} | {r['ttft']['median_ms']} / "
           f"{r['ttft']['p99_ms']} | {r['tpot']['median_ms']} / {r['tpot']['p99_ms']} | {r['itl']['median_ms']} / "
           f"{r['itl']['p99_ms']} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    labels = [str(r["request_rate"]) for r in rows]
    axes[0].bar(labels, [r["output_tok_s"] for r in rows])
    axes[0].set_xlabel("request rate (req/s)")
    axes[0].set_ylabel("output tokens/s")
    for key in ("ttft", "tpot"):
        axes[1].plot(labels, [r[key]["median_ms"] for r in rows], "o-", label=f"{key} median")
        axes[1].plot(labels, [r[key]["p99_ms"] for r in rows], "x--", label=f"{key} p99")
    axes[1].set_xlabel("request rate (req/s)")
    axes[1].set_ylabel("ms")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"{meta['device']} · {meta['commit']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)


if __name__ == "__main__":
    main()
