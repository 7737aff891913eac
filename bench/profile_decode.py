"""Where a decode step's GPU time goes: kernel time by name under torch.profiler (eager engine steps), and each of
the model's linear shapes at M = 1, 2, 4, 16 rows (cuBLAS, the small-M Triton kernel's tile configs, and what
``workers.kernels.tuning.tune`` picks, each timed as the tuner times it) against its weight-read floor.

    python3 -m bench.profile_decode --ckpt /tmp/llama-3.1-8b-random --out bench/results/profiles/profile_decode_8b_h100

``--graphs``: instead, the kernels of the bs=1 CUDA graphs as the engine runs them: the decode graph replayed back to
back, and (with ``--head``, an EAGLE-3 head) whole speculative rounds at a simulated accept length. Per kernel name:
launches, mean duration and the idle time before it (the gap since the previous kernel ended); per step: wall time,
time with a kernel running, and the sum of gaps.

``--exposed A.json B.json ...``: from ``--graphs`` results, the wall time each kernel adds to one round replay when
kernels overlap under PDL (``exposed_by_kernel``), and the verify forward's per-layer split (``verify_layers``):

    python3 -m bench.profile_decode --exposed base.json new.json --out bench/results/profiles/NAME
"""

from __future__ import annotations

import argparse
import gc
import json
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import command, commit, copy_bandwidth, device_name, out_path, pyplot, write_json, write_markdown


def linear_table(cfg: dict, bw: float, rows_m: tuple[int, ...] = (1, 2, 4, 16)) -> list[dict]:
    """Each linear shape of the model at M rows: cuBLAS (F.linear), every small-M Triton tile config, and what
    ``workers.kernels.tuning.tune`` picks, against the weight-read floor. Every time is ``replayed_ms``: a CUDA
    graph of back-to-back calls over weight copies worth twice the L2, as a decode step runs its layers (the tuner
    also launches a short PDL kernel before each call and takes its time off, ``_fastest``). The down projection
    runs gated, as in the models: its input is [gate | up] and silu(gate) * up is fused into the Triton kernel's
    loads, while cuBLAS runs after the separate silu_and_mul kernel."""
    from workers.kernels import small_m_linear as sml
    from workers.kernels import tuning
    from workers.kernels.norm_rope import silu_and_mul

    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    side = torch.cuda.Stream()
    rows = []
    for name, (n, k, gated) in {"qkv": (h + 2 * kv, h, False), "o": (h, h, False), "gate_up": (2 * inter, h, False),
                                "down": (h, inter, True), "lm_head": (v, h, False)}.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        weights = tuning.weight_copies(w)
        floor = n * k * 2 / bw * 1e3
        for m in rows_m:
            x = torch.randn(m, k * (2 if gated else 1), device="cuda", dtype=torch.bfloat16)
            ref = F.linear(silu_and_mul(x) if gated else x, w).float()
            t_cublas = tuning.replayed_ms((lambda ww: F.linear(silu_and_mul(x), ww)) if gated
                                       else (lambda ww: F.linear(x, ww)), weights, side)
            cands = [c for c in sml.candidates(sml.row_bucket(m)) if c is not None]  # None: cuBLAS, above
            t_cfg = {str(tuple(c)): tuning.replayed_ms(lambda ww, c=c: sml.small_m_linear(x, ww, None, c, gated), weights,
                                                    side) for c in cands}
            # every config's output against cuBLAS: the worst relative error over the configs
            worst = max(((sml.small_m_linear(x, w, None, c, gated).float() - ref).abs().max()
                         / ref.abs().max()).item() for c in cands)
            table = {sml.row_bucket(m): tuning.tune(w, None, sml.row_bucket(m), gated, side)}
            chosen = table[sml.row_bucket(m)]
            err = (sml.linear(x, w, None, table, gated).float() - ref).abs().max().item()
            t_chosen = tuning.replayed_ms(lambda ww: sml.linear(x, ww, None, table, gated), weights, side)
            best = min(t_cfg, key=t_cfg.get)
            rows.append({"linear": name, "m": m, "n": n, "k": k, "gated": gated, "floor_ms": round(floor, 4),
                         "cublas_ms": round(t_cublas, 4), "best_triton_ms": round(t_cfg[best], 4),
                         "best_triton_config": best, "chosen": "cublas" if chosen is None else str(tuple(chosen)),
                         "chosen_ms": round(t_chosen, 4), "cublas_vs_floor": round(t_cublas / floor, 2),
                         "chosen_vs_floor": round(t_chosen / floor, 2), "max_abs_diff_vs_cublas": err,
                         "worst_config_rel_err_vs_cublas": worst,
                         "triton_configs_ms": {c: round(t, 4) for c, t in t_cfg.items()}})
            print({kk: vv for kk, vv in rows[-1].items() if kk != "triton_configs_ms"}, flush=True)
        del w, weights
        torch.cuda.empty_cache()
    rows += activated_rows(h, inter, bw, rows_m, side)
    return rows


