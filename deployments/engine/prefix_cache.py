"""Prefix caching: an index of full KV pages by what they hold, so a request whose tokens start the same way reuses
them instead of recomputing them.

A page is indexed by a chained key: (the key's node id of the page before it, the page's tokens, and, when the
proposer is an EAGLE head, the token after the page). Node ids are handed out once and never reused, so a key names
the whole prefix exactly (no hash collisions to trust). Why the token after: an EAGLE head's KV at position p is
computed from the target's hidden state at p *and token p+1*, so the head's KV in a page's last slot is valid only
for a request whose next token is the same. Target KV (and a standalone draft model's) at p depends on tokens
[0, p] only, so without an EAGLE head the key is the tokens alone.

Keys are built when they can be needed, not as pages fill: a request keys its pages until it creates a node of its
own (a page no one else has computed), then defers the rest, registered under that node (``defer``). Only a lookup
that reaches the node and misses there can need them: it keys the deferred pages of the requests registered there
(``_expand``) and looks again. With nothing shared each request keys one page; what a lookup finds is what keying
every page as it filled would have found. A released request's deferred pages stay cached as a record of their
tokens (``_Released``), keyed on demand the same way.

Pages with no request holding them stay cached and evictable, least recently released first (a request releases
its pages tail first, so a prefix's tail goes before its head). The allocator evicts when its free list runs short.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

ROOT = 0  # the parent id of a sequence's first page
_PAGE_BITS = 32  # an index entry is one int, node id << _PAGE_BITS | page (no tuple per cached page to collect)
_PAGE_MASK = (1 << _PAGE_BITS) - 1


class _Released:
    """A released request's full pages that it had not keyed yet, with the tokens that key them: its own lists, not
    copies (a prompt never changes, and an output only grows, or loses its tail to a stop string once it has
    ended: a key is built from what is there, and a page past the end is left out)."""

    __slots__ = ("prompt_ids", "output_ids", "pages", "num_computed", "cache_nodes", "alive")
    draft_lag = 0  # (as a request's: a record keeps only pages whose KV was all written)

    def __init__(self, prompt: list[int], output: list[int], pages: list[int], num_computed: int, nodes: list[int]):
        self.prompt_ids, self.output_ids, self.pages = prompt, output, pages
        self.num_computed, self.cache_nodes = num_computed, nodes
        self.alive = len(pages)  # its pages [len(cache_nodes), alive) are cached (evictions take the tail first)


class PrefixCache:
    """The index (key → page, page → key), the requests and records whose pages are keyed on demand, and the LRU of
    cached pages that no request holds. Reference counts are the allocator's: it tells the cache when a cached page's
    count reaches 0 (``release``) or leaves 0 (``take``), and hands a released request's deferred pages over as one
    record (``release_request``, ``PageAllocator.give_to_cache``)."""

    def __init__(self, page_size: int, key_next_token: bool):
        self.page_size = page_size
        self.key_next_token = key_next_token  # an EAGLE head's KV at a page's last slot depends on the next token
        self._index: dict[tuple, int] = {}  # key -> node id << _PAGE_BITS | page
        self._keys: dict[int, tuple] = {}  # page -> its key
        # cached pages with no holder, oldest release first: a page (keyed, or one left private, no longer cached)
        # -> None, or a record of a released request's pages not keyed yet -> itself
        self._lru: OrderedDict[int | _Released, _Released | None] = OrderedDict()
        self._num_evictable = 0  # pages in the LRU (a record counts its pages)
        # node -> the requests (running ones, or _Released records) whose full pages after it are not keyed yet
        self._pending: dict[int, list] = {}
        self._num_deferred = 0  # released pages not keyed yet
        self._ids = itertools.count(ROOT + 1)
        self.queries = 0  # prompt tokens looked up (first admissions only, as vLLM counts)
        self.hits = 0  # of those, tokens served from the cache
        self.evictions = 0  # pages evicted

    # ---- keys ------------------------------------------------------------------------------------------------
    def key(self, parent: int, ids: list[int], k: int) -> tuple | None:
        """The key of block ``k`` of ``ids`` under node ``parent``; None when ``ids`` cannot prove it (the block is
        not full, or the token after it is needed and not known yet)."""
        return self.page_key(parent, ids, (), k)

    def page_key(self, parent: int, ids: list[int], more: list[int], k: int) -> tuple | None:
        """``key`` of the sequence ``ids + more`` (a request's prompt and output) without joining them: a request's
        page is indexed once it is full, and copying its whole sequence each time would cost more than the key."""
        P, n = self.page_size, len(ids)
        start, end = k * P, (k + 1) * P
        if end + self.key_next_token > n + len(more):
            return None
        if end <= n:
            tokens = tuple(ids[start:end])
        elif start >= n:
            tokens = tuple(more[start - n:end - n])
        else:
            tokens = tuple(ids[start:] + more[:end - n])
        if self.key_next_token:
            return parent, tokens, ids[end] if end < n else more[end - n]
        return parent, tokens

    # ---- lookups ---------------------------------------------------------------------------------------------
    def match(self, ids: list[int], max_tokens: int, more: list[int] = ()) -> list[tuple[int, int]]:
        """(page, node id) of each leading block of ``ids + more`` that is cached, covering at most ``max_tokens``
        tokens. Takes no reference."""
        out: list[tuple[int, int]] = []
        parent = ROOT
        for k in range(max_tokens // self.page_size):
            key = self.page_key(parent, ids, more, k)
            if key is None:
                break
            hit = self._index.get(key)
            if hit is None and parent in self._pending:  # pages after this node may be there, not keyed yet
                self._expand(parent)
                hit = self._index.get(key)
            if hit is None:
                break
            parent = hit >> _PAGE_BITS
            out.append((hit & _PAGE_MASK, parent))
        if out:  # looked up: the most recently used among equals
            for page, _ in out:
                if page in self._lru:
                    self._lru.move_to_end(page)
        return out

    def insert(self, key: tuple, page: int) -> int:
        """Index ``page`` (held by a request, its KV final) under ``key``; returns the key's node id. When the key is
        cached already (another request computed the same block), the page stays private and that node's id is
        returned, so the chain goes on through it."""
        node = next(self._ids)  # (unused on a hit: ids only need to be unique)
        entry = self._index.setdefault(key, node << _PAGE_BITS | page)  # (one hash of the key, not two)
        if entry >> _PAGE_BITS != node:
            return entry >> _PAGE_BITS
        self._keys[page] = key
        return node

    def index(self, nodes: list[int], ids: list[int], more: list[int], pages: list[int], num_tokens: int,
              until_new: bool = False) -> bool:
        """Index a request's full pages within its first ``num_tokens`` tokens (``ids + more``) after the
        ``len(nodes)`` indexed already, appending their node ids to ``nodes``: ``insert`` of each page's key, in one
        call. ``until_new``: stop after the first page that makes a node of its own; returns whether one did."""
        index, keys, ids_gen = self._index, self._keys, self._ids
        parent = nodes[-1] if nodes else ROOT
        for k in range(len(nodes), num_tokens // self.page_size):
            key = self.page_key(parent, ids, more, k)
            if key is None:  # the token after it is not known yet (an EAGLE head's KV at its last slot needs it)
                break
            node, page = next(ids_gen), pages[k]
            entry = index.setdefault(key, node << _PAGE_BITS | page)
            nodes.append(node if entry >> _PAGE_BITS == node else entry >> _PAGE_BITS)
            if entry >> _PAGE_BITS == node:
                keys[page] = key
                if until_new:
                    return True
            # else cached already: this page stays private (a released one is evicted as any), the chain goes on
            # through that node
            parent = nodes[-1]
        return False

    # ---- deferred pages ---------------------------------------------------------------------------------------
    def defer(self, req) -> None:
        """``req`` (a running request, which has made a node of its own) keys no more pages as they fill: a lookup
        that needs them keys them (``_expand``), or its release keeps them as a record."""
        self._pending.setdefault(req.cache_nodes[-1], []).append(req)

    def _expand(self, node: int) -> None:
        """Key the full pages of the requests deferred at ``node``; each stays deferred at its new last node (a
        running one fills more pages; a record goes once it has nothing left)."""
        for rec in self._pending.pop(node):
            if type(rec) is _Released:  # (a record in _pending has pages left: it goes with its last)
                self._expand_record(rec)
            else:
                self.index(rec.cache_nodes, rec.prompt_ids, rec.output_ids, rec.pages,
                           rec.num_computed - rec.draft_lag)
                self.defer(rec)

    def _expand_record(self, rec: _Released) -> None:
        """Key a record's pages that are left (evictions take its tail first); they become single LRU entries, the
        most recently used (a lookup reached them)."""
        nodes, pages, lru = rec.cache_nodes, rec.pages, self._lru
        start, alive = len(nodes), rec.alive
        self.index(nodes, rec.prompt_ids, rec.output_ids, pages, alive * self.page_size)
        del lru[rec]
        for page in reversed(pages[start:alive]):
            lru[page] = None  # keyed now (or left private, no longer cached: evicted as any)
        self._num_deferred -= alive - start
        rec.alive = len(nodes)

    def release_request(self, req) -> tuple[int, int]:
        """Before ``req`` lets go of its pages (finished, aborted, preempted): its deferred full pages stay cached as
        one record of them and their tokens, keyed when a lookup needs them, one LRU entry for them all. Returns the
        range of ``req.pages`` that the record keeps ((0, 0): none); the allocator hands them over
        (``PageAllocator.give_to_cache``)."""
        nodes = req.cache_nodes
        recs = self._pending.get(nodes[-1]) if nodes else None
        if not recs or req not in recs:
            return 0, 0
        recs.remove(req)
        if not recs:
            del self._pending[nodes[-1]]
        P, start, n, nxt = self.page_size, len(nodes), len(req.prompt_ids), self.key_next_token
        # its full pages below num_computed whose key the tokens prove (with the token after, under an EAGLE head),
        # and whose draft KV is written (``Request.draft_lag``)
        ready = min(min(req.num_computed - req.draft_lag, n + len(req.output_ids) - nxt) // P, len(req.pages))
        if ready <= start:
            return 0, 0
        rec = _Released(req.prompt_ids, req.output_ids, req.pages[:ready], ready * P, nodes)
        self._lru[rec] = rec
        self._num_deferred += ready - start
        self._num_evictable += ready - start
        self._pending.setdefault(nodes[-1], []).append(rec)
        return start, ready

    def holds(self, page: int) -> bool:
        return page in self._keys

    # ---- reference count changes (from the allocator) --------------------------------------------------------
    def take(self, page: int) -> None:
        """A request takes a cached page nobody held: it is no longer evictable."""
        if page in self._lru:
            del self._lru[page]
            self._num_evictable -= 1

    def release(self, page: int) -> None:
        """The last holder of a cached page let it go: it stays indexed, evictable."""
        self._lru[page] = None
        self._num_evictable += 1

    def release_all(self, pages: list[int]) -> list[int]:
        """``release`` of each page of ``pages`` (in order) that the cache indexes; returns the others."""
        keys, lru, uncached = self._keys, self._lru, []
        for page in pages:
            if page in keys:
                lru[page] = None
            else:
                uncached.append(page)
        self._num_evictable += len(pages) - len(uncached)
        return uncached

    @property
    def num_evictable(self) -> int:
        return self._num_evictable

    def evict(self, n: int) -> list[int]:
        """Unindex the ``n`` least recently released pages and return them (to the free list). Blocks cached under
        an evicted page can no longer be matched (their parent id is gone for good) and age out in turn. A record's
        pages go tail first (the same: the ones after an evicted page can no longer be reached); the record goes
        with its first."""
        out: list[int] = []
        lru, keys, index = self._lru, self._keys, self._index
        while len(out) < n:
            first = next(iter(lru))
            if type(first) is int:  # a page (keyed, or left private)
                lru.popitem(last=False)
                key = keys.pop(first, None)
                if key is not None:
                    del index[key]
                out.append(first)
                continue
            rec, start = first, len(first.cache_nodes)
            take = min(n - len(out), rec.alive - start)
            out.extend(reversed(rec.pages[rec.alive - take:rec.alive]))
            rec.alive -= take
            self._num_deferred -= take
            if rec.alive == start:
                lru.popitem(last=False)
                recs = self._pending.get(rec.cache_nodes[-1], ())
                if rec in recs:
                    recs.remove(rec)
                    if not recs:
                        del self._pending[rec.cache_nodes[-1]]
        self._num_evictable -= n
        self.evictions += n
        return out

    def clear(self) -> list[int]:
        """Forget every entry (their KV can no longer be trusted, e.g. after a failed step); returns the pages that
        no request holds, for the free list. Held pages go to the free list when their holders release them."""
        free = []
        for item in self._lru:
            if type(item) is int:
                free.append(item)
            else:
                free.extend(item.pages[len(item.cache_nodes):item.alive])
        self._lru.clear()
        self._index.clear()
        self._keys.clear()
        self._pending.clear()
        self._num_deferred = self._num_evictable = 0
        return free

    @property
    def num_cached(self) -> int:
        return len(self._keys) + self._num_deferred
