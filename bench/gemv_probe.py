"""Probe that led to the small-M GEMV (bench/results/gemv_h100.md): an M = 1 GEMV accumulating [BLOCK_N, BLOCK_K]
products (reduced once after the loop) over a grid of tiles, against cuBLAS and the small-M kernel's M = 1 and
tensor-core candidates of commit 5df5b04, each timed as the tuner times it (``replayed_ms``), on the Llama-3.1-8B and
Llama-3.2-1B linear shapes. Kept as it ran: it imports 5df5b04's ``CANDIDATES_M1`` / ``CANDIDATES``, so it runs on that
tree (``git worktree add /tmp/t 5df5b04 && cp bench/gemv_probe.py /tmp/t/bench/``), on a GPU:

    python bench/gemv_probe.py bench/results/gemv_probe_h100.json
"""
import itertools
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, ".")
from workers.kernels.norm_rope import silu_and_mul
from workers.kernels.small_m_linear import (
    CANDIDATES,
    CANDIDATES_M1,
    replayed_ms,
    small_m_linear,
    weight_copies,
)


@triton.jit
def _gemv2d(X, W, Y, N, K, stride_wn, GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = X + offs_k
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(w_ptrs)
        x = tl.load(x_ptrs)
        if GATED:
            up = tl.load(x_ptrs + K).to(tl.float32)
            g = x.to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(X.dtype.element_ty)
            x = (act.to(tl.float32) * up).to(X.dtype.element_ty)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    tl.store(Y + offs_n, y.to(Y.dtype.element_ty))


def gemv2d(x, w, cfg, gated):
    bn, bk, warps, stages = cfg
    n, k = w.shape
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv2d[(n // bn,)](x, w, y, n, k, w.stride(0), GATED=gated, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                        num_stages=stages)
    return y


def main():
    shapes = {"8b_qkv": (6144, 4096, False), "8b_o": (4096, 4096, False), "8b_gate_up": (28672, 4096, False),
              "8b_down": (4096, 14336, True), "1b_qkv": (3072, 2048, False), "1b_o": (2048, 2048, False),
              "1b_gate_up": (16384, 2048, False), "1b_down": (2048, 8192, True)}
    bw_a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda"); bw_b = torch.empty_like(bw_a)
    side = torch.cuda.Stream()
    out = {"device": torch.cuda.get_device_name(), "rows": []}
    for name, (n, k, gated) in shapes.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        x = torch.randn(1, k * (2 if gated else 1), dtype=torch.bfloat16, device="cuda")
        ws = weight_copies(w)
        floor_us = n * k * 2 / 3.0e12 * 1e6
        res = {}
        res["cublas"] = replayed_ms((lambda ww: F.linear(silu_and_mul(x), ww)) if gated else (lambda ww: F.linear(x, ww)), ws, side)
        ref = F.linear(silu_and_mul(x) if gated else x, w).float()
        for cfg in CANDIDATES_M1 + CANDIDATES:
            try:
                res[f"cur{tuple(cfg)}"] = replayed_ms(lambda ww, c=cfg: small_m_linear(x, ww, None, c, gated), ws, side)
            except Exception as e:
                torch.cuda.synchronize()
        errs = {}
        for cfg in itertools.product((8, 16, 32), (256, 512, 1024), (2, 4, 8), (2, 3, 4)):
            if k % cfg[1] or n % cfg[0] or cfg[0] * cfg[1] // (32 * cfg[2]) > 256:
                continue
            try:
                y = gemv2d(x, w, cfg, gated).float()
                errs[str(cfg)] = float(((y - ref).norm() / ref.norm()).item())
                res[f"v2{cfg}"] = replayed_ms(lambda ww, c=cfg: gemv2d(x, ww, c, gated), ws, side)
            except Exception as e:
                torch.cuda.synchronize()
                print(name, cfg, type(e).__name__, str(e)[:80], flush=True)
        best = sorted(res.items(), key=lambda kv: kv[1])
        cur_best = min((v, kk) for kk, v in res.items() if kk.startswith("cur"))
        v2_best = min((v, kk) for kk, v in res.items() if kk.startswith("v2"))
        row = {"shape": name, "n": n, "k": k, "gated": gated, "floor_us_at_3TBps": round(floor_us, 2),
               "cublas_us": round(res["cublas"] * 1e3, 2), "current_best_us": round(cur_best[0] * 1e3, 2),
               "current_best": cur_best[1], "v2_best_us": round(v2_best[0] * 1e3, 2), "v2_best": v2_best[1],
               "v2_max_rel_err": max(errs.values()) if errs else None,
               "top5": [(kk, round(v * 1e3, 2)) for kk, v in best[:5]]}
        print(row, flush=True)
        out["rows"].append(row)
        del ws, w
        torch.cuda.empty_cache()
    json.dump(out, open(sys.argv[1], "w"), indent=1)


main()
