"""The sparse MLA backend's draft-round metadata, built once per round from the stacked batch
(``SparseTorchNativeBackend.init_round_metadata``), gives every step's rows exactly the positions the per-forward
metadata of that step built on its own (from its tree mask) gives: the same request rows, and the same visible
slots. Verification is lossless, so a wrong draft row would only lower the accept rate: hence this direct check."""

from __future__ import annotations

import pytest
import torch

from attention.sparse_mla_ref import visible_positions
from attention.sparse_torch_native import SparseTorchNativeBackend
from workers.forward_batch import DraftSteps, ForwardBatch
from workers.kv_cache import MLAKVCache, PageTable
from workers.messages import ForwardMode


def _visible(m, table: PageTable) -> list[set[int]]:
    slots, vis = visible_positions(table.table, m.row_req, m.row_len, table.page_size, table.table.shape[1] *
                                   table.page_size, m.tree_bits, m.tree_len)
    return [set(slots[r][vis[r]].tolist()) for r in range(slots.shape[0])]


@pytest.mark.parametrize("lens", ["host", "device"])
@pytest.mark.parametrize("prefix", [0, 1])
@pytest.mark.parametrize("k", [1, 3])
def test_sparse_round_rows_equal_per_step_rows(lens, prefix, k):
    g = torch.Generator().manual_seed(0)
    b, steps, page, pages_per = 3, 4, 4, 20
    kv = MLAKVCache(1, b * pages_per + 2, page, 8, 16, torch.float32, "cpu")
    table = PageTable(b + 1, pages_per, page, "cpu")
    table.table.copy_((torch.randperm((b + 1) * pages_per, generator=g) + 1).view(b + 1, pages_per).to(torch.int32))
    slots = torch.tensor([2, 0, 3])  # page-table rows out of order
    m = torch.tensor([10, 23, 7])
    seq = torch.stack([m + prefix + (i + 1) * k for i in range(steps)])
    seq_lens = seq.tolist() if lens == "host" else seq
    base = (m - 5).tolist() if lens == "host" else m - 5
    positions = (m.unsqueeze(0) + torch.arange(steps).unsqueeze(1)).repeat_interleave(k, dim=1)
    origins = [torch.randint(0, k, (b, k), generator=g) for _ in range(steps)]
    rnd = DraftSteps.build(ForwardMode.DECODE, slots, base, k, kv, table, steps=steps, seq_offset=5 + prefix,
                           positions=positions if k > 1 else None, tree_prefix=prefix if k > 1 else 0)
    backend = SparseTorchNativeBackend()
    backend.init_round_metadata(rnd)
    eye = torch.eye(k, dtype=torch.bool).expand(b, k, k)
    scratch = torch.zeros(b, k, 0, dtype=torch.bool)
    for i, fb in enumerate(rnd):
        backend.init_forward_metadata(fb)
        once = fb.attn_metadata
        assert once is fb.round_metadata and once.row_req.dtype == once.row_len.dtype == torch.int32
        mask = torch.cat([scratch, eye], dim=2)
        if prefix and k > 1:
            mask = torch.cat([torch.ones(b, k, 1, dtype=torch.bool), mask], dim=2)
        own = ForwardBatch.build(ForwardMode.DECODE, torch.zeros(b * k, dtype=torch.int64), slots, seq_lens[i],
                                 [k] * b, kv, table, positions=positions[i] if k > 1 else None,
                                 tree_mask=mask if k > 1 else None)
        backend.init_forward_metadata(own)
        ref = own.attn_metadata
        assert torch.equal(once.row_req, ref.row_req) and once.rows_per_req == ref.rows_per_req
        got, want = _visible(once, table), _visible(ref, table)
        assert got == want, (i, lens, prefix, k)
        assert all(len(v) > int(seq[i].min()) - (prefix + (i + 1) * k) for v in got)  # (the context before the block)
        scratch = torch.cat([scratch, eye], dim=2).gather(1, origins[i].unsqueeze(2).expand(b, k, scratch.shape[2] + k))
        if i + 1 < steps:
            rnd.advance(i + 1, origins[i])
