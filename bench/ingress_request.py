"""An ingress replica's CPU per request on the way in, stage by stage: from the HTTP request's arrival (the ASGI
call) to the engine ``submit`` call leaving, then the response's headers, the first streamed chunk and the last.

The real FastAPI app (``deployments.ingress.app``: middlewares, routing, body parsing and validation, our handler,
``EngineClient``'s batched submit) driven in-process by ASGI calls, as uvicorn makes them; the engine core a Ray actor
whose ``submit`` accepts at once (the call's pickling and sending are the ingress's real cost), or with ``--intake``
a thread that reads the ZMQ intake socket the client sends its submissions to and pushes the answers back to the
client's output channel, as the engine core's intake does; the first token and the last handed to
``EngineClient._deliver`` as the output channel's reader does. Each stage is the event loop
thread's CPU time (``time.thread_time``) between stamps, so other processes' load on the machine counts little.
The bodies are ``bench.serving``'s (streamed, ``ignore_eos``, ``stream_options.include_usage``, temperature 0) with
a 256-token prompt as token ids or as text, and a chat request of the same text.

    python3 -m bench.ingress_request --out bench/results/serving/cpu_ingress_request

``--wave K``: K requests' ASGI calls started together (a wave of closed-loop clients' successors): the loop's CPU per
request over the wave, and the requests per submit. uvicorn's HTTP parsing and socket writes are not included
(``bench.ingress_chunks --http --ttft`` runs the app under uvicorn).
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

STAGES = [  # (name, from stamp, to stamp)
    ("ASGI call → body read (Starlette, our middlewares, routing, FastAPI's set-up)", "asgi", "receive"),
    ("body read → our handler (JSON, validation, routing's rest)", "receive", "handler"),
    ("  of which FastAPI's content type and json.loads", "receive", "deps0"),
    ("  of which pydantic's validation and Serve's `self` dependency", "deps0", "deps1"),
    ("handler: our checks (model, limits, prompt ids' range)", "handler", "text0"),
    ("tokenizing / chat template", "text0", "text1"),
    ("handler: the engine request (sampling params, rid)", "text1", "add"),
    ("EngineClient.add: the stream and detokenizer, routing", "add", "flush0"),
    ("the submission (pickling the batch, Ray's or ZMQ's send)", "flush0", "flush1"),
    ("total: arrival → the submission left", "asgi", "flush1"),
    ("(after) the submission left → its answer on the loop (Ray's reply, or the output channel's)", "flush1",
     "answer"),
    ("(after) the submit's answer → response headers sent", "answer", "start"),
    ("(after) first token delivered → its chunk sent", "deliver0", "chunk0"),
    ("(after) last token delivered → last chunk, usage, [DONE], the call's end", "deliver1", "end"),
]
TEXT_STAGES = ("text0", "text1")


def bodies(tokenizer, prompt_tokens: int, max_tokens: int) -> dict[str, tuple[str, bytes]]:
    """(path, body) per API: bench.serving's completions body with the prompt as token ids and as text, and chat."""
    text = Path(ROOT / "README.md").read_text()
    ids = tokenizer.encode(text, add_special_tokens=False)[:prompt_tokens]
    prompt_text = tokenizer.decode(ids)
    common = {"model": "specserve-tiny", "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
              "stream_options": {"include_usage": True}, "ignore_eos": True}
    return {"completions_ids": ("/v1/completions", json.dumps({**common, "prompt": ids}).encode()),
            "completions_text": ("/v1/completions", json.dumps({**common, "prompt": prompt_text}).encode()),
            "chat": ("/v1/chat/completions",
                     json.dumps({**common, "messages": [{"role": "user", "content": prompt_text}]}).encode())}


def intake_core(client, stop) -> str:
    """(--intake) A thread standing for the engine core's intake: each submission read, checked and answered (all
    accepted) on the client's output channel, as ``EngineCore._intake_loop`` does. Returns the intake's address."""
    import threading

    import zmq

    from deployments.engine.signing import INTAKE, OUTPUT, Session, verified

    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(client._channel(client.info["max_model_len"]))
    join = Session(client._sessions.setdefault("core0", Session()).id)  # (the core's end of the client's join)

    def serve():
        while not stop.is_set():
            if not pull.poll(100):
                continue
            _, msg = pull.recv_multipart()
            session, number, (kind, body) = verified(client._push_key, msg, INTAKE)
            assert join.accepts(session, number)
            if kind == "submit":
                push.send(join.signed(client._push_key, OUTPUT,
                                      ("core0", {"answers": [(item[0], None) for item in body]})))
        pull.close(linger=0)
        push.close(linger=0)

    threading.Thread(target=serve, daemon=True).start()
    return f"tcp://127.0.0.1:{port}"


