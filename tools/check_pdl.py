"""Programmatic dependent launch on the GPU (sm90+): the decoder's own kernels chained as a decode step chains them
(residual add + RMSNorm → linear → linear → RMSNorm → gate/up linear → gated down linear, several layers, then
RoPE, the KV store and the greedy argmax / log-sum-exp), launched with PDL (each release point, with and without the linears'
L2 weight prefetch), eagerly and replayed from a CUDA graph with fresh inputs before every replay, must give bit for bit what the same
kernels give launched one after another. A kernel that read its input before the previous kernel had written it
would differ. Also times the chain's graph replay each way (8B-shaped weights).

    python tools/check_pdl.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workers import fused_ops, small_m_linear as sml  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 4096, 32, 8, 128, 14336, 4


def make_weights(g: torch.Generator) -> list[dict]:
    def w(*shape):
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to("cuda", torch.bfloat16)

    qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return [{"norm1": 1 + w(HIDDEN) * 0.1, "qkv": w(qkv, HIDDEN), "o": w(HIDDEN, HEADS * HEAD_DIM),
             "norm2": 1 + w(HIDDEN) * 0.1, "gate_up": w(2 * INTER, HIDDEN), "down": w(HIDDEN, INTER)}
            for _ in range(LAYERS)]


def chain(x: torch.Tensor, layers: list[dict], cache: dict, positions: torch.Tensor) -> list[torch.Tensor]:
    """Every kernel's output that the check compares."""
    rows = x.shape[0]
    cfg = sml.CANDIDATES_M1[0] if rows == 1 else sml.CANDIDATES[0]
    outs, residual = [], None
    for lw in layers:
        h, residual = fused_ops.rms_norm(x, lw["norm1"], 1e-5, residual) if residual is not None else (
            fused_ops.rms_norm(x, lw["norm1"], 1e-5), x)
        qkv = sml.small_m_linear(h, lw["qkv"], None, cfg)
        q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        q, k = fused_ops.apply_rope_qk(q.view(rows, HEADS, HEAD_DIM), k.view(rows, KV_HEADS, HEAD_DIM),
                                       cache["cos"][positions], cache["sin"][positions])
        fused_ops.store_kv(cache["k"], cache["v"], positions, k, v.view(rows, KV_HEADS, HEAD_DIM))
        attn_out = sml.small_m_linear(q.reshape(rows, -1), lw["o"], None, cfg)
        h, residual = fused_ops.rms_norm(attn_out, lw["norm2"], 1e-5, residual)
        x = sml.small_m_linear(sml.small_m_linear(h, lw["gate_up"], None, cfg), lw["down"], None, cfg, gated=True)
        outs += [q, attn_out, x, residual]
    ids, lse = fused_ops.argmax_logsumexp(x.float())
    return outs + [ids, lse, cache["k"][positions].clone(), cache["v"][positions].clone()]


def fresh_cache(g: torch.Generator) -> dict:
    half = HEAD_DIM // 2
    return {"k": torch.zeros(64, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda"),
            "v": torch.zeros(64, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda"),
            "cos": torch.randn(64, half, generator=g).cuda(), "sin": torch.randn(64, half, generator=g).cuda()}


def run_case(rows: int, replays: int, g: torch.Generator) -> dict:
    layers = make_weights(g)
    inputs = [torch.randn(rows, HIDDEN, generator=g).to("cuda", torch.bfloat16) for _ in range(replays)]
    positions = torch.arange(rows, device="cuda") * 3
    cache = fresh_cache(g)

    fused_ops._PDL_ALLOWED = False  # the reference: every kernel waits for the previous one
    reference = [chain(x, layers, cache, positions) for x in inputs]
    fused_ops._PDL_ALLOWED = True
    assert fused_ops.use_pdl(inputs[0]), "this GPU does not launch with PDL"

    eager_equal = all(torch.equal(a, b) for x, ref in zip(inputs, reference)
                      for a, b in zip(chain(x, layers, cache, positions), ref))
    static_x = inputs[0].clone()
    results = {}
    for release in (0, 1, 2):
        for prefetch in (0, 4 << 20):
            name = f"release{release}_prefetch{prefetch >> 20}mb"
            saved = fused_ops.PDL_RELEASE, sml.L2_PREFETCH_BYTES
            fused_ops.PDL_RELEASE, sml.L2_PREFETCH_BYTES = release, prefetch
            try:
                chain(static_x, layers, cache, positions)  # compile outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_out = chain(static_x, layers, cache, positions)
            finally:
                fused_ops.PDL_RELEASE, sml.L2_PREFETCH_BYTES = saved
            equal = True
            for x, ref in zip(inputs, reference):
                static_x.copy_(x)
                graph.replay()
                equal &= all(torch.equal(a, b) for a, b in zip(static_out, ref))
            results[name] = {"graph_equal": bool(equal), "replay_ms": round(replay_ms(graph), 4)}

    fused_ops._PDL_ALLOWED = False
    chain(static_x, layers, cache, positions)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(static_x, layers, cache, positions)
    fused_ops._PDL_ALLOWED = True
    weight_bytes = sum(t.numel() * t.element_size() for lw in layers for t in lw.values())
    return {"rows": rows, "layers": LAYERS, "weight_mb": round(weight_bytes / 2**20), "eager_pdl_equal": eager_equal,
            **{f"{k}_{m}": v for k, r in results.items() for m, v in r.items()},
            "no_pdl_replay_ms": round(replay_ms(graph), 4)}


def replay_ms(graph, iters: int = 100) -> float:
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--replays", type=int, default=8)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    rows = [run_case(m, args.replays, g) for m in (1, 4)]
    ok = all(v for r in rows for k, v in r.items() if k.endswith("_equal"))
    for r in rows:
        print(r, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "ok": ok, "rows": rows},
                                              indent=1))
    print("PDL check:", "ok" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
