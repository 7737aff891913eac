"""Serving benchmark: an OpenAI-compatible endpoint under load, as vLLM's / SGLang's serving benchmarks drive one.

Requests with random prompt and output lengths (uniform within ±range-ratio; 0: fixed) arrive as a Poisson process
at each request rate (inf = all at once), at most --max-concurrency in flight; or, with --concurrencies, 2C requests
all at once with C in flight, for each C (comparable with the engine's offline throughput at batch C). Each streams
a completion over plain HTTP with ignore_eos, so every request produces exactly its output length. Per level:
request and output-token throughput, TTFT, TPOT (time per output token after the first) and
ITL (gaps between streamed chunks; with speculation a chunk may carry several tokens), mean / median / p99.

    python3 -m bench.serving --config configs/local.yaml --request-rates 2,8,inf --out bench/results/serving/cpu_serving
    python3 -m bench.serving --url http://HOST:8000/v1 --model-id M --vocab-size 128256 ...   # a running server
    python3 -m bench.serving --server-config configs/gpu-bench-llama1b-random.yaml --wait-s 600 ...  # `serve run` of it

With --server-config (a config already running under `serve run`), URL, model id and vocabulary come from the config
and the config is recorded with the results. Results are rewritten after every rate; a failed request fails the run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import time
from pathlib import Path

import yaml

from bench.common import ROOT, command, commit, out_path, pyplot, write_json, write_markdown
from deployments.config import LLMConfig


def start_app(config: Path, stream_interval: int | None = None,
              output_channel: str | None = None) -> tuple[str, str, int, str]:
    """Run the config's first application in this process (Ray Serve); returns (base url, model id, vocab, device).
    ``stream_interval`` and ``output_channel`` override the application's."""
    from ray import serve

    from deployments.app import build_app, build_openai_app
    from deployments.rayllm import load_llm_configs

    base, model, args = server_config(config)
    app = yaml.safe_load(config.read_text())["applications"][0]
    several = "llm_configs" in app["args"]
    if several:
        app["args"]["llm_configs"] = load_llm_configs(app["args"]["llm_configs"])
    for a in app["args"]["llm_configs"] if several else [app["args"]]:
        if stream_interval is not None:
            a["stream_interval"] = stream_interval
        if output_channel is not None:
            a["output_channel"] = output_channel
    host, port = base.removeprefix("http://").rsplit(":", 1)
    serve.start(http_options={"host": host, "port": int(port)})
    serve.run((build_openai_app if several else build_app)(app["args"]), name=app.get("name", "default"), route_prefix=app.get("route_prefix", "/"))
    wait_healthy(base, 600)
    return base + "/v1", model, vocab_size(args), args.get("engine_kwargs", {}).get("device", "auto")


async def one_request(http, url: str, headers: dict, model: str, prompt: list[int], max_tokens: int,
                      sampling: dict | None = None) -> dict:
    """One streamed completion over plain HTTP (aiohttp; SSE lines read as raw bytes, only the usage chunk parsed: the
    client must never be what limits the figure): time to the first token, the gaps between chunks that carry text,
    the server's token count and speculation stats. ``sampling``: temperature / top_p (default greedy)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, **(sampling or {})}
    t0 = time.perf_counter()
    stamps, tokens, spec, last_line = [], 0, None, None
    async with http.post(url, json=body, headers=headers) as resp:
        headers_at = time.perf_counter()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:300]!r}")
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            now = last_line = time.perf_counter()
            if not line.startswith(b"data: {"):
                continue
            if b'"usage"' in line and b'"usage": null' not in line and b'"usage":null' not in line:
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                    spec = chunk.get("spec_decode_stats")
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
            elif b'"text":""' in line or b'"text": ""' in line:
                continue  # a chunk without text (the finish reason alone)
            stamps.append(now)
    end = time.perf_counter()
    stamps = stamps or [end]  # no visible text at all: the first token is taken to arrive with the end
    # where a request's time outside the engine goes: the way in up to the response's headers (sent once the core
    # has accepted it), and from the last text chunk to the response's end (the usage chunk, [DONE], the close)
    return {"ttft": stamps[0] - t0, "e2e": end - t0, "tokens": tokens, "asked": max_tokens, "spec": spec,
            "tpot": (end - stamps[0]) / max(tokens - 1, 1), "itl": [b - a for a, b in zip(stamps, stamps[1:])],
            "start": t0, "end": end, "to_headers": headers_at - t0, "last_text_to_end": end - stamps[-1],
            "last_line_to_end": end - (last_line or end)}


async def requests_share(base: str, model: str, prompts, out_lens, rate: float, max_concurrency: int,
                         api_key: str | None = None, seed: int = 0, sampling: dict | None = None,
                         start_at: float | None = None) -> list[dict]:
    """Requests arriving at ``rate`` per second (inf: all at once), at most ``max_concurrency`` in flight; from
    ``start_at`` (``time.time()``) if given, so that client processes spawned one after the other start together."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(max_concurrency)
    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=max_concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:
        late = None
        if start_at is not None:
            late = time.time() - start_at
            await asyncio.sleep(max(0.0, -late))
        if rate == float("inf"):  # closed loop: each of the C slots sends its next request when its last one ends
            todo = iter(zip(prompts, out_lens))

            async def slot() -> list[dict]:
                done, prev_end = [], None
                for p, n in todo:
                    r = await one_request(http, base + "/completions", headers, model, p, n, sampling)
                    # the client's own turn-around: its last response's end to this request's send
                    r["slot_gap"] = None if prev_end is None else r["start"] - prev_end
                    prev_end = r["end"]
                    done.append(r)
                return done

            results = [r for rs in await asyncio.gather(*(slot() for _ in range(max_concurrency))) for r in rs]
            if late is not None and results:  # (how late this process was for the common start, if it was)
                results[0]["late_s"] = max(0.0, late)
                results[0]["proc_start"] = min(r["start"] for r in results)
            return results

        async def limited(p, n):
            async with gate:
                return await one_request(http, base + "/completions", headers, model, p, n, sampling)

        tasks = []
        for p, n in zip(prompts, out_lens):
            tasks.append(asyncio.create_task(limited(p, n)))
            await asyncio.sleep(rng.expovariate(rate))
        return await asyncio.gather(*tasks)


