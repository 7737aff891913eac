"""DeepSeek-V3.2 (MLA + lightning indexer top-k): greedy tokens equal transformers' DeepseekV32ForCausalLM in fp32,
with the indexer's top-k below the context (selection matters) and above it (dense), and under YaRN rope scaling
(the released checkpoints' and one with every YaRN term away from its default); the kernel interface's
reference against a brute-force loop (tree blocks included); MoE checkpoints refused naming the field."""

from __future__ import annotations

import json

import pytest
import torch

from attention.sparse_mla_ref import indexer_topk, sparse_mla
from deployments.engine.engine import Engine
from deployments.engine.request import SamplingParams
from deployments.make_tiny import DEEPSEEK_YARN, make_tiny
from tests.helpers import hf_greedy, mixed_prompts
from workers.config import EngineConfig
from workers.model_config import CheckpointError, ModelConfig

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = mixed_prompts(6)  # 3 .. 64 tokens


@pytest.fixture(scope="module")
def ds_models(tmp_path_factory):
    """The same weights (same seed and shapes) with the indexer keeping 4 tokens, and keeping all of them."""
    base = tmp_path_factory.mktemp("ds")
    return {topk: make_tiny("deepseek_v32", base / f"topk{topk}", layers=2, hidden=64, vocab=512, heads=4,
                            max_position=1024, seed=3, deepseek={"index_topk": topk}) for topk in (4, 2048)}


@pytest.fixture(scope="module")
def hf_reference(ds_models):
    from transformers import AutoModelForCausalLM

    out = {}
    for topk, path in ds_models.items():
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out[topk] = [hf_greedy(m, p, GREEDY.max_tokens) for p in PROMPTS]
    return out


def ds_engine(path, **kw) -> Engine:
    kw.setdefault("max_model_len", 512)
    return Engine(EngineConfig(model=str(path), device="cpu", **kw))


def test_selection_matters(hf_reference):
    """The sparse checkpoint's greedy tokens differ from the dense one's: the parity below tests the selection."""
    assert hf_reference[4] != hf_reference[2048]


@pytest.mark.parametrize("topk", [4, 2048])
@pytest.mark.parametrize("page_size,chunk", [(64, 512), (16, 24)])
def test_greedy_equals_transformers(ds_models, hf_reference, topk, page_size, chunk):
    eng = ds_engine(ds_models[topk], page_size=page_size, max_prefill_tokens=chunk)
    out = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in out] == hf_reference[topk]
    assert eng.allocator.num_free == eng.allocator.capacity_pages


def test_moe_layers_refused(ds_models, tmp_path):
    raw = json.loads((ds_models[4] / "config.json").read_text())
    raw.update(first_k_dense_replace=1, mlp_layer_types=["dense", "sparse"])
    cfg = ModelConfig.from_dict(raw, "moe")
    from workers.layers import TPGroup
    from workers.models.deepseek_v32 import DeepseekV32ForCausalLM

    with pytest.raises(CheckpointError, match="mlp_layer_types / first_k_dense_replace"):
        DeepseekV32ForCausalLM(cfg, torch.float32, TPGroup())


