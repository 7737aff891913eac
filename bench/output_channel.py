"""The engine core → ingress output channel alone (``output_channel``: push or poll), with a stub engine whose step is
a sleep of a GPU step's length, so the figure is the channel's and not this machine's model speed: the real
``EngineCore`` in a Ray actor (its loop, ``_publish``, the push or the poll) and the real ``EngineClient`` in an async
actor (its event loop, ``_deliver``, each request's ``RequestStream`` drained as a handler drains it).

    python3 -m bench.output_channel --out bench/results/serving/cpu_output_channel

Per channel and number of streams C: the delivery latency (a step's end, stamped in the core, to its message handed
to the streams on the ingress's event loop), the gap between a stream's deltas (ITL) against the step, the deltas
that carried more than one step's token (steps merged: the channel fell behind a step), the step period the loop
kept, and the CPU seconds per step of the core's and the ingress's processes.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import time
import types

from bench.common import ROOT, command, commit, out_path, write_json, write_markdown

CORE_NAME = "bench-output-channel-core"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


class StubEngine:
    """What ``EngineCore`` drives, with a step that sleeps ``step_s`` (a GPU step's wait) and gives every running
    request one token; a token's logprob slot carries the time its step ended."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self.executor = types.SimpleNamespace(model_config=types.SimpleNamespace(vocab_size=512))
        self.allocator = types.SimpleNamespace(capacity_pages=1)
        self.max_model_len, self.sampling_defaults = 4096, {}
        self.metrics = self.failure = None
        self.step_time = {"steps": 0}
        self.num_steps = 0
        self._running: dict[str, list] = {}

    def new_request(self, prompt_ids, params, rid, arrival, queued=0):
        return types.SimpleNamespace(rid=rid, prompt_ids=prompt_ids, max_tokens=params.max_tokens, output_ids=[],
                                     spec=types.SimpleNamespace(num_drafts=0), error=None, num_cached_tokens=0)

    def enqueue(self, req) -> None:
        self._running[req.rid] = req

    def abort(self, rid: str) -> None:
        self._running.pop(rid, None)

    def has_work(self) -> bool:
        return bool(self._running)

    def step_stats(self) -> dict:
        return {"step_time": dict(self.step_time)}

    def shutdown(self) -> None:
        pass

    def step(self) -> list:
        time.sleep(self.step_s)
        self.num_steps += 1
        self.step_time["steps"] += 1
        now = time.time()
        outs = []
        for rid, req in list(self._running.items()):
            req.output_ids.append(100 + len(req.output_ids) % 50)
            done = len(req.output_ids) >= req.max_tokens
            if done:
                del self._running[rid]
            outs.append(types.SimpleNamespace(rid=rid, request=req, new_token_ids=[req.output_ids[-1]],
                                              finished=done, finish_reason="length" if done else None,
                                              new_logprobs=[now], new_top_logprobs=None, num_cached_tokens=0,
                                              prompt_logprobs=None))
        return outs


def core_actor(step_s: float):
    import ray

    from deployments.controller import CORE_NAMESPACE
    from deployments.engine.core import EngineCore

    class Core(EngineCore):
        def __init__(self):
            cfg = types.SimpleNamespace(tokenizer=None, model="stub", worker_step_timeout_s=60.0,
                                        speculative_config=None,
                                        distributed_executor_backend="uni")
            super().__init__(cfg, "stub", engine=StubEngine(step_s))

        def usage(self) -> tuple[float, int]:
            r = resource.getrusage(resource.RUSAGE_SELF)
            return r.ru_utime + r.ru_stime, self.engine.num_steps

    return ray.remote(Core).options(name=CORE_NAME, namespace=CORE_NAMESPACE, max_concurrency=64,
                                    num_cpus=0).remote()


class Ingress:
    """An async actor holding one ``EngineClient`` (as an ingress replica does), joined to the stub core."""

    def __init__(self, channel: str, tokenizer: str):
        from deployments.engine.tokenizer import load_tokenizer
        from deployments.engine_client import EngineClient

        latency = self.latency = []

        class Client(EngineClient):
            def _deliver(self, items, core=None):
                now = time.time()
                for item in items:
                    latency.append(now - item[3][0])
                super()._deliver([(*item[:3], None, None, *item[5:]) for item in items], core)

        self.client = Client(None, "stub", output_channel=channel)
        self.client.tokenizer = load_tokenizer(tokenizer)

    async def join(self) -> None:
        self.client._joined = asyncio.Event()
        await self.client._join(CORE_NAME)
        assert self.client._cores, "the stub core did not join"

    async def run(self, streams: int, tokens: int) -> dict:
        self.latency.clear()
        gaps, merged, deltas = [], 0, 0

        async def one(i: int) -> None:
            nonlocal merged, deltas
            stream = await self.client.add(f"r{i}-{time.monotonic_ns()}", [5, 6, 7], {"max_tokens": tokens,
                                                                                      "ignore_eos": True},
                                           time.time())
            last = None
            async for delta in stream:
                now = time.perf_counter()
                deltas += 1
                merged += len(delta.token_ids) > 1
                if last is not None:
                    gaps.append(now - last)
                last = now

        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(streams)))
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
        return {"wall_s": wall, "ingress_cpu_s": cpu, "latency_ms": [x * 1e3 for x in self.latency],
                "gaps_ms": [x * 1e3 for x in gaps], "merged": merged, "deltas": deltas}

    def close(self) -> None:
        self.client.close()


