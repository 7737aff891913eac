"""Structured output under the overlap schedule: a step with grammar requests is launched up to its logits (a round:
its drafts, then the verify forward) while the host reads the step before it and computes the masks, which follow in
a mask message; the step then stays in flight like any other. Tokens equal with overlap on and off, eagerly and
through the graph path's ``+mask`` variant (static mask buffer; callables run as they are on a CPU), with and without
speculation; requests without a grammar in the same batches get the tokens they get alone."""

from __future__ import annotations

import json

import pytest

from deployments.engine.engine import Engine
from deployments.engine.grammar import GuidedSpec
from deployments.engine.request import SamplingParams
from deployments.make_heads import make_head
from tests.engine.test_structured import SCHEMAS, check_valid
from workers.config import EngineConfig, SpeculativeConfig
from workers.graphs import MASK_VARIANT


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory):
    target = tiny_models["llama"]
    return {"target": target, "draft": target,
            "eagle3": make_head("eagle3", target, tmp_path_factory.mktemp("so") / "eagle3", seed=2, draft_vocab=200)}


SPECS = {"none": None, "draft": ("draft", 3, 1, None), "eagle3-tree": ("eagle3", 2, 3, 5)}
PROMPTS = [[1 + 7 * i % 400, 2 + i, 3, 9 + i] for i in range(6)]
ARRIVALS = {0: [0, 1, 2, 3], 3: [4, 5]}  # two join while the first four decode (their prefill beside guided steps)


def params(guided: bool = True) -> list[SamplingParams]:
    """Requests 2 and 5 without a grammar; greedy and seeded sampling."""
    out = []
    for i in range(6):
        g = GuidedSpec("json_schema", json.dumps(SCHEMAS[i])) if guided and i % 3 != 2 else None
        out.append(SamplingParams(max_tokens=48 if g else 24, temperature=0.0 if i % 2 else 0.9, seed=i, guided=g,
                                  ignore_eos=g is None))
    return out


def make(models, name: str, overlap: bool, graphs: bool) -> Engine:
    s = SPECS[name]
    spec = None if s is None else SpeculativeConfig(method=s[0], model=str(models[s[0]]), num_steps=s[1], topk=s[2],
                                                    num_draft_tokens=s[3])
    eng = Engine(EngineConfig(model=str(models["target"]), device="cpu", max_model_len=256, max_num_seqs=8,
                              page_size=4, max_prefill_tokens=24, cuda_graph_max_bs=8, speculative_config=spec,
                              disable_overlap_schedule=not overlap))
    if graphs:
        eng.executor.worker.capture_graphs()
    return eng


def drive(eng: Engine, ps: list[SamplingParams]) -> tuple[list, dict]:
    """Run the arrivals to completion; returns the requests and, per kind of worker call, how many there were (mask
    messages after which the step stayed in flight: ``kept``)."""
    worker, real = eng.executor.worker, eng.executor.step
    counts = {"mask_follows": 0, "mask_messages": 0, "kept": 0}

    def counting(step, keep):
        results = real(step, keep)
        if step is not None:
            counts["mask_follows"] += step.mask_follows
            counts["mask_messages"] += bool(step.mask_for)
            counts["kept"] += bool(step.mask_for) and bool(worker._launched)
        return results

    eng.executor.step = counting
    reqs: list = [None] * len(PROMPTS)
    call = 0
    while call <= max(ARRIVALS) or eng.has_work():
        for i in ARRIVALS.get(call, []):
            reqs[i] = eng.add_request(PROMPTS[i], ps[i])
        eng.step()
        call += 1
    assert eng.allocator.num_free == eng.allocator.capacity_pages
    assert all(r.finished and r.num_inflight == 0 for r in reqs) and not worker._launched
    return reqs, counts


@pytest.mark.parametrize("name", list(SPECS))
def test_guided_tokens_equal_with_overlap_on_and_off_and_through_graphs(models, name):
    ps = params()
    ref, off = drive(make(models, name, overlap=False, graphs=False), ps)
    assert off["kept"] == 0  # nothing stays in flight without overlap
    guided = [i for i, p in enumerate(ps) if p.guided is not None]
    check_valid([ref[i] for i in guided], [SCHEMAS[i] for i in guided])
    alone, _ = drive(make(models, name, overlap=True, graphs=False), params(guided=False))
    for graphs in (False, True):
        eng = make(models, name, overlap=True, graphs=graphs)
        reqs, counts = drive(eng, ps)
        assert [r.output_ids for r in reqs] == [r.output_ids for r in ref], graphs
        # the guided steps overlapped: launched to their logits, masks after, then left in flight
        assert counts["mask_follows"] >= 10 and counts["kept"] >= 10, counts
        assert eng.step_time["grammar_s"] > 0
        if graphs:  # the +mask variant ran from its static mask buffer
            g = eng.executor.worker.graphs
            assert any(kind.endswith(MASK_VARIANT) for _, kind, _ in g.phases) and g.mask_buffer is not None
            assert g.num_replays >= 10
        # requests without a grammar, in batches with grammar requests, get what they get alone
        for i, p in enumerate(ps):
            if p.guided is None:
                assert reqs[i].output_ids == alone[i].output_ids, i


@pytest.mark.parametrize("name", ["none", "draft"])
def test_mask_variant_captured_for_every_bucket_at_its_first_use(models, name):
    """The guided batch shrinks through the buckets as its requests end: every bucket's +mask graphs are captured
    at the first guided step, none later in the middle of the decode (each a stall of the whole batch)."""
    eng = make(models, name, overlap=True, graphs=True)
    g = eng.executor.worker.graphs
    capture, at = g._capture, []

    def recorded(bucket, kind, top, depth=None):
        at.append((g.num_replays, bucket, kind))
        return capture(bucket, kind, top, depth)

    g._capture = recorded
    reqs, _ = drive(eng, params())
    masked = [(n, b) for n, b, kind in at if kind.endswith(MASK_VARIANT)]
    assert sorted(b for _, b in masked) == sorted(g.buckets), at
    assert len({n for n, _ in masked}) == 1, at  # all in one go, before any of them replayed
    assert len({len(r.output_ids) for r in reqs}) > 2  # (the batch did shrink through sizes)


def test_mask_message_to_a_failed_step_is_dropped(models):
    """A step that failed before its masks came is answered by its error; its mask message adds nothing."""
    import numpy as np

    from workers.messages import WorkerStep

    eng = make(models, "none", overlap=True, graphs=False)
    worker = eng.executor.worker
    assert worker.step(WorkerStep.mask_message(7, np.full((1, 1, 16), -1, np.int32)), 0) == []


@pytest.mark.parametrize("name", ["none", "draft"])
def test_guided_graph_launches_never_wait_for_the_device(models, name):
    """The +mask variant's two parts (to the logits; after the masks) queue device work without a host read of a
    device value (the sync lint of tests/workers/test_launch_syncs.py)."""
    from tests.workers.test_launch_syncs import SyncLint

    eng = make(models, name, overlap=True, graphs=True)
    worker, lint = eng.executor.worker, SyncLint()
    launch, finish = worker._launch_masked, worker._finish_masked
    calls = {"launch": 0, "finish": 0}

    def linted_launch(step, *a):
        calls["launch"] += 1
        with lint:
            return launch(step, *a)

    def linted_finish(mask):
        calls["finish"] += 1
        with lint:
            return finish(mask)

    worker._launch_masked, worker._finish_masked = linted_launch, linted_finish
    drive(eng, params())
    assert calls["launch"] >= 10 and calls["finish"] >= 10, calls
    assert lint.found == [], lint.found
