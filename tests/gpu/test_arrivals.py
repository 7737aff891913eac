"""Arrivals during decoding on the GPU (``check_arrivals``: prefill overlap, mixed and separate steps, graphs,
speculation; token-exact in fp32 against each request alone on the torch-native backend)."""

from __future__ import annotations

from tests.gpu.runner import needs_gpus, result_path, run_check

pytestmark = needs_gpus(1)


def test_arrivals_fp32(tmp_path):
    run_check("check_arrivals", "--dtype", "float32", "--json", result_path("arrivals_fp32.json", tmp_path))
