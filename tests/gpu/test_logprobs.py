"""Logprobs and top logprobs through the graph variant with alternatives under the overlap schedule against
torch-native run eagerly (``check_logprobs``: fp32, without speculation, with an EAGLE-3 chain and tree)."""

from __future__ import annotations

from tests.gpu.runner import needs_gpus, result_path, run_check

pytestmark = needs_gpus(1)


def test_logprobs_fp32(tmp_path):
    run_check("check_logprobs", "--json", result_path("logprobs_fp32.json", tmp_path))
