"""The reference backend attends one-token rows (decode rows riding in a prefill step) apart from the longer chunks
of the same batch: the same output as one batch padded to the longest chunk."""

from __future__ import annotations

import torch

from attention.base import AttentionLayerSpec
from attention.torch_native import TorchNativeBackend
from workers.forward_batch import ForwardBatch
from workers.kv_cache import KVCache, PageTable
from workers.messages import ForwardMode


def test_one_token_rows_attend_apart_with_the_padded_batchs_output():
    torch.manual_seed(0)
    page, kv_heads, heads, dim = 4, 2, 4, 16
    seq_lens, new = [37, 9, 60, 5, 23], [1, 9, 1, 3, 1]  # decode rows and chunks, a whole prompt among them
    pages_per = -(-max(seq_lens) // page)
    kv = KVCache(1, len(seq_lens) * pages_per + 1, page, kv_heads, dim, torch.float32, "cpu")
    kv.k[0].normal_()
    kv.v[0].normal_()
    table = PageTable(len(seq_lens), pages_per, page, "cpu")
    table.table.copy_((torch.randperm(len(seq_lens) * pages_per) + 1).view(len(seq_lens), pages_per).to(torch.int32))
    fb = ForwardBatch.build(ForwardMode.EXTEND, torch.zeros(sum(new), dtype=torch.int64), list(range(len(new))),
                            seq_lens, new, kv, table)
    fb.kv_cache = kv
    q = torch.randn(sum(new), heads, dim)
    layer = AttentionLayerSpec(0, heads, kv_heads, dim, dim ** -0.5)
    be = TorchNativeBackend()
    be.init_forward_metadata(fb)
    assert [len(toks) for toks, _ in fb.attn_metadata.groups] == [3, 12]
    split = be._attend(q, layer, fb)
    fb.attn_metadata = be._metadata(fb, fb.seq_lens, fb.extend_lens, fb.extend_start, fb.req_slots, new, seq_lens,
                                    sum(new))  # one batch, every row padded to 9 queries
    padded = be._attend(q, layer, fb)
    torch.testing.assert_close(split, padded, atol=1e-6, rtol=1e-5)
    # and each one-token row is its own causal attention over its whole context
    slots = table.slots(torch.tensor([0] * 37), torch.arange(37))
    k, v = kv.k[0][slots].repeat_interleave(2, 1), kv.v[0][slots].repeat_interleave(2, 1)  # [S, H, D]
    att = torch.softmax(torch.einsum("hd,shd->hs", q[0], k) * dim ** -0.5, -1)
    torch.testing.assert_close(split[0], torch.einsum("hs,shd->hd", att, v), atol=1e-5, rtol=1e-5)