def _share_in_process(args: tuple) -> list[dict]:
    return asyncio.run(requests_share(*args))


async def run_rate(base: str, model: str, prompts, out_lens, rate: float, max_concurrency: int,
                   api_key: str | None = None, procs: int = 1, sampling: dict | None = None) -> dict:
    """One level: requests at ``rate`` per second (inf: all at once), at most ``max_concurrency`` in flight; with
    ``procs`` > 1 (all at once only), the requests and the in-flight limit are split over that many client
    processes, so that many hundreds of streams do not wait on one client's event loop. (One share runs here: a
    client process spawned for it sent a wave's requests spread out, one per engine submit instead of 8, on CPU.)"""
    if procs > 1 and rate == float("inf"):
        import concurrent.futures
        import multiprocessing

        # every process starts at one moment, well after the slowest one's spawn: the level's wall is then not
        # stretched by processes that came up late (fewer than C in flight at its start and end)
        start_at = time.time() + 5.0
        shares = [(base, model, prompts[i::procs], out_lens[i::procs], rate,
                   max(1, max_concurrency // procs + (i < max_concurrency % procs)), api_key, i, sampling, start_at)
                  for i in range(procs) if prompts[i::procs]]
        with concurrent.futures.ProcessPoolExecutor(len(shares), mp_context=multiprocessing.get_context("spawn")) \
                as pool:
            loop = asyncio.get_running_loop()
            results = [r for share in await asyncio.gather(*(loop.run_in_executor(pool, _share_in_process, a)
                                                             for a in shares)) for r in share]
    else:
        results = await requests_share(base, model, prompts, out_lens, rate, max_concurrency, api_key,
                                       sampling=sampling)
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    late = [r["late_s"] for r in results if "late_s" in r]

    def stats(values: list[float]) -> dict:
        v = sorted(values) or [float("nan")]
        return {"mean_ms": round(statistics.fmean(v) * 1e3, 2), "median_ms": round(statistics.median(v) * 1e3, 2),
                "p99_ms": round(v[min(len(v) - 1, int(0.99 * len(v)))] * 1e3, 2)}

    out_tokens = sum(r["tokens"] for r in results)
    short = sum(r["tokens"] != r["asked"] for r in results)
    if short:
        raise RuntimeError(f"{short} of {len(results)} requests came back with fewer or more tokens than asked "
                           "(ignore_eos is set)")
    row = {"request_rate": rate if rate != float("inf") else "inf", "concurrency": max_concurrency,
           "num_requests": len(results), "client_processes": procs if rate == float("inf") else 1,
           "duration_s": round(wall, 2), "request_throughput": round(len(results) / wall, 3),
           "output_tok_s": round(out_tokens / wall, 1), "ttft": stats([r["ttft"] for r in results]),
           "tpot": stats([r["tpot"] for r in results]), "itl": stats([g for r in results for g in r["itl"]]),
           "to_headers": stats([r["to_headers"] for r in results]),
           "last_text_to_end": stats([r["last_text_to_end"] for r in results]),
           "last_line_to_end": stats([r["last_line_to_end"] for r in results]),
           "e2e_mean_ms": round(statistics.fmean(r["e2e"] for r in results) * 1e3, 2)}
    if late:  # a client process that came up after the common start: its share started that much late
        row["client_late_ms"] = round(max(late) * 1e3, 1)
        starts = [r["proc_start"] for r in results if "proc_start" in r]
        row["client_start_spread_ms"] = round((max(starts) - min(starts)) * 1e3, 2)
    gaps = [r["slot_gap"] for r in results if r.get("slot_gap") is not None]
    if gaps:
        row["slot_gap"] = stats(gaps)
    specs = [r["spec"] for r in results if r["spec"]]
    drafts = sum(x.get("num_drafts", 0) for x in specs)
    if drafts:  # the server's own per-request counters, summed over the requests
        row["accept_length"] = round(1 + sum(x.get("num_accepted_tokens", 0) for x in specs) / drafts, 3)
    return row


def offline_levels(app_args: dict, prompts, out_lens, levels: list[int], out_file: str, waves: int = 2,
                   sampling: dict | None = None) -> None:
    """The same workload through the in-process engine (``Engine.step`` in a loop, no HTTP, no Ray): for each C,
    ``waves``·C requests (2C by default) with C in flight, the next one added as soon as one finishes. Writes {C: row}
    to ``out_file``."""
    from deployments.app import resolve_config
    from deployments.engine.engine import Engine
    from deployments.engine.request import SamplingParams

    cfg = resolve_config(dict(app_args)).engine_config()
    if cfg.resolved_device() == "cpu":
        import torch

        torch.set_num_threads(1)  # as the server's worker actor (Ray gives an actor of < 1 CPU one thread)
    engine = Engine(cfg)

    def run(n: int, concurrency: int) -> dict:
        todo = list(range(n))
        added, first, last, count = {}, {}, {}, {}
        t0 = time.perf_counter()

        def add() -> None:
            i = todo.pop(0)
            rid = engine.add_request(prompts[i], SamplingParams(max_tokens=out_lens[i], ignore_eos=True,
                                                                **{"temperature": 0.0, **(sampling or {})})).rid
            added[rid] = time.perf_counter()

        for _ in range(min(concurrency, n)):
            add()
        extends, steps = engine.step_time["extend_steps"], engine.step_time["steps"]
        before = {"step_time": dict(engine.step_time)}
        phases = dict(engine.request_phases)
        while engine.has_work():
            for o in engine.step():
                now = time.perf_counter()
                if o.new_token_ids:
                    first.setdefault(o.rid, now)
                    last[o.rid] = now
                    count[o.rid] = count.get(o.rid, 0) + len(o.new_token_ids)
                if o.finished and todo:
                    add()
        wall = time.perf_counter() - t0
        ttft = sorted(first[r] - added[r] for r in added)
        tpot = sorted((last[r] - first[r]) / max(1, count[r] - 1) for r in added)
        return {"concurrency": concurrency, "num_requests": n, "output_tok_s": round(sum(count.values()) / wall, 1),
                "ttft_median_ms": round(statistics.median(ttft) * 1e3, 2),
                "tpot_median_ms": round(statistics.median(tpot) * 1e3, 3),
                "extend_steps": engine.step_time["extend_steps"] - extends,
                "steps": engine.step_time["steps"] - steps, "phases_ms": phase_means(phases, engine.request_phases),
                "per_step": per_step(before, {"step_time": dict(engine.step_time)})}

    run(2, 1)  # warm-up: a prompt alone, then several at once (the kernels of both prefill shapes)
    run(8, 8)
    # and a first full wave of 16: the first level with 16 in flight ran 2-3x slower than served in every run
    run(16, 16)
    rows = {c: run(waves * c, c) for c in levels}
    Path(out_file).write_text(json.dumps(rows))
    engine.shutdown()


def server_stats(base: str, api_key: str | None = None) -> dict:
    """The server's /v1/stats ({} from a server without it, e.g. another OpenAI-compatible one)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{base}/stats", headers=headers, timeout=30)
        return resp.json() if resp.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


def phase_means(before: dict, after: dict) -> dict:
    """The mean of each request phase (``Request.phases``) in ms over the requests that finished between two
    readings of the engine's ``request_phases`` totals."""
    n = after.get("requests", 0) - before.get("requests", 0)
    if n <= 0:
        return {}
    return {k[:-2]: round((v - before.get(k, 0.0)) / n * 1e3, 2) for k, v in after.items() if k.endswith("_s")}


def per_step(before: dict, after: dict) -> dict:
    """The server's own host time per engine step over one rate: schedule / execute (workers, round trip) /
    outputs (reading the tokens, metrics) inside the step, and the engine loop's wall time per step."""
    a, b = after.get("step_time"), before.get("step_time")
    if not a or not b:
        return {}
    steps = a["steps"] - b["steps"]
    if steps <= 0:
        return {"steps": 0}
    ms = lambda key, x=a, y=b: round((x[key] - y[key]) / steps * 1e3, 3)  # noqa: E731
    row = {"steps": steps, "schedule_ms": ms("schedule_s"), "execute_ms": ms("execute_s"),
           "worker_ms": ms("worker_s"), "outputs_ms": ms("outputs_s")}
    if "wait_s" in a and "wait_s" in b:  # the host's waits for the device per step; prefill steps' wall, in all
        row["wait_ms"] = ms("wait_s")
        row["extend_wall_ms_total"] = round((a["extend_wall_s"] - b["extend_wall_s"]) * 1e3, 1)
    if "loop" in after and "loop" in before:
        row["loop_wall_ms"] = ms("busy_s", after["loop"], before["loop"])
        # the engine core's wall time per step that ran (with handing its outputs to the polls)
        submits = after["loop"].get("submits", 0) - before["loop"].get("submits", 0)
        if submits > 0 and "requests" in after and "requests" in before:  # how the arrivals reached the core
            row["submits"] = submits
            row["requests_per_submit"] = round((after["requests"] - before["requests"]) / submits, 2)
    if "extend_steps" in a and "extend_steps" in b:  # prefill (or mixed) steps: the pieces the arrivals came in
        row["extend_steps"] = a["extend_steps"] - b["extend_steps"]
    la, lb = after.get("loop") or {}, before.get("loop") or {}
    if "slow_steps" in la and "slow_steps" in lb:  # steps that stalled every stream (the core's SLOW_STEP_S)
        row["slow_steps"] = la["slow_steps"] - lb["slow_steps"]
        row["slow_steps_ms"] = round((la["slow_steps_s"] - lb["slow_steps_s"]) * 1e3, 1)
    if "gc" in after and "gc" in before:  # the engine core's garbage collections over the level
        row["gc"] = {g: {"collections": a["collections"] - before["gc"][g]["collections"],
                         "ms": round((a["s"] - before["gc"][g]["s"]) * 1e3, 1)} for g, a in after["gc"].items()}
    if "compiles" in after and "compiles" in before:  # Triton compiles inside the level's steps (rank 0 in the core)
        row["compiles"] = after["compiles"]["compiles"] - before["compiles"]["compiles"]
        row["compiles_ms"] = round((after["compiles"]["s"] - before["compiles"]["s"]) * 1e3, 1)
        if "graph_captures" in after["compiles"] and "graph_captures" in before["compiles"]:  # graphs on first use
            row["graph_captures"] = after["compiles"]["graph_captures"] - before["compiles"]["graph_captures"]
            row["graph_captures_ms"] = round((after["compiles"]["graph_capture_s"]
                                              - before["compiles"]["graph_capture_s"]) * 1e3, 1)
    if "request_phases" in after:  # where the level's requests spent their time, on average
        row["phases_ms"] = phase_means(before.get("request_phases") or {}, after["request_phases"])
    return row


# the server's processes on this machine, by the title Ray gives them (or the program's name)
ROLES = (("OpenAIIngress", "ingress"), ("LLMController", "controller"), ("EngineCore", "engine core"),
         ("WorkerActor", "worker"), ("ProxyActor", "proxy"), ("haproxy", "haproxy"), ("raylet", "ray"),
         ("gcs_server", "ray"))


def server_processes() -> dict[int, str]:
    """pid -> role of the server's processes running here (Linux /proc; {} elsewhere)."""
    found = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
        except OSError:
            continue
        role = next((r for key, r in ROLES if key in cmd), None)
        if role is not None:
            found[int(d.name)] = role
    return found


def cpu_seconds(pids: dict[int, str]) -> dict[int, float]:
    """Each process's user + system CPU seconds so far (a process gone since is left out)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def py_spy_summary(raw: Path, top: int = 25) -> list[str]:
    """Markdown of a py-spy raw profile (``--threads``): per thread, its share of the samples, then the functions
    with the most samples on top of the stack (own) and anywhere in it (inclusive)."""
    from collections import Counter

    per_thread: dict[str, list[tuple[list[str], int]]] = {}
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        per_thread.setdefault(frames[0], []).append((frames[1:], int(n)))
    total = sum(n for stacks in per_thread.values() for _, n in stacks) or 1
    md = [f"# py-spy: {raw.name} ({total} samples, not idle)"]
    for thread, stacks in sorted(per_thread.items(), key=lambda t: -sum(n for _, n in t[1])):
        own, incl = Counter(), Counter()
        for frames, n in stacks:
            own[frames[-1] if frames else "?"] += n
            for f in set(frames):
                incl[f] += n
        share = sum(n for _, n in stacks)
        md += ["", f"## {thread}: {100 * share / total:.1f}% of the samples", "", "| own % | function |", "|---|---|"]
        md += [f"| {100 * n / total:.1f} | `{f}` |" for f, n in own.most_common(top)]
        md += ["", "| inclusive % | function |", "|---|---|"]
        md += [f"| {100 * n / total:.1f} | `{f}` |" for f, n in incl.most_common(top)]
    return md


class LevelCPU:
    """CPU use of the server's processes and of this benchmark's clients over one level, in cores (CPU seconds per
    second of the level): which process is saturated when served throughput stops following the engine. With
    ``py_spy_dir``, the ingress replicas and the engine core are also sampled by py-spy for the level."""

    def __init__(self, py_spy_dir: str | None = None, tag: str = ""):
        import resource

        self.pids = server_processes()
        self.t0, self.cpu0 = time.monotonic(), cpu_seconds(self.pids)
        own = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        self.client0 = sum(u.ru_utime + u.ru_stime for u in own)
        self.spies = []
        if py_spy_dir:
            import shutil
            import subprocess

            Path(py_spy_dir).mkdir(parents=True, exist_ok=True)
            for pid, role in self.pids.items():
                if role in ("ingress", "engine core") and shutil.which("py-spy"):
                    raw = Path(py_spy_dir) / f"{role.replace(' ', '_')}_{pid}_{tag}.txt"
                    self.spies.append(subprocess.Popen(
                        ["py-spy", "record", "--nonblocking", "--threads", "-r", "100", "-f", "raw", "-d", "3600",
                         "-p", str(pid), "-o", str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def stop(self) -> None:
        """py-spy writes its samples when interrupted (one that does not stop within a minute is killed)."""
        import signal
        import subprocess

        for spy in self.spies:
            if spy.poll() is None:
                spy.send_signal(signal.SIGINT)
        for spy in self.spies:
            try:
                spy.wait(timeout=60)
            except subprocess.TimeoutExpired:
                spy.kill()

    def done(self) -> dict[str, float]:
        import resource

        wall = time.monotonic() - self.t0
        cpu1 = cpu_seconds(self.pids)
        own = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        self.stop()
        for spy in self.spies:
            raw = Path(spy.args[-1])
            if raw.exists():
                raw.with_suffix(".md").write_text("\n".join(py_spy_summary(raw)) + "\n")
        cores: dict[str, float] = {}
        for pid, role in self.pids.items():
            if pid in cpu1 and pid in self.cpu0:
                cores[role] = cores.get(role, 0.0) + (cpu1[pid] - self.cpu0[pid]) / wall
        cores["client"] = (sum(u.ru_utime + u.ru_stime for u in own) - self.client0) / wall
        return {role: round(c, 2) for role, c in sorted(cores.items())}


def server_config(path: Path) -> tuple[str, str, dict]:
    """(base URL, model id, application args) of a serve config (its first application)."""
    spec = yaml.safe_load(path.read_text())
    http = spec.get("http_options", {})
    args = spec["applications"][0]["args"]
    if "llm_configs" in args:  # Ray Serve LLM's shape (deployments.app:build_openai_app): its first model
        from deployments.rayllm import load_llm_configs

        args = load_llm_configs(args["llm_configs"])[0]
    return (f"http://{http.get('host', '127.0.0.1')}:{http.get('port', 8000)}",
            args["model_loading_config"]["model_id"], args)


def vocab_size(app_args: dict) -> int:
    """The served checkpoint's vocabulary (read once the server is up: it may build its default model first)."""
    source = Path(app_args["model_loading_config"]["model_source"])
    source = source if source.is_absolute() else ROOT / source
    return json.loads((source / "config.json").read_text())["vocab_size"]


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (an exited child its parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


DEPLOY_FAILED = ("Failed to update the deployments", "DEPLOY_FAILED")  # Ray Serve's words for a failed deploy


def wait_healthy(base: str, timeout_s: float, server_pid: int | None = None, server_log: str | None = None) -> None:
    """Poll <base>/health until 200; fail after timeout_s, or at once when the server process has exited or its log
    says the deploy failed (`serve run` keeps running, retrying, after a replica's constructor raised)."""
    import httpx

    deadline = time.time() + timeout_s
    while True:
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if server_pid is not None and not alive(server_pid):
            raise SystemExit(f"server process {server_pid} exited before {base}/health answered")
        if server_log and Path(server_log).is_file():
            bad = [line for line in Path(server_log).read_text(errors="replace").splitlines()
                   if any(w in line for w in DEPLOY_FAILED)]
            if bad:
                raise SystemExit(f"the deploy failed ({server_log}):\n" + "\n".join(bad[:5]))
        if time.time() > deadline:
            raise SystemExit(f"{base}/health did not answer 200 within {timeout_s:.0f}s")
        time.sleep(1.0)


def write(meta: dict, rows: list[dict], out: Path) -> None:
    """<out>.json, .md and .png from the rows measured so far."""
    meta = {**meta, "rows": rows}
    key, head = ("concurrency", "concurrency") if meta.get("concurrencies") else ("request_rate", "rate (req/s)")
    write_json(out, meta)
    spec = any("accept_length" in r for r in rows)
    md = [f"# Serving benchmark ({meta['device']})", "",
          f"commit `{meta['commit']}` · command `{meta['command']}`", "",
          (f"{meta.get('waves', 2)}C requests per level" if meta.get("concurrencies") else f"{meta['num_prompts']} requests per rate") +
          f", input {meta['input_len']} / output {meta['output_len']} tokens "
          f"(±{meta['range_ratio']:.0%}), " + (f"{meta.get('waves', 2)}C requests at once with C in flight" if meta.get("concurrencies")
                                                else f"at most {meta['max_concurrency']} in flight") +
          ", " + (", ".join(f"{k} {v}" for k, v in meta["sampling"].items()) if meta.get("sampling") else "greedy")
          + ", streamed, ignore_eos"]
    if meta.get("engine_kwargs"):
        md += ["", f"server engine_kwargs: `{json.dumps(meta['engine_kwargs'])}`"]
    if meta.get("stream_interval") is not None:
        md += ["", f"stream_interval: {meta['stream_interval']}"
               + (f" · stream_batching_interval_ms: {meta['stream_batching_interval_ms']}"
                  if meta.get("stream_batching_interval_ms") is not None else "")
               + (f" · output_channel: {meta['output_channel']}" if meta.get("output_channel") else "")]
    if meta.get("startup_s") is not None:
        md += ["", f"server start-up (serve.run until healthy): {meta['startup_s']} s"]
    md += ["", f"| {head} | req/s | output tok/s | TTFT median / p99 ms | TPOT median / p99 ms | "
           "ITL median / p99 ms |" + (" accept length |" if spec else ""),
           "|---|---|---|---|---|---|" + ("---|" if spec else "")]
    md += [f"| {r[key]} | {r['request_throughput']} | {r['output_tok_s']} | {r['ttft']['median_ms']} / "
           f"{r['ttft']['p99_ms']} | {r['tpot']['median_ms']} / {r['tpot']['p99_ms']} | {r['itl']['median_ms']} / "
           f"{r['itl']['p99_ms']} |" + (f" {r.get('accept_length', '')} |" if spec else "") for r in rows]
    if any("offline" in r for r in rows):
        md += ["", "The same workload through the in-process engine (offline: `Engine.step` in a loop, the next request "
               "added as one finishes), measured first in the same run:", "",
               f"| {head} | served tok/s | offline tok/s | served ÷ offline | TTFT p50 served / offline ms | "
               "TPOT p50 served / offline ms |", "|---|---|---|---|---|---|"]
        md += [f"| {r[key]} | {r['output_tok_s']} | {o['output_tok_s']} | {r['served_over_offline']} | "
               f"{r['ttft']['median_ms']} / {o['ttft_median_ms']} | {r['tpot']['median_ms']} / {o['tpot_median_ms']} |"
               for r in rows if "offline" in r for o in [r["offline"]]]
    split = [r for r in rows if r.get("slot_gap")]
    if split:
        md += ["", "A closed-loop request's cycle from the client's side, mean ms (p50 in brackets): the slot's turn-around "
               "(its last response's end to this send), send → response headers (the front end's way in and the "
               "core's acceptance), headers → first text, first text → last text, and the last text → the "
               "response's end (the usage chunk, [DONE] and the close). The cycle is their sum; C × 1000 ÷ it is "
               "the requests per second the level can run.", "",
               f"| {head} | turn-around | send → headers | headers → first text | first → last text | last text "
               "→ end | cycle |", "|---|---|---|---|---|---|---|"]
        for r in split:
            parts = [r["slot_gap"], r["to_headers"]]
            h2f = r["ttft"]["mean_ms"] - r["to_headers"]["mean_ms"]
            body = r["e2e_mean_ms"] - r["ttft"]["mean_ms"] - r["last_text_to_end"]["mean_ms"]
            cycle = r["slot_gap"]["mean_ms"] + r["e2e_mean_ms"]
            md += [f"| {r[key]} | " + " | ".join(f"{x['mean_ms']} ({x['median_ms']})" for x in parts)
                   + f" | {h2f:.2f} | {body:.2f} | {r['last_text_to_end']['mean_ms']} "
                   f"({r['last_text_to_end']['median_ms']}) | {cycle:.2f} |"]
    steps = [r for r in rows if r.get("server_per_step", {}).get("steps")]
    if steps:
        md += ["", "Server host time per engine step (from /v1/stats): schedule, execute (the workers' step, round "
               "trip; worker: rank 0's own part of it), outputs (reading the tokens, metrics), and the engine "
               "loop's wall time per step (with handing the outputs to the ingress polls); prefill steps: the EXTEND "
               "steps (prompt chunks, with decode rows when mixed) over the level, served and offline (how many "
               "pieces the arrivals were admitted in), and the requests per submit call into the engine core.", "",
               f"| {head} | steps | schedule ms | execute ms | worker ms | outputs ms | loop wall ms | prefill "
               "steps (offline) | requests per submit |", "|---|---|---|---|---|---|---|---|---|"]
        md += [f"| {r[key]} | {p['steps']} | {p['schedule_ms']} | {p['execute_ms']} | "
               f"{p.get('worker_ms', '')} | {p['outputs_ms']} | {p.get('loop_wall_ms', '')} | "
               f"{p.get('extend_steps', '')} ({r.get('offline', {}).get('extend_steps', '-')}) | "
               f"{p.get('requests_per_submit', '')} |"
               for r in steps for p in [r["server_per_step"]]]
        offline = [(r, r["offline"]["per_step"]) for r in steps if r.get("offline", {}).get("per_step")]
        if offline:
            md += ["", "The offline engine's host time per step over the same level (no loop around it):", "",
                   f"| {head} | steps | schedule ms | execute ms | worker ms | outputs ms | wall ms |",
                   "|---|---|---|---|---|---|---|"]
            md += [f"| {r[key]} | {o['steps']} | {o['schedule_ms']} | {o['execute_ms']} | {o['worker_ms']} | "
                   f"{o['outputs_ms']} | {round(o['schedule_ms'] + o['execute_ms'] + o['outputs_ms'], 3)} |"
                   for r, o in offline]
        waits = [r for r in steps if "wait_ms" in r["server_per_step"]]
        if waits:
            md += ["", "The host's waits for the device per step (in execute), and all prefill steps' wall over the "
                   "level, served (offline):", "", f"| {head} | wait ms | prefill steps' wall ms |", "|---|---|---|"]
            md += [f"| {r[key]} | {p['wait_ms']} ({o.get('wait_ms', '-')}) | {p['extend_wall_ms_total']} "
                   f"({o.get('extend_wall_ms_total', '-')}) |"
                   for r in waits for p, o in [(r["server_per_step"], r.get("offline", {}).get("per_step") or {})]]
    phased = [r for r in steps if r["server_per_step"].get("phases_ms")]
    if phased:
        names = ("receive", "inbox", "queue", "prefill", "decode")
        stalls = lambda p: (f"{p.get('slow_steps', '')} / {p.get('slow_steps_ms', '')} ms" + (  # noqa: E731
            " · GC gen2 {collections} / {ms} ms".format(**p["gc"]["gen2"]) if "gc" in p else "") + (
            f" · Triton compiles {p['compiles']} / {p['compiles_ms']} ms" if "compiles" in p else "") + (
            f" · graphs captured {p['graph_captures']} / {p['graph_captures_ms']} ms" if "graph_captures" in p else ""))
        md += ["", "Where a request's time went, mean ms per finished request over the level (the engine core's "
               "timestamps): receive (the ingress's arrival until the core had it), inbox (until the engine loop "
               "queued it), queue (until its prefill was planned), prefill (until its first token), decode (first "
               "token to last); offline in brackets; engine steps over the level, served (offline); and the steps "
               "that stalled every stream (loop wall over 50 ms: how many / their total), with the engine core's "
               "full garbage collections and, with rank 0 in the core, the Triton compiles and CUDA graph captures "
               "inside steps (how many / their total).", "",
               f"| {head} | " + " | ".join(names) + " | steps | slow steps |", "|---|" + "---|" * (len(names) + 2)]
        md += [f"| {r[key]} | " + " | ".join(f"{p.get(n, '')}" + (f" ({o[n]})" if n in o else "") for n in names)
               + f" | {r['server_per_step']['steps']} ({r.get('offline', {}).get('steps', '-')}) | "
               + f"{stalls(r['server_per_step'])} |"
               for r in phased for p, o in [(r["server_per_step"]["phases_ms"],
                                             r.get("offline", {}).get("phases_ms") or {})]]
    cpu = [r for r in rows if r.get("server_cpu_cores")]
    if cpu:
        roles = sorted({k for r in cpu for k in r["server_cpu_cores"]})
        md += ["", "CPU use over each level, in cores (CPU seconds per second) of the server's processes on this "
               "machine by role (summed over a role's processes) and of this benchmark's clients: a role near "
               "1.0 a process is saturated (the ingress replica and the engine core each run one event loop or "
               "engine loop).", "", f"| {head} | " + " | ".join(roles) + " |", "|---|" + "---|" * len(roles)]
        md += [f"| {r[key]} | " + " | ".join(str(r["server_cpu_cores"].get(k, "")) for k in roles) + " |"
               for r in cpu]
    write_markdown(out, md)
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    labels = [str(r[key]) for r in rows]
    axes[0].bar(labels, [r["output_tok_s"] for r in rows])
    axes[0].set_xlabel(head)
    axes[0].set_ylabel("output tokens/s")
    for key in ("ttft", "tpot"):
        axes[1].plot(labels, [r[key]["median_ms"] for r in rows], "o-", label=f"{key} median")
        axes[1].plot(labels, [r[key]["p99_ms"] for r in rows], "x--", label=f"{key} p99")
    axes[1].set_xlabel(head)
    axes[1].set_ylabel("ms")
    axes[1].set_yscale("log")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"{meta['device']} · {meta['commit']}" + (f" · {meta['model_id']}" if meta.get("model_id") else ""),
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    plt.close(fig)


def workload(args, vocab: int) -> tuple[list[int], list[list[int]], list[int]]:
    """(concurrency levels, prompts, output lengths): the same for every engine given the same arguments."""
    rng = random.Random(1)
    levels = [int(c) for c in args.concurrencies.split(",")] if args.concurrencies else []
    args.num_prompts = max([args.num_prompts] + [args.waves * c for c in levels])
    lens = lambda n: [rng.randint(int(n * (1 - args.range_ratio)), int(n * (1 + args.range_ratio)))  # noqa: E731
                      for _ in range(args.num_prompts)]
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(n)] for n in lens(args.input_len)]
    return levels, prompts, lens(args.output_len)


def sampling(args) -> dict:
    """The requests' sampling fields (none: greedy)."""
    return {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p)) if v is not None}