def setup(tokenizer_path: str, stamps: dict, intake: bool = False):
    """The ingress app with the stub core, its ``EngineClient`` stamping each stage (with ``intake``, the client
    submits over ZMQ and an async set-up, ``engine.start_intake()``, must run on the event loop first)."""
    import threading

    import fastapi.routing
    import ray
    import ray.serve

    from deployments.config import LIMIT_FIELDS, LLMConfig
    from deployments.engine_client import EngineClient
    from deployments.ingress import OpenAIIngress, _Served, app
    from deployments.limits import RequestLimits

    @ray.remote(num_cpus=0)
    class Core:
        def submit(self, client, batch):
            return [None] * len(batch)

        def abort(self, rids):
            pass

    core = Core.remote()
    clock = time.thread_time

    def stamp(name: str) -> None:
        stamps.setdefault(name, clock())

    class Client(EngineClient):
        def __init__(self):
            super().__init__(None, "specserve-tiny", tokenizer_path)
            self.info = {"max_model_len": 4096, "vocab_size": len(self.tokenizer), "sampling_defaults": {}}
            self._cores = {"core0": core}
            self.router.add_replica("core0")
            self.submits = 0
            self.stop_intake = threading.Event()

        async def start_intake(self):
            if intake:
                from deployments.engine.signing import DEFAULT_MAX_REQUEST_BODY_BYTES, intake_max_bytes

                limit = intake_max_bytes(self.info["max_model_len"], DEFAULT_MAX_REQUEST_BODY_BYTES)
                self._open_intake("core0", intake_core(self, self.stop_intake), limit)

        def _answered(self, name, batch, answers):
            stamp("answer")
            return super()._answered(name, batch, answers)

        async def core(self):
            return

        async def encode(self, prompt):
            stamp("text0")
            try:
                return await super().encode(prompt)
            finally:
                stamp("text1")

        async def render_chat(self, messages):
            stamp("text0")
            try:
                return await super().render_chat(messages)
            finally:
                stamp("text1")

        async def add(self, *args, **kwargs):
            stamp("text0")  # (token ids: no tokenizing stage)
            stamp("text1")
            stamp("add")
            return await super().add(*args, **kwargs)

        async def _submit(self, name, batch, answer):
            return await super()._submit(name, batch, answer if isinstance(answer, Exception) else _Ref(answer))

        def _flush(self, name):
            stamp("flush0")
            super()._flush(name)
            stamp("flush1")
            self.submits += 1

    class _Ref:
        """The submit's answer (an ObjectRef), awaited (as the client awaits it)."""

        def __init__(self, ref):
            self.ref = ref

        def __await__(self):
            return (yield from self.ref.__await__())

    engine = Client()
    ingress = OpenAIIngress.func_or_class.__new__(OpenAIIngress.func_or_class)
    ingress.created = int(time.time())
    served = _Served("specserve-tiny", None, engine,
                     RequestLimits(**{k: LLMConfig.model_fields[k].default for k in LIMIT_FIELDS}))
    ingress.models, ingress.default = {"specserve-tiny": served}, served
    check_model = ingress._check_model

    def check_stamped(model):
        stamp("handler")
        return check_model(model)

    ingress._check_model = check_stamped
    app.state.ingress = ingress  # (as the replica's constructor sets it; a tree from before ignores it)
    ray.serve.get_replica_context = lambda: types.SimpleNamespace(servable_object=ingress)  # (Serve's `self`)
    app.state.auth_header, app.state.max_body_bytes = None, None
    solve = fastapi.routing.solve_dependencies

    async def solve_stamped(*args, **kwargs):
        stamp("deps0")
        try:
            return await solve(*args, **kwargs)
        finally:
            stamp("deps1")

    fastapi.routing.solve_dependencies = solve_stamped
    return app, engine, stamp


def scope_for(path: str, body: bytes) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
            "query_string": b"", "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000),
            "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())]}


async def one(app, engine, stamp, stamps: dict, path: str, body: bytes, token: int) -> dict:
    """One request's stamps (CPU seconds of this thread). Its first token is delivered once the submit is answered
    and the headers are out, the last once the first chunk is out."""
    done, got_body = asyncio.Event(), [False]
    chunks = []

    async def receive():
        if not got_body[0]:
            got_body[0] = True
            stamp("receive")
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            stamp("start")
            if message["status"] != 200:
                raise RuntimeError(f"status {message['status']}")
            asyncio.get_running_loop().call_soon(first)
        elif message["type"] == "http.response.body":
            chunks.append(message["body"])
            if len(chunks) == 1 + path.endswith("chat/completions"):  # (chat: the role's chunk comes first)
                stamp("chunk0")
                asyncio.get_running_loop().call_soon(last)

    def rid() -> str:
        return next(iter(engine._streams))

    def first():
        stamp("deliver0")
        engine._deliver([(rid(), [token], None, None, None, None)])

    def last():
        stamp("deliver1")
        engine._deliver([(rid(), [token], "length", None, None, {"spec": None, "cached_tokens": 0})])

    stamps.clear()
    stamp("asgi")
    await app(scope_for(path, body), receive, send)
    stamp("end")
    done.set()
    text = b"".join(chunks)
    if not text.endswith(b"data: [DONE]\n\n") or b'"usage"' not in text:
        raise RuntimeError(f"unexpected response: {text[-300:]!r}")
    return dict(stamps)


