"""Paged KV cache.

The host side (``deployments.engine.pages.PageAllocator``) hands out fixed-size pages. On every worker, ``KVCache`` holds per-layer K/V buffers of ``num_pages * page_size`` slots,
and ``PageTable`` maps (request slot, page position) to a physical page. A token at position ``p`` of request ``r``
lives in slot ``page_table[r, p // page_size] * page_size + p % page_size``.

Page 0 is never handed out: padded rows of a batch (CUDA-graph buckets) write their K/V there.
"""

from __future__ import annotations

import torch

from workers.kernels.metadata import paged_slots
from workers.kernels.norm_rope import apply_rope_store_kv, store_kv


class PageTable:
    """Device-side request-slot → pages table, updated from the scheduler's page grants."""

    def __init__(self, max_requests: int, max_pages_per_request: int, page_size: int, device):
        self.page_size = page_size
        self.table = torch.zeros(max_requests, max_pages_per_request, dtype=torch.int32, device=device)

    def apply(self, req_slots: torch.Tensor, page_pos: torch.Tensor, page_ids: torch.Tensor) -> None:
        if req_slots.numel():
            self.table[req_slots.long(), page_pos.long()] = page_ids.to(torch.int32)

    def slots(self, req_slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Physical KV slots of token ``positions`` of requests ``req_slots`` (same shape)."""
        return paged_slots(self.table, self.page_size, req_slots, positions)


class KVCache:
    """Per-layer K and V buffers: ``[num_pages * page_size, num_kv_heads, head_dim]`` each."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype, device):
        self.page_size = page_size
        self.num_pages = num_pages
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        store_kv(self.k[layer_id], self.v[layer_id], slots, k, v)

    def rope_and_store(self, layer_id: int, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """RoPE on q [T, Hq, D] and k [T, Hk, D], rotated k and v stored at ``slots``; returns the rotated q (one
        kernel on the GPU: ``kernels.norm_rope.apply_rope_store_kv``). ``positions``: cos / sin are the whole tables."""
        return apply_rope_store_kv(q, k, v, cos, sin, self.k[layer_id], self.v[layer_id], slots, positions)

    def rope_and_store_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """``rope_and_store`` without a query: the same kernel over no query heads."""
        self.rope_and_store(layer_id, slots, k[:, :0], k, v, cos, sin, positions)

    def move(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy K/V of every layer from ``src_slots`` to ``dst_slots`` (compacting accepted tree nodes)."""
        for k, v in zip(self.k, self.v):
            k[dst_slots] = k[src_slots]
            v[dst_slots] = v[src_slots]

    def paged(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's buffers viewed as ``[num_pages, page_size, heads, dim]`` (FlashInfer / Triton layout)."""
        k, v = self.k[layer_id], self.v[layer_id]
        return k.view(self.num_pages, self.page_size, *k.shape[1:]), v.view(self.num_pages, self.page_size, *v.shape[1:])

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class MLAKVCache:
    """DeepSeek-V3.2's cache: per layer ONE compressed latent plus the shared rotated rope key per token
    (``latent[layer]``: [num_pages * page_size, kv_lora_rank + rope_dim]) and the lightning indexer's key at the
    same slot. Both are indexed by the same slots, so one page table and one page grant cover them.

    Indexer keys: in the model dtype (``index_k[layer]``: [slots, index_head_dim]; bf16 on GPUs, fp32 in CPU
    tests: what transformers computes), or with ``index_fp8`` FP8 e4m3 with a per-token fp32 scale in SGLang's page
    layout (``index_k[layer]``: uint8 [num_pages, page_size * (index_head_dim + 4)], what
    ``workers.kernels.sparse_mla.quantize_index_keys`` writes: each page's FP8 keys, then its scales), quantized
    as they are stored."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, latent_dim: int, index_dim: int, dtype,
                 device, index_fp8: bool = False):
        self.page_size = page_size
        self.num_pages = num_pages
        self.index_dim = index_dim
        self.index_fp8 = index_fp8
        slots = num_pages * page_size
        self.latent = [torch.zeros(slots, latent_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        if index_fp8:
            self.index_k = [torch.zeros(num_pages, page_size * (index_dim + 4), dtype=torch.uint8, device=device)
                            for _ in range(num_layers)]
            # per layer: (keys [pages, page_size, dim], scales' bytes [pages, page_size, 4]), views of its buffer
            self._fp8_parts = [(buf[:, :page_size * index_dim].unflatten(1, (page_size, index_dim)),
                                buf[:, page_size * index_dim:].unflatten(1, (page_size, 4))) for buf in self.index_k]
        else:
            self.index_k = [torch.zeros(slots, index_dim, dtype=dtype, device=device) for _ in range(num_layers)]

    def store(self, layer_id: int, slots: torch.Tensor, latent: torch.Tensor, index_k: torch.Tensor) -> None:
        self.latent[layer_id][slots] = latent.to(self.latent[layer_id].dtype)
        if not self.index_fp8:
            self.index_k[layer_id][slots] = index_k.to(self.index_k[layer_id].dtype)
            return
        from workers.kernels.sparse_mla import quantize_index_keys

        rows = quantize_index_keys(index_k, 1)  # [T, dim + 4]: each key's FP8 bytes, then its scale's
        keys, scales = self._fp8_parts[layer_id]
        page, off = slots // self.page_size, slots % self.page_size
        keys[page, off] = rows[:, :self.index_dim]
        scales[page, off] = rows[:, self.index_dim:]

    def move(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy every layer's latents and indexer keys from ``src_slots`` to ``dst_slots`` (accepted tree nodes)."""
        for buf in self.latent if self.index_fp8 else (*self.latent, *self.index_k):
            buf[dst_slots] = buf[src_slots]
        if self.index_fp8:
            ps = self.page_size
            src, dst = (src_slots // ps, src_slots % ps), (dst_slots // ps, dst_slots % ps)
            for keys, scales in self._fp8_parts:
                keys[dst] = keys[src]
                scales[dst] = scales[src]

    @staticmethod
    def bytes_per_token(num_layers: int, latent_dim: int, index_dim: int, dtype, index_fp8: bool = False) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        return num_layers * (latent_dim * size + (index_dim + 4 if index_fp8 else index_dim * size))
