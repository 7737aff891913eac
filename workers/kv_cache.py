"""Paged KV cache.

Host side (the controller's scheduler): ``PageAllocator`` hands out fixed-size pages and remembers which pages each
request owns. Device side (every worker): ``KVCache`` holds per-layer K/V buffers of ``num_pages * page_size`` slots,
and ``PageTable`` maps (request slot, page position) to a physical page. A token at position ``p`` of request ``r``
lives in slot ``page_table[r, p // page_size] * page_size + p % page_size``.

Page 0 is never handed out: padded rows of a batch (CUDA-graph buckets) write their K/V there.
"""

from __future__ import annotations

import torch

from workers.fused_ops import apply_rope_store_kv, paged_slots, store_kv


class OutOfPages(RuntimeError):
    """Raised when the KV cache has no free page left for an allocation."""


class PageAllocator:
    """Free-list allocator of KV pages (host side)."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError("the KV cache needs at least 2 pages (page 0 is reserved)")
        self.page_size = page_size
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity_pages(self) -> int:
        return self.num_pages - 1

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def grow(self, pages: list[int], num_tokens: int) -> list[int]:
        """Extend ``pages`` in place so it covers ``num_tokens`` tokens; returns the new pages.
        Raises OutOfPages (allocating nothing) when there are not enough free pages."""
        need = self.pages_for(num_tokens) - len(pages)
        if need <= 0:
            return []
        if need > len(self._free):
            raise OutOfPages(f"need {need} pages, {len(self._free)} free")
        new = [self._free.pop() for _ in range(need)]
        pages.extend(new)
        return new

    def shrink(self, pages: list[int], num_tokens: int) -> None:
        """Free the pages of ``pages`` beyond what ``num_tokens`` tokens need (rejected draft tokens)."""
        keep = self.pages_for(num_tokens)
        while len(pages) > keep:
            self._free.append(pages.pop())

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))
        pages.clear()


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
        kernel on the GPU: ``fused_ops.apply_rope_store_kv``). ``positions``: cos / sin are the whole tables."""
        return apply_rope_store_kv(q, k, v, cos, sin, self.k[layer_id], self.v[layer_id], slots, positions)

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
