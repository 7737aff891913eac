"""Probe for a small-M linear kernel at 1-4 rows (a verify of a chain of 3 drafts runs 4 rows per request): two
candidate kernels over a grid of tiles, against cuBLAS and what ``workers.small_m_linear.tune`` picks today, each timed
as the tuner times it (``replayed_ms``), on the Llama-3.1-8B linear shapes.

- ``vec``: a GEMV whose weight tile is read as [BLOCK_N, BLOCK_K / 8, 8]: each thread multiplies 8 contiguous weights
  (one 16-byte load) by 8 inputs and sums them in its registers, so a row's accumulator is [BLOCK_N, BLOCK_K / 8]
  (8x smaller than the current GEMV's), summed across threads once after the loop. Up to 4 rows, one accumulator each.
- ``swap``: tensor cores with the weight as the left operand, acc[BLOCK_N, 16] = W_tile @ x_tile^T (rows padded to
  16), so BLOCK_N can be 64-128 (the left operand of Hopper's warp-group MMA is 64 rows).

    python bench/rows_probe.py OUT.json [--second]
    python bench/rows_probe.py --plot FIRST.json SECOND.json OUT.png   (4 rows: best of each family / floor)

``--second`` (4 rows only): the weight-left kernel on a wider grid with the down projection's silu(gate) * up run
first by its own kernel, the weight-left kernel split over K (each program writes an fp32 partial; the last of a column
block to arrive sums them), and the current rows-left kernel with longer K tiles.

Each kernel's output is compared with cuBLAS (relative Frobenius error) before it is timed.
"""
from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.kernels import small_m_linear as sml  # noqa: E402

from workers.kernels import tuning  # noqa: E402
from workers.kernels.norm_rope import silu_and_mul  # noqa: E402


