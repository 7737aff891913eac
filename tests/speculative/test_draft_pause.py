"""The draft's pause (adaptive speculation, #41): where plain steps are firmly the choice, steps run exactly what no
speculation runs and the draft's pending inputs are dropped, so the draft KV of the requests that live through a
pause has holes. Outputs stay no speculation's (verification decides every token), a paused step launches what a
step without speculation launches, holey requests' verdicts stay out of the chooser's estimates, and the chooser
enters and leaves the pause as designed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from deployments.engine.request import SamplingParams
from speculative.adaptive import PAUSED, DepthChooser, DepthSchedule
from tests.helpers import mixed_prompts
from tests.speculative.test_adaptive import (H100_8B, SEEDED, _bench_acceptance, _per_position,  # noqa: F401
                                             _served, _spec, references)
from tests.speculative.test_speculative import GREEDY, engine, spec_models  # noqa: F401  (fixture)
from workers.config import SpeculativeConfig
from workers.graphs import PAUSED_DEPTH

# a pause after plain steps (their stash dropped) and right after a round (whose advance the first paused step
# reads); rounds right after a pause (a draft with holes, nothing to catch up) and after plain steps that follow one
# (the catch-up of the positions since); with a stash of 2, plain steps that catch up between
PAUSE_SCHEDULE = [0, 0, PAUSED, PAUSED, PAUSED, 1, 0, PAUSED, 2, 0, 0, 3, PAUSED, 0, 1, PAUSED, PAUSED, 0, 0, 0, 2]


@pytest.mark.parametrize("method,params", [("eagle3", GREEDY), ("eagle3", SEEDED), ("eagle", GREEDY),
                                           ("draft", GREEDY), ("draft", SEEDED)],
                         ids=["eagle3-greedy", "eagle3-seeded", "eagle-greedy", "draft-greedy", "draft-seeded"])
def test_paused_steps_equal_no_speculation(spec_models, references, method, params):
    """The pause forced on and off between rounds of every depth (preemption, the prefix cache and the overlap
    schedule on): the tokens are no speculation's, the rounds on drafts with holes included."""
    prompts, ref = references
    eng = engine(spec_models["target"], _spec(spec_models, method, catch_up_window=2), kv_cache_tokens=160,
                 max_prefill_tokens=32)
    eng.depth_policy = DepthSchedule(PAUSE_SCHEDULE)
    out = eng.generate(prompts, params)
    assert [o.token_ids for o in out] == ref[id(params)]
    assert eng.paused_steps > 0 and set(eng.steps_by_depth) == {0, 1, 2, 3}
    assert eng.scheduler.num_preemptions > 0
    assert eng.step_stats()["adaptive"]["paused_steps"] == eng.paused_steps


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_target_as_draft_through_pauses(spec_models, references, graphs):
    """The target as its own draft accepts every draft where its KV is whole, so rounds append up to 4 tokens: a
    pause right after such a round (its first step reads that round's advance; every later one appends one) and
    rounds on the draft with holes after it keep no speculation's tokens; the holes cost acceptance only."""
    prompts, ref = references
    spec = SpeculativeConfig(method="draft", model=str(spec_models["target"]), num_steps=3, catch_up_window=4,
                             adaptive=True if graphs else None)
    kw = {"cuda_graph_max_bs": 8} if graphs else {}
    whole = engine(spec_models["target"], spec, **kw)
    whole.depth_policy = DepthSchedule([3, 0, 3])
    eng = engine(spec_models["target"], spec, **kw)
    if graphs:
        eng.executor.worker.capture_graphs()
    eng.depth_policy = DepthSchedule([3, 0, PAUSED, PAUSED, 0, 3, PAUSED, 3, 0, 0, 3, 3, PAUSED, PAUSED, 3])
    out = eng.generate(prompts, GREEDY)
    assert [o.token_ids for o in out] == ref[id(GREEDY)]
    rate = lambda outs: sum(o.spec["num_accepted_tokens"] for o in outs) / sum(  # noqa: E731
        o.spec["num_draft_tokens"] for o in outs)
    assert eng.paused_steps > 0 and rate(whole.generate(prompts, GREEDY)) > rate(out) > 0.2


def test_paused_steps_on_the_graph_path(spec_models, references):
    """On the graph path (run eagerly on the CPU) a paused step replays the bucket's graph of the step without
    speculation, captured at start-up; the tokens are no speculation's."""
    prompts, ref = references
    eng = engine(spec_models["target"], _spec(spec_models, "eagle3", adaptive=True, catch_up_window=2),
                 cuda_graph_max_bs=8)
    worker = eng.executor.worker
    worker.capture_graphs()
    replays, replay = [], worker.graphs.replay

    def counted(key):
        replays.append(key)
        return replay(key)

    worker.graphs.replay = counted
    eng.depth_policy = DepthSchedule(PAUSE_SCHEDULE)
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == ref[id(GREEDY)]
    paused = [k for k in replays if k[-1] == PAUSED_DEPTH]
    assert len(paused) == eng.paused_steps > 0 and {k[0] for k in paused} == {"decode"}
    assert worker.catch_ups[0] > 0


