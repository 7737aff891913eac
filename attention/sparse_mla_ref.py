"""The sparse-attention kernel interface (DeepSeek-V3.2: lightning indexer + top-k + MLA over the selected tokens),
as PyTorch references. The Triton kernels implement the same two functions with the same signatures, so a backend
swaps one for the other.

Every query row ``r`` belongs to request ``row_req[r]`` (its page-table row) and may see the tokens at positions
``t < row_len[r]`` of that request, a token at position ``t`` living in slot
``page_table[row_req[r], t // page_size] * page_size + t % page_size``. A speculative block (tree verify, tree
draft steps) narrows that: with ``tree_bits`` given, the block is the row's last ``tree_len`` positions
(``row_len[r] - tree_len .. row_len[r] - 1``), and a position in it is visible only where its bit (its index in
the block) of ``tree_bits[r]`` is set: the node itself and its ancestors (at most 63 positions). The Triton kernels
(``workers.kernels.sparse_mla``) take the same arguments.
"""

from __future__ import annotations

import torch

from workers.kernels.sparse_mla import quantize_index_queries


def visible_positions(page_table: torch.Tensor, row_req: torch.Tensor, row_len: torch.Tensor, page_size: int,
                      max_len: int, tree_bits: torch.Tensor | None = None,
                      tree_len: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [R, max_len] int64, visible [R, max_len] bool) of positions 0 .. max_len-1 of every row's request."""
    device = page_table.device
    t = torch.arange(max_len, device=device)
    pages = page_table[row_req.long()][:, (t // page_size).clamp(max=page_table.shape[1] - 1)]  # [R, L]
    slots = pages.long() * page_size + (t % page_size)
    visible = t.unsqueeze(0) < row_len.long().unsqueeze(1)
    if tree_bits is not None:
        rel = t.unsqueeze(0) - (row_len.long() - tree_len).unsqueeze(1)
        in_block = ((tree_bits.unsqueeze(1) >> rel.clamp(0, 62)) & 1) != 0
        visible &= (rel < 0) | in_block
    return slots, visible


def gather_index_keys(index_k_cache: torch.Tensor, slots: torch.Tensor, page_size: int, dim: int,
                      fp8: bool = False) -> torch.Tensor:
    """The fp32 indexer keys at ``slots`` (any shape) → [*slots.shape, dim]. ``fp8``: the cache is the uint8 page
    buffer of ``workers.kernels.sparse_mla.quantize_index_keys`` (each page's FP8 keys, then their fp32 scales),
    dequantized as FP8 value × scale."""
    if not fp8:
        return index_k_cache[slots].float()
    page, off = slots // page_size, slots % page_size
    keys = index_k_cache[:, :page_size * dim].unflatten(1, (page_size, dim))[page, off]
    scales = index_k_cache[:, page_size * dim:].unflatten(1, (page_size, 4))[page, off]
    return keys.view(torch.float8_e4m3fn).float() * scales.contiguous().view(torch.float32)


def indexer_topk(q: torch.Tensor, w: torch.Tensor, index_k_cache: torch.Tensor, page_table: torch.Tensor,
                 row_req: torch.Tensor, row_len: torch.Tensor, page_size: int, topk: int, *, fp8: bool = False,
                 tree_bits: torch.Tensor | None = None, tree_len: int = 0, rows_per_req: int = 1) -> torch.Tensor:
    """The lightning indexer's choice. q [R, Hi, Di], w [R, Hi] (the head weights with every scale folded in),
    index_k_cache [S, Di] (``fp8``: FP8 pages, ``gather_index_keys``, the queries quantized as the kernel's);
    returns the slots [R, topk] int32 of each row's ``topk`` highest-scoring visible tokens,
    score_t = sum_h w[r, h] * relu(q[r, h] . k[slot(t)]) (all of them when fewer are visible), padded with -1.
    Order within a row is unspecified. ``tree_bits`` ([R] int64) / ``tree_len``: the speculative block (module
    docstring); None: no row has one. ``rows_per_req``: how the rows group by request (the Triton kernel reads a
    group's keys once; the result does not depend on it)."""
    max_len = page_table.shape[1] * page_size
    slots, visible = visible_positions(page_table, row_req, row_len, page_size, max_len, tree_bits, tree_len)
    k = gather_index_keys(index_k_cache, slots, page_size, q.shape[-1], fp8)  # [R, L, Di]
    if fp8:  # the Triton indexer's FP8 x FP8 dot: queries quantized per (row, head), the scale folded into w
        q, q_scale = quantize_index_queries(q)
        w = w.float() * q_scale
    scores = torch.relu(torch.einsum("rhd,rld->rhl", q.float(), k))
    score = torch.einsum("rh,rhl->rl", w.float(), scores).masked_fill(~visible, float("-inf"))
    kk = min(topk, max_len)
    vals, idx = score.topk(kk, dim=-1)
    chosen = torch.where(vals > float("-inf"), slots.gather(1, idx), -1).to(torch.int32)
    if kk < topk:
        chosen = torch.cat([chosen, chosen.new_full((chosen.shape[0], topk - kk), -1)], dim=1)
    return chosen


def sparse_mla(q_latent: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor, slots: torch.Tensor,
               sm_scale: float, rows_per_req: int = 1) -> torch.Tensor:
    """MLA over each row's selected slots, in the latent space. q_latent [R, H, Dl] (q_nope absorbed through W_UK),
    q_rope [R, H, Dr], latent_cache [S, Dl + Dr] (the normalised latent, then the rotated shared rope key), slots
    [R, topk] int32 (-1: none). Returns softmax((q_latent.c + q_rope.k_rope) * sm_scale) . c, [R, H, Dl] (W_UV is
    applied by the caller). ``rows_per_req``: consecutive rows of one request (a kernel's launch may use it)."""
    dl = q_latent.shape[-1]
    kv = latent_cache[slots.long().clamp(min=0)].float()  # [R, K, Dl + Dr]
    c, kr = kv[..., :dl], kv[..., dl:]
    s = (torch.einsum("rhd,rkd->rhk", q_latent.float(), c) + torch.einsum("rhd,rkd->rhk", q_rope.float(), kr))
    s = (s * sm_scale).masked_fill((slots < 0).unsqueeze(1), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with nothing selected (padding) gives zeros
    return torch.einsum("rhk,rkd->rhd", p, c).to(q_latent.dtype)
