"""CUDA graphs against eager runs of the same engine, every proposer, greedy and seeded sampling (``check_graphs``:
token-exact in fp32; bf16 reported)."""

from __future__ import annotations

import pytest

from tests.gpu.runner import needs_gpus, result_path, run_check

pytestmark = needs_gpus(1)


@pytest.mark.parametrize("dtype, name", [("float32", "graphs_fp32.json"), ("bfloat16", "graphs_bf16.json")])
def test_graphs_match_eager(tmp_path, dtype, name):
    run_check("check_graphs", "--dtype", dtype, "--json", result_path(name, tmp_path))
