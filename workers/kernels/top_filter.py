"""Where a sampled row's top-k / top-p / min-p filtering ends: the floor logit of the kept set.
"""

from __future__ import annotations

import torch

from workers.kernels.argmax import row_chunks
from workers.kernels.launch import triton, use_triton

if triton is not None:
    import triton.language as tl



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
    if not use_triton(sorted_logits) or sorted_logits.stride(-1) != 1:
        return filter_floor_reference(sorted_logits, temperature, top_k, top_p, min_p)
    b, n = sorted_logits.shape
    block = 1024
    parts, chunk = row_chunks(n, block)
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