async def wave(app, engine, path: str, body: bytes, k: int) -> tuple[float, int]:
    """(loop CPU seconds per request, submits) for k requests whose ASGI calls start together, each until its
    response headers (the submit answered); the requests are then cancelled, untimed."""
    never = asyncio.Event()
    heads, tasks = [], []

    def call():
        got = [False]
        headers = asyncio.get_running_loop().create_future()

        async def receive():
            if not got[0]:
                got[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            await never.wait()

        async def send(message):
            if message["type"] == "http.response.start" and not headers.done():
                headers.set_result(message["status"])
            await never.wait()

        heads.append(headers)
        tasks.append(asyncio.ensure_future(app(scope_for(path, body), receive, send)))

    submits0 = engine.submits
    cpu0 = time.thread_time()
    for _ in range(k):
        call()
    statuses = await asyncio.gather(*heads)
    cpu = time.thread_time() - cpu0
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if any(s != 200 for s in statuses):
        raise RuntimeError(f"statuses {set(statuses)}")
    return cpu / k, engine.submits - submits0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300, help="per API, one at a time")
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--wave", type=int, default=64, help="requests started together (0: no wave run)")
    ap.add_argument("--waves", type=int, default=5)
    ap.add_argument("--apis", default="completions_ids,completions_text,chat")
    ap.add_argument("--tokenizer", default=str(ROOT / "models" / "specserve-tiny"))
    ap.add_argument("--intake", action="store_true", help="submissions over the ZMQ intake (the push channel's "
                    "way in) instead of Ray's submit call")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import gc

    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)  # (request metrics record through Ray)
    stamps: dict = {}
    rows = []
    try:
        app, engine, stamp = setup(args.tokenizer, stamps, args.intake)
        reqs = bodies(engine.tokenizer, args.prompt_tokens, args.max_tokens)
        gc.freeze()  # (as the replica freezes its start-up heap)

        # tokens that decode to text on their own (a byte-level piece may not: no chunk for it)
        words = engine.tokenizer.encode(" the cat sat on a mat and then", add_special_tokens=False)

        async def run_all():
            await engine.start_intake()
            for api in args.apis.split(","):
                path, body = reqs[api]
                per_stage = {name: [] for name, _, _ in STAGES}
                for i in range(args.warmup + args.requests):
                    st = await one(app, engine, stamp, stamps, path, body, token=words[i % len(words)])
                    if i < args.warmup:
                        continue
                    for name, a, b in STAGES:
                        if a in st and b in st:  # (FastAPI's own stages: not on a path that skips it)
                            per_stage[name].append((st[b] - st[a]) * 1e6)
                per_stage = {n: v for n, v in per_stage.items() if v}
                row = {"api": api, "body_bytes": len(body), "requests": args.requests,
                       "stages_us_median": {n: round(statistics.median(v), 1) for n, v in per_stage.items()},
                       "stages_us_mean": {n: round(statistics.fmean(v), 1) for n, v in per_stage.items()}}
                if args.wave:
                    per, subs = [], []
                    for _ in range(args.waves + 1):
                        p, s = await wave(app, engine, path, body, args.wave)
                        per.append(p * 1e6)
                        subs.append(s)
                    row.update(wave=args.wave, wave_us_per_request=[round(x, 1) for x in per[1:]],
                               wave_us_per_request_median=round(statistics.median(per[1:]), 1),
                               wave_submits=subs[1:])
                rows.append(row)
                print(json.dumps(row), flush=True)

        asyncio.run(run_all())
        engine.stop_intake.set()
    finally:
        ray.shutdown()
    res = {"device": device_name("cpu"), "commit": commit(), "command": command(), "rows": rows}
    out = out_path(args.out)
    write_json(out, res)
    apis = [r["api"] for r in rows]
    md = [f"# An ingress replica's CPU per request on the way in, stage by stage ({res['device']})", "",
          f"commit `{res['commit']}` · command `{res['command']}`", "",
          "The real ingress app driven in-process by ASGI calls (no uvicorn), "
          + ("a thread reading the client's ZMQ intake as the engine core, answering on the output channel"
             if args.intake else "a Ray actor as the engine core whose submit accepts at once")
          + "; the event loop thread's CPU time between stamps, median of "
          f"{args.requests} requests one at a time (µs). Bodies as `bench.serving` sends them: streamed, ignore_eos, "
          f"include_usage, a {args.prompt_tokens}-token prompt as token ids or text; chat: the same text as one user "
          "message.", "",
          "| stage | " + " | ".join(apis) + " |", "|---|" + "---|" * len(apis)]
    for name, _, _ in STAGES:
        md.append(f"| {name} | " + " | ".join(str(r["stages_us_median"].get(name, "-")) for r in rows) + " |")
    if args.wave:
        md.append(f"| a wave of {args.wave} started together: loop CPU per request up to its headers, median of "
                  f"{args.waves} (submits per wave) | " + " | ".join(
                      f"{r['wave_us_per_request_median']} ({statistics.median(r['wave_submits']):g})" for r in rows)
                  + " |")
    write_markdown(out, md)
    print("\n".join(md))


if __name__ == "__main__":
    main()
