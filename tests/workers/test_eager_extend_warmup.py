"""The eager prefills' start-up warm-up (``Worker.warm_eager_extend``): one eager prefill per distinct compile key,
on the padding slot, changing nothing any request sees."""

from __future__ import annotations

import torch

from deployments.engine.engine import Engine
from deployments.engine.request import SamplingParams
from deployments.make_heads import make_head
from tests.helpers import mixed_prompts
from workers.config import EngineConfig, SpeculativeConfig
from workers.graphs import eager_extend_shapes
from workers.messages import ForwardMode, WorkerStep


def test_shapes_keep_the_first_of_each_key_within_the_budget():
    seen = []

    def key(b, n, uniform):
        if uniform and b <= 2 and n <= 8:
            return None  # (a prefill graph takes it)
        return (uniform, n > 16, b % 4 == 0)

    shapes = eager_extend_shapes(max_requests=8, max_len=32, max_tokens=40,
                                 key=lambda *shape: seen.append(shape) or key(*shape))
    assert all((n * b if u else n + b - 1) <= 40 and n <= 32 for b, n, u in seen), seen
    keys = [key(*s) for s in shapes]
    assert None not in keys and len(keys) == len(set(keys)), shapes
    assert len(keys) == len({key(*s) for s in seen} - {None})  # every key met is run once
    for b, n, u in shapes:  # each with the fewest requests of its key at that length
        assert not any(key(c, n, u) == key(b, n, u) for c in range(1 if u else 2, b)), (b, n, u)
    assert {n for _, n, _ in seen} == {1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32}
    assert min(n for _, n, u in seen if not u) == 2  # (one long chunk: one token each is a uniform batch)


def _state(worker, pad: int, page: int) -> dict:
    """What a request's later steps read: the slots' newest tokens and advances, the draft's per-slot state, and
    the target's and draft's KV past page 0."""
    out = {"last_token": worker.last_token[:pad].clone(), "advance": worker.advance[:pad].clone()}
    for name in ("state_ids", "state_logp", "state_feat"):
        if getattr(worker.proposer, name, None) is not None:
            out[name] = getattr(worker.proposer, name)[:pad].clone()
    for who, cache in (("target", worker.target.kv_cache), ("draft", worker.proposer.runner.kv_cache)):
        for i, (k, v) in enumerate(zip(cache.k, cache.v)):
            out[f"{who} k{i}"], out[f"{who} v{i}"] = k[page:].clone(), v[page:].clone()
    return out


def _prefill(worker, slot: int, lens: list[int]) -> None:
    b, zeros = len(lens), [0] * len(lens)
    worker.execute(WorkerStep.pack(ForwardMode.EXTEND, req_slots=[slot] * b, input_ids=[7] * sum(lens), seq_lens=lens,
                                   extend_lens=lens, page_updates=([], [], []), temperature=[0.0] * b, top_k=zeros,
                                   top_p=[1.0] * b, min_p=[0.0] * b, seeds=zeros, counters=zeros))


def test_the_warm_up_changes_no_request(tiny_models, tmp_path):
    """After requests have run, the warm-up (target and EAGLE-3 draft prefills on the padding slot) leaves every
    other slot's state and every KV page but page 0 as they were, and the engine then gives the tokens and the
    draft acceptance it gave before. The same prefill on a request's slot would change them (the check can fail)."""
    target = tiny_models["llama"]
    head = make_head("eagle3", target, tmp_path / "head", seed=2, draft_vocab=200)
    cfg = EngineConfig(model=str(target), device="cpu", page_size=4, max_model_len=128, max_num_seqs=4,
                       max_prefill_tokens=48, speculative_config=SpeculativeConfig(
                           method="eagle3", model=str(head), num_steps=3))
    engine = Engine(cfg)
    worker, prompts = engine.executor.worker, mixed_prompts(6, seed=5)
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    try:
        first = [(c.token_ids, c.spec) for c in engine.generate(prompts, greedy)]
        before = _state(worker, cfg.max_num_seqs, cfg.page_size)
        shapes = worker.warm_eager_extend()
        after = _state(worker, cfg.max_num_seqs, cfg.page_size)
        assert [k for k in before if not torch.equal(before[k], after[k])] == []
        assert {u for _, _, u in shapes} == {True, False} and max(b for b, _, _ in shapes) == 4, shapes
        assert [(c.token_ids, c.spec) for c in engine.generate(prompts, greedy)] == first
        before = _state(worker, cfg.max_num_seqs, cfg.page_size)
        _prefill(worker, 0, [5, 1])  # (the control: on a request's slot)
        after = _state(worker, cfg.max_num_seqs, cfg.page_size)
        assert {"last_token", "target k0", "draft k0"} <= {k for k in before if not torch.equal(before[k], after[k])}
    finally:
        engine.shutdown()
