"""Fused elementwise ops of the decoder: residual add + RMSNorm, SiLU-and-multiply, rotate-half RoPE on q and k.

On CUDA (or under Triton's CPU interpreter) each is ONE Triton kernel; a decode step of a small batch is otherwise
dominated by the dozens of tiny PyTorch kernels these replace. Elsewhere the same math runs in PyTorch (the CPU
reference, which the Triton kernels match up to float rounding order). Rounding follows PyTorch's: bf16 inputs are
widened to fp32, and results are rounded back where PyTorch would round them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install without triton: PyTorch paths only
    triton = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: kernels start when the previous one has ended
    gdc_launch_dependents = gdc_wait = None


_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter runs the kernels on CPU tensors


def _triton_for(x: torch.Tensor) -> bool:
    return triton is not None and (x.is_cuda or _INTERPRETER)


# ---- programmatic dependent launch (PDL) --------------------------------------------------------------------------
# On Hopper and later a kernel launched with PDL may start while the one before it still runs: its programs become
# resident and wait (``griddepcontrol.wait``) until that kernel has ended and its writes are visible. A decode step
# of a small batch is a chain of ~9 kernels a layer, each too short to hide its own start: the short kernels let the
# next one start at once, and the linear layers pull the first weight tile of each of their programs into L2 before
# they wait, so a layer's weight stream starts while the norm / RoPE / attention kernels before it run. Nothing is
# read from an activation or written before the wait, so results are those of kernels run one after another.
# Only launches inside ``pdl_launches()`` (CUDA-graph warm-ups and captures) take part: an eager decode step launched
# this way took 35.0 ms instead of 25.3 on an H100 (not profiled; eager steps are bound by the host's launches).
# SPECSERVE_PDL=0 turns it off (A/B, debugging).
_PDL_ALLOWED = os.environ.get("SPECSERVE_PDL", "1") != "0"
_pdl_scope = threading.local()


@contextlib.contextmanager
def pdl_launches():
    """Kernels launched inside (this thread) use PDL where ``pdl_supported``."""
    was = getattr(_pdl_scope, "on", False)
    _pdl_scope.on = True
    try:
        yield
    finally:
        _pdl_scope.on = was


@functools.lru_cache(maxsize=None)
def _pdl_device(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_supported(device: torch.device | str) -> bool:
    """Whether Triton kernels on ``device`` can launch with PDL (CUDA sm90+, a Triton with grid dependency
    control, not turned off by SPECSERVE_PDL=0)."""
    device = torch.device(device)
    if not (_PDL_ALLOWED and device.type == "cuda" and triton is not None and gdc_wait is not None
            and torch.cuda.is_available()):
        return False
    return _pdl_device(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch(x: torch.Tensor) -> dict:
    """Launch keywords of a kernel on ``x``'s device with a ``PDL`` constexpr (``pdl_start``, or ``pdl_release``
    and a wait)."""
    on = getattr(_pdl_scope, "on", False) and pdl_supported(x.device)
    return {"PDL": True, "launch_pdl": True} if on else {}


if triton is not None:

    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        """A short kernel's first statement: let the next kernel's programs start now, then wait for the previous
        kernel's results."""
        if PDL:
            gdc_launch_dependents()
            gdc_wait()

    @triton.jit
    def pdl_release(PDL: tl.constexpr):
        """Let the next kernel's programs start (a linear layer: once its weight stream is done)."""
        if PDL:
            gdc_launch_dependents()

    @triton.jit
    def prefetch_to_l2(ptrs, nbytes):
        """Bring ``nbytes`` from each pointer into L2 without waiting for them (sm90 bulk prefetch; skipped where
        nbytes <= 0). Pointers 16-byte aligned, nbytes a multiple of 16."""
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch_bytes(weight: torch.Tensor, block_k: int) -> int:
    """Bytes of each weight row a linear kernel's program prefetches before it waits (its first K tile), 0 where
    the rows are not 16-byte aligned."""
    row = weight.stride(0) * weight.element_size()
    if weight.data_ptr() % 16 or row % 16:
        return 0
    return min(block_k, weight.shape[1]) * weight.element_size() // 16 * 16


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
    if not _triton_for(x):
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
    if not _triton_for(b):
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
    if not _triton_for(gate_up):
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
    if not _triton_for(q):
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
    if not (_triton_for(q) and _fits_cache(k_cache, v_cache, slots, k, v) and q.dtype == k.dtype):
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
    if not (_triton_for(k) and _fits_cache(k_cache, v_cache, slots, k, v)):
        k_cache[slots] = k.to(k_cache.dtype)
        v_cache[slots] = v.to(v_cache.dtype)
        return
    if t:
        _store_kv[(t,)](k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                        k_cache.stride(0), k_cache.stride(1), heads, HEAD_DIM=dim,
                        HEADS_P2=triton.next_power_of_2(heads), **pdl_launch(k))


