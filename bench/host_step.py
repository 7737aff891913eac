"""The engine's host time per DECODE step, by batch size: planning (schedule), launching and reading a step
(execute; ``worker`` is rank 0's own part of it) and a step's outputs (tokens to requests, detokenizing, metrics).
With the overlap schedule these must hide behind the device's step; ``wall`` is what a step really took.

On a CPU the step itself (execute) is the model's own compute and is reported only for scale:

    specserve make-tiny --out /tmp/micro --layers 1 --hidden 64 --heads 4 --kv-heads 2 --vocab 2048 --max-position 2048
    python3 -m bench.host_step --model /tmp/micro --out bench/results/host_step/cpu_host_step

On a GPU (bf16, Triton attention, CUDA graphs as ``gpu_perf`` runs them; ``--no-metrics`` there, Ray is not needed),
``--profile-batch N`` also records, at N requests, the kernels of the steady-state engine steps (wall vs busy time per
step, per-kernel totals) and the host's functions by own time (cProfile), to tell a host-bound step from a
device-bound one:

    python3 -m bench.common --shape llama-3.2-1b --out /tmp/l1
    python3 -m bench.host_step --device cuda --model /tmp/l1 --no-metrics --prompt-len 128 --new-tokens 128 \\
        --batch-sizes 64,128,256 --profile-batch 256 --out bench/results/host_step/gpu_host_step_1b_h100

``--served`` runs the engine as the served engine core does (no detokenizing: the ingress does it) and also times,
per step, its metrics calls (``metrics``, part of ``outputs``) and the core's push messages (``publish``: each
output packed, one pickled and signed message per ingress replica, ``--clients`` of them; the ZMQ send left out):

    python3 -m bench.host_step --model /tmp/micro --served --batch-sizes 64,256 --out bench/results/host_step/cpu_served

``--stub-worker`` replaces the worker's step by a stub that answers each step at once with one token per row (a
plain step's ``StepResult``): what is left is the engine's own host work, without the model's CPU compute (which
on this machine is most of a step and varies with its load). ``execute`` is then the stub's:

    python3 -m bench.host_step --model /tmp/micro --served --stub-worker --gc-freeze --batch-sizes 64,256 \
        --new-tokens 128 --repeats 3 --out bench/results/host_step/cpu_served_stub

``--messages`` (no model) times the controller<->worker step message on its own: building a DECODE step's
``WorkerStep`` (``StepPlan.to_worker_step``), its pickling (dumps on the controller, loads on the worker),
the worker filling the CUDA graphs' static inputs from it (``StaticInputs.fill``, here into host memory), the
worker turning a step's copied outputs into the ``StepResult`` (plain decode and a speculative round of 3 drafts),
that result's pickling, and the scheduler applying it (``Scheduler.update``):

    python3 -m bench.host_step --messages --batch-sizes 1,64,128,256 --out bench/results/host_step/cpu_step_messages

``--spec-head`` (an EAGLE-3 head of ``--model``; ``deployments.make_heads``) compares, per batch size, the host time
of a DECODE step under no speculation, forced depths and the adaptive chooser (``--policies``; simulated acceptance
``--accept-length``; the chooser reads ``--chooser-costs``, by default the H100 1B shape's start-up table, so that it
picks what it picked there: depth 1 at bs 64, depth 0 at bs 256). On a CPU the model is eager and slow, so each
policy's steps run under cProfile, and ``host`` is their time less the cumulative time of what a GPU replays as
graphs (the decode forward and sampling, the round, the plain step with its stash, the eager inputs and packing);
the draft's catch-up (eager on a GPU too) is shown apart:

    python3 -m bench.host_step --model /tmp/micro --spec-head /tmp/micro-eagle3 --batch-sizes 64,256 \
        --out bench/results/host_step/cpu_spec_host_step

``--spec-depth N`` with ``--spec-head`` times the speculative engine as the rows above time one without it, every
DECODE step forced to depth N (0: adaptive speculation's plain steps; ``paused``: plain steps with the draft paused,
the step without speculation), so the same command with and without it
compares the two on one machine; on a GPU with ``--profile-batch`` each adds the kernel timeline (busy, idle gaps,
kernels per step) and the CUDA runtime calls per step (graph launches, copies, and where the host waits for the
device: synchronizes, blocking copies):

    python3 -m bench.common --shape llama-3.2-1b --out /tmp/l1 --eagle3-head /tmp/l1-eagle3
    python3 -m bench.host_step --device cuda --model /tmp/l1 --no-metrics --gc-freeze --prompt-len 128 \
        --new-tokens 160 --max-model-len 4096 --batch-sizes 128,256 --profile-batch 256 --profile-steps 16 \
        [--spec-head /tmp/l1-eagle3 --spec-depth 0] --out /tmp/host_step_1b_{nospec,d0}
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import random
import time
from pathlib import Path

from bench.common import GCTimer, command, commit, device_name, out_path, pyplot, write_json, write_markdown

STEP_KEYS = ("schedule_s", "execute_s", "worker_s", "outputs_s")


def make_engine(args, max_batch: int):
    from deployments.engine.engine import Engine
    from workers.config import EngineConfig

    kw = {"model": args.model, "max_num_seqs": max_batch,
          "max_model_len": args.max_model_len or args.prompt_len + args.new_tokens + 64}
    if args.device == "cuda":
        kw.update(device="cuda", dtype="bfloat16", cuda_graph_max_bs=max_batch, gpu_memory_utilization=0.8,
                  prefill_attention_backend="triton", decode_attention_backend="triton")
    else:
        kw.update(device="cpu", kv_cache_tokens=max_batch * (args.prompt_len + args.new_tokens + 16))
    metrics = None
    if not args.no_metrics:
        from deployments.engine.metrics import EngineMetrics

        metrics = EngineMetrics("host-step")
    if args.spec_head is not None:  # (with --stub-worker: a speculative engine's host work, rounds simulated)
        from workers.config import SpeculativeConfig

        # (--spec-depth: adaptive on, as bench.adaptive runs it: the stash and the catch-up graphs of depth 0)
        kw["speculative_config"] = SpeculativeConfig(method="eagle3", model=args.spec_head, num_steps=args.spec_steps,
                                                     topk=1, adaptive=True if args.spec_depth is not None else None,
                                                     simulated_accept_length=None if args.spec_depth is None
                                                     else args.accept_length)
        kw["max_model_len"] += args.new_tokens * args.spec_steps  # (rounds append up to spec_steps + 1 tokens)
        kw["kv_cache_tokens"] = max_batch * kw["max_model_len"]
    eng = Engine(EngineConfig(**kw), metrics=metrics, detokenize=not args.served)
    if args.spec_depth is not None:  # every DECODE step at that depth (0: plain steps, the draft catching up lazily)
        from speculative.adaptive import DepthSchedule

        eng.depth_policy = DepthSchedule([args.spec_depth])
    if args.stub_worker:
        stub_worker(eng, args.spec_steps if args.spec_head is not None else 0, args.accept_length)
    if args.gc_freeze:  # as the server's engine core does after start-up
        from deployments.engine import tune_gc_for_steps
        from deployments.engine.engine import freeze_startup_heap

        freeze_startup_heap()
        if not args.default_gc:
            tune_gc_for_steps()
    return eng


class Publisher:
    """The served engine core's work per step after ``Engine.step`` (``EngineCore._publish`` and ``_push`` without
    the locks and the ZMQ send): each output packed, and per ingress replica one pickled, signed message. Requests
    go to ``clients`` replicas in turn."""

    def __init__(self, clients: int):
        self.clients, self.owner, self.seconds, self.key = clients, {}, 0.0, b"k" * 32

    def add(self, req) -> None:
        self.owner[req.rid] = f"client{len(self.owner) % self.clients}"

    def __call__(self, outputs) -> None:
        from deployments.engine.core import pack_output
        from deployments.engine.signing import signed

        t0 = time.perf_counter()
        boxes: dict[str, list] = {}
        for out in outputs:
            client = self.owner.pop(out.rid, None) if out.finished else self.owner.get(out.rid)
            if client is not None:
                boxes.setdefault(client, []).append(pack_output(out))
        for items in boxes.values():
            signed(self.key, items)
        self.seconds += time.perf_counter() - t0


def stub_worker(eng, depth: int = 0, accept_length: float = 1.0) -> None:
    """The executor's step answered at once: per launched step a result of one token per row (the tokens a
    random pool's, never an EOS: the requests ignore it), read back as the worker's would be (overlap: ``keep``).
    ``depth`` > 0 (a speculative engine): each DECODE step is a round of ``depth`` drafts whose rows append
    ``accept_length`` - 1, ``accept_length`` or ``accept_length`` + 1 tokens (clipped to 1 ... ``depth`` + 1)."""
    from collections import deque

    from workers.messages import ForwardMode, StepResult

    vocab = eng.executor.model_config.vocab_size
    rng = random.Random(0)
    pool = [rng.randrange(10, vocab - 10) for _ in range(4096)]
    launched: deque = deque()

    def step(step, keep: int):
        if step is not None:
            b = step.batch_size
            if depth and step.mode == ForwardMode.DECODE:
                counts = [min(depth + 1, max(1, round(accept_length + rng.choice((-1, 0, 1))))) for _ in range(b)]
                n = sum(counts)
                at = rng.randrange(len(pool) - n)
                launched.append(StepResult(tokens=pool[at:at + n], logprobs=[-0.5] * n, counts=counts,
                                           num_drafts=depth, step_id=step.step_id, timings={"worker_s": 0.0}))
            else:
                at = rng.randrange(len(pool) - b)
                launched.append(StepResult(tokens=pool[at:at + b], logprobs=[-0.5] * b, step_id=step.step_id,
                                           timings={"worker_s": 0.0}))
        out = []
        while len(launched) > keep:
            out.append(launched.popleft())
        return out

    eng.executor.step = step


def timed_metrics(eng) -> dict:
    """Wraps the engine's metrics calls with a timer; returns its running total ({"s": seconds})."""
    total = {"s": 0.0}
    m = eng.metrics
    if m is None:
        return total
    for name in ("record_step", "record_generated", "record_load"):
        inner = getattr(m, name)

        def call(*a, _inner=inner, **kw):
            t0 = time.perf_counter()
            try:
                return _inner(*a, **kw)
            finally:
                total["s"] += time.perf_counter() - t0

        setattr(m, name, call)
    return total


