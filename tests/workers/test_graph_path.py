"""The CUDA-graph path (static input buffers, batches padded to a bucket, lengths only on the device, the round
fused or split into phases) run eagerly on the CPU: the same tokens as the plain eager path, padding rows never
leak into real ones, and the pad slot's writes stay on the reserved page 0."""

from __future__ import annotations

import pytest

from deployments.engine.request import SamplingParams
from tests.helpers import mixed_prompts
from tests.speculative.test_speculative import GREEDY, engine, spec_models  # noqa: F401  (fixture)
from workers.config import SpeculativeConfig
from workers.graphs import batch_buckets

SAMPLED = SamplingParams(max_tokens=16, temperature=0.8, top_k=50, top_p=0.9, seed=7, ignore_eos=True)
TEMPERATURE_ONLY = SamplingParams(max_tokens=16, temperature=0.8, seed=9, ignore_eos=True)
KIND = {id(GREEDY): "greedy", id(SAMPLED): "filter", id(TEMPERATURE_ONLY): "sample"}


def test_captures_pause_the_garbage_collector():
    """No collection inside a capture (it could destroy a dropped engine's graphs there, which fails the capture);
    the collector's state comes back after, also after an error, and a collector that was off stays off."""
    import gc

    from workers.kernels.launch import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_sampling_kinds_listed_once():
    from pydantic import ValidationError

    from workers.config import EngineConfig

    assert EngineConfig(model="m").cuda_graph_sampling_kinds == ["sample", "filter"]
    with pytest.raises(ValidationError, match="lists a kind twice"):  # (its graphs would be captured twice)
        EngineConfig(model="m", cuda_graph_sampling_kinds=["filter", "filter"])


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(64)[-3:] == [48, 56, 64]


def _run(target, spec, params, prompts, graphs: bool, kinds=None, caplog=None, **kw):
    """``kinds``: the sampling kinds captured at start-up (None: the default, both)."""
    if kinds is not None:
        kw["cuda_graph_sampling_kinds"] = kinds
    eng = engine(target, spec, cuda_graph_max_bs=8, **kw)
    worker = eng.executor.worker
    if graphs:
        worker.capture_graphs()
        at_start = set(worker.graphs.phases)
        for runner in (worker.graphs, worker.extend_graphs):  # as once a GPU worker has started: a capture from
            if runner is not None:  # now on is counted and logged
                runner.serving = True
        assert worker.compile_stats() is None  # (the CPU: no compile watch, so the core's stats carry none)
    out = [o.token_ids for o in eng.generate(prompts, params)]
    if graphs:  # every bucket greedy and the start-up kinds, others when used; the pad slot's page stays unused
        phases = len(next(iter(worker.graphs.phases.values())))
        assert len(worker.graphs.graphs) == len(worker.graphs.phases) * phases
        start_kinds = {"greedy", *(["sample", "filter"] if kinds is None else kinds)}
        assert at_start == {(b, k, False) for b in worker.graphs.buckets for k in start_kinds}
        late = set(worker.graphs.phases) - at_start
        kind = KIND[id(params)] if params.temperature > 0 else "greedy"
        assert {k for _, k, _ in late} == ({kind} if kind not in start_kinds else set())
        assert worker.graphs.late_captures == len(late) * phases  # one per graph
        ext = worker.extend_graphs
        if ext is not None:  # the prefill graphs likewise (the kind's prefills came first)
            assert {k for _, _, k in ext.captured} == start_kinds | {kind}
            assert ext.late_captures == (0 if kind in start_kinds else len({(t, r) for t, r, k in ext.captured
                                                                                 if k == kind}))
        if caplog is not None:  # each logged
            assert sum("after start-up" in r.getMessage() for r in caplog.records) == \
                worker.graphs.late_captures + (ext.late_captures if ext is not None else 0)
        assert int(worker.page_table.table[worker.graphs.static.pad_slot].abs().sum()) == 0
        assert worker.graphs.num_replays >= 10
    assert eng.allocator.num_free == eng.allocator.capacity_pages
    return out


CASES = [  # (method, steps, topk, draft tokens, fused round)
    (None, 0, 0, None, True),
    ("eagle3", 3, 1, None, True),
    ("eagle", 3, 3, 6, False),
    ("draft", 2, 2, 4, True),
    ("ngram", 3, 1, None, False),
    ("naive", 1, 1, None, False),
]


