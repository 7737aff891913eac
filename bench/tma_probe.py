"""Probe: the weight-left tensor-core tile at few rows with its weight tiles brought by the Hopper tensor memory
accelerator (TMA: a host tensor descriptor, ``triton.tools.tensor_descriptor``) instead of per-thread loads, against
the tuner's incumbent weight-left tile, cuBLAS and (one row) the GEMV, on the Llama-3.1-8B linear shapes.

Timed as the tuner times (``small_m_linear.replayed_ms``: CUDA-graph replays of back-to-back calls over weight
copies worth twice the L2). Writes JSON (every config's microseconds and its error against cuBLAS).

    python bench/tma_probe.py --out /tmp/r/tma_probe_h100
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_vs_hf import commit, device_name  # noqa: E402
from workers.kernels import small_m_linear as sml  # noqa: E402
from workers.kernels import tuning  # noqa: E402


@triton.jit
def _weight_left_tma(X, w_desc, Y, M, N, K, stride_xm, stride_ym, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc [BLOCK_N, 16] += W_tile @ x_tile^T, W_tile [BLOCK_N, BLOCK_K] through the TMA (K % BLOCK_K == 0)."""
    pid = tl.program_id(0)
    off_n = pid * BLOCK_N
    offs_m = tl.arange(0, 16)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + offs_m[None, :] * stride_xm + offs_k[:, None]
    row_ok = offs_m[None, :] < M
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = w_desc.load([off_n, k0])
        x = tl.load(x_ptrs, mask=row_ok, other=0.0)
        acc = tl.dot(w, x, acc)
        x_ptrs += BLOCK_K
    offs_n = off_n + tl.arange(0, BLOCK_N)
    tl.store(Y + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(Y.dtype.element_ty),
             mask=row_ok & (offs_n[:, None] < N))


def tma_linear(x: torch.Tensor, w: torch.Tensor, cfg: tuple[int, int, int, int]) -> torch.Tensor:
    from triton.tools.tensor_descriptor import TensorDescriptor

    bn, bk, warps, stages = cfg
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    desc = TensorDescriptor.from_tensor(w, [bn, bk])
    _weight_left_tma[(triton.cdiv(n, bn),)](x, desc, y, m, n, k, x.stride(0), y.stride(0), BLOCK_N=bn, BLOCK_K=bk,
                                           num_warps=warps, num_stages=stages)
    return y


GRID = [(bn, bk, w, s) for bn in (64, 128) for bk in (128, 256) for w in (4, 8) for s in (3, 4, 6)
        if bn * bk * 2 * s <= 200 * 1024]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="4")
    args = ap.parse_args()
    side = torch.cuda.Stream()
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
              "lm_head": (128256, 4096)}
    res = {"device": device_name("cuda"), "commit": commit(), "command": "python " + " ".join(sys.argv),
           "note": "microseconds per call, CUDA-graph replays over weight copies worth twice the L2; down timed on "
                   "its activated input (no silu)", "rows": []}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        ws = tuning.weight_copies(w)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, w).float()
            row = {"linear": name, "m": m, "n": n, "k": k, "floor_us_3tbs": round(n * k * 2 / 3.0e12 * 1e6, 2),
                   "cublas": tuning.replayed_ms(lambda ww: F.linear(x, ww), ws, side) * 1e3}
            if m <= 2:
                g = sml.GEMV_CANDIDATES[m][0]
                row[f"gemv{tuple(g)}"] = tuning.replayed_ms(lambda ww: sml.small_m_linear(x, ww, None, g), ws, side) * 1e3
            inc = sml.TENSOR_CORE_INCUMBENT
            row[f"incumbent{tuple(inc)}"] = tuning.replayed_ms(lambda ww: sml.small_m_linear(x, ww, None, inc), ws,
                                                            side) * 1e3
            tma, errs = {}, {}
            for cfg in GRID:
                if n % cfg[0] or k % cfg[1]:
                    continue
                try:
                    err = ((tma_linear(x, w, cfg).float() - ref).abs().max() / ref.abs().max()).item()
                    tma[str(cfg)] = round(tuning.replayed_ms(lambda ww, c=cfg: tma_linear(x, ww, c), ws, side) * 1e3, 2)
                    errs[str(cfg)] = err
                except Exception as e:  # noqa: BLE001 - a config that does not compile is no result
                    torch.cuda.synchronize()
                    tma[str(cfg)] = f"{type(e).__name__}: {str(e)[:120]}"
            timed = {c: t for c, t in tma.items() if isinstance(t, float)}
            best = min(timed, key=timed.get) if timed else None
            row.update({kk: round(v, 2) for kk, v in row.items() if isinstance(v, float)})
            row.update({"tma_best": best, "tma_best_us": timed.get(best), "tma_worst_rel_err": max(errs.values(), default=None),
                        "tma": tma})
            res["rows"].append(row)
            print({kk: vv for kk, vv in row.items() if kk != "tma"}, flush=True)
            Path(args.out).with_suffix(".json").write_text(json.dumps(res, indent=1))
        del w, ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
