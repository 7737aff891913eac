"""Speculative decoding: lossless greedy for every proposer and tree shape, sampling keeps the target distribution,
acceptance sanity, and the EAGLE draft state matches a one-shot recompute."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from deployments.engine.engine import Engine
from deployments.engine.request import SamplingParams
from deployments.make_heads import make_head
from deployments.make_tiny import make_tiny
from tests.helpers import ROOT, mixed_prompts, run_all
from workers.config import EngineConfig, SpeculativeConfig

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def spec_models(tiny_models, tmp_path_factory):
    base = tmp_path_factory.mktemp("spec")
    target = tiny_models["llama"]
    return {
        "target": target,
        "eagle": make_head("eagle", target, base / "eagle", seed=1),
        "eagle3": make_head("eagle3", target, base / "eagle3", seed=2, draft_vocab=200),
        "draft": make_tiny("llama", base / "draft", layers=1, hidden=64, vocab=512, max_position=1024, seed=5,
                           tokenizer_from=str(target)),
    }


def engine(target, spec: SpeculativeConfig | None = None, **kw) -> Engine:
    kw.setdefault("max_model_len", 512)
    return Engine(EngineConfig(model=str(target), device="cpu", speculative_config=spec, **kw))


@pytest.fixture(scope="module")
def baseline(spec_models):
    prompts = mixed_prompts(8)
    return prompts, [o.token_ids for o in engine(spec_models["target"]).generate(prompts, GREEDY)]


CASES = [  # (method, num_steps, topk, num_draft_tokens)
    ("eagle", 3, 1, None), ("eagle", 3, 3, 6),
    ("eagle3", 3, 1, None), ("eagle3", 2, 3, 5),
    ("draft", 3, 1, None), ("draft", 3, 2, 5),
    ("ngram", 3, 1, None),
    ("naive", 1, 1, None),
]


@pytest.mark.parametrize("method,steps,topk,ndt", CASES, ids=[f"{c[0]}-s{c[1]}k{c[2]}" for c in CASES])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_equals_no_speculation_with_preemption(spec_models, baseline, method, steps, topk, ndt, page_size):
    prompts, ref = baseline
    spec = SpeculativeConfig(method=method, model=None if method == "ngram" else str(spec_models[
        "eagle" if method == "naive" else method]), num_steps=steps, topk=topk, num_draft_tokens=ndt)
    eng = engine(spec_models["target"], spec, page_size=page_size, kv_cache_tokens=128, max_prefill_tokens=32)
    out = eng.generate(prompts, GREEDY)
    assert [o.token_ids for o in out] == ref
    assert eng.scheduler.num_preemptions > 0
    assert eng.allocator.num_free == eng.allocator.capacity_pages
    for o in out:
        s = o.spec
        assert s["num_drafts"] > 0 and s["num_draft_tokens"] == s["num_drafts"] * (spec.num_draft_tokens - 1)
        assert 1.0 <= s["accept_length"] <= spec.num_steps + 1


@pytest.mark.parametrize("method", ["eagle3", "eagle", "draft"])
def test_bf16_chains_run(spec_models, method):
    """16-bit models: a top-1 chain drafts from the raw logits (no log-softmax) and keeps them as its state; every
    round completes (a dtype slip there failed on the GPU), with plausible acceptance counts."""
    spec = SpeculativeConfig(method=method, model=str(spec_models[method]), num_steps=3)
    eng = engine(spec_models["target"], spec, dtype="bfloat16")
    out = eng.generate(mixed_prompts(3), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for o in out:
        assert len(o.token_ids) == 12 and o.spec["num_drafts"] > 0
        assert 1.0 <= o.spec["accept_length"] <= spec.num_draft_tokens


@pytest.mark.parametrize("method", ["eagle", "eagle3", "draft"])
def test_chain_fast_path_drafts_what_the_tree_path_drafts(spec_models, method, monkeypatch):
    """Top-1 chains skip the log-softmax, the top-k and the tree bookkeeping; with 5 steps (features carried
    through 4 of them) every proposed chain equals what the general tree path proposes for top-1."""
    from speculative.proposers import _ModelProposer

    def trees(chain: bool) -> list:
        monkeypatch.setattr(_ModelProposer, "chain", property(lambda self: chain))
        eng = engine(spec_models["target"], SpeculativeConfig(method=method, model=str(spec_models[method]),
                                                             num_steps=5))
        proposer, seen = eng.executor.worker.proposer, []
        propose = proposer.propose
        monkeypatch.setattr(proposer, "propose", lambda inp: seen.append(propose(inp)) or seen[-1])
        eng.generate(mixed_prompts(3), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        return [t.tokens.tolist() for t in seen]

    fast, general = trees(True), trees(False)
    assert len(fast) > 5 and fast == general


def test_identical_draft_accepts_everything(spec_models):
    spec = SpeculativeConfig(method="draft", model=str(spec_models["target"]), num_steps=3)
    out = engine(spec_models["target"], spec).generate(mixed_prompts(4), SamplingParams(
        max_tokens=33, temperature=0.0, ignore_eos=True))
    for o in out:  # 33 tokens = 1 from prefill + 8 rounds of 4
        assert o.spec["accept_length"] == spec.num_draft_tokens
        assert o.spec["accepted_per_position"] == [o.spec["num_drafts"]] * 3


@pytest.mark.parametrize("method,steps,topk,ndt", [("eagle3", 3, 1, None), ("eagle", 3, 3, 6), ("draft", 3, 2, 5)])
def test_overlapped_rounds_equal_rounds_one_at_a_time(spec_models, method, steps, topk, ndt):
    """Overlap schedule with speculation: a round is launched before the previous round's accept lengths reach the
    host (the worker adds them on the device); greedy and seeded sampled tokens, max_tokens cut-offs, preemption
    and the freed pages are as when each round is read before the next."""
    spec = SpeculativeConfig(method=method, model=str(spec_models[method]), num_steps=steps, topk=topk,
                             num_draft_tokens=ndt)
    prompts = mixed_prompts(6)
    params = [SamplingParams(max_tokens=9 + 7 * i, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
              for i in range(6)]
    runs = {}
    for overlap in (True, False):
        eng = engine(spec_models["target"], spec, page_size=4, kv_cache_tokens=200, max_prefill_tokens=16,
                     disable_overlap_schedule=not overlap)
        reqs = run_all(eng, prompts, params, overlap)
        assert [len(r.output_ids) for r in reqs] == [sp.max_tokens for sp in params]
        runs[overlap] = [r.output_ids for r in reqs]
    assert runs[True] == runs[False]


def test_ngram_on_repetitive_prompt(spec_models):
    spec = SpeculativeConfig(method="ngram", num_steps=4)
    pattern = [11, 12, 13, 14, 15, 16, 17, 18]
    eng = engine(spec_models["target"], spec)
    # the tiny random model repeats whatever cycle it falls into; ngram finds it in the request's own tokens
    out = eng.generate([pattern * 6], SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))[0]
    assert out.spec["accept_length"] > 1.5, out.spec


def test_eagle_state_matches_one_shot_recompute(spec_models):
    """After several rounds (chunked prefill, tree drafts, paged KV, accepted-KV compaction), the EAGLE-3 head's
    top-k for the next token must equal what a fresh engine computes from a single prefill of the same tokens."""
    spec = SpeculativeConfig(method="eagle3", model=str(spec_models["eagle3"]), num_steps=3, topk=2,
                             num_draft_tokens=5)
    prompt = mixed_prompts(4)[3]
    # one step at a time: with the overlap schedule the head's state would already be a round past the host's tokens
    eng = engine(spec_models["target"], spec, page_size=4, max_prefill_tokens=16, disable_overlap_schedule=True)
    req = eng.add_request(prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    while len(req.output_ids) < 12:
        eng.step()
    proposer = eng.executor.worker.proposer
    incremental = (proposer.state_ids[req.req_slot].clone(), proposer.state_logp[req.req_slot].clone())
    fresh = engine(spec_models["target"], spec, page_size=4)
    r2 = fresh.add_request(req.all_ids[:-1], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while fresh.has_work():  # one prefill, in request slot 0 (the first free slot); read on the next call
        fresh.step()
    assert r2.finished and fresh.num_steps == 1
    slot = 0
    p2 = fresh.executor.worker.proposer
    assert r2.output_ids == [req.all_ids[-1]]
    assert torch.equal(p2.state_ids[slot], incremental[0])
    torch.testing.assert_close(p2.state_logp[slot], incremental[1], atol=1e-4, rtol=1e-4)


def _target_triple_probs(target, prompt, vocab, temperature):
    """Exact P(t1, t2, t3 | prompt) of the target at a temperature, from transformers."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = torch.softmax(m(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        p2 = torch.softmax(m(torch.tensor([prompt + [a] for a in range(vocab)])).logits[:, -1] / temperature, -1)
        seqs = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
        p3 = torch.softmax(m(seqs).logits[:, -1] / temperature, -1).view(vocab, vocab, vocab)
    return (p1[:, None, None] * p2[:, :, None] * p3).double()


