"""DeepSeek-V3.2 sparse attention kernels (``workers.kernels.sparse_mla``): the indexer scores, the exact top-k and
the sparse MLA, run on the CPU through Triton's interpreter (in a subprocess), each against its PyTorch reference;
and the draft round's rows built once against the per-step build."""

from __future__ import annotations

import itertools

import pytest

from tests.kernels.interpreter import assert_interpreting

pytest.importorskip("triton")


def paged_case(g, lens_per_req, page_size, dim, extra_pages=3):
    """A page table over scattered pages (page 0 unused) for requests of the given lengths, and bf16-valued fp32
    keys for every slot."""
    import torch

    pages_per = max(-(-n // page_size) for n in lens_per_req) + 1
    b = len(lens_per_req)
    num_pages = b * pages_per + 1 + extra_pages
    perm = torch.randperm(num_pages - 1, generator=g)[:b * pages_per] + 1
    table = perm.view(b, pages_per).to(torch.int32)
    keys = torch.randn(num_pages * page_size, dim, generator=g).bfloat16().float()
    return table, keys


def rows_of(lens_per_req, rows_spec):
    """row_req / row_len [R] int32 from (request, length) pairs."""
    import torch

    req = torch.tensor([r for r, _ in rows_spec], dtype=torch.int32)
    ln = torch.tensor([n for _, n in rows_spec], dtype=torch.int32)
    assert all(n <= lens_per_req[r] for r, n in rows_spec)
    return req, ln


def sorted_rows(x):
    return x.sort(dim=1).values


def check_topk(g) -> None:
    """The radix top-k against the stable-sort reference on the same scores: rows shorter than, equal to and longer
    than top-k, an empty row, heavy ties (values from a small set: the lower positions win), -inf (masked) entries,
    negative scores, and page sizes 64 and 24; each also through the sampled threshold's two paths (a sample of 64, so
    rows over 160 are sampled), including rows whose sample misleads it (too few kept, too many) and fall back."""
    import torch

    from workers.kernels.sparse_mla import positions_to_slots, topk_positions_reference, topk_slots

    for page_size in (64, 24):
        lens = [300, 200, 70]
        table, _ = paged_case(g, lens, page_size, 16)
        cap = table.shape[1] * page_size
        topk = 40
        spec = [(0, 300), (0, 40), (0, 17), (1, 200), (1, 41), (2, 70), (2, 0), (0, 299), (1, 39), (2, 1)]
        row_req, row_len = rows_of(lens, spec)
        r = len(spec)
        scores = torch.randn(r, cap, generator=g) * 3
        scores[3] = torch.randint(0, 5, (cap,), generator=g).float()  # ties across the threshold
        scores[7] = -scores[7].abs()  # all negative
        scores[5, ::3] = float("-inf")  # masked positions (a tree row's invisible nodes)
        scores[8, :] = 1.0  # all equal
        scores[:, :] = torch.where(torch.arange(cap)[None, :] < row_len[:, None], scores, torch.nan)  # not read
        ref = positions_to_slots(topk_positions_reference(scores, row_len, topk), table, row_req, page_size)
        # one program a row; rows split over programs (their slots in position order too); each path
        for splits, method in itertools.product((1, 3), ("radix", "sampled", "ordered")):
            got = topk_slots(scores, table, row_req, row_len, page_size, topk, block=64, num_splits=splits,
                             method=method, sample=64)
            assert got.dtype == torch.int32 and got.shape == (r, topk)
            assert torch.equal(got, ref), (page_size, splits, method, got, ref)
            n = (got >= 0).sum(1)
            assert n.tolist() == [40, 40, 17, 40, 40, 40, 0, 40, 39, 1], n
    # against torch.topk on a long row with no ties, several blocks and k over a block
    scores = torch.randn(2, 5000, generator=g)
    table = torch.arange(1, 5000 // 50 + 1, dtype=torch.int32).view(1, -1)
    row_req, row_len = torch.zeros(2, dtype=torch.int32), torch.tensor([5000, 3333], dtype=torch.int32)
    for splits, method in ((1, "radix"), (4, "radix"), (4, "sampled"), (4, "ordered")):
        got = topk_slots(scores, table, row_req, row_len, 50, 700, block=512, num_splits=splits, method=method)
        for i in range(2):
            idx = torch.topk(scores[i, :row_len[i]], 700).indices
            want = positions_to_slots(idx[None], table, row_req[:1], 50)
            assert torch.equal(got[i].sort().values, want[0].sort().values), (splits, method, i)
    # samples that mislead the threshold: the sampled positions high (it keeps them alone: too few for a top-k of
    # 300, so the row's select reads the whole row; enough for 100) or low (it keeps nearly every score: too many)
    n, sample = 5000, 256
    at = torch.arange(sample) * n // sample
    scores = torch.randn(3, n, generator=g)
    scores[0, at], scores[1, at], scores[2, at] = 10.0, 10.0, -10.0
    row_req, row_len = torch.zeros(3, dtype=torch.int32), torch.full((3,), n, dtype=torch.int32)
    for k in (100, 300):
        ref = positions_to_slots(topk_positions_reference(scores, row_len, k), table, row_req, 50)
        for method in ("sampled", "ordered"):
            got = topk_slots(scores, table, row_req, row_len, 50, k, block=512, num_splits=3, method=method,
                             sample=sample)
            assert torch.equal(got, ref), (k, method)


def check_indexer(g) -> None:
    """Indexer scores vs the reference in fp32 (several splits, one split; tree-style rows: many rows of one
    request with different lengths; a tree row's bitmask), FP8 keys vs the reference on the same FP8 values
    (tight) and vs the bf16 keys (loose), and the whole indexer_topk: its slots are exactly the top-k of its own
    scores and within tolerance of the reference's selection."""
    import torch

    from workers.kernels.sparse_mla import (dequantize_index_keys, indexer_scores, indexer_scores_reference,
                                            indexer_topk, indexer_topk_reference, quantize_index_keys, topk_slots)

    heads, dim = 4, 16
    for page_size in (64, 24):
        lens = [260, 90]
        table, keys = paged_case(g, lens, page_size, dim)
        # a decode row, a verify-style run of rows of request 0 (one per draft token), request 1's rows
        spec = [(0, 256), (0, 257), (0, 258), (0, 259), (0, 260), (1, 90), (1, 5), (1, 1), (0, 0)]
        row_req, row_len = rows_of(lens, spec)
        r = len(spec)
        q = torch.randn(r, heads, dim, generator=g)
        w = torch.randn(r, heads, generator=g) * dim ** -0.5
        ref = indexer_scores_reference(q, w, keys, table, row_req, row_len, page_size)
        # (each tile loaded where scored, or the next carried in registers: the FP8 and the bf16 defaults)
        for splits, carry in ((None, None), (1, False), (3, True), (3, False)):
            got = indexer_scores(q, w, keys, table, row_req, row_len, page_size, num_splits=splits, block_n=32,
                                 carry=carry)
            vis = torch.arange(ref.shape[1])[None, :] < row_len[:, None]
            torch.testing.assert_close(got[vis], ref[vis], rtol=1e-5, atol=1e-5)
        # tree rows: the last 4 positions are a tree block, each row sees its own nodes
        bits = torch.tensor([0b1, 0b11, 0b101, 0b1001, 0b1111, 0b1, 0b1, 0b1, 0b0], dtype=torch.int64)
        got = indexer_scores(q, w, keys, table, row_req, row_len, page_size, tree_bits=bits, tree_len=4,
                             block_n=32)
        ref_t = indexer_scores_reference(q, w, keys, table, row_req, row_len, page_size, tree_bits=bits, tree_len=4)
        vis = torch.arange(ref.shape[1])[None, :] < row_len[:, None]
        assert torch.equal(torch.isinf(got[vis]), torch.isinf(ref_t[vis]))
        assert torch.isinf(ref_t[vis]).sum() > 0
        fin = vis & torch.isfinite(ref_t)
        torch.testing.assert_close(got[fin], ref_t[fin], rtol=1e-5, atol=1e-5)
        # FP8 keys with per-token scales
        packed = quantize_index_keys(keys, page_size)
        assert packed.shape == (keys.shape[0] // page_size, page_size * (dim + 4))
        assert (dequantize_index_keys(packed, page_size, dim) - keys).abs().max() <= keys.abs().max() / 8
        got8 = indexer_scores(q, w, packed, table, row_req, row_len, page_size, fp8=True, block_n=32)
        ref8 = indexer_scores_reference(q, w, packed, table, row_req, row_len, page_size, fp8=True)
        torch.testing.assert_close(got8[vis], ref8[vis], rtol=1e-5, atol=1e-5)
        carried = indexer_scores(q, w, packed, table, row_req, row_len, page_size, fp8=True, block_n=32, carry=True)
        assert torch.equal(carried[vis], got8[vis])
        scale = ref[vis].abs().max()
        assert (got8[vis] - ref[vis]).abs().max() < 0.1 * scale, (got8[vis] - ref[vis]).abs().max() / scale
        # the whole selection
        for topk in (16, 300):
            sl = indexer_topk(q, w, keys, table, row_req, row_len, page_size, topk, block_n=32, topk_block=64)
            own = indexer_scores(q, w, keys, table, row_req, row_len, page_size, block_n=32)
            assert torch.equal(sorted_rows(sl), sorted_rows(topk_slots(own, table, row_req, row_len, page_size,
                                                                       topk)))
            want = indexer_topk_reference(q, w, keys, table, row_req, row_len, page_size, topk)
            assert torch.equal((sl >= 0).sum(1), (want >= 0).sum(1))
            assert torch.equal((sl >= 0).sum(1), row_len.clamp(max=topk))
            same = [len(set(a.tolist()) & set(b.tolist())) / max(1, len(set(b.tolist()))) for a, b in zip(sl, want)]
            assert min(same) >= 0.95, same
            if topk >= 260:  # every visible slot
                assert all(set(a.tolist()) == set(b.tolist()) for a, b in zip(sl, want))


def check_grouped(g) -> None:
    """Rows grouped by request (``rows_per_req``: each key tile read once for a verify's rows, the group's queries
    in pieces of 1, 2 or 4 rows a dot): the same scores and selections as one program a row, with rows of
    different lengths in a group, tree bits, a short last group, FP8 keys, and page sizes whose pages a tile does
    (64) and does not (24) cover."""
    import torch

    from workers.kernels.sparse_mla import (indexer_scores, indexer_scores_reference, indexer_topk,
                                            indexer_topk_reference, quantize_index_keys)

    heads, dim = 4, 16
    for page_size in (64, 24):
        lens = [200, 90, 130]
        table, keys = paged_case(g, lens, page_size, dim)
        packed = quantize_index_keys(keys, page_size)
        # groups of 3: request 0's verify rows, request 1's (lengths in any order, one empty), request 2's short group
        spec = [(0, 198), (0, 199), (0, 200), (1, 90), (1, 0), (1, 45), (2, 129), (2, 130)]
        row_req, row_len = rows_of(lens, spec)
        r = len(spec)
        q = torch.randn(r, heads, dim, generator=g)
        w = torch.randn(r, heads, generator=g) * dim ** -0.5
        bits = torch.tensor([0b1, 0b11, 0b111, 0b1, 0b0, 0b101, 0b01, 0b10], dtype=torch.int64)
        vis = torch.arange(table.shape[1] * page_size)[None, :] < row_len[:, None]
        for fp8, k in ((False, keys), (True, packed)):
            for tree in (None, bits):
                ref = indexer_scores_reference(q, w, k, table, row_req, row_len, page_size, fp8=fp8, tree_bits=tree,
                                               tree_len=3)
                one = indexer_scores(q, w, k, table, row_req, row_len, page_size, fp8=fp8, tree_bits=tree,
                                     tree_len=3, block_n=16)
                for splits, piece, carry in ((None, None, None), (4, 1, not fp8), (None, 2, not fp8)):
                    got = indexer_scores(q, w, k, table, row_req, row_len, page_size, fp8=fp8, tree_bits=tree,
                                         tree_len=3, rows_per_req=3, num_splits=splits, block_n=16, piece=piece,
                                         min_groups=1, carry=carry)
                    fin = vis & torch.isfinite(ref)
                    assert torch.equal(torch.isinf(got[vis]), torch.isinf(ref[vis]))
                    assert torch.equal(torch.isinf(got[vis]), torch.isinf(one[vis]))
                    torch.testing.assert_close(got[fin], one[fin], rtol=1e-6, atol=1e-6)
                    torch.testing.assert_close(got[fin], ref[fin], rtol=1e-5, atol=1e-5)
                if tree is not None:
                    assert torch.isinf(ref[vis]).sum() > 0
        for topk in (20, 250):
            want = indexer_topk_reference(q, w, keys, table, row_req, row_len, page_size, topk, tree_bits=bits,
                                          tree_len=3)
            for per in (1, 3):
                sl = indexer_topk(q, w, keys, table, row_req, row_len, page_size, topk, tree_bits=bits, tree_len=3,
                                  rows_per_req=per, block_n=16, topk_block=64)
                assert torch.equal((sl >= 0).sum(1), (want >= 0).sum(1)), (topk, per)
                same = [len(set(a.tolist()) & set(b.tolist())) / max(1, len(set(b.tolist())))
                        for a, b in zip(sl, want)]
                assert min(same) >= 0.95, same


def check_sparse_mla(g) -> None:
    """Sparse MLA vs the reference: fp32 with one split (output written directly) and several (merged), the latent
    output split over two programs, the transposed dots, several head blocks a row (heads not a multiple of the head
    block), -1 slots scattered and a row with none, a latent cache row with padding. (Not bf16: this Triton's
    interpreter computes bf16 ``tl.dot`` wrongly; the GPU check covers it.)"""
    import torch

    from workers.kernels.sparse_mla import sparse_mla, sparse_mla_reference

    rows, heads, dl, dr, topk, slots_n = 5, 6, 32, 16, 40, 300
    cache = torch.randn(slots_n, dl + dr, generator=g)
    slots = torch.stack([torch.randperm(slots_n, generator=g)[:topk] for _ in range(rows)]).to(torch.int32)
    slots[1, 30:] = -1  # a short selection padded at the end
    slots[2, ::3] = -1  # holes
    slots[3] = -1  # nothing selected
    ql = torch.randn(rows, heads, dl, generator=g)
    qr = torch.randn(rows, heads, dr, generator=g)
    scale = (dl + dr) ** -0.5
    ref = sparse_mla_reference(ql, qr, cache, slots, scale)
    assert ref[3].abs().max() == 0
    for splits in (1, 3, 8):
        got = sparse_mla(ql, qr, cache, slots, scale, num_splits=splits, block_n=16)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for splits in (1, 3):  # two programs a head block, each keeping half of the latent output
        got = sparse_mla(ql, qr, cache, slots, scale, num_splits=splits, block_n=16, lat_split=2)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # several head blocks a row (the last one partial), each with one or two latent parts: a row's programs are
    # consecutive in the grid, so their indices must decode to every (row, head block, part) once
    ql40 = torch.randn(rows, 40, dl, generator=g)
    qr40 = torch.randn(rows, 40, dr, generator=g)
    ref40 = sparse_mla_reference(ql40, qr40, cache, slots, scale)
    for splits, ls, hn, rf in ((1, 1, False, False), (3, 2, False, False), (1, 1, True, False), (3, 2, True, False),
                               (8, 1, True, False), (3, 2, False, True)):
        got = sparse_mla(ql40, qr40, cache, slots, scale, num_splits=splits, block_h=16, block_n=16, lat_split=ls,
                         heads_n=hn, row_fast=rf)  # heads_n: the transposed dots; row_fast: the former grid order
        torch.testing.assert_close(got, ref40, rtol=1e-5, atol=1e-5)
    # a latent cache row wider than latent + rope (padding), read through its stride; q_latent and q_rope as views
    # of one [R, H, Dl + Dr] query, as a model's absorbed projection leaves them
    wide = torch.cat([cache, torch.full((slots_n, 16), float("nan"))], 1)
    q = torch.cat([ql, qr], -1)
    torch.testing.assert_close(sparse_mla(q[..., :dl], q[..., dl:], wide, slots, scale, num_splits=2, block_n=16),
                               ref, rtol=1e-5, atol=1e-5)


def check() -> None:
    import torch

    assert_interpreting()
    g = torch.Generator().manual_seed(0)
    check_topk(g)
    check_indexer(g)
    check_grouped(g)
    check_sparse_mla(g)
    print("sparse_mla ok")


def test_sparse_kernels_match_references_in_interpreter(interpreter_checks):
    """Indexer scores (bf16-valued fp32 and FP8 keys), top-k and sparse MLA against their references."""
    interpreter_checks.check(__name__, "sparse_mla ok")


def test_draft_rows_built_once_equal_per_step():
    """SparseDraftRows' static buffers hold, after one fill, what building each step from scratch gives (chain and
    tree steps, the expanded page rows); a second round's fill rewrites them in place."""
    import torch

    from workers.kernels.sparse_mla import SparseDraftRows, draft_rows_per_step

    table = torch.randint(0, 100, (4, 7), dtype=torch.int32)
    for causal in (True, False):
        k, steps = (1, 3) if causal else (4, 2)
        rows = SparseDraftRows(4, k, steps, "cpu", causal=causal, page_table=table)
        ptrs = rows.row_len.data_ptr(), rows.pages.data_ptr()
        for base in (torch.tensor([10, 3, 50], dtype=torch.int32), torch.tensor([7, 8, 9], dtype=torch.int32)):
            rows.fill(base, offset=1)
            for i in range(steps):
                req, ln = rows.step(i, batch=3)
                want_req, want_len, want_pages = draft_rows_per_step(base, k, i, offset=1, causal=causal,
                                                                     page_table=table)
                assert torch.equal(req, want_req) and torch.equal(ln, want_len), (causal, i)
                assert torch.equal(rows.pages[:3 * k], want_pages)
        assert (rows.row_len.data_ptr(), rows.pages.data_ptr()) == ptrs
    rows = SparseDraftRows(2, 1, 2, "cpu")
    rows.fill(torch.tensor([5, 9], dtype=torch.int32))
    assert rows.row_len.tolist() == [[6, 10], [7, 11]]


if __name__ == "__main__":
    check()


def test_launch_helpers_fall_back_to_the_references_off_cuda():
    """Without CUDA or the interpreter the launch helpers run the references, into the given buffers (a caller's
    static outputs stay the outputs)."""
    import torch

    from workers.kernels import launch
    from workers.kernels import sparse_mla as sm

    if launch.use_triton(torch.zeros(1)):
        pytest.skip("the interpreter is on in this process")
    g = torch.Generator().manual_seed(0)
    table = torch.arange(1, 9, dtype=torch.int32).view(2, 4)
    keys = torch.randn(9 * 16, 16, generator=g)
    q, w = torch.randn(3, 4, 16, generator=g), torch.randn(3, 4, generator=g)
    req, ln = torch.tensor([0, 1, 1], dtype=torch.int32), torch.tensor([60, 10, 33], dtype=torch.int32)
    out = torch.empty(3, 8, dtype=torch.int32)
    assert sm.indexer_topk(q, w, keys, table, req, ln, 16, 8, out=out) is out
    assert torch.equal(out, sm.indexer_topk_reference(q, w, keys, table, req, ln, 16, 8))
    assert ((out >= 0).sum(1) == torch.tensor([8, 8, 8])).all()
    # the top-k's path by shape (few scores in all: radix; long rows: ordered; else sampled), a misspelt one refused
    assert [sm.topk_method(r, c, 2048) for r, c in ((8, 65536), (32, 65536), (160, 16384), (8, 9088), (512, 9088))] \
        == ["radix", "ordered", "sampled", "radix", "radix"]
    with pytest.raises(ValueError, match="top-k method"):
        sm.topk_slots(torch.zeros(3, 64), table, req, ln, 16, 8, method="order")
    cache = torch.randn(9 * 16, 48, generator=g)
    ql, qr = torch.randn(3, 2, 32, generator=g), torch.randn(3, 2, 16, generator=g)
    o = torch.empty(3, 2, 32)
    assert sm.sparse_mla(ql, qr, cache, out, 0.1, out=o) is o
    torch.testing.assert_close(o, sm.sparse_mla_reference(ql, qr, cache, out, 0.1))
