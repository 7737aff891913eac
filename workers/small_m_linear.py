"""Linear layers for few rows (decode and verify of small batches): ``y = x W^T (+ b)`` with x [M <= 16, K].

At M = 1..16 a linear layer only streams its weight from memory, and cuBLAS's kernels for these shapes reach 1.1-2.1x
the weight-read time on an H100 (bench/results/linears_8b_h100.md). This module's Triton kernel streams W once in
[BLOCK_N, BLOCK_K] tiles, one program per BLOCK_N output columns, the M rows multiplied on the tensor cores (rows
padded to 16) or, for M = 1, as a broadcast multiply-sum.

Which kernel runs is measured once, at start-up, not guessed and not on the serving path: ``tune_small_m_linears``
times cuBLAS (``F.linear``) and every candidate tile config on each layer's real weight for each row bucket and stores
the winner in that layer's ``small_m`` table (row bucket → TileConfig, or None for cuBLAS). ``linear`` only reads the
table: a bucket that was not tuned (CPU, fp32, a replicated draft under TP, where every rank must run the very same
kernel) runs ``F.linear``.

The kernel can compute its input as it loads it: silu(gate) * up for the MLP's down projection (``gated``), and the
residual add + RMSNorm before the qkv and gate/up projections (``norm_linear``), so a decoder layer of a small batch
runs three elementwise kernels fewer where the tuning chose this kernel (each costs a launch and a dependent wait).

Timings are noisy, and kernels round differently, so two starts that chose differently would give different bf16
tokens for the same greedy request. A ``TuningCache`` file keeps each choice per GPU model and software versions:
later starts (restarts, other replicas sharing the file) read it and time nothing, so they run the same kernels.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from workers.fused_ops import rms_norm, silu_and_mul

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install without triton
    triton = None

logger = logging.getLogger(__name__)

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

ROW_BUCKETS = (1, 2, 4, 8, 16)
# A later candidate (cuBLAS first, then the list's order) must be this much faster to be chosen: kernels of nearly
# the same speed then resolve the same way on every start, so replicas and restarts mostly run the same kernels and
# round alike (timings stay noisy: this narrows run-to-run differences, it cannot rule them out).
SWITCH_MARGIN = 0.03


if triton is not None:

    @triton.jit
    def _small_m_linear(X, W, Bias, Y, R, NormW, ROut, M, N, K, stride_xm, stride_wn, stride_ym, stride_rm,
                        stride_rom, eps,
                        HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr,
                        HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
        row_ok = offs_m[:, None] < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN:  # N % BLOCK_N == 0 and K % BLOCK_K == 0: unmasked weight loads
                w = tl.load(w_ptrs)
                x_ok = row_ok
            else:
                k_ok = (k0 + offs_k) < K
                w = tl.load(w_ptrs, mask=(offs_n[:, None] < N) & k_ok[None, :], other=0.0)
                x_ok = row_ok & k_ok[None, :]
            x = tl.load(x_ptrs, mask=x_ok, other=0.0)
            if GATED:  # X rows are [gate | up]: silu(gate) * up, rounded as fused_ops.silu_and_mul rounds
                up = tl.load(x_ptrs + K, mask=x_ok, other=0.0).to(tl.float32)
                g = x.to(tl.float32)
                act = (g / (1.0 + tl.exp(-g))).to(X.dtype.element_ty)
                x = (act.to(tl.float32) * up).to(X.dtype.element_ty)
            if NORM:  # x rows are the residual stream: (x + residual) * norm weight here, * 1/rms at the end
                if HAS_RES:
                    r = tl.load(R + offs_m[:, None] * stride_rm + k0 + offs_k[None, :], mask=x_ok, other=0.0)
                    x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
                    # the first column block writes the new residual stream (a buffer no program reads)
                    first = (tl.zeros((BLOCK_M, BLOCK_K), tl.int32) + pid) == 0
                    tl.store(ROut + offs_m[:, None] * stride_rom + k0 + offs_k[None, :], x, mask=x_ok & first)
                xf = x.to(tl.float32)
                sum_sq += tl.sum(xf * xf, axis=1)
                if EVEN:
                    nw = tl.load(NormW + k0 + offs_k)
                else:
                    nw = tl.load(NormW + k0 + offs_k, mask=(k0 + offs_k) < K, other=0.0)
                x = (xf * nw.to(tl.float32)[None, :]).to(X.dtype.element_ty)
            if BLOCK_M == 1:
                acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
            else:
                acc = tl.dot(x, tl.trans(w), acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if NORM:
            acc = acc * (1.0 / tl.sqrt(sum_sq / K + eps))[:, None]
        if HAS_BIAS:
            acc += tl.load(Bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=row_ok & (offs_n[None, :] < N))


class InputNorm(NamedTuple):
    """An RMSNorm applied to a linear layer's input inside the kernel: y = norm(x + residual) W^T, and the new
    residual stream x + residual (the input itself when ``residual`` is None)."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None