def activated_rows(h: int, inter: int, bw: float, rows_m: tuple[int, ...], side) -> list[dict]:
    """The gate/up layer writing silu(gate) * up (an MLP's activated path, ``tune_activated``): its candidate tiles
    against cuBLAS + silu_and_mul ("cuBLAS" column) and against the layer's own tuned kernel + silu_and_mul (the
    baseline the tuner compares with, "plain_then_silu_ms"); "chosen" is what ``tune_activated`` picks (the
    plain kernel + silu_and_mul when none beats it)."""
    from workers.kernels import small_m_linear as sml
    from workers.kernels import tuning
    from workers.kernels.norm_rope import silu_and_mul

    n, k = 2 * inter, h
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    weights = tuning.weight_copies(w)
    floor = n * k * 2 / bw * 1e3
    rows = []
    for m in rows_m:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = silu_and_mul(F.linear(x, w)).float()
        bucket = sml.row_bucket(m)
        plain = tuning.tune(w, None, bucket, False, side)
        t_cublas = tuning.replayed_ms(lambda ww: silu_and_mul(F.linear(x, ww)), weights, side)
        t_plain = tuning.replayed_ms(lambda ww: silu_and_mul(sml.linear(x, ww, None, {bucket: plain})), weights, side)
        t_cfg, worst = {}, 0.0
        for c in sml.ACTIVATED_CANDIDATES:
            try:
                t_cfg[str(tuple(c))] = tuning.replayed_ms(lambda ww, c=c: sml.small_m_linear(x, ww, None, c,
                                                                                           activated=True),
                                                       weights, side)
                got = sml.small_m_linear(x, w, None, c, activated=True).float()
                worst = max(worst, ((got - ref).abs().max() / ref.abs().max()).item())
            except Exception:  # noqa: BLE001 - as the tuner: a tile this GPU cannot run is no candidate
                torch.cuda.synchronize()
        chosen = tuning.tune_activated(w, None, bucket, plain, side)
        t_chosen = (tuning.replayed_ms(lambda ww: sml.small_m_linear(x, ww, None, chosen, activated=True), weights,
                                    side) if chosen is not None else t_plain)
        best = min(t_cfg, key=t_cfg.get)
        rows.append({"linear": "gate_up_activated", "m": m, "n": inter, "k": k, "gated": False,
                     "floor_ms": round(floor, 4), "cublas_ms": round(t_cublas, 4),
                     "plain_then_silu_ms": round(t_plain, 4),
                     "plain": "cublas" if plain is None else str(tuple(plain)), "best_triton_ms": round(t_cfg[best], 4),
                     "best_triton_config": best,
                     "chosen": "plain + silu_and_mul" if chosen is None else str(tuple(chosen)),
                     "chosen_ms": round(t_chosen, 4), "cublas_vs_floor": round(t_cublas / floor, 2),
                     "chosen_vs_floor": round(t_chosen / floor, 2), "worst_config_rel_err_vs_cublas": worst,
                     "triton_configs_ms": {c: round(t, 4) for c, t in t_cfg.items()}})
        print({kk: vv for kk, vv in rows[-1].items() if kk != "triton_configs_ms"}, flush=True)
    del w, weights
    torch.cuda.empty_cache()
    return rows