def _brute_indexer(q, w, kc, table, row_req, row_len, ps, topk, tree_bits, tree_len):
    out = []
    for r in range(q.shape[0]):
        cand = []
        for t in range(int(row_len[r])):
            start = int(row_len[r]) - tree_len
            if tree_bits is not None and t >= start and not (int(tree_bits[r]) >> (t - start)) & 1:
                continue
            slot = int(table[row_req[r], t // ps]) * ps + t % ps
            cand.append((float((w[r] * torch.relu(q[r] @ kc[slot])).sum()), slot))
        out.append({s for _, s in sorted(cand, reverse=True)[:topk]})
    return out


@pytest.mark.parametrize("tree", [False, True])
def test_kernel_interface_reference(tree):
    """indexer_topk keeps each row's highest-scoring visible slots (a tree row: the positions before its block and
    its ancestors' inside), -1 padded; sparse_mla is softmax attention over exactly those slots."""
    g = torch.Generator().manual_seed(0)
    ps, pages, hi, di, topk = 4, 8, 3, 8, 5
    kc = torch.randn(pages * ps, di, generator=g)
    table = torch.tensor([[3, 1, 6, 0, 0], [2, 5, 7, 4, 0]], dtype=torch.int32)
    row_req = torch.tensor([0, 0, 1, 1, 1], dtype=torch.int32)
    row_len = torch.tensor([3, 11, 16, 17, 17], dtype=torch.int32)
    q, w = torch.randn(5, hi, di, generator=g), torch.randn(5, hi, generator=g)
    tree_bits, tree_len = None, 0
    if tree:  # every row's last 3 positions are a block: request 1's holds node 0 (root), node 1 (its child) and
        # node 2 (the sibling of 1); request 0's rows see their whole block
        tree_bits, tree_len = torch.tensor([0b111, 0b111, 0b001, 0b011, 0b101], dtype=torch.int64), 3
        row_len = torch.tensor([3, 11, 17, 17, 17], dtype=torch.int32)
    got = indexer_topk(q, w, kc, table, row_req, row_len, ps, topk, tree_bits=tree_bits, tree_len=tree_len)
    want = _brute_indexer(q, w, kc, table, row_req, row_len, ps, topk, tree_bits, tree_len)
    assert got.shape == (5, topk) and got.dtype == torch.int32
    for r in range(5):
        assert {int(s) for s in got[r] if s >= 0} == want[r]
        assert int((got[r] < 0).sum()) == topk - len(want[r])
    h, dl, dr = 2, 6, 4
    cache = torch.randn(pages * ps, dl + dr, generator=g)
    ql, qr = torch.randn(5, h, dl, generator=g), torch.randn(5, h, dr, generator=g)
    out = sparse_mla(ql, qr, cache, got, 0.3)
    for r in range(5):
        sel = got[r][got[r] >= 0].long()
        s = (ql[r] @ cache[sel, :dl].T + qr[r] @ cache[sel, dl:].T) * 0.3
        torch.testing.assert_close(out[r], torch.softmax(s, -1) @ cache[sel, :dl])


# ---- YaRN ------------------------------------------------------------------------------------------------------
YARN = {  # the released checkpoints' (cos / sin factor 1, softmax scale x mscale^2 = 1.874), and a short one whose
    # positions pass original_max_position_embeddings, with mscale != mscale_all_dim (cos / sin x 1.065), no truncate
    "deepseek": DEEPSEEK_YARN,
    "short": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0,
              "mscale_all_dim": 0.5, "beta_fast": 8, "beta_slow": 1, "truncate": False},
}


@pytest.fixture(scope="module")
def yarn_models(tmp_path_factory):
    """ds_models[4]'s weights (same seed and shapes) under each YaRN setting, and transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    base = tmp_path_factory.mktemp("ds_yarn")
    out = {}
    for name, scaling in YARN.items():
        path = make_tiny("deepseek_v32", base / name, layers=2, hidden=64, vocab=512, heads=4, max_position=1024,
                         seed=3, rope_scaling=dict(scaling), deepseek={"index_topk": 4})
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out[name] = (path, [hf_greedy(m, p, GREEDY.max_tokens) for p in PROMPTS])
    return out


@pytest.mark.parametrize("name", list(YARN))
def test_yarn_rope_and_scale_equal_transformers(name):
    """The rope tables (MLA's and the indexer's) and MLA's softmax scale are transformers' bit for bit."""
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Attention, DeepseekV32RotaryEmbedding

    from workers.models.deepseek_v32 import rope_tables, softmax_scale

    hf = DeepseekV32Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=16, qk_nope_head_dim=16,
                           kv_lora_rank=32, q_lora_rank=32, v_head_dim=16, index_head_dim=32, index_n_heads=4,
                           num_hidden_layers=1, first_k_dense_replace=1, mlp_layer_types=["dense"],
                           max_position_embeddings=1024, rope_parameters={**YARN[name], "rope_theta": 10000.0},
                           architectures=["DeepseekV32ForCausalLM"])
    cfg = ModelConfig.from_dict(hf.to_dict(), name)
    rope = DeepseekV32RotaryEmbedding(hf)
    cos, sin = rope(torch.zeros(1), torch.arange(300)[None])
    ours = rope_tables(16, 300, cfg.rope_theta, cfg.rope_scaling)
    assert torch.equal(ours[0], cos[0, :, :8]) and torch.equal(ours[1], sin[0, :, :8])
    assert softmax_scale(cfg) == DeepseekV32Attention(hf, 0).scaling != 32 ** -0.5


def test_yarn_changes_the_tokens(yarn_models, hf_reference):
    assert yarn_models["deepseek"][1] != hf_reference[4] and yarn_models["short"][1] != hf_reference[4]


@pytest.mark.parametrize("name", list(YARN))
def test_yarn_greedy_equals_transformers(yarn_models, name):
    path, want = yarn_models[name]
    eng = ds_engine(path, page_size=16, max_prefill_tokens=24)
    stop_at_eos = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0.0)  # as transformers' generate does
    assert [o.token_ids for o in eng.generate(PROMPTS, stop_at_eos)] == want


def test_rope_scaling_refusals(ds_models):
    """YaRN is DeepSeek-V3.2's only (llama's RoPE does not apply it); DeepSeek-V3.2 takes no other scaling."""
    raw = json.loads((ds_models[4] / "config.json").read_text())
    raw["rope_scaling"] = {"type": "llama3", "factor": 8.0, "original_max_position_embeddings": 128}
    from workers.layers import TPGroup
    from workers.models.deepseek_v32 import DeepseekV32ForCausalLM

    with pytest.raises(CheckpointError, match="unsupported rope scaling type 'llama3'"):
        ModelConfig.from_dict(raw, "llama3")
    raw["rope_scaling"] = {"type": "yarn", "original_max_position_embeddings": 128}
    with pytest.raises(CheckpointError, match="yarn rope scaling needs factor"):
        DeepseekV32ForCausalLM(ModelConfig.from_dict(raw, "no-factor"), torch.float32, TPGroup())
    raw.update(architectures=["LlamaForCausalLM"], rope_scaling=dict(DEEPSEEK_YARN))
    with pytest.raises(CheckpointError, match="unsupported rope scaling type 'yarn'"):
        ModelConfig.from_dict(raw, "llama-yarn")
