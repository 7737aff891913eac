"""Prefix caching: the index and the allocator's holder counts; greedy and seeded outputs with the cache on equal to
off for every speculative method across shared prefixes of every alignment to the page size, with eviction,
preemption and aborts mid-share; an EAGLE head's state after a hit equal to a cold prefill's; the hit rate with
speculation equal to the hit rate without; every page free or held only by the cache at the end."""

from __future__ import annotations

import pytest
import torch

from deployments.engine.engine import Engine
from deployments.engine.pages import OutOfPages, PageAllocator
from deployments.engine.prefix_cache import ROOT, PrefixCache
from deployments.engine.request import Request, SamplingParams
from tests.speculative.test_speculative import spec_models  # noqa: F401 - the fixture
from workers.config import EngineConfig, SpeculativeConfig

P = 4  # page size of the engine tests
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


# ---- the index and the allocator -----------------------------------------------------------------------------
def test_index_chains_keys_and_evicts_least_recently_released():
    cache = PrefixCache(2, key_next_token=False)
    alloc = PageAllocator(8, 2, cache)
    ids = [5, 6, 7, 8, 9]
    a: list[int] = []
    alloc.grow(a, 5)  # 3 pages
    nodes = []
    for k in range(2):
        nodes.append(cache.insert(cache.key(nodes[-1] if nodes else ROOT, ids, k), a[k]))
    assert cache.key(ROOT, ids, 2) is None  # not full
    assert [p for p, _ in cache.match(ids, 4)] == a[:2]
    assert [p for p, _ in cache.match(ids, 3)] == a[:1]  # at most max_tokens
    assert cache.match([5, 6, 0, 8], 4) == cache.match(ids, 2)  # the chain stops at the first differing page
    assert cache.match([0, 6, 7, 8], 4) == []  # ... and a later page is reached only through its parent
    # a second holder shares them; a duplicate block computed elsewhere stays private and the chain goes through
    b: list[int] = []
    for page, _ in cache.match(ids, 4):
        alloc.share(b, page)
    assert alloc.refs(a[0]) == 2
    c: list[int] = []
    alloc.grow(c, 2)
    assert cache.insert(cache.key(ROOT, ids, 0), c[0]) == nodes[0] and not cache.holds(c[0])
    alloc.free(c)
    a0, a1 = a[0], a[1]
    alloc.free(a)
    assert cache.num_evictable == 0 and alloc.num_free == 7 - 2  # b still holds the cached two
    alloc.free(b)
    assert cache.num_evictable == 2 and alloc.num_free == 7
    # LRU: the tail page was released first, so it goes first; a lookup refreshes a page
    d: list[int] = []
    alloc.grow(d, 2 * 6)
    assert cache.num_evictable == 1 and cache.holds(a0) and not cache.holds(a1)
    assert cache.match(ids, 4) == cache.match(ids, 2)  # the second page was evicted, the first is still there
    with pytest.raises(OutOfPages):
        alloc.grow(d, 2 * 8)
    assert len(d) == 6 and cache.num_evictable == 1  # nothing allocated
    alloc.grow(d, 2 * 7)
    assert cache.num_evictable == 0 and cache.num_cached == 0 and cache.evictions == 2
    alloc.free(d)
    assert alloc.num_free == 7 and sorted(alloc._free) == list(range(1, 8))


def test_eagle_keys_carry_the_next_token():
    cache = PrefixCache(2, key_next_token=True)
    assert cache.key(ROOT, [1, 2], 0) is None  # the token after the page is not known yet
    assert cache.key(ROOT, [1, 2, 3], 0) == (ROOT, (1, 2), 3)
    alloc = PageAllocator(4, 2, cache)
    a: list[int] = []
    alloc.grow(a, 3)
    cache.insert(cache.key(ROOT, [1, 2, 3], 0), a[0])
    assert cache.match([1, 2, 4, 5], 3) == []  # same page, different next token: the head's last slot differs
    assert len(cache.match([1, 2, 3, 5], 3)) == 1


