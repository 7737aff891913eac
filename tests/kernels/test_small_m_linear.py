"""The small-M linear kernels (``workers.kernels.small_m_linear``), run on the CPU through Triton's interpreter (in a
subprocess), against ``F.linear``: every row path, gated and activated forms, ``linear``'s table lookups; and the
norms and residual adds inside them (tests/gpu/check_fused_norms.py on the CPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tests.kernels.interpreter import assert_interpreting

pytest.importorskip("triton")


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


def check() -> None:
    import torch

    assert_interpreting()
    g = torch.Generator().manual_seed(0)
    check_small_m_linear(g)
    print("small_m_linear ok")


def test_small_m_linear_matches_reference_in_interpreter(interpreter_checks):
    """small_m_linear / linear / activated MLP against F.linear."""
    interpreter_checks.check(__name__, "small_m_linear ok")


def test_fused_norms_match_reference_in_interpreter():
    """tests/gpu/check_fused_norms.py (the norms and residual adds inside the small-M kernels) on the CPU."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-m", "tests.gpu.check_fused_norms", "--device", "cpu", "--dtype", "float32"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "fused norms ok" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]


if __name__ == "__main__":
    check()
