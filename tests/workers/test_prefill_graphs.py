"""Prefill (EXTEND) steps through the prefill graphs' path (static buffers, tokens padded to a bucket by a padding
request on the pad slot, requests padded by empty ones, lengths only on the device), run eagerly on the CPU: the
same tokens and logprobs as the eager prefill, with chunked prompts, prefix-cache hits and sampling; steps the graphs
do not cover run eagerly; the pad slot's page stays unused."""

from __future__ import annotations

import pytest

from deployments.engine.request import SamplingParams
from tests.helpers import mixed_prompts
from tests.models.test_shipped_models import DRAFT, EAGLE3, PROMPTS, TARGET
from tests.speculative.test_speculative import engine, spec_models  # noqa: F401  (fixture)
from workers.config import SpeculativeConfig
from workers.graphs import ExtendGraphs

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
GREEDY_LONG = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True)
SEEDED = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.8, seed=3, ignore_eos=True, logprobs=True)


def _run(target, waves, params, graphs: bool, spec=None):
    # (no decode rows in prefill steps: with decode graphs on a GPU they never ride in them)
    eng = engine(target, spec, cuda_graph_max_bs=4, cuda_graph_max_prefill_tokens=64, max_prefill_tokens=80,
                 mixed_decode_rows=0 if spec is None else None)
    worker = eng.executor.worker
    if graphs:
        worker.capture_graphs()
        ext = worker.extend_graphs
        assert isinstance(ext, ExtendGraphs) and ext.token_buckets == [16, 32, 64]
        assert {(t, r) for t, r, kind in ext.captured if kind == "greedy"} == {
            (t, r) for t in ext.token_buckets for r in ext.request_buckets}
    out = []
    for prompts in waves:  # one after the other: a later wave hits the earlier one's cached pages
        reqs = [eng.add_request(p, params) for p in prompts]
        while eng.has_work():
            eng.step()
        out += [(r.output_ids, r.output_logprobs, r.spec.num_accepted_tokens, list(r.spec.accepted_per_position))
                for r in reqs]
    assert eng.allocator.num_free == eng.allocator.capacity_pages
    hits = eng.allocator.cache.hits
    if graphs:
        assert int(worker.page_table.table[ext.static.pad_slot].abs().sum()) == 0
        return out, ext.num_replays, eng.step_time["extend_steps"], hits
    return out, 0, eng.step_time["extend_steps"], hits


def _same(static, eager) -> bool:
    """Tokens and accept counts equal, logprobs within 1e-4 (a padded batch's matmuls may round differently)."""
    return len(static) == len(eager) and all(
        a[0] == b[0] and a[2:] == b[2:] and len(a[1]) == len(b[1])
        and all(abs(x - y) < 1e-4 for x, y in zip(a[1], b[1])) for a, b in zip(static, eager))


SPECS = [None, ("eagle3", 3, 1), ("eagle", 2, 2), ("draft", 3, 1)]


@pytest.mark.parametrize("spec", SPECS, ids=[s[0] if s else "none" for s in SPECS])
def test_prefill_graph_path_matches_eager(spec_models, spec):  # noqa: F811
    """Prompts of 1-200 tokens in 80-token steps (several requests a step; steps past the largest bucket run
    eagerly), then prompts that extend three of them (prefills that start after cached pages, in graphs): greedy and
    seeded sampling give the eager prefill's tokens (and logprobs, to rounding), with the draft's prefill in the
    graphs too (the accept counts are compared as well; the drafts here are random: the test below accepts)."""
    target = spec_models["target"]
    cfg = None if spec is None else SpeculativeConfig(method=spec[0], model=str(spec_models[spec[0]]),
                                                      num_steps=spec[1], topk=spec[2])
    first = mixed_prompts(8) + [list(range(10, 210))]
    waves = [first, [p + [7, 8, 9] for p in first[3:6]], mixed_prompts(3, seed=1)]
    for params in (GREEDY, SEEDED) if spec is None else (GREEDY,):
        eager, _, _, eager_hits = _run(target, waves, params, graphs=False, spec=cfg)
        static, replays, extends, hits = _run(target, waves, params, graphs=True, spec=cfg)
        assert _same(static, eager)
        assert hits == eager_hits > 0
        assert 0 < replays < extends  # later waves' prefills replayed graphs, the first wave's 80-token steps not


@pytest.mark.parametrize("method,head", [("eagle3", EAGLE3), ("draft", DRAFT)])
def test_prefill_graphs_keep_the_drafts_accepted(method, head):
    """The shipped family, whose drafts are accepted: the draft's prefill inside the graphs leaves the state and KV
    that the eager prefill leaves, so every round accepts the same drafts (a wrong draft state or KV in a graph
    would change the accept counts, not the tokens)."""
    cfg = SpeculativeConfig(method=method, model=str(head), num_steps=3)
    waves = [PROMPTS, [p + "        return None\n" for p in PROMPTS]]
    eager, _, _, _ = _run(TARGET, waves, GREEDY_LONG, graphs=False, spec=cfg)
    static, replays, _, _ = _run(TARGET, waves, GREEDY_LONG, graphs=True, spec=cfg)
    assert _same(static, eager) and replays > 0
    assert sum(o[2] for o in eager) > len(eager) * 8  # accepted drafts, of 24 tokens a request