@pytest.mark.parametrize("topk,ndt", [(1, None), (2, 4)], ids=["chain", "tree"])
def test_sampling_keeps_target_distribution(tmp_path_factory, topk, ndt):
    """χ² goodness of fit of (t1, t2, t3) sampled with speculation against the exact target distribution: t1 comes
    from prefill, t2 from a round's root, t3 from a drafted node whenever the draft was accepted. False-alarm rate
    of the test: 1e-3."""
    from scipy.stats import chisquare

    base = tmp_path_factory.mktemp("smallvocab")
    tok_src = make_tiny("llama", base / "tok", layers=1, hidden=32, vocab=300)
    target = make_tiny("llama", base / "t", layers=2, hidden=32, vocab=8, tokenizer_from=str(tok_src), seed=3,
                       init_std=0.6)
    draft = make_tiny("llama", base / "d", layers=1, hidden=32, vocab=8, tokenizer_from=str(tok_src), seed=4,
                      init_std=0.6)
    prompt, n, temp = [1, 5, 2], 3000, 1.0
    spec = SpeculativeConfig(method="draft", model=str(draft), num_steps=2, topk=topk, num_draft_tokens=ndt)
    eng = engine(target, spec, max_num_seqs=512, max_queue_len=n)
    params = [SamplingParams(max_tokens=3, temperature=temp, ignore_eos=True, seed=i) for i in range(n)]
    out = eng.generate([prompt] * n, params)
    counts = torch.zeros(8, 8, 8, dtype=torch.float64)
    for o in out:
        counts[o.token_ids[0], o.token_ids[1], o.token_ids[2]] += 1
    probs = _target_triple_probs(target, prompt, 8, temp)
    keep = probs.flatten() * n >= 5  # χ² needs enough expected counts; pool the rest
    obs = torch.cat([counts.flatten()[keep], counts.flatten()[~keep].sum(0, keepdim=True)])
    exp = torch.cat([probs.flatten()[keep], probs.flatten()[~keep].sum(0, keepdim=True)])
    exp = exp / exp.sum() * n
    assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3
    longer = eng.generate([prompt] * 200, [SamplingParams(max_tokens=8, temperature=temp, ignore_eos=True, seed=i)
                                           for i in range(200)])
    assert sum(o.spec["num_accepted_tokens"] for o in longer) > 0  # speculation does accept drafts here
    # seeded requests produce the very same tokens with speculation off (same noise per output position)
    plain = engine(target, max_num_seqs=512, max_queue_len=n).generate([prompt] * 200, params[:200])
    assert [o.token_ids for o in plain] == [o.token_ids for o in out[:200]]