# ---- counter-based noise (the sampler's): a 32-bit hash of (seed, counter, column, stream), and Gumbel noise ------
_MASK32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply) on int64 tensors holding values < 2^32."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def hash32(seeds: torch.Tensor, counters: torch.Tensor, width: int, stream: int) -> torch.Tensor:
    """[B, width] int64 holding 32-bit hashes of (seed, counter, column, stream)."""
    base = mix32((seeds.long() & _MASK32) ^ mix32((counters.long() * 0x9E37 + stream * 0x85EB + 0x27D4) & _MASK32))
    cols = torch.arange(width, device=seeds.device, dtype=torch.int64)
    return mix32((base.unsqueeze(1) + mix32(cols).unsqueeze(0) * 0x2C1B) & _MASK32)


if triton is not None:

    @triton.jit
    def _mix32(x):
        """``mix32`` on uint32 lanes (its int64 products taken mod 2^32 are uint32 products; the
        wrap-around is meant, so Triton's debug-mode overflow checks would flag it)."""
        x = ((x >> 16) ^ x) * 0x45D9F3B
        x = ((x >> 16) ^ x) * 0x45D9F3B
        return (x >> 16) ^ x

    @triton.jit
    def _hash_base(seed, counter, stream):
        """A row's hash base, as ``hash32`` computes it (uint32); column c's hash is
        ``_mix32(base + _mix32(c) * 0x2C1B)``."""
        ctr = (counter * 0x9E37 + stream * 0x85EB + 0x27D4) & 0xFFFFFFFF
        return _mix32((seed & 0xFFFFFFFF).to(tl.uint32) ^ _mix32(ctr.to(tl.uint32)))

    @triton.jit
    def _uniform_noise(Seeds, Counters, Out, width, stream, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        base = _hash_base(tl.load(Seeds + row), tl.load(Counters + row), stream)
        h = _mix32(base + _mix32(cols.to(tl.uint32)) * 0x2C1B)
        tl.store(Out + row * width + cols, (h.to(tl.float64) + 0.5) * 2.3283064365386963e-10, mask=cols < width)


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, width: int, stream: int = 0) -> torch.Tensor:
    """Uniforms (hash32 + 0.5) / 2^32 in (0, 1), float64 [B, width], a pure function of (seed, counter, column,
    stream): one kernel on the GPU (the PyTorch form is about 45 int64 element-wise kernels)."""
    if not _triton_for(seeds):
        return (hash32(seeds, counters, width, stream).double() + 0.5) / 4294967296.0
    b = seeds.shape[0]
    out = torch.empty(b, width, dtype=torch.float64, device=seeds.device)
    if b and width:
        block = min(1024, triton.next_power_of_2(width))
        _uniform_noise[(b, triton.cdiv(width, block))](seeds, counters, out, width, stream, BLOCK=block)
    return out


def gumbel_from_hash(h: torch.Tensor) -> torch.Tensor:
    """Gumbel noise -log(-log u), u = (h + 0.5) / 2^32, in fp32 without losing the tail: u near 1 (where fp32 would
    round u to 1 and the noise to +inf) goes through q = 1 - u, exact from the hash, and a series for -log(1 - q).
    ``_gumbel`` computes the same in the argmax kernel."""
    upper = h >= 2**31
    q = (torch.where(upper, _MASK32 - h, h).float() + 0.5) * 2.0**-32  # min(u, 1 - u), in (0, 0.5]
    series = q * (1 + q * (1 / 2 + q * (1 / 3 + q * (1 / 4 + q * (1 / 5 + q * (1 / 6 + q * (1 / 7 + q * 0.125)))))))
    e = torch.where(upper, torch.where(q < 1 / 16, series, -torch.log(1 - q)), -torch.log(q))  # -log u
    return -torch.log(e)


