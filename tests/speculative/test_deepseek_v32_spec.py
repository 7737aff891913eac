"""Speculative decoding on DeepSeek-V3.2 (sparse MLA): greedy tokens with speculation equal those without, for the
checkpoint's MTP layer, a standalone draft (a smaller DeepSeek-V3.2), an EAGLE-3 head and n-gram, chains and trees,
with preemption (pages of 16); the target as its own draft accepts every draft (its draft steps, tree rows and DRAFT_EXTEND see
exactly what TARGET_VERIFY sees)."""

from __future__ import annotations

import pytest

from deployments.engine.engine import Engine
from deployments.engine.request import SamplingParams
from deployments.make_heads import make_head
from deployments.make_tiny import make_tiny
from speculative.adaptive import DepthSchedule
from tests.helpers import mixed_prompts
from workers.config import EngineConfig, SpeculativeConfig

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = mixed_prompts(6)  # 3 .. 64 tokens


@pytest.fixture(scope="module")
def ds_spec_models(tmp_path_factory):
    base = tmp_path_factory.mktemp("ds_spec")
    target = make_tiny("deepseek_v32", base / "target", layers=2, hidden=64, vocab=512, heads=4, max_position=1024,
                       seed=3, deepseek={"index_topk": 4, "num_nextn_predict_layers": 1})
    return {
        "target": target,
        "draft": make_tiny("deepseek_v32", base / "draft", layers=1, hidden=64, vocab=512, heads=4,
                           max_position=1024, seed=7, tokenizer_from=str(target), deepseek={"index_topk": 4}),
        "eagle3": make_head("eagle3", target, base / "eagle3", seed=2, draft_vocab=200),
    }


def ds_engine(path, spec=None, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cpu", max_model_len=512, speculative_config=spec, **kw))


@pytest.fixture(scope="module")
def ds_baseline(ds_spec_models):
    return [o.token_ids for o in ds_engine(ds_spec_models["target"]).generate(PROMPTS, GREEDY)]


CASES = [  # (method, draft, num_steps, topk, num_draft_tokens, page_size)
    ("mtp", None, 3, 1, None, 16), ("mtp", None, 3, 2, 5, 64),
    ("draft", "draft", 3, 1, None, 64), ("draft", "draft", 3, 2, 5, 16),
    ("eagle3", "eagle3", 3, 1, None, 16), ("eagle3", "eagle3", 2, 3, 5, 64),
    ("ngram", None, 3, 1, None, 16),
]


@pytest.mark.parametrize("method,draft,steps,topk,ndt,page_size", CASES,
                         ids=[f"{c[0]}-s{c[2]}k{c[3]}-p{c[5]}" for c in CASES])
def test_speculation_equals_plain_decoding(ds_spec_models, ds_baseline, method, draft, steps, topk, ndt, page_size):
    spec = SpeculativeConfig(method=method, model=str(ds_spec_models[draft]) if draft else None, num_steps=steps,
                             topk=topk, num_draft_tokens=ndt)
    eng = ds_engine(ds_spec_models["target"], spec, page_size=page_size, kv_cache_tokens=128 if page_size == 64 else 256,
                    max_prefill_tokens=32)
    out = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in out] == ds_baseline
    if page_size == 16:  # (pages of 64 hold each of these requests whole: waiting, never retracted)
        assert eng.scheduler.num_preemptions > 0
    assert eng.allocator.num_free == eng.allocator.capacity_pages
    assert all(o.spec["num_drafts"] > 0 for o in out)


@pytest.mark.parametrize("topk,ndt", [(1, None), (2, 7)])
def test_target_as_its_own_draft_accepts_its_top_choices(ds_spec_models, ds_baseline, topk, ndt):
    """A chain accepts every draft (16 tokens: the prefill's, then rounds of 4, 4, 4, 3); a tree of 7 nodes over 3
    steps keeps most of its top-1 path (a random draft's trees accept about 1)."""
    target = str(ds_spec_models["target"])
    eng = ds_engine(target, SpeculativeConfig(method="draft", model=target, num_steps=3, topk=topk,
                                              num_draft_tokens=ndt), page_size=64)
    out = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in out] == ds_baseline
    for o in out:
        if topk == 1:
            assert o.spec["accept_length"] == pytest.approx(15 / 4, abs=1e-3)
        else:
            assert o.spec["accept_length"] > 2.0


def test_mtp_plain_steps_and_lazy_catch_up(ds_spec_models, ds_baseline):
    """Adaptive speculation's depths forced on the MTP layer: plain steps (the target alone), then the MTP layer
    catching up on them before a round or when its stash of 2 fills; the tokens are plain decoding's."""
    spec = SpeculativeConfig(method="mtp", num_steps=3, catch_up_window=2)
    eng = ds_engine(ds_spec_models["target"], spec, page_size=16, kv_cache_tokens=256, max_prefill_tokens=32)
    eng.depth_policy = DepthSchedule([0, 0, 0, 2, 0, 3, 0, 0, 1, 0, 0, 0, 0, 0, 3])
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == ds_baseline
    assert eng.executor.worker.catch_ups[1] > eng.executor.worker.catch_ups[0] > 0
