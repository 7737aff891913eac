"""The FlashInfer backend's pure-torch metadata on the CPU; flashinfer itself is not needed.

Wrappers: page lists and the packed tree mask, against the page table and the mask TorchNativeBackend applies.
XQA: the mask bits against TorchNativeBackend's rule (decode, chain verify, tree verify L == n, tree draft step
L > n with padded queries, block shorter than the new tokens), the bit packing as the kernel reads it, and the
backend's whole XQA path (metadata builder, query padding, the call) against an emulation of the kernel's contract,
with host lengths and without.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

import attention.flashinfer_wrappers as fimod
import attention.flashinfer_xqa as xqamod
from attention.base import AttentionLayerSpec
from attention.flashinfer_wrappers import packed_tree_mask, paged_kv_metadata
from attention.flashinfer_xqa import block_mask, pack_xqa_mask, xqa_mask_bits
from attention.torch_native import TorchNativeBackend
from tests.gpu.check_attention import _to_fp32_cpu, make_case
from workers.forward_batch import ForwardBatch
from workers.kv_cache import KVCache, PageTable
from workers.messages import ForwardMode


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
    TorchNativeBackend().init_forward_metadata(fb)
    return fb.attn_metadata.mask[:, 0]  # [B, n, S]


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


# ---- the XQA path ---------------------------------------------------------------------------------------------------
# The XQA kernel's contract as read from flashinfer 0.7.2.post1 (data/csrc/xqa/mha.cu, applyMaskFromInput and its
# call site; xqa_wrapper.cu; decode.py xqa_batch_decode_with_kv_cache), emulated on the CPU: the backend's whole
# XQA path (metadata builder, query padding, the call) runs against it here, and the real kernel against the same
# reference on the GPU (tests/gpu/check_attention.py).


def _xqa_emulator(query, kv_cache, workspace, block_tables, seq_lens, max_seq_len, bmm1_scale=1.0, bmm2_scale=1.0,
                  kv_layout="NHD", q_len_per_req=1, mask=None):
    """xqa_batch_decode_with_kv_cache for a 16-bit KV cache, from the kernel sources: row r of request b (query row
    b * q + r) sees every key before ``seq_len - q``, key ``seq_len - q + j`` iff bit j % 16 of uint16 word j // 16
    of mask row [b, r] is set, and no key from ``seq_len`` on; no mask when q == 1; scores scaled by
    bmm1_scale / bmm2_scale; pages through ``block_tables[b]`` (int32), lengths uint32. Returns [b, q, H, D] when
    q > 1 (the function views the query that way and returns its ``empty_like``), else [b, H, D]."""
    k_pages, v_pages = kv_cache
    q = q_len_per_req
    assert kv_layout == "NHD" and workspace.dtype == torch.uint8
    assert query.dtype == k_pages.dtype == v_pages.dtype and query.dtype in (torch.float16, torch.bfloat16)
    assert seq_lens.dtype == torch.uint32 and seq_lens.dim() == 1
    assert block_tables.dtype == torch.int32 and block_tables.is_contiguous()
    b, page = seq_lens.shape[0], k_pages.shape[1]
    assert block_tables.shape[0] == b and max_seq_len == block_tables.shape[1] * page
    assert query.is_contiguous() and query.shape[0] == b * q
    if q > 1:
        assert mask is not None and mask.dtype == torch.uint16 and mask.shape == (b, q, 2 * (-(-q // 32)))
        words = mask.view(torch.int16).to(torch.int64) & 0xFFFF
    lens = seq_lens.view(torch.int32).long()
    heads, dim = query.shape[1:]
    group = heads // k_pages.shape[2]
    qs = query.float().view(b, q, heads, dim)
    out = torch.empty_like(query).view(b, q, heads, dim)
    for i in range(b):
        s = int(lens[i])
        pos = torch.arange(s)
        pages = block_tables[i, pos // page].long()
        k = k_pages[pages, pos % page].float().repeat_interleave(group, 1)  # [s, H, D]
        v = v_pages[pages, pos % page].float().repeat_interleave(group, 1)
        visible = torch.ones(q, s, dtype=torch.bool)
        if q > 1:
            j = pos - (s - q)  # place in the window of the last q keys
            jc = j.clamp(min=0)
            bit = ((words[i][:, jc // 16] >> (jc % 16)) & 1) != 0  # [q, s]
            visible = torch.where(j >= 0, bit, visible)
        scores = torch.einsum("rhd,shd->hrs", qs[i], k) * (bmm1_scale / bmm2_scale)
        scores = scores.masked_fill(~visible, float("-inf"))
        out[i] = torch.einsum("hrs,shd->rhd", scores.softmax(-1), v).to(out.dtype)
    return out if q > 1 else out.view(b, heads, dim)  # as the real function: [b, q, H, D] when q > 1


@pytest.fixture
def xqa_backend(monkeypatch):
    """FlashInferBackend on the CPU with the emulator as its XQA kernel (no flashinfer needed)."""
    fake = types.ModuleType("flashinfer")
    fake.__version__ = "0.7.2.post1"
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(xqamod, "xqa_kernel_for_device", lambda: (_xqa_emulator, None))
    monkeypatch.setattr(xqamod, "XQA_WORKSPACE_BYTES", xqamod.XQA_SEMAPHORE_BYTES + 4096)
    return lambda verify_mode="decode": fimod.FlashInferBackend(verify_attention_mode=verify_mode)


HEADS, KV_HEADS, DIM = 4, 2, 16
LAYER = AttentionLayerSpec(0, HEADS, KV_HEADS, DIM, DIM**-0.5)
# short sequences, so that one key more or less visible moves a row's output well past the tolerance
XQA_CASES = {  # name: (check_attention mode, seq_lens, new tokens per request)
    "decode": ("decode", [1, 17, 40], [1, 1, 1]),
    "draft_extend": ("draft_extend", [4, 19], [4, 4]),
    "verify_chain": ("verify_chain", [5, 30], [5, 5]),
    "verify_tree": ("verify_tree", [8, 21, 33], [8, 8, 8]),
    "draft_step": ("draft_step", [13, 20], [4, 4]),  # L = 12 > n = 4: queries padded to 12 rows
}


def _case(name, page_size=16, dtype=torch.float16, seed=0):
    mode, seqs, news = XQA_CASES[name]
    return make_case(mode, page_size, seqs, news, HEADS, KV_HEADS, DIM, torch.device("cpu"), dtype,
                     torch.Generator().manual_seed(seed))


def _uniform_short_block_case():
    """A block shorter than the new tokens (L = 2 < n = 5): keys between them are causal."""
    g = torch.Generator().manual_seed(3)
    seq_lens, ext = [10, 30, 6], [5, 5, 5]
    kv = KVCache(1, 12, 16, KV_HEADS, DIM, torch.float16, "cpu")
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=g).half())
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=g).half())
    table = PageTable(3, 3, 16, "cpu")
    table.table.copy_((torch.randperm(11, generator=g)[:9] + 1).view(3, 3).to(torch.int32))
    tree_mask = torch.rand(3, 5, 2, generator=g) < 0.5
    fb = ForwardBatch.build(ForwardMode.TARGET_VERIFY, torch.zeros(15, dtype=torch.int64), [0, 1, 2], seq_lens, ext,
                            kv, table, tree_mask=tree_mask)
    return fb, torch.randn(15, HEADS, DIM, generator=g).half()


def _reference(fb, q):
    fb32, q32 = _to_fp32_cpu(fb, q)
    ref = TorchNativeBackend()
    ref.init_forward_metadata(fb32)
    return ref.forward(q32, None, None, LAYER, fb32)


@pytest.mark.parametrize("case", ["decode", "verify_chain", "verify_tree", "draft_step", "short_block"])
def test_xqa_mask_bits_follow_the_reference_rule(case):
    """For every request: the reference mask is all-visible before the last q keys (the kernel's rule there), and
    over the last q keys equals the real rows (the last n) of the XQA bits; padding rows see themselves."""
    fb, _ = _uniform_short_block_case() if case == "short_block" else _case(case)
    n, b = fb.extend_lens_cpu[0], fb.batch_size
    bits = xqa_mask_bits(block_mask(fb, n), b, n)
    length = 0 if fb.tree_mask is None else fb.tree_mask.shape[2]
    q = max(n, length)
    assert bits.shape == (b, q, q) and bits.dtype == torch.bool
    assert {"decode": 1, "verify_chain": 5, "verify_tree": 8, "draft_step": 12, "short_block": 5}[case] == q
    ref = _reference_mask(fb)
    for i, s in enumerate(fb.seq_lens_cpu):
        assert ref[i, :n, : s - q].all()
        assert torch.equal(ref[i, :n, s - q: s], bits[i, q - n:])
        assert not ref[i, :n, s:].any()
    assert bits[:, : q - n].diagonal(dim1=1, dim2=2).all()  # padding rows never see nothing


@pytest.mark.parametrize("q", [1, 5, 12, 16, 17, 32, 33, 63, 64])
def test_xqa_mask_packing_is_what_the_kernel_reads(q):
    g = torch.Generator().manual_seed(q)
    bits = torch.rand(3, q, q, generator=g) < 0.5
    packed = pack_xqa_mask(bits)
    words_per_row = 2 * (-(-q // 32))  # uint16 words, rows aligned to 32 bits
    assert packed.dtype == torch.uint8 and packed.shape == (3, q, 2 * words_per_row)
    mask = packed.view(torch.uint16)
    assert mask.shape == (3, q, words_per_row)
    words = mask.view(torch.int16).to(torch.int64) & 0xFFFF
    j = torch.arange(words_per_row * 16)
    unpacked = ((words[..., j // 16] >> (j % 16)) & 1) != 0  # the kernel: bit j % 16 of word j // 16
    assert torch.equal(unpacked[..., :q], bits)
    assert not unpacked[..., q:].any()  # padding bits are zero


@pytest.mark.parametrize("lens", ["host", "device"])
@pytest.mark.parametrize("case", list(XQA_CASES) + ["short_block"])
def test_xqa_path_matches_torch_native(xqa_backend, case, lens):
    """The backend's XQA path end to end against the emulated kernel when the lengths are on the device only (as in
    CUDA-graph replay and speculative rounds), against TorchNativeBackend on fp32 copies of the same data; with host
    lengths the same forward goes to a planned wrapper (each XQA query length is a JIT module of its own)."""
    fb, q = _uniform_short_block_case() if case == "short_block" else _case(case)
    expected = _reference(fb, q)
    if lens == "device":
        fb.seq_lens_cpu = None
    backend = xqa_backend()
    assert backend.supports_cuda_graph
    backend.init_forward_metadata(fb)
    if lens == "host":
        assert fb.attn_metadata.kernel != "xqa" and fb.attn_metadata.kernel.endswith("wrapper"), fb.attn_metadata
        return
    assert fb.attn_metadata.kernel == "xqa"
    out = backend.forward(q, None, None, LAYER, fb)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.float(), expected, atol=3e-3, rtol=3e-3)


def test_xqa_comparison_sees_a_one_position_mask_shift(xqa_backend):
    """Negative control: the same check fails when the block mask is shifted by one key."""
    fb, q = _case("draft_step")
    expected = _reference(fb, q)
    fb.tree_mask = fb.tree_mask.roll(1, dims=2)
    backend = xqa_backend()
    fb.seq_lens_cpu = None  # device lengths only: the forwards XQA takes
    backend.init_forward_metadata(fb)
    out = backend.forward(q, None, None, LAYER, fb)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(out.float(), expected, atol=3e-3, rtol=3e-3)


def test_xqa_reads_draft_round_tree_bits(xqa_backend):
    """A draft-round step's per-token int64 bitmask (``tree_bits``, bit j: block position j) in place of the bool
    mask."""
    fb, q = _case("draft_step")
    expected = _reference(fb, q)
    b, n, length = fb.tree_mask.shape
    fb.tree_bits = (fb.tree_mask.long() << torch.arange(length)).sum(-1).reshape(-1)
    fb.tree_len, fb.tree_mask, fb.seq_lens_cpu = length, None, None
    backend = xqa_backend()
    backend.init_forward_metadata(fb)
    assert fb.attn_metadata.q_len == length
    torch.testing.assert_close(backend.forward(q, None, None, LAYER, fb).float(), expected, atol=3e-3, rtol=3e-3)


def test_xqa_metadata_stays_with_its_batch(xqa_backend):
    """Each forward's lengths, page-table rows and mask live on its own batch (``fb.attn_metadata``): forwards one
    after the other on one backend each stay correct, and a later batch's metadata leaves an earlier one's intact."""
    backend = xqa_backend()
    done = []
    for case in ["verify_tree", "draft_step", "decode", "verify_chain"]:
        fb, q = _case(case, seed=7)
        expected = _reference(fb, q)
        fb.seq_lens_cpu = None  # device lengths only: the forwards XQA takes
        backend.init_forward_metadata(fb)
        assert fb.attn_metadata.kernel == "xqa"
        torch.testing.assert_close(backend.forward(q, None, None, LAYER, fb).float(), expected, atol=3e-3,
                                   rtol=3e-3)
        done.append((fb, q, expected))
    for fb, q, expected in done:  # run again after the other batches' metadata was built
        torch.testing.assert_close(backend.forward(q, None, None, LAYER, fb).float(), expected, atol=3e-3,
                                   rtol=3e-3)


def test_xqa_lengths_cover_the_query_window_on_padded_rows(xqa_backend):
    """A padded CUDA-graph row may be shorter than the q window; its length is raised to q (real rows unchanged)."""
    fb, _ = _case("draft_step")
    fb.seq_lens[0] = 3  # a padding row (seq_len < q = 12)
    backend = xqa_backend()
    fb.seq_lens_cpu = None  # device lengths only: the forwards XQA takes
    backend.init_forward_metadata(fb)
    assert fb.attn_metadata.seq_lens.view(torch.int32).tolist() == [12, 20]


def test_forwards_xqa_cannot_take_raise_without_host_lengths(xqa_backend):
    backend = xqa_backend()
    cpu = torch.device("cpu")

    def batch(mode, page, seqs, news):
        fb, _ = make_case(mode, page, seqs, news, HEADS, KV_HEADS, DIM, cpu, torch.float16, torch.Generator())
        return fb

    cases = {"page size 1": batch("decode", 1, [9, 20], [1, 1]),
             "EXTEND": batch("extend", 16, [40, 30], [10, 10]),
             "differ": batch("draft_extend", 16, [20, 30], [3, 4]),
             "query rows": batch("verify_chain", 16, [70, 90], [65, 65])}
    for words, fb in cases.items():
        backend.init_forward_metadata(fb)  # with host lengths: the wrappers' metadata
        assert fb.attn_metadata.kernel != "xqa"
        fb.seq_lens_cpu = None
        with pytest.raises(ValueError, match=words):
            backend.init_forward_metadata(fb)
    prefill = xqa_backend("prefill")
    assert not prefill.supports_cuda_graph
    fb = batch("verify_tree", 16, [20, 30], [8, 8])
    fb.seq_lens_cpu = None
    with pytest.raises(ValueError, match="prefill"):
        prefill.init_forward_metadata(fb)
    fb = batch("draft_extend", 16, [20, 30], [4, 4])
    fb.seq_lens_cpu = None
    prefill.init_forward_metadata(fb)  # DRAFT_EXTEND takes XQA in either verify mode
    assert fb.attn_metadata.kernel == "xqa"


def test_xqa_off_without_a_capable_gpu(monkeypatch):
    fake = types.ModuleType("flashinfer")
    fake.__version__ = "0.7.2.post1"
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    backend = fimod.FlashInferBackend()  # the real device check, on a machine without a CUDA device
    assert not backend.xqa_available and not backend.supports_cuda_graph
    fb, _ = _case("decode")
    fb.seq_lens_cpu = None
    with pytest.raises(ValueError, match="no CUDA device"):
        backend.init_forward_metadata(fb)


def test_xqa_workspace_holds_the_scratch_of_large_shapes():
    """132 SMs (H100), 64 query rows, 16 heads per KV head, head_dim 256: still inside the workspace."""
    assert xqamod.xqa_scratch_bytes(132, 64, 16, 256) < xqamod.XQA_WORKSPACE_BYTES - xqamod.XQA_SEMAPHORE_BYTES


def test_xqa_scratch_bound_guards_the_workspace(xqa_backend):
    """A shape whose multi-CTA scratch could overrun the workspace raises instead of running."""
    backend = xqa_backend()
    backend._num_sms = 132  # an H100's worth: 132 * ceil(12 * 2 / 32) * (64 * 16 + 1024) bytes > 4096
    fb, q = _case("draft_step")
    fb.seq_lens_cpu = None  # device lengths only: the forwards XQA takes
    backend.init_forward_metadata(fb)
    with pytest.raises(ValueError, match="scratch"):
        backend.forward(q, None, None, LAYER, fb)


def test_flashinfer_version_floor():
    from attention.flashinfer_wrappers import check_flashinfer_version

    check_flashinfer_version("0.7.2.post1")
    check_flashinfer_version("0.8.0")
    for old in ("0.6.18.post1", "0.7.1", "0.2.5"):
        with pytest.raises(ValueError, match="too old"):
            check_flashinfer_version(old)
