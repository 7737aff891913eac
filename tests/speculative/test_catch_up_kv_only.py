"""The KV-only catch-up of one-layer EAGLE heads (``EagleProposer.kv_only_catch_up``): after plain steps the draft
writes its KV alone at every stashed position but each request's last, and runs its whole layer only there. It
must leave the draft's KV and state that the full catch-up (the layer over every stashed position) leaves, so the
drafts, their acceptance and the tokens are the same (EAGLE-3 and EAGLE heads, chains and trees, greedy and
seeded sampling; fp32 on the CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deployments.engine.request import SamplingParams
from speculative.adaptive import DepthSchedule
from tests.helpers import mixed_prompts
from tests.speculative.test_speculative import engine, spec_models  # noqa: F401  (fixture)
from workers.config import SpeculativeConfig

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
CHAIN = dict(num_steps=3)
TREE = dict(num_steps=2, topk=3, num_draft_tokens=5)
# runs of plain steps that fill the stash of 2 (caught up inside a plain step) and that end before a round; a tree
# runs only its full depth
SCHEDULES = {"chain": [0, 0, 0, 2, 0, 3, 0, 0, 1, 0, 0, 0, 0, 0, 3], "tree": [0, 0, 0, 2, 0, 2, 0, 0, 0, 0, 0, 2]}


def _spec(models, method: str, shape: str, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(method=method, model=str(models[method]), **(CHAIN if shape == "chain" else TREE), **kw)


@pytest.fixture(scope="module")
def references(spec_models):
    prompts = mixed_prompts(4)
    eng = engine(spec_models["target"])
    return prompts, {id(p): [o.token_ids for o in eng.generate(prompts, p)] for p in (GREEDY, SEEDED)}


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_kv_only_catch_up_equals_the_full_one_and_no_speculation(spec_models, references, method, shape, params):
    """Forced depths with runs of plain steps (preemption and the overlap schedule on): the tokens are no
    speculation's, and every round's draft tree is the full catch-up's (the random heads' drafts are rarely
    accepted, so the drafts themselves are compared)."""
    prompts, ref = references
    drafts = []
    for kv_only in (True, False):
        eng = engine(spec_models["target"], _spec(spec_models, method, shape, catch_up_window=2),
                     kv_cache_tokens=112, max_prefill_tokens=32)
        worker = eng.executor.worker
        p = worker.proposer
        assert p.kv_only_catch_up  # (one-layer heads)
        p.kv_only_catch_up = kv_only
        trees, propose = [], p.propose
        p.propose = lambda inp: trees.append(propose(inp)) or trees[-1]
        eng.depth_policy = DepthSchedule(SCHEDULES[shape])
        out = eng.generate(prompts, params)
        assert [o.token_ids for o in out] == ref[id(params)]
        runs, positions = worker.catch_ups
        assert positions > runs > 0 and eng.scheduler.num_preemptions > 0
        drafts.append([t.tokens[:, 1:].tolist() for t in trees])  # (the nodes after each root)
    assert drafts[0] == drafts[1] and len(drafts[0]) > 3


def _draft_state(p, slots: torch.Tensor) -> list[torch.Tensor]:
    return [p.state_ids[slots].clone(), p.state_logp[slots].clone(), p.state_feat[slots].clone()]


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_kv_only_catch_up_writes_the_full_catch_ups_kv(spec_models, method, shape):
    """Requests behind by different numbers of plain steps (one by a single step) caught up both ways from the same
    stash: the draft KV at every stashed position (zeroed first, so a missing store fails) and the draft state
    (first drafts, their scores, the next feature) are the full catch-up's."""
    eng = engine(spec_models["target"], _spec(spec_models, method, shape, catch_up_window=8), page_size=4,
                 disable_overlap_schedule=True)
    eng.depth_policy = DepthSchedule([0])
    prompts = mixed_prompts(4)
    reqs = []
    for i, steps in enumerate((3, 2, 1)):  # each added after the previous one's plain steps
        reqs.append(eng.add_request(prompts[i + 1], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)))
        for _ in range(steps + 1):  # its prefill, then plain steps of everyone admitted
            eng.step()
    worker = eng.executor.worker
    p = worker.proposer
    slots = np.array([r.req_slot for r in reqs], dtype=np.int64)
    lags = worker.plain_run[slots].astype(np.int64)
    assert sorted(lags.tolist()) == [1, 3, 6] and worker.catch_ups[0] == 0  # mixed lags, one of 1; none caught up
    root_pos = np.array([len(r.all_ids) - 1 for r in reqs], dtype=np.int64)  # each root: no forward consumed it yet
    kv = p.runner.kv_cache
    tok_slots = torch.tensor(np.repeat(slots, lags))
    pos = torch.tensor(np.concatenate([np.arange(m - n, m) for m, n in zip(root_pos, lags)]))
    at = worker.page_table.slots(tok_slots, pos)  # the stashed positions' KV slots
    before = [t.clone() for t in kv.k + kv.v]
    state = _draft_state(p, torch.tensor(slots))
    results = []
    for kv_only in (True, False):
        for t, b in zip(kv.k + kv.v, before):
            t.copy_(b)
            t[at] = 0
        p.kv_only_catch_up = kv_only
        p.catch_up(slots, root_pos, lags)
        results.append(([t.clone() for t in kv.k + kv.v], _draft_state(p, torch.tensor(slots))))
    (kv_a, state_a), (kv_b, state_b) = results
    for a, b, old in zip(kv_a, kv_b, before):
        assert a[at].abs().amax(dim=(1, 2)).min() > 0  # every stashed position written
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        keep = torch.ones(a.shape[0], dtype=torch.bool)
        keep[at] = False
        assert torch.equal(a[keep], old[keep])  # nothing else
    assert torch.equal(state_a[0], state_b[0])  # the same first drafts
    for a, b in zip(state_a[1:], state_b[1:]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert not torch.equal(state_a[2], state[2])  # (the state moved)
