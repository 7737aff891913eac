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


def test_gpu_visibility_is_widened_only_for_one_distinct_gpu_per_rank():
    """Ray gives each one-GPU actor CUDA_VISIBLE_DEVICES=<its id>; the custom all-reduce needs every rank's GPU
    visible, so the ranks join their ids (rank r then uses device r). Anything else stays as the launcher set it."""
    from workers.custom_all_reduce import widened_visibility

    assert widened_visibility(["3", "5"]) == "3,5"
    assert widened_visibility(["GPU-aa", "GPU-bb", "GPU-cc"]) == "GPU-aa,GPU-bb,GPU-cc"
    assert widened_visibility(["", ""]) is None  # a launcher that shows every GPU and sets LOCAL_RANK
    assert widened_visibility(["0,1", "0,1"]) is None
    assert widened_visibility(["2", "2"]) is None  # two ranks on one GPU: never widen into a clash
    assert widened_visibility(["1", ""]) is None
    assert widened_visibility(["MIG-aa", "MIG-bb"]) is None  # CUDA shows one MIG instance per process


def test_custom_all_reduce_switch_reaches_the_config():
    from deployments.cli import _engine_args, engine_config_from_args
    import argparse

    p = argparse.ArgumentParser()
    _engine_args(p)
    cfg = engine_config_from_args(p.parse_args(["--model", "m", "--tp", "2", "--disable-custom-all-reduce"]))
    assert cfg.disable_custom_all_reduce and cfg.tensor_parallel_size == 2
    assert not engine_config_from_args(p.parse_args(["--model", "m"])).disable_custom_all_reduce
    assert EngineConfig(model="m").resolved_device() == "cpu"  # auto on a machine without GPUs
