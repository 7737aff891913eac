"""KV page allocation on the host: the scheduler hands out fixed-size pages and remembers which each request owns.

Page 0 is never handed out: padded rows of a batch (CUDA-graph buckets) write their K/V there.

With prefix caching (``deployments.engine.prefix_cache``) a full page may be held by several requests: the
allocator counts each page's holders. A page whose count reaches 0 goes back to the free list, or, when the cache
indexes it, stays cached and evictable; allocations evict such pages when the free list runs short.
"""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """Raised when the KV cache has no free page left for an allocation."""


class PageAllocator:
    """Free-list allocator of KV pages (host side), with per-page holder counts."""

    def __init__(self, num_pages: int, page_size: int, cache=None):
        if num_pages < 2:
            raise ValueError("the KV cache needs at least 2 pages (page 0 is reserved)")
        self.page_size = page_size
        self.num_pages = num_pages
        self.cache = cache  # a PrefixCache, or None (prefix caching off)
        self._free: list[int] = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        """Pages an allocation can have: free ones and cached ones that no request holds."""
        return len(self._free) + (self.cache.num_evictable if self.cache is not None else 0)

    @property
    def capacity_pages(self) -> int:
        return self.num_pages - 1

    def refs(self, page: int) -> int:
        return self._refs[page]

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def grow(self, pages: list[int], num_tokens: int) -> list[int]:
        """Extend ``pages`` in place so it covers ``num_tokens`` tokens; returns the new pages.
        Raises OutOfPages (allocating nothing) when there are not enough free pages."""
        need = self.pages_for(num_tokens) - len(pages)
        if need <= 0:
            return []
        short = need - len(self._free)
        if short > 0:
            if self.cache is None or short > self.cache.num_evictable:
                raise OutOfPages(f"need {need} pages, {self.num_free} free")
            self._free.extend(self.cache.evict(short))
        new = [self._free.pop() for _ in range(need)]
        for p in new:
            self._refs[p] = 1
        pages.extend(new)
        return new

    def share(self, pages: list[int], page: int) -> None:
        """Append a cached ``page`` to ``pages``, holding it."""
        if self._refs[page] == 0:
            self.cache.take(page)
        self._refs[page] += 1
        pages.append(page)

    def _drop(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] == 0:
            if self.cache is not None and self.cache.holds(page):
                self.cache.release(page)
            else:
                self._free.append(page)

    def shrink(self, pages: list[int], num_tokens: int) -> None:
        """Free the pages of ``pages`` beyond what ``num_tokens`` tokens need (rejected draft tokens)."""
        keep = self.pages_for(num_tokens)
        while len(pages) > keep:
            self._drop(pages.pop())

    def free(self, pages: list[int]) -> None:
        """Let go of every page of ``pages``, the last first (a cached prefix's tail is evicted before its head)."""
        refs, unheld = self._refs, []
        for p in reversed(pages):  # (no call per page: a finished request lets go of all its pages at once)
            refs[p] -= 1
            if refs[p] == 0:
                unheld.append(p)
        self._free.extend(unheld if self.cache is None else self.cache.release_all(unheld))
        pages.clear()

    def give_to_cache(self, pages: list[int], start: int, end: int) -> None:
        """``pages[start:end]`` (held by their request alone) become the cache's, as one record
        (``PrefixCache.release_request``): out of ``pages``, nobody holds them, and they are not freed."""
        refs = self._refs
        for p in pages[start:end]:
            refs[p] = 0
        del pages[start:end]

    def clear_cache(self) -> None:
        """Forget every cached page (prefix caching keeps working from empty)."""
        if self.cache is not None:
            self._free.extend(self.cache.clear())