@triton.jit
def _act(x, up, GATED: tl.constexpr):
    if GATED:
        g = x.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(x.dtype)
        x = (act.to(tl.float32) * up.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _row_chunk(ptrs, mask, K, GATED: tl.constexpr):
    x = tl.load(ptrs, mask=mask, other=0.0)
    if GATED:
        x = _act(x, tl.load(ptrs + K, mask=mask, other=0.0), GATED)
    return x.to(tl.float32)


@triton.jit
def _vec_gemv(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym, GATED: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    VEC: tl.constexpr = 8
    C: tl.constexpr = BLOCK_K // VEC
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k2 = tl.arange(0, C)[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [C, VEC]
    w_ptrs = W + offs_n.to(tl.int64)[:, None, None] * stride_wn + offs_k2[None, :, :]
    x_ptrs = X + offs_k2
    all_k = offs_k2 >= 0
    rows = offs_k2 * 0 + M  # masks are tensors (the interpreter's too)
    acc0 = tl.zeros((BLOCK_N, C), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, C), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, C), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, C), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(w_ptrs).to(tl.float32)
        acc0 += tl.sum(w * _row_chunk(x_ptrs, all_k, K, GATED)[None, :, :], axis=2)
        if BLOCK_M > 1:
            acc1 += tl.sum(w * _row_chunk(x_ptrs + stride_xm, rows > 1, K, GATED)[None, :, :], axis=2)
        if BLOCK_M > 2:
            acc2 += tl.sum(w * _row_chunk(x_ptrs + 2 * stride_xm, rows > 2, K, GATED)[None, :, :], axis=2)
            acc3 += tl.sum(w * _row_chunk(x_ptrs + 3 * stride_xm, rows > 3, K, GATED)[None, :, :], axis=2)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    tl.store(Y + offs_n, tl.sum(acc0, axis=1).to(Y.dtype.element_ty))
    if BLOCK_M > 1:
        tl.store(Y + stride_ym + offs_n, tl.sum(acc1, axis=1).to(Y.dtype.element_ty), mask=(offs_n * 0 + M) > 1)
    if BLOCK_M > 2:
        tl.store(Y + 2 * stride_ym + offs_n, tl.sum(acc2, axis=1).to(Y.dtype.element_ty), mask=(offs_n * 0 + M) > 2)
        tl.store(Y + 3 * stride_ym + offs_n, tl.sum(acc3, axis=1).to(Y.dtype.element_ty), mask=(offs_n * 0 + M) > 3)


@triton.jit
def _swap_dot(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym, GATED: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 16)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = X + offs_m[None, :] * stride_xm + offs_k[:, None]  # [BLOCK_K, 16]
    m_ok = offs_m[None, :] < M
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(w_ptrs)
        x = tl.load(x_ptrs, mask=m_ok, other=0.0)
        if GATED:
            x = _act(x, tl.load(x_ptrs + K, mask=m_ok, other=0.0), GATED)
        acc = tl.dot(w, x, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y_ptrs = Y + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_ok)


@triton.jit
def _swap_split(X, W, Y, P, Count, M, N, K, stride_xm, stride_wn, stride_ym,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    """``_swap_dot`` over 1/SPLIT of K per program; each writes its fp32 partial, and the last of a column block's
    SPLIT programs to arrive (an atomic counter, reset by it) sums them and stores the output."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 16)
    offs_k = tl.arange(0, BLOCK_K)
    k_len = K // SPLIT
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + (split * k_len + offs_k)[None, :]
    x_ptrs = X + offs_m[None, :] * stride_xm + (split * k_len + offs_k)[:, None]
    m_ok = offs_m[None, :] < M
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for k0 in range(0, k_len, BLOCK_K):
        acc = tl.dot(tl.load(w_ptrs), tl.load(x_ptrs, mask=m_ok, other=0.0), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    part = P + (split * N + offs_n)[:, None] * 16 + offs_m[None, :]
    tl.store(part, acc)
    tl.debug_barrier()
    arrived = tl.atomic_add(Count + pid, 1)
    if arrived == SPLIT - 1:
        for s in range(SPLIT):
            if s != split:
                acc += tl.load(P + (s * N + offs_n)[:, None] * 16 + offs_m[None, :], cache_modifier=".cg")
        tl.store(Y + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(Y.dtype.element_ty), mask=m_ok)
        tl.atomic_xchg(Count + pid, 0)


_SCRATCH = {}


def swap_split(x, w, cfg, gated):
    bn, bk, split, warps, stages = cfg
    if gated:
        x = silu_and_mul(x)
    m = x.shape[0]
    n, k = w.shape
    if k % (split * bk):
        raise ValueError("K not divisible")
    key = (n, split)
    if key not in _SCRATCH:
        _SCRATCH[key] = (torch.empty(split * n * 16, dtype=torch.float32, device=x.device),
                         torch.zeros(n // bn + 1, dtype=torch.int32, device=x.device))
    p, cnt = _SCRATCH[key]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _swap_split[(n // bn, split)](x, w, y, p, cnt, m, n, k, x.stride(0), w.stride(0), y.stride(0), BLOCK_N=bn,
                                  BLOCK_K=bk, SPLIT=split, num_warps=warps, num_stages=stages)
    return y


def swap_pre(x, w, cfg, gated):
    """``_swap_dot`` on silu(gate) * up computed first by its own kernel (gated) — as cuBLAS runs."""
    return swap_dot(silu_and_mul(x) if gated else x, w, cfg, False)


def rows_dot(x, w, cfg, gated):
    return sml.small_m_linear(x, w, None, sml.TileConfig(16, *cfg), gated)


def vec_gemv(x, w, cfg, gated):
    bm, bn, bk, warps, stages = cfg
    m = x.shape[0]
    n, k = w.shape
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _vec_gemv[(n // bn,)](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), GATED=gated, BLOCK_M=bm,
                          BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return y


def swap_dot(x, w, cfg, gated):
    bn, bk, warps, stages = cfg
    m = x.shape[0]
    n, k = w.shape
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _swap_dot[(n // bn,)](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), GATED=gated, BLOCK_N=bn,
                          BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return y


VEC_GRID = [c for c in itertools.product((8, 16, 32), (256, 512, 1024), (4, 8), (3,))]
SWAP_GRID = [c for c in itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (3,))]
# --second: the probe's second run (4 rows only): wider weight-left grid, pre-activated down, split K, and the
# current rows-left kernel with longer K tiles
SWAP2_GRID = [c for c in itertools.product((16, 32, 64), (256, 512), (2, 4), (2, 3, 4))]
SPLIT_GRID = [c for c in itertools.product((32, 64), (128, 256), (2, 4), (4,), (3,))]
ROWS_GRID = [c for c in itertools.product((16, 32), (512, 1024), (4, 8), (2, 3))]


def main():
    out_path = sys.argv[1]
    quick = "--quick" in sys.argv
    second = "--second" in sys.argv
    shapes = {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate_up": (28672, 4096, False),
              "down": (4096, 14336, True)}
    side = torch.cuda.Stream()
    res_all = {"device": torch.cuda.get_device_name(), "rows": []}
    t0 = time.time()
    for name, (n, k, gated) in shapes.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        ws = tuning.weight_copies(w)
        floor_us = n * k * 2 / 3.0e12 * 1e6
        for m in ((4,) if second else (1, 4)):
            x = torch.randn(m, k * (2 if gated else 1), dtype=torch.bfloat16, device="cuda")
            ref = F.linear(silu_and_mul(x) if gated else x, w).float()
            t = {"cublas": tuning.replayed_ms((lambda ww: F.linear(silu_and_mul(x), ww)) if gated
                                           else (lambda ww: F.linear(x, ww)), ws, side) * 1e3}
            for cfg in filter(None, sml.candidates(sml.row_bucket(m))):  # (None: cuBLAS, timed above)
                t[f"cur{tuple(cfg)}"] = tuning.replayed_ms(lambda ww, c=cfg: sml.small_m_linear(x, ww, None, c, gated),
                                                        ws, side) * 1e3
            errs = {}
            bm = 1 if m == 1 else 4
            grids = [("vec", (bm,) + c, vec_gemv) for c in VEC_GRID
                     if n % c[0] == 0 and k % c[1] == 0 and c[0] * c[1] // (32 * c[2]) <= 128]
            if m > 1 and not second:
                grids += [("swap", c, swap_dot) for c in SWAP_GRID if n % c[0] == 0 and k % c[1] == 0]
            if second:
                grids = ([("swap_pre", c, swap_pre) for c in SWAP2_GRID if n % c[0] == 0 and k % c[1] == 0]
                         + [("split", c, swap_split) for c in SPLIT_GRID if n % c[0] == 0 and k % (c[1] * c[2]) == 0]
                         + [("rows", c, rows_dot) for c in ROWS_GRID if n % c[0] == 0 and k % c[1] == 0])
            if quick:
                grids = grids[::6]
            for kind, cfg, fn in grids:
                key = f"{kind}{cfg}"
                try:
                    y = fn(x, w, cfg, gated).float()
                    errs[key] = float(((y - ref).norm() / ref.norm()).item())
                    t[key] = tuning.replayed_ms(lambda ww, c=cfg, f=fn: f(x, ww, c, gated), ws, side) * 1e3
                except Exception as e:  # noqa: BLE001 - a tile this GPU cannot run is not a candidate
                    torch.cuda.synchronize()
                    print(name, m, key, type(e).__name__, str(e)[:100], flush=True)
            best = sorted(t.items(), key=lambda kv: kv[1])

            def best_of(prefix):
                c = [(v, kk) for kk, v in t.items() if kk.startswith(prefix)]
                return (round(min(c)[0], 2), min(c)[1]) if c else None
            row = {"linear": name, "m": m, "n": n, "k": k, "gated": gated, "floor_us_at_3TBps": round(floor_us, 2),
                   "cublas_us": round(t["cublas"], 2), "current_best": best_of("cur"), "vec_best": best_of("vec"),
                   "swap_best": best_of("swap"), "swap_pre_best": best_of("swap_pre"),
                   "split_best": best_of("split"), "rows_best": best_of("rows"), "max_rel_err": max(errs.values()) if errs else None,
                   "top8": [(kk, round(v, 2)) for kk, v in best[:8]], "all_us": {kk: round(v, 2) for kk, v in t.items()}}
            print({kk: v for kk, v in row.items() if kk != "all_us"}, f"{time.time() - t0:.0f}s", flush=True)
            res_all["rows"].append(row)
        del ws, w
        torch.cuda.empty_cache()
        Path(out_path).write_text(json.dumps(res_all, indent=1))


def plot(first: str, second: str, out: str) -> None:
    """Bar chart at 4 rows: cuBLAS and the best of each kernel family, over the weight-read floor, per shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(Path(p).read_text()) for p in (first, second)]
    fams = [("cublas", "cuBLAS", 0), ("current_best", "rows left (current)", 0), ("vec_best", "8-wide GEMV", 0),
            ("swap_best", "weight left", 0), ("swap_pre_best", "weight left, silu first", 1),
            ("split_best", "weight left, split K", 1), ("rows_best", "rows left, long K", 1)]
    shapes = [r["linear"] for r in runs[0]["rows"] if r["m"] == 4]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(fams)
    for i, (key, label, run) in enumerate(fams):
        rows = {r["linear"]: r for r in runs[run]["rows"] if r["m"] == 4}
        vals = []
        for s in shapes:
            v = rows[s]["cublas_us"] if key == "cublas" else (rows[s].get(key) or [None])[0]
            vals.append(v / rows[s]["floor_us_at_3TBps"] if v else 0)
        ax.bar([j + (i - len(fams) / 2) * width for j in range(len(shapes))], vals, width=width, label=label)
    ax.axhline(1.0, color="gray", linestyle=":")
    ax.set_xticks(range(len(shapes)), [f"{s}{' (gated)' if s == 'down' else ''}" for s in shapes])
    ax.set_ylim(0.9, 2.0)
    ax.set_ylabel("time / weight-read floor (3.0 TB/s), 4 rows")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"{runs[0]['device']} · {runs[0]['commit']} / {runs[1]['commit']} · bars past 2.0 clipped", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    if sys.argv[1] == "--plot":
        plot(*sys.argv[2:5])
    else:
        main()
