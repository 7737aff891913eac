"""The DeepSeek-V3.2 sparse attention kernels compiled on the GPU against their references, bf16 and fp32, and the
layer replayed from a CUDA graph (``check_sparse_mla``)."""

from __future__ import annotations

from tests.gpu.runner import needs_gpus, run_check

pytestmark = needs_gpus(1)


def test_sparse_kernels_on_gpu():
    out = run_check("check_sparse_mla")
    assert "sparse kernels ok" in out, out[-4000:]
