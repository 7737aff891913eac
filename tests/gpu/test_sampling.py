"""The sampler on the GPU: draws against their distribution (chi-square) and against the CPU reference's draws and
filter floors (``check_sampling``)."""

from __future__ import annotations

from tests.gpu.runner import needs_gpus, needs_module, result_path, run_check

pytestmark = needs_gpus(1)


@needs_module("scipy")
def test_sampler_on_gpu(tmp_path):
    run_check("check_sampling", "--device", "cuda", "--json", result_path("sampling_check.json", tmp_path))
