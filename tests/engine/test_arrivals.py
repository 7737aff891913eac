"""Requests that arrive while others decode: prefills keep the overlap pipeline full (the first token stays on the
device, like a decode's), and without speculation their chunks ride in the decode steps (one EXTEND forward, one
token budget). Outputs stay those of transformers and of the one-step-at-a-time schedule."""

from __future__ import annotations

import pytest

from deployments.engine.engine import Engine
from deployments.engine.request import SamplingParams
from deployments.make_heads import make_head
from tests.helpers import hf_greedy, mixed_prompts
from workers.config import EngineConfig, SpeculativeConfig
from workers.messages import ForwardMode

PROMPTS = mixed_prompts(10, seed=3)
# engine call -> requests that arrive just before it (several at once: admitted in one step)
ARRIVALS = {0: [0, 1, 2], 3: [3], 4: [4, 5], 9: [6], 13: [7, 8], 14: [9]}
CONFIGS = {
    "mixed": {},  # the CPU default: decode rows and chunks in one step
    "separate": {"mixed_decode_rows": 0},  # EXTEND and DECODE steps, both overlapped
    "serial": {"disable_overlap_schedule": True},  # mixed, each step read before the next is planned
    "mix_few": {"mixed_decode_rows": 4},  # mixed only while at most 4 requests run
}


def drive(engine: Engine, params: list[SamplingParams], prompts: list = PROMPTS) -> tuple[list, dict]:
    """Run the arrival pattern to completion; returns the requests and the steps launched, by kind, with how many
    of them were read in the call that launched them (nothing left running on the worker)."""
    worker, real_step = engine.executor.worker, engine.executor.step
    counts = {"extend": 0, "decode": 0, "mixed": 0, "read_at_once": 0}

    def counting(step, keep):
        results = real_step(step, keep)
        if step is not None:
            mixed = step.mode == ForwardMode.EXTEND and min(step.input_ids) < 0
            counts["decode" if step.mode == ForwardMode.DECODE else "mixed" if mixed else "extend"] += 1
            counts["read_at_once"] += not worker._launched
        return results

    engine.executor.step = counting
    reqs: list = [None] * len(prompts)
    call = 0
    while call <= max(ARRIVALS) or engine.has_work():
        for i in ARRIVALS.get(call, []):
            reqs[i] = engine.add_request(prompts[i], params[i])
        engine.step()
        call += 1
    assert engine.allocator.num_free == engine.allocator.capacity_pages
    assert all(r.finished and r.num_inflight == 0 for r in reqs)
    return reqs, counts


def make_engine(path, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cpu", max_model_len=512, page_size=4,
                               max_prefill_tokens=24, **kw))


