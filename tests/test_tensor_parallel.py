"""Tensor parallelism over Ray worker actors with gloo (CPU): greedy tokens with TP=2 equal TP=1."""

from __future__ import annotations

import pytest

from conftest import mixed_prompts
from deployments.config import EngineConfig, SpeculativeConfig
from deployments.engine import Engine
from deployments.request import SamplingParams
from tools.make_heads import make_head
from tools.make_tiny import make_tiny

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory):
    base = tmp_path_factory.mktemp("tp")
    # 4 query heads, 1 KV head: TP=2 replicates the KV head; vocab 509 is not divisible by 2 (padded shards)
    target = make_tiny("qwen2", base / "t", layers=2, hidden=64, heads=4, kv_heads=1, vocab=509, max_position=512,
                       tie_embeddings=False)
    return {"target": target, "eagle3": make_head("eagle3", target, base / "e3", seed=3, draft_vocab=128),
            "draft": make_tiny("qwen2", base / "d", layers=1, hidden=64, heads=4, kv_heads=2, vocab=509,
                               max_position=512, tokenizer_from=str(target), seed=9)}


def run(tp_models, tp: int, spec: SpeculativeConfig | None):
    from deployments.executor import RayExecutor

    cfg = EngineConfig(model=str(tp_models["target"]), device="cpu", tensor_parallel_size=tp, page_size=4,
                       max_model_len=256, speculative_config=spec)
    executor = RayExecutor.start(cfg)
    try:
        return [o.token_ids for o in Engine(cfg, executor).generate(mixed_prompts(4), GREEDY)]
    finally:
        executor.shutdown()


@pytest.mark.parametrize("spec", [
    None,
    {"method": "eagle3", "num_steps": 2, "topk": 2, "num_draft_tokens": 4},
    {"method": "draft", "num_steps": 2, "draft_tensor_parallel_size": 2},
    {"method": "draft", "num_steps": 2, "draft_tensor_parallel_size": 1},
], ids=["plain", "eagle3-tree", "draft-tp2", "draft-tp1"])
def test_tp2_equals_tp1(ray_cluster, tp_models, spec):
    sc = None
    if spec is not None:
        sc = SpeculativeConfig(model=str(tp_models[spec["method"]]), **spec)
    ref = [o.token_ids for o in Engine(EngineConfig(model=str(tp_models["target"]), device="cpu", page_size=4,
                                                    max_model_len=256)).generate(mixed_prompts(4), GREEDY)]
    if sc is None or sc.draft_tensor_parallel_size != 2:  # a TP=1 target takes only a TP=1 draft
        assert run(tp_models, 1, sc) == ref
    assert run(tp_models, 2, sc) == ref


def test_bad_tp_size_is_refused(tp_models):
    from workers.layers import QKVParallelLinear, TPGroup

    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size 3"):
        QKVParallelLinear(64, 16, 4, 1, False, None, TPGroup(rank=0, size=3))
