"""Greedy token and log-normaliser of each row of logits (with the Gumbel race of a sampled row), one pass.
"""

from __future__ import annotations

import torch

from workers.kernels.launch import pdl_launch, triton, use_triton
from workers.kernels.rng import gumbel_from_hash, hash32

if triton is not None:
    import triton.language as tl

    from workers.kernels.launch import pdl_start
    from workers.kernels.rng import _hash_base, _mix32


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


def row_chunks(n: int, block: int) -> tuple[int, int]:
    """(programs, positions each) that spread a row of ``n`` over up to 64 programs of at least 4 blocks."""
    parts = max(1, min(64, triton.cdiv(n, 4 * block)))
    chunk = triton.cdiv(triton.cdiv(n, parts), block) * block
    return triton.cdiv(n, chunk), chunk


def greedy_with_logprob(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax [B] int64, its log-probability [B] fp32) of logits [B, V]: the two kernels of ``argmax_logsumexp``
    write the log-probability too (max - logsumexp), so greedy sampling needs no gather afterwards."""
    if not use_triton(logits) or logits.stride(-1) != 1:
        x = logits.float()
        return x.argmax(-1), x.max(-1).values - torch.logsumexp(x, dim=-1)
    ids, _, logprob = _argmax_lse(logits, None, None, with_logprob=True)
    return ids, logprob


def argmax_logsumexp(logits: torch.Tensor, gumbel: tuple | None = None, floor: torch.Tensor | None = None,
                     remap: torch.Tensor | None = None, ids_out: torch.Tensor | None = None,
                     ids_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax [B] int64, the first index on ties, as torch's; logsumexp [B] fp32) of logits [B, V]. On the GPU two
    kernels spread each row over many programs (PyTorch reduces a row of a 128k vocabulary in one block).
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
    if gumbel is not None and not (use_triton(logits) and logits.stride(-1) == 1):
        temp, seeds, counters, stream = gumbel
        noise = gumbel_from_hash(hash32(seeds, counters, logits.shape[1], stream))
        x = logits.float()
        if floor is not None:
            x = torch.where(x >= floor.unsqueeze(1), x, float("-inf"))
        logits, gumbel = x / temp.unsqueeze(1) + noise, None
    if not use_triton(logits) or logits.stride(-1) != 1:
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
    parts, chunk = row_chunks(n, block)
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