def measure_offline(config: Path, args) -> dict[int, dict]:
    """``offline_levels`` in a child process, so that its device memory is free again before the server starts."""
    import multiprocessing
    import tempfile

    app_args = server_config(config)[2]
    levels, prompts, out_lens = workload(argparse.Namespace(**vars(args)), vocab_size(app_args))
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        child = multiprocessing.get_context("spawn").Process(
            target=offline_levels, args=(app_args, prompts, out_lens, levels, f.name, args.waves, sampling(args)))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise RuntimeError(f"the offline run failed (exit code {child.exitcode})")
        rows = {int(c): row for c, row in json.loads(Path(f.name).read_text()).items()}
    for c, row in rows.items():
        print("offline", row, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None, help="a serve config whose first application is started here")
    ap.add_argument("--stream-interval", type=int, default=None, help="with --config: override its stream_interval")
    ap.add_argument("--output-channel", choices=("push", "poll"), default=None,
                    help="with --config: override its output_channel (how each step's outputs reach the ingress)")
    ap.add_argument("--client-url", default=None, help="with --config: send the requests here instead (e.g. an ingress "
                    "replica's own port under Ray Serve's direct ingress)")
    ap.add_argument("--server-config", default=None, help="or the serve config of a server already running "
                    "(`serve run` of it): URL, model id and vocabulary are read from it")
    ap.add_argument("--url", default=None, help="or an OpenAI base URL of a running server")
    ap.add_argument("--model-id", default=None)
    ap.add_argument("--vocab-size", type=int, default=None)
    ap.add_argument("--wait-s", type=float, default=0, help="wait this long for the server's /health first")
    ap.add_argument("--server-pid", type=int, default=None, help="stop waiting when this process has exited")
    ap.add_argument("--server-log", default=None, help="stop waiting when this log says the deploy failed")
    ap.add_argument("--device-label", default=None, help="the server's device, for the report (e.g. the GPU name)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--request-rates", default="2,8,inf")
    ap.add_argument("--concurrencies", default=None, help="instead of rates: for each C, 2C requests at once, C in "
                    "flight (e.g. 1,16,64,128,256)")
    ap.add_argument("--waves", type=int, default=2, help="with --concurrencies: waves x C requests per level (more waves: a longer steady state, less of the start and the tail)")
    ap.add_argument("--api-key", default=None, help="the server's API key, if it needs one")
    ap.add_argument("--temperature", type=float, default=None, help="sample at this temperature (default: greedy)")
    ap.add_argument("--top-p", type=float, default=None, help="with --temperature: nucleus sampling")
    ap.add_argument("--offline", action="store_true", help="with --config and --concurrencies: first the same "
                    "workload through the in-process engine (in a child process), reported beside the served rows")
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--client-procs", type=int, default=0, help="client processes for a level with all requests at "
                    "once (default: one per 32 streams in flight, at most 8)")
    ap.add_argument("--py-spy-levels", default="", help="levels (C or rate) at which py-spy samples the ingress "
                    "replicas and the engine core (it must be on PATH); raw samples go beside --out")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.top_p is not None and not args.temperature:
        ap.error("--top-p needs --temperature above 0 (a greedy request ignores it)")
    engine_kwargs = stream_interval = app_args = startup_s = None
    offline = {}
    if args.offline:
        if not (args.config and args.concurrencies):
            ap.error("--offline needs --config and --concurrencies")
        offline = measure_offline(Path(args.config), args)
    if args.config:
        t0 = time.perf_counter()
        base, model, vocab, device = start_app(Path(args.config), args.stream_interval, args.output_channel)
        # serve.run until healthy: loading, graphs, warm-ups (only a server started here: --config)
        startup_s = round(time.perf_counter() - t0, 1)
        app_args = server_config(Path(args.config))[2]
        engine_kwargs = app_args.get("engine_kwargs")
        stream_interval = args.stream_interval or app_args.get("stream_interval", 1)
    elif args.server_config:
        base, model, app_args = server_config(Path(args.server_config))
        engine_kwargs = app_args.get("engine_kwargs")
        stream_interval = app_args.get("stream_interval", 1)
        device = (engine_kwargs or {}).get("device", "remote")
        if args.wait_s:
            wait_healthy(base, args.wait_s, args.server_pid, args.server_log)
        base, vocab = base + "/v1", args.vocab_size or vocab_size(app_args)
    elif args.url:
        if not (args.model_id and args.vocab_size):
            ap.error("--url needs --model-id and --vocab-size")
        base, model, vocab, device = args.url, args.model_id, args.vocab_size, "remote"
        if args.wait_s:
            wait_healthy(base.removesuffix("/v1"), args.wait_s, args.server_pid,
                         args.server_log)
    else:
        ap.error("one of --config, --server-config, --url")
    model = args.model_id or model
    if args.client_url:
        base = args.client_url
        wait_healthy(base.removesuffix("/v1"), 120)
    levels, prompts, out_lens = workload(args, vocab)
    import platform

    label = args.device_label or (f"CPU {platform.machine()}" if device == "cpu" else device)
    meta = {"device": label, "commit": commit(), "command": command(),
            "config": args.config or args.server_config, "stream_interval": stream_interval, "url": base,
            "serve_env": {k: v for k, v in os.environ.items() if k.startswith("RAY_SERVE_")},
            "stream_batching_interval_ms": None if app_args is None else app_args.get(
                "stream_batching_interval_ms", LLMConfig.model_fields["stream_batching_interval_ms"].default),
            "output_channel": None if app_args is None else (args.output_channel or app_args.get(
                "output_channel", LLMConfig.model_fields["output_channel"].default)),
            "model_id": model, "engine_kwargs": engine_kwargs,
            "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
            "range_ratio": args.range_ratio, "max_concurrency": args.max_concurrency, "concurrencies": levels,
            "waves": args.waves, "startup_s": startup_s, "sampling": sampling(args)}
    rows = []
    # warm-up: a prompt alone, then several at once (the kernels of both prefill shapes), as the offline run does
    asyncio.run(run_rate(base, model, prompts[:2], [8] * 2, float("inf"), 1, args.api_key, sampling=sampling(args)))
    asyncio.run(run_rate(base, model, prompts[:8], [8] * 8, float("inf"), 8, args.api_key, sampling=sampling(args)))
    # this process may be the server's Ray driver, with the whole application imported: its heap is frozen, so that
    # no full collection of it lands in a level's clients
    gc.collect()
    gc.freeze()
    runs = ([(float("inf"), c, args.waves * c) for c in levels] if levels else
            [(float(r), args.max_concurrency, len(prompts)) for r in args.request_rates.split(",")])
    for rate, concurrency, n in runs:
        before = server_stats(base, args.api_key)
        procs = args.client_procs or min(8, max(1, concurrency // 32))
        level = concurrency if levels else rate
        spy = str(level) in args.py_spy_levels.split(",") or f"{level:g}" in args.py_spy_levels.split(",")
        cpu = LevelCPU(str(out_path(args.out)) + "_py-spy" if spy else None, f"c{level:g}")
        try:
            rows.append(asyncio.run(run_rate(base, model, prompts[:n], out_lens[:n], rate, concurrency,
                                             args.api_key, procs, sampling(args))))
        finally:
            cpu.stop()  # (a failed level leaves no profiler running)
        rows[-1]["server_cpu_cores"] = cpu.done()
        rows[-1]["server_per_step"] = per_step(before, server_stats(base, args.api_key))
        if concurrency in offline:
            rows[-1]["offline"] = offline[concurrency]
            rows[-1]["served_over_offline"] = round(rows[-1]["output_tok_s"] / offline[concurrency]["output_tok_s"], 3)
        print(rows[-1], flush=True)
        write(meta, rows, out_path(args.out))


if __name__ == "__main__":
    main()