def measure(eng, batch: int, args, profile: bool = False) -> dict:
    """``batch`` greedy requests; the steps after every request is decoding, timed per part."""
    from deployments.engine.request import SamplingParams

    rng = random.Random(batch)
    vocab = eng.executor.model_config.vocab_size
    publish = Publisher(args.clients) if args.served else (lambda outputs: None)
    metric_time = getattr(eng, "_metric_time", None)
    if metric_time is None:
        metric_time = eng._metric_time = timed_metrics(eng)
    # (the most tokens a step appends: a forced depth's requests then run as many steps as without speculation)
    depth = args.spec_depth if args.spec_depth is not None else args.spec_steps
    per_step = 1 if args.spec_head is None or depth == "paused" else depth + 1
    for _ in range(batch):
        req = eng.add_request([rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)],
                              SamplingParams(max_tokens=args.new_tokens * per_step, temperature=args.temperature,
                                             top_p=args.top_p, top_k=args.top_k, seed=len(eng.scheduler.waiting),
                                             ignore_eos=True))
        if args.served:
            publish.add(req)
    while len(eng.scheduler.running) < batch:  # prefills
        publish(eng.step())
    for _ in range(4):  # into the steady state (overlap: one step in flight)
        publish(eng.step())
    before, by_depth, t0 = dict(eng.step_time), dict(eng.steps_by_depth), time.perf_counter()
    pub0, met0 = getattr(publish, "seconds", 0.0), metric_time["s"]
    n_timed = max(8, args.new_tokens // 2)
    with GCTimer() as gct:
        for _ in range(n_timed):
            publish(eng.step())
    wall = time.perf_counter() - t0
    steps = eng.step_time["steps"] - before["steps"]
    row = {"batch_size": batch, "steps": steps, "wall_ms_per_step": round(wall / steps * 1e3, 3),
           "gc_ms_per_step": round(sum(gct.seconds) / steps * 1e3, 3), "gc_collections": gct.count,
           "gc_ms_by_generation": [round(x * 1e3, 2) for x in gct.seconds]}
    for key in STEP_KEYS:
        row[key.replace("_s", "_ms_per_step")] = round((eng.step_time[key] - before[key]) / steps * 1e3, 3)
    row["metrics_ms_per_step"] = round((metric_time["s"] - met0) / steps * 1e3, 4)
    depths = {str(d): n - by_depth.get(d, 0) for d, n in sorted(eng.steps_by_depth.items()) if n - by_depth.get(d, 0)}
    if depths:  # (a speculative engine: its timed steps by depth)
        row["steps_by_depth"] = depths
    if args.served:
        row["publish_ms_per_step"] = round((publish.seconds - pub0) / steps * 1e3, 4)
    if profile:
        row["profile"] = profile_steps(eng, args.profile_steps)
    while eng.has_work():
        publish(eng.step())
    return row


def profile_steps(eng, steps: int) -> dict:
    """Kernels of ``steps`` engine steps (torch.profiler, CUDA) and the host's functions by own time (cProfile,
    separate steps: the two profilers together would distort each other)."""
    out = {}
    if eng.executor.worker.device.type == "cuda":
        import torch
        from torch.profiler import ProfilerActivity, profile

        from bench.profile_decode import kernel_timeline, timeline_summary

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                eng.step()
            torch.cuda.synchronize()
        summary = timeline_summary(kernel_timeline(prof), steps)
        summary["kernels"] = summary["kernels"][:25]
        out["device"] = summary
        # separate steps with the host's side too: the CUDA runtime calls per step (eager launches, copies, and
        # the host's waits for the device: an event / stream synchronize, or a copy that blocks)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                eng.step()
            torch.cuda.synchronize()
        out["runtime_calls"] = runtime_call_summary(
            [(e.name, e.time_range.end - e.time_range.start) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CPU], steps)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        eng.step()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    out["host_tottime"] = s.getvalue().splitlines()
    return out


def runtime_call_summary(events: list[tuple[str, float]], steps: int) -> list[dict]:
    """Per CUDA runtime / driver call name (``cuda*`` / ``cu*`` host events of a torch.profiler run: (name, µs)):
    calls and µs per step, the longest call, longest first. The trailing synchronize of the profiled window (one
    call) is in it."""
    by: dict[str, list[float]] = {}
    for name, us in events:
        if not (name.startswith("cuda") or (name.startswith("cu") and name[2:3].isupper())):
            continue
        row = by.setdefault(name, [0, 0.0, 0.0])
        row[0] += 1
        row[1] += us
        row[2] = max(row[2], us)
    return [{"call": name, "per_step": round(n / steps, 2), "us_per_step": round(t / steps, 1),
             "longest_us": round(m, 1)} for name, (n, t, m) in sorted(by.items(), key=lambda kv: -kv[1][1])]


MESSAGE_KEYS = ("build_step_us", "step_bytes", "step_dumps_us", "step_loads_us", "fill_static_us",
                "read_result_us", "result_bytes", "result_dumps_us", "result_loads_us", "apply_result_us")
SPEC_DRAFTS = 3  # the speculative shape: an n-gram round of 3 host drafts per request (an EAGLE round sends none)


def per_call_us(fn, reps: int = 9, calls: int = 200) -> float:
    """The fastest of ``reps`` runs of ``calls`` calls, in microseconds per call (the least disturbed by whatever
    else the machine runs)."""
    fn()
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return round(min(runs), 2)


def pickle_row(name: str, obj) -> dict:
    """Its pickled size, and the time of ``pickle.dumps`` (the sender's) and of ``pickle.loads`` (the receiver's)."""
    import pickle

    data = pickle.dumps(obj, protocol=5)
    return {f"{name}_bytes": len(data), f"{name}_dumps_us": per_call_us(lambda: pickle.dumps(obj, protocol=5)),
            f"{name}_loads_us": per_call_us(lambda: pickle.loads(data))}


def message_row(batch: int, spec: bool) -> dict:
    """One DECODE step's message at ``batch`` requests, sampled with top-k/top-p, their previous step in flight,
    one page grant per 16 requests; ``spec``: with SPEC_DRAFTS host drafts per request, and a round's result (0 to
    SPEC_DRAFTS drafts accepted)."""
    from functools import partial

    import torch

    from deployments.engine.pages import PageAllocator
    from deployments.engine.request import Request, RequestStatus, SamplingParams
    from deployments.engine.scheduler import Scheduler, StepPlan
    from workers.graphs import StaticInputs, batch_buckets
    from workers.messages import ForwardMode
    from workers.outputs import HostCopy, Launched, PackedOutputs, round_result, token_result

    rng = random.Random(batch)
    params = SamplingParams(max_tokens=1 << 30, temperature=0.8, top_k=50, top_p=0.9, ignore_eos=True)
    reqs = []
    for i in range(batch):
        req = Request(f"r{i}", [rng.randrange(32000) for _ in range(8)], params)
        req.req_slot, req.status, req.output_ids = i, RequestStatus.RUNNING, [1] * rng.randrange(600)
        reqs.append(req)
    grants = range(0, batch, 16)
    plan = StepPlan(
        mode=ForwardMode.DECODE, requests=reqs, input_ids=[], seq_lens=[r.num_tokens for r in reqs],
        extend_lens=[1] * batch, page_updates=([i for i in grants], [40] * len(grants), [7 + i for i in grants]),
        counters=[len(r.output_ids) for r in reqs], pending=[1] * batch,
        draft_tokens=[[rng.randrange(32000) for _ in range(SPEC_DRAFTS)] for _ in reqs] if spec else None)
    step = plan.to_worker_step()
    row = {"batch_size": batch, "shape": "spec" if spec else "decode",
           "build_step_us": per_call_us(plan.to_worker_step),
           **pickle_row("step", step)}
    static = StaticInputs(256, SPEC_DRAFTS if spec else 0, 256, "cpu")
    bucket = next(b for b in batch_buckets(256) if b >= batch)
    row["fill_static_us"] = per_call_us(lambda: static.fill(step, bucket))

    ids = torch.tensor([rng.randrange(32000) for _ in range(batch * (SPEC_DRAFTS + 1))])
    logprobs = -torch.rand(batch * (SPEC_DRAFTS + 1))
    if spec:
        accept = torch.tensor([rng.randrange(SPEC_DRAFTS + 1) for _ in range(batch)])
        packed = PackedOutputs.pack(accept, ids.view(batch, -1), logprobs.view(batch, -1))
        finish = partial(round_result, tree_size=SPEC_DRAFTS + 1)
    else:
        packed, finish = PackedOutputs.pack(ids[:batch], logprobs[:batch]), token_result
    read = lambda: Launched(0, HostCopy(packed), finish, 0.0).result()  # noqa: E731
    result = read()
    row["read_result_us"] = per_call_us(read)
    row.update(pickle_row("result", result))
    sched = Scheduler(PageAllocator(1024, 16), max_num_seqs=512, max_prefill_tokens=8192, max_model_len=1 << 31,
                      eos_token_ids=(), vocab_size=32000)
    sched.running = list(reqs)
    row["apply_result_us"] = per_call_us(lambda: sched.update(plan, result), calls=50)  # (requests grow each call)
    return row


def message_markdown(meta: dict) -> str:
    md = [f"# The controller<->worker step message ({meta['device']})", "",
          f"commit `{meta['commit']}` · command `{meta['command']}`", "",
          "Per DECODE step, microseconds (the fastest of 9 runs): build = ``StepPlan.to_worker_step``; dumps / "
          "loads = ``pickle.dumps(x, protocol=5)`` / ``pickle.loads``; fill = ``StaticInputs.fill`` (host side of the graphs' "
          "one host->device copy); read = the worker turning the step's copied outputs into its ``StepResult``; "
          f"apply = ``Scheduler.update``. spec: {SPEC_DRAFTS} host drafts per request in the step, a round's "
          "result (0-3 accepted + bonus).", "",
          "| shape | batch | build µs | step bytes | step dumps µs | step loads µs | fill µs | read µs | "
          "result bytes | result dumps µs | result loads µs | apply µs |", "|---" * 12 + "|"]
    md += ["| " + " | ".join(str(r[k]) for k in ("shape", "batch_size") + MESSAGE_KEYS) + " |" for r in meta["rows"]]
    return "\n".join(md) + "\n"


def _forced_depth(meta: dict) -> str:
    if meta.get("spec_depth") is None:
        return ""
    return (f"; speculative engine (EAGLE-3 head, chain of {meta['spec_steps']}), every DECODE step at depth "
            f"{meta['spec_depth']}" + (" (plain steps, the draft catching up lazily)" if meta["spec_depth"] == 0
                                       else " (plain steps, the draft paused)" if meta["spec_depth"] == "paused"
                                       else f" (simulated accept length {meta['accept_length']})"))


def markdown(meta: dict) -> str:
    rows = meta["rows"]
    md = [f"# Engine host time per DECODE step ({meta['device']})", "",
          f"commit `{meta['commit']}` · command `{meta['command']}`", "",
          f"{meta['prompt_len']}-token prompts, {meta['new_tokens']} tokens each ({meta.get('sampling', 'greedy')}), "
          "metrics "
          f"{'off' if meta['no_metrics'] else 'on (Ray)'}"
          f"{'; served (no detokenizing; publish: the core push messages, ' + str(meta.get('clients')) + ' clients)' if meta.get('served') else ''}"
          f"{'; stub worker (no model compute: execute is the stub answering)' if meta.get('stub_worker') else ''}"
          f"{_forced_depth(meta)}"
          ". wall: a step's real time; execute: launching the step "
          "and reading the previous one's results (worker: rank 0's own part, the rest is waiting for the device); "
          + ("on a CPU, execute is the model's own compute." if meta["device"].startswith("CPU") else
             "with the overlap schedule, schedule + outputs hide behind the device's step."), "",
          "| batch | steps | wall ms | schedule ms | execute ms | worker ms | outputs ms | of which metrics ms | "
          "publish ms | GC ms (collections) |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['batch_size']} | {r['steps']} | {r['wall_ms_per_step']} | {r['schedule_ms_per_step']} | "
           f"{r['execute_ms_per_step']} | {r['worker_ms_per_step']} | {r['outputs_ms_per_step']} | "
           f"{r.get('metrics_ms_per_step', '')} | {r.get('publish_ms_per_step', '')} | "
           f"{r.get('gc_ms_per_step', '')} ({'/'.join(map(str, r.get('gc_collections', [])))}) |" for r in rows]
    depths = [f"bs {r['batch_size']}: " + ", ".join(f"d{d}:{n}" for d, n in r["steps_by_depth"].items())
              for r in rows if r.get("steps_by_depth")]
    if depths:
        md += ["", "Timed steps by depth: " + "; ".join(depths) + "."]
    for r in rows:
        prof = r.get("profile")
        if not prof:
            continue
        md += ["", f"## {r['batch_size']} requests, profiled", ""]
        dev = prof.get("device")
        if dev:
            md += [f"device: wall {dev['wall_us_per_step']} µs per step, kernels running {dev['busy_us_per_step']} "
                   f"µs, idle gaps {dev['gap_us_per_step']} µs, {dev['kernels_per_step']} kernels", "",
                   "| kernel | per step | mean µs | µs per step | gap before µs |", "|---|---|---|---|---|"]
            md += [f"| `{k['kernel']}` | {k['per_step']} | {k['mean_us']} | {k['us_per_step']} | "
                   f"{k['gap_before_us']} |" for k in dev["kernels"][:15]]
        calls = prof.get("runtime_calls")
        if calls:
            md += ["", "CUDA runtime calls (other steps, profiled with the host's side):", "",
                   "| call | per step | µs per step | longest µs |", "|---|---|---|---|"]
            md += [f"| `{c['call']}` | {c['per_step']} | {c['us_per_step']} | {c['longest_us']} |" for c in calls[:15]]
        md += ["", "host functions by own time (cProfile):", "", "```", *prof["host_tottime"][:45], "```"]
    return "\n".join(md) + "\n"


# ---- speculative engines: host time of a DECODE step by policy (``--spec-head``) ------------------------------------
# the H100 1B shape's start-up table (ms; bench.adaptive, adaptive_h100_1b_kvonly_long) at the buckets compared here:
# with it the chooser picks depth 1 at bs 64 and depth 0 (with depth-1 probes) at bs 256 at accept length 1.5
H100_1B_COSTS = {64: {0: 1.4562, 1: 1.8179, 2: 2.195, 3: 2.48, -1: 0.2042, -16: 0.2986},
                 256: {0: 2.2811, 1: 3.716, 2: 5.2628, 3: 6.7209, -1: 0.2732, -16: 0.5333}}
# what a GPU runs as graph replays (its host part there is a replay call): excluded from ``host``
DEVICE_FUNCS = {("workers/worker.py", "_decode"), ("workers/worker.py", "_plain_step"),
                ("workers/worker.py", "_eager_inputs"), ("speculative/round.py", "run"),
                ("workers/outputs.py", "pack")}
CATCH_UP_FUNCS = {("speculative/proposers.py", "catch_up"), ("speculative/proposers.py", "catch_up_behind")}
SPEC_POLICIES = "nospec,depth0,adaptive,depth1"
# host functions whose cumulative time each row reports (file suffix, name)
WATCHED = [("deployments/engine/scheduler.py", "schedule"), ("deployments/engine/scheduler.py", "to_worker_step"),
           ("deployments/engine/scheduler.py", "update"), ("deployments/engine/scheduler.py", "count_accepted"),
           ("deployments/engine/engine.py", "_apply"), ("deployments/engine/engine.py", "_read"),
           ("speculative/adaptive.py", "choose"), ("speculative/adaptive.py", "observe"),
           ("speculative/adaptive.py", "choose"), ("workers/worker.py", "_lazy_catch_up"),
           ("workers/worker.py", "_launch_decode"), ("workers/worker.py", "step"),
           ("workers/messages.py", "spec"), ("workers/messages.py", "offsets"),
           ("workers/outputs.py", "result"), ("workers/outputs.py", "round_result"),
           ("workers/outputs.py", "plain_round_result"), ("workers/outputs.py", "token_result")]


def spec_engine(args, max_batch: int, head: str | None):
    from deployments.engine.engine import Engine
    from workers.config import EngineConfig, SpeculativeConfig

    spec = None if head is None else SpeculativeConfig(
        method="eagle3", model=head, num_steps=args.spec_steps, topk=1, adaptive=True,
        simulated_accept_length=args.accept_length)
    eng = Engine(EngineConfig(model=args.model, device="cpu", max_num_seqs=max_batch, dtype="float32",
                              max_model_len=args.prompt_len + args.new_tokens + 64, speculative_config=spec,
                              kv_cache_tokens=max_batch * (args.prompt_len + args.new_tokens + 64)))
    if args.gc_freeze:  # as the engine core does once it is up
        from deployments.engine import tune_gc_for_steps
        from deployments.engine.engine import freeze_startup_heap

        freeze_startup_heap()
        if not args.default_gc:
            tune_gc_for_steps()
    return eng


def _own_and_excluded(stats: pstats.Stats) -> tuple[float, float, float, list]:
    """(total own time, cumulative time of DEVICE_FUNCS, of CATCH_UP_FUNCS, the 25 largest own times outside
    both) from a profile's raw stats."""
    total, device, catch_up = 0.0, 0.0, 0.0

    def key(fn):
        file, _, name = fn
        return next(((f, n) for f, n in DEVICE_FUNCS | CATCH_UP_FUNCS if file.endswith(f) and name == n), None)

    for fn, (cc, nc, tt, ct, callers) in stats.stats.items():
        total += tt
        k = key(fn)
        if k in DEVICE_FUNCS:
            device += ct
        elif k in CATCH_UP_FUNCS:  # (called from another catch-up function: counted there)
            catch_up += sum(c[3] for caller, c in callers.items() if key(caller) not in CATCH_UP_FUNCS) \
                if callers else ct
    # own times of the host's functions: those reached from the profiled calls without entering an excluded one
    callees: dict = {}
    for fn, (cc, nc, tt, ct, callers) in stats.stats.items():
        for caller in callers:
            callees.setdefault(caller, []).append(fn)
    todo = [fn for fn, v in stats.stats.items() if not v[4]]  # (the roots: what the profiled loop called)
    seen = set(todo)
    while todo:
        for fn in callees.get(todo.pop(), ()):
            if fn not in seen and key(fn) is None:
                seen.add(fn)
                todo.append(fn)
    host = [(stats.stats[fn][2], fn) for fn in seen]
    watched = {}
    for fn, v in stats.stats.items():
        for f, n in WATCHED:
            if fn[0].endswith(f) and fn[2] == n:
                watched[f"{Path(f).stem}.{n}"] = watched.get(f"{Path(f).stem}.{n}", 0.0) + v[3]
    host.sort(reverse=True)
    return total, device, catch_up, host[:25], watched


def spec_measure(eng, batch: int, args, policy: str) -> dict:
    """``batch`` greedy requests under ``policy``; after every request decodes, ``--spec-timed-steps`` steps under
    cProfile: their time, what a GPU replays as graphs, the catch-up, and the rest (host)."""
    import gc

    from deployments.engine.request import SamplingParams
    from speculative.adaptive import PAUSED, DepthChooser, DepthSchedule

    vocab = eng.executor.model_config.vocab_size
    recording, timing, timers, unprofiled = [False], [False], {}, {}
    worker = eng.executor.worker
    restore = []

    def timed_call(obj, name: str, kind: str):
        inner = getattr(obj, name)

        def call(*a, **kw):
            if not timing[0]:
                return inner(*a, **kw)
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                timers[kind] = timers.get(kind, 0.0) + time.perf_counter() - t0

        setattr(obj, name, call)
        restore.append((obj, name))

    for name in ("_decode", "_plain_step", "_eager_inputs"):
        timed_call(worker, name, "device")
    if worker.spec_round is not None:
        timed_call(worker.spec_round, "run", "device")

    def run(new_tokens: int, timed: int):
        rng = random.Random(batch)
        for i in range(batch):
            eng.add_request([rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)],
                            SamplingParams(max_tokens=new_tokens, temperature=0.0, seed=i, ignore_eos=True))
        while eng.scheduler.waiting or not all(r.output_ids for r in eng.scheduler.running):  # (prefills)
            eng.step()
        for _ in range(4):
            eng.step()
        out = None
        if timed:  # first without the profiler: wall less the timed device calls and catch-ups
            gc.collect()
            timers.clear()
            timing[0] = True
            t0 = time.perf_counter()
            with GCTimer() as gct:
                for _ in range(timed):
                    eng.step()
            plain_wall = time.perf_counter() - t0
            timing[0] = False
            unprofiled.update(wall=plain_wall, device=timers.get("device", 0.0),
                              catch_up=timers.get("catch_up", 0.0), gc_count=gct.count, gc_s=sum(gct.seconds))
            gc.collect()
            by_depth = dict(eng.steps_by_depth)
            pr = cProfile.Profile()
            recording[0] = True
            t0 = time.perf_counter()
            pr.enable()
            for _ in range(timed):
                eng.step()
            pr.disable()
            wall = time.perf_counter() - t0
            recording[0] = False
            out = (pr, wall, {str(d): n - by_depth.get(d, 0) for d, n in sorted(eng.steps_by_depth.items())
                              if n - by_depth.get(d, 0)})
        while eng.has_work():
            eng.step()
        return out

    if policy == "adaptive":
        eng.depth_policy = DepthChooser(H100_1B_COSTS, args.spec_steps)
        run(16, 0)  # untimed: the chooser learns acceptance at this load (as bench.adaptive's warm batch)
    elif policy.startswith("depth"):
        eng.depth_policy = DepthSchedule([int(policy.removeprefix("depth"))])
    elif policy == "paused":  # (plain steps with the draft paused: the step without speculation)
        eng.depth_policy = DepthSchedule([PAUSED])
    shapes: list = []
    if worker.proposer is not None:  # the catch-ups of the timed steps: (requests, longest lag, uniform, KV rows)
        def logged(inner):
            def call(slots, root_pos, lags):
                outer = not inside[0]  # (a catch-up may run another inside: catch_up_behind, catch_up)
                if recording[0] and outer:
                    lags_ = [int(x) for x in lags]
                    shapes.append((len(lags_), max(lags_), len(set(lags_)) == 1, sum(x - 1 for x in lags_ if x > 1)))
                t0 = time.perf_counter()
                inside[0] = True
                try:
                    return inner(slots, root_pos, lags)
                finally:
                    if outer:
                        inside[0] = False
                        timers["catch_up"] = timers.get("catch_up", 0.0) + time.perf_counter() - t0
            return call

        inside = [False]
        for name in ("catch_up", "catch_up_behind"):
            setattr(worker.proposer, name, logged(getattr(worker.proposer, name)))
    pr, wall, depths = run(args.new_tokens, args.spec_timed_steps)
    if worker.proposer is not None:
        del worker.proposer.catch_up, worker.proposer.catch_up_behind
    for obj, name in restore:
        delattr(obj, name)
    stats = pstats.Stats(pr)
    total, device, catch_up, top, watched = _own_and_excluded(stats)
    n = args.spec_timed_steps
    ms = lambda x: round(x / n * 1e3, 4)  # noqa: E731
    row = {"policy": policy, "batch_size": batch, "steps": n, "wall_ms_per_step": ms(wall),
           "profiled_ms_per_step": ms(total), "device_ms_per_step": ms(device),
           "catch_up_ms_per_step": ms(catch_up), "host_ms_per_step": ms(total - device - catch_up),
           "steps_by_depth": depths,
           "catch_ups": list(eng.executor.worker.catch_ups) if eng.executor.worker.proposer else None,
           "unprofiled_host_ms_per_step": ms(unprofiled["wall"] - unprofiled["device"] - unprofiled["catch_up"]),
           "unprofiled_catch_up_ms_per_step": ms(unprofiled["catch_up"]),
           "unprofiled_wall_ms_per_step": ms(unprofiled["wall"]),
           # collections in the unprofiled steps (their pauses are in its host time)
           "gc_collections": unprofiled["gc_count"], "gc_ms_per_step": ms(unprofiled["gc_s"]),
           "catch_up_shapes": shapes,
           "watched_us_per_step": {k: round(v / n * 1e6, 1) for k, v in sorted(watched.items())},
           "host_tottime_us_per_step": [(round(tt / n * 1e6, 1), f"{Path(fn[0]).name}:{fn[1]}({fn[2]})")
                                        for tt, fn in top]}
    return row


