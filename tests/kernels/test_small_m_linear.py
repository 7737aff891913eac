"""The fused Triton ops (run on the CPU through Triton's interpreter, in a subprocess) against their PyTorch
references: add + RMSNorm, SiLU-and-multiply, RoPE on strided q/k views of a fused qkv; fp32 and bf16."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def check() -> None:
    import torch

    from workers.kernels import launch
    from workers.kernels.norm_rope import (
        apply_rope_qk,
        rms_norm,
        rms_norm_reference,
        rope_reference,
        silu_and_mul,
    )

    assert launch.use_triton(torch.zeros(1))  # the Triton kernels run here, not the references
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x, r = (torch.randn(5, 96, generator=g).to(dtype) for _ in range(2))
        w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
        out, res = rms_norm(x, w, 1e-6, r)
        ref_out, ref_res = rms_norm_reference(x, w, 1e-6, r)
        assert torch.allclose(res.float(), ref_res.float(), atol=tol, rtol=tol)
        assert torch.allclose(out.float(), ref_out.float(), atol=tol, rtol=tol), (out - ref_out).abs().max()
        assert torch.allclose(rms_norm(x, w, 1e-6).float(), rms_norm_reference(x, w, 1e-6).float(), atol=tol, rtol=tol)
        gu = torch.randn(5, 2 * 1536, generator=g).to(dtype)  # two column blocks of 1024
        gate, up = gu.chunk(2, dim=-1)
        ref = torch.nn.functional.silu(gate) * up
        assert torch.allclose(silu_and_mul(gu).float(), ref.float(), atol=tol, rtol=tol)
        qkv = torch.randn(5, (4 + 2 + 2) * 32, generator=g).to(dtype)  # q, k, v of 4 / 2 / 2 heads, head_dim 32
        q, k, _ = qkv.split([128, 64, 64], dim=-1)
        q, k = q.view(5, 4, 32), k.view(5, 2, 32)
        ang = torch.rand(5, 16, generator=g) * 6
        qo, ko = apply_rope_qk(q, k, ang.cos(), ang.sin())
        assert torch.allclose(qo.float(), rope_reference(q, ang.cos(), ang.sin()).float(), atol=tol, rtol=tol)
        assert torch.allclose(ko.float(), rope_reference(k, ang.cos(), ang.sin()).float(), atol=tol, rtol=tol)
    empty = torch.zeros(0, 96)  # empty batches launch nothing
    assert rms_norm(empty, torch.ones(96), 1e-6).shape == (0, 96) and silu_and_mul(torch.zeros(0, 8)).shape == (0, 4)
    strided = torch.randn(4, 192, generator=g)[:, :96]  # rows of a wider tensor
    assert torch.allclose(rms_norm(strided, torch.ones(96), 1e-6), rms_norm_reference(strided, torch.ones(96), 1e-6),
                          atol=1e-5)
    # the norm and the sum written into columns of wider tensors (EAGLE-3's captured states, its head's input)
    x, r = torch.randn(3, 96, generator=g), torch.randn(3, 96, generator=g)
    wide, wide_r = torch.zeros(3, 2 * 96), torch.zeros(3, 3 * 96)
    got, got_r = rms_norm(x, torch.ones(96), 1e-6, r, out=wide[:, 96:], residual_out=wide_r[:, 96:192])
    ref, ref_r = rms_norm_reference(x, torch.ones(96), 1e-6, r)
    assert got.data_ptr() == wide[:, 96:].data_ptr() and got_r.data_ptr() == wide_r[:, 96:192].data_ptr()
    assert torch.allclose(wide[:, 96:], ref, atol=1e-5) and torch.equal(wide_r[:, 96:192], ref_r)
    assert not wide[:, :96].any() and not wide_r[:, :96].any() and not wide_r[:, 192:].any()
    # only some rows (a forward's logits rows), in their order, as [R, n]
    rows = torch.tensor([2, 0])
    got, got_r = rms_norm(x, torch.ones(96), 1e-6, r, rows=rows)
    assert got.shape == got_r.shape == (2, 96)
    assert torch.allclose(got, ref[rows], atol=1e-5) and torch.equal(got_r, ref_r[rows])
    assert torch.allclose(rms_norm(x, torch.ones(96), 1e-6, rows=rows), rms_norm_reference(x[rows], torch.ones(96),
                                                                                         1e-6), atol=1e-5)
    check_rms_norm_pair(g)
    check_small_m_linear(g)
    check_uniform_token_metadata(g)
    check_overlap_step_inputs(g)
    check_tree_verdict(g)
    check_record_round(g)
    check_store_kv_and_argmax(g)
    check_one_shot_sum(g)
    print("fused ops ok")


def check_rms_norm_pair(g) -> None:
    """Two norms side by side in one kernel (EAGLE-3's layer input) equal two ``rms_norm`` calls bit for bit, with
    the first input's rows gathered by index (an embedding lookup fused in), a strided second input, bf16 and fp32."""
    import torch

    from workers.kernels.norm_rope import rms_norm, rms_norm_pair

    for dtype in (torch.float32, torch.bfloat16):
        table, hidden = torch.randn(11, 80, generator=g).to(dtype), torch.randn(4, 160, generator=g).to(dtype)[:, :80]
        wa, wb = ((1 + 0.1 * torch.randn(80, generator=g)).to(dtype) for _ in range(2))
        ids = torch.tensor([3, 3, 10, 0])
        out = torch.full((4, 160), float("nan"), dtype=dtype)
        got = rms_norm_pair(table, hidden, wa, wb, 1e-5, out, a_rows=ids)
        assert got.data_ptr() == out.data_ptr()
        assert torch.equal(out[:, :80], rms_norm(table[ids], wa, 1e-5)) and torch.equal(out[:, 80:],
                                                                                       rms_norm(hidden, wb, 1e-5))
        rms_norm_pair(table[ids], hidden, wa, wb, 1e-5, out)  # without the gather
        assert torch.equal(out[:, :80], rms_norm(table[ids], wa, 1e-5))
    try:
        rms_norm_pair(table, hidden, wa, wb, 1e-5, out)  # 11 table rows for 4 outputs, no a_rows
        raise AssertionError("rms_norm_pair took mismatched rows")
    except ValueError:
        pass


def check_store_kv_and_argmax(g) -> None:
    """K/V into the paged cache in one kernel (strided views of a fused qkv, a non-power-of-two head count), RoPE
    fused with that store, and the split-row argmax + logsumexp (first index on ties, -inf columns, rows longer and
    shorter than one program)."""
    import torch

    from workers.kernels.argmax import argmax_logsumexp, greedy_with_logprob
    from workers.kernels.norm_rope import (
        apply_rope_qk,
        apply_rope_store_kv,
        rope_reference,
        store_kv,
    )

    for dtype in (torch.float32, torch.bfloat16):
        qkv = torch.randn(5, (3 + 3 + 3) * 16, generator=g).to(dtype)
        _, k, v = qkv.split([48, 48, 48], dim=-1)
        k, v = k.view(5, 3, 16), v.view(5, 3, 16)
        slots = torch.tensor([7, 0, 12, 3, 9])
        kc, vc = torch.zeros(16, 3, 16, dtype=dtype), torch.zeros(16, 3, 16, dtype=dtype)
        store_kv(kc, vc, slots, k, v)
        ref_k, ref_v = torch.zeros_like(kc), torch.zeros_like(vc)
        ref_k[slots], ref_v[slots] = k, v
        assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
        # RoPE on q and k with the rotated k and v written straight into the cache (one kernel): bit for bit what
        # RoPE then the indexed stores give, and close to the PyTorch reference; also with a cache of another dtype
        # (the two-step fallback)
        q = torch.randn(5, 6, 16, generator=g).to(dtype)[:, ::2]  # strided heads
        ang = torch.rand(5, 8, generator=g) * 6
        for cache_dtype in (dtype, torch.float64):
            kc, vc = torch.zeros(16, 3, 16, dtype=cache_dtype), torch.zeros(16, 3, 16, dtype=cache_dtype)
            q_rot = apply_rope_store_kv(q, k, v, ang.cos(), ang.sin(), kc, vc, slots)
            two_q, two_k = apply_rope_qk(q, k, ang.cos(), ang.sin())
            two_kc, two_vc = torch.zeros_like(kc), torch.zeros_like(vc)
            store_kv(two_kc, two_vc, slots, two_k, v)
            assert torch.equal(q_rot, two_q) and torch.equal(kc, two_kc) and torch.equal(vc, two_vc), cache_dtype
            ref_k = torch.zeros_like(kc)
            ref_k[slots] = rope_reference(k, ang.cos(), ang.sin()).to(cache_dtype)
            assert torch.allclose(kc, ref_k, atol=1e-5, rtol=1e-2), cache_dtype
            assert torch.allclose(q_rot.float(), rope_reference(q, ang.cos(), ang.sin()).float(), atol=1e-5,
                                  rtol=1e-2)
            assert kc[[i for i in range(16) if i not in slots.tolist()]].abs().sum() == 0  # other slots untouched
            # the whole tables with each token's position: the kernel reads the rows itself, bit for bit the same
            table = torch.rand(40, 8, generator=g) * 6
            pos = torch.tensor([3, 39, 0, 17, 3])
            kt, vt = torch.zeros_like(kc), torch.zeros_like(vc)
            q_tab = apply_rope_store_kv(q, k, v, table.cos(), table.sin(), kt, vt, slots, positions=pos)
            kg, vg = torch.zeros_like(kc), torch.zeros_like(vc)
            q_gat = apply_rope_store_kv(q, k, v, table.cos()[pos], table.sin()[pos], kg, vg, slots)
            assert torch.equal(q_tab, q_gat) and torch.equal(kt, kg) and torch.equal(vt, vg), cache_dtype
            qa, ka = apply_rope_qk(q, k, table.cos(), table.sin(), pos)
            qb, kb = apply_rope_qk(q, k, table.cos()[pos], table.sin()[pos])
            assert torch.equal(qa, qb) and torch.equal(ka, kb)
    for b, n in ((3, 50), (2, 5000), (4, 70001)):
        for dtype in (torch.float32, torch.bfloat16):
            logits = (torch.randn(b, n, generator=g) * 4).to(dtype)
            logits[0, n // 3] = logits[0, n - 1] = logits[0].max() + 1  # a tie: the first index wins
            if b > 2:
                logits[2, : n // 2] = float("-inf")
            ids, lse = argmax_logsumexp(logits)
            assert ids.dtype == torch.int64 and torch.equal(ids, logits.argmax(-1)), (b, n, dtype)
            assert ids[0].item() == n // 3
            assert torch.allclose(lse, torch.logsumexp(logits.float(), -1), atol=1e-4, rtol=1e-5), (b, n, dtype)
            # greedy sampling's (argmax, its log-probability) from the same kernels: the gathered logit minus lse
            gids, glp = greedy_with_logprob(logits)
            assert torch.equal(gids, ids) and glp.dtype == torch.float32
            remap = torch.randint(0, 1000, (n,), generator=g)  # an EAGLE-3 d2t: id + remap[id]
            rids, rlse = argmax_logsumexp(logits, remap=remap)
            assert torch.equal(rids, ids + remap[ids]) and torch.equal(rlse, lse), (b, n, dtype)
            assert torch.equal(glp, logits.gather(1, ids.unsqueeze(1)).squeeze(1).float() - lse), (b, n, dtype)
            # in place: into a given [B] (a draft chain's node), or scattered by slot into a per-request state
            into = torch.full((b + 1, b), -1)
            got, _ = argmax_logsumexp(logits, remap=remap, ids_out=into[1])
            assert got.data_ptr() == into[1].data_ptr() and torch.equal(into[1], rids) and (into[0] == -1).all()
            state, slots = torch.full((2 * b + 3,), -1), torch.randperm(2 * b + 3, generator=g)[:b]
            argmax_logsumexp(logits, remap=remap, ids_out=state, ids_rows=slots)
            want = torch.full_like(state, -1)
            want[slots] = rids
            assert torch.equal(state, want), (state, want)
    check_gumbel_argmax(g)
    check_filter_floor(g)


def check_filter_floor(g) -> None:
    """The per-row filter floor kernels against their reference: top-k (ties with the k-th), top-p (a nucleus inside
    the first chunk, ones that reach into the second and third, with and without top-k), min-p, a row that filters
    nothing, bf16-valued logits with ties, -inf entries; and the race stays above each row's floor."""
    import torch

    from workers.kernels.argmax import argmax_logsumexp
    from workers.kernels.top_filter import filter_floor, filter_floor_reference

    n = 9000  # three chunks of three blocks of 1024
    logits = torch.randn(8, n, generator=g) * torch.tensor([3.0, 3.0, 0.3, 0.05, 3.0, 1.0, 2.0, 3.0]).unsqueeze(1)
    logits[5] = logits[5].bfloat16().float()  # ties
    logits[6, n // 2:] = float("-inf")
    temp = torch.tensor([0.7, 1.0, 1.0, 1.0, 0.0, 1.0, 0.9, 1.0])
    top_k = torch.tensor([40, 0, 0, 0, 7, 1500, 0, 0])
    top_p = torch.tensor([0.9, 0.8, 0.95, 0.5, 1.0, 0.9, 0.99, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.0])
    desc = logits.sort(dim=-1, descending=True).values
    got = filter_floor(desc, temp, top_k, top_p, min_p)
    ref = filter_floor_reference(desc, temp, top_k, top_p, min_p)
    assert torch.equal(got, ref), (got, ref)
    half = desc.bfloat16()  # 16-bit logits, as a bf16 model's (read as fp32 inside)
    assert torch.equal(filter_floor(half, temp, top_k, top_p, min_p), filter_floor_reference(half, temp, top_k, top_p,
                                                                                             min_p))
    kept = (logits >= got.unsqueeze(1)).sum(-1)
    assert kept[7] == n and kept[4] == 7 and 1 <= kept[0] <= 40 and kept[2] > 3072 and kept[3] < kept[2], kept
    race = (torch.where(temp > 0, temp, 1.0), torch.arange(8), torch.zeros(8, dtype=torch.long), 0)
    ids = argmax_logsumexp(logits, gumbel=race, floor=got)[0]
    assert torch.all(logits.gather(1, ids.unsqueeze(1)).squeeze(1) >= got)


def check_one_shot_sum(g) -> None:
    """The one-shot all-reduce kernel (``workers.custom_all_reduce``) as rank 0 of 2, its peer played here: the peer
    has pushed its slices into slot 1 of rank 0's buffer, in the phase of each program's call count (mod 3). Rank 0
    must push its own slices into slot 0 of the peer's buffer (same phase, -0.0 sent as +0.0: -0.0 marks a slot
    empty), sum both in rank order, mark the peer's slot of its previous phase empty again, count its calls and
    leave the programs past the grid alone; sizes change between calls, a ragged last slice included."""
    import torch

    from workers.kernels.all_reduce import BLOCK, _one_shot_sum_kernel

    world, slot = 2, 4 * BLOCK

    def negative_zero(t):
        return (t == 0) & (1 / t < 0)

    for dtype in (torch.float32, torch.bfloat16):
        buffers = [torch.full((3 * world * slot,), -0.0, dtype=dtype) for _ in range(world)]
        buffer_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
        mine, peers = (b.view(3, world, slot) for b in buffers)  # [phase, slot, elements]
        calls = torch.zeros(4, dtype=torch.int64)
        for n in (BLOCK + 7, 3 * BLOCK, BLOCK + 7, 4 * BLOCK, 5, BLOCK + 7):
            x, peer = (torch.randn(n, generator=g).to(dtype) for _ in range(2))
            x[1] = -0.0
            grid = -(-n // BLOCK)
            for p in range(grid):
                lo, hi = p * BLOCK, min(n, (p + 1) * BLOCK)
                mine[int(calls[p]) % 3, 1, lo:hi] = peer[lo:hi]
            before, out = calls.clone(), torch.empty_like(x)
            _one_shot_sum_kernel[(grid,)](x, out, buffer_ptrs, calls, n, slot, RANK=0, WORLD=world, BLOCK=BLOCK,
                                          num_warps=4)
            sent = torch.where(x == 0, torch.zeros_like(x), x)
            ref = (sent.float() + peer.float()).to(dtype)
            if dtype == torch.float32:
                assert torch.equal(out, ref), n
            else:  # the interpreter rounds fp32 to bf16 towards zero, the GPU to nearest: one unit apart at most
                assert torch.allclose(out.float(), ref.float(), rtol=2 ** -7, atol=0), n
            assert torch.equal(calls[:grid], before[:grid] + 1) and torch.equal(calls[grid:], before[grid:])
            for p in range(grid):
                lo, hi = p * BLOCK, min(n, (p + 1) * BLOCK)
                phase = int(before[p]) % 3
                assert torch.equal(peers[phase, 0, lo:hi], sent[lo:hi]), (n, p)
                assert not negative_zero(peers[phase, 0, lo:hi]).any()
                # the previous phase: empty over the program's whole slice, where an earlier, larger call of that
                # phase left elements past this n (a later, larger call would take them for landed)
                assert negative_zero(mine[(phase + 2) % 3, 1, lo:lo + BLOCK]).all(), (n, p)
            peers.fill_(-0.0)  # the peer has read them


def check_gumbel_argmax(g) -> None:
    """The Gumbel race inside the split-row argmax kernel: the same uniforms as ``uniform_noise`` (hash on uint32
    lanes), so the same winners as the PyTorch reference, for several temperatures, seeds (one past 2^32), counters
    and streams, rows longer than one program, -inf entries that never win."""
    import torch

    from workers.kernels.argmax import argmax_logsumexp
    from workers.kernels.rng import gumbel_from_hash, hash32, uniform_noise

    for b, n in ((3, 50), (4, 9000)):
        logits = torch.randn(b, n, generator=g) * 3
        logits[0, : n // 2] = float("-inf")
        temp = torch.tensor([0.5, 1.0, 2.0, 0.8][:b])
        seeds = torch.tensor([7, 2**33 + 5, 123456789, 42][:b])
        counters = torch.tensor([0, 17, 10**6, 3][:b])
        for stream in (0, 7):
            ids = argmax_logsumexp(logits, gumbel=(temp, seeds, counters, stream))[0]
            u = uniform_noise(seeds, counters, n, stream)
            ref = (logits / temp.unsqueeze(1) + (-torch.log(-torch.log(u))).float()).argmax(-1)  # float64 noise
            assert torch.equal(ids, ref), (b, n, stream, ids, ref)
            assert ids[0] >= n // 2
    # the fp32 noise against float64 -log(-log u), over the whole range of hashes, the tails included
    h = torch.cat([torch.arange(0, 2**32, 2**32 // 100000), torch.arange(2**32 - 1000, 2**32), torch.arange(1000)])
    exact = -torch.log(-torch.log((h.double() + 0.5) / 2**32))
    assert torch.allclose(gumbel_from_hash(h).double(), exact, rtol=2e-6, atol=2e-6)
    assert gumbel_from_hash(h).isfinite().all() and hash32(torch.tensor([1]), torch.tensor([2]), 4, 0).shape == (1, 4)
    # the one-kernel uniforms (the interpreter runs it here) are exactly the PyTorch hash's, past one block of columns
    seeds, counters = torch.tensor([7, 2**33 + 5, 123456789]), torch.tensor([0, 17, 10**6])
    for width, stream in ((1, 7), (1500, 0)):
        ref = (hash32(seeds, counters, width, stream).double() + 0.5) / 2**32
        assert torch.equal(uniform_noise(seeds, counters, width, stream), ref)
    flat = torch.zeros(64, 1000)  # a uniform distribution: each counter draws its own token
    ids = argmax_logsumexp(flat, gumbel=(torch.ones(64), torch.full((64,), 3), torch.arange(64), 0))[0]
    assert len(set(ids.tolist())) > 50


def check_small_m_linear(g) -> None:
    """The small-M linear kernel: its row paths (GEMV for 1 and 2 rows, padded dot with the rows or the weight on
    the left), bias, ragged N and K, strided rows; and ``linear`` runs it only for the row buckets the layer's table
    holds a config for."""
    import torch

    from workers.kernels import small_m_linear as sml

    gemv1, gemv2 = sml.TileConfig(1, 8, 32, 2, 1), sml.TileConfig(2, 8, 32, 2, 1)
    dot16 = sml.TileConfig(16, 16, 32, 4, 1)
    left16 = sml.TileConfig(16, 16, 32, 4, 1, weight_left=True)
    for cfg in (gemv1, gemv2, dot16, left16):
        for m, n, k, bias in ((1, 48, 96, False), (1, 44, 70, True), (2, 40, 70, True), (3, 40, 70, True),
                              (4, 48, 64, False), (16, 64, 64, False)):
            if m > cfg.block_m:
                continue
            x = torch.randn(m, 2 * k, generator=g)[:, :k]  # rows of a wider tensor
            w = torch.randn(n, k, generator=g)
            b = torch.randn(n, generator=g) if bias else None
            got = sml.small_m_linear(x, w, b, cfg)
            ref = torch.nn.functional.linear(x, w, b)
            assert got.shape == (m, n) and torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (cfg, m, n, k)
    from workers.kernels.norm_rope import silu_and_mul

    for cfg in (gemv1, gemv2, dot16, left16):  # silu(gate) * up fused in (weight on the left: activated first)
        for m, k in ((1, 64), (1, 70), (2, 70), (5, 70)):
            if m > cfg.block_m:
                continue
            gu, w = torch.randn(m, 2 * k, generator=g), torch.randn(24, k, generator=g)
            ref = torch.nn.functional.linear(silu_and_mul(gu), w)
            assert torch.allclose(sml.small_m_linear(gu, w, None, cfg, gated=True), ref, atol=1e-4, rtol=1e-4)
            assert torch.allclose(sml.linear(gu, w, None, {sml.row_bucket(m): cfg}, gated=True), ref, atol=1e-4,
                                  rtol=1e-4)
            assert torch.allclose(sml.linear(gu, w, None, {}, gated=True), ref, atol=1e-5, rtol=1e-5)  # unfused
    try:
        sml.linear(torch.randn(2, 64, generator=g), torch.randn(8, 64, generator=g), None, {}, gated=True)
        raise AssertionError("a gated input must be twice the weight's input width")
    except ValueError:
        pass
    try:
        sml.small_m_linear(torch.randn(3, 64, generator=g), torch.randn(8, 64, generator=g), None, gemv2)
        raise AssertionError("a GEMV tile of 2 rows must refuse 3")
    except ValueError:
        pass
    # the order timed: one row, cuBLAS then the GEMV's tiles; from 2 rows the weight-left incumbent, cuBLAS, the
    # GEMV's tiles of 2 rows, the other tensor-core tiles; each config once
    one, two, four = sml.candidates(1), sml.candidates(2), sml.candidates(4)
    assert one[0] is None and [c.block_m for c in one[1:1 + len(sml.GEMV_CANDIDATES[1])]] == [1] * len(
        sml.GEMV_CANDIDATES[1])
    assert two[:2] == four[:2] == [sml.TENSOR_CORE_INCUMBENT, None] and sml.TENSOR_CORE_INCUMBENT.weight_left
    assert two[2:2 + len(sml.GEMV_CANDIDATES[2])] == sml.GEMV_CANDIDATES[2]
    assert all(len(set(c)) == len(c) for c in (one, two, four)) and all(c.block_m == 16 for c in four[2:])
    assert {c.weight_left for c in four[2:]} == {False, True}
    w = torch.randn(32, 64, generator=g)
    # which kernel ran: count the calls of the Triton path (the table must be what decides)
    calls = []
    real = sml.small_m_linear
    sml.small_m_linear = lambda *a, **kw: calls.append(a[3]) or real(*a, **kw)
    try:
        table = {8: sml.TileConfig(16, 16, 32, 4, 1)}
        x = torch.randn(2, 3, 64, generator=g)  # 6 rows: bucket 8, in the table
        assert torch.allclose(sml.linear(x, w, None, table), torch.nn.functional.linear(x, w), atol=1e-4, rtol=1e-4)
        assert calls == [table[8]]
        sml.linear(torch.randn(2, 64, generator=g), w, None, table)  # bucket 2: not tuned, cuBLAS / F.linear
        sml.linear(torch.randn(40, 64, generator=g), w, None, table)  # more rows than any bucket
        assert len(calls) == 1
    finally:
        sml.small_m_linear = real
    assert sml.row_bucket(1) == 1 and sml.row_bucket(3) == 4 and sml.row_bucket(9) == 16
    check_activated_output(g)


def check_activated_output(g) -> None:
    """A weight-left tile writing silu(gate) * up of a [gate; up] weight equals the two-kernel path (bf16: bit for
    bit, as it rounds gate and up first), with bias and ragged sizes; an MLP takes that path exactly when its
    gate/up layer has such a tile for the bucket and its down projection would otherwise run silu_and_mul first."""
    import torch

    from workers.kernels import small_m_linear as sml
    from workers.kernels.norm_rope import silu_and_mul
    from workers.layers import SINGLE
    from workers.models.llama import MLP

    act16 = sml.TileConfig(16, 16, 32, 4, 1, weight_left=True)
    for m, n, k, bias, dtype in ((1, 32, 64, False, torch.float32), (3, 24, 70, True, torch.float32),
                                 (4, 32, 64, False, torch.bfloat16), (16, 40, 96, True, torch.bfloat16)):
        x = torch.randn(m, k, generator=g).to(dtype)
        w = torch.randn(2 * n, k, generator=g).to(dtype)
        b = torch.randn(2 * n, generator=g).to(dtype) if bias else None
        ref = silu_and_mul(sml.small_m_linear(x, w, b, act16))
        got = sml.small_m_linear(x, w, b, act16, activated=True)
        assert got.shape == (m, n) and got.dtype == dtype
        if dtype == torch.bfloat16:
            assert torch.equal(got, ref), (m, n, k)
        else:
            assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), (m, n, k)
    try:
        sml.small_m_linear(torch.randn(1, 64), torch.randn(64, 64), None, sml.TileConfig(1, 8, 32, 2, 1),
                           activated=True)
        raise AssertionError("only a weight-left tile writes an activated output")
    except ValueError:
        pass

    class Cfg:
        hidden_size, intermediate_size = 64, 96

    mlp = MLP(Cfg, torch.float32, SINGLE)
    for p in mlp.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    gemv, left = sml.TileConfig(1, 8, 32, 2, 1), sml.TileConfig(16, 16, 32, 4, 1, weight_left=True)
    mlp.gate_up_proj.small_m_act.update({1: act16, 4: act16})
    mlp.down_proj.small_m.update({1: gemv, 4: left})
    calls = []
    real = sml.small_m_linear
    sml.small_m_linear = lambda *a, **kw: calls.append(kw.get("activated", False)) or real(*a, **kw)
    try:
        with torch.no_grad():
            for m, activated in ((4, True), (3, True), (1, False), (2, False)):
                x = torch.randn(m, 64, generator=g)
                ref = torch.nn.functional.linear(silu_and_mul(torch.nn.functional.linear(
                    x, mlp.gate_up_proj.weight)), mlp.down_proj.weight)
                calls.clear()
                assert torch.allclose(mlp(x), ref, atol=1e-4, rtol=1e-4), m
                # 3-4 rows: the activated gate/up, then the down kernel on plain input; 1 row: the down GEMV
                # activates as it loads; 2 rows: no tiles in the tables, cuBLAS / F.linear throughout
                assert calls == ([True, False] if activated else [False] if m == 1 else []), (m, calls)
    finally:
        sml.small_m_linear = real


def check_uniform_token_metadata(g) -> None:
    """The one-kernel token metadata of a uniform batch equals the PyTorch ops it replaces (the interpreter runs the
    kernel on these CPU tensors), for decode (1 token), verify-sized (4), odd (5) and prefill-sized (2500: three
    programs per request) extends, int64 and int32 sequence lengths, pages scattered."""
    import torch

    from workers.kernels import metadata

    page, pages_per = 4, 700
    table = (torch.randperm(6 * pages_per, generator=g) + 1).view(6, pages_per).to(torch.int32)
    for n, dtype in ((1, torch.int64), (4, torch.int32), (5, torch.int64), (2500, torch.int64)):  # 2500: 3 blocks
        slots = torch.tensor([5, 9, 0, 9, 3, 9], dtype=torch.int64)[::2]  # strided views, as callers may pass
        seq = torch.tensor([[n, 17 + n, 2790], [0, 0, 0]], dtype=dtype).T[:, 0]
        got = metadata.uniform_token_metadata(slots, seq, n, table, page)
        real = metadata.use_triton
        metadata.use_triton = lambda x: False
        try:
            ref = metadata.uniform_token_metadata(slots, seq, n, table, page)
        finally:
            metadata.use_triton = real
        for a, b in zip(got, ref):
            assert a.dtype == b.dtype and torch.equal(a, b), (n, a, b)
        pos = torch.cat([torch.arange(s - n, s) for s in seq.tolist()])
        assert torch.equal(ref[5], table[slots.repeat_interleave(n), pos // page].long() * page + pos % page)
        # lengths moved by an offset, the batch stacked 3 times (each copy 2 further), logits at chosen rows: the
        # same as the plain metadata of the explicit lengths
        if n < 100:
            at = torch.randint(0, n, (3,), generator=g)
            kw = dict(seq_offset=1, steps=3, seq_step=2, logits_at=at)
            got = metadata.uniform_token_metadata(slots, seq, n, table, page, **kw)
            metadata.use_triton = lambda x: False
            try:
                ref = metadata.uniform_token_metadata(slots, seq, n, table, page, **kw)
                plain = metadata.uniform_token_metadata(
                    slots.repeat(3), torch.cat([seq + 1 + 2 * i for i in range(3)]), n, table, page)
            finally:
                metadata.use_triton = real
            for a, b, c in zip(got, ref, plain[:3] + (plain[2] + at.repeat(3),) + plain[4:]):
                assert a.dtype == b.dtype and torch.equal(a, b) and torch.equal(b, c), (n, a, b, c)


def check_overlap_step_inputs(g) -> None:
    """A replayed step's inputs in one kernel: lengths and counters moved ahead by the step in flight (pending rows
    only), roots gathered by slot; the same as the PyTorch ops."""
    import torch

    from workers.kernels import metadata

    advance, last = torch.randint(1, 5, (40,), generator=g), torch.randint(0, 1000, (40,), generator=g)
    for b in (1, 7, 33):
        slots = torch.randperm(40, generator=g)[:b]
        pending = torch.randint(0, 2, (b,), generator=g)
        seq, ctr = torch.randint(1, 500, (b,), generator=g), torch.randint(0, 50, (b,), generator=g)
        got = metadata.overlap_step_inputs(slots, pending, seq, ctr, advance, last)
        ahead = pending * advance[slots]
        for a, ref in zip(got, (seq + ahead, last[slots], seq + ahead - 1, ctr + ahead)):
            assert a.dtype == torch.int64 and torch.equal(a, ref), (b, a, ref)


def check_tree_verdict(g) -> None:
    """A round's verdict in one kernel: the same accepted counts, paths, emitted tokens and log-probs as the PyTorch
    ops, on random trees whose tokens repeat (several children match: the first wins; a walk that stopped stays
    stopped), on chains (as their explicit parents), and with a forced accept count (the benchmark's)."""
    import torch

    from workers.kernels import verdict

    def both(*args, **kwargs):
        got = verdict.tree_verdict(*args, **kwargs)
        real = verdict.use_triton
        verdict.use_triton = lambda x: False
        try:
            ref = verdict.tree_verdict(*args, **kwargs)
        finally:
            verdict.use_triton = real
        for a, r in zip(got, ref):
            assert a.dtype == r.dtype and torch.equal(a, r), (args[1].shape, a, r)
        return ref

    hits = 0
    for b, d, depth in ((6, 4, 3), (5, 8, 4), (7, 13, 5), (3, 1, 0)):
        parents = torch.full((b, d), -1, dtype=torch.int64)
        for j in range(1, d):
            parents[:, j] = torch.randint(0, j, (b,), generator=g)
        tokens = torch.randint(0, 3, (b, d), generator=g)
        choice = torch.randint(0, 3, (b, d), generator=g)
        logits = torch.randn(b * d, 5, generator=g).to(torch.bfloat16)
        lse = torch.logsumexp(logits.float(), -1).view(b, d)
        accept, path, out, logprob = both(parents, tokens, choice, lse, logits, depth)
        hits += int((accept > 1).sum())
        for i in range(b):  # what the walk emits: the target's choice along the path, with its log-prob
            assert path[i, 0] == 0 and all(parents[i, path[i, j + 1]] == path[i, j] for j in range(int(accept[i])))
            assert torch.equal(out[i], choice[i, path[i]])
            assert torch.equal(logprob[i], logits[i * d + path[i], out[i]].float() - lse[i, path[i]])
        # a chain (parents None: node j's parent is j - 1) walks as its explicit parents do
        chain = both(None, tokens, choice, lse, logits, depth)
        explicit = verdict.tree_verdict((torch.arange(d) - 1).expand(b, d).contiguous(), tokens, choice, lse,
                                          logits, depth)
        assert all(torch.equal(a, e) for a, e in zip(chain, explicit))
        if d == depth + 1:  # forced: floor(u + offset) drafts, then the target's choice
            u = torch.rand(b, generator=g)
            accept, path, out, _ = both(None, tokens, choice, lse, logits.view(b, d, 5), depth, forced=(u, 1.0))
            assert torch.equal(accept, (u + 1.0).long().clamp(0, depth)) and torch.equal(path[0], torch.arange(d))
            for i in range(b):
                a = int(accept[i])
                assert torch.equal(out[i, :a], tokens[i, 1:a + 1]) and out[i, a] == choice[i, a]
    assert hits > 0  # some walks went deeper than one hop


def check_record_round(g) -> None:
    """A round's outcome into the per-request state: last_token[slot] = out[b, accept], advance[slot] = accept + 1."""
    import torch

    from workers.kernels import verdict

    slots = torch.tensor([7, 2, 9, 4, 0, 5])[::2]  # strided
    accept = torch.tensor([0, 3, 1])
    out = torch.randint(0, 100, (3, 4), generator=g)
    last, adv = torch.zeros(10, dtype=torch.int64), torch.ones(10, dtype=torch.int64)
    verdict.record_round(slots, accept, out, last, adv)
    want_last, want_adv = torch.zeros(10, dtype=torch.int64), torch.ones(10, dtype=torch.int64)
    want_last[slots], want_adv[slots] = out[torch.arange(3), accept], accept + 1
    assert torch.equal(last, want_last) and torch.equal(adv, want_adv), (last, adv)


def test_pdl_only_inside_graph_scopes_and_never_on_cpu():
    """Programmatic dependent launch is scoped (CUDA-graph warm-ups and captures, per thread, nesting restores the
    outer state) and never asked for on a device without it."""
    import threading

    import torch

    from workers.kernels import launch

    x = torch.zeros(1)
    seen = {}
    with launch.pdl_launches():
        with launch.pdl_launches():
            pass
        seen["inside"] = launch._pdl_scope.on
        worker = threading.Thread(target=lambda: seen.update(other=getattr(launch._pdl_scope, "on", False)))
        worker.start()
        worker.join()
        assert launch.pdl_launch(x) == {}  # no CUDA here
    assert seen == {"inside": True, "other": False} and not launch._pdl_scope.on
    assert not launch.pdl_supported("cpu")


def test_fused_norms_match_reference_in_interpreter():
    """tools/check_fused_norms.py (the norms and residual adds inside the small-M kernels) on the CPU."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, os.path.join(root, "tools", "check_fused_norms.py"), "--device", "cpu",
                          "--dtype", "float32"], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "fused norms ok" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]


def test_fused_ops_match_reference_in_interpreter():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root)
    res = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "fused ops ok" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]


if __name__ == "__main__":
    check()
