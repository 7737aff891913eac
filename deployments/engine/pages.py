"""KV page allocation on the host: the scheduler hands out fixed-size pages and remembers which each request owns.

Page 0 is never handed out: padded rows of a batch (CUDA-graph buckets) write their K/V there.
"""

from __future__ import annotations


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
