"""The eager prefills' start-up warm-up (``Worker.warm_eager_extend``): one eager prefill per distinct compile key,
on the padding slot, changing nothing any request sees."""

from __future__ import annotations

from deployments.engine.engine import Engine
from deployments.engine.request import SamplingParams
from deployments.make_heads import make_head
from tests.helpers import mixed_prompts
from workers.config import EngineConfig, SpeculativeConfig
from workers.graphs import eager_extend_shapes


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


def test_the_warm_up_changes_no_request(tiny_models, tmp_path):
    """Greedy tokens and the draft's acceptance after the warm-up (target and EAGLE-3 draft prefills on the padding
    slot) are those of an engine without it."""
    target = tiny_models["llama"]
    head = make_head("eagle3", target, tmp_path / "head", seed=2, draft_vocab=200)

    def run(warm: bool):
        cfg = EngineConfig(model=str(target), device="cpu", page_size=4, max_model_len=128, max_num_seqs=4,
                           max_prefill_tokens=48, speculative_config=SpeculativeConfig(
                               method="eagle3", model=str(head), num_steps=3))
        engine = Engine(cfg)
        shapes = engine.executor.worker.warm_eager_extend() if warm else []
        done = engine.generate(mixed_prompts(6, seed=5), SamplingParams(max_tokens=12, temperature=0.0))
        engine.shutdown()
        return shapes, [(c.token_ids, c.spec) for c in done]

    shapes, warmed = run(True)
    assert {u for _, _, u in shapes} == {True, False} and max(b for b, _, _ in shapes) == 4, shapes
    assert warmed == run(False)[1]
