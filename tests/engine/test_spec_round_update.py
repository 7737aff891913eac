"""A speculative round's tokens applied in one pass (``Scheduler._update_round``) leave the scheduler exactly as the
general ``update`` does: outputs, stops (EOS, stop ids inside the accepted run, length), KV pages and the prefix
cache."""

import copy
import random

from deployments.engine.pages import PageAllocator
from deployments.engine.prefix_cache import PrefixCache
from deployments.engine.request import Request, SamplingParams
from deployments.engine.scheduler import Scheduler
from workers.messages import ForwardMode, StepResult


def state(sched: Scheduler) -> tuple:
    reqs = sorted(sched._by_id.values(), key=lambda r: r.rid)
    return ([(r.rid, r.output_ids, r.output_logprobs, r.status, r.finish_reason, r.pages, r.num_computed,
              r.draft_lag, r.num_inflight, r.cache_at) for r in reqs],
            [r.rid for r in sched.running], sorted(sched.allocator._free), sched.allocator._refs)


def test_one_pass_round_update_matches_the_general_update(monkeypatch):
    one_pass, inner = [], Scheduler._update_round
    monkeypatch.setattr(Scheduler, "_update_round", lambda self, plan, result: one_pass.append(1) or inner(self, plan,
                                                                                                         result))
    rng = random.Random(0)
    page, depth = 4, 3
    sched = Scheduler(PageAllocator(200, page, PrefixCache(page, key_next_token=True)), max_num_seqs=12,
                      max_prefill_tokens=256, max_model_len=64, eos_token_ids=(1,), vocab_size=64,
                      decode_lookahead=depth + 1, decode_max_advance=depth + 1, draft_catch_up_window=2)
    prefix = [rng.randrange(10, 60) for _ in range(8)]
    for i in range(12):
        prompt = (prefix if i % 2 else []) + [rng.randrange(10, 60) for _ in range(rng.randint(2, 12))]
        sched.add(Request(f"r{i:02}", prompt, SamplingParams(max_tokens=rng.randint(1, 30),
                                                             ignore_eos=i % 3 == 0,
                                                             stop_token_ids=[5] if i % 4 == 1 else [])))
    fast_rounds, reasons = 0, set()
    while sched.has_work():
        plan = sched.schedule()
        b = len(plan.requests)
        if plan.mode == ForwardMode.DECODE:
            counts = [rng.randint(1, depth + 1) for _ in range(b)]
            n = sum(counts)
            result = StepResult([rng.choice((1, 5, 7, 11, 12, 13)) for _ in range(n)],
                                [-rng.random() for _ in range(n)], counts=counts, num_drafts=depth)
            # the general path: alternatives given as [] (not None: no one-pass update; falsy: none are read)
            other, other_plan, other_result = copy.deepcopy((sched, plan, result))
            other_result.top_logprobs = []
            produced = sched.update(plan, result)
            other_produced = other.update(other_plan, other_result)
            assert [(r.rid, new, spec) for r, new, spec in produced] == \
                [(r.rid, new, spec) for r, new, spec in other_produced]
            assert state(sched) == state(other)
            reasons |= {r.finish_reason for r, _, _ in produced if r.finish_reason}
            fast_rounds += 1
        else:
            sched.update(plan, StepResult([rng.randrange(10, 60) for _ in range(b)], [-0.5] * b))
    assert fast_rounds > 5 and len(one_pass) == fast_rounds  # (every round in one pass; the copies' none)
    assert reasons == {"stop", "length"}
