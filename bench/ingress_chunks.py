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


def json_dumps_sse(fmt_args: tuple, index: int, text, finish, logprobs=None, first=False, stop_reason=None) -> str:
    """The chunk's text as the ingress wrote it before ``ChunkFormat``: the whole object through json.dumps."""
    head, chat, include_usage = fmt_args
    if chat:
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "finish_reason": finish, "stop_reason": stop_reason,
                  "logprobs": logprobs}
    else:
        choice = {"index": index, "text": text or "", "finish_reason": finish, "stop_reason": stop_reason,
                  "logprobs": logprobs}
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


async def drive_asgi(client, ingress_cls, token_ids: list[int], concurrency: int, steps: int, chat: bool) -> float:
    """As ``drive``, through the response object the handler returns, run as an ASGI app per stream (its send
    loop, its generators, the stream's wake-ups; a send that only counts): seconds for ``steps`` steps, the
    request's last step (its closing writes) not timed."""
    from deployments.engine_client import RequestStream
    from deployments.ingress import _Echo, _Streamed

    fake = types.SimpleNamespace(model_id="specserve-tiny", engine=client)
    never = asyncio.Event()
    sent, want, reached = [0], [0], asyncio.Event()

    async def receive():
        await never.wait()

    async def send(message):
        if message["type"] == "http.response.body":
            sent[0] += 1
            if sent[0] >= want[0]:
                reached.set()

    async def until(n: int) -> None:
        want[0] = n
        reached.clear()
        if sent[0] < n:
            await reached.wait()

    streams, tasks = [], []
    for c in range(concurrency):
        rid = f"r{c}"
        stream = RequestStream(client, rid, 16, [], time.time(), 1, 0.0)
        echo = _Echo(None, [[1] * 16], 1, 0, False, False, client.token_text)
        response = _Streamed(ingress_cls._sse(fake, [stream], rid, 1764180000, chat, False, False, echo), [stream],
                             client)
        streams.append(stream)
        tasks.append(asyncio.ensure_future(response({"type": "http"}, receive, send)))
    await until(concurrency if chat else 0)  # (chat: the role chunks)
    t0 = time.perf_counter()
    for step in range(steps + 1):
        if step == steps:
            elapsed = time.perf_counter() - t0
        last = step == steps
        for c, stream in enumerate(streams):
            tok = token_ids[(step * 7 + c) % len(token_ids)]
            stream.put((f"r{c}", [tok], "length" if last else None, None, None, {"spec": None} if last else None))
        await until(sent[0] + concurrency)
    await asyncio.gather(*tasks)
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


# -- the whole write path: the real ASGI app under uvicorn, streams over local sockets -----------------------------

def _stub_engine(tokenizer: str, token_ids: list[int], step_s: float, ttft: bool = False):
    """The real ``EngineClient`` (streams, delivery, detokenizing, metrics) with its engine core replaced: a thread
    that every ``step_s`` hands the event loop one token for every running request, as the push channel's reader
    does (one ``call_soon_threadsafe`` per step)."""
    import queue
    import threading

    from deployments.engine_client import EngineClient

    class StubEngine(EngineClient):
        def __init__(self):
            super().__init__(None, "specserve-tiny", tokenizer)
            self.info = {"max_model_len": 4096, "vocab_size": len(self.tokenizer), "sampling_defaults": {}}
            self.running: dict[str, list[int]] = {}  # rid -> [tokens sent, max_tokens]
            self.lock = threading.Lock()
            self.loop = None
            self.steps = 0
            self.arrived = queue.Queue()

        async def core(self):
            return

        def _route(self, item):  # accepted at once
            item[4].set_result(None)
            if ttft:  # (the first token at once, from a thread, as the push channel's reader hands it over)
                self.arrived.put((item[0], item[2]["max_tokens"]))
                return
            with self.lock:
                self.running[item[0]] = [0, item[2]["max_tokens"]]

        def abort(self, rid):
            super().abort(rid)
            with self.lock:
                self.running.pop(rid, None)

        def first_token_loop(self, stop: threading.Event):
            while not stop.is_set():
                try:
                    rid, max_tokens = self.arrived.get(timeout=0.1)
                except queue.Empty:
                    continue
                self.loop.call_soon_threadsafe(self._deliver, [(rid, [token_ids[0]], None, None, None, None)])
                with self.lock:
                    self.running[rid] = [1, max_tokens]

        def step_loop(self, stop: threading.Event):
            while not stop.wait(step_s):
                batch = []
                with self.lock:
                    for rid, st in list(self.running.items()):
                        tok = token_ids[(st[0] * 7 + len(rid)) % len(token_ids)]
                        st[0] += 1
                        if st[0] >= st[1]:
                            del self.running[rid]
                            batch.append((rid, [tok], "length", None, None, {"spec": None, "cached_tokens": 0}))
                        else:
                            batch.append((rid, [tok], None, None, None, None))
                if batch:
                    self.steps += 1
                    self.loop.call_soon_threadsafe(self._deliver, batch)

    return StubEngine()