def test_deferred_pages_are_keyed_when_a_lookup_reaches_them():
    """A request keys its pages until it makes a node of its own, then defers the rest: a lookup that reaches that
    node keys them (the request running, or released: a record of its tokens); evicting a record's pages makes the
    rest unreachable, as an evicted page's children, and the record goes with its first one."""
    cache = PrefixCache(2, key_next_token=False)
    alloc = PageAllocator(32, 2, cache)
    a = Request("a", [5, 6, 7, 8, 9, 10, 11], SamplingParams())
    alloc.grow(a.pages, 7)  # 4 pages, the last one partial
    a.num_computed = 7
    assert cache.index(a.cache_nodes, a.prompt_ids, a.output_ids, a.pages, a.num_computed, until_new=True)
    cache.defer(a)
    assert len(a.cache_nodes) == 1 and cache.num_cached == 1  # one page keyed, two full ones deferred
    assert [p for p, _ in cache.match([5, 6, 7, 8, 9, 10, 0, 0], 8)] == a.pages[:3]  # the lookup keyed them
    assert len(a.cache_nodes) == 3 and cache.num_cached == 3
    a.output_ids, a.num_computed = [12, 13], 8  # its 4th page filled (deferred), a 5th holds its newest token
    alloc.grow(a.pages, 9)
    a_pages = list(a.pages)
    alloc.give_to_cache(a.pages, *cache.release_request(a))
    alloc.free(a.pages)
    assert cache.num_cached == 4 and cache.num_evictable == 4 and alloc.num_free == 31  # the 5th page is free
    assert len(cache.match([5, 6, 7, 8, 9, 10, 11, 12, 0, 0], 10)) == 4  # the record keyed its page

    b = Request("b", [20, 21, 22, 23, 24, 25], SamplingParams())
    alloc.grow(b.pages, 6)
    b.num_computed = 6
    assert cache.index(b.cache_nodes, b.prompt_ids, b.output_ids, b.pages, b.num_computed, until_new=True)
    cache.defer(b)
    b0, b_pages = b.pages[0], list(b.pages)
    alloc.give_to_cache(b.pages, *cache.release_request(b))
    alloc.free(b.pages)  # (tail first: the least recently released is its last page)
    assert cache.num_cached == 4 + 3 and cache.num_evictable == 4 + 3
    assert cache.evict(4) == a_pages[:4]  # (the lookup refreshed them, head first)
    assert cache.evict(2) == b_pages[:0:-1]  # b's deferred pages, tail first: its record has nothing left
    assert not cache._pending and cache.num_cached == 1  # b0
    assert [p for p, _ in cache.match([20, 21, 22, 23, 24, 25], 6)] == [b0]


# ---- the engine ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(spec_models):  # the target, EAGLE and EAGLE-3 heads and the draft of the speculation tests
    return spec_models


def make_engine(models, spec: SpeculativeConfig | None = None, **kw) -> Engine:
    kw.setdefault("max_model_len", 256)
    kw.setdefault("page_size", P)
    return Engine(EngineConfig(model=str(models["target"]), device="cpu", speculative_config=spec, **kw))


def shared_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts sharing prefixes of every alignment to the page size (P-1, P, P+1, 2P, 2P+1), each followed by no or
    two tokens of its own."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(4, 500, (2 * P + 1,), generator=g).tolist()
    out = []
    for n in (P - 1, P, P + 1, 2 * P, 2 * P + 1):
        for q in (0, 2):
            out.append(shared[:n] + torch.randint(4, 500, (q,), generator=g).tolist())
    return out


def spec_config(models, method: str, steps: int = 3, topk: int = 1, ndt: int | None = None):
    if method == "none":
        return None
    return SpeculativeConfig(method=method, model=None if method == "ngram" else str(
        models["eagle" if method == "naive" else method]), num_steps=steps, topk=topk, num_draft_tokens=ndt)


def assert_pages_back(eng: Engine) -> None:
    """Every page is free or held only by the cache."""
    a = eng.allocator
    assert not eng.has_work()
    assert a.num_free == a.capacity_pages and all(a.refs(p) == 0 for p in range(a.num_pages))


def run_twice(eng: Engine, prompts, params):
    """The prompts, then the same prompts again (the second time their pages and their answers' are cached)."""
    out = eng.generate(prompts, params) + eng.generate(prompts, params)
    return [o.token_ids for o in out], [o.spec for o in out], out


@pytest.fixture(scope="module")
def reference(models):
    prompts = shared_prompts()
    eng = make_engine(models, enable_prefix_caching=False)
    return prompts, run_twice(eng, prompts, GREEDY)[0]


CASES = [("none", 1, 1, None), ("eagle", 3, 1, None), ("eagle3", 3, 1, None),
         ("eagle3", 2, 3, 5), ("draft", 3, 1, None), ("ngram", 3, 1, None), ("naive", 1, 1, None)]


