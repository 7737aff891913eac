"""DeepSeek-V3.2 with the indexer's keys in FP8 (``indexer_key_dtype="fp8"``): the cache writes the kernels' page
layout and the reference reads it back as the kernels' reference dequantizes it; on the tiny model's own indexer
inputs, FP8 scores are within 1% of each score's scale (sum_h |w_h| ||q_h|| ||k||) of the full-precision ones
and the selected top-4 sets overlap by at least 95%; the model's prompt logprobs stay close; speculation on == off holds with FP8 keys
(tree rounds move the FP8 keys and scales of accepted nodes); the Triton indexer (in Triton's interpreter) picks
what the reference picks from the cache's FP8 pages."""

from __future__ import annotations

import pytest
import torch

from attention import sparse_mla_ref
from deployments.engine.engine import Engine
from deployments.engine.request import SamplingParams
from deployments.make_tiny import make_tiny
from tests.helpers import mixed_prompts
from tests.kernels.interpreter import assert_interpreting, run_in_interpreter
from workers.config import EngineConfig, SpeculativeConfig
from workers.kernels.sparse_mla import dequantize_index_keys, indexer_scores_reference, quantize_index_keys
from workers.kv_cache import MLAKVCache

PROMPTS = mixed_prompts(6)  # 3 .. 64 tokens
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ds_mtp(tmp_path_factory):
    """The index_topk=4 tiny model (selection matters) with an MTP layer."""
    return make_tiny("deepseek_v32", tmp_path_factory.mktemp("ds_fp8") / "m", layers=2, hidden=64, vocab=512, heads=4,
                     max_position=1024, seed=3, deepseek={"index_topk": 4, "num_nextn_predict_layers": 1})


def ds_engine(path, keys: str, spec=None, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cpu", max_model_len=512, page_size=16, max_prefill_tokens=24,
                               indexer_key_dtype=keys, speculative_config=spec, **kw))


def test_fp8_cache_layout_is_the_kernels():
    """Keys stored at scattered slots give exactly ``quantize_index_keys`` of the whole cache (the Triton indexer's
    input), the reference's gather equals ``dequantize_index_keys`` (the kernels' reference), ``move`` carries keys
    and scales, and a token costs dim + 4 bytes (132 at dim 128, against 256 in bf16)."""
    g = torch.Generator().manual_seed(0)
    ps, pages, dim = 16, 5, 32
    cache = MLAKVCache(2, pages, ps, 8, dim, torch.float32, "cpu", index_fp8=True)
    keys = torch.randn(pages * ps, dim, generator=g) * torch.rand(pages * ps, 1, generator=g) * 4
    slots = torch.randperm(pages * ps, generator=g)
    cache.store(1, slots, torch.zeros(pages * ps, 8), keys[slots])
    assert torch.equal(cache.index_k[1], quantize_index_keys(keys, ps))
    deq = dequantize_index_keys(cache.index_k[1], ps, dim)
    assert (deq - keys).abs().max() <= 0.07 * keys.abs().max()  # e4m3: 3 mantissa bits, per-token scale
    at = torch.randint(0, pages * ps, (3, 7), generator=g)
    assert torch.equal(sparse_mla_ref.gather_index_keys(cache.index_k[1], at, ps, dim, fp8=True), deq[at])
    cache.move(torch.tensor([3, 40]), torch.tensor([70, 5]))
    moved = dequantize_index_keys(cache.index_k[1], ps, dim)
    assert torch.equal(moved[70], deq[3]) and torch.equal(moved[5], deq[40])
    bf16 = MLAKVCache.bytes_per_token(1, 576, 128, torch.bfloat16)
    assert MLAKVCache.bytes_per_token(1, 576, 128, torch.bfloat16, index_fp8=True) == bf16 - 256 + 132


