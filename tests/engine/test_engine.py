"""Engine core: greedy parity with transformers, paging, chunked prefill, preemption, sampling, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from deployments.engine.engine import Engine
from deployments.engine.request import InvalidRequest, SamplingParams
from tests.helpers import ROOT, hf_greedy, mixed_prompts, run_all
from workers.config import EngineConfig
from workers.model_config import CheckpointError

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def make_engine(path, **kw) -> Engine:
    kw.setdefault("max_model_len", 512)
    return Engine(EngineConfig(model=str(path), device="cpu", **kw))


@pytest.fixture(scope="module")
def hf_reference(tiny_models, hf_models):
    prompts = mixed_prompts(8)
    return prompts, {arch: [hf_greedy(hf_models[arch], p, GREEDY.max_tokens) for p in prompts] for arch in tiny_models}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_matches_transformers(tiny_models, hf_reference, arch, page_size):
    prompts, ref = hf_reference
    engine = make_engine(tiny_models[arch], page_size=page_size)
    out = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in out] == ref[arch]
    assert all(o.finish_reason in ("stop", "length") for o in out)
    assert engine.allocator.num_free == engine.allocator.capacity_pages  # every page came back


@pytest.mark.parametrize("page_size", [1, 16])
def test_preemption_and_chunked_prefill_keep_outputs(tiny_models, hf_reference, page_size):
    prompts, ref = hf_reference
    # room for ~2 requests at a time, prompts split into 16-token chunks
    engine = make_engine(tiny_models["llama"], page_size=page_size, kv_cache_tokens=160, max_prefill_tokens=16)
    out = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in out] == ref["llama"]
    assert engine.scheduler.num_preemptions > 0
    assert engine.allocator.num_free == engine.allocator.capacity_pages


def test_overlap_launches_ahead_and_changes_no_output(tiny_models):
    """Overlap: after the call that launched a DECODE step, that step is still unread on the worker; outputs
    (greedy and seeded sampling, max_tokens, EOS, stop ids, preemption, chunked prefill) equal the one-at-a-time
    schedule's, and every page comes back."""
    prompts = mixed_prompts(6)
    params = [SamplingParams(max_tokens=12 + 6 * i, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=i < 4)
              for i in range(6)]
    runs = {}
    for overlap in (True, False):
        engine = make_engine(tiny_models["qwen2"], page_size=4, kv_cache_tokens=112, max_prefill_tokens=16,
                             disable_overlap_schedule=not overlap)
        runs[overlap] = run_all(engine, prompts, params, overlap)
    # preemptions fall on other steps (a request sits out a step its in-flight token may end): batches differ,
    # and with them the float rounding of logprobs, not the tokens
    for a, b in zip(runs[True], runs[False]):
        assert (a.output_ids, a.finish_reason) == (b.output_ids, b.finish_reason)
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_models):
    engine = make_engine(tiny_models["qwen2"])
    prompts = mixed_prompts(4)
    sp = [SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=100 + i, ignore_eos=True) for i in range(4)]
    a = engine.generate(prompts, sp)
    b = engine.generate(prompts[::-1], sp[::-1])[::-1]  # other batch order
    c = engine.generate(prompts[:1], sp[:1])  # alone
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert a[0].token_ids == c[0].token_ids
    other = engine.generate(prompts[:1], [SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)])
    assert other[0].token_ids != a[0].token_ids

    def seeded(seed):
        return engine.generate(prompts[:1], [SamplingParams(max_tokens=16, temperature=1.0, seed=seed,
                                                            ignore_eos=True)])[0].token_ids

    # 64-bit seeds reach the sampler's 32 bits mixed, not folded: -1 and 0, 2**32 and 1 once gave the same tokens
    assert seeded(-1) != seeded(0) and seeded(2**32) != seeded(1) and seeded(-1) == seeded(-1)
    assert all(len(o.logprobs) == 16 and all(lp <= 0 for lp in o.logprobs) for o in a)


