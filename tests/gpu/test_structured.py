"""Structured output through the ``+mask`` CUDA graphs under the overlap schedule against torch-native run eagerly
(``check_structured``: fp32, without speculation, with an EAGLE-3 chain and tree)."""

from __future__ import annotations

from tests.gpu.runner import needs_gpus, result_path, run_check

pytestmark = needs_gpus(1)


def test_structured_fp32(tmp_path):
    run_check("check_structured", "--json", result_path("structured_fp32.json", tmp_path))
