"""Counter-based noise for the sampler: a 32-bit hash of (seed, counter, column, stream), and Gumbel noise from it.
"""

from __future__ import annotations

import torch

from workers.kernels.launch import triton, use_triton

if triton is not None:
    import triton.language as tl



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
    if not use_triton(seeds):
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
