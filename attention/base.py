"""The attention-backend interface.

A backend is bound to one model's KV cache. Per forward, ``init_forward_metadata(fb)`` builds the backend's typed
metadata once for all layers and puts it on the batch (``fb.attn_metadata``). It is the single builder, used by eager
runs and by CUDA-graph capture and replay alike: under a capture its fresh tensors come from the graph's private
memory pool and keep their addresses across replays. A multi-step draft round may prepare every step's metadata once
(``init_round_metadata``, leaving each step's part on its batch as ``fb.round_metadata``), which the step's
``init_forward_metadata`` then finishes. Each attention layer calls ``forward``, which stores new K/V when it is
given them (the models store theirs with RoPE in one kernel, ``KVCache.rope_and_store``, and pass none) and runs the
extend-style or the decode-style kernel for the batch's mode.

Every backend has: ``name``, ``verify_attention_mode``, ``supports_cuda_graph``, ``graph_refusal``,
``init_forward_metadata``, ``init_round_metadata``, ``child``, ``forward``, ``forward_extend``, ``forward_decode``,
``compile_key`` (what a forward's shape compiles, for warm-ups).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from workers.forward_batch import DraftSteps, ForwardBatch
from workers.messages import ForwardMode


@dataclass(frozen=True)
class AttentionLayerSpec:
    layer_id: int
    num_heads: int  # local (per TP rank)
    num_kv_heads: int  # local
    head_dim: int
    scaling: float


class AttentionMetadata:
    """Base of the per-forward metadata a backend's ``init_forward_metadata`` puts on the batch."""

    @property
    def kernel(self) -> str:
        """The kernel the forward runs (checks and benchmarks report it)."""
        raise NotImplementedError


class AttentionBackend(ABC):
    name: str = "attention"
    #: which kernel family runs TARGET_VERIFY: "decode" (split-KV, the default) or "prefill"
    verify_attention_mode: str = "decode"
    #: whether forwards can be captured in CUDA graphs (launches depend on no host-side sequence length)
    supports_cuda_graph: bool = False
    #: whether EXTEND forwards whose lengths only the device knows (the host: a bound) can be captured (prefill graphs)
    graph_safe_extend: bool = False

    def graph_refusal(self, page_size: int, kv_dtype: torch.dtype, head_dim: int) -> str | None:
        """Why this backend's forwards cannot be captured in CUDA graphs over this KV layout (None: they can)."""
        if self.supports_cuda_graph:
            return None
        return f"the {self.name} backend's launches depend on host-side lengths"

    @abstractmethod
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Compute everything the kernels need for this batch, once for all layers, into ``fb.attn_metadata``."""

    def init_round_metadata(self, steps: DraftSteps) -> None:
        """Prepare every step's metadata of a multi-step draft round once (``fb.round_metadata`` of each step's
        batch). Default: nothing; each step's ``init_forward_metadata`` builds its own from the step's batch."""

    def child(self, fb: ForwardBatch) -> AttentionBackend:
        """The backend that runs this forward (a hybrid's prefill or decode backend; otherwise itself)."""
        return self

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

    def compile_key(self, mode: ForwardMode, batch: int, n_max: int, uniform: bool, layer: AttentionLayerSpec,
                    capacity: int) -> tuple:
        """What the kernels of a forward of ``batch`` requests (at most ``n_max`` new tokens each, the same number
        for all if ``uniform``; KV ``capacity`` positions per request) are compiled for: forwards with equal keys
        share their compiled kernels, so an eager caller can compile every variant it may meet ahead of time.
        Default: nothing shape-specialised."""
        return ()


def int_specialisation(value: int) -> str:
    """How Triton compiles a runtime int argument: a constant where it is 1, known divisible by 16, or neither."""
    return "1" if value == 1 else "16n" if value % 16 == 0 else "int"


def uses_decode_kernel(mode: ForwardMode, verify_attention_mode: str) -> bool:
    """The one place that decides kernel family per forward mode."""
    if mode == ForwardMode.DECODE:
        return True
    if mode == ForwardMode.TARGET_VERIFY:
        return verify_attention_mode == "decode"
    return False
