"""Serving overheads: cold start, controller↔worker per-step orchestration, ITL at bs=1 over HTTP vs engine-only.

    python3 -m bench.serve_overhead --out bench/results/serving/cpu_serve_overhead [--device cpu]

Per-step orchestration = (step time through worker actors) − (step time of the same worker in-process), measured on
the same decode steps; for Ray Compiled Graphs and for plain actor calls.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import command, commit, device_name, out_path, write_json, write_markdown


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def decode_step_ms(engine, steps: int) -> list[float]:
    from deployments.engine.request import SamplingParams

    engine.add_request([11, 12, 13, 14], SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1000)
    while engine.has_work():
        engine.step()
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default="bench/results/serving/cpu_serve_overhead")
    args = ap.parse_args()
    import httpx
    import ray
    from ray import serve

    from deployments.app import build_app
    from deployments.engine.engine import Engine
    from deployments.engine.executor import RayExecutor
    from deployments.make_tiny import make_tiny
    from workers.config import EngineConfig

    model = args.model or str(make_tiny("llama", Path(tempfile.mkdtemp()) / "m", layers=4, hidden=256, vocab=2048,
                                        max_position=2048))
    cfg = EngineConfig(model=model, device=args.device, max_model_len=1024)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    local = statistics.median(decode_step_ms(Engine(cfg), args.steps))
    res = {"local_step_ms": round(local, 3)}
    for name, compiled in (("compiled_graph", True), ("actor_call", False)):
        ex = RayExecutor.start(cfg, use_compiled_graph=compiled)
        med = statistics.median(decode_step_ms(Engine(cfg, ex), args.steps))
        ex.shutdown()
        res[f"{name}_step_ms"] = round(med, 3)
        res[f"{name}_overhead_ms"] = round(med - local, 3)
    # HTTP: cold start and streaming ITL at bs=1
    port = _port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    t0 = time.perf_counter()
    serve.run(build_app({"model_loading_config": {"model_id": "m", "model_source": model},
                         "engine_kwargs": {"device": args.device, "max_model_len": 1024}}), blocking=False)
    base = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    res["cold_start_s"] = round(time.perf_counter() - t0, 2)
    gaps = []
    with httpx.Client(base_url=base, timeout=120) as c:
        for _ in range(3):
            last = None
            body = {"model": "m", "prompt": [11, 12, 13, 14], "max_tokens": 64, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append((now - last) * 1000)
                        last = now
    res["http_itl_ms_median"] = round(statistics.median(gaps), 3)
    res["engine_itl_ms_median"] = res["local_step_ms"]
    serve.shutdown()
    ray.shutdown()
    meta = {"device": device_name(args.device), "commit": commit(), "command": command(),
            "model": model if args.model else "make_tiny llama layers=4 hidden=256 vocab=2048", "results": res}
    out = out_path(args.out)
    write_json(out, meta)
    md = [f"# Serving overheads ({meta['device']})", "", f"commit `{meta['commit']}`, command `{meta['command']}`", "",
          "| measure | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in res.items()]
    write_markdown(out, md)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
