"""An ingress replica's own work per streamed chunk, in-process: C requests' streams (``RequestStream``) fed one
token a step as the poll loop feeds them, each drained through the SSE generator the HTTP handler returns
(delivery, detokenizing, request metrics, the chunk's JSON text), before Starlette and uvicorn write it. Also the
chunk's text alone: ``ChunkFormat`` against ``json.dumps`` of the whole chunk object (what it replaced).

    python3 -m bench.ingress_chunks --out bench/results/serving/cpu_ingress_chunks

One ingress process streams every step's tokens of every request it serves: at small models and many streams, tens of
thousands of chunks a second, so this cost bounds served throughput (docs/performance.md, Served path).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import types
from pathlib import Path

from bench.common import ROOT, command, commit, device_name, out_path, write_json, write_markdown


def json_dumps_sse(fmt_args: tuple, index: int, text, finish, logprobs=None, first=False) -> str:
    """The chunk's text as the ingress wrote it before ``ChunkFormat``: the whole object through json.dumps."""
    head, chat, include_usage = fmt_args
    if chat:
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
    else:
        choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
    payload = {**head, "choices": [choice]}
    if include_usage:
        payload["usage"] = None
    return f"data: {json.dumps(payload)}\n\n"


async def drive(client, ingress_cls, token_ids: list[int], concurrency: int, steps: int, chat: bool) -> float:
    """Seconds for ``steps`` steps of ``concurrency`` streams: each step puts one token into every stream (the last
    step ends them), then takes one chunk from each stream's SSE generator."""
    from deployments.engine_client import RequestStream
    from deployments.ingress import _Echo

    fake = types.SimpleNamespace(model_id="specserve-tiny", engine=client)
    streams, gens = [], []
    for c in range(concurrency):
        rid = f"r{c}"
        stream = RequestStream(client, rid, 16, [], time.time(), 1, 0.0)
        echo = _Echo(None, [[1] * 16], 1, 0, False, False, client.token_text)
        streams.append(stream)
        gens.append(ingress_cls._sse(fake, [stream], rid, 1764180000, chat, False, False, echo))
    if chat:  # the role chunk comes first
        for g in gens:
            await g.__anext__()
    t0 = time.perf_counter()
    for step in range(steps):
        last = step == steps - 1
        for c, stream in enumerate(streams):
            tok = token_ids[(step * 7 + c) % len(token_ids)]
            stream.put((f"r{c}", [tok], "length" if last else None, None, None, {"spec": None} if last else None))
        for g in gens:
            await g.__anext__()
    elapsed = time.perf_counter() - t0
    for g in gens:
        await g.aclose()
    return elapsed


def format_us(chat: bool, n: int = 20000) -> dict:
    """µs per chunk text: ChunkFormat vs json.dumps of the chunk object, on the same texts ({} on a tree from before
    ChunkFormat, which this benchmark also times for A/B runs)."""
    try:
        from deployments.protocol import ChunkFormat
    except ImportError:
        return {}

    head = {"id": "cmpl-0123456789abcdef", "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 1764180000, "model": "specserve-tiny"}
    fmt, args = ChunkFormat(head, chat, False), (head, chat, False)
    texts = [" the", "ing", "(", " self", ".\n", "é"]
    out = {}
    for name, fn in (("json.dumps", lambda i, t: json_dumps_sse(args, i, t, None)),
                     ("ChunkFormat", lambda i, t: fmt.sse(i, t, None))):
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for k in range(n):
                fn(0, texts[k % 6])
            best = min(best, (time.perf_counter() - t0) / n * 1e6)
        out[name] = round(best, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokenizer", default=str(ROOT / "models" / "specserve-tiny"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import ray

    from deployments.engine_client import EngineClient
    from deployments.ingress import OpenAIIngress

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)  # (request metrics record through Ray)
    try:
        client = EngineClient(None, "specserve-tiny", args.tokenizer)
        text = Path(ROOT / "README.md").read_text()[:4000]
        token_ids = client.tokenizer.encode(text, add_special_tokens=False)
        rows = []
        for chat in (False, True):
            times = [asyncio.run(drive(client, OpenAIIngress.func_or_class, token_ids, args.concurrency, args.steps,
                                       chat)) for _ in range(args.repeats)]
            chunks = args.concurrency * args.steps
            rows.append({"api": "chat" if chat else "completions", "concurrency": args.concurrency,
                         "steps": args.steps, "us_per_chunk_median": round(statistics.median(times) / chunks * 1e6, 2),
                         "us_per_chunk_min": round(min(times) / chunks * 1e6, 2),
                         "chunk_text_us": format_us(chat)})
            print(rows[-1], flush=True)
    finally:
        ray.shutdown()
    res = {"device": device_name("cpu"), "commit": commit(), "command": command(), "rows": rows}
    out = out_path(args.out)
    write_json(out, res)
    md = [f"# An ingress replica's own work per streamed chunk ({res['device']})", "",
          f"commit `{res['commit']}` · command `{res['command']}`", "",
          "In-process: C streams fed one token a step and drained through the SSE generator of the HTTP handler "
          "(delivery, detokenizing, request metrics through Ray, the chunk's text); Starlette and uvicorn's writes "
          "not included. Chunk text alone: `ChunkFormat` against `json.dumps` of the chunk object (best of 5).", "",
          "| API | streams | steps | µs per chunk, median (min) of runs | chunk text µs: json.dumps → ChunkFormat |",
          "|---|---|---|---|---|"]
    md += [f"| {r['api']} | {r['concurrency']} | {r['steps']} | {r['us_per_chunk_median']} ({r['us_per_chunk_min']}) "
           f"| {r['chunk_text_us'].get('json.dumps', '-')} → {r['chunk_text_us'].get('ChunkFormat', '-')} |"
           for r in rows]
    write_markdown(out, md)


if __name__ == "__main__":
    main()