def small_m_linear(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: TileConfig,
                   gated: bool = False, norm: InputNorm | None = None):
    """The Triton kernel with one tile config: x2d [M <= 16, K] (unit stride in K), weight [N, K] contiguous.
    ``gated``: x2d is [M, 2K] (gate | up) and the input is silu(gate) * up, computed as it is loaded.
    ``norm``: the input is RMSNorm(x2d + norm.residual) (residual rows unit stride in K); returns (y, new residual).
    The norm's 1/rms scales the accumulator at the end (the sum of squares comes with the loads), so the rounding
    is (x * norm weight) in the input dtype, not the separate norm kernel's: close, not bit-equal."""
    m, k = x2d.shape
    if gated:
        k //= 2
    if gated and norm is not None:
        raise ValueError("a linear input is gated or normed, not both")
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x2d.dtype, device=x2d.device)
    res = norm.residual if norm is not None else None
    r_out = torch.empty_like(x2d) if res is not None else y
    even = n % cfg.block_n == 0 and k % cfg.block_k == 0
    _small_m_linear[(triton.cdiv(n, cfg.block_n),)](
        x2d, weight, bias if bias is not None else weight, y, res if res is not None else x2d,
        norm.weight if norm is not None else weight, r_out, m, n, k, x2d.stride(0), weight.stride(0), y.stride(0),
        res.stride(0) if res is not None else 0, r_out.stride(0), norm.eps if norm is not None else 0.0,
        HAS_BIAS=bias is not None, EVEN=even, GATED=gated, NORM=norm is not None, HAS_RES=res is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    if norm is None:
        return y
    return y, (r_out if res is not None else x2d)


def row_bucket(m: int) -> int:
    """The tuned row count M rows run under (the smallest bucket >= m)."""
    return next(b for b in ROW_BUCKETS if b >= m)


def tune(weight: torch.Tensor, bias: torch.Tensor | None, rows: int, gated: bool = False,
         normed: bool = False) -> TileConfig | None:
    """Time cuBLAS and every candidate tile config at ``rows`` rows on this weight; the fastest (None: cuBLAS).
    ``gated`` layers are timed as they run: cuBLAS after the separate silu_and_mul kernel, Triton with it fused;
    ``normed`` ones likewise with the residual add + RMSNorm.
    A candidate that fails to compile or launch (e.g. too much shared memory on this GPU) is skipped."""
    from triton.testing import do_bench

    x = torch.randn(rows, weight.shape[1] * (2 if gated else 1), dtype=weight.dtype, device=weight.device)
    norm = InputNorm(torch.rand(weight.shape[1], dtype=weight.dtype, device=weight.device) + 0.5, 1e-5,
                     torch.randn_like(x)) if normed else None
    if gated:
        cublas = lambda: F.linear(silu_and_mul(x), weight, bias)  # noqa: E731
    elif normed:
        cublas = lambda: F.linear(rms_norm(x, norm.weight, norm.eps, norm.residual)[0], weight, bias)  # noqa: E731
    else:
        cublas = lambda: F.linear(x, weight, bias)  # noqa: E731
    best, best_ms = None, do_bench(cublas, warmup=5, rep=20)
    for cfg in (CANDIDATES_M1 if rows == 1 else []) + CANDIDATES:
        try:
            ms = do_bench(lambda c=cfg: small_m_linear(x, weight, bias, c, gated, norm), warmup=5, rep=20)
        except Exception:  # noqa: BLE001 - a config this GPU cannot run is simply not a candidate
            continue
        if ms < best_ms * (1 - SWITCH_MARGIN):
            best, best_ms = cfg, ms
    return best


class TuningCache:
    """The tuned choices, in a JSON file shared by every start on this machine (or volume):
    ``{environment: {shape key: {row bucket: [tile config] | null (cuBLAS)}}}``. The environment names the GPU model
    and the torch and triton versions, whose kernels were timed. Saving merges with what the file holds by then and
    replaces it atomically, so concurrent starts (TP ranks, replicas) never leave it half written; an unreadable
    file is logged, timed afresh and replaced by the next save."""

    def __init__(self, path: str | os.PathLike, environment: str):
        self.path = Path(path)
        self.environment = environment
        self._entries: dict[str, dict[str, list[int] | None]] = self._read().get(environment, {})
        self._new: dict[str, dict[str, list[int] | None]] = {}

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


def tuning_environment(device: torch.device) -> str:
    """What a timing depends on besides the shape: the GPU model and the torch / triton builds."""
    return f"{torch.cuda.get_device_name(device)} | torch {torch.__version__} | triton {triton.__version__}"


def shape_key(weight: torch.Tensor, has_bias: bool, gated: bool, normed: bool = False) -> str:
    n, k = weight.shape
    return (f"{n}x{k} {str(weight.dtype).removeprefix('torch.')}{' bias' if has_bias else ''}"
            f"{' gated' if gated else ''}{' normed' if normed else ''}")


def tune_small_m_linears(model: torch.nn.Module, cache: TuningCache | None = None) -> int:
    """Fill the ``small_m`` table of every layer of ``model`` that has one, for every row bucket (CUDA, 16-bit
    weights only); layers of the same shape share one timing, and a shape the cache holds is not timed. Returns how
    many (shape, bucket) pairs were timed."""
    by_shape: dict[str, dict] = {}
    timed = 0
    for module in model.modules():
        table = getattr(module, "small_m", None)
        weight = getattr(module, "weight", None)
        if table is None or weight is None or not weight.is_cuda or weight.dtype not in (torch.bfloat16,
                                                                                          torch.float16):
            continue
        bias = getattr(module, "bias", None)
        gated = getattr(module, "gated_input", False)
        normed = getattr(module, "normed_input", False)
        key = shape_key(weight, bias is not None, gated, normed)
        if key not in by_shape:
            by_shape[key] = cache.get(key) if cache is not None else None
            if by_shape[key] is None:
                by_shape[key] = {rows: tune(weight, bias, rows, gated, normed) for rows in ROW_BUCKETS}
                timed += len(ROW_BUCKETS)
                if cache is not None:
                    cache.put(key, by_shape[key])
        table.update(by_shape[key])
    return timed


def _tuned_config(x: torch.Tensor, weight: torch.Tensor, small_m) -> TileConfig | None:
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not small_m or not 0 < m <= MAX_ROWS or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return None  # (no backward through the Triton kernel)
    return small_m.get(row_bucket(m))


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2d = x.reshape(-1, x.shape[-1])
    return x2d if x2d.stride(1) == 1 else x2d.contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           small_m: dict[int, TileConfig | None] | None = None, gated: bool = False) -> torch.Tensor:
    """``F.linear``, or the small-M Triton kernel where ``small_m`` (the layer's tuned table) says it is faster.
    ``gated``: x is [..., 2K] (gate | up) and the layer's input is silu(gate) * up — inside the Triton kernel's
    loads when it runs (one kernel less per MLP), else through ``fused_ops.silu_and_mul`` first."""
    width = x.shape[-1]
    if gated and width != 2 * weight.shape[1]:
        raise ValueError(f"a gated input is [..., 2 x {weight.shape[1]}] (gate | up), not [..., {width}]")
    cfg = _tuned_config(x, weight, small_m)
    if cfg is None:
        if gated:
            x = silu_and_mul(x.reshape(-1, width)).view(*x.shape[:-1], width // 2)
        return F.linear(x, weight, bias)
    return small_m_linear(_rows(x), weight, bias, cfg, gated).view(*x.shape[:-1], weight.shape[0])


def norm_linear(x: torch.Tensor, norm: InputNorm, weight: torch.Tensor, bias: torch.Tensor | None = None,
                small_m: dict[int, TileConfig | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm, then the linear layer: (norm(x + residual) W^T (+ b), x + residual), with
    ``residual = None`` meaning (norm(x) W^T, x). One Triton kernel where ``small_m`` chose the small-M kernel for
    this row count (two kernels less per decoder layer), else ``fused_ops.rms_norm`` then ``F.linear``."""
    cfg = _tuned_config(x, weight, small_m)
    if cfg is None:
        if norm.residual is None:
            return F.linear(rms_norm(x, norm.weight, norm.eps), weight, bias), x
        h, residual = rms_norm(x, norm.weight, norm.eps, norm.residual)
        return F.linear(h, weight, bias), residual
    res = _rows(norm.residual) if norm.residual is not None else None
    y, residual = small_m_linear(_rows(x), weight, bias, cfg, norm=norm._replace(residual=res))
    return y.view(*x.shape[:-1], weight.shape[0]), (residual.view(x.shape) if res is not None else x)