def test_cli_generate_with_speculation(spec_models):
    res = subprocess.run(
        [sys.executable, "-m", "deployments.cli", "generate", "--model", str(spec_models["target"]), "--device", "cpu",
         "--prompt", "def f(x):", "--max-tokens", "12", "--ignore-eos", "--spec", "eagle3", "--draft",
         str(spec_models["eagle3"]), "--num-steps", "2", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    obj = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(obj["token_ids"]) == 12 and obj["spec"]["num_drafts"] > 0 and obj["spec"]["accept_length"] >= 1
    plain = subprocess.run(
        [sys.executable, "-m", "deployments.cli", "generate", "--model", str(spec_models["target"]), "--device", "cpu",
         "--prompt", "def f(x):", "--max-tokens", "12", "--ignore-eos", "--spec", "ngram"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0 and "accept length" in plain.stderr


def test_simulated_acceptance_is_benchmark_only(spec_models):
    assert SpeculativeConfig(method="eagle3", model="x").simulated_accept_length is None  # off by default
    spec = SpeculativeConfig(method="eagle3", model=str(spec_models["eagle3"]), num_steps=3,
                             simulated_accept_length=3.0)
    out = engine(spec_models["target"], spec).generate(mixed_prompts(4), SamplingParams(
        max_tokens=200, temperature=0.0, ignore_eos=True))
    drafts = sum(o.spec["num_drafts"] for o in out)
    accepted = sum(o.spec["num_accepted_tokens"] for o in out)
    assert 2.7 < 1 + accepted / drafts < 3.3
    assert all(o.spec["simulated"] for o in out)


def test_tree_sizes_past_the_bitmask_are_refused_by_the_config():
    from workers.config import MAX_TREE_BLOCK, SpeculativeConfig

    SpeculativeConfig(method="eagle3", model="head", num_steps=6, topk=10, num_draft_tokens=20)  # 61 positions
    with pytest.raises(ValueError, match=f"exceeds {MAX_TREE_BLOCK}"):
        SpeculativeConfig(method="eagle3", model="head", num_steps=8, topk=8, num_draft_tokens=20)  # 65
