"""Linear layers for few rows (decode and verify of small batches): ``y = x W^T (+ b)`` with x [M <= 16, K].

At M = 1..16 a linear layer only streams its weight from memory, and cuBLAS's kernels for these shapes reach 1.1-2.1x
the weight-read time on an H100 (bench/results/profile_decode_8b_h100.json). This module's Triton kernel streams W
once in [BLOCK_N, BLOCK_K] tiles, one program per BLOCK_N output columns, the M rows multiplied on the tensor cores
(rows padded to 16) or, for M = 1, as a broadcast multiply-sum.

Which kernel runs is measured, not guessed: the first time a (row bucket, N, K, dtype) is seen outside a CUDA-graph
capture, every candidate tile config and cuBLAS (``F.linear``) are timed on the real operands and the fastest is kept
for that key (``choices``). Under a capture an unseen key runs cuBLAS. Larger M, 32-bit dtypes and CPUs run
``F.linear``; Triton's CPU interpreter runs the kernel (the tests check it that way).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install without triton
    triton = None

_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
MAX_ROWS = 16


class TileConfig(NamedTuple):
    block_m: int  # 1: broadcast multiply-sum (M == 1 only); 16: tensor-core dot with rows padded to 16
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Candidates (timed per shape): few enough that tuning a model's handful of shapes costs seconds.
CANDIDATES = [TileConfig(16, bn, bk, w, s) for bn, bk, w, s in
              ((16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 4), (32, 128, 4, 5), (64, 128, 4, 4), (32, 256, 8, 3))]
CANDIDATES_M1 = [TileConfig(1, bn, bk, w, s) for bn, bk, w, s in ((16, 512, 4, 3), (32, 256, 4, 3), (8, 512, 2, 3))]
INTERPRETER_CONFIG = TileConfig(16, 16, 32, 4, 1)

#: (row bucket, N, K, dtype) → the chosen TileConfig, or None for cuBLAS
choices: dict[tuple, TileConfig | None] = {}


if triton is not None:

    @triton.jit
    def _small_m_linear(X, W, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                        HAS_BIAS: tl.constexpr, EVEN: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
        row_ok = offs_m[:, None] < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN:  # N % BLOCK_N == 0 and K % BLOCK_K == 0: unmasked weight loads
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs, mask=row_ok, other=0.0)
            else:
                k_ok = (k0 + offs_k) < K
                w = tl.load(w_ptrs, mask=(offs_n[:, None] < N) & k_ok[None, :], other=0.0)
                x = tl.load(x_ptrs, mask=row_ok & k_ok[None, :], other=0.0)
            if BLOCK_M == 1:
                acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
            else:
                acc = tl.dot(x, tl.trans(w), acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(Bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=row_ok & (offs_n[None, :] < N))


def small_m_linear(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: TileConfig) -> torch.Tensor:
    """The Triton kernel with one tile config: x2d [M <= 16, K] (unit stride in K), weight [N, K] contiguous."""
    m, k = x2d.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x2d.dtype, device=x2d.device)
    even = n % cfg.block_n == 0 and k % cfg.block_k == 0
    _small_m_linear[(triton.cdiv(n, cfg.block_n),)](
        x2d, weight, bias if bias is not None else weight, y, m, n, k, x2d.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, EVEN=even, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


def _row_bucket(m: int) -> int:
    return 1 if m == 1 else 2 if m == 2 else 4 if m <= 4 else 8 if m <= 8 else 16


def _choose(key: tuple, x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> TileConfig | None:
    """Time cuBLAS and every candidate on these operands (outside any capture); keep the fastest."""
    from triton.testing import do_bench

    cands: list[TileConfig | None] = [None] + (CANDIDATES_M1 if x2d.shape[0] == 1 else []) + CANDIDATES
    times = []
    for cfg in cands:
        fn = (lambda: F.linear(x2d, weight, bias)) if cfg is None else (lambda c=cfg: small_m_linear(x2d, weight,
                                                                                                      bias, c))
        times.append(do_bench(fn, warmup=5, rep=20))
    return cands[min(range(len(cands)), key=times.__getitem__)]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with the small-M Triton kernel where it was measured faster (see the module docstring)."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if triton is None or not 0 < m <= MAX_ROWS or not weight.is_contiguous():
        return F.linear(x, weight, bias)
    if _INTERPRETER and not x.is_cuda:
        cfg = INTERPRETER_CONFIG
    elif not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return F.linear(x, weight, bias)
    else:
        key = (_row_bucket(m), weight.shape[0], k, x.dtype)
        if key not in choices:
            if torch.cuda.is_current_stream_capturing():
                return F.linear(x, weight, bias)
            choices[key] = _choose(key, x.reshape(m, k), weight, bias)
        cfg = choices[key]
        if cfg is None:
            return F.linear(x, weight, bias)
    x2d = x.reshape(m, k)
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    return small_m_linear(x2d, weight, bias, cfg).view(*x.shape[:-1], weight.shape[0])