@pytest.fixture(scope="module")
def reference(tiny_models, hf_models):
    return [hf_greedy(hf_models["qwen3"], p, 8 + 3 * i) for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_arrivals_during_decoding_are_token_exact(tiny_models, reference, config):
    engine = make_engine(tiny_models["qwen3"], **CONFIGS[config])
    greedy = [SamplingParams(max_tokens=8 + 3 * i, temperature=0.0) for i in range(len(PROMPTS))]
    reqs, counts = drive(engine, greedy)
    assert [r.output_ids for r in reqs] == reference
    if config == "serial":
        assert counts["read_at_once"] == sum(counts[k] for k in ("extend", "decode", "mixed"))
    else:  # every step but the last is read only after the next one was launched
        assert counts["read_at_once"] <= 1
    assert (counts["mixed"] > 0) == (config != "separate"), counts
    if config in ("mixed", "serial"):  # every arrival rode in a decode step (none came while nothing ran)
        assert counts["extend"] == 1, counts


def test_a_step_admits_what_arrived_together_with_the_decode_rows(tiny_models):
    """Three requests arriving while two decode become one step: two decode rows (-1: their ids are read on the
    device) and the three prompts, under one token budget (the rest of the last prompt waits for the next step)."""
    engine = make_engine(tiny_models["qwen3"])
    sched = engine.scheduler
    assert not engine.executor.decode_graphs and sched.mixed_decode_rows == 64  # the default: decode runs eagerly
    for p in PROMPTS[:2]:
        engine.add_request(p, SamplingParams(max_tokens=20, temperature=0.0))
    engine.step()
    first = sched.running[:]
    assert len(first) == 2 and all(r.num_inflight == 1 for r in first)  # running, first token still on the device
    new = [engine.add_request(PROMPTS[5][:n], SamplingParams(max_tokens=4, temperature=0.0)) for n in (3, 5, 40)]
    plan = sched.schedule()
    assert plan.mode == ForwardMode.EXTEND and plan.requests == first + new
    assert plan.extend_lens == [1, 1, 3, 5, 24 - 2 - 3 - 5] and plan.input_ids[:2] == [-1, -1]
    # the decode rows' lengths and counters count the token in flight (one: no speculation)
    assert plan.seq_lens[:2] == [len(r.prompt_ids) + 1 for r in first] and plan.counters[:2] == [1, 1]
    assert plan.next_ids[:4] == [-1] * 4 and plan.next_ids[4] == PROMPTS[5][14]
    # planned is done: the two short prompts run (their first token will be in flight), the long one waits
    assert sched.running == first + new[:2] and list(sched.waiting) == [new[2]]
    assert [r.num_inflight for r in first + new] == [2, 2, 1, 1, 0] and new[2].num_computed == 14

def test_seeded_sampling_with_arrivals_equals_the_serial_schedule(tiny_models):
    params = [SamplingParams(max_tokens=10 + i, temperature=0.9, top_p=0.95, seed=40 + i, ignore_eos=True, logprobs=1)
              for i in range(len(PROMPTS))]
    runs = {name: drive(make_engine(tiny_models["qwen3"], **CONFIGS[name]), params)[0]
            for name in ("mixed", "separate", "serial")}
    for name in ("mixed", "separate"):
        for a, b in zip(runs[name], runs["serial"]):
            assert a.output_ids == b.output_ids
            assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)


@pytest.mark.parametrize("method", ["draft", "eagle3"])
def test_speculative_rounds_with_arrivals_keep_the_target_output(tiny_models, hf_models, tmp_path, method):
    """Rounds never carry prompt chunks, but a prefill still overlaps: the round after it reads the first token on
    the device, and a slot's accept count from its previous request is not carried into the new one."""
    target = tiny_models["llama"]
    model = target if method == "draft" else make_head("eagle3", target, tmp_path / "head", seed=2, draft_vocab=200)
    spec = SpeculativeConfig(method=method, model=str(model), num_steps=3)
    engine = make_engine(target, speculative_config=spec, max_num_seqs=4)  # slots are reused by later arrivals
    greedy = [SamplingParams(max_tokens=8 + 3 * i, temperature=0.0) for i in range(len(PROMPTS))]
    reqs, counts = drive(engine, greedy)
    assert [r.output_ids for r in reqs] == [hf_greedy(hf_models["llama"], p, 8 + 3 * i)
                                             for i, p in enumerate(PROMPTS)]
    assert counts["mixed"] == 0 and counts["extend"] > 1 and counts["read_at_once"] <= 1, counts


def ticking(engine: Engine) -> Engine:
    """The scheduler's clock advanced one unit at each plan: every step's wall is 1.0."""
    now, sched = [0.0], engine.scheduler
    real = sched.schedule

    def schedule():
        now[0] += 1.0
        return real()

    sched.clock, sched.schedule = (lambda: now[0]), schedule
    return engine


