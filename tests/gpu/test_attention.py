"""The attention backends compiled on the GPU against the torch-native fp32 reference, every forward mode, and their
CUDA-graph capture / replay (``check_attention``)."""

from __future__ import annotations

from tests.gpu.runner import needs_gpus, needs_module, result_path, run_check

pytestmark = needs_gpus(1)


def test_triton_attention_bf16(tmp_path):
    run_check("check_attention", "--device", "cuda", "--backends", "triton", "--dtype", "bfloat16",
              "--json", result_path("attention_check_bf16.json", tmp_path))


def test_triton_attention_fp32(tmp_path):
    run_check("check_attention", "--device", "cuda", "--backends", "triton", "--dtype", "float32",
              "--json", result_path("attention_check_fp32.json", tmp_path))


@needs_module("flashinfer")
def test_flashinfer_attention_bf16(tmp_path):
    run_check("check_attention", "--device", "cuda", "--backends", "flashinfer", "--dtype", "bfloat16",
              "--json", result_path("attention_check_flashinfer_bf16.json", tmp_path))
