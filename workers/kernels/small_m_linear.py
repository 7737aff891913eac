"""Linear layers for few rows (decode and verify of small batches): ``y = x W^T (+ b)`` with x [M <= 16, K].

At M = 1..16 a linear layer only streams its weight from memory, and cuBLAS's kernels for the Llama-3.1-8B shapes
take 1.06-1.52x the weight-read time on an H100 as a decode step runs them (bench/results/linears_8b_h100.md). This
module's Triton kernels stream W once in [BLOCK_N, BLOCK_K] tiles, one program per BLOCK_N output columns, the M
rows multiplied on the tensor cores (rows padded to 16) or, for M <= 2, as a GEMV: each row's products added into
its own [BLOCK_N, BLOCK_K] accumulator, summed once after the loop (narrow column blocks, 1-2 KB of each weight row
per load, no reduction in the loop). On the tensor cores either operand order is a candidate: rows on the left
(acc [16, BLOCK_N]) or the weight tile on the left (acc [BLOCK_N, 16]); at the 4 rows of a chain's verify the latter
was the faster on every Llama-3.1-8B shape on an H100 (bench/results/rows_probe_h100.md).
With 3-4 rows the same GEMV (tried: a [4, BLOCK_N, BLOCK_K] accumulator, four of [BLOCK_N, BLOCK_K], and one
summing 8-wide products in registers) was slower than the tensor-core tiles on an H100 (bench/results/gemv_h100.md,
rows_probe_h100.md).

Which kernel runs is measured once, at start-up, not guessed and not on the serving path: ``tune_small_m_linears``
times cuBLAS (``F.linear``) and every candidate tile config on each layer's real weight for each row bucket, as CUDA
graph replays of back-to-back calls, each after a short PDL kernel (``replayed_ms``, ``_fastest``: how a decode step
runs them) in the order of ``candidates`` (an incumbent first; a later kernel must be SWITCH_MARGIN faster), and
stores the winner in that layer's ``small_m`` table (row bucket → TileConfig, or None for cuBLAS). ``linear`` only
reads the table: a bucket that was not tuned (CPU, fp32, a replicated draft under TP, where every rank must run the
very same kernel) runs ``F.linear``. An MLP's [gate; up] layer also gets a ``small_m_act`` table (``tune_activated``): a
weight-left tile writing silu(gate) * up in its epilogue, where that beats the layer's own kernel followed by the
silu_and_mul kernel; the MLP takes it where the down projection's kernel would run silu_and_mul first
(``activated_config``).

Timings are noisy, and kernels round differently, so two starts that chose differently would give different bf16
tokens for the same greedy request. A ``TuningCache`` file keeps each choice per GPU model and software versions:
later starts (restarts, other replicas sharing the file) read it and time nothing, so they run the same kernels.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from workers.kernels.launch import (
    l2_prefetch_bytes,
    pdl_launch,
    pdl_launches,
    pdl_supported,
)
from workers.kernels.norm_rope import rms_norm, silu_and_mul

try:
    import triton
    import triton.language as tl

    from workers.kernels.launch import gdc_wait, pdl_release, prefetch_to_l2
except ImportError:  # CPU-only install without triton
    triton = None

logger = logging.getLogger(__name__)

MAX_ROWS = 16


class TileConfig(NamedTuple):
    block_m: int  # 1, 2: GEMV, broadcast multiply-add (M <= block_m); 16: tensor-core dot, rows padded to 16
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    # tensor cores only: the weight tile is the dot's left operand (acc [BLOCK_N, 16]); a gated input is activated
    # by norm_rope.silu_and_mul first (in this kernel's loads it would run on all 16 padded rows of every tile)
    weight_left: bool = False


# Candidates (timed per shape): few enough that tuning a model's handful of shapes costs seconds. Tensor cores with
# the rows on the left, then with the weight on the left (the best tiles at 4 rows on the Llama-3.1-8B shapes on an
# H100, bench/results/rows_probe_h100.md).
CANDIDATES = ([TileConfig(16, bn, bk, w, s) for bn, bk, w, s in
               ((16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 4), (32, 128, 4, 5), (64, 128, 4, 4), (32, 256, 8, 3))]
              + [TileConfig(16, bn, bk, w, s, weight_left=True) for bn, bk, w, s in
                 ((64, 256, 4, 4), (64, 256, 4, 3), (32, 256, 2, 2), (32, 256, 4, 2), (16, 512, 2, 3),
                  (32, 512, 2, 3))])
# weight on the left writing silu(gate) * up: block_n weight rows per tile, the gate and up rows of half as many
# output columns (the weight-left tiles above, and one with a shorter K step)
ACTIVATED_CANDIDATES = [TileConfig(16, bn, bk, w, s, weight_left=True) for bn, bk, w, s in
                        ((64, 256, 4, 4), (64, 256, 4, 3), (32, 256, 2, 2), (32, 256, 4, 2), (32, 512, 2, 3),
                         (64, 128, 4, 4))]
# GEMV tiles for 1 and 2 rows: M = 1, the best of a sweep over the Llama-3.2-1B / 3.1-8B shapes on an H100
# (bench/results/gemv_h100.md); 2 rows, the same narrow tiles
GEMV_CANDIDATES = {
    1: [TileConfig(1, bn, bk, w, s) for bn, bk, w, s in
        ((8, 1024, 4, 3), (8, 1024, 8, 3), (8, 1024, 4, 2), (8, 1024, 8, 2), (8, 512, 8, 3), (16, 1024, 8, 3))],
    2: [TileConfig(2, bn, bk, w, s) for bn, bk, w, s in
        ((8, 1024, 4, 3), (8, 1024, 8, 3), (8, 512, 4, 3), (16, 512, 8, 3))],
}


# From 2 rows on, the first candidate timed, which the others (cuBLAS included) must beat by SWITCH_MARGIN: the
# weight-left tile that was the fastest or within 1% of it on every Llama-3.1-8B shape at 2 and 4 rows on an H100
# (rows_probe_h100.md, linears_8b_h100.md, tma_probe_h100.json). With cuBLAS as the incumbent, starts kept it (or
# another tile) by less than the margin on some machines and not on others: gate/up at 4 rows 82.6-87.5 us against
# this tile's 80.6, an EAGLE-3 chain-of-3 round 7.19 against 6.98 ms (speculation_incumbent_h100.md).
TENSOR_CORE_INCUMBENT = TileConfig(16, 64, 256, 4, 4, weight_left=True)
TENSOR_CORE_INCUMBENT_ROWS = 2


def candidates(rows: int) -> list[TileConfig | None]:
    """What a row bucket times, in order (None: cuBLAS): the incumbent first, each later one chosen only when
    SWITCH_MARGIN faster than the best before it. One row: cuBLAS, the GEMV's tiles, the tensor-core ones; from
    TENSOR_CORE_INCUMBENT_ROWS on, TENSOR_CORE_INCUMBENT, cuBLAS, the GEMV's tiles (2 rows), the other tensor-core
    tiles."""
    if rows >= TENSOR_CORE_INCUMBENT_ROWS:
        return ([TENSOR_CORE_INCUMBENT, None] + GEMV_CANDIDATES.get(rows, [])
                + [c for c in CANDIDATES if c != TENSOR_CORE_INCUMBENT])
    return [None] + GEMV_CANDIDATES.get(rows, []) + CANDIDATES

ROW_BUCKETS = (1, 2, 4, 8, 16)
# A tensor-core linear that adds the residual stream (o, down: the kernels before a normalising q/k/v or gate/up when
# a layer's norms are fused) lets the next kernel start this many weight steps before its loop ends, not after it:
# without the norm kernel between them, the next linear's L2 prefetch had only this one's epilogue to overlap (8B
# verify forward, norm_fold_round_h100.md: the normalising linears 4.2 us a layer slower in place, 1.6 standing
# alone). The one-row GEMV keeps releasing after its loop: released early on every tile, the 8B bs=1 step took 5.67 ms
# at 2 steps (main 5.54), and at 4 steps no-spec fell from 182 to 175 tok/s while the EAGLE-3 round got faster (457
# against 451); on the tensor-core tiles only, 4 steps: EAGLE-3 2.516x no-spec, 8: 2.502x
# (bench/results/norms_in_linears_landed_h100.md).
RELEASE_STEPS_AHEAD = 4
# A later candidate must be this much faster than the best before it to be chosen: kernels of nearly the same speed
# then resolve the same way on every start, so replicas and restarts mostly run the same kernels and round alike
# (timings stay noisy: this narrows run-to-run differences, it cannot rule them out).
SWITCH_MARGIN = 0.03


if triton is not None:

    @triton.jit
    def _pdl_enter_linear(row_ptrs, nbytes, PDL: tl.constexpr):
        """A linear kernel's start under PDL: its first weight tile (``nbytes`` of each of its rows) on its way to L2
        while the previous kernel still runs, then the wait for that kernel's results."""
        if PDL:
            prefetch_to_l2(row_ptrs, nbytes)
            gdc_wait()

    @triton.jit
    def _silu_times(gate, up):
        """silu(gate) * up of two tiles in their 16-bit dtype, rounded as norm_rope.silu_and_mul rounds."""
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)

    @triton.jit
    def _input_chunk(ptrs, mask, K, GATED: tl.constexpr):
        """A tile of the input (either kernel), in its dtype; GATED: each row is [gate | up] and the input
        silu(gate) * up."""
        x = tl.load(ptrs, mask=mask, other=0.0)
        if GATED:
            x = _silu_times(x, tl.load(ptrs + K, mask=mask, other=0.0))
        return x

    @triton.jit
    def _sum_squares(x, sq):
        """A NORM_IN kernel's squares ``sq`` (the input tile's shape, fp32) with those of an input tile ``x``
        added, element by element: summed over K once after the loop, since a reduction across threads in every
        step would hold up the weight stream (measured: 0.7 us more per 4-row kernel on an H100)."""
        x = x.to(tl.float32)
        return sq + x * x

    @triton.jit
    def _inv_rms(sq, K, eps):
        return 1.0 / tl.sqrt(sq / K + eps)

    @triton.jit
    def _stream_tile(add_ptrs, mask, ADD: tl.constexpr):
        """ADD: the residual stream's tile for the output's epilogue, in fp32, loaded before the weight loop (its
        latency hidden behind the loop, not added after it; under PDL after the wait, as the stream is an earlier
        kernel's output); else 0."""
        if ADD:
            return tl.load(add_ptrs, mask=mask, other=0.0).to(tl.float32)
        else:
            return 0.0

    @triton.jit
    def _plus_stream(out, stream, ADD: tl.constexpr):
        """An output tile in its dtype; ADD: plus the residual stream's tile (``_stream_tile``), rounded once
        more (as norm_rope.rms_norm rounds its residual add)."""
        if ADD:
            out = (out.to(tl.float32) + stream).to(out.dtype)
        return out

    @triton.jit
    def _release_ahead(k0, K, BLOCK_K: tl.constexpr, PDL: tl.constexpr, AHEAD: tl.constexpr):
        """Under PDL with AHEAD > 0: let the next kernel's programs start AHEAD weight steps before this program's
        loop ends (``RELEASE_STEPS_AHEAD``) instead of after it, so that its prologue's L2 prefetch overlaps this
        kernel's last steps. Safe at any point: the next kernel still waits for this one to finish."""
        if PDL and AHEAD > 0:
            if k0 == tl.maximum(tl.cdiv(K, BLOCK_K) - 1 - AHEAD, 0) * BLOCK_K:
                pdl_release(PDL)

    @triton.jit
    def _gemv(X, W, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym, prefetch_bytes, Add, stride_am, eps,
              HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, GATED: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_IN: tl.constexpr,
              ADD: tl.constexpr, PDL: tl.constexpr = False, RELEASE_AHEAD: tl.constexpr = 0):
        """One or two rows (BLOCK_M 1 or 2): each row's products with the [BLOCK_N, BLOCK_K] weight tile added
        into its own accumulator of that shape, summed over K once after the loop. NORM_IN and ADD:
        ``small_m_linear``."""
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        _pdl_enter_linear(W + offs_n.to(tl.int64) * stride_wn, tl.where(offs_n < N, prefetch_bytes, 0), PDL)
        x_ptrs = X + offs_k
        second_row = offs_k * 0 + M > 1  # a vector: the interpreter's masks are tensors
        n_ok = offs_n < N
        ok1 = n_ok & (offs_n * 0 + M > 1)
        stream0 = _stream_tile(Add + offs_n, n_ok, ADD)
        stream1 = _stream_tile(Add + stride_am + offs_n, ok1, ADD and BLOCK_M > 1)
        acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_N, BLOCK_K) if BLOCK_M > 1 else (1, 1), dtype=tl.float32)
        sq0 = tl.zeros((BLOCK_K,) if NORM_IN else (1,), dtype=tl.float32)  # the rows' squares (_sum_squares)
        sq1 = tl.zeros((BLOCK_K,) if NORM_IN and BLOCK_M > 1 else (1,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            _release_ahead(k0, K, BLOCK_K, PDL, RELEASE_AHEAD)
            if EVEN:  # N % BLOCK_N == 0 and K % BLOCK_K == 0: unmasked weight loads
                w = tl.load(w_ptrs).to(tl.float32)
                k_ok = offs_k < BLOCK_K
            else:
                k_ok = (k0 + offs_k) < K
                w = tl.load(w_ptrs, mask=(offs_n[:, None] < N) & k_ok[None, :], other=0.0).to(tl.float32)
            x0 = _input_chunk(x_ptrs, k_ok, K, GATED).to(tl.float32)
            if NORM_IN:
                sq0 = _sum_squares(x0, sq0)
            acc0 += w * x0[None, :]
            if BLOCK_M > 1:
                x1 = _input_chunk(x_ptrs + stride_xm, k_ok & second_row, K, GATED).to(tl.float32)
                if NORM_IN:
                    sq1 = _sum_squares(x1, sq1)
                acc1 += w * x1[None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if RELEASE_AHEAD == 0:
            pdl_release(PDL)
        bias = tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32) if HAS_BIAS else 0.0
        y0 = tl.sum(acc0, axis=1)
        if NORM_IN:
            y0 = y0 * _inv_rms(tl.sum(sq0, 0), K, eps)
        tl.store(Y + offs_n, _plus_stream((y0 + bias).to(Y.dtype.element_ty), stream0, ADD), mask=n_ok)
        if BLOCK_M > 1:
            y1 = tl.sum(acc1, axis=1)
            if NORM_IN:
                y1 = y1 * _inv_rms(tl.sum(sq1, 0), K, eps)
            tl.store(Y + stride_ym + offs_n, _plus_stream((y1 + bias).to(Y.dtype.element_ty), stream1, ADD), mask=ok1)

    @triton.jit
    def _small_m_linear(X, W, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym, prefetch_bytes, Add, stride_am, eps,
                        HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, GATED: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_IN: tl.constexpr,
                        ADD: tl.constexpr, PDL: tl.constexpr = False, RELEASE_AHEAD: tl.constexpr = 0):
        """Up to BLOCK_M = 16 rows on the tensor cores (rows padded to 16). NORM_IN and ADD: ``small_m_linear``."""
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        _pdl_enter_linear(W + offs_n.to(tl.int64) * stride_wn, tl.where(offs_n < N, prefetch_bytes, 0), PDL)
        x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
        row_ok = offs_m[:, None] < M
        ok = row_ok & (offs_n[None, :] < N)
        stream = _stream_tile(Add + offs_m[:, None] * stride_am + offs_n[None, :], ok, ADD)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        sq = tl.zeros((BLOCK_M, BLOCK_K) if NORM_IN else (1, 1), dtype=tl.float32)  # _sum_squares
        for k0 in range(0, K, BLOCK_K):
            _release_ahead(k0, K, BLOCK_K, PDL, RELEASE_AHEAD)
            if EVEN:  # N % BLOCK_N == 0 and K % BLOCK_K == 0: unmasked weight loads
                w = tl.load(w_ptrs)
                x_ok = row_ok
            else:
                k_ok = (k0 + offs_k) < K
                w = tl.load(w_ptrs, mask=(offs_n[:, None] < N) & k_ok[None, :], other=0.0)
                x_ok = row_ok & k_ok[None, :]
            x = _input_chunk(x_ptrs, x_ok, K, GATED)
            if NORM_IN:
                sq = _sum_squares(x, sq)
            acc = tl.dot(x, tl.trans(w), acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if RELEASE_AHEAD == 0:
            pdl_release(PDL)
        if NORM_IN:
            acc = acc * _inv_rms(tl.sum(sq, axis=1), K, eps)[:, None]
        if HAS_BIAS:
            acc += tl.load(Bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        out = _plus_stream(acc.to(Y.dtype.element_ty), stream, ADD)
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], out, mask=ok)

    @triton.jit
    def _weight_left_dot(X, W, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym, prefetch_bytes, Add, stride_am, eps,
                         HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, ACTIVATED: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_IN: tl.constexpr, ADD: tl.constexpr,
                         PDL: tl.constexpr = False, RELEASE_AHEAD: tl.constexpr = 0):
        """Up to 16 rows on the tensor cores, the weight tile on the left: acc [BLOCK_N, 16] += W_tile @ x_tile^T.
        ACTIVATED: W is [gate; up] (2N rows) and the output silu(gate) * up [M, N]: the tile's BLOCK_N weight rows
        are its BLOCK_N / 2 columns' gate and up rows, interleaved (one load, one dot: as fast as a plain tile of
        BLOCK_N rows), split apart in the epilogue and rounded as the two-kernel path rounds. NORM_IN and ADD:
        ``small_m_linear``."""
        pid = tl.program_id(0)
        COLS: tl.constexpr = BLOCK_N // 2 if ACTIVATED else BLOCK_N  # output columns per program
        r = tl.arange(0, BLOCK_N)
        if ACTIVATED:  # tile row 2j: gate row of column j, 2j + 1: its up row, N rows further
            col = pid * COLS + r // 2
            w_rows = col + (r % 2) * N
        else:
            col = pid * COLS + r
            w_rows = col
        offs_m = tl.arange(0, 16)
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = W + w_rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        _pdl_enter_linear(W + w_rows.to(tl.int64) * stride_wn, tl.where(col < N, prefetch_bytes, 0), PDL)
        x_ptrs = X + offs_m[None, :] * stride_xm + offs_k[:, None]  # [BLOCK_K, 16]: the rows as columns
        row_ok = offs_m[None, :] < M
        offs_n = pid * COLS + tl.arange(0, COLS)
        ok = row_ok & (offs_n[:, None] < N)
        stream = _stream_tile(Add + offs_m[None, :] * stride_am + offs_n[:, None], ok, ADD)
        acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
        sq = tl.zeros((BLOCK_K, 16) if NORM_IN else (1, 1), dtype=tl.float32)  # _sum_squares
        for k0 in range(0, K, BLOCK_K):
            _release_ahead(k0, K, BLOCK_K, PDL, RELEASE_AHEAD)
            if EVEN:  # N % COLS == 0 and K % BLOCK_K == 0: unmasked weight loads
                w = tl.load(w_ptrs)
                x_ok = row_ok
            else:
                k_ok = (k0 + offs_k) < K
                w = tl.load(w_ptrs, mask=(col[:, None] < N) & k_ok[None, :], other=0.0)
                x_ok = row_ok & k_ok[:, None]
            x = tl.load(x_ptrs, mask=x_ok, other=0.0)
            if NORM_IN:
                sq = _sum_squares(x, sq)
            acc = tl.dot(w, x, acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if RELEASE_AHEAD == 0:
            pdl_release(PDL)
        if NORM_IN:
            acc = acc * _inv_rms(tl.sum(sq, axis=0), K, eps)[None, :]
        if HAS_BIAS:
            acc += tl.load(Bias + w_rows, mask=col < N, other=0.0).to(tl.float32)[:, None]
        if ACTIVATED:  # [COLS, 2, 16] → [COLS, 16, 2] → gate, up; on the 16-bit values, as the two-kernel path
            gate, up = tl.split(tl.permute(tl.reshape(acc, (COLS, 2, 16)), (0, 2, 1)))
            out = _silu_times(gate.to(Y.dtype.element_ty), up.to(Y.dtype.element_ty))
        else:
            out = acc.to(Y.dtype.element_ty)
        out = _plus_stream(out, stream, ADD)
        tl.store(Y + offs_m[None, :] * stride_ym + offs_n[:, None], out, mask=ok)


def small_m_linear(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: TileConfig,
                   gated: bool = False, activated: bool = False,
                   norm_eps: float | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel of one tile config (the GEMV for block_m 1-2, else a tensor-core one, rows or weight on the
    left): x2d [M <= 16, K] (unit stride in K; M <= block_m), weight [N, K] contiguous.
    ``gated``: x2d is [M, 2K] (gate | up) and the input is silu(gate) * up, computed as it is loaded (weight on the
    left: by norm_rope.silu_and_mul first). ``activated`` (weight on the left only): weight is [gate; up] [2N, K]
    and the output silu(gate) * up [M, N], in the kernel's epilogue.
    ``norm_eps``: the input is RMS-normalised without a weight (``fold_norm_weight`` put the norm's weight in this
    one): each row's sum of squares is taken from the kernel's own input loads and 1 / rms applied to the row's
    result (no norm kernel before it). ``add`` [M, N]: the output is y + add, rounded as the add + norm kernel
    rounds its residual add (a residual stream's next value, no add kernel after it)."""
    m, k = x2d.shape
    if m > cfg.block_m and cfg.block_m < MAX_ROWS:
        raise ValueError(f"the GEMV tile {cfg} takes at most {cfg.block_m} rows, not {m}")
    if activated and not cfg.weight_left:
        raise ValueError(f"only a weight-left tile writes an activated output, not {cfg}")
    if norm_eps is not None and gated:
        raise ValueError("a gated input (silu(gate) * up) is not normalised")
    if gated:
        k //= 2
        if cfg.weight_left:
            x2d, gated = silu_and_mul(x2d), False
    n = weight.shape[0] // (2 if activated else 1)
    if add is not None and (add.shape != (m, n) or add.stride(1) != 1):
        raise ValueError(f"add= is [{m}, {n}] with unit column stride, not {tuple(add.shape)}")
    cols = cfg.block_n // 2 if activated else cfg.block_n  # output columns per program
    y = torch.empty(m, n, dtype=x2d.dtype, device=x2d.device)
    even = n % cols == 0 and k % cfg.block_k == 0
    pdl = pdl_launch(x2d)
    args = (x2d, weight, bias if bias is not None else weight, y, m, n, k, x2d.stride(0), weight.stride(0),
            y.stride(0), l2_prefetch_bytes(weight, cfg.block_k) if pdl else 0,
            y if add is None else add, 0 if add is None else add.stride(0), norm_eps or 0.0)
    grid = (triton.cdiv(n, cols),)
    tensor_cores = cfg.weight_left or cfg.block_m >= MAX_ROWS
    release_ahead = RELEASE_STEPS_AHEAD if add is not None and tensor_cores else 0
    launch = dict(HAS_BIAS=bias is not None, EVEN=even, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  NORM_IN=norm_eps is not None, ADD=add is not None, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages, RELEASE_AHEAD=release_ahead, **pdl)
    if cfg.weight_left:
        _weight_left_dot[grid](*args, ACTIVATED=activated, **launch)
    else:
        (_gemv if cfg.block_m < MAX_ROWS else _small_m_linear)[grid](*args, GATED=gated, BLOCK_M=cfg.block_m,
                                                                       **launch)
    return y


def row_bucket(m: int) -> int:
    """The tuned row count M rows run under (the smallest bucket >= m)."""
    return next(b for b in ROW_BUCKETS if b >= m)


def weight_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """The weight and as many copies as it takes for all of them to be twice the GPU's L2 cache (at most 256), so
    that timed calls cycling over them stream their weight from memory, as every layer of a decode step does."""
    l2 = getattr(torch.cuda.get_device_properties(weight.device), "L2_cache_size", 0) or 50 << 20
    n = min(256, max(1, -(-2 * l2 // (weight.numel() * weight.element_size()))))
    return [weight] + [weight.clone() for _ in range(n - 1)]


def replayed_ms(call, weights: list[torch.Tensor], side: torch.cuda.Stream, min_calls: int = 8,
                replays: int = 5, between=None) -> float:
    """Milliseconds per ``call(weight)`` as a decode step runs it: captured in a CUDA graph as back-to-back calls
    cycling over ``weights`` (no launch gaps, a cold weight each time, the next kernel queued behind), the median
    over replays. Isolated timings (``do_bench``: one call after an L2 flush) add several microseconds of dirty
    L2 write-back and launch latency to each call, enough to rank kernels of a few tens of microseconds wrongly.
    ``between()``: launched before each call (its time is part of the result)."""
    import statistics

    from workers.graphs import capturing

    calls = max(min_calls, len(weights))
    side.wait_stream(torch.cuda.current_stream())
    with pdl_launches(), torch.cuda.stream(side):  # compile and warm up outside the capture (PDL: as in graphs)
        for w in weights:
            if between is not None:
                between()
            call(w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: as GraphRunner.capture, another thread's CUDA calls (the NCCL watchdog under TP) must not
    # invalidate the capture
    with pdl_launches(), capturing(graph, capture_error_mode="thread_local"):
        for i in range(calls):
            if between is not None:
                between()
            call(weights[i % len(weights)])
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


def pdl_neighbour(weight: torch.Tensor):
    """A short Triton kernel launched with PDL, like those around a linear in a layer (its RMS norm, RoPE, the
    attention merge): an RMS norm of one row as wide as ``weight``'s input."""
    x = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
    gamma, out = torch.ones_like(x[0]), torch.empty_like(x)
    return lambda: rms_norm(x, gamma, 1e-6, out=out)


def _fastest(weights: list[torch.Tensor], side: torch.cuda.Stream, runs) -> TileConfig | None:
    """Of ``runs`` [(choice, call(weight))] in order, the choice timed fastest (``replayed_ms``), each later one
    taken only when it beats the best before it by SWITCH_MARGIN. A candidate that fails to compile or launch (e.g.
    too much shared memory on this GPU) is simply not a candidate.

    Each call is timed after a short PDL kernel (``pdl_neighbour``), less that kernel's own time: in a layer a
    linear starts after, and is followed by, such kernels, and a Triton kernel meets them under PDL (each starts
    while the one before it ends) where a cuBLAS one waits at both ends. Timed back to back among themselves, the
    1B gate/up's one-row kernels came out about 1 us (4%) apart, the rows-left tile ahead of cuBLAS, and fresh
    starts still kept cuBLAS (the incumbent, within the margin) on 3 of 5; in the model, cuBLAS made the step 36 us
    (2.3 us a layer) slower than the tile (bench/results/tuner_neighbours_h100.md)."""
    neighbour = pdl_neighbour(weights[0])
    alone = replayed_ms(lambda w: None, weights, side, between=neighbour)
    best, best_ms = None, float("inf")
    for choice, call in runs:
        try:
            ms = replayed_ms(call, weights, side, between=neighbour) - alone
        except Exception:  # noqa: BLE001
            torch.cuda.synchronize()
            continue
        if ms < best_ms * (1 - SWITCH_MARGIN):
            best, best_ms = choice, ms
    return best


def tune(weight: torch.Tensor, bias: torch.Tensor | None, rows: int, gated: bool = False,
         side: torch.cuda.Stream | None = None) -> TileConfig | None:
    """Time cuBLAS and every candidate tile config at ``rows`` rows on this weight (``replayed_ms``), in the order
    of ``candidates``; the fastest (None: cuBLAS). ``gated`` layers are timed as they run: cuBLAS after the
    separate silu_and_mul kernel, Triton with it fused. ``side``: the stream warm-ups run on (one for a whole
    tuning: PyTorch keeps a cuBLAS workspace of tens of MB per stream, which must not pile up before the KV cache
    is sized)."""
    x = torch.randn(rows, weight.shape[1] * (2 if gated else 1), dtype=weight.dtype, device=weight.device)
    cublas = (lambda w: F.linear(silu_and_mul(x), w, bias)) if gated else (lambda w: F.linear(x, w, bias))
    runs = [(c, cublas if c is None else lambda w, c=c: small_m_linear(x, w, bias, c, gated)) for c in candidates(rows)]
    return _fastest(weight_copies(weight), side or torch.cuda.Stream(weight.device), runs)


def tune_activated(weight: torch.Tensor, bias: torch.Tensor | None, rows: int, plain: TileConfig | None,
                   side: torch.cuda.Stream | None = None) -> TileConfig | None:
    """For a [gate; up] weight: the tile that writes silu(gate) * up at ``rows`` rows (None: the layer's own kernel
    for them, ``plain`` (None: cuBLAS), followed by the silu_and_mul kernel). A weight-left ``plain`` tile's own
    activated form is the incumbent (the same weight stream, one kernel less), then the two kernels, then the
    ACTIVATED_CANDIDATES."""
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    own = [plain] if plain is not None and plain.weight_left else []
    runs = [(c, lambda w, c=c: small_m_linear(x, w, bias, c, activated=True)) for c in own]
    runs.append((None, lambda w: silu_and_mul(linear(x, w, bias, {rows: plain}))))
    runs += [(c, lambda w, c=c: small_m_linear(x, w, bias, c, activated=True))
             for c in ACTIVATED_CANDIDATES if c not in own]
    return _fastest(weight_copies(weight), side or torch.cuda.Stream(weight.device), runs)


class TuningCache:
    """The tuned choices, in a JSON file shared by every start on this machine (or volume):
    ``{environment: {shape key: {row bucket: [tile config] | null (cuBLAS)}}}``, and yes / no choices
    (``put_choice``) under their own keys. The environment names the GPU model
    and the torch and triton versions, whose kernels were timed. Saving merges with what the file holds by then and
    replaces it atomically, so concurrent starts (TP ranks, replicas) never leave it half written; an unreadable
    file is logged, timed afresh and replaced by the next save."""

    def __init__(self, path: str | os.PathLike, environment: str):
        self.path = Path(path)
        self.environment = environment
        self._entries: dict[str, dict[str, list[int] | None] | bool] = self._read().get(environment, {})
        self._new: dict[str, dict[str, list[int] | None] | bool] = {}

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            return data
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            logger.warning("small-M tuning cache %s is unreadable (%s): tuning afresh", self.path, e)
            return {}

    def get(self, key: str) -> dict[int, TileConfig | None] | None:
        """The row bucket → kernel table stored for this shape key, or None when any bucket is missing."""
        entry = self._entries.get(key)
        if entry is None or any(str(rows) not in entry for rows in ROW_BUCKETS):
            return None
        try:
            return {rows: None if entry[str(rows)] is None else TileConfig(*entry[str(rows)]) for rows in ROW_BUCKETS}
        except TypeError:  # a config of another shape (an older file): time it again
            return None

    def put(self, key: str, table: dict[int, TileConfig | None]) -> None:
        entry = {str(rows): None if cfg is None else list(cfg) for rows, cfg in table.items()}
        self._entries[key] = self._new[key] = entry

    def get_choice(self, key: str) -> bool | None:
        """A yes / no choice stored under ``key`` (``put_choice``), or None."""
        value = self._entries.get(key)
        return value if isinstance(value, bool) else None

    def put_choice(self, key: str, value: bool) -> None:
        """A yes / no choice timed once, such as whether a batch bucket's graphs run the norms inside the linears
        (``DecodeGraphs._capture``), so that later starts make the same one."""
        self._entries[key] = self._new[key] = value

    def save(self) -> None:
        """Write the entries tuned since loading (nothing when none was); errors are logged, not raised."""
        if not self._new:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            data = self._read()
            data.setdefault(self.environment, {}).update(self._new)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
            self._new = {}
        except OSError as e:
            logger.warning("small-M tuning cache %s not written: %s", self.path, e)


# part of the cache's environment: choices timed another way are timed again
TIMING_METHOD = "graph replays after a PDL kernel"


def candidates_digest() -> str:
    """A short digest of every tile config the tuner times, in its order: choices made among other candidates or in
    another order (an older release's file) are timed again rather than kept."""
    timed = [candidates(rows) for rows in ROW_BUCKETS]  # in order: the incumbents matter too
    # (an activated tile's block_n counts its interleaved gate and up rows; the plain tile's own form goes first)
    activated = ("interleaved, own first", ACTIVATED_CANDIDATES)
    return hashlib.sha1(repr((timed, activated)).encode()).hexdigest()[:8]


def tuning_environment(device: torch.device) -> str:
    """What a timing depends on besides the shape: the GPU model, the torch / triton builds, how it was timed and
    among which candidates, whether the kernels launch with PDL."""
    pdl = " | pdl" if pdl_supported(device) else ""
    return (f"{torch.cuda.get_device_name(device)} | torch {torch.__version__} | triton {triton.__version__} | "
            f"{TIMING_METHOD} | candidates {candidates_digest()}{pdl}")


def shape_key(weight: torch.Tensor, has_bias: bool, gated: bool) -> str:
    n, k = weight.shape
    return f"{n}x{k} {str(weight.dtype).removeprefix('torch.')}{' bias' if has_bias else ''}{' gated' if gated else ''}"


def tune_small_m_linears(model: torch.nn.Module, cache: TuningCache | None = None) -> int:
    """Fill the ``small_m`` table of every layer of ``model`` that has one, for every row bucket (CUDA, 16-bit
    weights only), and a [gate; up] layer's ``small_m_act`` table (``activated_output``: ``tune_activated``);
    layers of the same shape share one timing, and a shape the cache holds is not timed. Returns how many
    (shape, bucket) pairs were timed."""
    tables: dict[str, dict] = {}
    timed = 0
    side = None  # one warm-up stream for every timing (made when the first shape needs timing)

    def table(key: str, device: torch.device, time_bucket) -> dict:
        nonlocal side, timed
        if key not in tables:
            tables[key] = cache.get(key) if cache is not None else None
            if tables[key] is None:
                side = side or torch.cuda.Stream(device)
                tables[key] = {rows: time_bucket(rows, side) for rows in ROW_BUCKETS}
                timed += len(ROW_BUCKETS)
                if cache is not None:
                    cache.put(key, tables[key])
        return tables[key]

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if getattr(module, "small_m", None) is None or weight is None or not weight.is_cuda or weight.dtype not in (
                torch.bfloat16, torch.float16):
            continue
        bias = getattr(module, "bias", None)
        gated = getattr(module, "gated_input", False)
        key = shape_key(weight, bias is not None, gated)
        plain = table(key, weight.device, lambda rows, side: tune(weight, bias, rows, gated, side))
        module.small_m.update(plain)
        if getattr(module, "activated_output", False):
            module.small_m_act.update(table(key + " activated", weight.device, lambda rows, side: tune_activated(
                weight, bias, rows, plain[rows], side)))
    return timed


def activated_config(act_table: dict[int, TileConfig | None], down_table: dict[int, TileConfig | None],
                     m: int) -> TileConfig | None:
    """The tile that writes an MLP's silu(gate) * up for ``m`` rows in its gate/up layer's epilogue, or None: when
    the gate/up layer's activated table (``tune_activated``) holds one for m's bucket and the down projection's
    kernel for that bucket would run the separate silu_and_mul kernel first (cuBLAS, weight on the left); a down
    kernel that activates its input as it loads it (GEMV, rows on the left) keeps that."""
    if not act_table or not 0 < m <= MAX_ROWS:
        return None
    bucket = row_bucket(m)
    down = down_table.get(bucket)
    return act_table.get(bucket) if down is None or down.weight_left else None


def activated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     cfg: TileConfig, norm_eps: float | None = None) -> torch.Tensor:
    """silu(gate) * up [..., N] of a [gate; up] weight [2N, K], in one weight-left kernel (``activated_config``);
    ``norm_eps``: of the RMS-normalised input (``small_m_linear``)."""
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    y = small_m_linear(x2d, weight, bias, cfg, activated=True, norm_eps=norm_eps)
    return y.view(*x.shape[:-1], weight.shape[0] // 2)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           small_m: dict[int, TileConfig | None] | None = None, gated: bool = False,
           norm_eps: float | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, or the small-M Triton kernel where ``small_m`` (the layer's tuned table) says it is faster.
    ``gated``: x is [..., 2K] (gate | up) and the layer's input is silu(gate) * up — inside the Triton kernel's
    loads when it runs (one kernel less per MLP), else through ``norm_rope.silu_and_mul`` first.
    ``norm_eps``: the input is RMS-normalised without a weight (``fold_norm_weight``), ``add``: the output plus
    ``add`` (a residual stream): inside the Triton kernel when it runs (``small_m_linear``), else computed around
    cuBLAS, rounded as ``norm_rope.rms_norm`` rounds."""
    width = x.shape[-1]
    if gated and width != 2 * weight.shape[1]:
        raise ValueError(f"a gated input is [..., 2 x {weight.shape[1]}] (gate | up), not [..., {width}]")
    m = x.numel() // width if width else 0
    cfg = small_m.get(row_bucket(m)) if small_m and 0 < m <= MAX_ROWS else None
    if cfg is None or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):  # no backward here
        if norm_eps is not None:
            x = _normalised(x, norm_eps)
        if gated:
            x = silu_and_mul(x.reshape(m, width)).view(*x.shape[:-1], width // 2)
        y = F.linear(x, weight, bias)
        return y if add is None else (y.float() + add.float()).to(y.dtype)
    x2d = x.reshape(m, width)
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    add2d = add.reshape(m, weight.shape[0]) if add is not None else None
    y = small_m_linear(x2d, weight, bias, cfg, gated, norm_eps=norm_eps, add=add2d)
    return y.view(*x.shape[:-1], weight.shape[0])


def _normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight, rounded as norm_rope.rms_norm rounds it (x * rsqrt(mean(x^2) + eps) in fp32, to x's
    dtype; the norm's weight, folded away, is then ones)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def fold_norm_weight(linear_weight: torch.Tensor, norm_weight: torch.Tensor) -> None:
    """W <- W diag(g) (in fp32, rounded once to W's dtype) and g <- 1: a linear layer whose input is RMSNorm(x) * g
    computes the same (up to that rounding) from the unweighted norm, which the small-M kernels take from their own
    input loads (``linear(norm_eps=)``), and the separate norm kernel, where another kernel runs, with weights of
    one."""
    linear_weight.copy_((linear_weight.float() * norm_weight.float()[None, :]).to(linear_weight.dtype))
    norm_weight.fill_(1)
