"""Adaptive speculation: outputs are the same whatever depth each step drafts (greedy token-exact, seeded sampling
equal to no speculation) with the depth forced to change between steps, the draft stays in step across plain
steps, the chooser's arithmetic, and its re-adaptation when acceptance changes."""

from __future__ import annotations

import math

import pytest
import torch

from deployments.engine.request import RequestStatus, SamplingParams
from speculative.adaptive import AcceptanceEstimate, DepthChooser, DepthSchedule, context_level, expected_tokens
from tests.helpers import mixed_prompts
from tests.speculative.test_speculative import GREEDY, engine, spec_models  # noqa: F401  (fixture)
from workers.config import SpeculativeConfig
from workers.graphs import PAUSED_DEPTH
from workers.messages import ForwardMode

SEEDED = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
# every depth, each followed by every other (plain steps between rounds, rounds of every depth after plain steps)
SCHEDULE = [0, 3, 0, 0, 1, 2, 0, 3, 3, 1, 0, 2]


def _spec(models, method: str, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(method=method, model=None if method == "ngram" else str(models[method]), num_steps=3,
                             **kw)


@pytest.fixture(scope="module")
def references(spec_models):
    prompts = mixed_prompts(6)
    eng = engine(spec_models["target"])
    return prompts, {id(p): [o.token_ids for o in eng.generate(prompts, p)] for p in (GREEDY, SEEDED)}


@pytest.mark.parametrize("method", ["eagle3", "draft", "ngram"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_forced_depths_equal_no_speculation(spec_models, references, method, params):
    """Depth changing every step (preemption and the overlap schedule on): the tokens are no speculation's."""
    prompts, ref = references
    eng = engine(spec_models["target"], _spec(spec_models, method), kv_cache_tokens=160, max_prefill_tokens=32)
    eng.depth_policy = DepthSchedule(SCHEDULE)
    out = eng.generate(prompts, params)
    assert [o.token_ids for o in out] == ref[id(params)]
    assert set(eng.steps_by_depth) == {0, 1, 2, 3}
    assert eng.scheduler.num_preemptions > 0
    stats = eng.step_stats()["adaptive"]
    assert stats["policy"] == "schedule" and sum(stats["steps_by_depth"].values()) == sum(eng.steps_by_depth.values())
    for o in out:  # plain steps count no drafts; each round its own depth's
        s = o.spec
        assert s["num_drafts"] > 0 and s["num_drafts"] <= s["num_draft_tokens"] <= 3 * s["num_drafts"]


@pytest.mark.parametrize("fused", [True, False])
def test_forced_depths_on_the_graph_path(spec_models, references, fused):
    """The CUDA-graph path (run eagerly on the CPU): a round per depth tier per bucket, each captured at start-up,
    with the depth forced to change; the costs were timed per bucket and tier."""
    prompts, ref = references
    eng = engine(spec_models["target"], _spec(spec_models, "eagle3", adaptive=True, catch_up_window=2),
                 cuda_graph_max_bs=8, fuse_speculative_round=fused)
    worker = eng.executor.worker
    costs = eng.executor.depth_costs
    # every tier, and the catch-up over one plain step's token and over a full stash (-L)
    assert sorted(costs) == [1, 2, 4, 8] and all(sorted(row) == [-2, -1, 0, 1, 2, 3] for row in costs.values())
    # and timed again with every row at a longer context (512 tokens here): what a step grows by per token (the
    # timings' difference, which on a loaded CPU can be noise: none below 0); the rows' pages are given back after
    per_token = eng.executor.context_costs
    assert worker.cost_context(eng.executor.num_pages) == 512
    assert sorted(per_token) == sorted(costs) and all(sorted(r) == [0, 1, 2, 3] for r in per_token.values())
    assert min(min(r.values()) for r in per_token.values()) >= 0
    assert not worker.page_table.table.any()
    # the rows were requests at 512 tokens on pages of their own (not timing noise: where the steps wrote): each
    # row's root (position 511) on its own page, and no page past the 8 rows' (1 .. 8 x width, within the pool)
    page, width = 16, -(-(512 + worker.lookahead) // 16)
    k = worker.target.kv_cache.k[0].view(eng.executor.num_pages, page, -1)
    written = set((k != 0).any(dim=2).any(dim=1).nonzero().flatten().tolist()) - {0}  # (page 0: padding rows')
    assert {1 + r * width + 511 // page for r in range(8)} <= written
    assert max(written) <= 8 * width < eng.executor.num_pages
    assert eng.depth_policy.context_costs == per_token
    assert isinstance(eng.depth_policy, DepthChooser) and eng.depth_policy.window == 2
    worker.capture_graphs()
    # num_steps: the plain round's keys; the draft's pause: the step without speculation
    assert {k[3] for k in worker.graphs.phases if len(k) == 4} == {0, 1, 2, PAUSED_DEPTH}
    # every start-up kind at every tier (a sampled batch picks its depth as a greedy one does)
    assert {(k[1], k[3]) for k in worker.graphs.phases if len(k) == 4} == {
        (kind, d) for kind in ("greedy", "sample", "filter") for d in (0, 1, 2, PAUSED_DEPTH)}
    # depth 0 replays the plain decode step's graph, and so does a paused step (without the stash)
    assert all(worker.graphs.phases[(b, "greedy", False, d)] == ["decode"] for b in worker.graphs.buckets
               for d in (0, PAUSED_DEPTH))
    eng.depth_policy = DepthSchedule(SCHEDULE + LAZY_SCHEDULE)
    replays = worker.graphs.num_replays
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == ref[id(GREEDY)]
    assert worker.graphs.num_replays > replays and set(eng.steps_by_depth) == {0, 1, 2, 3}
    assert worker.catch_ups[1] > worker.catch_ups[0] > 0


# long runs of plain steps (the stash of 2 positions fills: the draft catches up inside a plain step too), rounds of
# every depth after them
LAZY_SCHEDULE = [0, 0, 0, 2, 0, 3, 0, 0, 1, 0, 0, 0, 0, 0, 3]


@pytest.mark.parametrize("method,params", [("eagle3", GREEDY), ("eagle3", SEEDED), ("eagle", GREEDY),
                                           ("draft", SEEDED)], ids=["eagle3-greedy", "eagle3-seeded",
                                                                    "eagle-greedy", "draft-seeded"])
def test_lazy_catch_up_equals_no_speculation(spec_models, references, method, params):
    """Plain steps run the target alone and the draft catches up on them before the next round, or when a
    request's stash is full: the tokens are still no speculation's (preemption and the overlap schedule on)."""
    prompts, ref = references
    eng = engine(spec_models["target"], _spec(spec_models, method, catch_up_window=2), kv_cache_tokens=160,
                 max_prefill_tokens=32)
    eng.depth_policy = DepthSchedule(LAZY_SCHEDULE)
    out = eng.generate(prompts, params)
    assert [o.token_ids for o in out] == ref[id(params)]
    assert eng.scheduler.num_preemptions > 0 and set(eng.steps_by_depth) == {0, 1, 2, 3}
    runs, positions = eng.executor.worker.catch_ups
    assert runs > 0 and positions > runs  # catch-ups over several positions at once


def _draft_kv(worker, slot: int, n: int) -> list[torch.Tensor]:
    """The draft's K and V of every layer at positions 0 .. n-1 of request ``slot``."""
    pos = torch.arange(n)
    kv = worker.proposer.runner.kv_cache
    at = worker.page_table.slots(torch.full_like(pos, slot), pos)
    return [t[at] for t in kv.k + kv.v]


@pytest.mark.parametrize("method", ["eagle3", "draft"])
def test_catch_up_leaves_the_draft_kv_of_a_prefill(spec_models, method):
    """After runs of plain steps (caught up in a plain step when the stash of 3 fills, and before each round), the
    draft's KV at every position it has consumed equals what one prefill of the same tokens writes (fp32)."""
    prompt = mixed_prompts(4)[3]
    # one step at a time, so that the last step applied is the last one run
    eng = engine(spec_models["target"], _spec(spec_models, method, catch_up_window=3), page_size=4,
                 max_prefill_tokens=16, disable_overlap_schedule=True)
    eng.depth_policy = DepthSchedule([0, 0, 0, 0, 0, 2, 0, 1])
    req = eng.add_request(prompt, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    while len(req.output_ids) < 20 or eng.depth_policy.last_depth == 0:
        eng.step()
    worker = eng.executor.worker
    assert worker.catch_ups[1] >= 5 and not worker.plain_run[req.req_slot]
    n = len(req.all_ids) - 1  # the last token is the next root, which no forward has consumed yet
    fresh = engine(spec_models["target"], _spec(spec_models, method))
    r2 = fresh.add_request(req.all_ids[:-1], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while fresh.has_work():  # one prefill, in request slot 0
        fresh.step()
    assert r2.output_ids == [req.all_ids[-1]]
    for a, b in zip(_draft_kv(worker, req.req_slot, n), _draft_kv(fresh.executor.worker, 0, n)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_draft_keeps_in_step_across_plain_steps(spec_models):
    """The target as its own draft accepts every draft only if the draft saw every token: after plain steps too."""
    spec = SpeculativeConfig(method="draft", model=str(spec_models["target"]), num_steps=3)
    eng = engine(spec_models["target"], spec)
    verdicts = []

    class Recorded(DepthSchedule):
        def observe(self, depth, accepted):
            verdicts.append((depth, accepted))

    eng.depth_policy = Recorded([0, 0, 3, 0, 2, 1, 0, 0, 3])
    eng.generate(mixed_prompts(4), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    assert {d for d, _ in verdicts} == {0, 1, 2, 3}
    for depth, accepted in verdicts:  # every draft of every round, whatever plain steps came before
        assert accepted == [depth] * len(accepted)


def test_adaptive_engine_chooses_from_measured_costs(spec_models, references):
    """adaptive: true on an eager engine: start-up eager timings, the chooser's depths, the same tokens, and the
    choice visible in the stats."""
    from deployments.engine.engine import Engine
    from deployments.engine.metrics import EngineMetrics
    from workers.config import EngineConfig

    prompts, ref = references
    eng = Engine(EngineConfig(model=str(spec_models["target"]), device="cpu", max_model_len=512, max_num_seqs=8,
                              speculative_config=_spec(spec_models, "eagle3", adaptive=True)),
                 metrics=EngineMetrics("adaptive-test"))  # (records steps by depth through ray.util.metrics)
    assert isinstance(eng.depth_policy, DepthChooser)
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == ref[id(GREEDY)]
    stats = eng.step_stats()["adaptive"]
    assert stats["policy"] == "adaptive" and len(stats["acceptance"]) == 3 and stats["tiers"] == [0, 1, 2, 3]
    assert eng.depth_policy.window == 16 and all(row[-16] > 0 for row in eng.executor.depth_costs.values())
    assert sum(stats["steps_by_depth"].values()) > 0


def test_config():
    assert SpeculativeConfig(method="ngram").resolved_adaptive(decode_graphs=True)
    assert not SpeculativeConfig(method="ngram").resolved_adaptive(decode_graphs=False)
    assert not SpeculativeConfig(method="ngram", adaptive=False).resolved_adaptive(decode_graphs=True)
    tree = SpeculativeConfig(method="eagle", model="x", topk=2, num_steps=3, num_draft_tokens=6)
    assert not tree.resolved_adaptive(decode_graphs=True)  # trees: off unless asked for, and refused then
    with pytest.raises(ValueError, match="adaptive speculation chooses among chain depths"):
        SpeculativeConfig(method="eagle", model="x", topk=2, num_steps=3, num_draft_tokens=6, adaptive=True)
    assert SpeculativeConfig(method="ngram", num_steps=4, depth_tiers=[4, 0, 2]).tiers() == [0, 2, 4]
    assert SpeculativeConfig(method="ngram", num_steps=2).tiers() == [0, 1, 2]
    with pytest.raises(ValueError, match="depth_tiers"):
        SpeculativeConfig(method="ngram", num_steps=4, depth_tiers=[0, 2])


# ---- the chooser ---------------------------------------------------------------------------------------------
# per-step ms shaped like an 8B target with a one-layer head: at bs 1 a round costs little more than a plain step
# (memory-bound), at bs 256 each draft step and each verified token adds compute
COSTS = {1: {0: 7.0, 1: 7.6, 2: 8.1, 3: 8.6}, 64: {0: 9.0, 1: 11.5, 2: 13.5, 3: 15.5},
         256: {0: 20.0, 1: 33.0, 2: 45.0, 3: 57.0}}


def test_expected_tokens():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens([1.0, 1.0, 0.0], 3) == 3.0


def test_chooser_math():
    c = DepthChooser(COSTS, num_steps=3)
    assert c.best(256, [0.3, 0.3, 0.3]) == 0  # low acceptance, large batch: plain steps
    assert c.best(1, [0.9, 0.9, 0.9]) == 3  # high acceptance, one request: the deepest
    assert c.best(1, [0.3, 0.3, 0.3]) > 0  # (a round costs little more than a plain step at bs 1)
    assert c.best(64, [1.0, 0.0, 0.0]) == 1  # exactly one draft accepted: one draft
    assert c.best(200, [0.9, 0.9, 0.9]) == c.best(256, [0.9, 0.9, 0.9])  # a batch takes its bucket's costs
    # the choice maximises E(d) / cost(d)
    for bs, p in [(64, [0.8, 0.6, 0.4]), (256, [0.95, 0.9, 0.9])]:
        d = c.best(bs, p)
        assert all(expected_tokens(p, d) / COSTS[bs][d] >= expected_tokens(p, e) / COSTS[bs][e] for e in range(4))


def test_best_reads_a_callers_acceptance_as_it_is_now():
    """``best`` with the caller's acceptance list, changed in place between two calls: the second reads its new
    values (nothing the chooser keeps is read from the caller's list)."""
    c = DepthChooser(COSTS, num_steps=3)
    p = [0.3, 0.3, 0.3]
    assert c.best(256, p) == 0
    p[:] = [0.95, 0.95, 0.95]
    assert c.best(256, p) == c.best(256, [0.95, 0.95, 0.95]) == 3


def test_chooser_pays_the_catch_up_on_leaving_depth_0():
    """A round after L plain steps first catches the draft up on them (costs key -L, interpolated): a marginal
    gain does not leave depth 0 with a long catch-up due, a round right after a round is chosen as before, and
    on a full stash (where a plain step catches up too) the catch-up weighs on neither."""
    costs = {64: {**COSTS[64], -1: 0.5, -8: 4.0}}
    c = DepthChooser(costs, num_steps=3, margin=0.0)
    assert c.window == 8 and c.catch_up_cost(64, 4) == pytest.approx(0.5 + 3.5 * 3 / 7)
    p = [0.3, 0.3, 0.3]  # a round of 1 gives 1.3 tokens in 11.5 ms vs 1 in 9 ms: 1.7 % better
    assert c.best(64, p, lag=0) == 1
    assert c.best(64, p, lag=1) == 0 and c.best(64, p, lag=7) == 0
    assert c.best(64, p, lag=8) == 1  # the stash is full: the next plain step would catch up as well
    # the chooser counts the plain steps it chose since its last round, as the worker does
    c.estimate.accepted, c.estimate.tried = [0.0] * 3, [1.0] * 3
    assert [c.choose(64) for _ in range(3)] == [0, 0, 0] and c.lag == 3
    c.estimate.accepted = [0.3] * 3
    depths = [c.choose(64) for _ in range(12)]
    assert depths[:5] == [0] * 5 and depths[5] == 1 and c.lag == 0  # left at the full stash, then stays


def test_acceptance_estimate():
    est = AcceptanceEstimate(3, prior=0.5)
    for _ in range(30):
        est.update(3, [2, 2, 3, 1])  # position 1 passed by all, 2 by 3 of 4 (tried 4), 3 by 1 of 3
    assert est.p == pytest.approx([1.0, 0.75, 1 / 3], abs=0.01)
    est.update(0, [0, 0])  # plain steps tell nothing
    assert est.p == pytest.approx([1.0, 0.75, 1 / 3], abs=0.01)


def _simulate(chooser: DepthChooser, accept_length: float, rounds: int, bs: int) -> list[int]:
    """``rounds`` steps at batch ``bs`` whose drafts are accepted as the benchmark's simulated acceptance does
    (floor(L - 1 + u), here its mean: the same count for every request), clamped to the chosen depth."""
    depths = []
    for _ in range(rounds):
        d = chooser.choose(bs)
        depths.append(d)
        chooser.observe(d, [min(int(accept_length - 1), d)] * bs)
    return depths


def test_re_adapts_when_acceptance_drops_and_rises():
    c = DepthChooser(COSTS, num_steps=3, probe_interval=10)
    high = _simulate(c, 4.0, 30, 64)
    assert high[-10:] == [3] * 10
    low = _simulate(c, 1.0, 40, 64)
    first_plain = low.index(0)
    assert first_plain <= 20  # re-adapted within 20 rounds
    assert low[first_plain:].count(0) >= len(low[first_plain:]) - 3  # plain, but for the probes
    back = _simulate(c, 4.0, 40, 64)
    assert back[-10:] == [3] * 10  # a probe saw acceptance rise


def test_engine_re_adapts_to_simulated_acceptance(spec_models):
    """The engine's loop end to end (verdicts observed with the overlap schedule's one-step lag): the simulated
    accept length, changed mid-run on the device, moves the chosen depth from the deepest to plain steps within
    20 rounds."""
    spec = SpeculativeConfig(method="eagle3", model=str(spec_models["eagle3"]), num_steps=3,
                             simulated_accept_length=4.0)
    eng = engine(spec_models["target"], spec)
    # (no margin: the rounds run until the estimate itself has fallen, which the last line checks)
    eng.depth_policy = chooser = DepthChooser({8: COSTS[64]}, num_steps=3, probe_interval=1000, margin=0.0)
    for p in mixed_prompts(4):
        eng.add_request(p, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    depths = []
    while eng.has_work() and len(depths) < 60:
        if len(depths) == 25:
            eng.executor.worker.spec_round.set_simulated_accept_length(1.0)
            changed = len(depths)
        eng.step()
        depths.append(chooser.last_depth)
    assert depths[15:25] == [3] * 10
    assert 0 in depths[changed:changed + 20] and depths[-10:] == [0] * 10
    assert chooser.estimate.p[0] < 0.2


def test_structured_round_after_plain_steps(spec_models):
    """A structured-output request joins requests that ran plain steps: its rounds (drafted at num_steps, masks
    after the drafts) first catch the draft up on them. Tokens equal no speculation's; the target as its own draft
    still accepts every draft the grammar allows."""
    import json

    from deployments.engine.grammar import GuidedSpec
    from tests.engine.test_structured import SCHEMAS

    target = str(spec_models["target"])
    prompts = mixed_prompts(3)
    ps = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=30, temperature=0.9, seed=3, ignore_eos=True),
          SamplingParams(max_tokens=16, temperature=0.0, guided=GuidedSpec("json_schema", json.dumps(SCHEMAS[0])))]

    def run(eng):
        reqs = [eng.add_request(p, sp) for p, sp in zip(prompts[:2], ps[:2])]
        for _ in range(8):  # plain steps only (rounds only every fourth step)
            eng.step()
        reqs.append(eng.add_request(prompts[2], ps[2]))
        while eng.has_work():
            eng.step()
        return [r.output_ids for r in reqs]

    ref = run(engine(target))
    eng = engine(target, SpeculativeConfig(method="draft", model=target, num_steps=3))
    eng.depth_policy = DepthSchedule([0, 0, 0, 3])
    assert run(eng) == ref
    assert eng.executor.worker.catch_ups[1] > eng.executor.worker.catch_ups[0] > 0


def test_plain_step_graphs_make_their_own_norm_fusion_choice(spec_models, references, tmp_path, monkeypatch):
    """Where a bucket's forwards could run the norms inside the linears, the plain step's graphs (the target alone,
    as without speculation) are captured both ways and timed apart from the rounds', their choice kept in the
    tuning cache under a key of their own; no graph of the losing way is left."""
    from workers import graphs
    from workers.kernels.tuning import TuningCache

    monkeypatch.setattr(graphs.DecodeGraphs, "_norm_fusion_open", lambda self, bucket: True)
    monkeypatch.setattr(graphs, "NORM_FUSION_PASSES", 1)
    monkeypatch.setattr(graphs, "NORM_FUSION_REPLAYS", 1)
    prompts, ref = references
    eng = engine(spec_models["target"], _spec(spec_models, "eagle3"), cuda_graph_max_bs=2)
    g = eng.executor.worker.graphs
    g.depth_tiers = [0, 1, 2, 3]  # (what adaptive: true sets, without its start-up timings)
    cache = TuningCache(tmp_path / "small_m_linear.json", "cpu")
    g.capture_all(cache)
    assert sorted(g.norm_fusion) == sorted(g.plain_norm_fusion) == [1, 2]
    assert all(cache.get_choice(g.norm_fusion_key(b) + " | plain step") == g.plain_norm_fusion[b] for b in (1, 2))
    assert len(g.graphs) == sum(len(names) for names in g.phases.values())  # one way kept of each
    eng.depth_policy = DepthSchedule(SCHEDULE)
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == ref[id(GREEDY)]


def test_a_cached_cost_table_is_read_back_only_for_the_same_steps(tiny_models, tmp_path):
    """The start-up tables (step costs, and ms per context token) kept in the tuning cache are read back by a start
    that runs the same steps, and not by one with another target (the key named only the models whose norms are
    folded, none in fp32: every model read the first one's tables) or pages of another size (the context's table is
    mostly attention)."""
    from workers.kernels.tuning import TuningCache

    def tables(model, **kw):  # (n-gram: no draft model to build; a small pool: a short context at start-up)
        eng = engine(model, SpeculativeConfig(method="ngram", num_steps=2, adaptive=True), cuda_graph_max_bs=2,
                     kv_cache_tokens=256, **kw)
        worker = eng.executor.worker
        worker.graphs.capture_all(TuningCache(tmp_path / "small_m_linear.json", "cpu"))
        return worker.graphs.depth_costs([0, 1, 2], worker.page_table, 64)

    first = tables(tiny_models["llama"])
    assert all(first[1].values())  # (both tables stored)
    assert tables(tiny_models["llama"]) == first  # the same steps: read back (no timing repeats to the last bit)
    assert tables(tiny_models["qwen3"]) != first
    assert tables(tiny_models["llama"], page_size=8) != first


# ---- the chooser on an H100's start-up cost table (8B target, EAGLE-3 chain of 3; ms; -L: catch-up over L) ---------
H100_8B = {1: {0: 5.467, 1: 5.911, 2: 6.201, 3: 6.504, -1: 0.380, -16: 0.393},
           16: {0: 5.697, 1: 6.720, 2: 7.069, 3: 7.389, -1: 0.379, -16: 0.476},
           64: {0: 6.814, 1: 7.755, 2: 8.865, 3: 9.873, -1: 0.414, -16: 1.015},
           128: {0: 7.956, 1: 9.764, 2: 12.690, 3: 15.356, -1: 0.445, -16: 1.859},
           256: {0: 9.876, 1: 14.949, 2: 22.993, 3: 28.453, -1: 0.548, -16: 3.533}}


def _served(chooser: DepthChooser, bs: int, steps: int, accepted, seed: int = 0, context: int = 0) -> list[int]:
    """``steps`` steps at batch ``bs`` holding ``context`` tokens of context, each round's verdicts observed one step
    late (the overlap schedule); ``accepted(depth, rng)``: one request's accepted drafts."""
    import random

    rng, depths, pending = random.Random(seed), [], None
    for _ in range(steps):
        d = chooser.choose(bs, context)
        depths.append(d)
        if pending is not None:
            chooser.observe(*pending)
        # (a step with the draft paused is no chosen step: no verdicts)
        pending = None if chooser.paused else (d, [accepted(d, rng) for _ in range(bs)])
    return depths


def _bench_acceptance(length: float):
    """bench.adaptive's simulated acceptance: floor(L - 1 + u) drafts per request, clamped to the depth."""
    return lambda d, rng: min(d, int(length - 1 + rng.random()))


def _per_position(p: float):
    return lambda d, rng: next((i for i in range(d) if rng.random() >= p), d)


def _histogram_update(est: AcceptanceEstimate, depth: int, accepted: list[int], step: int | None) -> None:
    """The estimate's update as a histogram of the verdicts (what ``AcceptanceEstimate.update`` computed before it
    counted with ``list.count``): the oracle of the test below."""
    from collections import Counter

    at_least = [0] * (depth + 2)
    for a, n in Counter(accepted).items():
        at_least[min(a, depth)] += n
    for i in range(depth, -1, -1):
        at_least[i] += at_least[i + 1]
    weight = min(1.0, len(accepted) / est.full_round)
    for i in range(depth):
        if at_least[i]:
            keep = est.decay ** (weight * (1 if step is None else max(1, step - est.at[i])))
            est.accepted[i] = keep * est.accepted[i] + at_least[i + 1]
            est.tried[i] = keep * est.tried[i] + at_least[i]
            est.at[i] = est.at[i] + 1 if step is None else step


def test_estimate_counts_the_verdicts_as_a_histogram_does():
    """Random rounds (depths 1-3, batches of 1-300, verdicts up to the depth, steps in order or none): the counted
    update leaves every position's sums and step where the histogram's does."""
    import random

    rng = random.Random(7)
    fast, oracle = AcceptanceEstimate(3), AcceptanceEstimate(3)
    step = 0
    for _ in range(400):
        depth = rng.randint(1, 3)
        accepted = [min(depth, int(rng.expovariate(0.7))) for _ in range(rng.choice([1, 2, 5, 64, 300]))]
        step += rng.randint(1, 3)
        when = None if rng.random() < 0.3 else step
        fast.update(depth, accepted, when)
        _histogram_update(oracle, depth, accepted, when)
        assert fast.accepted == pytest.approx(oracle.accepted, rel=1e-12)
        assert fast.tried == pytest.approx(oracle.tried, rel=1e-12)
        assert fast.at == oracle.at


@pytest.mark.parametrize("bs, acceptance", [(64, _per_position(0.8)), (128, _bench_acceptance(1.5))])
def test_a_steady_round_skips_the_full_choice_not_a_depth(bs, acceptance):
    """A stationary acceptance (a round's depth winning clearly; bs 128 with a probe every 50 steps): the chooser
    that repeats a steady round for up to 4 or 8 steps chooses the same depths, probes included, as the one that
    makes the full choice every step, with under half the full choices."""
    runs = {}
    for steady in (1, 4, 8):
        c = DepthChooser(H100_8B, num_steps=3, steady_steps=steady)
        runs[steady] = (_served(c, bs, 200, acceptance), c.full_choices)
    assert runs[4][0] == runs[1][0] and runs[8][0] == runs[1][0]
    assert len(set(runs[1][0])) > 1  # (a probe above the choice is in the run)
    assert runs[4][1] < runs[1][1] / 2 and runs[8][1] < runs[4][1], (runs[8][1], runs[4][1], runs[1][1])


def test_a_steady_round_ends_where_the_acceptance_moves():
    """Steady at depth 3 (every draft accepted, bs 64), then every draft rejected: the first such verdicts, deferred
    in the run, carry its watch past the tolerance, the next step makes the full choice, and the depths come down on
    the same steps as the chooser's that makes it every step."""
    runs = {}
    for steady in (1, 8):
        c = DepthChooser(H100_8B, num_steps=3, steady_steps=steady)
        before = _served(c, 64, 40, lambda d, rng: d)
        assert before[-8:] == [3] * 8
        full = c.full_choices
        depths, pending = [], (3, [3] * 64)
        for i in range(12):
            depths.append(c.choose(64))
            if i == 2:  # (the full choice, the rejections taken in)
                assert c.full_choices > full
            c.observe(*pending)
            if i == 1:
                assert c._steady is None or c._drifted
            pending = (depths[-1], [0] * 64)
        runs[steady] = depths
    assert runs[8] == runs[1] and runs[1][-1] < 3, runs


def test_a_steady_round_takes_verdicts_of_holed_drafts_alone():
    """After a draft's pause every running request's draft has holes, and the engine sends a round's verdicts as []
    (``Engine._apply``): a steady run takes them as the every-step chooser does (the estimate skips them), not as a
    division by no requests in its watch on acceptance."""
    runs = {}
    for steady in (1, 16):
        c = DepthChooser(H100_8B, num_steps=3, steady_steps=steady)
        depths, pending = [], None
        for i in range(60):
            depths.append(c.choose(64))
            if pending is not None:
                c.observe(*pending)
            if steady > 1 and i == 30:
                assert c._steady is not None  # (the [] below falls in a run)
            pending = (depths[-1], [] if 30 <= i < 40 else [depths[-1]] * 64)
        runs[steady] = depths
    assert runs[16] == runs[1] and runs[1][-1] == 3, runs


@pytest.mark.parametrize("lag", [1, 5, 16])
def test_a_lag_told_during_a_steady_round_is_counted(lag):
    """Steady at depth 3 (bs 64, every draft accepted) with steps to go, then ``sync_lag``: the next step makes the
    full choice, and at every step the count of plain steps and what the step catches up are those of the chooser
    that makes the full choice every step (repeated, the steady round left the lag counted after its rounds, and
    the next full choice charged, and sampled as a catch-up, one that no round ran). The engine tells a lag at a
    batch's first decode step, none but 0 after rounds today: this holds the chooser to its ``sync_lag``."""
    runs = {}
    for steady in (1, 4):
        c = DepthChooser(H100_8B, num_steps=3, steady_steps=steady)
        twin = DepthChooser(H100_8B, num_steps=3)  # (steady_steps 4: finds a step where a steady round has 2 to go)
        for _ in range(60):
            d = c.choose(64)
            assert twin.choose(64) == d
            c.observe(d, [d] * 64)
            twin.observe(d, [d] * 64)
            if twin._steady is not None and twin._steady[1] > twin._step + 2 and not twin._drifted:
                break
        assert twin._steady is not None and not twin._drifted
        c.sync_lag(lag)
        rows = []
        for _ in range(6):
            d = c.choose(64)
            rows.append((d, c.lag, c._chosen))
            c.observe(d, [d] * 64)
        runs[steady] = rows
    assert runs[4] == runs[1], runs
    assert runs[1][0][2][2]  # (the first round catches the draft up)


def test_large_batch_does_not_pay_for_the_prior():
    """At bs 256 a round of 1 costs 1.5 plain steps (and 0.56 ms of catch-up after plain steps): at accept length
    1.5 (half the requests accept one draft) depth 0 is the best fixed depth on the H100, and the chooser, fresh
    or arriving from a smaller batch where depth 1 won, spends at most 2 of 34 steps above it."""
    fresh = _served(DepthChooser(H100_8B, num_steps=3), 256, 34, _bench_acceptance(1.5))
    assert sum(d > 0 for d in fresh) <= 2
    c = DepthChooser(H100_8B, num_steps=3)
    at_128 = _served(c, 128, 60, _bench_acceptance(1.5))
    assert at_128[-20:].count(1) >= 18  # (bs 128: depth 1 wins, as it measured there)
    after = _served(c, 256, 34, _bench_acceptance(1.5), seed=1)
    assert sum(d > 0 for d in after) <= 2


# what a step grows by per token of context where it reads the 8B's KV (128 KiB a token) at ~3.35 TB/s, every depth
KV_8B = {b: {d: 131072 / 3.35e9 for d in range(4)} for b in H100_8B}


def test_the_batch_context_moves_the_choice():
    """The start-up table times padding rows of one token; a loaded server's step also reads the batch's KV, which
    every depth pays alike, so a round's share of the step shrinks as the context grows. At bs 256 and accept length
    3 (two drafts always accepted) the table alone keeps depth 1; with 512 tokens a request the chooser runs depth 2,
    which is then 7% ahead. At accept length 1.5 plain steps win on the table; at 1024 tokens a request depth 1
    (1.5 tokens for 25.1 against 20.1 ms)."""
    def settled(chooser, length, context=0):  # (acceptance learnt at bs 16 first, as bench.adaptive does)
        _served(chooser, 16, 20, _bench_acceptance(length))
        depths = _served(chooser, 256, 60, _bench_acceptance(length), seed=1, context=context)
        return max(set(depths[-30:]), key=depths[-30:].count)

    long = 256 * 512
    assert settled(DepthChooser(H100_8B, 3), 3.0, context=long) == 1
    assert settled(DepthChooser(H100_8B, 3, context_costs=KV_8B), 3.0) == 1
    c = DepthChooser(H100_8B, 3, context_costs=KV_8B)
    assert settled(c, 3.0, context=long) == 2 and c.stats()["context_tokens"] == long
    assert settled(DepthChooser(H100_8B, 3, context_costs=KV_8B), 1.5) == 0
    assert settled(DepthChooser(H100_8B, 3, context_costs=KV_8B), 1.5, context=2 * long) == 1
    # a context level holds the leading four bits: a growing batch reuses its cached choices
    assert [context_level(n) for n in (0, 15, 17, 1000, 1023, 131072 + 5000)] == [0, 15, 16, 960, 960, 131072]


def test_a_pause_ends_where_the_context_makes_a_round_the_choice():
    """The draft's pause lasts while the step's choice is a plain step. At bs 256 and accept length 1.5 the chooser
    pauses at 128 tokens a request; as the batch's context grows to 1024 tokens a request depth 1 is the choice at
    the same bucket (a fresh chooser runs it), so the pause ends within a step and rounds run, not another 1024
    plain steps until ``pause_hold``."""
    c = DepthChooser(H100_8B, 3, context_costs=KV_8B)
    _served(c, 16, 20, _bench_acceptance(1.5))
    short = _served(c, 256, 80, _bench_acceptance(1.5), seed=1, context=256 * 128)
    assert c.paused and c.pauses == 1 and set(short[-10:]) == {0}
    long = _served(c, 256, 30, _bench_acceptance(1.5), seed=2, context=2 * 256 * 512)
    assert not c.paused and long[0] == 1 and long[-10:].count(1) >= 8, long


@pytest.mark.parametrize("bs", [1, 16])
@pytest.mark.parametrize("length, best", [(2.0, 1), (3.0, 2)])
def test_small_batch_reaches_the_best_depth_at_once(bs, length, best):
    """Where rounds cost little more than plain steps, the prior's first rounds measure acceptance and the chooser
    settles on the best depth (accept length 2: one draft always accepted, the second never) within a few steps."""
    depths = _served(DepthChooser(H100_8B, num_steps=3), bs, 40, _bench_acceptance(length))
    assert depths[4:].count(best) >= len(depths[4:]) - 1  # (but for a probe)


def test_probes_the_next_tier_within_its_budget():
    """Below the deepest tier one step in an interval runs one tier deeper: at bs 256 a round costs several plain
    steps, so probes are spaced to keep their extra time under 1 % of the steps'; a rise in acceptance (0.1 to 0.9
    per position) is still seen within one interval. (Without the draft's pause, which stops probes: below.)"""
    c = DepthChooser(H100_8B, num_steps=3, pause_after=0)
    every = [c.probe_every(256, 0, 1, lag) for lag in (1, 15, 16)]
    # (a full stash: the plain step would catch up too, so the probe's catch-up is no extra)
    assert every == [math.ceil((14.949 + 0.548 - 9.876) / 0.09876),
                     math.ceil((14.949 + 0.548 + (3.533 - 0.548) * 14 / 15 - 9.876) / 0.09876),
                     math.ceil((14.949 - 9.876) / 0.09876)]
    assert c.probe_every(64, 0, 1, 1) == 50  # (cheap probes: at least probe_interval apart)
    low = _served(c, 256, 300, _per_position(0.1))
    probes = [i for i, d in enumerate(low) if d > 0]
    assert set(low[i] for i in probes) == {1} and len(probes) <= 300 // every[0] + 1
    assert all(b - a >= every[2] for a, b in zip(probes, probes[1:]))
    high = _served(c, 256, every[2] + 16 + 3, _per_position(0.9), seed=2)  # (a full stash comes every 16 steps)
    first = next(i for i, d in enumerate(high) if d > 0)
    assert all(d >= 1 for d in high[first + 2:])  # seen, then kept
    # tiers without plain steps (depth_tiers [2, 3]) probe too
    two = DepthChooser({8: {2: 6.0, 3: 6.4}}, num_steps=3, probe_interval=5)
    assert 3 in _served(two, 8, 12, _bench_acceptance(2.0))


def test_prefix_cache_keeps_only_pages_whose_draft_kv_is_written(spec_models):
    """A request that ends in a run of plain steps leaves its draft's KV of those positions unwritten (only a
    later catch-up would write it): the cache must not hand those pages to the next turn of the chat. The next
    request's draft KV over its whole cached prefix equals one prefill's (fp32)."""
    prompt = mixed_prompts(4)[3]
    eng = engine(spec_models["target"], _spec(spec_models, "eagle3", catch_up_window=16), page_size=4,
                 max_prefill_tokens=64, disable_overlap_schedule=True)
    eng.depth_policy = DepthSchedule([1] + [0] * 11)
    first = eng.add_request(prompt, SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True))
    while eng.has_work():
        eng.step()
    history = first.all_ids
    nxt = eng.add_request(history + [7], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while eng.has_work():
        eng.step()
    cached = nxt.num_cached_tokens
    assert 0 < cached <= len(history) - 1 - 4  # the plain steps' last full page stayed out
    fresh = engine(spec_models["target"], _spec(spec_models, "eagle3"))
    ref = fresh.add_request(history + [7], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while fresh.has_work():
        fresh.step()
    assert ref.output_ids == nxt.output_ids
    for a, b in zip(_draft_kv(eng.executor.worker, 0, cached),  # (each request took slot 0 in turn)
                    _draft_kv(fresh.executor.worker, 0, cached)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_catch_up_warm_up_changes_nothing(spec_models, references):
    """The start-up warm-up of the catch-up's compiles (run on GPUs; called here directly): the catch-up at uniform
    and mixed lags up to the stash's size, on the padding slot only. Every request page's draft KV is unchanged
    and the tokens are no speculation's."""
    prompts, ref = references
    eng = engine(spec_models["target"], _spec(spec_models, "eagle3", adaptive=True, catch_up_window=8),
                 max_num_seqs=8)
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == ref[id(GREEDY)]
    worker = eng.executor.worker
    kv = worker.proposer.runner.kv_cache
    before = [t.clone() for t in kv.k + kv.v]
    calls = []
    catch_up = worker.proposer.catch_up
    worker.proposer.catch_up = lambda slots, pos, lags: (calls.append((slots.copy(), pos.copy(), lags.copy())),
                                                         catch_up(slots, pos, lags))
    shapes = worker.graphs.warm_catch_up()
    assert len(calls) == len(shapes) > 0
    assert all((s == 8).all() and (p == lag).all() for s, p, lag in calls)  # the padding slot, positions 0 .. lag-1
    uniform = {int(lag[0]) for _, _, lag in calls if len(set(lag.tolist())) == 1}
    # (the EAGLE-3 head's catch-up is KV-only but for each request's last position: a longer lag changes only the
    # KV pass's row count, whose compile variants stop at the small-M row buckets)
    assert 1 in uniform and uniform & set(range(2, 9))
    assert any(len(set(lag.tolist())) > 1 for _, _, lag in calls)  # mixed lags
    pad_page = worker.page_table.table[8].unique().tolist()
    assert pad_page == [0]
    for a, b in zip(before, kv.k + kv.v):  # (page 0 is the padding page)
        torch.testing.assert_close(a.view(-1, *a.shape[-2:])[worker.cfg.page_size:],
                                   b.view(-1, *b.shape[-2:])[worker.cfg.page_size:], rtol=0, atol=0)
    worker.proposer.catch_up = catch_up
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == ref[id(GREEDY)]


def test_catch_up_shapes_cover_the_triton_launches():
    """The warm-up's shapes with the Triton backend's compile key at the 8B shape on an H100 (132 SMs, GQA group 4,
    a stash of 16): every launch variant a catch-up over 1..256 requests can meet, found by running every shape, is
    among them: the query blocks of 16, 32 and 64 rows (lags 1-4, 5-8, 9-16), uniform and mixed lags, and each
    split count's power of two (the merge kernel's constexpr), with the fewest requests each."""
    from attention.base import AttentionLayerSpec
    from attention.triton_backend import TritonBackend
    from workers.graphs import catch_up_shapes
    from workers.messages import ForwardMode

    backend = TritonBackend()
    backend._num_sms = 132
    layer = AttentionLayerSpec(0, 32, 8, 128, 128 ** -0.5)

    def key(b, n, uniform):
        return backend.compile_key(ForwardMode.DRAFT_EXTEND, b, n, uniform, layer, 4112)

    shapes = catch_up_shapes(16, 256, key)
    every = {key(b, n, u) for u in (True, False) for n in range(1 if u else 2, 17) for b in range(1 if u else 2, 257)}
    assert {key(*s) for s in shapes} == every and len(shapes) == len(every)
    assert {k[1] for k in every} == {16, 32, 64} and {k[0] for k in every} == {True, False}
    assert {k[-1] for k in every} == {1, 2, 4, 64, 128}
    assert any(u and 5 <= n <= 8 for _, n, u in shapes) and any(not u and 5 <= n <= 8 for _, n, u in shapes)
    assert max(b for b, _, _ in shapes) <= 32  # (past 32 requests a catch-up runs one split, like 32)


def test_plain_steps_overlap_to_a_requests_last_token(spec_models):
    """A plain step appends one token, as without speculation: a request near its end is planned while its plain
    step is in flight (not held back as if a full round could end it), so depth 0 reads no step more on its own
    than no speculation does; a round of depth d holds back the requests that d + 1 tokens could end."""
    prompts, params = mixed_prompts(3), SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)

    def run(spec, depths=None):
        eng = engine(spec_models["target"], spec)
        if depths is not None:
            eng.depth_policy = DepthSchedule(depths)
        calls, step = [], eng.executor.step
        eng.executor.step = lambda s, keep: calls.append(s is None) or step(s, keep)
        tokens = [o.token_ids for o in eng.generate(prompts, params)]
        return tokens, sum(calls)  # (None: a call that only reads the step in flight)

    ref, idle = run(None)
    tokens, plain_idle = run(_spec(spec_models, "eagle3"), [0])
    assert tokens == ref and plain_idle == idle
    # full rounds: the requests wait for their last round's tokens before more steps are planned
    tokens, round_idle = run(_spec(spec_models, "eagle3"), [3])
    assert tokens == ref and round_idle > idle


@pytest.mark.parametrize("span, behind", [(None, False), (3, False), (None, True)])
def test_fixed_shape_catch_up_equals_the_catch_up(spec_models, span, behind):
    """``catch_up_fixed`` (the catch-up as a CUDA graph replays it: span - 1 KV rows per request, the span the
    window's or a shorter one's that covers the lags, a padding row and a row not behind on the padding slot) writes
    the draft KV and state that ``catch_up`` writes for the same requests and lags (mixed), and nothing else outside
    the padding page (fp32); without its whole-layer pass (a plain step's graph), the KV that ``catch_up_behind``
    writes, and no draft state."""
    import numpy as np

    eng = engine(spec_models["target"], _spec(spec_models, "eagle3", adaptive=True, catch_up_window=4),
                 max_num_seqs=4, page_size=4, disable_overlap_schedule=True)
    eng.depth_policy = DepthSchedule([0])
    reqs = [eng.add_request(p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
            for p in mixed_prompts(3)]
    for _ in range(8):  # plain steps (the stash of 4 fills and is caught up on, then fills again)
        eng.step()
    worker = eng.executor.worker
    p = worker.proposer
    assert p.fixed_shape_catch_up and all(worker.plain_run[r.req_slot] >= 3 for r in reqs)
    slots = np.array([r.req_slot for r in reqs], dtype=np.int64)
    root = np.array([len(r.all_ids) - 1 for r in reqs], dtype=np.int64)
    lags = np.array([3, 0, 2], dtype=np.int64)
    kv = p.runner.kv_cache
    state = [p.state_ids, p.state_logp, p.state_feat]
    saved = [t.clone() for t in kv.k + kv.v + state]

    def snapshot():
        out = [t.clone() for t in kv.k + kv.v + state]
        for t, s in zip(kv.k + kv.v + state, saved):
            t.copy_(s)
        return out

    with torch.inference_mode():
        pad = worker.cfg.max_num_seqs  # rows: the three requests (the second not behind: lag 0 there), padding
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        p.catch_up_fixed(t([slots[0], slots[1], slots[2], pad]), t([root[0], root[1], root[2], 0]),
                         t([3, 0, 2, 0]), pad, span, whole_last=not behind)
        fixed = snapshot()
        (p.catch_up_behind if behind else p.catch_up)(slots[[0, 2]], root[[0, 2]], lags[[0, 2]])
        eager = snapshot()
    page = worker.cfg.page_size
    n = len(kv.k + kv.v)
    changed = 0
    for a, b, s in zip(eager[:n], fixed[:n], saved[:n]):  # (page 0 is the padding page)
        a, b, s = (x.view(-1, *x.shape[-2:])[page:] for x in (a, b, s))
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        changed += int((a != s).any())
    assert changed == n  # (the catch-up wrote KV in every layer)
    for a, b, s in zip(eager[n:], fixed[n:], saved[n:]):  # the draft state of every slot but the padding one
        torch.testing.assert_close(a[:pad], b[:pad], atol=1e-5, rtol=1e-5)
        assert (b[slots[1]] == s[slots[1]]).all()  # (not behind: untouched)
    feat = fixed[-1]  # (a chain's state is its draft ids and output feature)
    assert all((feat[i] != saved[-1][i]).any() != behind for i in slots[[0, 2]])


@pytest.mark.parametrize("method", ["eagle3", "draft"])
def test_a_full_stash_keeps_its_newest_position(spec_models, method):
    """Eagerly, a plain step on a full stash (3) catches the draft up on all but the newest position, so the
    request is 2 behind after it (the scheduler's count the worker's), and the draft's KV of every position consumed
    is what one prefill of the same tokens writes (fp32)."""
    prompt = mixed_prompts(4)[2]
    eng = engine(spec_models["target"], _spec(spec_models, method, catch_up_window=3), page_size=4,
                 disable_overlap_schedule=True)
    eng.depth_policy = DepthSchedule([0])
    req = eng.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    worker, runs, slot, lags = eng.executor.worker, [], None, []
    while eng.has_work():
        eng.step()
        if req.output_ids:
            slot = req.req_slot if slot is None else slot
            runs.append(int(worker.plain_run[slot]))
            lags.append(req.draft_lag)
    assert runs[:7] == [0, 1, 2, 3, 2, 3, 2], runs  # (the prefill's step leaves none behind)
    assert lags[:-1] == runs[:-1], lags  # (the scheduler's count, until the request ends and frees its slot)
    assert worker.catch_ups[1] == worker.catch_ups[0] * 2  # each over the 2 positions before the newest
    n = len(req.all_ids) - 1 - runs[-1]  # the positions consumed
    fresh = engine(spec_models["target"], _spec(spec_models, method))
    fresh.generate([req.all_ids[:n]], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    for a, b in zip(_draft_kv(worker, slot, n), _draft_kv(fresh.executor.worker, 0, n)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_lag_after_plain_step():
    from speculative.adaptive import lag_after_plain_step

    assert [lag_after_plain_step(lag, 4) for lag in range(5)] == [1, 2, 3, 4, 2]
    assert lag_after_plain_step(1, 1) == 1 and lag_after_plain_step(7, 0) == 8  # (one column: all consumed)
    assert [lag_after_plain_step(lag, 2) for lag in range(3)] == [1, 2, 1]  # (two columns: all consumed too)
    # a step that caught up because another row's stash was full: every row behind keeps its newest position
    assert [lag_after_plain_step(lag, 4, caught_up=True) for lag in range(5)] == [1, 2, 2, 2, 2]
    assert [lag_after_plain_step(lag, 1, caught_up=True) for lag in range(2)] == [1, 1]


@pytest.mark.parametrize("overlap", [False, True])
def test_the_scheduler_counts_each_rows_lag_as_the_worker(spec_models, overlap):
    """Requests joining a run of plain steps at different times (rows of mixed lags in one batch; a plain step that
    finds any row's stash full catches every row behind up) and, with the overlap schedule, requests preempted while
    a step of theirs is in flight: after every decode step each running request's ``draft_lag`` (what the prefix
    cache reads as the draft KV not written yet) is the worker's count of its row, never below it."""
    import numpy as np

    eng = engine(spec_models["target"], _spec(spec_models, "eagle3", catch_up_window=4), page_size=4,
                 kv_cache_tokens=160, max_prefill_tokens=32, disable_overlap_schedule=not overlap)
    eng.depth_policy = DepthSchedule([0] * 11 + [1])
    worker, sched = eng.executor.worker, eng.scheduler
    counted, updated = {}, {}
    lazy, update = worker._lazy_catch_up, sched.update

    def lazy_recorded(step, **kw):
        out = lazy(step, **kw)
        counted[step.step_id] = {int(s): int(worker.plain_run[s]) for s in step.req_slots}
        return out

    def update_recorded(plan, result):
        out = update(plan, result)
        if plan.mode == ForwardMode.DECODE:
            updated[result.step_id] = {r.req_slot: r.draft_lag for r in plan.requests if r.req_slot is not None
                                       and r.status == RequestStatus.RUNNING}
        return out

    worker._lazy_catch_up, sched.update = lazy_recorded, update_recorded
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts, added, n = mixed_prompts(6), 0, 0
    while added < len(prompts) or eng.has_work():
        if added < len(prompts) and n % 3 == 0:  # (one request joins every third step)
            eng.add_request(prompts[added], params)
            added += 1
        eng.step()
        n += 1
    assert len(updated) > 30 and set(updated) <= set(counted)
    drift = [(i, slot, lag, counted[i][slot]) for i, rows in updated.items() for slot, lag in rows.items()
             if lag != counted[i][slot]]
    assert not drift, drift  # (step, slot, the scheduler's lag, the worker's)
    assert max(max(rows.values(), default=0) for rows in counted.values()) == 4
    assert len({lag for rows in updated.values() if len(set(rows.values())) > 1 for lag in rows.values()}) > 1
    if overlap:
        assert sched.num_preemptions > 0


def test_plain_steps_replay_the_catch_up(spec_models, references):
    """On the graph path a plain step on a full stash replays its bucket's catch-up graph (requests joining apart:
    mixed lags, some not behind), and a round after fewer plain steps the graph of the shortest span that covers
    its lags, never the eager catch-up: the tokens are no speculation's, and one request's draft KV is what one
    prefill of its tokens writes (fp32)."""
    prompts, ref = references
    # (tiers 0 and 3: a shorter start-up cost model; depths 1 and 2 are captured at their first use)
    eng = engine(spec_models["target"], _spec(spec_models, "eagle3", adaptive=True, catch_up_window=3,
                                              depth_tiers=[0, 3]),
                 cuda_graph_max_bs=8, max_num_seqs=8, page_size=4, max_prefill_tokens=24)
    worker = eng.executor.worker
    worker.capture_graphs()
    assert worker.graphs.catch_up_graphs and worker.graphs.catch_up_spans() == [1, 2, 3]
    keys, replay = [], worker.graphs.replay
    worker.graphs.replay = lambda key: keys.append(key) or replay(key)
    eager, catch_up = [], worker.proposer.catch_up
    worker.proposer.catch_up = lambda *a: eager.append(a) or catch_up(*a)
    # full stashes in plain steps and before a round (3 plain steps, then a round), rounds short of one
    eng.depth_policy = DepthSchedule([0, 0, 0, 2, 0, 0, 0, 0, 1, 0, 3])
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == ref[id(GREEDY)]
    worker.proposer.catch_up = catch_up
    assert set(eng.steps_by_depth) == {0, 1, 2, 3}
    after = [(k[0], k[2], keys[i + 1][0]) for i, k in enumerate(keys[:-1]) if k[0].startswith("catch_up")]
    names = {name for _, _, name in after}
    assert "decode" in names and ({"round", "draft"} & names)  # before a plain step, and before a round
    # a plain step (a full stash) consumes all but each request's newest position, a round every position
    assert all((kind == "catch_up_behind") == (name == "decode") for kind, _, name in after), after
    assert {span for _, span, name in after if name != "decode"} & {1, 2}, after  # a round short of a full stash
    assert not eager and worker.catch_ups[0] == len(after)
    eng.depth_policy = DepthSchedule([0])  # one request, runs of plain steps only
    req = eng.add_request(prompts[3], SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True))
    while not req.output_ids:
        eng.step()
    slot = req.req_slot
    while eng.has_work():
        eng.step()
    n = len(req.all_ids) - 1 - int(worker.plain_run[slot])  # the positions caught up on
    assert n > len(prompts[3]) + 6
    fresh = engine(spec_models["target"], _spec(spec_models, "eagle3"))
    fresh.generate([req.all_ids[:n]], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    for a, b in zip(_draft_kv(worker, slot, n), _draft_kv(fresh.executor.worker, 0, n)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_a_plain_step_in_flight_near_the_context_end_stays_within_the_page_table():
    """A request two tokens short of max_model_len whose step in flight is plain (it appends one token) takes one
    more step; the pages it is given then still fit the worker's page table (max_model_len + lookahead tokens): the
    step in flight counts as the one token it appends, not as a full round."""
    from deployments.engine.pages import PageAllocator
    from deployments.engine.request import Request, RequestStatus
    from deployments.engine.scheduler import Scheduler

    page, length, lookahead = 4, 64, 4
    sched = Scheduler(PageAllocator(64, page), max_num_seqs=2, max_prefill_tokens=64, max_model_len=length,
                      eos_token_ids=(2,), vocab_size=128, decode_lookahead=lookahead, decode_max_advance=lookahead)
    req = Request("r", [5] * (length - 4), SamplingParams(max_tokens=1000, ignore_eos=True))
    req.output_ids = [7, 7]  # (its length: max_model_len - 2)
    req.req_slot, req.status = 0, RequestStatus.RUNNING
    sched.allocator.grow(req.pages, req.num_tokens - 1 + lookahead)
    sched.running = [req]
    sched._decode_plan([req]).max_advance = 1  # (the engine chose depth 0 for the step in flight)
    assert sched._decode_rows() == [req]  # (it may still end in the next step: it is not held back)
    assert len(req.pages) <= -(-(length + lookahead) // page)


def test_engine_feeds_the_host_clock(spec_models):
    """With the host clock on (where decode steps replay graphs; forced here on the CPU) the engine tells the chooser
    each decode launch: after a few steps at one bucket and depth the chooser holds that depth's host time (the
    interval between launches less the waits for the device: on the CPU each eager step's whole time, longer than
    the table's), and its step costs are max(table, host)."""
    spec = SpeculativeConfig(method="eagle3", model=str(spec_models["eagle3"]), num_steps=3,
                             simulated_accept_length=1.0)
    eng = engine(spec_models["target"], spec)
    eng.host_clock = True
    # a table far below any CPU step's time (a microsecond), so that each measured host time is above it
    table = {d: c / 1e4 for d, c in COSTS[64].items()}
    eng.depth_policy = chooser = DepthChooser({8: table}, num_steps=3, probe_interval=1000)
    for p in mixed_prompts(4):
        eng.add_request(p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    while eng.has_work():
        eng.step()
    host = chooser.stats()["host_ms"]["8"]
    assert host, chooser.stats()
    for depth, ms in host.items():
        assert table[int(depth)] < ms < 10_000
        assert chooser.cost_at(8)[int(depth)] == pytest.approx(ms, rel=0.03)


def test_a_host_cost_measured_in_a_slow_spell_expires():
    """A plain step's host time measured high (a slow spell of the machine) prices depth 0 out, and a depth the
    chooser no longer picks gets no samples to correct it: after ``host_ttl`` steps without one, a median above the
    table is dropped, depth 0 is chosen again and measured anew, and stays chosen where it is now cheaper."""
    table = {256: {0: 2.3, 1: 3.7, 2: 5.3, 3: 6.7}}
    c = DepthChooser(table, num_steps=3, host_unit=1.0, probe_interval=10**6, host_ttl=64)
    now = 0.0

    def step(host: dict) -> int:
        nonlocal now
        d = c.choose(256)
        c.launched(now, 0.2, True)
        now += host[d] + 0.2
        return d

    c.estimate.accepted = [0.0, 0.0, 0.0]  # (plain steps first: acceptance nil)
    for _ in range(5):
        step({0: 4.7})
    assert c.host[256] == {0: 4.7}
    c.estimate.accepted = [0.5, 0.5, 0.5]  # a round now beats a plain step priced at 4.7 ms
    slow = {0: 4.7, 1: 3.5, 2: 4.0, 3: 4.5}
    depths = [step(slow) for _ in range(40)]
    assert 0 not in depths and len(set(depths)) == 1, depths
    fast = {0: 2.5, 1: 3.5, 2: 4.0, 3: 4.5}  # the spell is over: a plain step costs the host 2.5 ms
    depths = [step(fast) for _ in range(80)]
    first = depths.index(0)  # (40 + first steps since depth 0's last sample: past the ttl, at a multiple of 16)
    assert 40 + first <= 64 + 16 + 1 and set(depths[first:]) == {0}, depths
    assert c.host[256][0] == pytest.approx(2.5) and c.cost_at(256)[0] == pytest.approx(2.5)


def test_a_moving_host_median_refreshes_the_chosen_bucket_alone():
    """A host median that moves may move every bucket's costs (those not measured borrow the nearest measured one's),
    so they are brought up to date when the bucket is next chosen for, not all at every move: on a noisy host-bound
    engine (the shipped tiny family on an H100, 23 buckets) refreshing them all cost the host more per step than the
    chooser's own work. The costs read are the same either way."""
    import random

    buckets = [1, 2, 4, 8] + list(range(16, 257, 16))
    table = {b: {0: 1.0 + b / 100, 1: 1.4 + b / 90, 2: 1.8 + b / 80, 3: 2.2 + b / 70} for b in buckets}
    c = DepthChooser(table, num_steps=3, host_unit=1.0, probe_interval=10**6, pause_after=0)
    refreshed, real = [], c._refresh
    c._refresh = lambda b: refreshed.append(b) or real(b)
    rng, now = random.Random(0), 0.0
    for _ in range(300):  # (host time well above the table's, moving by ±30 %: its median moves often)
        d = c.choose(64)
        c.launched(now, 0.0, True)
        now += 3.0 * (0.7 + 0.6 * rng.random())
        c.observe(d, [min(d, 1)] * 64)
    assert c._host_gen > 10 and len(refreshed) <= c._host_gen + 1 and set(refreshed) == {64}
    own, other = dict(c.cost_at(64)), dict(c.cost_at(128))  # (128 never measured: 64's, scaled)
    assert refreshed[-1] == 128 and any(own[d] > table[64][d] for d in c.host[64])
    for b in buckets:  # (every bucket refreshed at once, as at every move before)
        real(b)
    assert c.cost_at(64) == own and c.cost_at(128) == other


def _host_cost_per_depth(c: DepthChooser, bucket: int, depth: int) -> float:
    """``host_cost`` as it was computed depth by depth (before ``_host_row``): the oracle of the test below."""
    host, at = c.host[bucket], bucket
    if not host:
        measured = [b for b in c.buckets if c.host[b]]
        if not measured:
            return 0.0
        at = min(measured, key=lambda b: (abs(math.log(b / bucket)), -b))
        host = c.host[at]
    scale = bucket / at
    if depth in host:
        return host[depth] * scale
    below = [d for d in host if d < depth]
    if below:
        d = max(below)
        return (host[d] + c.host_per_depth * at * (depth - d)) * scale
    d = min(d for d in host if d > depth)
    table = c.costs[at]
    less = max(0.0, host[d] - c.host_per_depth * at * (d - depth))
    return min(host[d] * table[depth] / table[d], less) * scale


def test_host_costs_of_a_bucket_in_one_pass_equal_them_depth_by_depth():
    """Random tables (tiers with and without 0, gaps between them), host medians at random tiers of random buckets
    (none at some, none at all now and then) and increments per request and depth (0, small, large enough to clamp
    at 0): every bucket's row and each ``host_cost`` equal, to the bit, what the depth-by-depth computation gave."""
    import random

    rng = random.Random(3)
    for trial in range(300):
        tiers = rng.choice([[0, 1, 2, 3], [0, 1, 2, 4, 8], [1, 2, 3], [0, 3], [0, 1, 2, 3, 4, 5]])
        buckets = sorted(rng.sample([1, 2, 4, 8, 16, 32, 64, 128, 256], rng.randint(1, 6)))
        table = {}
        for b in buckets:
            cost, row = rng.uniform(0.5, 10.0), {}
            for d in tiers:
                cost += rng.uniform(0.01, 3.0)  # (rising with the depth, as the start-up table does)
                row[d] = cost
            table[b] = row
        c = DepthChooser(table, num_steps=max(tiers) or 1)
        none = rng.random() < 0.1
        for b in buckets:
            if none or rng.random() < 0.35:
                continue
            c.host[b] = {d: rng.uniform(0.1, 20.0) for d in rng.sample(tiers, rng.randint(1, len(tiers)))}
        c.host_per_depth = rng.choice([0.0, rng.uniform(0.0, 0.01), rng.uniform(0.0, 1.0)])
        for b in buckets:
            want = [_host_cost_per_depth(c, b, d) for d in tiers]
            assert c._host_row(b) == want, (trial, b, c.host, c.host_per_depth)
            assert [c.host_cost(b, d) for d in tiers] == want


def test_a_bucket_whose_costs_move_drops_its_own_cached_choices_alone():
    """The choices cached per bucket, lag and context level: a bucket whose step costs move drops its own, and the
    other buckets keep theirs (a long run passes many context levels: scanned whole at each move, the caches cost
    more the longer the server ran)."""
    c = DepthChooser(H100_8B, num_steps=3, pause_after=0)
    for bs in (64, 256):
        for ctx in range(1000, 60000, 3000):  # (many context levels at each bucket)
            c.choose(bs, ctx * bs // 64)
            c.observe(1, [1] * bs)
    assert len(c._totals[64]) > 5 and 256 in c._totals and 256 in c._best
    kept = {k: dict(v) for k, v in c._totals.items() if k != 256}
    c.host[256] = {d: 10 * cost for d, cost in H100_8B[256].items()}  # (its host far above the table: costs move)
    c._host_gen += 1
    c._fresh(256)
    assert 256 not in c._totals and 256 not in c._best and 256 not in c._probe_every
    assert {k: v for k, v in c._totals.items() if k != 256} == kept


def test_host_samples():
    """The chooser's host costs from launch times (ms here): consecutive steps at one depth and bucket sample it
    (the interval less the wait for the device), an interval across a non-contiguous launch does not, a probe
    between two base steps samples its depth (its two intervals less the base's cost), and a bucket never measured
    borrows the nearest one's, scaled by the batch."""
    table = {240: {0: 2.3, 1: 3.6, 2: 5.2, 3: 6.6}, 256: {0: 2.3, 1: 3.7, 2: 5.3, 3: 6.7}}
    c = DepthChooser(table, num_steps=3, host_unit=1.0, probe_interval=10**6)
    c.estimate.accepted = [0.0, 0.0, 0.0]  # (acceptance nil: plain steps unless forced)
    now = 0.0

    def step(depth=None, host=4.0, wait=0.5, contiguous=True):
        nonlocal now
        d = c.choose(256)
        if depth is not None:  # (a forced depth: as a probe would be)
            c._chosen = (256, depth, False, 0)
        c.launched(now, wait if contiguous else 0.0, contiguous)
        now += host + wait
        return d

    for _ in range(5):  # (the first launch starts the run; samples from the third on; a median from 3 samples)
        step()
    assert c.host[256] == {0: 4.0} and c.cost_at(256)[0] == 4.0 and c.cost_at(256)[3] == 6.7
    for _ in range(3):  # a pause before each of three launches that follow no decode step (a prefill): no sample
        step(host=40.0)
        step(contiguous=False)
    assert list(c._host_runs[256, 0]).count(4.0) == 4 and 40.0 not in c._host_runs[256, 0]
    # probes at depth 1, each between plain steps: (I_p + I_next) - host(0), the probe's interval holding its
    # launch and the plain step's apply (4.0 + 4.4) / 2, the next one the other way round
    for _ in range(3):
        step(depth=1, host=4.2)
        step(host=4.2)
        step()
    assert c.host[256][1] == pytest.approx(4.4)
    assert c.cost_at(240)[0] == pytest.approx(4.0 * 240 / 256) and c.cost_at(240)[3] == 6.6
    # a round that catches the draft up short of a full stash (after 5 plain steps): its interval holds the
    # catch-up's launches, its sample is that interval less its depth's host cost; the choice then charges it
    assert not c.catch_up_host and c.catch_up_charge(256, 5) == c.catch_up_cost(256, 5)
    for _ in range(5):
        step()
    d = c.choose(256)
    assert d == 0 and c._chosen == (256, 0, False, 0)  # (nil acceptance: a plain step; forced to a round below)
    c._chosen = (256, 1, True, 5)
    c.launched(now, 0.5, True)
    now += 4.4 + 8.0 + 0.5
    step()
    assert c.catch_up_host == {256: pytest.approx(8.0)} and c.catch_up_charge(256, 5) == pytest.approx(8.0)
    assert c.stats()["catch_up_host_ms"] == {"256": pytest.approx(8.0)}


def _record_counts(eng, chooser) -> tuple[list[int], list[int]]:
    """At every decode step, the chooser's count of plain steps as it chooses, and the worker's (the batch's most
    behind) as it launches."""
    import numpy as np

    worker = eng.executor.worker
    counted, behind = [], []
    choose, lazy = chooser.choose, worker._lazy_catch_up
    chooser.choose = lambda bs, context=0: counted.append(chooser.lag) or choose(bs, context)
    worker._lazy_catch_up = lambda step, **kw: behind.append(int(np.max(worker.plain_run[step.req_slots]))) or lazy(
        step, **kw)
    return counted, behind


@pytest.mark.parametrize("overlap", [True, False])
def test_chooser_counts_the_batchs_own_plain_steps(spec_models, overlap):
    """The chooser's count of plain steps is the worker's (the most behind of the batch's requests) at every decode
    step, over batches back to back: the engine sets it at a batch's first decode step, where none is in flight.
    (Counted on from the last batch, its full stashes, where a catch-up is due whatever the choice and most
    probes fall, were not the worker's.)"""
    eng = engine(spec_models["target"], _spec(spec_models, "eagle3", adaptive=True, catch_up_window=4),
                 disable_overlap_schedule=not overlap)
    # plain steps best, a probe one tier up every 5 steps: rounds after plain steps, plain steps on full stashes
    eng.depth_policy = chooser = DepthChooser({8: {0: 1.0, 1: 1.5, 2: 2.0, 3: 2.5, -1: 0.01, -4: 0.02}},
                                              num_steps=3, probe_interval=5, probe_budget=1.0)
    counted, behind = _record_counts(eng, chooser)
    for n in (9, 7, 12):  # (batches of other lengths: the count a batch leaves is not the next one's)
        eng.generate(mixed_prompts(3), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    assert counted == behind and max(behind) == 4 and len(behind) > 20
    assert {0, 1} <= set(eng.steps_by_depth)


def test_chooser_counts_a_structured_round_as_a_round(spec_models):
    """A batch with a structured-output request runs full rounds whatever the chooser picked (the worker catches
    the draft up and counts no plain step): the chooser's count of plain steps restarts there too, so that at
    every decode step it is the worker's."""
    import json

    from deployments.engine.grammar import GuidedSpec
    from tests.engine.test_structured import SCHEMAS

    eng = engine(spec_models["target"], _spec(spec_models, "eagle3", adaptive=True, catch_up_window=4))
    # plain steps best at once (acceptance nil), no probes
    eng.depth_policy = chooser = DepthChooser({8: {0: 1.0, 1: 1.5, 2: 2.0, 3: 2.5, -1: 0.01, -4: 0.02}},
                                              num_steps=3, probe_interval=10**6)
    chooser.estimate.accepted = [0.0, 0.0, 0.0]
    counted, behind = _record_counts(eng, chooser)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    reqs = [eng.add_request(p, params) for p in mixed_prompts(2)]
    for _ in range(6):  # plain steps
        eng.step()
    guided = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                            guided=GuidedSpec("json_schema", json.dumps(SCHEMAS[0])))
    reqs.append(eng.add_request(mixed_prompts(3)[2], guided))
    while eng.has_work():
        eng.step()
    assert counted == behind and 0 in eng.steps_by_depth and max(behind) >= 2, (counted, behind)
    assert all(r.output_ids for r in reqs)


def test_plain_steps_move_their_lengths_on_a_copy(spec_models):
    """Before a step, each request behind (its last steps plain) has its in-flight token added to its length and
    sampling counter on the host and no longer counts as pending; the others keep theirs. The moves go to a copy:
    the caller's step (the engine's message, read-only where it was unpickled) stays as it was, and every other
    field of the copy is the caller's."""
    import numpy as np

    eng = engine(spec_models["target"], _spec(spec_models, "eagle3", adaptive=True, catch_up_window=3),
                 cuda_graph_max_bs=8)
    eng.executor.worker.capture_graphs()
    eng.depth_policy = DepthSchedule([0, 0, 0, 0, 1, 0, 0])
    worker = eng.executor.worker
    seen, lazy = [], worker._lazy_catch_up

    def recorded(step, **kw):
        ints, run = step.ints.copy(), worker.plain_run[step.req_slots].copy()
        step.ints.flags.writeable = False  # (as an unpickled message's)
        moved, lags = lazy(step, **kw)
        seen.append((step, ints, run, moved))
        return moved, lags

    worker._lazy_catch_up = recorded
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    prompts = mixed_prompts(5)
    reqs = [eng.add_request(p, params) for p in prompts[:3]]
    while len(seen) < 3:  # (the later requests join a batch whose rows are behind: mixed rows)
        eng.step()
    reqs += [eng.add_request(p, params) for p in prompts[3:]]
    while eng.has_work():
        eng.step()
    assert all(len(r.output_ids) == 14 for r in reqs)
    behind_pending = mixed = 0
    for step, ints, run, moved in seen:
        assert np.array_equal(step.ints, ints)  # the caller's step unchanged
        shift = np.where(run > 0, ints[5], 0)  # (row 5: pending)
        expected = ints.copy()
        expected[1] += shift  # seq_lens
        expected[4] += shift  # counters
        expected[5] -= shift
        assert np.array_equal(moved.ints, expected)
        assert all(getattr(moved, k) is getattr(step, k) for k in vars(step) if k != "ints")
        behind_pending += int(shift.sum())
        mixed += bool(run.any() and ((run == 0) & (ints[5] > 0)).any())  # rows behind, and pending rows not
    assert behind_pending > 10 and mixed and {0, 1} <= set(eng.steps_by_depth)


def test_each_decode_step_is_chosen_for_its_batch_context(spec_models):
    """The engine tells the policy each decode step's context, the sum of its requests' lengths (prompt and the
    tokens known so far), which grows as the requests decode: the cost model charges a step for it."""
    eng = engine(spec_models["target"], SpeculativeConfig(method="draft", model=str(spec_models["draft"]),
                                                          num_steps=3))
    seen = []

    class Recorded(DepthSchedule):
        def choose(self, batch_size, context_tokens=0):
            seen.append((batch_size, context_tokens))
            return super().choose(batch_size, context_tokens)

    eng.depth_policy = Recorded([0, 2, 0, 1])
    prompts = mixed_prompts(3)
    eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    full = [c for b, c in seen if b == 3]
    prompt_tokens = sum(len(p) for p in prompts)
    assert len(full) > 4 and prompt_tokens <= full[0] < full[-1] <= prompt_tokens + 3 * 12
    assert all(b >= a for a, b in zip(full, full[1:]))


def test_a_failed_decode_step_is_reported_lost(spec_models):
    """The depth policy pairs the n-th verdicts with the n-th step it chose: a decode step that fails (injected in
    the worker, with the step before it in flight) is reported to it as ``lost``, so every step chosen is answered
    once, in order, and the engine serves on."""
    eng = engine(spec_models["target"], SpeculativeConfig(method="draft", model=str(spec_models["draft"]),
                                                          num_steps=3))
    events = []

    class Recorded(DepthSchedule):
        def choose(self, batch_size, context_tokens=0):
            events.append("chosen")
            return super().choose(batch_size, context_tokens)

        def observe(self, depth, accepted):
            events.append("observed")

        def lost(self):
            events.append("lost")

    eng.depth_policy = Recorded([0, 2, 0, 1])
    worker = eng.executor.worker
    real_launch, launches = worker._launch, [0]

    def flaky(step):
        launches[0] += 1
        if launches[0] == 5:  # (a decode step after the prefill)
            raise RuntimeError("injected worker failure")
        return real_launch(step)

    worker._launch = flaky
    out = eng.generate(mixed_prompts(2), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert all(o.finish_reason == "error" for o in out)
    assert events.count("lost") == 1 and events.count("chosen") == events.count("observed") + 1, events
    again = eng.generate(mixed_prompts(2), GREEDY)
    assert all(o.finish_reason == "length" for o in again)
    assert events.count("chosen") == events.count("observed") + events.count("lost"), events


def test_a_steady_round_ends_where_the_batch_has_run_plain_steps():
    """A new batch whose requests ran plain steps (the engine's ``sync_lag``) needs its draft caught up first: the
    steady round is not repeated then, and the full choice charges the catch-up (``_chosen`` says so)."""
    c = DepthChooser(H100_8B, num_steps=3)
    _served(c, 64, 40, lambda d, rng: d)
    for _ in range(8):  # (to a full choice that begins a steady run)
        d = c.choose(64)
        c.observe(d, [d] * 64)
        if c._steady is not None and c._steady[1] - c._step >= 3:
            break
    assert c._steady is not None and c._steady[1] - c._step >= 3
    c.sync_lag(3)
    d = c.choose(64)
    assert d > 0 and c._chosen[2] and c._chosen[3] == 3 and c.lag == 0


def test_a_steady_round_ends_where_the_context_jumps_within_its_bucket():
    """Steady at bs 128 with 200k tokens of context (the 8B's KV read per step: deeper rounds win), then the batch's
    requests turn over and hold 1k: the bucket stays, the context level does not, and the next step makes the full
    choice, as the chooser that makes it every step does."""
    import random

    def served(c, steps, context, rng, stop=None):
        depths = []
        for _ in range(steps):
            depths.append(c.choose(128, context))
            c.observe(depths[-1], [_per_position(0.7)(depths[-1], rng) for _ in range(128)])
            if stop is not None and stop(c):
                break
        return depths

    steady = DepthChooser(H100_8B, num_steps=3, context_costs=KV_8B)
    before = served(steady, 200, 200_000, random.Random(0),
                    stop=lambda c: c._steady is not None and c._steady[1] > c._step + 1 and not c._drifted)
    assert steady._steady is not None and len(before) < 200  # (steps to go at the jump)
    every = DepthChooser(H100_8B, num_steps=3, context_costs=KV_8B, steady_steps=1)
    assert served(every, len(before), 200_000, random.Random(0)) == before
    after = [served(c, 4, 1_000, random.Random(1)) for c in (steady, every)]
    assert after[0] == after[1], after
    assert after[1][0] != before[-1]  # (the jump moves the choice)


def _full_choices(c: DepthChooser, bs: int, context: int) -> tuple[int, bool]:
    """``c.choose``, and whether it made the full choice (not a steady run's step, carried on or not)."""
    before = c.full_choices
    d = c.choose(bs, context)
    return d, c.full_choices != before


def test_a_steady_run_holds_over_context_levels_where_its_round_still_wins():
    """bs 64, 8B table with the KV's cost, a context that grows by a whole round a request each step (from 128
    tokens a request): the run holds across the context levels where its round still wins clearly, so the
    chooser makes the full choice about once in its run length, not at every level (about every 4 steps here), and
    chooses the depths of the chooser that makes it every step."""
    import random

    rows = {}
    for steady in (1, 8):
        c = DepthChooser(H100_8B, num_steps=3, context_costs=KV_8B, steady_steps=steady)
        rng, context, pending, depths, full = random.Random(3), 64 * 128, None, [], 0
        for _ in range(160):
            d, f = _full_choices(c, 64, context)
            depths.append(d)
            full += f
            if pending is not None:
                c.observe(*pending)
            pending = (d, [_per_position(0.8)(d, rng) for _ in range(64)])
            context += 64 * (d + 1)
        rows[steady] = depths, full
    assert rows[8][0] == rows[1][0]
    assert rows[1][1] == 160 and rows[8][1] <= 160 // 8 + 160 // 16 + 4, rows[8][1]  # (runs end at 16-step marks too)


def test_a_steady_runs_deferred_verdicts_and_launches_are_taken_in_as_they_came():
    """The verdicts, launches (the host clock: noisy but stationary host times) and a lost step that a steady run
    defers are taken in, in order, at the next full choice: the depths are the every-step chooser's, and once both
    have taken everything in, their host samples, sample steps and counts of verdicts are equal, their host medians
    to within ``host_change`` (a run's samples are taken in together: the median is read once, not after each) and
    their estimates to within 0.02."""
    import random

    twins = [DepthChooser(H100_8B, num_steps=3, host_unit=1.0, steady_steps=s) for s in (1, 8)]
    rng = random.Random(5)
    host = {0: 6.0, 1: 6.8, 2: 7.5, 3: 8.2}
    now, pending, full = 0.0, None, 0
    for i in range(300):
        d, f = _full_choices(twins[1], 64, 0)
        assert twins[0].choose(64) == d, i
        full += f
        waited = rng.random() * 0.1
        for c in twins:
            c.launched(now, waited, True)
            if i == 150:
                c.lost()
            elif pending is not None:
                c.observe(*pending)
        now += host[d] * (1 + 0.05 * rng.random()) + waited
        pending = (d, [_per_position(0.75)(d, rng) for _ in range(64)])
    every, steady = twins
    steady._flush()  # (as the next full choice would)
    shown = [{k: v for k, v in c.stats().items() if k not in ("host_ms", "step_cost_ms", "acceptance")}
             for c in twins]
    assert shown[0] == shown[1]
    assert every._host_runs == steady._host_runs and every.host.keys() == steady.host.keys()
    for b, row in every.host.items():
        assert row.keys() == steady.host[b].keys()
        for d, ms in row.items():
            assert steady.host[b][d] == pytest.approx(ms, rel=every.host_change)
    # (a stretch of a run's rounds enters the estimate as one update, weighted as rounds alike would be)
    assert steady.estimate.p == pytest.approx(every.estimate.p, abs=0.02) and every.estimate.at == steady.estimate.at
    assert every._sampled_at == steady._sampled_at and every._observed == steady._observed
    assert every.host[64] and not steady._deferred and full < 300 / 3, full


def test_stretches_are_the_runs_of_rounds_alike():
    """A run's deferred verdicts are taken in by stretch (``stretches``, found in C): on random event lists (depths,
    batch sizes, lost steps, gaps between steps) the stretches are those a plain loop finds: one depth and batch
    size, or lost steps, each one step after the one before."""
    import random

    from speculative.adaptive import stretches

    rng = random.Random(2)
    for _ in range(300):
        events, step = [], 0
        for _ in range(rng.randint(0, 40)):
            step += 1 if rng.random() < 0.9 else rng.randint(2, 4)
            if rng.random() < 0.1:
                events.append((None, None, step))
            else:
                d = rng.choice([1, 3]) if rng.random() < 0.3 else 3
                events.append((d, [d] * rng.choice([16, 16, 16, 5]), step))
        want, i = [], 0
        while i < len(events):
            j = i + 1
            while (j < len(events) and events[j][0] == events[i][0] and events[j][2] == events[j - 1][2] + 1
                   and (events[j][1] is None) == (events[i][1] is None)
                   and (events[i][1] is None or len(events[j][1]) == len(events[i][1]))):
                j += 1
            want.append((i, j - i))
            i = j
        assert stretches(events) == want, events


def test_a_runs_launches_taken_in_as_a_block_sample_as_one_by_one():
    """A run's launches of one choice, each contiguous with the one before, are taken in as a block that works out
    only the intervals that can stay in the host window (the newest ``host_samples`` above 0): the window, the
    sample steps, the last launches kept and the medians are those of taking each launch in on its own."""
    import random

    rng = random.Random(4)
    for case in range(200):
        samples = rng.choice([3, 5, 15])
        twins = [DepthChooser(H100_8B, num_steps=3, host_unit=1.0, host_samples=samples) for _ in range(2)]
        chosen, now, step = (64, 3, False, 0), 0.0, 0
        launches = []
        for i in range(rng.randint(3, 60)):
            # (zero-length intervals now and then: a wait as long as the interval samples nothing)
            gap = 0.0 if rng.random() < 0.1 else rng.uniform(1.0, 3.0)
            waited = gap if gap == 0.0 or rng.random() < 0.1 else rng.uniform(0.0, 0.5)
            now, step = now + gap + (waited if gap else 0.0), step + 1
            launches.append((now, waited, True, chosen, step))
        for c in twins:
            for e in launches[:2]:  # (the block follows two launches of its choice)
                c._launched(*e)
        twins[0]._take_launches(launches[2:])
        for e in launches[2:]:
            twins[1]._launched(*e)
        for c in twins:
            c._settle()
        block, one = twins
        assert block._host_runs == one._host_runs, case
        assert block._sampled_at == one._sampled_at and block.host == one.host, case
        assert list(block._launches)[-2:] == list(one._launches)[-2:] and block._launch_at == one._launch_at, case


def _run_begun(c: DepthChooser, bs: int, accepted, steps_left: int = 6) -> None:
    """Steps at ``bs`` until a full choice begins a steady run with ``steps_left`` steps or more to go."""
    import random

    rng = random.Random(0)
    for _ in range(60):
        d = c.choose(bs)
        c.observe(d, [accepted(d, rng) for _ in range(bs)])
        if c._steady is not None and c._steady[1] - c._step >= steps_left:
            return
    raise AssertionError("no steady run began")


@pytest.mark.parametrize("bs, p, rise", [(16, 0.6, True), (64, 0.5, True), (16, 0.6, False)])
def test_drifting_acceptance_ends_a_run_both_ways_at_every_tier(bs, p, rise):
    """A run's watch ends it where its rounds' acceptance drifts past its bound, both ways, at the deepest tier too
    (a rising mean can hide a falling position: the test below). 8B table: depth 3 at bs 16, 2 at bs 64,
    acceptance then every draft (rise) or none (fall)."""
    c = DepthChooser(H100_8B, num_steps=3)
    _served(c, bs, 40, _per_position(p))
    _run_begun(c, bs, _per_position(p))
    depth, full = c._steady[3], c.full_choices
    assert depth == (3 if bs == 16 else 2)
    for _ in range(5):
        d = c.choose(bs)
        c.observe(d, [d if rise else 0] * bs)
    assert c.full_choices > full, (depth, rise)


def test_a_rising_mean_that_hides_a_falling_position_ends_a_run_at_the_deepest_tier():
    """More acceptance at every position only widens the deepest round's lead, but a rising mean need not be that:
    here the first two positions rise to ~0.98 while the third falls from 0.8 to 0.45 (mean accepted 1.95 -> 2.4),
    and depth 3's lead over depth 2 (E(3) / E(2): 1.21 -> 1.15 against a cost ratio of 1.17) turns into a loss.
    The every-step chooser moves to depth 2 a few steps after the shift; the run must end as soon, not hold depth
    3 to its 16th step."""
    table = {64: {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.404}}
    before = [0] * 13 + [1] * 10 + [2] * 8 + [3] * 33
    after = [0] + [1] + [2] * 34 + [3] * 28

    def drive(steady: int, shift: int) -> list[int]:
        c = DepthChooser(table, num_steps=3, steady_steps=steady, host_samples=0)
        for _ in range(30):  # (a settled estimate of about 0.8 at every position: depth 3 clearly the best)
            c.observe(3, before)
        depths, pending = [], None
        for i in range(shift + 24):
            d = c.choose(64)
            depths.append(d)
            if pending is not None:
                c.observe(*pending)
            pending = (d, [min(d, a) for a in (before if i < shift else after)])
        return depths

    for shift in range(17, 34):  # (the shift at every step of a run)
        steady, every = drive(16, shift), drive(1, shift)
        assert steady[:shift] == every[:shift] == [3] * shift
        assert sum(a != b for a, b in zip(steady, every)) <= 2, (shift, steady[shift:], every[shift:])


def test_a_steady_runs_contexts_are_those_where_its_round_stays_the_best():
    """Random cost tables (a host base over some tiers, a slope per token of context per tier) and acceptances: where
    a full choice begins a steady run, the round it repeats is what the full choice would choose at every context
    level the run holds over (``_steady_reach``), and the run holds past its own level where the costs allow."""
    import random

    from speculative.adaptive import context_level

    rng, runs, beyond = random.Random(11), 0, 0
    for _ in range(300):
        table = {b: {d: rng.uniform(0.2, 2.0) * (1 + 0.3 * d) for d in range(4)} for b in (16, 64)}
        slopes = {b: {d: rng.choice([0.0, 1e-6, 1e-5, 1e-4]) * rng.uniform(0.5, 1.5) for d in range(4)}
                  for b in table}
        c = DepthChooser(table, num_steps=3, context_costs=slopes, probe_interval=10**6, pause_after=0)
        c.estimate.accepted = [rng.uniform(0.05, 0.95) for _ in range(3)]
        for b in table:  # (host medians above some tiers' table costs: the flat part of a cost)
            c.host[b] = {d: table[b][d] * rng.uniform(0.5, 2.0) for d in range(4) if rng.random() < 0.5}
        c._host_gen += 1
        bs, context = rng.choice([16, 64]), rng.randint(100, 50_000)
        c.choose(bs, context)  # (a run begins where the bucket was chosen for at the step before too)
        depth = c.choose(bs, context)
        if c._steady is None:
            continue
        runs += 1
        lo, hi = c._steady[4], c._extend_run()
        beyond += hi > context_level(context) * 2
        level = c._context
        for x in sorted(rng.uniform(lo, min(hi, 64 * lo)) for _ in range(20)):
            c._context = context_level(int(x))
            assert c.best(bs, lag=0) == depth, (x, lo, hi)
        c._context = level
    assert runs > 50 and beyond > 10, (runs, beyond)


def test_stats_reads_only():
    """/v1/stats calls ``stats`` from another thread than the engine's: it changes nothing the choice reads (a
    refresh there dropped the caches under the engine thread, as a run's ``_extend_run`` reads its totals), and shows
    each bucket's step costs as its next choice reads them."""
    import copy

    c = DepthChooser(H100_8B, num_steps=3, host_unit=1.0, context_costs=KV_8B)
    now = 0.0
    for _ in range(40):
        d = c.choose(64, 64 * 500)
        c.launched(now, 0.0, True)
        now += 12.0 + d  # (host-bound: the host medians move the step costs)
        c.observe(d, [d] * 64)
    assert c.host[64] and c._fresh_at.get(64) == c._host_gen
    c.host[64] = {d: ms * 1.5 for d, ms in c.host[64].items()}  # (a median moved: the bucket's costs are stale)
    c._host_gen += 1
    state = ("_fresh_at", "step_cost", "_totals", "_best", "_rests", "_probe_every", "_steady")
    before = {k: copy.deepcopy(getattr(c, k)) for k in state}
    shown = c.stats()["step_cost_ms"]["64"]
    assert {k: getattr(c, k) for k in state} == before
    c._fresh(64)
    assert shown == {str(d): round(c.step_cost[64][d], 4) for d in c.tiers} and c.step_cost != before["step_cost"]


def test_rounds_alike_update_the_estimate_as_one_as_they_do_one_by_one():
    """``update(..., rounds=k)`` with the verdicts of k rounds alike, one step apart, leaves every position's sums and
    step where k updates one by one do (full batches and a batch under ``full_round``); rounds that differ land near."""
    import random

    rng = random.Random(3)
    for size in (64, 2):
        one = [min(3, int(rng.expovariate(0.8))) for _ in range(size)]
        for k in (2, 5, 16):
            by_one, as_one = AcceptanceEstimate(3), AcceptanceEstimate(3)
            by_one.update(3, one, 10)
            as_one.update(3, one, 10)
            for j in range(k):
                by_one.update(3, one, 11 + j)
            as_one.update(3, one * k, 10 + k, rounds=k)
            assert as_one.accepted == pytest.approx(by_one.accepted, rel=1e-12)
            assert as_one.tried == pytest.approx(by_one.tried, rel=1e-12) and as_one.at == by_one.at
            # (the first of the rounds at the step of the update before, as where two verdicts came at one step)
            by_one.update(3, one, 10 + k)
            for j in range(k):
                by_one.update(3, one, 10 + k + j)
            as_one.update(3, one, 10 + k)
            as_one.update(3, one * k, 10 + 2 * k - 1, rounds=k)
            assert as_one.accepted == pytest.approx(by_one.accepted, rel=1e-12)
            assert as_one.tried == pytest.approx(by_one.tried, rel=1e-12) and as_one.at == by_one.at
    rounds = [[min(3, int(rng.expovariate(0.8))) for _ in range(64)] for _ in range(8)]
    by_one, as_one = AcceptanceEstimate(3), AcceptanceEstimate(3)
    for j, r in enumerate(rounds):
        by_one.update(3, r, 1 + j)
    as_one.update(3, [a for r in rounds for a in r], 8, rounds=8)
    assert as_one.p == pytest.approx(by_one.p, abs=0.03)


def test_a_run_carried_over_a_draining_batch_chooses_as_the_full_choice_does():
    """8B table with the KV's cost, a batch of 256 whose requests then end over 15 steps down to one (each round's
    verdicts alike at a batch size, so the estimates settle): the steady chooser carries its runs over the buckets
    the batch drains through and makes under a third of the full choices there, and chooses every step's depth as
    the chooser that makes the full choice every step, the choice moving from 1 to 3 on the way."""
    import random

    rng = random.Random(3)
    pattern = [next((i for i in range(3) if rng.random() >= 0.7), 3) for _ in range(256)]
    sizes = [256] * 20 + [240, 200, 160, 128, 100, 64, 48, 32, 20, 16, 10, 6, 4, 2, 1]
    runs = {}
    for steady in (16, 1):
        c = DepthChooser(H100_8B, 3, context_costs=KV_8B, steady_steps=steady)
        depths, full, pending = [], 0, None
        for batch in range(5):
            for i, n in enumerate(sizes):
                before = c.full_choices
                d = c.choose(n, n * 600 + i * n)
                c.launched(0.01 * (batch * 40 + i), 0.0, i > 0)
                if pending is not None:
                    c.observe(*pending)
                pending = (d, [min(d, a) for a in pattern[:n]])
                depths.append(d)
                full += i >= 20 and batch > 0 and c.full_choices != before
        runs[steady] = depths, full
    assert runs[16][0] == runs[1][0]
    assert runs[16][1] < 60 / 3 and runs[1][1] == 60, (runs[16][1], runs[1][1])
    assert runs[1][0][-15:][0] == 1 and runs[1][0][-1] == 3


def test_a_steady_run_halves_the_choosers_own_work_where_the_batch_stays():
    """``bench.adaptive_calls``'s count: a batch that stays at its bucket costs the chooser (its defaults) under
    half the bytecodes a step of the one that makes the full choice every step, and a batch whose last requests
    drain a bucket a step under 80% of it (its run carried on over the buckets; the deterministic measure of its host
    work: #41's host-bound steps)."""
    from bench.adaptive_calls import bytecodes

    flat = [sum(bytecodes(s, 64, "flat", 8, 2).values()) for s in (None, 1)]
    tail = [sum(bytecodes(s, 64, "tail", 8, 2).values()) for s in (None, 1)]
    assert flat[0] < flat[1] / 2, flat
    assert tail[0] < 0.8 * tail[1], tail


def test_steady_and_every_step_choosers_fuzzed_alike():
    """``tests/speculative/fuzz_steady.py`` on a few seeds (batches that stay, drain and grow, context jumps, lost
    steps, structured rounds, non-contiguous launches, lags told, verdicts of holed drafts, host clock on): no
    exception, nothing deferred after a full choice, and the two choosers' depths apart on few steps."""
    import argparse

    from tests.speculative.fuzz_steady import run_seed

    opts = argparse.Namespace(steps=600, host=True, context=True, holes=True, alike=True, p_change=0.004,
                              p_jump=0.003, p_lost=0.003, p_guided=0.003, p_holes=0.01, p_gap=0.01, host_noise=0.1)
    apart = 0
    for seed in range(6):
        r = run_seed(seed, opts)
        assert r["error"] is None, r["error"]
        apart += sum(n for _, n, _ in r["stretches"])
    assert apart < 6 * 600 // 20, apart