@pytest.mark.parametrize("method,steps,topk,ndt,fused", CASES, ids=[f"{c[0]}-fused{c[4]}" for c in CASES])
def test_graph_path_matches_eager(spec_models, method, steps, topk, ndt, fused, caplog):  # noqa: F811
    spec = None
    if method is not None:
        spec = SpeculativeConfig(method=method, model=None if method == "ngram" else str(spec_models[
            "eagle" if method == "naive" else method]), num_steps=steps, topk=topk, num_draft_tokens=ndt)
    prompts = mixed_prompts(6)  # 6 running requests, padded to the bucket of 8
    # each sampling kind once captured at start-up (the default, both), once on first use
    for params, kinds in ((GREEDY, None), (SAMPLED, ["sample"]), (TEMPERATURE_ONLY, ["filter"]), (SAMPLED, None)):
        eager = _run(spec_models["target"], spec, params, prompts, graphs=False)
        static = _run(spec_models["target"], spec, params, prompts, graphs=True, kinds=kinds,
                      fuse_speculative_round=fused, caplog=caplog)
        caplog.clear()
        assert static == eager


TOP = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5)


def _top_logprobs(eng, prompts, params):
    reqs = [eng.add_request(p, params) for p in prompts]
    while eng.has_work():
        eng.step()
    return [r.output_ids for r in reqs], [r.output_top_logprobs for r in reqs], [r.output_logprobs for r in reqs]


@pytest.mark.parametrize("method,steps,topk,ndt,fused", CASES[:4], ids=[f"{c[0]}-fused{c[4]}" for c in CASES[:4]])
@pytest.mark.parametrize("graphs", [False, True])
def test_top_logprobs_match_plain_decode(spec_models, method, steps, topk, ndt, fused, graphs):  # noqa: F811
    """Each token's 5 most likely alternatives: from the prefill, from plain decode steps, and (speculating) from
    the verify logits at each emitted position, eager or through the graph path's variant with alternatives; all
    equal to plain eager decoding's, the greedy token first with exactly its own logprob."""
    target = spec_models["target"]
    prompts = mixed_prompts(3)
    ref_ids, ref_top, ref_lp = _top_logprobs(engine(target), prompts, TOP)
    for ids, tops, lps in zip(ref_ids, ref_top, ref_lp):
        assert len(tops) == len(ids) == 10
        for tok, top, lp in zip(ids, tops, lps):
            assert len(top) == 5 and top[0][0] == tok and top[0][1] == lp, (top[0], lp)
            assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))
    spec = None if method is None else SpeculativeConfig(
        method=method, model=str(spec_models[method]), num_steps=steps, topk=topk, num_draft_tokens=ndt)
    eng = engine(target, spec, cuda_graph_max_bs=8, fuse_speculative_round=fused)
    if graphs:
        eng.executor.worker.capture_graphs()
    ids, top, lps = _top_logprobs(eng, prompts, TOP)
    assert ids == ref_ids
    assert all(t[0][1] == lp for tops, lp_row in zip(top, lps) for t, lp in zip(tops, lp_row)), "logprob vs top entry"
    for got, ref in zip(top, ref_top):
        for g, r in zip(got, ref):
            assert [t for t, _ in g] == [t for t, _ in r], (g, r)
            assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(g, r))
    if graphs:  # the variant with alternatives was captured and replayed
        assert any(top_variant for _, _, top_variant in eng.executor.worker.graphs.phases)
    # in a batch where one request asks for alternatives, one that does not keeps none
    asks = eng.add_request(prompts[0], TOP)
    plain = eng.add_request(prompts[1], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    while eng.has_work():
        eng.step()
    assert len(asks.output_top_logprobs) == 10 and plain.output_top_logprobs == [] and plain.output_ids == ref_ids[1]


def test_late_captures_reach_the_compile_stats(spec_models, monkeypatch):  # noqa: F811
    """Graphs captured after start-up (a kind's first use) are summed over the decode and prefill graphs into the
    worker's compile stats, beside the Triton compiles; capturing everything again (start-up's capture) adds none."""
    from workers.kernels.launch import compile_watch

    eng = engine(spec_models["target"], None, cuda_graph_max_bs=4, cuda_graph_max_prefill_tokens=32,
                 cuda_graph_sampling_kinds=[])
    worker = eng.executor.worker
    worker.capture_graphs()
    assert worker.compile_stats() is None  # (the CPU: the compile watch never starts)
    monkeypatch.setattr(compile_watch(), "started", True)  # as on a GPU once the worker is up
    for runner in (worker.graphs, worker.extend_graphs):
        runner.serving = True
    eng.generate([[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]], SAMPLED)  # "filter": prefill and decode graphs
    stats = worker.compile_stats()
    assert stats["graph_captures"] == worker.graphs.late_captures + worker.extend_graphs.late_captures
    assert worker.graphs.late_captures > 0 and worker.extend_graphs.late_captures > 0, stats
    assert stats["compiles"] == compile_watch().compiles and stats["graph_capture_s"] >= 0
    worker.capture_graphs()
    assert worker.compile_stats()["graph_captures"] == stats["graph_captures"]
    assert worker.graphs.serving and worker.extend_graphs.serving  # (still counting what comes later)
