"""DeepSeek-V3.2's decode backend ``flashinfer`` (``check_sparse_flashinfer``): FlashInfer's MLA against the fp32
reference alone and in every call of an engine, and the engine's long-rows graphs against the Triton backend."""

from __future__ import annotations

from tests.gpu.runner import needs_gpus, needs_module, result_path, run_check

pytestmark = [*needs_gpus(1), needs_module("flashinfer")]


def test_sparse_flashinfer(tmp_path):
    run_check("check_sparse_flashinfer", "--json", result_path("check_sparse_flashinfer.json", tmp_path))
