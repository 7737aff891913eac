"""Where a lone request's first token spends its time between the ingress and the engine core, stage by stage: the
real ``EngineCore`` in a Ray actor (its submit, its loop's wake from idle, ``_publish`` and the push) with a stub
engine whose step sleeps (``bench.output_channel``'s), and the real ``EngineClient`` in an async actor (its batched
submit, the push channel's reader thread, the hand-off to the event loop, the stream's consumer). Each stage is
stamped with ``time.monotonic()`` (one clock for every process of the machine) and the requests come one at a time,
apart, so the core's loop is idle when each arrives.

    python3 -m bench.ttft_path --out bench/results/serving/cpu_ttft_path

The HTTP side (parsing, validation, chat template, the response's first write) is timed by ``bench.ingress_chunks
--http --ttft``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
import types

from bench.common import ROOT, command, commit, out_path, write_json, write_markdown
from bench.output_channel import CORE_NAME, StubEngine, stop

STAGES = [  # (name, from stamp, to stamp)
    ("ingress: add() to the submit's actor call", "add", "flush"),
    ("actor call: request leg (to the core's submit)", "flush", "sub_in"),
    ("core: submit (validation, inbox)", "sub_in", "sub_out"),
    ("core: loop's wake (submit's end to the loop taking the inbox)", "sub_out", "pickup"),
    ("core: plan to the step's start", "pickup", "step0"),
    ("core: the step (stub: a sleep)", "step0", "step1"),
    ("core: step's end to the push sent", "step1", "pushed"),
    ("push: sent to the ingress's event loop (ZMQ, reader thread, hand-off)", "pushed", "deliver"),
    ("ingress: delivery to the stream's consumer", "deliver", "first"),
    ("(off the path) the submit's answer back at the ingress", "sub_out", "added"),
    ("total: add() to the first token at the consumer", "add", "first"),
]


def core_actor(step_s: float):
    import ray

    from deployments.controller import CORE_NAMESPACE
    from deployments.engine.core import EngineCore

    class Engine(StubEngine):
        def step(self):
            self.stamps.setdefault("step0", time.monotonic())
            outs = super().step()
            self.stamps.setdefault("step1", time.monotonic())
            return outs

    class Core(EngineCore):
        def __init__(self):
            cfg = types.SimpleNamespace(tokenizer=None, model="stub", worker_step_timeout_s=60.0,
                                        speculative_config=None, distributed_executor_backend="uni")
            engine = Engine(step_s)
            engine.stamps = self.stamps = {}
            super().__init__(cfg, "stub", engine=engine)

        def submit(self, client, batch):
            self.stamps.clear()
            self.stamps["sub_in"] = time.monotonic()
            answers = super().submit(client, batch)
            self.stamps["sub_out"] = time.monotonic()
            return answers

        def _take_inbox(self):
            if self._inbox:
                self.stamps.setdefault("pickup", time.monotonic())
            super()._take_inbox()

        def _publish(self, outputs):
            super()._publish(outputs)
            if outputs:
                self.stamps.setdefault("pushed", time.monotonic())

        def take_stamps(self) -> dict:
            return dict(self.stamps)

    return ray.remote(Core).options(name=CORE_NAME, namespace=CORE_NAMESPACE, max_concurrency=64,
                                    num_cpus=0).remote()


class Ingress:
    """An async actor holding one ``EngineClient`` joined to the stub core, stamping its side."""

    def __init__(self, tokenizer: str):
        from deployments.engine.tokenizer import load_tokenizer
        from deployments.engine_client import EngineClient

        stamps = self.stamps = {}

        class Client(EngineClient):
            def _flush(self, name):
                stamps.setdefault("flush", time.monotonic())
                super()._flush(name)

            def _deliver(self, items, core=None):
                stamps.setdefault("deliver", time.monotonic())
                super()._deliver([(*item[:3], None, None, *item[5:]) for item in items], core)

        self.client = Client(None, "stub", output_channel="push")
        self.client.tokenizer = load_tokenizer(tokenizer)

    async def join(self) -> None:
        self.client._joined = asyncio.Event()
        await self.client._join(CORE_NAME)
        assert self.client._cores, "the stub core did not join"

    async def one(self) -> dict:
        self.stamps.clear()
        self.stamps["add"] = time.monotonic()
        stream = await self.client.add(f"r-{time.monotonic_ns()}", [5, 6, 7], {"max_tokens": 2, "ignore_eos": True},
                                       time.time())
        self.stamps["added"] = time.monotonic()
        async for _ in stream:
            self.stamps.setdefault("first", time.monotonic())
        return dict(self.stamps)

    def close(self) -> None:
        self.client.close()


def measure(step_ms: float, requests: int, tokenizer: str) -> dict[str, list[float]]:
    import ray

    core = core_actor(step_ms / 1e3)
    ingress = ray.remote(Ingress).options(num_cpus=0, max_concurrency=1000).remote(tokenizer)
    ray.get(ingress.join.remote())
    per_stage: dict[str, list[float]] = {name: [] for name, _, _ in STAGES}
    try:
        for i in range(requests + 5):
            time.sleep(random.uniform(0.06, 0.12))  # the core's loop idle (its wait is 50 ms) when it arrives
            mine = ray.get(ingress.one.remote())
            theirs = ray.get(core.take_stamps.remote())
            if i < 5:  # warm-up
                continue
            st = {**mine, **theirs}
            for name, a, b in STAGES:
                per_stage[name].append((st[b] - st[a]) * 1e3)
    finally:
        stop(ingress, core)
    return per_stage


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step-ms", type=float, default=2.0, help="the stub's step (default: about the 1B shape's "
                    "prefill of 256 tokens on an H100)")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--tokenizer", default=str(ROOT / "models" / "specserve-tiny"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        per_stage = measure(args.step_ms, args.requests, args.tokenizer)
    finally:
        ray.shutdown()
    rows = [{"stage": name, "p50_ms": round(statistics.median(v), 3),
             "p10_ms": round(sorted(v)[len(v) // 10], 3), "p90_ms": round(sorted(v)[len(v) * 9 // 10], 3)}
            for name, v in per_stage.items()]
    import platform

    meta = {"device": f"CPU {platform.machine()} ({__import__('os').cpu_count()} cores)", "commit": commit(),
            "command": command(), "step_ms": args.step_ms, "requests": args.requests, "rows": rows,
            "samples_ms": per_stage}
    out = out_path(args.out)
    write_json(out, meta)
    md = ["# A lone request's first token, ingress → engine core → ingress, stage by stage (stub engine)", "",
          f"commit `{meta['commit']}` · command `{meta['command']}` · {meta['device']}", "",
          f"{args.requests} requests one at a time, 60-120 ms apart (the core's loop idle when each arrives), 3 "
          f"prompt tokens, a stub step of {args.step_ms} ms (a sleep). Each stage from stamps of "
          "`time.monotonic()` in the ingress's and the core's processes.", "",
          "| stage | p50 ms | p10 ms | p90 ms |", "|---|---|---|---|"]
    md += [f"| {r['stage']} | {r['p50_ms']} | {r['p10_ms']} | {r['p90_ms']} |" for r in rows]
    write_markdown(out, md)
    print("\n".join(md))


if __name__ == "__main__":
    main()
