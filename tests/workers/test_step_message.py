"""The controller<->worker step message: a packed ``WorkerStep`` survives pickling whole, the plan's values land in
the right rows, the graphs' static inputs get exactly the values (and padding) the step's lists say, and a step's
outputs become flat per-request tokens that the scheduler splits back correctly."""

from __future__ import annotations

import pickle
from functools import partial

import numpy as np
import pytest
import torch

from deployments.engine.request import Request, RequestStatus, SamplingParams
from deployments.engine.scheduler import StepPlan
from workers.graphs import StaticInputs
from workers.messages import FLOAT_FIELDS, INT_FIELDS, ForwardMode, StepResult, WorkerStep
from workers.outputs import HostCopy, Launched, PackedOutputs, round_result, token_result

ROWS = dict(req_slots=[3, 0, 5], seq_lens=[17, 40, 9], extend_lens=[1, 1, 1], top_k=[0, 50, 7],
            seeds=[2**32 - 1, 0, 12345], counters=[4, 30, 0], pending=[1, 0, 1], temperature=[0.0, 0.8, 1.3],
            top_p=[1.0, 0.9, 0.5], min_p=[0.0, 0.05, 0.0])


def decode_step(drafts: list[list[int]] | None = None) -> WorkerStep:
    return WorkerStep.pack(ForwardMode.DECODE, input_ids=[], page_updates=([0, 5], [2, 1], [11, 12]),
                           draft_tokens=drafts, step_id=9, top_logprobs=True, **ROWS)


@pytest.mark.parametrize("drafts", [None, [[1, 2, 3], [4, 5, 6], [7, 8, 9]]])
def test_packed_step_round_trips(drafts):
    step = pickle.loads(pickle.dumps(decode_step(drafts), protocol=5))
    assert (step.mode, step.step_id, step.top_logprobs, step.batch_size) == (ForwardMode.DECODE, 9, True, 3)
    for name in INT_FIELDS[:6] + ("extend_lens",):
        assert step.ints.dtype == np.int64 and getattr(step, name).tolist() == ROWS[name], name
    assert step.next_ids.tolist() == [-1, -1, -1]  # none given
    for name in FLOAT_FIELDS:
        assert getattr(step, name).tolist() == pytest.approx(ROWS[name]), name
    assert step.page_updates.tolist() == [[0, 5], [2, 1], [11, 12]] and step.input_ids.shape == (0,)
    assert (step.draft_tokens is None) if drafts is None else step.draft_tokens.tolist() == drafts


def test_plan_to_worker_step():
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=i)
              for i, (t, k, p, m) in enumerate(zip(ROWS["temperature"], ROWS["top_k"], ROWS["top_p"], ROWS["min_p"]))]
    reqs = [Request(f"r{i}", [1, 2], p) for i, p in enumerate(params)]
    for r, slot in zip(reqs, ROWS["req_slots"]):
        r.req_slot = slot
    plan = StepPlan(ForwardMode.EXTEND, reqs, input_ids=[5, 6, 7, 8], seq_lens=[2, 1, 1], extend_lens=[2, 1, 1],
                    page_updates=([3], [0], [4]), counters=[0, 0, 0], next_ids=[-1, 9, -1])
    step = plan.to_worker_step()
    assert step.req_slots.tolist() == ROWS["req_slots"] and step.seeds.tolist() == [r.seed for r in reqs]
    assert step.input_ids.tolist() == [5, 6, 7, 8] and step.next_ids.tolist() == [-1, 9, -1]
    assert step.pending.tolist() == [0, 0, 0] and step.top_k.tolist() == ROWS["top_k"]
    assert step.temperature.tolist() == pytest.approx(ROWS["temperature"]) and not step.top_logprobs


