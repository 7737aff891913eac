"""Time to first token of one request through the in-process engine, by prompt length: where it goes (the engine's
step calls until the first token, and the prefill's GPU kernels by kind under torch.profiler) against the floors of
a prefill (its weights read once; its matmul FLOPs at the bf16 rate measured in the same run).

    python3 -m bench.prefill --shapes llama-3.2-1b,llama-3.1-8b --out bench/results/prefill/prefill_h100

A request is added to an idle engine and stepped until its first token (max_tokens 2, greedy); ``--reps`` timed
requests per length after two untimed ones, each with a prompt of its own (nothing to share in the prefix cache).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.common import (SHAPES, command, commit, copy_bandwidth, device_name, out_path, pyplot,
                          weight_bytes_per_token, write_checkpoint, write_json, write_markdown)

KINDS = (("gemm", ("gemm", "cutlass", "nvjet", "sm90_", "cublas", "matmul", "linear")),
         ("attention", ("attn", "attention", "extend", "split", "merge", "flash")),
         ("norm/rope/act", ("norm", "rope", "silu", "act_and_mul", "residual")),
         ("kv store", ("store", "kv_")),
         ("sampling", ("argmax", "gumbel", "sample", "top")))


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def matmul_rate() -> float:
    """bf16 FLOP/s of an 8192-cube matmul, the best of three timings."""
    import triton.testing

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = min(triton.testing.do_bench(lambda: a @ a, warmup=10, rep=50) for _ in range(3))
    return 2 * 8192 ** 3 / (ms * 1e-3)


def matmul_params(shape: str) -> int:
    c = SHAPES[shape]
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    return layers * (2 * h * h + 2 * kv * h + 3 * h * inter)  # the head runs on the last row only


def first_token(engine, prompt: list[int]) -> tuple[float, list[dict]]:
    """Seconds from add_request to the first token, and each step call until then (start, end, what it returned)."""
    from deployments.engine.request import SamplingParams

    calls = []
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)).rid
    first = None
    while engine.has_work():
        s = time.perf_counter()
        outs = engine.step()
        e = time.perf_counter()
        got = sum(len(o.new_token_ids) for o in outs if o.rid == rid)
        if first is None:
            calls.append({"start_ms": round((s - t0) * 1e3, 3), "end_ms": round((e - t0) * 1e3, 3), "tokens": got})
            if got:
                first = e
    return first - t0, calls


def kernels(engine, prompt: list[int]) -> dict:
    """The GPU kernels of one request's first-token calls: time by kind, the busy span, the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        first_token(engine, prompt)
        torch.cuda.synchronize()
    ks = sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start),
                key=lambda k: k[1])
    by_kind, by_name = defaultdict(float), defaultdict(lambda: [0, 0.0])
    for name, s, e in ks:
        by_kind[kind_of(name)] += (e - s) / 1e3
        by_name[name[:80]][0] += 1
        by_name[name[:80]][1] += (e - s) / 1e3
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]
    return {"kernels": len(ks), "busy_ms": round(sum(by_kind.values()), 3),
            "span_ms": round((ks[-1][2] - ks[0][1]) / 1e3, 3) if ks else 0.0,
            "by_kind_ms": {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top": [{"kernel": n, "launches": c, "ms": round(t, 3)} for n, (c, t) in top]}


def host_profile(engine, prompt: list[int], top: int = 40) -> str:
    """cProfile of one request's calls until its first token: the host functions by own time and by cumulative."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    first_token(engine, prompt)
    prof.disable()
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(top)
    return text.getvalue()


def measure(shape: str, ckpt: str, lens: list[int], reps: int, bw: float, rate: float, graph_tokens: int,
            host: Path | None = None) -> list[dict]:
    from deployments.engine.engine import Engine
    from workers.config import EngineConfig

    engine = Engine(EngineConfig(model=ckpt, device="cuda", dtype="bfloat16", max_model_len=max(4096, 2 * max(lens)),
                                 max_num_seqs=8, cuda_graph_max_bs=8, max_prefill_tokens=max(2048, max(lens)),
                                 cuda_graph_max_prefill_tokens=graph_tokens, gpu_memory_utilization=0.5))
    vocab = SHAPES[shape]["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    rows = []
    for n in lens:
        for _ in range(2):
            first_token(engine, prompt(n))
        times, calls = [], None
        for _ in range(reps):
            t, c = first_token(engine, prompt(n))
            times.append(t * 1e3)
            calls = calls or c
        prof = kernels(engine, prompt(n))
        if host is not None:
            Path(f"{host}_{shape}_{graph_tokens}_{n}.txt").write_text(host_profile(engine, prompt(n)))
        read = weight_bytes_per_token(shape) / bw * 1e3
        flops = 2 * matmul_params(shape) * n / rate * 1e3
        row = {"shape": shape, "prefill_graph_tokens": graph_tokens, "prompt_len": n,
               "ttft_ms_median": round(statistics.median(times), 3),
               "ttft_ms_min": round(min(times), 3), "ttft_ms": [round(t, 3) for t in times],
               "read_floor_ms": round(read, 3), "compute_floor_ms": round(flops, 3),
               "floor_ms": round(max(read, flops), 3), "calls": calls, **prof}
        row["ttft_vs_floor"] = round(row["ttft_ms_median"] / row["floor_ms"], 2)
        print({k: row[k] for k in ("shape", "prefill_graph_tokens", "prompt_len", "ttft_ms_median", "floor_ms",
                                   "busy_ms", "span_ms", "by_kind_ms")}, flush=True)
        rows.append(row)
    engine.shutdown()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def report(res: dict, out: Path) -> None:
    md = [f"# Time to first token, one request, in-process engine ({res['device']})", "",
          f"commit `{res['commit']}` · command `{res['command']}`", "",
          f"Floors: weights read once at {res['copy_gb_s']:.0f} GB/s; matmul FLOPs at {res['matmul_tflops']:.0f} "
          "TFLOP/s (bf16, 8192 cube), both measured in this run. `busy`: GPU kernel time of the request's calls "
          "until its first token; `span`: first kernel start to last kernel end.", "",
          "| shape | prefill graphs up to | prompt | TTFT p50 ms (min) | floor ms (read / compute) | TTFT ÷ floor "
          "| GPU busy ms | span ms "
          "| kernels | by kind ms | step calls (start→end ms, tokens) |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        kinds = ", ".join(f"{k} {v}" for k, v in r["by_kind_ms"].items())
        calls = "; ".join(f"{c['start_ms']}→{c['end_ms']} ({c['tokens']})" for c in r["calls"])
        md.append(f"| {r['shape']} | {r['prefill_graph_tokens'] or 'eager'} | {r['prompt_len']} | "
                  f"{r['ttft_ms_median']} ({r['ttft_ms_min']}) | "
                  f"{r['floor_ms']} ({r['read_floor_ms']} / {r['compute_floor_ms']}) | {r['ttft_vs_floor']} | "
                  f"{r['busy_ms']} | {r['span_ms']} | {r['kernels']} | {kinds} | {calls} |")
    md += ["", "Top kernels of each row (ms, launches):", ""]
    for r in res["rows"]:
        md.append(f"- {r['shape']} {r['prefill_graph_tokens'] or 'eager'} {r['prompt_len']}: " + "; ".join(
            f"`{k['kernel'][:60]}` {k['ms']} ({k['launches']})" for k in r["top"][:6]))
    write_markdown(out, md)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    floors = set()
    for shape, g in dict.fromkeys((r["shape"], r["prefill_graph_tokens"]) for r in res["rows"]):
        rs = [r for r in res["rows"] if (r["shape"], r["prefill_graph_tokens"]) == (shape, g)]
        ax.plot([r["prompt_len"] for r in rs], [r["ttft_ms_median"] for r in rs], "o-",
                label=f"{shape} TTFT, " + (f"prefill graphs ≤ {g}" if g else "eager prefill"))
        if shape not in floors:
            floors.add(shape)
            ax.plot([r["prompt_len"] for r in rs], [r["floor_ms"] for r in rs], "k:", label=f"{shape} floor")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("ms")
    ax.legend(fontsize=7)
    ax.set_title(f"{res['device']} · {res['commit']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b")
    ap.add_argument("--prompt-lens", default="128,256,1024,2048")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--prefill-graph-tokens", default="2048,0", help="comma list of the engine's "
                    "cuda_graph_max_prefill_tokens to run (0: eager prefills)")
    ap.add_argument("--host-profile", action="store_true", help="also write <out>_<shape>_<len>.txt: cProfile of "
                    "one request's calls until its first token")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = out_path(args.out)
    bw, rate = copy_bandwidth(), matmul_rate()
    lens = [int(x) for x in args.prompt_lens.split(",")]
    rows = []
    for shape in args.shapes.split(","):
        ckpt = Path(f"/tmp/{shape}-random")
        if not (ckpt / "config.json").exists():
            write_checkpoint(ckpt, shape)
        for g in (int(x) for x in args.prefill_graph_tokens.split(",")):
            rows += measure(shape, str(ckpt), lens, args.reps, bw, rate, g, out if args.host_profile else None)
    res = {"device": device_name("cuda"), "commit": commit(), "command": command(), "copy_gb_s": bw / 1e9,
           "matmul_tflops": rate / 1e12, "rows": rows}
    write_json(out.with_suffix(".json"), res)
    report(res, out)


if __name__ == "__main__":
    main()