def test_a_stop_string_inside_a_speculative_run_ends_the_tokens_there(tiny_models):
    """A round can append several tokens at once. When a stop string ends inside them, the tokens after the one
    that completes it are not output (ids, logprobs, usage): the output is the same as without speculation."""
    from workers.config import SpeculativeConfig

    target = tiny_models["llama"]
    plain = make_engine(target)
    spec = make_engine(target, speculative_config=SpeculativeConfig(method="draft", model=str(target), num_steps=3))
    prompt = mixed_prompts(1)[0]
    free = plain.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    tok = plain.tokenizer
    cut_inside_a_run = 0
    for k in range(2, 14):  # the stop string: token k's own text (it may also occur earlier: then it ends there)
        piece = tok.decode(free.token_ids[: k + 1])[len(tok.decode(free.token_ids[:k])):]
        if not piece.strip():
            continue
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[piece], logprobs=2)
        a, b = plain.generate([prompt], params)[0], spec.generate([prompt], params)[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), (k, piece)
        assert len(b.logprobs) == len(b.token_ids) and b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
        cut_inside_a_run += len(a.token_ids) % 4 != 1  # (rounds of 4 accepted tokens after the prefill's one)
    assert cut_inside_a_run  # some stop strings did end inside a round's run


def test_filters_that_leave_one_token_equal_greedy(tiny_models):
    engine = make_engine(tiny_models["qwen3"])
    prompts = mixed_prompts(3)
    greedy = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    for sp in (SamplingParams(max_tokens=24, temperature=0.8, top_k=1, seed=1),
               SamplingParams(max_tokens=24, temperature=0.8, top_p=1e-6, seed=2),
               SamplingParams(max_tokens=24, temperature=0.8, min_p=1.0, seed=3)):
        assert [o.token_ids for o in engine.generate(prompts, sp)] == greedy


def test_stop_conditions(tiny_models):
    engine = make_engine(tiny_models["llama"])
    prompt = mixed_prompts(1)[0]
    free = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert len(free.token_ids) == 12 and free.finish_reason == "length"
    stop_tok = free.token_ids[5]
    first = free.token_ids.index(stop_tok)
    by_id = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                     stop_token_ids=[stop_tok]))[0]
    assert by_id.token_ids == free.token_ids[: first + 1] and by_id.finish_reason == "stop"
    # the stop token counts but its text is not output (as vLLM), so the text is the tokens' before it
    assert by_id.text == engine.tokenizer.decode(free.token_ids[:first], skip_special_tokens=True), by_id.text
    text = free.text
    if len(text.strip()) >= 4:
        stop = text.strip()[1:3]
        by_str = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                          stop=[stop]))[0]
        assert by_str.finish_reason == "stop"
        assert by_str.text == text[: text.index(stop)]


def test_bad_input_is_rejected_and_others_keep_going(tiny_models):
    engine = make_engine(tiny_models["llama"], max_model_len=128)
    good = mixed_prompts(2)
    prompts = [good[0], [], list(range(4, 200)), good[1]]
    params = [GREEDY, GREEDY, GREEDY, GREEDY]
    out = engine.generate(prompts, params)
    assert out[1].error == "the prompt is empty"
    assert "maximum context length is 128" in out[2].error
    alone = engine.generate([good[0], good[1]], GREEDY)
    assert out[0].token_ids == alone[0].token_ids and out[3].token_ids == alone[1].token_ids
    with pytest.raises(InvalidRequest, match="max_tokens must be an integer >= 1"):
        engine.add_request(good[0], SamplingParams(max_tokens=0))
    with pytest.raises(InvalidRequest, match="token ids must be in"):
        engine.add_request([10**6], GREEDY)
    with pytest.raises(InvalidRequest, match="temperature"):
        engine.add_request(good[0], SamplingParams(temperature=-1))
    for bad in ([10**9], [-1]):  # a stop id no step could emit is a mistake, not a no-op
        with pytest.raises(InvalidRequest, match="stop_token_ids must be token ids") as e:
            engine.add_request(good[0], SamplingParams(stop_token_ids=bad))
        assert e.value.param == "stop_token_ids"
    assert not engine.has_work()
    assert engine.allocator.num_free == engine.allocator.capacity_pages


