"""Residual add + RMSNorm, SiLU-and-multiply, rotate-half RoPE on q and k, and K/V stores into the paged cache.

On CUDA (or under Triton's CPU interpreter) each is one Triton kernel; elsewhere the same math runs in PyTorch (the
reference the kernels match up to rounding order). bf16 inputs are widened to fp32 and rounded back where PyTorch
would round them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.kernels.launch import pdl_launch, triton, use_triton

if triton is not None:
    import triton.language as tl

    from workers.kernels.launch import pdl_start


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
    def _add_rms_norm(X, R, W, Out, ROut, Rows, stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
                      HAS_RES: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr = False):
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)  # the output row; the input row is Rows[row] when given
        src = tl.load(Rows + row).to(tl.int64) if HAS_ROWS else row
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        x = tl.load(X + src * stride_x + cols, mask=ok, other=0.0)
        if HAS_RES:
            r = tl.load(R + src * stride_r + cols, mask=ok, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
            tl.store(ROut + row * stride_ro + cols, x, mask=ok)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
        normed = (xf * rstd).to(X.dtype.element_ty)
        w = tl.load(W + cols, mask=ok, other=0.0)
        tl.store(Out + row * stride_o + cols, (normed.to(tl.float32) * w.to(tl.float32)).to(Out.dtype.element_ty),
                 mask=ok)

    @triton.jit
    def _rms_norm_pair(A, B, WA, WB, Out, ARows, stride_a, stride_b, stride_o, n_cols, eps,
                       HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)  # program (row, 0) writes the first half, (row, 1) the second
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        if tl.program_id(1) == 0:
            src = tl.load(ARows + row).to(tl.int64) if HAS_ROWS else row
            x = tl.load(A + src * stride_a + cols, mask=ok, other=0.0)
            w = tl.load(WA + cols, mask=ok, other=0.0)
            dst = Out + row * stride_o + cols
        else:
            x = tl.load(B + row * stride_b + cols, mask=ok, other=0.0)
            w = tl.load(WB + cols, mask=ok, other=0.0)
            dst = Out + row * stride_o + n_cols + cols
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
        normed = (xf * rstd).to(A.dtype.element_ty)
        tl.store(dst, (normed.to(tl.float32) * w.to(tl.float32)).to(Out.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_and_mul(GateUp, Out, stride_g, stride_o, n, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n
        g = tl.load(GateUp + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(GateUp + row * stride_g + n + cols, mask=ok, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(Out.dtype.element_ty)
        tl.store(Out + row * stride_o + cols, (s.to(tl.float32) * u).to(Out.dtype.element_ty), mask=ok)

    @triton.jit
    def _rope_qk(Q, K, V, QOut, KOut, VOut, Slots, Cos, Sin, Positions, num_q_heads, half,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh,
                 stride_kot, stride_koh, stride_vot, stride_voh, stride_ct,
                 BLOCK: tl.constexpr, TO_CACHE: tl.constexpr, TABLE_ROWS: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        d = tl.arange(0, BLOCK)
        ok = d < half
        crow = tl.load(Positions + t).to(tl.int64) if TABLE_ROWS else t  # the token's row of cos / sin
        c = tl.load(Cos + crow * stride_ct + d, mask=ok, other=0.0)
        s = tl.load(Sin + crow * stride_ct + d, mask=ok, other=0.0)
        if h < num_q_heads:
            src = Q + t * stride_qt + h * stride_qh
            dst = QOut + t * stride_qot + h * stride_qoh
        else:
            kh = h - num_q_heads
            row = t  # the token's output row, or (TO_CACHE) its KV slot
            if TO_CACHE:
                row = tl.load(Slots + t).to(tl.int64)
            src = K + t * stride_kt + kh * stride_kh
            dst = KOut + row * stride_kot + kh * stride_koh
            if TO_CACHE:  # V goes to the cache as it is
                for half_start in tl.static_range(0, 2):
                    vd = half_start * half + d
                    tl.store(VOut + row * stride_vot + kh * stride_voh + vd,
                             tl.load(V + t * stride_vt + kh * stride_vh + vd, mask=ok), mask=ok)
        x1 = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + half + d, mask=ok, other=0.0).to(tl.float32)
        tl.store(dst + d, (x1 * c - x2 * s).to(QOut.dtype.element_ty), mask=ok)
        tl.store(dst + half + d, (x2 * c + x1 * s).to(QOut.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
             rows: torch.Tensor | None = None):
    """RMSNorm over the last dim; with ``residual``: (norm(x + residual), x + residual). ``rows`` (int64 [R]):
    only those rows of [T, n] inputs, as [R, n] outputs (the rows a forward's logits are taken at). ``out`` (the
    norm) and ``residual_out`` (x + residual) are tensors of the output's shape to write into and return, e.g.
    columns of a wider one."""
    if rows is not None and x.dim() != 2:
        raise ValueError("rms_norm(rows=) takes [T, n] inputs")
    shape = x.shape if rows is None else (rows.shape[0], x.shape[-1])
    for given, what in ((out, "out"), (residual_out, "residual_out")):
        if given is not None and (x.dim() != 2 or given.shape != shape or given.stride(1) != 1):
            raise ValueError(f"rms_norm({what}=) writes [T, n] rows (unit column stride) of [T, n] inputs")
    if residual_out is not None and residual is None:
        raise ValueError("rms_norm(residual_out=) needs a residual")
    if not use_triton(x):
        if rows is not None:
            x, residual = x[rows], (residual[rows] if residual is not None else None)
        ref = rms_norm_reference(x, weight, eps, residual)
        normed, summed = ref if residual is not None else (ref, None)
        normed = normed if out is None else out.copy_(normed)
        summed = summed if residual_out is None or summed is None else residual_out.copy_(summed)
        return normed if residual is None else (normed, summed)
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    r2 = residual.reshape(-1, n) if residual is not None else x2
    if out is None:
        out = torch.empty(shape, dtype=torch.result_type(x2, weight), device=x.device).view(-1, n)
    r_out = (torch.empty(out.shape, dtype=x2.dtype, device=x.device) if residual_out is None else residual_out
             ) if residual is not None else out
    if out.shape[0]:
        _add_rms_norm[(out.shape[0],)](x2, r2, weight, out, r_out, rows if rows is not None else x2, x2.stride(0),
                                       r2.stride(0), out.stride(0), r_out.stride(0), n, eps,
                                       HAS_RES=residual is not None, HAS_ROWS=rows is not None,
                                       BLOCK=triton.next_power_of_2(n), **pdl_launch(x2))
    return out.view(shape) if residual is None else (out.view(shape), r_out.view(shape))


def rms_norm_pair(a: torch.Tensor, b: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor, eps: float,
                  out: torch.Tensor, a_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Two RMSNorms side by side, one kernel: ``out`` [T, 2n] = [norm(a) * weight_a | norm(b) * weight_b] for a, b
    [T, n] (EAGLE-3's layer input). ``a_rows`` (int64 [T]): a's rows are ``a[a_rows]`` (an embedding lookup, a
    being the table, fused into the norm). The same values as two ``rms_norm`` calls."""
    t, n = b.shape
    rows_ok = a.shape[0] == t if a_rows is None else a_rows.shape == (t,)
    if (a.dtype != b.dtype or a.shape[-1] != n or out.shape != (t, 2 * n) or not rows_ok
            or any(x.stride(1) != 1 for x in (a, b, out))):
        raise ValueError(f"rms_norm_pair: a {tuple(a.shape)} {a.dtype}, b {tuple(b.shape)} {b.dtype}, out "
                         f"{tuple(out.shape)}, a_rows {None if a_rows is None else tuple(a_rows.shape)}")
    if not use_triton(b):
        rms_norm(a if a_rows is None else a[a_rows], weight_a, eps, out=out[:, :n])
        rms_norm(b, weight_b, eps, out=out[:, n:])
        return out
    if t:
        _rms_norm_pair[(t, 2)](a, b, weight_a, weight_b, out, a_rows if a_rows is not None else b, a.stride(0),
                               b.stride(0), out.stride(0), n, eps, HAS_ROWS=a_rows is not None,
                               BLOCK=triton.next_power_of_2(n), **pdl_launch(b))
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2n] (gate | up) → silu(gate) * up, [T, n]."""
    if not use_triton(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    if t:
        _silu_and_mul[(t, triton.cdiv(n, 1024))](gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=1024,
                                                 **pdl_launch(gate_up))
    return out


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def apply_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  positions: torch.Tensor | None = None):
    """Rotate-half RoPE of q [T, Hq, D] and k [T, Hk, D] (rows may be strided views of a fused qkv); cos/sin
    [T, D/2] fp32, or with ``positions`` [T] the whole tables, read at each token's position (inside the kernel on
    the GPU: no gather per forward). Returns new contiguous (q, k)."""
    if not use_triton(q):
        if positions is not None:
            cos, sin = cos[positions], sin[positions]
        return rope_reference(q, cos, sin), rope_reference(k, cos, sin)
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype,
                                                                                   device=k.device)
    _launch_rope(q, k, k, q_out, k_out, k_out, cos, sin, None, positions)
    return q_out, k_out


def apply_rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                        positions: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE on q and k, and the rotated k and v written to ``k_cache[slots]`` / ``v_cache[slots]`` ([S, Hk, D]):
    one kernel for what ``apply_rope_qk`` + ``store_kv`` do in two (the rotated k is never materialised).
    ``positions``: as for ``apply_rope_qk``. Returns the rotated q [T, Hq, D]."""
    if not (use_triton(q) and _fits_cache(k_cache, v_cache, slots, k, v) and q.dtype == k.dtype):
        q, k = apply_rope_qk(q, k, cos, sin, positions)
        store_kv(k_cache, v_cache, slots, k, v)
        return q
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _launch_rope(q, k, v, q_out, k_cache, v_cache, cos, sin, slots, positions)
    return q_out


