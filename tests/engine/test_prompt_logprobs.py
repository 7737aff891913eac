"""Prompt logprobs (``SamplingParams.prompt_logprobs``): computed in the prefill under the raw distribution, equal to
transformers' log_softmax of the same checkpoint's logits, across prefill chunks, preemption and speculation."""

from __future__ import annotations

import pytest
import torch

from deployments.engine.engine import Engine
from deployments.engine.request import SamplingParams
from tests.helpers import mixed_prompts
from workers.config import EngineConfig, SpeculativeConfig


def hf_prompt_logprobs(model, prompt: list[int], k: int) -> list:
    """transformers' reference: None for the first token, then (logprob of the token, its k likeliest)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    lsm = torch.log_softmax(logits, dim=-1)
    out = [None]
    for pos in range(1, len(prompt)):
        vals, ids = lsm[pos - 1].topk(k)
        out.append((lsm[pos - 1, prompt[pos]].item(), list(zip(ids.tolist(), vals.tolist()))))
    return out


def assert_close(got: list, want: list, k: int) -> None:
    assert len(got) == len(want) and got[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert abs(g[0] - w[0]) < 1e-4
        assert len(g[1]) == k
        for (gi, gl), (wi, wl) in zip(g[1], w[1]):
            assert abs(gl - wl) < 1e-4
            assert gi == wi or abs(gl - wl) < 1e-6  # (ties may order differently)


@pytest.mark.parametrize("setting", ["plain", "chunked", "speculative"])
def test_prompt_logprobs_equal_transformers(tiny_models, hf_models, setting):
    path = tiny_models["llama"]
    kw = {"page_size": 4, "max_model_len": 512}
    if setting == "chunked":  # chunks of 16 tokens (mixed with the running requests' decode rows), and preemption
        kw.update(max_prefill_tokens=16, kv_cache_tokens=96)
    if setting == "speculative":
        kw.update(max_prefill_tokens=16, speculative_config=SpeculativeConfig(method="draft", model=str(path),
                                                                               num_steps=2))
    engine = Engine(EngineConfig(model=str(path), device="cpu", **kw))
    prompts = mixed_prompts(8)
    ks = [0, 1, 5, 20, 2, 3, 0, 4]
    params = [SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=k) for k in ks]
    params[6] = SamplingParams(max_tokens=8, temperature=0.0)  # one that does not ask gets none
    out = engine.generate(prompts, params)
    for prompt, k, sp, c in zip(prompts, ks, params, out):
        assert c.error is None
        if sp.prompt_logprobs is None:
            assert c.prompt_logprobs is None
            continue
        assert_close(c.prompt_logprobs, hf_prompt_logprobs(hf_models["llama"], prompt, max(k, 1)), k)
    if setting == "chunked":
        assert engine.scheduler.num_preemptions > 0  # recomputed prompts asked for none again, and lost none
    # the same outputs as without prompt logprobs
    plain = engine.generate(prompts, [SamplingParams(max_tokens=8, temperature=0.0)] * len(prompts))
    assert [c.token_ids for c in plain] == [c.token_ids for c in out]


def test_prompt_logprobs_are_validated():
    from deployments.engine.request import InvalidRequest

    with pytest.raises(InvalidRequest) as e:
        SamplingParams(prompt_logprobs=21).validate()
    assert e.value.param == "prompt_logprobs"


def test_one_token_prompts_have_only_the_none(tiny_models):
    engine = Engine(EngineConfig(model=str(tiny_models["llama"]), device="cpu", max_model_len=128))
    out = engine.generate([[5], [6], [7, 8]], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))
    assert [c.prompt_logprobs[0] for c in out] == [None] * 3
    assert [len(c.prompt_logprobs) for c in out] == [1, 1, 2] and out[2].prompt_logprobs[1] is not None
    alone = engine.generate([[5], [6]], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0))
    assert [c.prompt_logprobs for c in alone] == [[None], [None]]
