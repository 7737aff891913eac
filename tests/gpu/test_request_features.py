"""Penalties, logit_bias, min_tokens, JSON-schema masks and prompt logprobs on the GPU path against torch-native
(``check_request_features``: fp32, without speculation and with an EAGLE-3 chain)."""

from __future__ import annotations

from tests.gpu.runner import needs_gpus, result_path, run_check

pytestmark = needs_gpus(1)


def test_request_features_fp32(tmp_path):
    run_check("check_request_features", "--json", result_path("request_features_fp32.json", tmp_path))
