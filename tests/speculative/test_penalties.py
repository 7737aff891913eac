"""Penalties, logit_bias and min_tokens (``workers.logits_processing``): equal to a plain-Python reference over
transformers' fp32 logits without speculation, and unchanged by every speculative method (greedy token-exact, seeded
sampling equal)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from deployments.engine.engine import Engine
from deployments.engine.request import SamplingParams
from tests.helpers import mixed_prompts
from tests.speculative.test_speculative import spec_models  # noqa: F401 - the fixture
from workers.config import EngineConfig, SpeculativeConfig

EOS_BIAS = 30.0  # pushes EOS to the top once min_tokens lets it through


def cases(eos: int) -> list[SamplingParams]:
    base = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    return [
        replace(base, frequency_penalty=1.5),
        replace(base, presence_penalty=2.0),
        replace(base, repetition_penalty=1.8),
        replace(base, logit_bias={7: 8.0, 11: 5.0, 300: -100.0}),
        replace(base, ignore_eos=False, min_tokens=6, logit_bias={eos: EOS_BIAS}),
        base,  # no processing: in the same batches as the others
        replace(base, frequency_penalty=-0.5, presence_penalty=0.7, repetition_penalty=0.6,
                logit_bias={20: 3.0}, min_tokens=3, stop_token_ids=[20]),
    ]


def reference(hf, prompt: list[int], p: SamplingParams, eos: int) -> list[int]:
    """Greedy decoding with the processing applied in a plain loop over full forwards (vLLM's order: bias,
    min_tokens, repetition, frequency and presence)."""
    out: list[int] = []
    stops = list(p.stop_token_ids) + ([] if p.ignore_eos else [eos])
    while len(out) < p.max_tokens:
        with torch.no_grad():
            x = hf(torch.tensor([prompt + out])).logits[0, -1].float().clone()
        v = x.shape[0]
        for t, b in (p.logit_bias or {}).items():
            x[t] += b
        if len(out) < p.min_tokens:
            x[stops] = float("-inf")
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=v).to(torch.int32)
        seen = counts > 0
        in_prompt = torch.zeros(v, dtype=torch.bool)
        in_prompt[prompt] = True
        x = torch.where(seen | in_prompt, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
        x = x - p.frequency_penalty * counts.float() - p.presence_penalty * seen.float()
        tok = int(x.argmax())
        out.append(tok)
        if tok in stops:
            break
    return out


def engine(target, spec=None, **kw) -> Engine:
    return Engine(EngineConfig(model=str(target), device="cpu", speculative_config=spec, max_model_len=512, **kw))


@pytest.fixture(scope="module")
def plain(spec_models):  # noqa: F811
    eng = engine(spec_models["target"], kv_cache_tokens=128, max_prefill_tokens=32)
    eos = min(eng.scheduler.eos_token_ids)
    params = cases(eos)
    prompts = mixed_prompts(len(params))
    # greedy and seeded sampling (every other row with top-k) in one batch
    sampled = [replace(p, temperature=0.9, seed=i, top_k=50 if i % 2 else 0) for i, p in enumerate(params)]
    out = [o.token_ids for o in eng.generate(prompts + prompts, params + sampled)]
    assert eng.scheduler.num_preemptions > 0
    return eos, prompts, params, sampled, out


def test_greedy_equals_reference_loop(spec_models, plain, hf_models):  # noqa: F811
    eos, prompts, params, _, out = plain
    greedy = out[:len(params)]
    hf = hf_models["llama"]
    assert [reference(hf, pr, p, eos) for pr, p in zip(prompts, params)] == greedy
    # the processing changed something: without it the outputs differ (and min_tokens held EOS back exactly)
    unprocessed = engine(spec_models["target"]).generate(prompts, [SamplingParams(
        max_tokens=p.max_tokens, temperature=0.0, ignore_eos=p.ignore_eos) for p in params])
    differs = [o.token_ids != g for o, g in zip(unprocessed, greedy)]
    assert differs == [True, True, True, True, True, False, True]
    assert len(greedy[4]) == 7 and greedy[4][-1] == eos and eos not in greedy[4][:-1]


SPEC_CASES = [  # (method, num_steps, topk, num_draft_tokens); "self": the target drafts for itself, without the
    # processing, so its drafts are accepted until the processing changes the target's choice
    ("eagle", 3, 3, 6), ("eagle3", 3, 1, None), ("eagle3", 2, 3, 5), ("self", 3, 1, None), ("self", 3, 2, 5),
    ("ngram", 3, 1, None),
]


@pytest.mark.parametrize("method,steps,topk,ndt", SPEC_CASES, ids=[f"{c[0]}-s{c[1]}k{c[2]}" for c in SPEC_CASES])
def test_speculation_equals_no_speculation(spec_models, plain, method, steps, topk, ndt):  # noqa: F811
    eos, prompts, params, sampled, ref = plain
    model = {"ngram": None, "self": str(spec_models["target"])}.get(method, str(spec_models.get(method)))
    spec = SpeculativeConfig(method="draft" if method == "self" else method, model=model, num_steps=steps, topk=topk,
                             num_draft_tokens=ndt)
    eng = engine(spec_models["target"], spec, kv_cache_tokens=128, max_prefill_tokens=32)
    out = eng.generate(prompts + prompts, params + sampled)
    assert [o.token_ids for o in out] == ref  # greedy token-exact, seeded sampling equal
    assert all(o.spec["num_drafts"] > 0 for o in out)
    if method == "self":  # drafts both accepted and rejected under the processing
        accepted = sum(o.spec["num_accepted_tokens"] for o in out)
        assert 0 < accepted < sum(o.spec["num_draft_tokens"] for o in out)