def test_prefill_graph_buckets(spec_models):  # noqa: F811
    """Off at 0; otherwise buckets up to the prefill chunk, and within a page table row (the padding request stores
    a bucket's tokens at its positions): at max_model_len 512, none past 512."""
    assert engine(spec_models["target"], cuda_graph_max_prefill_tokens=0).executor.worker.extend_graphs is None
    ext = engine(spec_models["target"], max_model_len=512).executor.worker.extend_graphs
    assert ext.token_buckets == [16, 32, 64, 128, 256, 512]
    ext = engine(spec_models["target"], max_model_len=1024, max_prefill_tokens=256).executor.worker.extend_graphs
    assert ext.token_buckets[-1] == 256


def test_prefill_graph_buckets_fit_the_page_table(spec_models):  # noqa: F811
    """A bucket's padding request holds up to the whole bucket at positions 0.. on the pad slot (a capture: all of
    it), so no bucket may pass a request's page-table row: with max_model_len below the prefill budget, the
    captures' inputs run (a GPU capture runs them) and a step of several short prompts padded past one request's
    row replays a graph with the eager prefill's tokens."""
    from workers.graphs import EXTEND_FIELDS

    target = spec_models["target"]
    kw = dict(max_model_len=32, cuda_graph_max_bs=4, cuda_graph_max_prefill_tokens=256, max_prefill_tokens=256,
              mixed_decode_rows=0)
    prompts = [[10 + i + j for j in range(18)] for i in range(4)]  # 72 tokens in one step: a 128 bucket
    eng = engine(target, **kw)
    worker = eng.executor.worker
    worker.capture_graphs()
    ext = worker.extend_graphs
    row = worker.page_table.table.shape[1] * worker.page_table.page_size
    assert ext.token_buckets and max(ext.token_buckets) <= row
    for tb, rb, kind in sorted(ext.captured):
        ext.static.reset()  # the inputs a capture runs on: one padding request holding all tb tokens
        ext.static.ints[EXTEND_FIELDS.index("seq_lens"), 0] = tb
        ext.static.ints[EXTEND_FIELDS.index("extend_lens"), 0] = tb
        ext.graphs[("extend", tb, rb, kind)][1]()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    short = [p[:10] for p in prompts[:2]]  # 20 tokens: a 32 bucket, replayed
    out = [[o.token_ids for o in eng.generate(p, params)] for p in (prompts, short)]
    assert ext.num_replays > 0
    kw["cuda_graph_max_prefill_tokens"] = 0
    eager = engine(target, **kw)
    assert out == [[o.token_ids for o in eager.generate(p, params)] for p in (prompts, short)]
    assert all(len(x) == 4 for x in out[0] + out[1])


@pytest.mark.parametrize("spec", [None, ("eagle3", 3, 1)], ids=["none", "eagle3"])
def test_prefill_step_of_exactly_a_bucket(spec_models, spec):  # noqa: F811
    """Steps of exactly 16, 32 and 64 tokens (64: the largest bucket, as a full ``max_prefill_tokens`` chunk is on a
    GPU): without a draft each replays its own bucket (its padding request left empty); with one, the next bucket up
    (the draft's prefill needs a padding token), and the largest runs eagerly. The eager prefill's tokens either way."""
    target = spec_models["target"]
    cfg = None if spec is None else SpeculativeConfig(method=spec[0], model=str(spec_models[spec[0]]),
                                                      num_steps=spec[1], topk=spec[2])
    waves = [[list(range(10, 26))], [list(range(30, 46)), list(range(50, 66))], [list(range(100, 164))]]
    out = {}
    for graphs in (False, True):
        eng = engine(target, cfg, cuda_graph_max_bs=4, cuda_graph_max_prefill_tokens=64, max_prefill_tokens=80,
                     mixed_decode_rows=0 if spec is None else None)
        keys = []
        if graphs:
            eng.executor.worker.capture_graphs()
            ext = eng.executor.worker.extend_graphs
            replay = ext.replay
            ext.replay = lambda key: (keys.append(key[1]), replay(key))[1]
        out[graphs] = [[(o.token_ids, o.logprobs) for o in eng.generate(w, GREEDY)] for w in waves]
        if graphs:
            assert keys == ([16, 32, 64] if spec is None else [32, 64])
    assert [[t for t, _ in w] for w in out[True]] == [[t for t, _ in w] for w in out[False]]
    assert all(abs(x - y) < 1e-4 for a, b in zip(out[True], out[False]) for (_, la), (_, lb) in zip(a, b)
               for x, y in zip(la, lb))