def test_fp8_indexer_close_to_full_precision(ds_mtp):
    """Every indexer call of a plain run (prefill chunks and decodes, both layers), recomputed from FP8 keys: the
    scores within 1% of their scale, the selected top-4 sets overlapping >= 95% overall (measured: 0.46%, 98.0%)."""
    eng = ds_engine(ds_mtp, "auto")
    backend = eng.executor.worker.target.attn_backend
    calls = []

    def recording(q, w, index_k, table, row_req, row_len, page_size, topk, **kw):  # the reference, inputs kept
        calls.append((q.clone(), w.clone(), index_k.clone(), table.clone(), row_req.clone(), row_len.clone(),
                      page_size, topk, kw))
        return sparse_mla_ref.indexer_topk(q, w, index_k, table, row_req, row_len, page_size, topk, **kw)

    backend.indexer_topk = recording
    eng.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert len(calls) > 20
    same = total = 0
    worst = 0.0
    for q, w, keys, table, row_req, row_len, ps, topk, kw in calls:
        assert not kw.pop("fp8") and kw["tree_bits"] is None
        packed = quantize_index_keys(keys, ps)
        exact = indexer_scores_reference(q, w, keys, table, row_req, row_len, ps)
        fp8 = indexer_scores_reference(q, w, packed, table, row_req, row_len, ps, fp8=True)
        seen = exact > float("-inf")
        assert torch.equal(seen, fp8 > float("-inf"))
        # |error| <= sum_h |w_h| |q_h . (k8 - k)| <= sum_h |w_h| ||q_h|| ||k8 - k||, and e4m3 keeps ||k8 - k|| within
        # 2^-4 ||k||: each position's error over its scale sum_h |w_h| ||q_h|| ||k_t|| (not over the score itself,
        # which relu and signed head weights can bring near 0)
        t, slots = torch.arange(exact.shape[1]), table[row_req.long()].long()
        k_norm = keys.float().norm(dim=-1)[slots[:, t // ps] * ps + t % ps]  # [R, capacity]
        scale = (w.abs() * q.float().norm(dim=-1)).sum(-1, keepdim=True) * k_norm
        worst = max(worst, float(((fp8 - exact).abs() / scale.clamp_min(1e-12)).where(seen, 0).max()))
        a = sparse_mla_ref.indexer_topk(q, w, keys, table, row_req, row_len, ps, topk, **kw)
        b = sparse_mla_ref.indexer_topk(q, w, packed, table, row_req, row_len, ps, topk, fp8=True, **kw)
        for ra, rb in zip(a.tolist(), b.tolist()):
            sa, sb = {s for s in ra if s >= 0}, {s for s in rb if s >= 0}
            assert len(sa) == len(sb)
            same, total = same + len(sa & sb), total + len(sa)
    assert worst <= 0.01, worst  # (the bound is 2^-4; e4m3's errors average out over the key's 32 dims)
    assert same / total >= 0.95, same / total


def test_fp8_keys_logprobs_close(ds_mtp):
    """The model with FP8 keys: each prompt token's logprob (teacher-forced, so both runs see the same inputs) is
    the full-precision one exactly where the top-k sets agree and close on average (measured: 75% exact, mean
    |diff| 0.057 nats, max 1.16); FP8 keys only move the selection. (Greedy tokens are not compared: at top-4 of up to 76 near-tied tiny-model scores, a flipped
    selection changes some continuations.)"""
    logprobs = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    runs = {keys: ds_engine(ds_mtp, keys).generate(PROMPTS, logprobs) for keys in ("auto", "fp8")}
    diffs = torch.tensor([abs(x[0] - y[0]) for a, b in zip(runs["auto"], runs["fp8"])
                          for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])])
    assert diffs.numel() == sum(len(p) - 1 for p in PROMPTS)
    assert float((diffs < 1e-5).float().mean()) >= 0.5
    assert float(diffs.mean()) <= 0.15, diffs


@pytest.fixture(scope="module")
def fp8_plain(ds_mtp):
    return [o.token_ids for o in ds_engine(ds_mtp, "fp8").generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("topk,ndt", [(1, None), (2, 5)])
def test_fp8_keys_speculation_equals_plain_decoding(ds_mtp, fp8_plain, topk, ndt):
    """FP8 keys on both sides, MTP chain and tree."""
    plain = fp8_plain
    eng = ds_engine(ds_mtp, "fp8", SpeculativeConfig(method="mtp", num_steps=3, topk=topk, num_draft_tokens=ndt),
                    kv_cache_tokens=256, max_num_seqs=6)
    out = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in out] == plain
    assert eng.executor.worker.proposer.runner.kv_cache.index_fp8
    assert eng.allocator.num_free == eng.allocator.capacity_pages


def test_fp8_keys_refused_without_an_indexer(tmp_path):
    path = make_tiny("llama", tmp_path / "llama", layers=1, hidden=32, vocab=300, heads=2, kv_heads=1)
    with pytest.raises(ValueError, match="indexer_key_dtype fp8 is for DeepSeek-V3.2"):
        Engine(EngineConfig(model=str(path), device="cpu", indexer_key_dtype="fp8"))


def check_triton_on_fp8_cache() -> None:
    """(Run under the interpreter.) Keys stored by ``MLAKVCache`` at scattered slots, pages of 16 and 64: the Triton
    indexer's top-k equals the reference's."""
    from workers.kernels import sparse_mla as kernels

    assert_interpreting()
    g = torch.Generator().manual_seed(0)
    for ps in (16, 64):
        pages, dim, heads = 8, 32, 4
        cache = MLAKVCache(1, pages, ps, 8, dim, torch.float32, "cpu", index_fp8=True)
        cache.store(0, torch.randperm(pages * ps, generator=g), torch.zeros(pages * ps, 8),
                    torch.randn(pages * ps, dim, generator=g))
        table = torch.tensor([[3, 1, 6, 0], [2, 5, 7, 4]], dtype=torch.int32)
        row_req = torch.tensor([0, 0, 1, 1, 1], dtype=torch.int32)
        row_len = torch.tensor([3, 2 * ps + 5, 3 * ps + 1, 4 * ps, 7], dtype=torch.int32)
        q, w = torch.randn(5, heads, dim, generator=g), torch.randn(5, heads, generator=g)
        got = kernels.indexer_topk(q, w, cache.index_k[0], table, row_req, row_len, ps, 6, fp8=True)
        want = sparse_mla_ref.indexer_topk(q, w, cache.index_k[0], table, row_req, row_len, ps, 6, fp8=True)
        for r in range(5):
            assert {int(s) for s in got[r] if s >= 0} == {int(s) for s in want[r] if s >= 0}, (ps, r)
    print("fp8 keys ok")


def test_triton_indexer_reads_the_fp8_cache():
    pytest.importorskip("triton")
    run_in_interpreter(__name__, "fp8 keys ok", timeout=300)


if __name__ == "__main__":
    check_triton_on_fp8_cache()