def test_a_prefill_delay_gathers_arrivals_into_fewer_prefill_steps(tiny_models, hf_models):
    """With ``scheduler_delay_factor`` 2, an arrival while others run waits two prefill walls, and what arrives
    meanwhile joins its prefill step (vLLM's rule); outputs are unchanged. A huge factor still admits arrivals once
    they fill a step's budget or nothing runs (no request waits for ever)."""
    prompts = [p[:6] for p in PROMPTS]  # short: two arrivals never fill the 24-token budget
    greedy = [SamplingParams(max_tokens=8 + 3 * i, temperature=0.0) for i in range(len(prompts))]
    reference = [hf_greedy(hf_models["qwen3"], p, 8 + 3 * i) for i, p in enumerate(prompts)]
    counts = {}
    for factor in (0.0, 2.0, 1e9):
        engine = ticking(make_engine(tiny_models["qwen3"], mixed_decode_rows=0, scheduler_delay_factor=factor))
        reqs, counts[factor] = drive(engine, greedy, prompts)
        assert [r.output_ids for r in reqs] == reference, f"scheduler_delay_factor {factor}"
    assert counts[2.0]["extend"] < counts[0.0]["extend"], counts
    assert counts[1e9]["extend"] <= counts[2.0]["extend"], counts


def test_the_prefill_delay_admits_at_once_what_fills_a_step(tiny_models):
    engine = ticking(make_engine(tiny_models["qwen3"], mixed_decode_rows=0, scheduler_delay_factor=1e9))
    sched = engine.scheduler
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.0))
    engine.step()  # nothing ran: admitted at once
    engine.step()
    assert len(sched.running) == 1 and not sched.waiting
    short = engine.add_request(PROMPTS[5][:5], SamplingParams(max_tokens=4, temperature=0.0))
    assert sched.schedule().mode == ForwardMode.DECODE and list(sched.waiting) == [short]
    # 5 + 20 prompt tokens fill the 24-token budget: no reason to wait
    long = engine.add_request(PROMPTS[5][:20], SamplingParams(max_tokens=4, temperature=0.0))
    plan = sched.schedule()
    assert plan.mode == ForwardMode.EXTEND and plan.requests == [short, long] and plan.extend_lens == [5, 19]


@pytest.mark.parametrize("overlap", [True, False])
def test_the_prefill_delay_scales_with_the_prefill_steps_own_wall(tiny_models, overlap):
    """The delay is F times the prefill step's own wall, overlapped too. On a device clock (a step's cost counted
    when its results are read: a prefill 10, a decode step 1), read at once the interval from a prefill's plan to the
    next holds the prefill; overlapped it holds the read of the step before (a decode step, or nothing) and the
    prefill falls in the interval after, which the delay must scale by instead."""
    engine = make_engine(tiny_models["qwen3"], mixed_decode_rows=0, scheduler_delay_factor=2.0,
                         disable_overlap_schedule=not overlap)
    sched, real_step, now, cost = engine.scheduler, engine.executor.step, [0.0], {}
    sched.clock = lambda: now[0]

    def device_clock(step, keep):
        if step is not None:
            cost[step.step_id] = 10.0 if step.mode == ForwardMode.EXTEND else 1.0
        results = real_step(step, keep)
        now[0] += sum(cost[r.step_id] for r in results)
        return results

    engine.executor.step = device_clock
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    for _ in range(4):  # its prefill (nothing runs: at once), then decode steps
        engine.step()
    assert sched._prefill_wall == 10.0, f"the prefill's wall measured as {sched._prefill_wall}, not its 10"
    late = engine.add_request(PROMPTS[5][:5], SamplingParams(max_tokens=4, temperature=0.0))
    while late in sched.waiting:  # (5 tokens: it fills no step; it waits 2 x 10 of decode steps)
        planned_at = now[0]  # (the step's plan reads the clock before its read advances it)
        engine.step()
    assert 20.0 <= planned_at - late.queued_at < 21.0, (planned_at, late.queued_at)
    while engine.has_work():
        engine.step()
    assert late.finished and len(late.output_ids) == 4
