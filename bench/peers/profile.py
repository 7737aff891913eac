"""Where a decode step's time goes at a batch size, by kernel class, for both engines, against the compute floor.

Two parts, each on the GPU machine:

    python3 -m bench.peers.profile --floor --shape llama-3.1-8b --batch-sizes 64,256 --out /tmp/peer_runs/floor_8b.json

measures, in a process of its own before any engine holds the GPU's memory, the bf16 matmul rate (torch.matmul of
random 8192 x 8192 x 8192), the device-to-device copy bandwidth, and every linear layer of the shape at M = batch
rows through torch (cuBLAS), summed over one step. The floor of a decode step at B rows is then
2 x (matmul parameters) x B / (matmul rate); the weight-read floor is the weight bytes over the copy bandwidth.

The kernels are profiled inside ``bench.peers.run --profile-batch-sizes 64,256`` (``profile_steps``), in the engine's
own process after its offline rows: B distinct random prompts (128 tokens) with N1 and then N2 new tokens each, under
the profiler (vLLM: its own torch profiler in the engine core, ``profiler_config``; specserve: torch.profiler around
``Engine.generate``), with the host asleep between the calls so that each call's kernels stand apart on the
timeline. Everything that grows with the decode step count is taken per step as (X(N2) - X(N1)) / (N2 - N1), which
leaves prefill and per-call overhead out, as the decode rows do. Per step: kernel time by class (sums of kernel
durations), busy time (the union of kernel intervals), and the step's time without the profiler (the same
difference of wall clocks): idle = that step time - busy time.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import time
from pathlib import Path

CLASSES = ("gemm", "attention", "norm_rope_elementwise", "sampling", "other")
CLASS_LABELS = {"gemm": "GEMMs", "attention": "attention (+ KV write)", "norm_rope_elementwise":
                "norms / RoPE / elementwise", "sampling": "sampling", "other": "all else"}
# First match wins. FA3's kernels carry "cutlass" in their template names, so attention is tested before GEMMs;
# an Inductor kernel fusing an argmax counts as sampling.
_RULES = [
    ("sampling", r"argmax|gumbel|top_?k|top_?p|_filter_|sampl|logprob|multinomial|exponential|_uniform_noise"),
    ("attention", r"attn|attention|flash|fmha|_split_kv|_merge_splits|reshape_and_cache|_store_kv|paged|xqa|mha"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|_linear|_gemv|_weight_left_dot|matmul|splitk|wgmma|bmm"),
    ("norm_rope_elementwise", r"norm|rms|rope|rotary|silu|act_and_mul|gelu|elementwise|triton_poi|triton_red|"
                              r"triton_per|vectorized|fused_add|_add_|mul_|copy|cat_|index|embedding|fill"),
]
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
CALL_GAP_US = 250e3  # the host sleeps 0.5 s between profiled calls: a gap this long separates two calls


def kernel_class(name: str, cat: str = "kernel") -> str:
    if cat != "kernel":
        return "other"  # copies and fills the runtime issues (memcpy / memset)
    low = name.lower()
    return next((c for c, rx in _RULES if re.search(rx, low)), "other")


def load_trace(path: str | Path) -> list[tuple[str, str, float, float]]:
    """(name, category, start us, end us) of every GPU activity in a Chrome trace (.json or .json.gz), in start
    order."""
    p = Path(path)
    raw = gzip.open(p, "rt") if p.suffix == ".gz" else p.open()
    with raw as f:
        events = json.load(f)
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    out = [(e["name"], e["cat"], float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
           if e.get("ph") == "X" and e.get("cat") in GPU_CATS and float(e.get("dur", 0)) > 0]
    return sorted(out, key=lambda k: k[2])


def split_calls(kernels: list[tuple], gap_us: float = CALL_GAP_US) -> list[list[tuple]]:
    """The timeline cut where the GPU stood idle for longer than ``gap_us``: one segment per profiled call."""
    segs, end = [], None
    for k in kernels:
        if end is None or k[2] - end > gap_us:
            segs.append([])
        segs[-1].append(k)
        end = k[3] if end is None else max(end, k[3])
    return segs


def summarize(kernels: list[tuple]) -> dict:
    """One call's kernels: time by class (sum of durations, us), busy (the union of the intervals), wall (first start
    to last end), the kernel count, and time by kernel name."""
    by_class = dict.fromkeys(CLASSES, 0.0)
    by_name: dict[str, list] = {}
    busy, cur_s, cur_e = 0.0, None, None
    for name, cat, s, e in kernels:
        c = kernel_class(name, cat)
        by_class[c] += e - s
        row = by_name.setdefault(name, [c, 0.0, 0])
        row[1] += e - s
        row[2] += 1
        if cur_e is None or s > cur_e:
            busy += 0.0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += 0.0 if cur_e is None else cur_e - cur_s
    wall = max(k[3] for k in kernels) - kernels[0][2] if kernels else 0.0
    return {"by_class_us": by_class, "busy_us": busy, "wall_us": wall, "kernels": len(kernels), "by_name": by_name}


def per_step(short: dict, long: dict, steps: int, step_ms_unprofiled: float | None) -> dict:
    """Per decode step, from the summaries of the N1 call and the N2 call (``steps`` = N2 - N1)."""
    ms = lambda a, b: round((b - a) / steps / 1e3, 4)  # noqa: E731
    row = {"by_class_ms": {c: ms(short["by_class_us"][c], long["by_class_us"][c]) for c in CLASSES},
           "busy_ms": ms(short["busy_us"], long["busy_us"]), "profiled_wall_ms": ms(short["wall_us"], long["wall_us"]),
           "kernels_per_step": round((long["kernels"] - short["kernels"]) / steps, 1)}
    if step_ms_unprofiled is not None:
        row["step_ms"] = round(step_ms_unprofiled, 4)
        row["idle_ms"] = round(step_ms_unprofiled - row["busy_ms"], 4)
    names = []
    for name, (c, us, n) in long["by_name"].items():
        us0, n0 = short["by_name"].get(name, [c, 0.0, 0])[1:]
        names.append({"kernel": name[:120], "class": c, "ms_per_step": round((us - us0) / steps / 1e3, 4),
                      "launches_per_step": round((n - n0) / steps, 2)})
    row["top_kernels"] = sorted(names, key=lambda r: -r["ms_per_step"])[:12]
    return row


def profile_steps(generate, start, stop, prompts, batch_sizes: list[int], n1: int = 16, n2: int = 80,
                  reps: int = 2) -> dict:
    """The decode step at each batch size, by kernel class. ``generate(prompts, n)`` runs a call as the offline
    rows do (wall clock around it); ``start()`` / ``stop()`` start the profiler and stop it, ``stop`` returning the
    Chrome trace's path; ``prompts(count, seed)`` gives distinct random prompts (no prefix-cache hits)."""
    out = {"n1": n1, "n2": n2, "method": "per step = (X(n2 new tokens) - X(n1)) / (n2 - n1)", "batch_sizes": {}}
    unprofiled = {}
    for bs in batch_sizes:
        # seeds apart from the rows' and from each other: no call finds another's prompts in a prefix cache
        generate(prompts(bs, 30_000 + bs), n1)  # warm at this batch size
        t = {}
        for n in (n1, n2):
            times = []
            for r in range(reps):
                t0 = time.perf_counter()
                generate(prompts(bs, 10_000 + 10 * bs + 2 * r + (n == n2)), n)
                times.append(time.perf_counter() - t0)
            t[n] = min(times)
        unprofiled[bs] = (t[n2] - t[n1]) / (n2 - n1) * 1e3
    calls = [(bs, n) for bs in batch_sizes for n in (n1, n2)]
    time.sleep(0.5)
    start()
    for i, (bs, n) in enumerate(calls):
        generate(prompts(bs, 20_000 + i), n)
        time.sleep(0.5)
    trace = stop()
    segs = split_calls(load_trace(trace))
    out["trace_segments"] = len(segs)
    if len(segs) != len(calls):
        out["error"] = f"{len(segs)} kernel segments on the timeline for {len(calls)} profiled calls"
        return out
    for j, bs in enumerate(batch_sizes):
        short, long = summarize(segs[2 * j]), summarize(segs[2 * j + 1])
        out["batch_sizes"][str(bs)] = per_step(short, long, n2 - n1, unprofiled[bs])
    return out


