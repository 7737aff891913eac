"""Backend construction and hybrid dispatch (prefill kernel and decode kernel chosen separately)."""

from __future__ import annotations

import importlib

import torch

from attention.base import AttentionBackend, AttentionLayerSpec, uses_decode_kernel
from workers.forward_batch import DraftSteps, ForwardBatch

# name → "module:Class"; imported lazily so GPU-only backends cost nothing on CPU
BACKENDS = {
    "torch_native": "attention.torch_native:TorchNativeBackend",
    "triton": "attention.triton_backend:TritonBackend",
    "flashinfer": "attention.flashinfer_wrappers:FlashInferBackend",
}
# the same names for models with sparse MLA attention (DeepSeek-V3.2: indexer top-k + latent attention)
SPARSE_BACKENDS = {
    "torch_native": "attention.sparse_torch_native:SparseTorchNativeBackend",
    "triton": "attention.sparse_triton:SparseTritonBackend",
    "flashinfer": "attention.sparse_flashinfer:SparseFlashInferBackend",
}
FAMILIES = {"dense": BACKENDS, "sparse_mla": SPARSE_BACKENDS}
VERIFY_ATTENTION_MODES = ("decode", "prefill")


def _make(name: str, verify_attention_mode: str, device: torch.device, family: str = "dense") -> AttentionBackend:
    backends = FAMILIES[family]
    if name not in backends:
        raise ValueError(f"unknown attention backend {name!r} for {family} attention; choose from {sorted(backends)}")
    if name != "torch_native" and torch.device(device).type != "cuda":
        raise ValueError(f"attention backend {name!r} needs a CUDA device; use torch_native on {device}")
    module, cls = backends[name].split(":")
    return getattr(importlib.import_module(module), cls)(verify_attention_mode=verify_attention_mode)


class HybridBackend(AttentionBackend):
    """Routes each forward to the prefill-family or decode-family child (see ``uses_decode_kernel``)."""

    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend, verify_attention_mode: str):
        self.prefill, self.decode = prefill, decode
        self.verify_attention_mode = verify_attention_mode
        self.name = f"hybrid({prefill.name}+{decode.name})"
        self.supports_cuda_graph = prefill.supports_cuda_graph and decode.supports_cuda_graph
        self.graph_safe_extend = prefill.graph_safe_extend

    def child(self, fb: ForwardBatch) -> AttentionBackend:
        return self.decode if uses_decode_kernel(fb.mode, self.verify_attention_mode) else self.prefill

    def graph_refusal(self, page_size: int, kv_dtype: torch.dtype, head_dim: int) -> str | None:
        return (self.prefill.graph_refusal(page_size, kv_dtype, head_dim)
                or self.decode.graph_refusal(page_size, kv_dtype, head_dim))

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        self.child(fb).init_forward_metadata(fb)

    def init_round_metadata(self, steps: DraftSteps) -> None:
        self.child(steps.stacked).init_round_metadata(steps)

    def forward(self, q, k, v, layer: AttentionLayerSpec, fb: ForwardBatch) -> torch.Tensor:
        return self.child(fb).forward(q, k, v, layer, fb)

    def forward_extend(self, q, layer, fb):
        return self.prefill.forward_extend(q, layer, fb)

    def compile_key(self, mode, batch, n_max, uniform, layer, capacity):
        child = self.decode if uses_decode_kernel(mode, self.verify_attention_mode) else self.prefill
        return child.compile_key(mode, batch, n_max, uniform, layer, capacity)

    def forward_decode(self, q, layer, fb):
        return self.decode.forward_decode(q, layer, fb)


def create_attention_backend(prefill: str, decode: str, verify_attention_mode: str, device,
                             family: str = "dense") -> AttentionBackend:
    """``family``: "dense" (paged K/V attention) or "sparse_mla" (the model's ``attention_family``)."""
    if verify_attention_mode not in VERIFY_ATTENTION_MODES:
        raise ValueError(f"verify_attention_mode must be one of {VERIFY_ATTENTION_MODES}, got {verify_attention_mode!r}")
    if family == "sparse_mla" and prefill == "flashinfer":  # (its MLA kernel runs rows of a whole top-k: decode)
        prefill = "triton"
    if prefill == decode:
        return _make(prefill, verify_attention_mode, device, family)
    return HybridBackend(_make(prefill, verify_attention_mode, device, family),
                         _make(decode, verify_attention_mode, device, family), verify_attention_mode)
