"""The FlashInfer backend's pure-torch metadata (page lists, packed tree mask) on the CPU, against the page table and
the mask TorchNativeBackend applies; flashinfer itself is not needed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attention.flashinfer_backend import packed_tree_mask, paged_kv_metadata
from attention.torch_native import TorchNativeBackend
from tools.check_attention import make_case
from workers.forward_batch import ForwardBatch, ForwardMode
from workers.kv_cache import KVCache, PageTable


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_page_lists_address_every_stored_position(page_size):
    g = torch.Generator().manual_seed(page_size)
    seq_lens, req_slots = [1, 16, 17, 40], torch.tensor([3, 0, 2, 1])
    max_pages = -(-max(seq_lens) // page_size)
    table = PageTable(4, max_pages, page_size, "cpu")
    table.table.copy_((torch.randperm(4 * max_pages, generator=g) + 1).view(4, max_pages).to(torch.int32))
    kv_indptr, kv_indices, last_page_len = paged_kv_metadata(seq_lens, page_size, req_slots, table.table)
    assert kv_indptr.dtype == kv_indices.dtype == last_page_len.dtype == torch.int32
    for b, s in enumerate(seq_lens):
        pages = kv_indices[kv_indptr[b]:kv_indptr[b + 1]].long()
        assert len(pages) == -(-s // page_size) and 1 <= last_page_len[b] <= page_size
        assert (len(pages) - 1) * page_size + last_page_len[b] == s
        pos = torch.arange(s)
        expected = table.slots(req_slots[b].expand(s), pos)
        assert torch.equal(pages[pos // page_size] * page_size + pos % page_size, expected)


def _reference_mask(fb: ForwardBatch) -> torch.Tensor:
    ref = TorchNativeBackend()
    ref.init_forward_metadata(fb)
    return ref._mask[:, 0]  # [B, n, S]


def _short_block_case():
    """Mixed lengths and a block shorter than the new tokens (causal keys between them)."""
    g = torch.Generator().manual_seed(1)
    seq_lens, ext = [10, 30, 6], [3, 5, 5]
    kv = KVCache(1, 12, 4, 1, 8, torch.float32, "cpu")
    table = PageTable(3, 8, 4, "cpu")
    tree_mask = torch.rand(3, 5, 2, generator=g) < 0.5
    return ForwardBatch.build(ForwardMode.TARGET_VERIFY, torch.zeros(sum(ext), dtype=torch.int64), [0, 1, 2],
                              seq_lens, ext, kv, table, tree_mask=tree_mask)


@pytest.mark.parametrize("case", ["verify_tree", "draft_step", "short_block"])
def test_packed_mask_is_segment_packbits_of_the_reference_mask(case):
    if case == "short_block":
        fb = _short_block_case()
    else:
        seq_lens, n_new = {"verify_tree": ([8, 21, 150], [8, 8, 8]), "draft_step": ([40, 13], [4, 4])}[case]
        fb, _ = make_case(case, 16, seq_lens, n_new, 2, 1, 8, torch.device("cpu"), torch.float32,
                          torch.Generator().manual_seed(0))
    packed, byte_indptr = packed_tree_mask(fb.tree_mask, fb.seq_lens_cpu, fb.extend_lens_cpu)
    ref = _reference_mask(fb)
    expected = [np.packbits(ref[b, :n, :s].reshape(-1).numpy(), bitorder="little")
                for b, (n, s) in enumerate(zip(fb.extend_lens_cpu, fb.seq_lens_cpu))]
    assert byte_indptr.tolist() == np.cumsum([0] + [len(e) for e in expected]).tolist()
    assert packed.dtype == torch.uint8 and packed.numpy().tolist() == np.concatenate(expected).tolist()