# -- the floor, in a process of its own ---------------------------------------------------------------------------

def matmul_params(cfg: dict) -> int:
    """Parameters that take part in a matrix product each step: every linear layer and the LM head (the embedding
    lookup does none)."""
    h, inter, v, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    return layers * (2 * h * h + 2 * kv * h + 3 * h * inter) + v * h


def linear_shapes(cfg: dict) -> dict[str, tuple[int, int, int]]:
    """(N, K, count per step) of each linear layer as both engines fuse them (q/k/v one GEMM, gate/up one)."""
    h, inter, v, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    return {"qkv": (h + 2 * kv, h, layers), "o": (h, h, layers), "gate_up": (2 * inter, h, layers),
            "down": (h, inter, layers), "lm_head": (v, h, 1)}


def measure_floor(shape: str, batch_sizes: list[int]) -> dict:
    import torch
    import torch.nn.functional as F
    import triton.testing

    from bench.common import SHAPES, copy_bandwidth

    def square_matmul_ms() -> float:
        a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        return statistics.median(triton.testing.do_bench(lambda: torch.matmul(a, b), warmup=50, rep=200)
                                 for _ in range(3))

    def linear_ms(bs: int, n: int, k: int) -> float:
        # copies of the weight worth over 200 MB, cycled, so the L2 does not hold it between calls
        copies = max(1, -(-200 * 2 ** 20 // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(bs, k, device="cuda", dtype=torch.bfloat16)
        it = iter(range(1 << 62))
        return triton.testing.do_bench(lambda: F.linear(x, ws[next(it) % copies]), warmup=25, rep=100)

    cfg = SHAPES[shape]
    torch.manual_seed(0)
    rate = 2 * 8192 ** 3 / (square_matmul_ms() * 1e-3)
    torch.cuda.empty_cache()
    bw = copy_bandwidth()
    params = matmul_params(cfg)
    res = {"shape": shape, "matmul_params": params, "matmul_tflops": round(rate / 1e12, 1),
           "matmul_method": "torch.matmul 8192x8192x8192 bf16, random data, median of 3 do_bench medians",
           "copy_gb_s": round(bw / 1e9, 1), "weight_read_floor_ms": round(2 * params / bw * 1e3, 4),
           "batch_sizes": {}}
    for bs in batch_sizes:
        gemm_ms, parts = 0.0, {}
        for name, (n, k, count) in linear_shapes(cfg).items():
            t = linear_ms(bs, n, k)
            parts[name] = round(t, 4)
            gemm_ms += t * count
            torch.cuda.empty_cache()
        res["batch_sizes"][str(bs)] = {"compute_floor_ms": round(2 * params * bs / rate * 1e3, 4),
                                       "cublas_linears_ms": round(gemm_ms, 4), "cublas_linear_ms_each": parts}
        print(bs, res["batch_sizes"][str(bs)], flush=True)
    return res


def profile_markdown(floor: dict | None, runs: list[dict]) -> list[str]:
    """The table for docs/performance.md: per batch size and engine, the step's time by kernel class, idle, and
    the floors."""
    have = [r for r in runs if r.get("profile", {}).get("batch_sizes")]
    if not have:
        return []
    sizes = sorted({bs for r in have for bs in r["profile"]["batch_sizes"]}, key=int)
    lines = ["| requests | engine | step ms (no profiler) | " + " | ".join(CLASS_LABELS[c] for c in CLASSES)
             + " | GPU idle | kernels / step |", "|---|---|---|" + "---|" * len(CLASSES) + "---|---|"]
    for bs in sizes:
        for r in sorted(have, key=lambda r: r["engine"]):
            p = r["profile"]["batch_sizes"].get(bs)
            if not p:
                continue
            cls = " | ".join(f"{p['by_class_ms'][c]:.2f}" for c in CLASSES)
            lines.append(f"| {bs} | {r['engine']} | {p.get('step_ms', float('nan')):.2f} | {cls} | "
                         f"{p.get('idle_ms', float('nan')):.2f} | {p['kernels_per_step']} |")
    if floor:
        lines += ["", f"Floors on this GPU ({floor['shape']}, {floor['matmul_params'] / 1e9:.2f} B matmul "
                  f"parameters): bf16 matmul {floor['matmul_tflops']} TFLOP/s measured ({floor['matmul_method']}), "
                  f"copy {floor['copy_gb_s']} GB/s; weight read {floor['weight_read_floor_ms']:.2f} ms.", "",
                  "| requests | compute floor ms (2 x params x rows / matmul rate) | the same linears through torch "
                  "(cuBLAS) at M = rows, ms |", "|---|---|---|"]
        for bs in sizes:
            f = floor["batch_sizes"].get(bs)
            if f:
                lines.append(f"| {bs} | {f['compute_floor_ms']:.2f} | {f['cublas_linears_ms']:.2f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--floor", action="store_true", help="measure the floor (see the docstring)")
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--batch-sizes", default="64,256")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not args.floor:
        ap.error("the kernels are profiled through bench.peers.run --profile-batch-sizes; here only --floor")
    from bench.common import command, commit, device_name

    res = {"device": device_name("cuda"), "commit": commit(), "command": command(),
           **measure_floor(args.shape, [int(x) for x in args.batch_sizes.split(",")])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "batch_sizes"}), flush=True)


if __name__ == "__main__":
    main()
