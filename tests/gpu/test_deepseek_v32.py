"""DeepSeek-V3.2 sparse MLA on the Triton sparse backend with CUDA graphs, with and without every drafter, against
torch-native run eagerly (``check_deepseek_v32``: fp32, greedy tokens equal)."""

from __future__ import annotations

from tests.gpu.runner import needs_gpus, result_path, run_check

pytestmark = needs_gpus(1)


def test_deepseek_v32_fp32(tmp_path):
    run_check("check_deepseek_v32", "--json", result_path("deepseek_v32_fp32.json", tmp_path))