# ---- greedy token and log-normaliser of each row of logits -------------------------------------------------------
if triton is not None:

    @triton.jit
    def _gumbel(h):
        """``gumbel_from_hash`` on uint32 hashes, fp32."""
        upper = h >= 0x80000000
        q = (tl.where(upper, 0xFFFFFFFF - h, h).to(tl.float32) + 0.5) * 2.3283064365386963e-10
        series = q * (1 + q * (1 / 2 + q * (1 / 3 + q * (1 / 4 + q * (1 / 5 + q * (1 / 6 + q * (1 / 7 + q * 0.125)))))))
        e = tl.where(upper, tl.where(q < 1 / 16, series, -tl.log(1 - q)), -tl.log(q))
        return -tl.log(e)

    @triton.jit
    def _argmax_lse_partial(Logits, PartMax, PartArg, PartSum, n, stride_l, chunk, num_parts,
                            Temperature, Seeds, Counters, stream, Floor,
                            BLOCK: tl.constexpr, GUMBEL: tl.constexpr, HAS_FLOOR: tl.constexpr,
                            PDL: tl.constexpr = False):
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        lo = part * chunk
        m = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: running max, its first index, sum of exp
        arg = tl.zeros([BLOCK], tl.int32)
        s = tl.zeros([BLOCK], tl.float32)
        if GUMBEL:  # the row's hash base, as ``hash32`` computes it
            temp = tl.load(Temperature + row)
            base = _hash_base(tl.load(Seeds + row), tl.load(Counters + row), stream)
        if HAS_FLOOR:
            floor = tl.load(Floor + row)
        for start in range(lo, lo + chunk, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(Logits + row * stride_l + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
            if HAS_FLOOR:  # filtered out: below the row's floor
                x = tl.where(x >= floor, x, float("-inf"))
            if GUMBEL:  # x / T + Gumbel noise of the column's hash
                x = x / temp + _gumbel(_mix32(base + _mix32(cols.to(tl.uint32)) * 0x2C1B))
            new_m = tl.maximum(m, x)
            safe = tl.where(new_m == float("-inf"), 0.0, new_m)
            s = s * tl.exp(m - safe) + tl.exp(x - safe)
            arg = tl.where(x > m, cols, arg)  # strictly greater: a lane keeps its first maximum
            m = new_m
        best = tl.max(m, 0)
        first = tl.min(tl.where(m == best, arg, 2147483647), 0)  # the first column holding the maximum
        safe_best = tl.where(best == float("-inf"), 0.0, best)
        total = tl.sum(s * tl.exp(m - safe_best), 0)
        tl.store(PartMax + row * num_parts + part, best)
        tl.store(PartArg + row * num_parts + part, first)
        tl.store(PartSum + row * num_parts + part, total)

    @triton.jit
    def _argmax_lse_final(PartMax, PartArg, PartSum, Ids, IdRows, Lse, LogProb, Remap, num_parts,
                          PARTS_P2: tl.constexpr, WITH_LOGPROB: tl.constexpr, HAS_REMAP: tl.constexpr,
                          HAS_ID_ROWS: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        p = tl.arange(0, PARTS_P2)
        ok = p < num_parts
        m = tl.load(PartMax + row * num_parts + p, mask=ok, other=float("-inf"))
        arg = tl.load(PartArg + row * num_parts + p, mask=ok, other=2147483647)
        s = tl.load(PartSum + row * num_parts + p, mask=ok, other=0.0)
        best = tl.max(m, 0)
        first = tl.min(tl.where(m == best, arg, 2147483647), 0)
        safe = tl.where(best == float("-inf"), 0.0, best)
        lse = safe + tl.log(tl.sum(s * tl.exp(m - safe), 0))
        first = first.to(tl.int64)
        if HAS_REMAP:  # a draft vocabulary's id → the target's: id + Remap[id]
            first += tl.load(Remap + first)
        tl.store(Ids + (tl.load(IdRows + row).to(tl.int64) if HAS_ID_ROWS else row), first)
        tl.store(Lse + row, lse)
        if WITH_LOGPROB:  # the argmax's log-probability: its logit is the row's maximum
            tl.store(LogProb + row, best - lse)


def _row_chunks(n: int, block: int) -> tuple[int, int]:
    """(programs, positions each) that spread a row of ``n`` over up to 64 programs of at least 4 blocks."""
    parts = max(1, min(64, triton.cdiv(n, 4 * block)))
    chunk = triton.cdiv(triton.cdiv(n, parts), block) * block
    return triton.cdiv(n, chunk), chunk


def greedy_with_logprob(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax [B] int64, its log-probability [B] fp32) of logits [B, V]: the two kernels of ``argmax_logsumexp``
    write the log-probability too (max - logsumexp), so greedy sampling needs no gather afterwards."""
    if not _triton_for(logits) or logits.stride(-1) != 1:
        x = logits.float()
        return x.argmax(-1), x.max(-1).values - torch.logsumexp(x, dim=-1)
    ids, _, logprob = _argmax_lse(logits, None, None, with_logprob=True)
    return ids, logprob


def argmax_logsumexp(logits: torch.Tensor, gumbel: tuple | None = None, floor: torch.Tensor | None = None,
                     remap: torch.Tensor | None = None, ids_out: torch.Tensor | None = None,
                     ids_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax [B] int64, the first index on ties, as torch's; logsumexp [B] fp32) of logits [B, V]. On the GPU two
    kernels spread each row over many programs (PyTorch reduces a row of a 128k vocabulary in one block, ~25 us).
    ``gumbel = (temperature [B], seeds [B], counters [B], stream)``: of logits / temperature + Gumbel noise from the
    counter-based uniforms instead (``workers.sampling.draw``; the reference here is only for CPUs).
    ``floor`` [B] (with ``gumbel``): logits below their row's floor take no part (``filter_floor``).
    ``remap`` [V] int64 (an EAGLE-3 head's d2t): the returned id is ``i + remap[i]`` for argmax ``i``, added in the
    second kernel (no index and add kernels after it).
    ``ids_out`` (contiguous int64): where the ids go, returned in their place: [B], or with ``ids_rows`` (int64 [B])
    any length, row b's id written to ``ids_out[ids_rows[b]]`` (a per-request state by slot: no copy kernel after)."""
    if ids_out is not None and (ids_out.dtype != torch.int64 or ids_out.dim() != 1 or not ids_out.is_contiguous() or (
            ids_rows is None and ids_out.shape != logits.shape[:1])) or (ids_rows is not None and ids_out is None):
        raise ValueError("argmax_logsumexp: ids_out takes [B] int64 contiguous ids, or any length with ids_rows")
    if gumbel is not None and not (_triton_for(logits) and logits.stride(-1) == 1):
        temp, seeds, counters, stream = gumbel
        noise = gumbel_from_hash(hash32(seeds, counters, logits.shape[1], stream))
        x = logits.float()
        if floor is not None:
            x = torch.where(x >= floor.unsqueeze(1), x, float("-inf"))
        logits, gumbel = x / temp.unsqueeze(1) + noise, None
    if not _triton_for(logits) or logits.stride(-1) != 1:
        ids = logits.argmax(-1)
        ids = ids if remap is None else ids + remap[ids]
        if ids_out is not None:
            ids = ids_out.index_copy_(0, ids_rows, ids) if ids_rows is not None else ids_out.copy_(ids)
        return ids, torch.logsumexp(logits.float(), dim=-1)
    return _argmax_lse(logits, gumbel, floor, remap=remap, ids_out=ids_out, ids_rows=ids_rows)[:2]


def _argmax_lse(logits, gumbel, floor, with_logprob: bool = False, remap: torch.Tensor | None = None,
                ids_out: torch.Tensor | None = None, ids_rows: torch.Tensor | None = None):
    b, n = logits.shape
    block = 1024
    parts, chunk = _row_chunks(n, block)
    dev = logits.device
    part_max = torch.empty(b, parts, dtype=torch.float32, device=dev)
    part_arg = torch.empty(b, parts, dtype=torch.int32, device=dev)
    part_sum = torch.empty(b, parts, dtype=torch.float32, device=dev)
    ids = torch.empty(b, dtype=torch.int64, device=dev) if ids_out is None else ids_out
    lse = torch.empty(b, dtype=torch.float32, device=dev)
    logprob = torch.empty_like(lse) if with_logprob else None
    if b:
        temp, seeds, counters, stream = gumbel if gumbel is not None else (lse, ids, ids, 0)  # (unused then)
        has_floor = gumbel is not None and floor is not None
        _argmax_lse_partial[(b, parts)](logits, part_max, part_arg, part_sum, n, logits.stride(0), chunk, parts,
                                        temp, seeds, counters, stream, floor if has_floor else lse,
                                        BLOCK=block, GUMBEL=gumbel is not None, HAS_FLOOR=has_floor,
                                        **pdl_launch(logits))
        _argmax_lse_final[(b,)](part_max, part_arg, part_sum, ids, ids_rows if ids_rows is not None else ids, lse,
                                logprob if with_logprob else lse, remap if remap is not None else ids, parts,
                                PARTS_P2=triton.next_power_of_2(parts), WITH_LOGPROB=with_logprob,
                                HAS_REMAP=remap is not None, HAS_ID_ROWS=ids_rows is not None, **pdl_launch(logits))
    return ids, lse, logprob


# ---- where a sampled row's top-k / top-p / min-p filtering ends ---------------------------------------------------
def filter_floor_reference(sorted_logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                           top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """The smallest logit a row keeps ([B], raw logit units) given its logits sorted in descending order: the
    tokens kept are those whose logit is at least this (``workers.sampling.processed_probs`` says which). With
    s = logits * (1 / T) and e = exp(s - s_max) (each token's probability relative to the most likely one's): top-k
    keeps s >= the k-th s; top-p keeps the tokens, in this order, whose e before them is below ``top_p`` of the
    top-k survivors' e; min-p keeps e >= ``min_p``. At least the most likely token is kept; a row with none of the
    three keeps everything (its smallest logit)."""
    n = sorted_logits.shape[1]
    inv = 1.0 / torch.where(temperature > 0, temperature, torch.ones_like(temperature)).unsqueeze(1)
    s = sorted_logits.float() * inv
    e = torch.exp(s - s[:, :1])
    k = torch.where((top_k <= 0) | (top_k > n), torch.full_like(top_k, n), top_k).unsqueeze(1)
    in_k = s >= s.gather(1, k - 1)
    n_k = in_k.sum(-1)
    before = e.cumsum(-1) - e
    kept = (e * in_k).sum(-1, keepdim=True)
    n_p = torch.where(top_p >= 1, n, (before < top_p.unsqueeze(1) * kept).sum(-1))
    n_m = torch.where(min_p > 0, (e >= min_p.unsqueeze(1)).sum(-1), n)
    last = torch.minimum(torch.minimum(n_k, n_p), n_m).clamp(min=1) - 1
    return sorted_logits.gather(1, last.unsqueeze(1)).squeeze(1).float()


if triton is not None:

    @triton.jit
    def _row_scale(Sorted, Temperature, TopK, row, n):
        """A row's 1 / T (IEEE, as PyTorch's), its k (n when off), s of its top token and of its k-th."""
        t = tl.load(Temperature + row)
        inv = tl.math.div_rn(1.0, tl.where(t > 0, t, 1.0))
        k = tl.load(TopK + row).to(tl.int32)
        k = tl.where((k <= 0) | (k > n), n, k)
        return inv, k, tl.load(Sorted).to(tl.float32) * inv, tl.load(Sorted + k - 1).to(tl.float32) * inv

    @triton.jit
    def _filter_partials(Sorted, Temperature, TopK, MinP, PartMass, PartInK, PartMinP, n, stride, chunk,
                         num_parts, BLOCK: tl.constexpr):
        """Per chunk of a sorted row: the top-k survivors' e (mass relative to the top token) and count, and the
        count of e >= min_p."""
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        base = Sorted + row * stride
        inv, k, s0, kth = _row_scale(base, Temperature, TopK, row, n)
        min_p = tl.load(MinP + row)
        mass = tl.zeros([BLOCK], tl.float32)
        in_k = tl.zeros([BLOCK], tl.int32)
        above_min_p = tl.zeros([BLOCK], tl.int32)
        for start in range(part * chunk, part * chunk + chunk, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            valid = cols < n
            s = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv
            e = tl.where(valid, tl.exp(s - s0), 0.0)
            inside = valid & (s >= kth)
            mass += tl.where(inside, e, 0.0)
            in_k += inside.to(tl.int32)
            above_min_p += (valid & (e >= min_p)).to(tl.int32)
        out = row * num_parts + part
        tl.store(PartMass + out, tl.sum(mass, 0))
        tl.store(PartInK + out, tl.sum(in_k, 0))
        tl.store(PartMinP + out, tl.sum(above_min_p, 0))

    @triton.jit
    def _filter_floor(Sorted, Temperature, TopK, TopP, MinP, PartMass, PartInK, PartMinP, Floor, n, stride, chunk,
                      num_parts, PARTS_P2: tl.constexpr, BLOCK: tl.constexpr):
        """``filter_floor_reference`` for one row from its chunks' partials: top-p's crossing is found among the
        chunks' prefix masses, and only that chunk is read again."""
        row = tl.program_id(0).to(tl.int64)
        base = Sorted + row * stride
        inv, k, s0, kth = _row_scale(base, Temperature, TopK, row, n)
        parts = tl.arange(0, PARTS_P2)
        ok = parts < num_parts
        pm = tl.load(PartMass + row * num_parts + parts, mask=ok, other=0.0)
        n_k = tl.sum(tl.load(PartInK + row * num_parts + parts, mask=ok, other=0), 0)
        min_p = tl.load(MinP + row)
        n_m = tl.where(min_p > 0, tl.sum(tl.load(PartMinP + row * num_parts + parts, mask=ok, other=0), 0), n)
        top_p = tl.load(TopP + row)
        target = top_p * tl.sum(pm, 0)
        n_p = n
        if top_p < 1:
            cum = tl.cumsum(pm, 0)
            c = tl.min(tl.where(ok & (cum >= target), parts, num_parts - 1), 0)  # the chunk where it is reached
            mass = tl.sum(tl.where(parts == c, cum - pm, 0.0), 0)  # e before that chunk: every token there counts
            count = tl.sum(tl.zeros([BLOCK], tl.int32), 0)
            for start in range(c * chunk, c * chunk + chunk, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                valid = cols < n
                s = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv
                e = tl.where(valid & (s >= kth), tl.exp(s - s0), 0.0)
                before = mass + tl.cumsum(e, 0) - e
                count += tl.sum((valid & (before < target)).to(tl.int32), 0)
                mass += tl.sum(e, 0)
            n_p = c * chunk + count
        last = tl.maximum(tl.minimum(tl.minimum(n_k, n_p), n_m), 1) - 1
        tl.store(Floor + row, tl.load(base + last).to(tl.float32))


def filter_floor(sorted_logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor) -> torch.Tensor:
    """``filter_floor_reference``; on the GPU two kernels: per-chunk partials of each sorted row (one read of it,
    spread over many programs), then one program per row that adds them up and reads again only the chunk where
    top-p's mass is reached (the ~20 passes over [B, V] of the reference are most of its time at large batches)."""
    if not _triton_for(sorted_logits) or sorted_logits.stride(-1) != 1:
        return filter_floor_reference(sorted_logits, temperature, top_k, top_p, min_p)
    b, n = sorted_logits.shape
    block = 1024
    parts, chunk = _row_chunks(n, block)
    dev = sorted_logits.device
    mass = torch.empty(b, parts, dtype=torch.float32, device=dev)
    in_k = torch.empty(b, parts, dtype=torch.int32, device=dev)
    above_min_p = torch.empty(b, parts, dtype=torch.int32, device=dev)
    floor = torch.empty(b, dtype=torch.float32, device=dev)
    if b:
        args = (sorted_logits, temperature, top_k)
        _filter_partials[(b, parts)](*args, min_p, mass, in_k, above_min_p, n, sorted_logits.stride(0), chunk, parts,
                                     BLOCK=block)
        _filter_floor[(b,)](*args, top_p, min_p, mass, in_k, above_min_p, floor, n, sorted_logits.stride(0), chunk,
                            parts, PARTS_P2=triton.next_power_of_2(parts), BLOCK=block)
    return floor


# ---- token metadata of a uniform batch (every request extends by n tokens), one kernel ---------------------------
def paged_slots(table: torch.Tensor, page_size: int, req_slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Physical KV slots of token ``positions`` of requests ``req_slots`` (same shape) through the page ``table``
    [requests, pages] (PyTorch ops; ``uniform_token_metadata`` does it in its kernel)."""
    pages = table[req_slots.long(), positions.long() // page_size].long()
    return pages * page_size + positions.long() % page_size


if triton is not None:

    @triton.jit
    def _uniform_tokens(Slots, SeqIn, Table, LogitsAt, SeqOut, ExtOut, StartOut, LogitsIdx, StoragePos, OutLoc,
                        n, page_size, num_req, seq_offset, seq_step, stride_slots, stride_seq, stride_table,
                        BLOCK: tl.constexpr, HAS_AT: tl.constexpr):
        b = tl.program_id(0)
        req = b % num_req
        slot = tl.load(Slots + req * stride_slots).to(tl.int64)
        seq = (tl.load(SeqIn + req * stride_seq) + seq_offset + (b // num_req) * seq_step).to(tl.int32)
        if tl.program_id(1) == 0:
            tl.store(SeqOut + b, seq)
            tl.store(ExtOut + b, n)
            tl.store(StartOut + b, b * n)
            if HAS_AT:
                tl.store(LogitsIdx + b, b * n + tl.load(LogitsAt + req).to(tl.int64))
            else:
                tl.store(LogitsIdx + b, (b * n + n - 1).to(tl.int64))
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = j < n
        pos = (seq - n + j).to(tl.int64)
        page = tl.load(Table + slot * stride_table + pos // page_size, mask=ok, other=0).to(tl.int64)
        tl.store(StoragePos + b * n + j, pos, mask=ok)
        tl.store(OutLoc + b * n + j, page * page_size + pos % page_size, mask=ok)


def uniform_token_metadata(slots: torch.Tensor, seq_lens: torch.Tensor, n: int, table: torch.Tensor,
                           page_size: int, *, seq_offset: int = 0, steps: int = 1, seq_step: int = 0,
                           logits_at: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """A batch where each of the B requests extends by ``n`` tokens ending at ``seq_lens + seq_offset``: (seq_lens
    int32, extend_lens int32 [B] = n, extend_start int32 [B] = b*n, logits row indices int64 [B] (each request's
    last token, or its token ``logits_at[b]``), storage positions int64 [B*n], KV slots int64 [B*n] through the page
    ``table`` [requests, pages] of request slots ``slots``). ``steps`` > 1 stacks the batch that many times (a
    multi-step draft round), step i's lengths ``i * seq_step`` further. One Triton kernel where it runs (the same
    values as the PyTorch ops below, which it replaces in every forward's metadata), else those ops."""
    b, device = slots.shape[0], slots.device
    if not (_triton_for(slots) and b):
        seq = (seq_lens.to(torch.int32) + seq_offset).repeat(steps)
        if steps > 1:
            seq = seq + torch.arange(steps, dtype=torch.int32, device=device).repeat_interleave(b) * seq_step
        rows = b * steps
        ext = torch.full((rows,), n, dtype=torch.int32, device=device)
        start = torch.arange(0, rows * n, n, dtype=torch.int32, device=device)
        at = ext - 1 if logits_at is None else logits_at.to(torch.int32).repeat(steps)
        storage_pos = ((seq - n).unsqueeze(1) + torch.arange(n, device=device)).reshape(-1).long()
        tok_req = slots.long().repeat(steps).unsqueeze(1).expand(rows, n).reshape(-1)
        out_loc = paged_slots(table, page_size, tok_req, storage_pos)
        return seq, ext, start, (start + at).long(), storage_pos, out_loc
    rows = b * steps
    seq = torch.empty(rows, dtype=torch.int32, device=device)
    ext, start = torch.empty_like(seq), torch.empty_like(seq)
    last = torch.empty(rows, dtype=torch.int64, device=device)
    storage_pos = torch.empty(rows * n, dtype=torch.int64, device=device)
    out_loc = torch.empty_like(storage_pos)
    block = min(1024, max(16, triton.next_power_of_2(n)))  # few distinct compiles whatever the prefill length
    _uniform_tokens[(rows, triton.cdiv(max(n, 1), block))](
        slots, seq_lens, table, logits_at.contiguous() if logits_at is not None else last, seq, ext, start, last,
        storage_pos,
        out_loc, n, page_size, b, seq_offset, seq_step, slots.stride(0), seq_lens.stride(0), table.stride(0),
        BLOCK=block, HAS_AT=logits_at is not None)
    return seq, ext, start, last, storage_pos, out_loc


# ---- a replayed step's inputs under the overlap schedule, one kernel ---------------------------------------------
if triton is not None:

    @triton.jit
    def _overlap_inputs(Slots, Pending, SeqLens, Counters, Advance, LastToken, SeqOut, Root, RootPos, CountersOut,
                        b, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < b
        slot = tl.load(Slots + i, mask=ok, other=0)
        ahead = tl.load(Pending + i, mask=ok, other=0) * tl.load(Advance + slot, mask=ok, other=0)
        seq = tl.load(SeqLens + i, mask=ok, other=0) + ahead
        tl.store(SeqOut + i, seq, mask=ok)
        tl.store(RootPos + i, seq - 1, mask=ok)
        tl.store(Root + i, tl.load(LastToken + slot, mask=ok, other=0), mask=ok)
        tl.store(CountersOut + i, tl.load(Counters + i, mask=ok, other=0) + ahead, mask=ok)


def overlap_step_inputs(slots: torch.Tensor, pending: torch.Tensor, seq_lens: torch.Tensor, counters: torch.Tensor,
                        advance: torch.Tensor, last_token: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A step's device inputs from the host's view of it (int64 [B] each): with ``pending`` (the step in flight
    appends ``advance[slot]`` tokens, 1 or a round's accepted drafts + 1, before this one runs) the sequence length
    and the sampling counter move ahead by that much. Returns (seq_lens, root token = ``last_token[slot]``, root
    position = seq_lens - 1, counters). One kernel where Triton runs, else the same PyTorch ops."""
    if not _triton_for(slots):
        ahead = pending * advance[slots]
        seq = seq_lens + ahead
        return seq, last_token[slots], seq - 1, counters + ahead
    b = slots.shape[0]
    slots, pending, seq_lens, counters = (x.contiguous() for x in (slots, pending, seq_lens, counters))  # views: as is
    seq, root, root_pos, ctr = (torch.empty(b, dtype=torch.int64, device=slots.device) for _ in range(4))
    if b:
        block = min(1024, max(16, triton.next_power_of_2(b)))
        _overlap_inputs[(triton.cdiv(b, block),)](slots, pending, seq_lens, counters, advance, last_token, seq, root,
                                                  root_pos, ctr, b, BLOCK=block)
    return seq, root, root_pos, ctr


# ---- a round's verdict: the walk down a verified draft tree and the emitted tokens, one kernel ------------------
if triton is not None:

    @triton.jit
    def _verdict(Parents, Tokens, Choice, Lse, Logits, Uniform, Accept, Path, Out, OutLogprob, d, max_depth, offset,
                 stride_p, stride_t, stride_c, stride_lse, stride_row, stride_path, stride_out, stride_olp,
                 D_P2: tl.constexpr, CHAIN: tl.constexpr, FORCED: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, D_P2)
        ok = j < d
        emit = j <= max_depth
        tokens = tl.load(Tokens + b * stride_t + j, mask=ok, other=-1)
        if FORCED:  # a chain's first floor(u + offset) drafts, whatever the target chose
            accept = tl.minimum(tl.maximum((tl.load(Uniform + b) + offset).to(tl.int64), 0), max_depth)
            path = j.to(tl.int64)
        else:
            if CHAIN:  # node j's parent is j - 1
                parents = tl.where(ok, j - 1, -2).to(tl.int64)
            else:
                parents = tl.load(Parents + b * stride_p + j, mask=ok, other=-2)
            cur = tl.zeros([], dtype=tl.int64)
            alive = tl.full([], 1, dtype=tl.int64)
            accept = tl.zeros([], dtype=tl.int64)
            path = tl.zeros([D_P2], dtype=tl.int64)
            for step in range(max_depth):
                want = tl.load(Choice + b * stride_c + cur)
                match = (parents == cur) & (tokens == want) & ok & (alive != 0)
                alive = tl.max(match.to(tl.int64), 0)
                cur = tl.where(alive != 0, tl.min(tl.where(match, j, D_P2), 0).to(tl.int64), cur)
                accept += alive
                path = tl.where(j == step + 1, cur, path)
        out = tl.load(Choice + b * stride_c + path, mask=emit, other=0)
        if FORCED:
            drafted = j < accept
            out = tl.where(drafted, tl.load(Tokens + b * stride_t + j + 1, mask=drafted & emit, other=0), out)
        logit = tl.load(Logits + (b * d + path) * stride_row + out, mask=emit, other=0.0).to(tl.float32)
        lse = tl.load(Lse + b * stride_lse + path, mask=emit, other=0.0)
        tl.store(Accept + b, accept)
        tl.store(Path + b * stride_path + j, path, mask=emit)
        tl.store(Out + b * stride_out + j, out, mask=emit)
        tl.store(OutLogprob + b * stride_olp + j, logit - lse, mask=emit)


def tree_verdict(parents: torch.Tensor | None, tokens: torch.Tensor, choice: torch.Tensor, lse: torch.Tensor,
                 logits: torch.Tensor, max_depth: int, forced: tuple[torch.Tensor, float] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A verified round's outcome for each request's draft tree ([B, D] ``parents``, ``tokens``; ``parents`` None:
    a chain, node j's parent is j - 1), given the target's choice after each node (``choice`` [B, D]), each node's
    log-normaliser (``lse`` [B, D] fp32) and logits ([B * D, V] rows, or [B, D, V]).

    Walks from the root along the child whose token is the target's choice at the current node (the first such
    child), for ``max_depth`` hops or until there is none. ``forced`` = (u [B] fp32, offset), a chain only (the
    benchmark's simulated acceptance): accept ``floor(u + offset)`` drafts (clamped to 0 .. max_depth) whatever the
    target chose, the emitted tokens being those drafts and then the target's choice.

    Returns (accepted drafts [B] int64; path [B, max_depth + 1] int64, node indices from the root, padded with the
    last; emitted tokens [B, max_depth + 1] int64, valid up to accept + 1; their target log-probs, fp32). One
    program per request where Triton runs (about 15 PyTorch ops otherwise)."""
    b, d = tokens.shape
    chain = parents is None
    if forced is not None and not chain:
        raise ValueError("a forced accept count takes a chain")
    rows = logits.reshape(b * d, -1)
    if not _triton_for(tokens):
        depth = torch.arange(max_depth + 1, device=tokens.device).expand(b, -1)
        if forced is not None:
            u, offset = forced
            accept, path = (u + offset).long().clamp_(0, max_depth), depth
            drafts = torch.cat([tokens[:, 1:], choice[:, -1:]], dim=1)  # node j + 1's token at j (the last: unread)
            out = torch.where(depth < accept.unsqueeze(1), drafts.gather(1, path), choice.gather(1, path))
        else:
            accept, path = _walk_reference(parents, tokens, choice, max_depth)
            out = choice.gather(1, path)
        row = torch.arange(b, device=tokens.device).unsqueeze(1) * d + path
        return accept, path, out, rows[row, out].float() - lse.gather(1, path)
    accept = torch.empty(b, dtype=torch.int64, device=tokens.device)
    path, out = (torch.empty(b, max_depth + 1, dtype=torch.int64, device=tokens.device) for _ in range(2))
    logprob = torch.empty(b, max_depth + 1, dtype=torch.float32, device=tokens.device)
    if b:
        parents = tokens if chain else parents  # (unread for a chain)
        u, offset = forced if forced is not None else (lse, 0.0)  # (unread unless forced)
        _verdict[(b,)](parents, tokens, choice, lse, rows, u.contiguous(), accept, path, out, logprob, d, max_depth,
                       float(offset), parents.stride(0), tokens.stride(0), choice.stride(0), lse.stride(0),
                       rows.stride(0), path.stride(0), out.stride(0), logprob.stride(0),
                       D_P2=max(16, triton.next_power_of_2(d)), CHAIN=chain, FORCED=forced is not None)
    return accept, path, out, logprob


def _walk_reference(parents: torch.Tensor | None, tokens: torch.Tensor, choice: torch.Tensor,
                    max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``tree_verdict``'s walk in PyTorch: (accept [B], path [B, max_depth + 1])."""
    b, d = tokens.shape
    if parents is None:
        parents = (torch.arange(d, device=tokens.device) - 1).expand(b, d)
    rows = torch.arange(b, device=parents.device)
    cur = torch.zeros(b, dtype=torch.int64, device=parents.device)
    alive = torch.ones(b, dtype=torch.bool, device=parents.device)
    accept = torch.zeros(b, dtype=torch.int64, device=parents.device)
    path = [cur]
    for _ in range(max_depth):
        want = choice[rows, cur]
        match = (parents == cur.unsqueeze(1)) & (tokens == want.unsqueeze(1))
        found = match.any(1) & alive
        cur = torch.where(found, match.int().argmax(1), cur)
        alive = found
        accept += found.long()
        path.append(cur)
    return accept, torch.stack(path, 1)


# ---- a round's outcome into the worker's per-request state, one kernel -------------------------------------------
if triton is not None:

    @triton.jit
    def _record_round(Slots, Accept, OutTokens, LastToken, Advance, b, stride_slots, stride_out, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < b
        slot = tl.load(Slots + i * stride_slots, mask=ok, other=0)
        accept = tl.load(Accept + i, mask=ok, other=0)
        tl.store(LastToken + slot, tl.load(OutTokens + i.to(tl.int64) * stride_out + accept, mask=ok), mask=ok)
        tl.store(Advance + slot, accept + 1, mask=ok)


def record_round(slots: torch.Tensor, accept: torch.Tensor, out_tokens: torch.Tensor, last_token: torch.Tensor,
                 advance: torch.Tensor) -> None:
    """After a speculative round: each request's newest token (``out_tokens[b, accept[b]]``, the bonus token after
    its accepted drafts) into ``last_token[slot]`` and the tokens the round appended (``accept + 1``) into
    ``advance[slot]`` (int64 tensors; slots distinct). One kernel where Triton runs, else four PyTorch ops."""
    if not _triton_for(slots) or out_tokens.stride(1) != 1:
        last_token[slots] = out_tokens.gather(1, accept.unsqueeze(1)).squeeze(1)
        advance[slots] = accept + 1
        return
    b = slots.shape[0]
    if b:
        block = min(1024, max(16, triton.next_power_of_2(b)))
        _record_round[(triton.cdiv(b, block),)](slots, accept.contiguous(), out_tokens, last_token, advance, b,
                                                slots.stride(0), out_tokens.stride(0), BLOCK=block)