def test_abort_frees_kv_and_keeps_others(tiny_models):
    engine = make_engine(tiny_models["qwen2"], page_size=4)
    prompts = mixed_prompts(3)
    reqs = [engine.add_request(p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)) for p in prompts]
    for _ in range(4):
        engine.step()
    held = len(reqs[1].pages)
    assert held > 0
    free_before = engine.allocator.num_free
    assert engine.abort(reqs[1].rid)
    assert engine.allocator.num_free == free_before + held
    while engine.has_work():
        engine.step()
    ref = engine.generate([prompts[0], prompts[2]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    assert reqs[0].output_ids == ref[0].token_ids and reqs[2].output_ids == ref[1].token_ids
    assert reqs[1].finish_reason == "abort"


def test_checkpoint_errors(tiny_models, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        make_engine(tmp_path / "nope")
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((tiny_models["llama"] / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported architecture 'MambaForCausalLM'"):
        make_engine(bad)
    cfg["architectures"] = ["LlamaForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        make_engine(bad)


def test_sampler_draws_from_the_processed_distribution():
    """Both race paths: a batch with a top-k row (kind "filter") and one with temperatures only ("sample"); the draws
    follow softmax(logits / T) restricted and renormalised as ``processed_probs`` says (chi-square, false alarm rate
    1e-4 each); a row that does not filter draws the same tokens in either batch."""
    from scipy.stats import chisquare

    from workers.sampling import SamplingTensors, draw, processed_probs

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 20000
    for top_k, kept in ((4, 4), (0, 6)):
        p = SamplingTensors.from_lists([0.7] * n, [top_k] * n, [1.0] * n, [0.0] * n, [11] * n, list(range(n)), "cpu")
        assert p.kind == ("filter" if top_k else "sample")
        probs = processed_probs(logits.expand(n, -1), p)
        assert probs[0, kept:].sum() == 0  # top-k 4 removed the tail (kept = 6: nothing to remove)
        draws = draw(logits.expand(n, -1), p)
        counts = torch.bincount(draws, minlength=6)[:kept].double()
        expected = probs[0, :kept].double() / probs[0, :kept].double().sum() * n
        assert counts.sum() == n and chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-4
    # the unfiltered rows of a mixed batch race exactly what a batch of only them races
    mixed = SamplingTensors.from_lists([0.7] * 8, [0, 3] * 4, [1.0] * 8, [0.0] * 8, list(range(8)), [5] * 8, "cpu")
    alone = SamplingTensors.from_lists([0.7] * 4, [0] * 4, [1.0] * 4, [0.0] * 4, [0, 2, 4, 6], [5] * 4, "cpu")
    wide = torch.randn(8, 300)
    assert torch.equal(draw(wide, mixed)[0::2], draw(wide[0::2], alone))


def test_processed_distribution_matches_hf_warpers():
    """temperature → top-k → top-p → min-p as HF transformers' logits warpers apply them (top-p over the top-k
    survivors renormalised; an earlier version took top-p of the whole distribution, which keeps more tokens).
    Where top-p's last token is tied with others, HF keeps those of them its sort happens to put first; we keep
    every one of them (as a threshold on the value does, as FlashInfer's top-p does), and nothing else differs."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from workers.sampling import SamplingTensors, processed_probs

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 500, generator=g) * 3
    # bf16 logits (as a bf16 model's) have ties; each of these rows takes a k whose k-th token is tied with the
    # next one, which HF keeps too
    tied = (torch.randn(4, 500, generator=g) * 0.25).bfloat16().float()
    desc = tied.sort(dim=-1, descending=True).values
    k_tied = [next(k for k in range(5, 500) if desc[i, k - 1] == desc[i, k]) for i in range(4)]
    logits = torch.cat([logits, tied])
    settings = [(0.7, 50, 0.9, 0.0), (1.0, 20, 0.5, 0.0), (0.6, 0, 0.9, 0.0), (1.3, 8, 1.0, 0.0), (0.9, 40, 0.8, 0.05),
                (1.0, 0, 1.0, 0.1)] + [(t, k, top_p, 0.0) for t, k, top_p in zip((1.0, 1.0, 0.7, 1.0), k_tied,
                                                                                 (1.0, 0.9, 0.95, 1.0))]
    p = SamplingTensors.from_lists(*[list(c) for c in zip(*settings)], [0] * 10, [0] * 10, "cpu")
    ours = processed_probs(logits, p)
    differs_from_whole_top_p, ties_at_top_p = False, 0
    for i, (t, k, top_p, min_p) in enumerate(settings):
        scores = logits[i:i + 1].clone()
        for warper in [TemperatureLogitsWarper(t)] + ([TopKLogitsWarper(k)] if k else []) + \
                ([TopPLogitsWarper(top_p)] if top_p < 1 else []) + ([MinPLogitsWarper(min_p)] if min_p else []):
            scores = warper(None, scores)
        hf = torch.softmax(scores, -1)[0]
        extra = (ours[i] > 0) & (hf == 0)
        assert not ((hf > 0) & (ours[i] == 0)).any(), i  # never fewer tokens than HF
        if extra.any():  # only top-p's boundary ties: the same logit as the smallest HF keeps
            ties_at_top_p += 1
            assert top_p < 1 and torch.all(logits[i][extra] == logits[i][hf > 0].min()), i
            torch.testing.assert_close(ours[i] * (hf > 0) / (ours[i] * (hf > 0)).sum(), hf, atol=1e-6, rtol=1e-5)
            continue
        torch.testing.assert_close(ours[i], hf, atol=1e-6, rtol=1e-5)
        if k and top_p < 1:  # this case tells the two top-p readings apart
            whole = torch.softmax(logits[i] / t, -1).sort(descending=True).values
            differs_from_whole_top_p |= int(((whole.cumsum(0) - whole) < top_p)[:k].sum()) != int((hf > 0).sum())
    assert differs_from_whole_top_p and ties_at_top_p == 1  # (row 7 of this data)
    assert all(int((ours[i] > 0).sum()) > k for i, k in zip(range(6, 10), k_tied) if settings[i][2] == 1.0)


def test_cli_generate_json(tiny_models):
    out = subprocess.run(
        [sys.executable, "-m", "deployments.cli", "generate", "--model", str(tiny_models["qwen3"]), "--prompt",
         "def main():", "--prompt", "import os", "--max-tokens", "8", "--json", "--device", "cpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    lines = [json.loads(x) for x in out.stdout.strip().splitlines()]
    assert len(lines) == 2
    for obj in lines:
        assert set(obj) >= {"text", "token_ids", "finish_reason"}
        assert 1 <= len(obj["token_ids"]) <= 8
    bad = subprocess.run([sys.executable, "-m", "deployments.cli", "generate", "--model", "/nonexistent", "--prompt",
                          "x"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "does not exist" in bad.stderr


def test_out_of_range_sampling_params(tiny_models):
    engine = make_engine(tiny_models["llama"])
    prompt = mixed_prompts(1)[0]
    with pytest.raises(InvalidRequest, match="seed must fit in 64 bits"):
        engine.add_request(prompt, SamplingParams(seed=2**70))
    with pytest.raises(InvalidRequest, match="temperature must be a finite number"):
        engine.add_request(prompt, SamplingParams(temperature=float("nan")))
    big = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.7, top_k=10**9, seed=2**62))[0]
    assert len(big.token_ids) >= 1 and big.error is None  # top_k past the vocabulary is no filter


def test_a_failing_step_fails_only_its_requests(tiny_models):
    """Fault injection: the worker raises in one step, while the step before it is still in flight (overlap) or
    not; that step's requests end with an error, their KV is freed, the earlier step's tokens still arrive, and the
    engine serves the next requests. A failure to reach the workers at all fails every launched step."""
    for overlap in (True, False):
        engine = make_engine(tiny_models["qwen3"], page_size=4, disable_overlap_schedule=not overlap)
        assert engine.overlap is overlap
        worker = engine.executor.worker
        real_launch = worker._launch
        launches = {"n": 0}

        def flaky(step):
            launches["n"] += 1
            if launches["n"] == 4:  # the third DECODE step (after the prefill)
                raise RuntimeError("injected worker failure")
            return real_launch(step)

        worker._launch = flaky
        first = engine.generate(mixed_prompts(2), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        assert all(o.finish_reason == "error" and "injected worker failure" in o.error for o in first)
        assert all(len(o.token_ids) == 3 for o in first)  # prefill + 2 DECODE steps landed before the failure
        assert engine.allocator.num_free == engine.allocator.capacity_pages
        assert not engine.in_flight and not worker._launched
        again = engine.generate(mixed_prompts(2), GREEDY)
        assert all(o.finish_reason in ("stop", "length") and o.token_ids for o in again)

        real_step = engine.executor.step
        calls = {"n": 0}

        def unreachable(step, keep):
            calls["n"] += 1
            if calls["n"] == 3:
                raise ConnectionError("injected transport failure")
            return real_step(step, keep)

        engine.executor.step = unreachable
        lost = engine.generate(mixed_prompts(2), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        assert all(o.finish_reason == "error" and "injected transport failure" in o.error for o in lost)
        assert engine.allocator.num_free == engine.allocator.capacity_pages and not engine.in_flight
        assert not worker._launched  # drained: a result held there would be taken for a later step's
        assert all(o.token_ids for o in engine.generate(mixed_prompts(2), GREEDY))

        calls["n"] = 0

        def out_of_step(step, keep):  # a result that is not the one the engine expects next
            calls["n"] += 1
            results = real_step(step, keep)
            if calls["n"] == 3:
                for r in results:
                    r.step_id += 1000
            return results

        engine.executor.step = out_of_step
        lost = engine.generate(mixed_prompts(2), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        assert all(o.finish_reason == "error" and "answered step" in o.error for o in lost)
        assert engine.allocator.num_free == engine.allocator.capacity_pages and not engine.in_flight
        assert not worker._launched
        engine.executor.step = real_step
        assert all(o.token_ids for o in engine.generate(mixed_prompts(2), GREEDY))


@pytest.mark.parametrize("stream", [True, False], ids=["decode_stream", "window"])
def test_incremental_detokenizer_matches_full_decode(stream):
    """Deltas from any chunking (1-5 tokens, splitting multi-byte characters) add up to the full decode, and a stop
    string cuts the text right before it; with the tokenizers library's DecodeStream (the default) and with the
    window of ids decoded again (its fallback)."""
    import random

    from deployments.engine.tokenizer import Detokenizer, load_tokenizer

    tok = load_tokenizer(str(ROOT / "models" / "specserve-tiny"))
    text = (ROOT / "deployments" / "engine" / "scheduler.py").read_text()[:2000] + "héllo wörld — ünïcode ✓ 日本語 🙂 end"
    ids = tok(text).input_ids
    full = tok.decode(ids, skip_special_tokens=True)
    if stream:
        assert Detokenizer(tok, [])._stream is not None
    else:  # the fast path, checked against decode
        assert Detokenizer(tok, [], stream=False)._decode.func == tok.backend_tokenizer.decode
    rng = random.Random(0)
    for _ in range(10):
        d, out, i = Detokenizer(tok, [], stream), "", 0
        while i < len(ids):
            n = rng.randint(1, 5)
            delta, _ = d.push(ids[i:i + n], final=i + n >= len(ids))
            out, i = out + delta, i + n
        assert out == full
    # a text that ends inside a multi-byte character: the final push emits what decode gives (replacement chars)
    emoji = tok("ab 🙂", add_special_tokens=False).input_ids
    cut = next(k for k in range(len(emoji) - 1, 0, -1) if "\ufffd" in tok.decode(emoji[:k]))
    d = Detokenizer(tok, [], stream)
    out = "".join(d.push([t], final=j == cut - 1)[0] for j, t in enumerate(emoji[:cut]))
    assert out == tok.decode(emoji[:cut], skip_special_tokens=True) and "\ufffd" in out
    d, out = Detokenizer(tok, ["OutOfPages"], stream), ""
    for j in range(0, len(ids), 3):
        delta, hit = d.push(ids[j:j + 3], final=False)
        out += delta
        if hit:
            break
    assert hit and out == full[: full.index("OutOfPages")] == d.text
    # stop strings cut at the earliest match of any of them, whatever the chunking; a prefix that is held back and
    # then does not complete a match is emitted; per step only a short window is decoded again
    for trial in range(20):
        a = rng.randrange(100, len(full) - 40)
        stops = [full[a:a + rng.randint(2, 12)], full[rng.randrange(len(full) - 5):][:4] + "\u2603", "never here"]
        first = min(i for i in (full.find(s) for s in stops) if i >= 0)
        d, out, i, hit = Detokenizer(tok, stops, stream), "", 0, False
        while i < len(ids) and not hit:
            n = rng.randint(1, 4)
            delta, hit = d.push(ids[i:i + n], final=i + n >= len(ids))
            out, i = out + delta, i + n
            assert len(d._unsent) <= 16 and (stream or len(d._window) <= 16)
        assert hit and out == full[:first] == d.text, (trial, stops)
    d, out = Detokenizer(tok, ["never here", "end!"], stream), ""
    for i in range(len(ids)):
        delta, hit = d.push(ids[i:i + 1], final=i == len(ids) - 1)
        out += delta
        assert not hit
    assert out == full  # "end" was held back at the end as the start of "end!", and the final push emits it
    # min_tokens (vLLM's rule): no stop string ends the output before it has more than min_tokens tokens
    stop = full[10:13]
    k = next(j for j in range(1, len(ids)) if stop in tok.decode(ids[:j], skip_special_tokens=True))
    for min_tokens, ends_at_first in ((0, True), (k, False)):
        d, out = Detokenizer(tok, [stop], stream, min_tokens=min_tokens), ""
        for i in range(len(ids)):
            delta, hit = d.push(ids[i:i + 1], final=i == len(ids) - 1)
            out += delta
            if hit:
                break
        assert hit and (out == full[:10]) == ends_at_first and len(out) >= 10, (min_tokens, out[:40])


def test_freeze_startup_heap_keeps_collecting_new_garbage():
    """After the start-up heap is frozen, full collections skip it, and cycles created later are still collected."""
    import gc
    import weakref

    from deployments.engine.engine import freeze_startup_heap

    class Node:
        pass

    old = Node()
    old.self = old  # a cycle from "start-up"
    old_ref = weakref.ref(old)
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
        del old
        new = Node()
        new.self = new
        new_ref = weakref.ref(new)
        del new
        gc.collect()
        assert new_ref() is None  # garbage made after the freeze is collected
        assert old_ref() is not None  # the frozen cycle is not scanned
    finally:
        gc.unfreeze()
    gc.collect()
    assert old_ref() is None  # back with the collector once unfrozen


def test_tune_gc_for_steps_leaves_a_steps_transient_objects_alone():
    """The engine core's collector: a step's objects alive at once (1,300 here, as at 256 requests) and freed by
    their reference counts start no collection each step, while the interpreter's default starts one every step."""
    import gc

    from deployments.engine import STEP_GC_THRESHOLD, tune_gc_for_steps

    saved = gc.get_threshold()
    started: list[int] = []

    def count(phase, info):
        if phase == "start":
            started.append(info["generation"])

    def steps(n: int = 30) -> int:
        gc.collect()
        started.clear()
        gc.callbacks.append(count)
        try:
            for _ in range(n):
                transient = [[i] for i in range(1300)]
                del transient
        finally:
            gc.callbacks.remove(count)
        return len(started)

    try:
        assert steps() >= 30  # (the default: 700)
        tune_gc_for_steps()
        assert gc.get_threshold() == (STEP_GC_THRESHOLD, *saved[1:])
        assert steps() == 0
    finally:
        gc.set_threshold(*saved)


def test_sampling_reads_16_bit_logits_as_their_fp32_values():
    """Logits stay in the model's dtype (no fp32 copy of [T, vocab]): greedy, temperature-only and filtering rows
    draw the same tokens with the same logprobs from bf16 logits as from the same values widened to fp32."""
    from workers.sampling import SamplingTensors, sample

    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 3000, generator=g) * 2).bfloat16()
    p = SamplingTensors.from_lists([0.0, 0.8, 0.8, 1.2, 0.7, 0.9], [0, 0, 40, 0, 0, 5], [1.0, 1.0, 0.9, 0.8, 1.0, 0.5],
                                   [0.0, 0.0, 0.0, 0.0, 0.1, 0.0], list(range(6)), [3] * 6, "cpu")
    assert p.kind == "filter"
    ids16, lp16 = sample(logits, p)
    ids32, lp32 = sample(logits.float(), p)
    assert torch.equal(ids16, ids32) and torch.equal(lp16, lp32) and lp16.dtype == torch.float32
    q = SamplingTensors.from_lists([0.8] * 6, [0] * 6, [1.0] * 6, [0.0] * 6, list(range(6)), [3] * 6, "cpu")
    assert q.kind == "sample" and torch.equal(sample(logits, q)[0], sample(logits.float(), q)[0])