@pytest.mark.parametrize("method,steps,topk,ndt", CASES, ids=[f"{c[0]}-s{c[1]}k{c[2]}" for c in CASES])
def test_greedy_cache_on_equals_off_with_eviction_and_preemption(models, reference, method, steps, topk, ndt):
    """A KV budget of a few requests: pages are evicted and requests preempted (their pages released to the cache).
    Tokens equal the reference's; with a draft model or head the accepted drafts equal the cache-off run's too (the
    drafts read the cached draft KV: garbage or another continuation's would change them)."""
    prompts, ref = reference
    spec = spec_config(models, method, steps, topk, ndt)
    runs = {}
    # (the cache-off run is the reference for acceptance: only methods whose drafts read draft KV need it)
    for on in (False, True) if method in ("eagle", "eagle3", "draft") else (True,):
        eng = make_engine(models, spec, kv_cache_tokens=64, max_prefill_tokens=16, enable_prefix_caching=on)
        runs[on] = run_twice(eng, prompts, GREEDY)
        assert runs[on][0] == ref
        assert eng.scheduler.num_preemptions > 0
        assert_pages_back(eng)
        cache = eng.allocator.cache
        if on:
            stats = eng.step_stats()
            assert stats["prefix_cache_hits"] > 0 and cache.evictions > 0
            assert stats["prefix_cache_queries"] == 2 * sum(map(len, prompts))
            assert stats["prefix_cache_hits"] == sum(o.num_cached_tokens for o in runs[on][2])
    if False in runs:  # (rounds cut by preemption differ between the runs: accepted tokens do not)
        accepted = {on: [s["num_accepted_tokens"] for s in run[1]] for on, run in runs.items()}
        assert accepted[True] == accepted[False]


def test_seeded_sampling_cache_on_equals_off(models):
    prompts = shared_prompts(1)
    params = [SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=i) for i in range(len(prompts))]
    for method in ("none", "eagle3"):
        spec = spec_config(models, method)
        runs = [[o.token_ids for o in make_engine(models, spec, kv_cache_tokens=96, max_prefill_tokens=16,
                                                  enable_prefix_caching=on).generate(prompts, params)]
                for on in (False, True)]
        assert runs[0] == runs[1]


def test_abort_mid_share(models, reference):
    """Requests holding the same cached pages; one is aborted while it shares them and one mid-decode: the others'
    tokens are unchanged and the shared pages stay with them, then with the cache."""
    prompts, ref = reference
    eng = make_engine(models, spec_config(models, "eagle3"), max_prefill_tokens=16)
    eng.generate(prompts[-1:], GREEDY)  # caches the shared prefix's pages
    reqs = [eng.add_request(p, GREEDY) for p in prompts]
    sharing: list = []
    for _ in range(20):
        eng.step()
        sharing = [r for r in reqs if not r.finished and r.pages and eng.allocator.refs(r.pages[0]) > 1]
        if len(sharing) >= 2:
            break
    assert len(sharing) >= 2
    assert eng.abort(sharing[0].rid)
    assert all(eng.allocator.refs(r.pages[0]) >= 1 for r in sharing[1:])
    while not any(r.output_ids and not r.finished for r in reqs):
        eng.step()
    assert eng.abort(next(r for r in reqs if r.output_ids and not r.finished).rid)
    firsts = {}
    while eng.has_work():
        for o in eng.step():
            firsts.setdefault(o.rid, o.num_cached_tokens)
    assert sum(r.finish_reason == "abort" for r in reqs) == 2
    assert all(firsts[r.rid] == r.num_cached_tokens for r in reqs if r.rid in firsts)
    assert any(r.num_cached_tokens for r in reqs if r.rid in firsts)
    for i, r in enumerate(reqs):
        if r.finish_reason != "abort":
            assert r.output_ids == ref[i]
    assert_pages_back(eng)
    assert eng.allocator.cache.num_cached > 0