def _client(port: int, concurrency: int, requests: int, max_tokens: int, chat: bool, out, ttft: bool = False) -> None:
    """(a process of its own) ``concurrency`` connections, each streaming one request after another (raw sockets:
    the client's cost stays small); puts (SSE events, bytes, wall seconds)."""
    import asyncio
    import json as _json

    body = {"model": "specserve-tiny", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    if chat:
        body["messages"] = [{"role": "user", "content": "Tell me a story about a cat."}]
    else:
        body["prompt"] = "Once upon a time there was a cat"
    payload = _json.dumps(body).encode()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    req = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
           f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
    left = [requests]
    events = [0, 0]
    firsts = []  # (ttft) seconds from the request's write to its first token's event

    async def worker():
        while left[0] > 0:
            left[0] -= 1
            if ttft:
                await asyncio.sleep(0.02)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            t0 = time.perf_counter()
            writer.write(req)
            tail, seen = b"", 0
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    break
                events[1] += len(data)
                buf = tail + data
                n = buf.count(b"data: ") - tail.count(b"data: ")
                if seen < 1 + chat <= seen + n:  # (chat: the role's chunk comes first)
                    firsts.append(time.perf_counter() - t0)
                seen += n
                events[0] += n
                tail = buf[-8:]
            writer.close()

    async def main():
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - t0

    wall = asyncio.run(main())
    out.put((events[0], events[1], wall, firsts))


def http_run(tokenizer: str, token_ids: list[int], concurrency: int, requests: int, max_tokens: int, chat: bool,
             step_s: float, ttft: bool = False) -> dict:
    """The real ingress app (``deployments.ingress.app``, its routes, middlewares and streaming response) under
    uvicorn on uvloop, as a replica serves it with direct ingress, with the stub engine; the client in another
    process. Counts the response-body ``send`` calls and the event loop thread's CPU time."""
    import asyncio
    import multiprocessing
    import socket
    import threading
    import types

    import ray.serve
    import uvicorn
    import uvloop

    from deployments.config import LIMIT_FIELDS, LLMConfig
    from deployments.ingress import OpenAIIngress, _Served, app
    from deployments.limits import RequestLimits

    engine = _stub_engine(tokenizer, token_ids, step_s, ttft)
    ingress = OpenAIIngress.func_or_class.__new__(OpenAIIngress.func_or_class)
    ingress.created = int(time.time())
    served = _Served("specserve-tiny", None, engine,
                     RequestLimits(**{k: LLMConfig.model_fields[k].default for k in LIMIT_FIELDS}))
    ingress.models, ingress.default = {"specserve-tiny": served}, served
    app.state.ingress = ingress  # (as the replica's constructor sets it)
    # (Serve's class-based routes take ``self`` from the replica context)
    ray.serve.get_replica_context = lambda: types.SimpleNamespace(servable_object=ingress)
    app.state.auth_header, app.state.max_body_bytes = None, None
    sends = [0]

    async def counted(scope, receive, send):
        async def counting_send(message):
            if message["type"] == "http.response.body":
                sends[0] += 1
            await send(message)
        await app(scope, receive, counting_send)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(counted, lifespan="off", access_log=False, log_level="warning",
                                           http="httptools", loop="none"))
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()

    async def main():
        engine.loop = asyncio.get_running_loop()
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        stop = threading.Event()
        for target in (engine.step_loop, engine.first_token_loop) if ttft else (engine.step_loop,):
            threading.Thread(target=target, args=(stop,), daemon=True).start()
        proc = ctx.Process(target=_client, args=(port, concurrency, requests, max_tokens, chat, out, ttft))
        proc.start()
        cpu0, t0 = time.thread_time(), time.perf_counter()
        result = await asyncio.to_thread(out.get)
        cpu, wall = time.thread_time() - cpu0, time.perf_counter() - t0
        await asyncio.to_thread(proc.join)
        stop.set()
        server.should_exit = True
        await serving
        return result, cpu, wall

    (events, nbytes, client_wall, firsts), cpu, wall = uvloop.run(main())
    tokens = requests * max_tokens
    if ttft:
        firsts = sorted(firsts[3:])  # (warm-up)
        return {"api": "chat" if chat else "completions", "requests": requests, "ttft_ms_p50":
                round(statistics.median(firsts) * 1e3, 3), "ttft_ms_p10": round(firsts[len(firsts) // 10] * 1e3, 3),
                "ttft_ms_p90": round(firsts[len(firsts) * 9 // 10] * 1e3, 3),
                "loop_cpu_ms_per_request": round(cpu / requests * 1e3, 3)}
    return {"api": "chat" if chat else "completions", "concurrency": concurrency, "requests": requests,
            "max_tokens": max_tokens, "step_ms": step_s * 1e3, "events": events, "body_sends": sends[0],
            "steps": engine.steps, "tok_s": round(tokens / client_wall), "offered_tok_s": round(concurrency / step_s),
            "loop_cpu_s": round(cpu, 3), "loop_busy": round(cpu / wall, 3),
            "loop_cpu_us_per_token": round(cpu / tokens * 1e6, 2),
            "sends_per_token": round(sends[0] / tokens, 3), "events_per_token": round(events / tokens, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokenizer", default=str(ROOT / "models" / "specserve-tiny"))
    ap.add_argument("--http", action="store_true", help="the whole write path: the real app under uvicorn, streams "
                    "over local sockets from a client process")
    ap.add_argument("--concurrencies", default="64,256", help="(--http) streams per run")
    ap.add_argument("--waves", type=int, default=2, help="(--http) requests per stream, one after another")
    ap.add_argument("--max-tokens", type=int, default=64, help="(--http) tokens per request")
    ap.add_argument("--step-ms", type=float, default=8.0, help="(--http) the stub engine's step")
    ap.add_argument("--apis", default="completions,chat")
    ap.add_argument("--ttft", action="store_true", help="(--http) one request at a time, its first token handed over "
                    "at once: the ingress's own time to first token (request written → first token's event read)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import ray

    from deployments.engine_client import EngineClient
    from deployments.ingress import OpenAIIngress

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)  # (request metrics record through Ray)
    rows = []
    try:
        client = EngineClient(None, "specserve-tiny", args.tokenizer)
        text = Path(ROOT / "README.md").read_text()[:4000]
        token_ids = client.tokenizer.encode(text, add_special_tokens=False)
        for api in args.apis.split(","):
            chat = api == "chat"
            if args.http and args.ttft:
                for _ in range(args.repeats):
                    rows.append(http_run(args.tokenizer, token_ids, 1, args.waves, args.max_tokens, chat,
                                         args.step_ms / 1e3, ttft=True))
                    print(rows[-1], flush=True)
                continue
            if args.http:
                for c in map(int, args.concurrencies.split(",")):
                    for _ in range(args.repeats):
                        rows.append(http_run(args.tokenizer, token_ids, c, c * args.waves, args.max_tokens, chat,
                                             args.step_ms / 1e3))
                        print(rows[-1], flush=True)
                continue
            times = [asyncio.run(drive(client, OpenAIIngress.func_or_class, token_ids, args.concurrency, args.steps,
                                       chat)) for _ in range(args.repeats)]
            chunks = args.concurrency * args.steps
            asgi = [asyncio.run(drive_asgi(client, OpenAIIngress.func_or_class, token_ids, args.concurrency,
                                           args.steps, chat)) for _ in range(args.repeats)]
            rows.append({"api": api, "concurrency": args.concurrency,
                         "steps": args.steps, "us_per_chunk_median": round(statistics.median(times) / chunks * 1e6, 2),
                         "us_per_chunk_min": round(min(times) / chunks * 1e6, 2),
                         "asgi_us_per_chunk_median": round(statistics.median(asgi) / chunks * 1e6, 2),
                         "asgi_us_per_chunk_min": round(min(asgi) / chunks * 1e6, 2),
                         "chunk_text_us": format_us(chat)})
            print(rows[-1], flush=True)
    finally:
        ray.shutdown()
    res = {"device": device_name("cpu"), "commit": commit(), "command": command(), "rows": rows}
    out = out_path(args.out)
    write_json(out, res)
    if args.http and args.ttft:
        md = [f"# An ingress replica's own time to first token over HTTP ({res['device']})", "",
              f"commit `{res['commit']}` · command `{res['command']}`", "",
              "One request at a time (20 ms apart, a connection each) to the real ingress app under uvicorn on "
              "uvloop; its stub engine accepts at once and hands the first token over from a thread as soon as the "
              "request is submitted. TTFT: the request written → its first token's SSE event read, in the client's "
              "process (parsing, validation, the chat template and tokenizing, the submit, the hand-off, the "
              "response's first writes).", "",
              "| API | requests | TTFT p50 ms (p10, p90) | loop CPU ms per request |", "|---|---|---|---|"]
        md += [f"| {r['api']} | {r['requests']} | {r['ttft_ms_p50']} ({r['ttft_ms_p10']}, {r['ttft_ms_p90']}) | "
               f"{r['loop_cpu_ms_per_request']} |" for r in rows]
        write_markdown(out, md)
        return
    if args.http:
        md = [f"# An ingress replica's event loop per streamed token, the whole write path ({res['device']})", "",
              f"commit `{res['commit']}` · command `{res['command']}`", "",
              "The real ingress app (routes, middlewares, streaming response) under uvicorn on uvloop, as a replica "
              "serves it with direct ingress; its engine a stub whose thread hands the event loop one token for every "
              "running request each step (as the push channel's reader does); C client connections in another "
              "process (raw sockets), each streaming one request after another. Loop CPU: the event loop thread's "
              "CPU time over the run; sends: response-body `send` calls; events: SSE `data:` events the client "
              "read.", "",
              "| API | streams | requests × tokens | step ms | offered tok/s | delivered tok/s | loop busy | loop CPU µs "
              "per token | sends per token | events per token |", "|---|---|---|---|---|---|---|---|---|---|"]
        md += [f"| {r['api']} | {r['concurrency']} | {r['requests']} × {r['max_tokens']} | {r['step_ms']} | "
               f"{r['offered_tok_s']} | {r['tok_s']} | {r['loop_busy']} | {r['loop_cpu_us_per_token']} | "
               f"{r['sends_per_token']} | {r['events_per_token']} |" for r in rows]
        write_markdown(out, md)
        return
    md = [f"# An ingress replica's own work per streamed chunk ({res['device']})", "",
          f"commit `{res['commit']}` · command `{res['command']}`", "",
          "In-process: C streams fed one token a step and drained through the SSE generator of the HTTP handler "
          "(delivery, detokenizing, request metrics through Ray, the chunk's text); Starlette and uvicorn's writes "
          "not included (`--http` times them). Chunk text alone: `ChunkFormat` against `json.dumps` of the chunk "
          "object (best of 5). ASGI: the same through the response object the handler returns, run as an ASGI app "
          "per stream with a send that only counts (its send loop, generators and wake-ups; not the middlewares' and "
          "uvicorn's sends).", "",
          "| API | streams | steps | µs per chunk, median (min) of runs | ASGI µs per chunk, median (min) | chunk text "
          "µs: json.dumps → ChunkFormat |", "|---|---|---|---|---|---|"]
    md += [f"| {r['api']} | {r['concurrency']} | {r['steps']} | {r['us_per_chunk_median']} ({r['us_per_chunk_min']}) "
           f"| {r.get('asgi_us_per_chunk_median', '-')} ({r.get('asgi_us_per_chunk_min', '-')}) "
           f"| {r['chunk_text_us'].get('json.dumps', '-')} → {r['chunk_text_us'].get('ChunkFormat', '-')} |"
           for r in rows]
    write_markdown(out, md)


if __name__ == "__main__":
    main()
