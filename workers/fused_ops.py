"""Fused elementwise ops of the decoder: residual add + RMSNorm, SiLU-and-multiply, rotate-half RoPE on q and k.

On CUDA (or under Triton's CPU interpreter) each is ONE Triton kernel; a decode step of a small batch is otherwise
dominated by the dozens of tiny PyTorch kernels these replace. Elsewhere the same math runs in PyTorch (the CPU
reference, which the Triton kernels match up to float rounding order). Rounding follows PyTorch's: bf16 inputs are
widened to fp32, and results are rounded back where PyTorch would round them.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install without triton: PyTorch paths only
    triton = None


_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter runs the kernels on CPU tensors


def _triton_for(x: torch.Tensor) -> bool:
    return triton is not None and (x.is_cuda or _INTERPRETER)


# ---- residual add + RMSNorm --------------------------------------------------------------------------------------
def rms_norm_reference(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return out if residual is None else (out, residual)


if triton is not None:

    @triton.jit
    def _add_rms_norm(X, R, W, Out, ROut, stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
                      HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
        if HAS_RES:
            r = tl.load(R + row * stride_r + cols, mask=ok, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
            tl.store(ROut + row * stride_ro + cols, x, mask=ok)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
        normed = (xf * rstd).to(X.dtype.element_ty)
        w = tl.load(W + cols, mask=ok, other=0.0)
        tl.store(Out + row * stride_o + cols, (normed.to(tl.float32) * w.to(tl.float32)).to(Out.dtype.element_ty),
                 mask=ok)

    @triton.jit
    def _silu_and_mul(GateUp, Out, stride_g, stride_o, n, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n
        g = tl.load(GateUp + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(GateUp + row * stride_g + n + cols, mask=ok, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(Out.dtype.element_ty)
        tl.store(Out + row * stride_o + cols, (s.to(tl.float32) * u).to(Out.dtype.element_ty), mask=ok)

    @triton.jit
    def _rope_qk(Q, K, QOut, KOut, Cos, Sin, num_q_heads, half,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_ct,
                 BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        d = tl.arange(0, BLOCK)
        ok = d < half
        c = tl.load(Cos + t * stride_ct + d, mask=ok, other=0.0)
        s = tl.load(Sin + t * stride_ct + d, mask=ok, other=0.0)
        if h < num_q_heads:
            src = Q + t * stride_qt + h * stride_qh
            dst = QOut + t * stride_qot + h * stride_qoh
        else:
            src = K + t * stride_kt + (h - num_q_heads) * stride_kh
            dst = KOut + t * stride_kot + (h - num_q_heads) * stride_koh
        x1 = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + half + d, mask=ok, other=0.0).to(tl.float32)
        tl.store(dst + d, (x1 * c - x2 * s).to(QOut.dtype.element_ty), mask=ok)
        tl.store(dst + half + d, (x2 * c + x1 * s).to(QOut.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim; with ``residual``: (norm(x + residual), x + residual)."""
    if not _triton_for(x):
        return rms_norm_reference(x, weight, eps, residual)
    shape, n = x.shape, x.shape[-1]
    x2 = x.reshape(-1, n)
    r2 = residual.reshape(-1, n) if residual is not None else x2
    out = torch.empty(x2.shape, dtype=torch.result_type(x2, weight), device=x.device)
    r_out = torch.empty_like(x2) if residual is not None else out
    if x2.shape[0]:
        _add_rms_norm[(x2.shape[0],)](x2, r2, weight, out, r_out, x2.stride(0), r2.stride(0), out.stride(0),
                                      r_out.stride(0), n, eps, HAS_RES=residual is not None,
                                      BLOCK=triton.next_power_of_2(n))
    return out.view(shape) if residual is None else (out.view(shape), r_out.view(shape))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2n] (gate | up) → silu(gate) * up, [T, n]."""
    if not _triton_for(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    if t:
        _silu_and_mul[(t, triton.cdiv(n, 1024))](gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=1024)
    return out


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def apply_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate-half RoPE of q [T, Hq, D] and k [T, Hk, D] (rows may be strided views of a fused qkv); cos/sin
    [T, D/2] fp32. Returns new contiguous (q, k)."""
    if not _triton_for(q):
        return rope_reference(q, cos, sin), rope_reference(k, cos, sin)
    t, hq, dim = q.shape
    hk = k.shape[1]
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype,
                                                                                   device=k.device)
    if t:
        _rope_qk[(t, hq + hk)](q, k, q_out, k_out, cos, sin, hq, dim // 2, q.stride(0), q.stride(1), k.stride(0),
                               k.stride(1), q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
                               cos.stride(0), BLOCK=triton.next_power_of_2(dim // 2))
    return q_out, k_out