@pytest.mark.parametrize("drafts", [None, [[1, 2, 3], [4, 5, 6], [7, 8, 9]]])
def test_static_fill_matches_the_lists(drafts):
    """What the graphs read after a fill: the step's values in its columns, padding up to the bucket (also where a
    larger step wrote before), exactly as built from the per-request lists."""
    static = StaticInputs(8, 0 if drafts is None else 3, pad_slot=8, device="cpu")
    big = WorkerStep.pack(ForwardMode.DECODE, input_ids=[], page_updates=([], [], []),
                          draft_tokens=None if drafts is None else [[99] * 3] * 6,
                          **{k: (v * 2)[:6] for k, v in ROWS.items()})
    static.fill(big, 8)
    static.fill(pickle.loads(pickle.dumps(decode_step(drafts))), 4)
    b, pad = 3, 4 - 3
    ints = [ROWS[n] + [v] * pad for n, v in zip(INT_FIELDS[:6], (8, 1, 0, 0, 0, 0))]
    ints += [] if drafts is None else [list(col) + [0] * pad for col in zip(*drafts)]
    floats = [ROWS[n] + [v] * pad for n, v in zip(FLOAT_FIELDS, (0.0, 1.0, 0.0))]
    assert torch.equal(static.ints[:, :4], torch.tensor(ints, dtype=torch.int64))
    assert torch.equal(static.floats[:, :4], torch.tensor(floats, dtype=torch.float32))
    assert static.column("seeds", b).tolist() == ROWS["seeds"]
    if drafts is not None:
        assert static.drafts(b).tolist() == drafts
    static.reset()
    assert static.ints[0].tolist() == [8] * 8 and static.floats[1].tolist() == [1.0] * 8


def _read(packed: PackedOutputs, finish) -> StepResult:
    res = Launched(4, HostCopy(packed), finish, 0.0).result()
    return pickle.loads(pickle.dumps(res, protocol=5))


def test_results_are_flat_per_request_runs():
    ids, lps = torch.tensor([7, 2**31 - 5, 0]), torch.tensor([-0.5, -1.25, -3.0])
    top_ids, top_lps = torch.tensor([[7, 1], [2**31 - 5, 3], [0, 4]]), torch.tensor([[-0.5, -2.0]] * 3)
    res = _read(PackedOutputs.pack(ids, lps, top_ids, top_lps), token_result)
    assert res.step_id == 4 and res.tokens == [7, 2**31 - 5, 0] and res.logprobs == [-0.5, -1.25, -3.0]
    assert res.offsets() == [0, 1, 2, 3] and res.spec() is None
    assert res.top_logprobs[1] == [[(2**31 - 5, -0.5), (3, -2.0)]]

    accept = torch.tensor([2, 0, 3])
    tokens = torch.arange(12).view(3, 4) + 100
    logprobs = -torch.arange(12, dtype=torch.float32).view(3, 4) / 4
    res = _read(PackedOutputs.pack(accept, tokens, logprobs), partial(round_result, tree_size=4))
    at = res.offsets()
    assert [res.tokens[at[i]:at[i + 1]] for i in range(3)] == [[100, 101, 102], [104], [108, 109, 110, 111]]
    assert [res.logprobs[at[i]:at[i + 1]] for i in range(3)] == [[0.0, -0.25, -0.5], [-1.0], [-2.0, -2.25, -2.5, -2.75]]
    assert res.spec() == [(3, range(2)), (3, range(0)), (3, range(3))]


def test_scheduler_applies_a_flat_result():
    from deployments.engine.pages import PageAllocator
    from deployments.engine.scheduler import Scheduler

    sched = Scheduler(PageAllocator(64, 16), max_num_seqs=4, max_prefill_tokens=64, max_model_len=64,
                      eos_token_ids=(2,), vocab_size=128)
    reqs = [Request(f"r{i}", [5, 6], SamplingParams(max_tokens=10)) for i in range(3)]
    for i, r in enumerate(reqs):
        r.req_slot, r.status, r.num_inflight = i, RequestStatus.RUNNING, 1
    sched.running = list(reqs)
    plan = StepPlan(ForwardMode.DECODE, reqs, [], [2, 2, 2], [1, 1, 1], ([], [], []), [0, 0, 0], [0, 0, 0])
    result = StepResult(tokens=[10, 11, 12, 2, 9, 13], logprobs=[-1.0, -2.0, -3.0, -4.0, -5.0, -6.0],
                        counts=[3, 2, 1], num_drafts=2)
    produced = sched.update(plan, result)
    assert [(r.rid, new, n, list(acc)) for r, new, (n, acc) in produced] == [
        ("r0", [10, 11, 12], 2, [0, 1]), ("r1", [2], 2, [0]), ("r2", [13], 2, [])]  # r1: EOS ends it
    assert reqs[0].output_logprobs == [-1.0, -2.0, -3.0] and reqs[1].finish_reason == "stop"
