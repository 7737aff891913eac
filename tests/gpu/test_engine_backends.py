"""The whole engine's greedy tokens with each attention backend pair, speculation off and on (``check_engine_backends``:
token-exact in fp32; bf16 reported)."""

from __future__ import annotations

from tests.gpu.runner import needs_gpus, needs_module, result_path, run_check

pytestmark = needs_gpus(1)


def test_engine_backends_fp32(tmp_path):
    run_check("check_engine_backends", "--dtype", "float32", "--backends", "torch_native,triton",
              "--json", result_path("engine_backends_fp32.json", tmp_path))


@needs_module("flashinfer")
def test_engine_backends_with_flashinfer_bf16(tmp_path):
    run_check("check_engine_backends", "--dtype", "bfloat16", "--backends", "torch_native,triton,flashinfer",
              "--json", result_path("engine_backends_bf16.json", tmp_path))