def spec_rows(args) -> list[dict]:
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    policies = args.policies.split(",")
    engines = {}
    rows = []
    for rep in range(args.repeats):
        for policy in policies:
            kind = "nospec" if policy == "nospec" else "spec"
            if kind not in engines:
                engines[kind] = spec_engine(args, max(sizes), None if kind == "nospec" else args.spec_head)
                spec_measure(engines[kind], min(sizes), args, "depth0" if kind == "spec" else kind)  # warm-up
            for b in sizes:
                row = spec_measure(engines[kind], b, args, policy)
                row["repeat"] = rep
                rows.append(row)
                print({k: v for k, v in row.items() if k != "host_tottime_us_per_step"}, flush=True)
    return rows


def spec_markdown(meta: dict) -> str:
    rows = meta["rows"]
    md = [f"# Host time of a DECODE step by speculation policy ({meta['device']})", "",
          f"commit `{meta['commit']}` · command `{meta['command']}`", "",
          f"micro target + micro EAGLE-3 head (chain of {meta['spec_steps']}), simulated accept length "
          f"{meta['accept_length']}, {meta['prompt_len']}-token prompts, greedy; per row {rows[0]['steps']} steps "
          "timed plainly, then as many under cProfile. device = what a GPU replays as graphs (eager on a CPU: the "
          "decode forward and sampling, the round, the plain step with its stash, the eager inputs); catch-up = the "
          "draft's lazy catch-up (eager on a GPU too); host = wall less both (scheduler, engine, worker bookkeeping, "
          "outputs, policy). The adaptive chooser reads the H100 1B start-up table at bs 64 / 256. "
          f"Collector: {meta.get('gc', 'the interpreter default, heap not frozen')}.", "",
          "| policy | batch | repeat | depths (profiled steps) | host ms | GC ms (collections) | catch-up ms | "
          "host ms, profiled | catch-up ms, profiled | device ms, profiled |", "|---|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['policy']} | {r['batch_size']} | {r['repeat']} | "
           f"{', '.join(f'd{d}:{n}' for d, n in (r['steps_by_depth'] or {}).items())} | "
           f"{r['unprofiled_host_ms_per_step']} | {r.get('gc_ms_per_step', '')} "
           f"({'/'.join(map(str, r.get('gc_collections', [])))}) | {r['unprofiled_catch_up_ms_per_step']} | "
           f"{r['host_ms_per_step']} | {r['catch_up_ms_per_step']} | {r['device_ms_per_step']} |" for r in rows]
    for r in rows:
        if r["repeat"] != 0:
            continue
        md += ["", f"## {r['policy']}, bs {r['batch_size']}: host functions by own time (µs per step)", "", "```"]
        md += [f"{us:>9} {name}" for us, name in r["host_tottime_us_per_step"][:15]]
        md.append("```")
    return "\n".join(md) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="a checkpoint (required unless --messages)")
    ap.add_argument("--messages", action="store_true", help="time the step message alone (no model)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch-sizes", default="8,32,96,256")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="default: prompt + new tokens + 64 (gpu_perf runs 4096; attention launches size by it)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling settings of every request (greedy "
                    "by default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--no-metrics", action="store_true", help="no Ray metrics (as the offline benchmarks run)")
    ap.add_argument("--gc-freeze", action="store_true", help="freeze the start-up heap after building the engine "
                    "and set the collector's threshold (deployments.engine.freeze_startup_heap and "
                    "tune_gc_for_steps, as the engine core does)")
    ap.add_argument("--default-gc", action="store_true", help="with --gc-freeze: freeze only, the interpreter's "
                    "thresholds")
    ap.add_argument("--served", action="store_true", help="as the served engine core: no detokenizing, and the "
                    "core's push messages timed (publish)")
    ap.add_argument("--stub-worker", action="store_true", help="no model compute: the worker's step answers at "
                    "once with one token per row (the engine's host work alone)")
    ap.add_argument("--clients", type=int, default=2, help="with --served: ingress replicas the outputs go to")
    ap.add_argument("--profile-batch", type=int, default=None, help="profile the steps at this batch size")
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--spec-head", default=None, help="an EAGLE-3 head: compare speculation policies' host time")
    ap.add_argument("--policies", default=SPEC_POLICIES, help="with --spec-head: nospec, depthN, paused, adaptive")
    ap.add_argument("--accept-length", type=float, default=1.5, help="with --spec-head: simulated accept length")
    ap.add_argument("--spec-steps", type=int, default=3, help="with --spec-head: the chain's depth")
    ap.add_argument("--spec-depth", type=lambda x: x if x == "paused" else int(x), default=None,
                    help="with --spec-head: the engine's steps timed per part as without it (the rows, "
                    "--profile-batch's kernels and runtime calls), every DECODE step forced to this depth (0: plain "
                    "steps; paused: plain steps with the draft paused); compare with the same command without "
                    "--spec-head")
    ap.add_argument("--spec-timed-steps", type=int, default=40, help="with --spec-head: profiled steps per row")
    ap.add_argument("--repeats", type=int, default=1, help="passes over the policies (--spec-head) or the batch sizes")
    ap.add_argument("--out", required=True)
    ap.add_argument("--report-only", action="store_true", help="re-render <out>.md/.png from <out>.json")
    args = ap.parse_args()
    out = out_path(args.out)
    if args.report_only:
        meta = json.loads(out.with_suffix(".json").read_text())
    elif args.spec_head is not None and not args.stub_worker and args.spec_depth is None:
        meta = {"device": f"CPU {platform.machine()}", "commit": commit(), "command": command(), "spec": True,
                "model": args.model, "head": args.spec_head, "prompt_len": args.prompt_len,
                "new_tokens": args.new_tokens, "accept_length": args.accept_length, "spec_steps": args.spec_steps,
                "gc": ("the interpreter default, heap not frozen" if not args.gc_freeze else
                       "start-up heap frozen, default thresholds" if args.default_gc else
                       "start-up heap frozen, the engine core's threshold (tune_gc_for_steps)"),
                "rows": spec_rows(args)}
        write_json(out, meta)
    elif args.messages:
        sizes = [int(b) for b in args.batch_sizes.split(",")]
        meta = {"device": f"CPU {platform.machine()}", "commit": commit(), "command": command(), "messages": True,
                "rows": [message_row(b, spec) for spec in (False, True) for b in sizes]}
        write_json(out, meta)
    else:
        if args.model is None:
            raise SystemExit("--model is required (or --messages)")
        if not args.no_metrics:
            import ray

            ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)  # the metrics' agent
        sizes = [int(b) for b in args.batch_sizes.split(",")]
        if args.profile_batch is not None and args.profile_batch not in sizes:
            raise SystemExit(f"--profile-batch {args.profile_batch} is not in --batch-sizes")
        eng = make_engine(args, max(sizes))
        measure(eng, min(sizes), args)  # warm-up
        rows = []
        for rep in range(args.repeats):
            for b in sizes:
                row = measure(eng, b, args, profile=b == args.profile_batch and rep == 0)
                row["repeat"] = rep
                rows.append(row)
        eng.shutdown()
        device = device_name("cuda") if args.device == "cuda" else f"CPU {platform.machine()}"
        meta = {"device": device, "commit": commit(), "command": command(),
                "model": args.model, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                "no_metrics": args.no_metrics, "rows": rows, "served": args.served, "clients": args.clients,
                "stub_worker": args.stub_worker,
                **({"spec_head": args.spec_head, "spec_steps": args.spec_steps, "accept_length": args.accept_length,
                    "spec_depth": args.spec_depth} if args.spec_head is not None else {}),
                "sampling": f"temperature {args.temperature}, top_p {args.top_p}, top_k {args.top_k}"}
        write_json(out, meta)
    if meta.get("spec"):
        md = spec_markdown(meta)
        write_markdown(out, md)
        print(md)
        return
    if meta.get("messages"):
        md = message_markdown(meta)
        write_markdown(out, md)
        print(md)
        return
    md = markdown(meta)
    write_markdown(out, md)
    plot(meta, out.with_suffix(".png"))
    print(md)


def plot(meta: dict, path: Path) -> None:
    plt = pyplot()
    rows = meta["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["batch_size"] for r in rows]
    for key, label in (("wall", "wall"), ("schedule", "schedule"), ("execute", "execute"),
                       ("outputs", "outputs")):
        ax.plot(xs, [r.get(f"{key}_ms_per_step") for r in rows], "o-", label=label)
    ax.set_xlabel("requests in the batch")
    ax.set_ylabel("ms per step")
    ax.set_title(f"engine time per step ({meta['device']}, {meta['commit']})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