@pytest.mark.parametrize("method,topk,ndt", [("eagle3", 2, 5), ("eagle", 1, None)])
def test_eagle_state_after_a_hit_equals_a_cold_prefill(models, method, topk, ndt):
    """A prompt that continues a cached one past a page boundary differently: the head's state after its prefill
    (which attends to the cached pages' draft KV) equals a fresh engine's after prefilling it all."""
    spec = spec_config(models, method, 3, topk, ndt)
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(4, 500, (3 * P,), generator=g).tolist()
    first, second = shared + [7, 8], shared + [9, 10, 11]
    states = []
    for warm in (True, False):
        eng = make_engine(models, spec, disable_overlap_schedule=True)
        if warm:
            eng.generate([first], SamplingParams(max_tokens=1, temperature=0.0))
        req = eng.add_request(second, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        eng.step()  # its prefill
        p = eng.executor.worker.proposer
        slot = req.req_slot
        states.append((req.num_cached_tokens, p.state_ids[slot].clone(), p.state_logp[slot].clone(),
                       p.state_feat[slot].clone()))
    assert torch.equal(states[0][1], states[1][1])
    torch.testing.assert_close(states[0][2], states[1][2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[0][3], states[1][3], atol=1e-5, rtol=1e-5)  # (the head's output feature)
    # the page ending where the prompts part is not reused (its last slot's head KV saw token 7): 2 of 3 pages
    assert states[0][0] == 2 * P and states[1][0] == 0


def test_hit_rate_with_speculation_equals_without(models):
    """A shared system prompt (not page-aligned) and several questions, then a second turn of each chat (prompt +
    answer + a new question): the same tokens hit under every drafter as without speculation; the second turn's
    hits include the cached answers' pages."""
    g = torch.Generator().manual_seed(4)
    system = torch.randint(4, 500, (3 * P + 2,), generator=g).tolist()
    questions = [torch.randint(4, 500, (5,), generator=g).tolist() for _ in range(4)]
    params = SamplingParams(max_tokens=2 * P + 3, temperature=0.0, ignore_eos=True)
    hits = {}
    for method in ("none", "eagle3", "draft", "ngram"):
        eng = make_engine(models, spec_config(models, method), max_prefill_tokens=64)
        first = eng.generate([system + questions[0]], params)  # caches the system prompt
        turn1 = first + eng.generate([system + q for q in questions[1:]], params)
        after1 = eng.step_stats()["prefix_cache_hits"]
        follow = [c.prompt_token_ids + c.token_ids + [11, 12, 13] for c in turn1]
        turn2 = eng.generate(follow, params)
        hits[method] = (after1, [c.num_cached_tokens for c in turn2])
        assert after1 == 3 * (3 * P)  # the system prompt's full pages, for each later question
        for c, t2 in zip(turn1, turn2):  # every full page of the first turn's prompt and answer but the last token's
            assert t2.num_cached_tokens == (len(c.prompt_token_ids) + len(c.token_ids) - 1) // P * P
        assert_pages_back(eng)
    assert all(h == hits["none"] for h in hits.values()), hits


@pytest.mark.parametrize("method", ["none", "eagle3"])
def test_deferred_keys_find_what_keying_every_page_finds(models, method):
    """Lookups find what keying every full page as it fills finds (the reference: a scheduler that never defers),
    request by request: prompts sharing prefixes of every alignment with requests still running (deferred) and
    finished (records), then chats continuing each answer. Few slots, so the requests come in waves."""
    g = torch.Generator().manual_seed(2)
    base = torch.randint(4, 500, (4 * P + 1,), generator=g).tolist()
    first = [base[:n] + torch.randint(4, 500, (q,), generator=g).tolist()
             for n in (P - 1, P, P + 1, 2 * P, 3 * P + 1, 4 * P + 1) for q in (0, 3, P + 2)]
    params = SamplingParams(max_tokens=2 * P + 1, temperature=0.0, ignore_eos=True)
    cached = {}
    for eager in (False, True):
        eng = make_engine(models, spec_config(models, method), max_num_seqs=3, max_prefill_tokens=16)
        if eager:
            sched, cache = eng.scheduler, eng.allocator.cache

            def key_every_page(req, sched=sched, cache=cache):
                if req.num_computed >= req.cache_at:
                    cache.index(req.cache_nodes, req.prompt_ids, req.output_ids, req.pages, req.num_computed)
                    req.cache_at = (len(req.cache_nodes) + 1) * cache.page_size

            sched._cache_pages = key_every_page
        out = eng.generate(first, params)
        chats = [p + o.token_ids + [7, 8, 9] for p, o in zip(first, out)]
        out += eng.generate(chats, params)
        cached[eager] = [o.num_cached_tokens for o in out]
        assert_pages_back(eng)
    assert cached[False] == cached[True]
    assert sum(cached[False][:len(first)]) > 0 and all(c > 0 for c in cached[False][len(first):]), cached


def test_cache_off_by_config(models):
    eng = make_engine(models, enable_prefix_caching=False)
    prompts = shared_prompts()
    eng.generate(prompts, GREEDY)
    out = eng.generate(prompts, GREEDY)
    assert eng.allocator.cache is None and all(o.num_cached_tokens == 0 for o in out)
    assert eng.step_stats()["prefix_cache_hits"] == 0 == eng.step_stats()["prefix_cache_queries"]