def measure(channel: str, step_ms: float, levels: list[int], tokens: int, tokenizer: str) -> list[dict]:
    import ray

    core = core_actor(step_ms / 1e3)
    ingress = ray.remote(Ingress).options(num_cpus=0, max_concurrency=1000).remote(channel, tokenizer)
    ray.get(ingress.join.remote())
    rows = []
    try:
        ray.get(ingress.run.remote(4, 20))  # warm-up
        for c in levels:
            cpu0, steps0 = ray.get(core.usage.remote())
            got = ray.get(ingress.run.remote(c, tokens))
            cpu1, steps1 = ray.get(core.usage.remote())
            steps = steps1 - steps0
            lat, gaps = got["latency_ms"], got["gaps_ms"]
            rows.append({"channel": channel, "streams": c, "step_ms": step_ms, "steps": steps,
                         "step_period_ms": round(got["wall_s"] * 1e3 / max(steps, 1), 3),
                         "latency_p50_ms": round(_pct(lat, 0.5), 3), "latency_p99_ms": round(_pct(lat, 0.99), 3),
                         "itl_p50_ms": round(_pct(gaps, 0.5), 3), "itl_mean_ms": round(statistics.fmean(gaps), 3),
                         "merged_deltas": round(got["merged"] / max(got["deltas"], 1), 4),
                         "core_cpu_ms_per_step": round((cpu1 - cpu0) * 1e3 / max(steps, 1), 3),
                         "ingress_cpu_ms_per_step": round(got["ingress_cpu_s"] * 1e3 / max(steps, 1), 3)})
            print(rows[-1], flush=True)
    finally:
        stop(ingress, core)
    return rows


def stop(ingress, core) -> None:
    """Close the ingress actor's channel and the core, then kill both actors."""
    import ray

    ray.get(ingress.close.remote())
    ray.kill(ingress)
    ray.get(core.shutdown.remote())
    ray.kill(core)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--channels", default="poll,push,poll,push", help="in this order (alternated: a noisy machine)")
    ap.add_argument("--streams", default="1,64,256")
    ap.add_argument("--step-ms", type=float, default=1.17, help="the stub's step (default: the 1B shape's decode "
                    "step on an H100)")
    ap.add_argument("--tokens", type=int, default=200, help="tokens per stream")
    ap.add_argument("--tokenizer", default=str(ROOT / "models" / "specserve-tiny"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    levels = [int(x) for x in args.streams.split(",")]
    rows = []
    try:
        for run, channel in enumerate(args.channels.split(",")):
            rows += [dict(r, run=run) for r in measure(channel, args.step_ms, levels, args.tokens, args.tokenizer)]
    finally:
        ray.shutdown()
    out = out_path(args.out)
    import platform

    meta = {"device": f"CPU {platform.machine()} ({__import__('os').cpu_count()} cores)", "commit": commit(),
            "command": command(), "step_ms": args.step_ms, "tokens": args.tokens, "rows": rows}
    write_json(out, meta)
    md = ["# The engine core → ingress output channel, push vs poll (stub engine)", "",
          f"commit `{meta['commit']}` · command `{meta['command']}` · {meta['device']}", "",
          f"A stub engine step of {args.step_ms} ms (a sleep), {args.tokens} tokens per stream, C streams at once. "
          "Latency: a step's end (stamped in the core) to its message on the ingress's event loop; ITL: the gap "
          "between a stream's deltas; merged: the share of deltas carrying more than one step's token; step period: "
          "the wall time per step the loop kept (the stub's sleep plus the loop's own work); CPU: CPU ms per step of "
          "the core's process and of the ingress's.", "",
          "| run | channel | C | step period ms | latency p50 / p99 ms | ITL p50 / mean ms | merged | core CPU ms/step "
          "| ingress CPU ms/step |", "|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['run']} | {r['channel']} | {r['streams']} | {r['step_period_ms']} | {r['latency_p50_ms']} / "
           f"{r['latency_p99_ms']} | {r['itl_p50_ms']} / {r['itl_mean_ms']} | {r['merged_deltas']:.1%} | "
           f"{r['core_cpu_ms_per_step']} | {r['ingress_cpu_ms_per_step']} |" for r in rows]
    write_markdown(out, md)
    print("\n".join(md))


if __name__ == "__main__":
    main()