def linear_markdown(res: dict) -> str:
    lines = [f"# Linear layers at few rows ({res['device']})", "",
             f"commit `{res['commit']}`, command `{res['command']}`; bf16, floor = weight bytes / "
             f"{res['copy_bandwidth_gb_s']} GB/s copy bandwidth measured in the run", "",
             "Triton configs: (block_m, block_n, block_k, warps, stages); worst rel. error: the largest "
             "over all configs, vs cuBLAS."
             + (" Times: CUDA-graph replays of back-to-back calls over weight copies worth twice the L2, as the "
                "start-up tuning times them; down runs gated (Triton: silu(gate) * up fused into its loads; cuBLAS: "
                "after the silu_and_mul kernel, both counted)." if res["linears"] and "gated" in res["linears"][0]
                else "")
             + (" gate_up_activated: the gate/up layer writing silu(gate) * up (N = its half); cuBLAS column: "
                "cuBLAS + silu_and_mul; chosen: what tune_activated picks against the layer's own tuned kernel + "
                "silu_and_mul (plain_then_silu_ms in the JSON), that baseline when none beats it by the margin."
                if any(r["linear"] == "gate_up_activated" for r in res["linears"]) else ""), "",
             "| linear | M | N | K | floor ms | cuBLAS ms (x floor) | best Triton ms (config) | chosen | "
             "chosen ms (x floor) | worst rel. error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["linears"]:
        lines.append(f"| {r['linear']} | {r['m']} | {r['n']} | {r['k']} | {r['floor_ms']} | {r['cublas_ms']} "
                     f"({r['cublas_vs_floor']}x) | {r['best_triton_ms']} {r['best_triton_config']} | {r['chosen']} | "
                     f"{r['chosen_ms']} ({r['chosen_vs_floor']}x) | {r.get('worst_config_rel_err_vs_cublas', '')} |")
    return "\n".join(lines) + "\n"


def linear_plot(res: dict, path: Path) -> None:
    """Time over the weight-read floor per linear shape and row count: cuBLAS, the best Triton config, the chosen."""
    plt = pyplot()
    rows = res["linears"]
    labels = [f"{r['linear']}\nM={r['m']}" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.6), 4))
    for i, (key, name) in enumerate((("cublas_ms", "cuBLAS"), ("best_triton_ms", "best Triton"),
                                      ("chosen_ms", "chosen (tuned)"))):
        ax.bar([x + (i - 1) * 0.27 for x in xs], [r[key] / r["floor_ms"] for r in rows], width=0.27, label=name)
    ax.axhline(1.0, color="gray", linestyle=":")
    ax.set_xticks(list(xs), labels, fontsize=6)
    ax.set_ylabel("time / weight-read floor")
    ax.legend(fontsize=7)
    ax.set_title(f"{res['device']} · {res['commit']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def kernel_profile(ckpt: str, steps: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    from deployments.engine.engine import Engine
    from deployments.engine.request import SamplingParams
    from workers.config import EngineConfig

    eng = Engine(EngineConfig(model=ckpt, device="cuda", dtype="bfloat16", max_model_len=4096, max_num_seqs=8,
                              disable_cuda_graph=True, prefill_attention_backend="triton",
                              decode_attention_backend="triton", gpu_memory_utilization=0.5))
    eng.add_request(list(range(1000, 1128)), SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        eng.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    by = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by[e.name[:90]] += e.device_time_total / 1e3 / steps
    total = sum(by.values())
    rows = [{"kernel": k, "ms_per_step": round(v, 4), "share": round(v / total, 3)}
            for k, v in sorted(by.items(), key=lambda kv: -kv[1])[:20]]
    for r in rows:
        print(r, flush=True)
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return [{"total_ms_per_step": round(total, 3)}] + rows


def kernel_timeline(prof) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of every GPU kernel in a torch.profiler run, in start order."""
    ks = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
          if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    return sorted(ks, key=lambda k: k[1])


def short_name(name: str) -> str:
    return name if len(name) <= 60 else name[:57] + "..."


def timeline_summary(ks: list[tuple[str, float, float]], steps: int) -> dict:
    """Per step: wall, busy, gaps; per kernel name: launches/step, mean µs, mean gap before it (µs)."""
    wall = (ks[-1][2] - ks[0][1]) / steps
    by: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    prev_end = ks[0][1]
    for name, start, end in ks:
        row = by[short_name(name)]
        row[0] += 1
        row[1] += end - start
        row[2] += max(0.0, start - prev_end)
        prev_end = max(prev_end, end)
    busy = sum(r[1] for r in by.values()) / steps
    kernels = [{"kernel": k, "per_step": round(n / steps, 2), "mean_us": round(t / n, 2),
                "us_per_step": round(t / steps, 1), "gap_before_us": round(g / n, 2)}
               for k, (n, t, g) in sorted(by.items(), key=lambda kv: -kv[1][1])]
    return {"wall_us_per_step": round(wall, 1), "busy_us_per_step": round(busy, 1),
            "gap_us_per_step": round(sum(r[2] for r in by.values()) / steps, 1),
            "kernels_per_step": round(len(ks) / steps, 1), "kernels": kernels}


def exposed_by_kernel(first_kernels: list[dict]) -> dict[str, dict]:
    """Per kernel name, from one replay's kernels in order (``*_graph_first_kernels``: duration and the gap since
    the previous kernel ended, negative where they overlap under PDL): launches, summed duration, and the wall
    time it adds (how far its end moves the replay's latest end, idle time before it included). Summed over
    names, the exposed times give the replay's wall time: the attribution of a step's length to its kernels when
    they overlap."""
    out: dict[str, dict] = defaultdict(lambda: {"launches": 0, "us": 0.0, "exposed_us": 0.0})
    for k, exposed in zip(first_kernels, exposed_with_times(first_kernels)):
        row = out[k["kernel"]]
        row["launches"] += 1
        row["us"] += k["us"]
        row["exposed_us"] += exposed
    return dict(out)


def exposed_with_times(first_kernels: list[dict]) -> list[float]:
    """Each kernel's exposed time (``exposed_by_kernel``), in order."""
    prev_end = latest = 0.0
    out = []
    for i, k in enumerate(first_kernels):
        end = (prev_end + k["gap_before_us"] if i else 0.0) + k["us"]
        out.append(max(0.0, end - latest))
        prev_end, latest = end, max(latest, end)
    return out


def verify_layers(first_kernels: list[dict], layers: int) -> dict[str, float]:
    """A round's target verify forward, per layer: exposed us by role, averaged over its ``layers`` layers (the
    span from the kernel before the first of the last ``layers`` RoPE kernels ahead of the lm_head, the longest
    kernel, up to that lm_head). The linears are told apart by place and length: q/k/v is the one before a RoPE,
    then o (under 30 us), down (30-60) and gate/up (longer), which holds for the Llama-3.1-8B shapes at 4 rows."""
    exposed = exposed_with_times(first_kernels)
    head = max(range(len(first_kernels)), key=lambda i: first_kernels[i]["us"])
    ropes = [i for i in range(head) if first_kernels[i]["kernel"] == "_rope_qk"][-layers:]
    start = ropes[0] - 1
    if start > 0 and "norm" in first_kernels[start - 1]["kernel"]:
        start -= 1  # the first layer's input norm
    roles: dict[str, float] = defaultdict(float)
    for i in range(start, head):
        k = first_kernels[i]
        name = k["kernel"]
        if name == "_weight_left_dot" or name == "_gemv":
            name = ("q/k/v" if first_kernels[i + 1]["kernel"] == "_rope_qk" else
                    "o" if k["us"] < 30 else "down" if k["us"] < 60 else "gate/up")
        roles[name] += exposed[i] / layers
    return {"per_layer_us": sum(roles.values()), **roles}


def exposed_markdown(files: list[str], key: str = "eagle3_chain3_graph_first_kernels", layers: int = 32) -> str:
    """A table of ``exposed_by_kernel`` for ``key`` of each ``--graphs`` result file, side by side; for a round,
    also its verify forward per layer (``verify_layers``, a model of ``layers`` layers)."""
    runs = [(Path(f).stem, json.loads(Path(f).read_text())) for f in files]
    tables = [exposed_by_kernel(r[key]) for _, r in runs]
    names = sorted({n for t in tables for n in t},
                   key=lambda n: -max(t.get(n, {}).get("exposed_us", 0) for t in tables))
    head = " | ".join(f"{stem} ({r['commit']}): launches, kernel us, exposed us" for stem, r in runs)
    lines = [f"`{key}`, one replay", "", f"| kernel | {head} |", "|---|" + "---|" * len(runs)]
    for n in names:
        cells = [f"{t[n]['launches']}, {t[n]['us']:.1f}, {t[n]['exposed_us']:.1f}" if n in t else "" for t in tables]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines.append("| wall | " + " | ".join(f"{sum(v['exposed_us'] for v in t.values()):.1f}" for t in tables) + " |")
    if key.startswith("eagle3"):  # the verify forward's layers (``verify_layers``)
        per = [verify_layers(r[key], layers) for _, r in runs]
        lines += ["", f"The verify forward, exposed us per layer (mean of {layers}):", "",
                  "| role | " + " | ".join(stem for stem, _ in runs) + " |", "|---|" + "---|" * len(runs)]
        for role in sorted({n for t in per for n in t}, key=lambda n: -max(t.get(n, 0.0) for t in per)):
            lines.append(f"| {role} | " + " | ".join(f"{t[role]:.2f}" if role in t else "" for t in per) + " |")
    return "\n".join(lines) + "\n"


def graph_profile(ckpt: str, head: str | None, steps: int, later_tokens: int = 0) -> dict:
    """The bs=1 decode graph replayed back to back, and (``head``) bs=1 speculative engine steps, under the profiler.
    ``later_tokens``: also profile engine steps (no-spec and, with ``head``, speculative) once the request has
    generated that many more tokens (what grows with the context)."""
    from torch.profiler import ProfilerActivity, profile

    from deployments.engine.engine import Engine
    from deployments.engine.request import SamplingParams
    from workers.config import EngineConfig, SpeculativeConfig

    def decoding_engine(spec=None):  # one request past its prefill and a few steps (graphs captured, warm)
        eng = Engine(EngineConfig(model=ckpt, device="cuda", dtype="bfloat16", max_model_len=4096, max_num_seqs=8,
                                  cuda_graph_max_bs=8, prefill_attention_backend="triton",
                                  decode_attention_backend="triton", gpu_memory_utilization=0.5,
                                  speculative_config=spec))
        eng.add_request(list(range(1000, 1128)), SamplingParams(max_tokens=8 * steps + 64 + later_tokens,
                                                                temperature=0.0, ignore_eos=True))
        for _ in range(8):
            eng.step()
        return eng

    def timeline(run_once) -> list[tuple[str, float, float]]:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                run_once()
            torch.cuda.synchronize()
        return kernel_timeline(prof)

    def release() -> None:  # after the caller dropped its engine (graphs and their closures form cycles)
        gc.collect()
        torch.cuda.empty_cache()

    def context(eng) -> int:
        req = next(iter(eng.scheduler.running))
        return req.num_tokens

    def engine_steps_at_two_contexts(eng, name: str, out: dict) -> None:
        """Engine steps now and ``later_tokens`` tokens later, each with the request's context."""
        at = {}
        for label in ("now", "later"):
            if label == "later":
                target = context(eng) + later_tokens
                while context(eng) < target:
                    eng.step()
            ctx = context(eng)
            at[label] = {"context": ctx, **timeline_summary(timeline(eng.step), steps)}
        out[f"{name}_engine_steps_by_context"] = at
        print(name, {k: (v["context"], v["wall_us_per_step"], v["busy_us_per_step"]) for k, v in at.items()},
              flush=True)

    def graph_replays(eng, name: str, out: dict, first_kernels: int) -> None:
        """The bs=1 graph ``name`` replayed back to back (the same inputs each time: no host work between), and
        the first kernels of one replay in order, with the gap before each."""
        graph = eng.executor.worker.graphs.graphs[(name, 1, "greedy", False)][0]
        ks = timeline(graph.replay)
        label = "decode" if name == "decode" else "eagle3_chain3"
        out[f"{label}_graph_replay"] = timeline_summary(ks, steps)
        first = ks[:min(len(ks) // steps, first_kernels)]
        out[f"{label}_graph_first_kernels"] = [{"kernel": short_name(n), "us": round(e - s, 2),
                                                "gap_before_us": round(s - (first[i - 1][2] if i else s), 2)}
                                               for i, (n, s, e) in enumerate(first)]

    out = {}
    eng = decoding_engine()
    graph_replays(eng, "decode", out, 40)
    print(json.dumps(out, indent=1), flush=True)
    if later_tokens:
        engine_steps_at_two_contexts(eng, "decode", out)
    del eng
    release()
    if head:
        eng = decoding_engine(SpeculativeConfig(method="eagle3", model=head, num_steps=3, topk=1,
                                                simulated_accept_length=3.0, adaptive=False))
        out["eagle3_chain3_engine_steps"] = timeline_summary(timeline(eng.step), steps)
        print(json.dumps(out["eagle3_chain3_engine_steps"], indent=1), flush=True)
        # every kernel of a round in order: which are the model's and which bookkeeping
        graph_replays(eng, "round", out, 1000)
        print(json.dumps(out["eagle3_chain3_graph_replay"], indent=1), flush=True)
        if later_tokens:
            engine_steps_at_two_contexts(eng, "eagle3_chain3", out)
        del eng
        release()
    return out




def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", required=True)
    ap.add_argument("--linears-only", action="store_true")
    ap.add_argument("--report-only", action="store_true", help="re-render <out>.md/.png from <out>.json")
    ap.add_argument("--graphs", action="store_true", help="profile the bs=1 CUDA graphs instead (see the docstring)")
    ap.add_argument("--head", help="with --graphs: an EAGLE-3 head for the speculative rounds")
    ap.add_argument("--later-tokens", type=int, default=0,
                    help="with --graphs: also profile engine steps this many generated tokens later")
    ap.add_argument("--exposed", nargs="+", metavar="JSON",
                    help="instead: the wall time each kernel adds to a round (exposed_by_kernel) in these --graphs "
                         "results, a markdown table to <out>.md")
    args = ap.parse_args()
    out = out_path(args.out)
    if args.exposed:
        write_markdown(out, exposed_markdown(args.exposed))
        return
    if args.report_only:
        res = json.loads(out.with_suffix(".json").read_text())
        write_markdown(out, linear_markdown(res))
        linear_plot(res, out.with_suffix(".png"))
        return
    if not args.ckpt:
        ap.error("--ckpt is required (except with --report-only or --exposed)")
    if args.graphs:
        res = {"device": device_name("cuda"), "commit": commit(), "command": command(),
               **graph_profile(args.ckpt, args.head, args.steps, args.later_tokens)}
        write_json(out, res)
        return
    cfg = json.loads((Path(args.ckpt) / "config.json").read_text())
    bw = copy_bandwidth()
    res = {"device": device_name("cuda"), "commit": commit(), "command": command(),
           "copy_bandwidth_gb_s": round(bw / 1e9, 1), "linears": linear_table(cfg, bw)}
    write_markdown(out, linear_markdown(res))
    linear_plot(res, out.with_suffix(".png"))
    if not args.linears_only:
        res["kernels_bs1_eager"] = kernel_profile(args.ckpt, args.steps)
    write_json(out, res)


if __name__ == "__main__":
    main()
