"""The DeepSeek-V3.2 MTP layer under YaRN rope scaling (the released checkpoints'): speculation on == off, chain
and tree, with preemption (pages of 16), and the MTP layer's RoPE tables and softmax scale are the target's (YaRN's;
``tests/models/test_deepseek_v32.py`` checks them against transformers and that YaRN changes the tokens)."""

from __future__ import annotations

import pytest
import torch

from deployments.engine.engine import Engine
from deployments.engine.request import SamplingParams
from deployments.make_tiny import DEEPSEEK_YARN, make_tiny
from tests.helpers import mixed_prompts
from workers.config import EngineConfig, SpeculativeConfig

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = mixed_prompts(6)  # 3 .. 64 tokens


def ds_engine(path, spec=None, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cpu", max_model_len=512, speculative_config=spec, **kw))


@pytest.fixture(scope="module")
def ds_yarn_target(tmp_path_factory):
    """A tiny target with an MTP layer under YaRN, and its tokens without speculation."""
    path = make_tiny("deepseek_v32", tmp_path_factory.mktemp("ds_yarn") / "target", layers=2, hidden=64, vocab=512,
                     heads=4, max_position=1024, seed=3, rope_scaling=dict(DEEPSEEK_YARN),
                     deepseek={"index_topk": 4, "num_nextn_predict_layers": 1})
    return path, [o.token_ids for o in ds_engine(path).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("topk,ndt", [(1, None), (2, 5)])
def test_mtp_under_yarn_equals_plain_decoding(ds_yarn_target, topk, ndt):
    path, plain = ds_yarn_target
    spec = SpeculativeConfig(method="mtp", num_steps=3, topk=topk, num_draft_tokens=ndt)
    eng = ds_engine(path, spec, page_size=16, kv_cache_tokens=256, max_prefill_tokens=32)
    out = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in out] == plain
    assert eng.scheduler.num_preemptions > 0
    assert all(o.spec["num_drafts"] > 0 for o in out)
    # (lossless verification hides a draft's numerics: the MTP layer's RoPE and softmax scale are the target's)
    worker = eng.executor.worker
    mtp, target = worker.proposer.head, worker.target.model
    n = min(mtp.rope_cos.shape[0], target.rope_cos.shape[0])
    assert torch.equal(mtp.rope_cos[:n], target.rope_cos[:n]) and torch.equal(mtp.rope_sin[:n], target.rope_sin[:n])
    assert mtp.layer.self_attn.spec.scaling == target.layers[0].self_attn.spec.scaling > 1.8 * 32 ** -0.5
