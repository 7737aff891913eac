"""Every prefill / decode backend pair's logits on the shipped model against the torch-native fp32 reference under
teacher forcing (``check_logits``: decisive top-1 >= 99%, relative error < 3%); flashinfer too where installed."""

from __future__ import annotations

from tests.gpu.runner import has_module, needs_gpus, result_path, run_check

pytestmark = needs_gpus(1)


def test_backend_logits_bf16(tmp_path):
    backends = "torch_native,triton" + (",flashinfer" if has_module("flashinfer") else "")
    run_check("check_logits", "--backends", backends, "--dtype", "bfloat16",
              "--json", result_path("logits_check_bf16.json", tmp_path))