def _launch_rope(q, k, v, q_out, k_out, v_out, cos, sin, slots, positions) -> None:
    """``slots`` None: k_out / v_out are [T, Hk, D] rows (v untouched); else the caches, row = slot. ``positions``
    None: cos / sin row t is token t's; else row positions[t] of the tables."""
    t, hq, dim = q.shape
    hk = k.shape[1]
    if t:
        _rope_qk[(t, hq + hk)](q, k, v, q_out, k_out, v_out, slots if slots is not None else cos, cos, sin,
                               positions if positions is not None else cos, hq,
                               dim // 2, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), v_out.stride(0),
                               v_out.stride(1), cos.stride(0), BLOCK=triton.next_power_of_2(dim // 2),
                               TO_CACHE=slots is not None, TABLE_ROWS=positions is not None, **pdl_launch(q))


# ---- K and V of new tokens into the paged cache, one kernel ------------------------------------------------------
if triton is not None:

    @triton.jit
    def _store_kv(K, V, KCache, VCache, Slots, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
                  num_heads, HEAD_DIM: tl.constexpr, HEADS_P2: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        t = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, HEADS_P2)
        d = tl.arange(0, HEAD_DIM)
        ok = (h < num_heads)[:, None]
        slot = tl.load(Slots + t).to(tl.int64)
        dst = slot * stride_cs + h[:, None] * stride_ch + d[None, :]
        k = tl.load(K + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=ok)
        v = tl.load(V + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=ok)
        tl.store(KCache + dst, k, mask=ok)
        tl.store(VCache + dst, v, mask=ok)


def _fits_cache(k_cache, v_cache, slots, k, v) -> bool:
    """Whether the Triton kernels can write k, v [T, H, D] straight into caches [S, H, D] (same dtypes and head
    layout, unit-stride head dims, one contiguous slot per token)."""
    t, _, dim = k.shape
    return (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype and k.shape == v.shape
            and k.shape[1:] == k_cache.shape[1:] == v_cache.shape[1:] and slots.shape == (t,) and slots.stride(0) == 1
            and k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride() == v_cache.stride()
            and k_cache.stride(2) == 1 and dim == triton.next_power_of_2(dim))


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """``k_cache[slots] = k; v_cache[slots] = v`` for k, v [T, H, D] (token rows may be strided views of a fused qkv)
    into caches [S, H, D]: one kernel instead of two indexing kernels, where the dtypes already match."""
    t, heads, dim = k.shape
    if not (use_triton(k) and _fits_cache(k_cache, v_cache, slots, k, v)):
        k_cache[slots] = k.to(k_cache.dtype)
        v_cache[slots] = v.to(v_cache.dtype)
        return
    if t:
        _store_kv[(t,)](k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                        k_cache.stride(0), k_cache.stride(1), heads, HEAD_DIM=dim,
                        HEADS_P2=triton.next_power_of_2(heads), **pdl_launch(k))
