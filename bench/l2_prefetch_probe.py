"""Probe: does pulling the next linear's weight into L2 on a side stream, while the latency-bound kernels between two
linears run (RoPE, attention, merge, norms: ~10 us a layer at bs=1 with the memory idle), make that linear faster?

A bs=1 layer skeleton of the 8B shape in one CUDA graph: qkv (4096 -> 6144), ``--window`` small kernels standing in
for RoPE / attention / merge, o (4096 -> 4096), 32 layers with their own weights (nothing stays in L2 from the last
replay). Variants prefetch o's weight (all of it or its first part) from a side stream forked right after qkv:
``bulk`` issues sm90 ``cp.async.bulk.prefetch.L2`` (the thread does not wait), ``touch`` reads the bytes. Times are
CUDA-graph replays (median of blocks), same process; JSON + markdown.

    python bench/l2_prefetch_probe.py --out bench/results/l2_prefetch_probe_h100
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@triton.jit
def _bulk_prefetch(W, nbytes_per_prog, SEG: tl.constexpr, LANES: tl.constexpr):
    base = W + tl.program_id(0).to(tl.int64) * nbytes_per_prog
    lane = tl.arange(0, LANES)
    ptrs = base + lane.to(tl.int64) * SEG
    n = tl.where(lane * SEG < nbytes_per_prog, SEG, 0)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, n], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _touch(W, Sink, n_per_prog, BLOCK: tl.constexpr):
    base = W + tl.program_id(0).to(tl.int64) * n_per_prog
    acc = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n_per_prog, BLOCK):
        acc += tl.load(base + start + tl.arange(0, BLOCK), cache_modifier=".cg")
    tl.store(Sink + tl.program_id(0), tl.sum(acc, 0))


def prefetch(kind: str, w: torch.Tensor, nbytes: int, programs: int, sink: torch.Tensor) -> None:
    per = nbytes // programs
    if kind == "bulk":
        seg = 4096
        lanes = triton.next_power_of_2(triton.cdiv(per, seg))
        _bulk_prefetch[(programs,)](w, per, SEG=seg, LANES=lanes, num_warps=4)
    else:
        words = w.view(torch.int32).reshape(-1)
        _touch[(programs,)](words, sink, per // 4, BLOCK=2048, num_warps=8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--window", type=int, default=4, help="small kernels between qkv and o")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    dt = torch.bfloat16
    L = args.layers
    wqkv = [torch.randn(6144, 4096, device=dev, dtype=dt) * 0.01 for _ in range(L)]
    wo = [torch.randn(4096, 4096, device=dev, dtype=dt) * 0.01 for _ in range(L)]
    x = torch.randn(1, 4096, device=dev, dtype=dt)
    small = torch.randn(64, 128, device=dev)
    sink = torch.zeros(1024, device=dev, dtype=torch.int32)
    side = torch.cuda.Stream()

    def layer_stack(variant):
        kind, frac, programs = variant
        h = x
        events = []
        for i in range(L):
            qkv = torch.nn.functional.linear(h, wqkv[i])
            if kind != "none":
                ev = torch.cuda.Event()
                ev.record()
                side.wait_event(ev)
                with torch.cuda.stream(side):
                    prefetch(kind, wo[i], int(wo[i].numel() * 2 * frac) // 4096 * 4096, programs, sink)
                done = torch.cuda.Event()
                done.record(side)
                events.append(done)
            s = small
            for _ in range(args.window):  # the latency-bound kernels between the two linears
                s = torch.tanh(s)
            h = torch.nn.functional.linear(qkv[:, :4096] + s[0, 0].to(dt), wo[i])
        for ev in events:  # join the side stream (a capture must end on one stream)
            torch.cuda.current_stream().wait_event(ev)
        return h

    variants = [("none", 0, 0)] + [(k, f, p) for k in ("bulk", "touch") for f in (1.0, 0.5) for p in (16, 64)]
    graphs = {}
    for v in variants:
        for _ in range(2):
            layer_stack(v)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            layer_stack(v)
        graphs[v] = g
    times = {v: [] for v in variants}
    for _ in range(7):  # interleaved blocks
        for v, g in graphs.items():
            g.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                g.replay()
            end.record()
            torch.cuda.synchronize()
            times[v].append(start.elapsed_time(end) / 20)
    base = statistics.median(times[variants[0]])
    rows = []
    for v in variants:
        ms = statistics.median(times[v])
        rows.append({"prefetch": v[0], "fraction_of_o": v[1], "programs": v[2], "ms_per_stack": round(ms, 4),
                     "us_per_layer_saved": round((base - ms) * 1000 / L, 2)})
    res = {"device": torch.cuda.get_device_name(), "commit": os.environ.get("SPECSERVE_COMMIT", "?"),
           "command": "python " + " ".join(sys.argv), "layers": L, "window_kernels": args.window, "rows": rows}
    Path(args.out + ".json").write_text(json.dumps(res, indent=1))
    md = [f"# L2 prefetch probe ({res['device']})", "",
          f"commit `{res['commit']}`, command `{res['command']}`; {L} layers of qkv + {args.window} small kernels + o",
          "", "| prefetch | fraction of o | programs | ms per stack | us saved per layer |", "|---|---|---|---|---|"]
    md += [f"| {r['prefetch']} | {r['fraction_of_o']} | {r['programs']} | {r['ms_per_stack']} | {r['us_per_layer_saved']} |"
           for r in rows]
    Path(args.out + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
