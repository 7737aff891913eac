"""The norm / SiLU / RoPE / KV-store kernels (``workers.kernels.norm_rope``), run on the CPU through Triton's
interpreter (in a subprocess), against their PyTorch references."""

from __future__ import annotations

import pytest

from tests.kernels.interpreter import assert_interpreting

pytest.importorskip("triton")


def check_norm_rope_ops(g) -> None:
    """add + RMSNorm (rows of wider tensors, outputs into columns of wider ones, chosen rows), SiLU-and-multiply,
    RoPE on strided q/k views of a fused qkv; fp32 and bf16; empty batches launch nothing."""
    import torch

    from workers.kernels.norm_rope import (
        apply_rope_qk,
        rms_norm,
        rms_norm_reference,
        rope_reference,
        silu_and_mul,
    )

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


def check_store_kv(g) -> None:
    """K/V into the paged cache in one kernel (strided views of a fused qkv, a non-power-of-two head count), and RoPE
    fused with that store."""
    import torch

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
            # no query heads (a draft's KV-only pass, ``KVCache.rope_and_store_kv``): the same k and v stored
            ko, vo = torch.zeros_like(kc), torch.zeros_like(vc)
            none = apply_rope_store_kv(k[:, :0], k, v, table.cos(), table.sin(), ko, vo, slots, positions=pos)
            assert none.shape == (5, 0, 16) and torch.equal(ko, kt) and torch.equal(vo, vt), cache_dtype
            qa, ka = apply_rope_qk(q, k, table.cos(), table.sin(), pos)
            qb, kb = apply_rope_qk(q, k, table.cos()[pos], table.sin()[pos])
            assert torch.equal(qa, qb) and torch.equal(ka, kb)


def check() -> None:
    import torch

    assert_interpreting()
    g = torch.Generator().manual_seed(0)
    check_norm_rope_ops(g)
    check_rms_norm_pair(g)
    check_store_kv(g)
    print("norm_rope ok")


def test_norm_rope_kernels_match_reference_in_interpreter(interpreter_checks):
    """rms_norm, rms_norm_pair, silu_and_mul, apply_rope_qk, store_kv, apply_rope_store_kv against their references."""
    interpreter_checks.check(__name__, "norm_rope ok")


if __name__ == "__main__":
    check()
