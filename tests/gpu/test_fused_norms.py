"""The norms and residual adds inside the small-M linear kernels, compiled, in bf16, and the folded model against
the unfolded one (``check_fused_norms``)."""

from __future__ import annotations

from tests.gpu.runner import needs_gpus, run_check

pytestmark = needs_gpus(1)


def test_fused_norms_bf16():
    out = run_check("check_fused_norms", "--device", "cuda", "--dtype", "bfloat16")
    assert "fused norms ok" in out, out[-4000:]