def test_holey_pages_cached_for_the_next_turn(spec_models):
    """A request that lived through a pause leaves pages whose draft KV has holes; the prefix cache indexes them
    (the target's KV is whole; the draft's holes cost acceptance only), and the next turn of the chat, starting
    from them, still decodes no speculation's tokens."""
    prompt = mixed_prompts(4)[3]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    turns = {}
    for name, spec in (("none", None), ("paused", _spec(spec_models, "eagle3", catch_up_window=4))):
        eng = engine(spec_models["target"], spec, page_size=4, max_prefill_tokens=64)
        if spec is not None:
            eng.depth_policy = DepthSchedule([1, 0, 0] + [PAUSED] * 12 + [1])
        (first,) = eng.generate([prompt], params)
        (second,) = eng.generate([prompt + first.token_ids + [5, 6, 7]], params)
        turns[name] = (first.token_ids, second.token_ids)
        if spec is not None:
            assert eng.paused_steps > 0 and second.num_cached_tokens >= len(prompt) + 16
    assert turns["paused"] == turns["none"]


def test_holey_requests_verdicts_stay_out_of_the_estimates(spec_models):
    """Rounds after a pause: the verdicts the policy observes are those of the requests whose draft has no holes
    (admitted after the pause), none of those that ran paused steps."""
    seen = []

    class Recorded(DepthSchedule):
        def observe(self, depth, accepted):
            if depth:
                seen.append(len(accepted))

    eng = engine(spec_models["target"], _spec(spec_models, "eagle3"), max_num_seqs=3)
    eng.depth_policy = Recorded([1, 0, PAUSED, PAUSED, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    clean, apply = [], eng._apply

    def counted(plan, result):  # (the requests of each round, before its verdicts are observed)
        if result.counts is not None and result.num_drafts:
            clean.append(sum(not r.draft_holes for r in plan.requests))
        return apply(plan, result)

    eng._apply = counted
    prompts = mixed_prompts(8, seed=5)
    params = [SamplingParams(max_tokens=8 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(8)]
    for p, sp in zip(prompts, params):
        eng.add_request(p, sp)
    holey = set()
    while eng.has_work():
        eng.step()
        holey |= {r.rid for r in eng.scheduler.running if r.draft_holes}
    assert seen == clean
    assert len(holey) >= 3 and any(n == 0 for n in clean) and any(n > 0 for n in clean), (clean, holey)


def test_the_pause_enters_where_plain_steps_are_firm_and_leaves_where_rounds_win():
    """The chooser pauses after ``pause_after`` plain choices in a row once acceptance is measured (never on the
    prior alone), runs no probe while paused (its steps are no chosen steps: no step count, lag or host sample),
    stays paused at buckets whose choice is a plain step, and resumes at one whose choice is a round."""
    blind = DepthChooser(H100_8B, num_steps=3, probe_interval=10**6, probe_budget=10.0)
    _served(blind, 256, 100, _bench_acceptance(1.5))
    assert not blind.paused  # (the prior's plain steps: no probe has measured anything to pause on)
    c = DepthChooser(H100_8B, num_steps=3)
    assert c.pause_after == 2 * c.window == 32
    depths = _served(c, 256, 400, _bench_acceptance(1.5))
    probe = next(i for i, d in enumerate(depths) if d > 0)
    assert c.paused and c.pauses == 1 and depths[probe + 1:].count(0) == len(depths) - probe - 1
    stats = c.stats()
    assert stats["draft_paused"] and stats["pauses"] == 1
    step, lag = c._step, c.lag
    assert _served(c, 200, 50, _bench_acceptance(1.5)) == [0] * 50  # (the same bucket)
    assert c.paused and c._step == step and lag == 0
    # bs 128: a round of 1 wins at accept length 1.5; the pause ends
    assert c.choose(128) > 0 and not c.paused and not c.stats()["draft_paused"]
    again = _served(c, 256, 120, _bench_acceptance(1.5))
    assert c.paused and c.pauses == 2 and again.count(0) >= 100
    off = DepthChooser(H100_8B, num_steps=3, pause_after=0)
    _served(off, 256, 400, _bench_acceptance(1.5))
    assert not off.paused and off.pauses == 0


def test_a_pause_ends_after_its_hold_so_a_rise_in_acceptance_is_seen():
    """At one bucket a pause lasts ``pause_hold`` steps: then the draft is kept in step again, the probe comes
    after its spacing (for requests admitted since: the running ones' drafts have holes), and a rise in acceptance
    takes the chooser to rounds; without it the chooser pauses again, once a probe's verdicts are in."""
    c = DepthChooser(H100_8B, num_steps=3, pause_hold=200)
    _served(c, 256, 150, _per_position(0.1))
    assert c.paused and c.pauses == 1
    high = _served(c, 256, 400, _per_position(0.9), seed=2)
    assert c.pauses == 1 and sum(d > 0 for d in high[-100:]) >= 95, high
    low = DepthChooser(H100_8B, num_steps=3, pause_hold=200)
    depths = _served(low, 256, 800, _per_position(0.1))
    assert low.pauses >= 3 and depths.count(0) >= 780  # (the probes after each hold, and nothing else)
    held = DepthChooser(H100_8B, num_steps=3)  # (the default hold: 1024 steps)
    _served(held, 256, 150, _per_position(0.1))
    assert held.paused and _served(held, 256, 400, _per_position(0.9)) == [0] * 400


def test_structured_output_steps_run_rounds_through_a_pause(tiny_models):
    """A step with grammar requests runs a full round whatever is chosen (its masks follow its drafts), so it is no
    paused step; the plain batches between run paused. The tokens are those without the pause (overlap off)."""
    from tests.engine.test_structured_overlap import drive, make, params

    models = {"target": tiny_models["llama"], "draft": tiny_models["llama"]}
    # (the requests without a grammar outlive the others: batches of them alone then run paused)
    ps = [p if p.guided is not None else replace(p, max_tokens=96) for p in params()]
    ref, _ = drive(make(models, "draft", overlap=False, graphs=False), ps)
    eng = make(models, "draft", overlap=True, graphs=False)
    eng.depth_policy = DepthSchedule([PAUSED])
    reqs, counts = drive(eng, ps)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in ref]
    assert eng.paused_steps > 0 and counts["mask_follows"] >= 10, (eng.paused_steps, counts)


def test_a_structured_output_step_does_not_begin_a_pause(tiny_models):
    """A structured-output step runs a full round whatever is chosen, so the chooser must not begin a pause on it:
    the pause would count a step the engine then runs (and observes) as a chosen round, and every later verdict
    would pair with the step after its own (the n-th ``observe`` is the n-th chosen step's: the rate check's
    records). Steps chosen and verdicts observed stay equal, and a pause begins only on a step that runs paused."""
    from tests.engine.test_structured_overlap import drive, make, params

    models = {"target": tiny_models["llama"], "draft": tiny_models["llama"]}
    ps = [p if p.guided is not None else replace(p, max_tokens=96) for p in params()]
    eng = make(models, "draft", overlap=True, graphs=False)
    # (rounds cost many plain steps at every batch: plain steps are the choice, and the guided rounds' verdicts
    # measure acceptance, so the streak of plain choices reaches pause_after while guided steps still run)
    costs = {8: {0: 1.0, 1: 5.0, 2: 10.0, 3: 15.0, -1: 0.1, -2: 0.2}}
    chooser = eng.depth_policy = DepthChooser(costs, num_steps=3, pause_after=2)
    begun, pause = [], eng._pause_draft

    def counted(paused):  # (the pauses the engine's steps ran)
        begun.append(paused)
        pause(paused)

    eng._pause_draft = counted
    drive(eng, ps)
    assert eng.paused_steps > 0 and chooser.pauses >= 1
    assert chooser._observed == chooser._step, (chooser._observed, chooser._step)
    assert chooser.pauses == begun.count(True), (chooser.pauses, begun)


def test_paused_steps_are_counted_in_the_steps_metric(spec_models):
    """``spec_decode_num_steps{depth}`` counts every decode step of a speculative engine: the paused ones under
    depth "paused" (plain steps the chooser did not choose), so the metric's steps are the engine's."""
    from deployments.engine.metrics import EngineMetrics

    eng = engine(spec_models["target"], _spec(spec_models, "eagle3", catch_up_window=2))
    eng.depth_policy = DepthSchedule(PAUSE_SCHEDULE)
    eng.metrics = EngineMetrics("pause-test")
    depths = []
    record = eng.metrics.record_step
    eng.metrics.record_step = lambda stats: (depths.append(stats.get("spec_depth")), record(stats))
    eng.generate(mixed_prompts(4), GREEDY)
    assert depths.count("paused") == eng.paused_steps > 0
    assert {d: depths.count(d) for d in set(depths) - {None, "paused"}} == eng.steps_by_depth
