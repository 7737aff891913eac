"""A draft round's metadata built once (``DraftSteps``: stacked batches, one tree bitmask buffer advanced in place,
the backend's ``init_round_metadata``) gives every step the same attention mask and KV slots as building each step
on its own from the step's tree mask (the per-step way it replaced). Acceptance cannot catch a wrong draft mask
(verification is lossless, so it only lowers the accept rate), hence this direct comparison."""

from __future__ import annotations

import pytest
import torch

from attention.torch_native import TorchNativeBackend
from workers.forward_batch import DraftSteps, ForwardBatch
from workers.kv_cache import KVCache, PageTable
from workers.messages import ForwardMode


@pytest.mark.parametrize("lens", ["host", "device"])
@pytest.mark.parametrize("prefix", [0, 1])  # EAGLE (no visible root in the block) / standalone draft (root visible)
@pytest.mark.parametrize("k", [1, 3])
def test_draft_round_metadata_equals_per_step_build(lens, prefix, k):
    g = torch.Generator().manual_seed(0)
    b, steps, page, pages_per = 3, 4, 4, 20
    kv = KVCache(1, b * pages_per + 1, page, 1, 8, torch.float32, "cpu")
    table = PageTable(b, pages_per, page, "cpu")
    table.table.copy_((torch.randperm(b * pages_per, generator=g) + 1).view(b, pages_per).to(torch.int32))
    slots = torch.arange(b)
    m = torch.tensor([10, 23, 7])
    seq = torch.stack([m + prefix + (i + 1) * k for i in range(steps)])
    seq_lens = seq.tolist() if lens == "host" else seq
    base = (m - 5).tolist() if lens == "host" else m - 5  # step i's lengths: base + offset + (i + 1) * k
    positions = (m.unsqueeze(0) + torch.arange(steps).unsqueeze(1)).repeat_interleave(k, dim=1)
    origins = [torch.randint(0, k, (b, k), generator=g) for _ in range(steps)]

    rnd = DraftSteps.build(ForwardMode.DECODE, slots, base, k, kv, table, steps=steps, seq_offset=5 + prefix,
                           positions=positions, tree_prefix=prefix)
    once = TorchNativeBackend()
    once.init_round_metadata(rnd)
    eye = torch.eye(k, dtype=torch.bool).expand(b, k, k)
    scratch = torch.zeros(b, k, 0, dtype=torch.bool)
    per_step = TorchNativeBackend()
    for i, fb in enumerate(rnd):
        once.init_forward_metadata(fb)
        new_mask, new_slots = fb.attn_metadata.mask.clone(), fb.attn_metadata.kv_slots.clone()
        mask = torch.cat([scratch, eye], dim=2)
        if prefix:
            mask = torch.cat([torch.ones(b, k, 1, dtype=torch.bool), mask], dim=2)
        old = ForwardBatch.build(ForwardMode.DECODE, torch.zeros(b * k, dtype=torch.int64), slots, seq_lens[i],
                                 [k] * b, kv, table, positions=positions[i], tree_mask=mask if k > 1 else None)
        per_step.init_forward_metadata(old)
        ref = old.attn_metadata
        assert torch.equal(fb.seq_lens, old.seq_lens) and torch.equal(fb.out_cache_loc, old.out_cache_loc)
        assert torch.equal(fb.positions, old.positions) and torch.equal(fb.req_slots, slots)
        assert fb.seq_lens_cpu == (seq_lens[i] if lens == "host" else None)
        width = min(ref.mask.shape[-1], new_mask.shape[-1])
        assert torch.equal(ref.mask[..., :width], new_mask[..., :width]), (i, lens, prefix, k)
        assert torch.equal(ref.kv_slots[:, :width], new_slots[:, :width])
        assert not new_mask[..., width:].any() and not ref.mask[..., width:].any()  # nothing visible past
        if k > 1:
            assert new_mask.any(-1).all() and not new_mask.all()  # every row sees something, and the tree hides some
        scratch = torch.cat([scratch, eye], dim=2).gather(1, origins[i].unsqueeze(2).expand(b, k, scratch.shape[2] + k))
        if i + 1 < steps:
            rnd.advance(i + 1, origins[i])
