"""The attention-backend interface.

A backend is bound to one model's KV cache. Per forward it builds its metadata once (``init_forward_metadata``: the
single builder, used by eager runs and by CUDA-graph capture and replay; under a capture its fresh tensors come
from the graph's private memory pool and keep their addresses across replays, and a backend may instead keep
persistent buffers made by ``init_graph_state``), then each attention layer calls
``forward``, which stores new K/V when it is given them (the models store theirs with RoPE in one kernel,
``KVCache.rope_and_store``, and pass none) and runs the extend-style or the decode-style kernel for the batch's mode.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from workers.forward_batch import ForwardBatch
from workers.messages import ForwardMode


@dataclass(frozen=True)
class AttentionLayerSpec:
    layer_id: int
    num_heads: int  # local (per TP rank)
    num_kv_heads: int  # local
    head_dim: int
    scaling: float


class AttentionBackend(ABC):
    """Five methods: init_graph_state, init_forward_metadata, forward (concrete), forward_extend, forward_decode."""

    #: which kernel family runs TARGET_VERIFY: "decode" (split-KV, the default) or "prefill"
    verify_attention_mode: str = "decode"
    #: whether forwards can be captured in CUDA graphs (launches depend on no host-side sequence length)
    supports_cuda_graph: bool = False

    def graph_refusal(self, page_size: int, kv_dtype: torch.dtype, head_dim: int) -> str | None:
        """Why this backend's forwards cannot be captured in CUDA graphs over this KV layout (None: they can)."""
        if self.supports_cuda_graph:
            return None
        return f"the {getattr(self, 'name', type(self).__name__)} backend's launches depend on host-side lengths"

    def init_graph_state(self, max_batch_size: int, max_num_tokens: int) -> None:
        """Allocate persistent metadata buffers for CUDA graphs (backends without graph support keep none)."""

    @abstractmethod
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Compute everything the kernels need for this batch, once for all layers."""

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: AttentionLayerSpec,
                fb: ForwardBatch) -> torch.Tensor:
        """q: [T, heads, dim]; k, v: [T, kv_heads, dim] (None: K/V already stored). Returns [T, heads, dim]."""
        if k is not None:
            fb.kv_cache.store(layer.layer_id, fb.out_cache_loc, k, v)
        if uses_decode_kernel(fb.mode, self.verify_attention_mode):
            return self.forward_decode(q, layer, fb)
        return self.forward_extend(q, layer, fb)

    @abstractmethod
    def forward_extend(self, q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch) -> torch.Tensor:
        """Prefill-style kernel: causal over the new tokens (+ tree mask for TARGET_VERIFY in prefill mode)."""

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch) -> torch.Tensor:
        """Decode-style split-KV kernel: DECODE, and TARGET_VERIFY with q_len_per_req = num_draft_tokens."""


def uses_decode_kernel(mode: ForwardMode, verify_attention_mode: str) -> bool:
    """The one place that decides kernel family per forward mode."""
    if mode == ForwardMode.DECODE:
        return True
    if mode == ForwardMode.TARGET_VERIFY:
        return verify_attention_mode == "decode"
    return False
