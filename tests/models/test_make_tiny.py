"""deployments.make_tiny: the checkpoints load with stock transformers, with the config, tokenizer and template we promise."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deployments.make_tiny import (
    BOS,
    CHAT_TEMPLATE,
    EOS,
    SPECIAL_TOKENS,
    _train_bpe,
    add_arguments,
    llama3_rope_scaling,
    make_tiny,
    run,
    stdlib_corpus,
)

SNIPPET = 'def greet(name: str) -> str:\n    """Say hello."""\n    return f"Hello, {name}! ✓ naïve"\n'
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Count to 3."}]
TEXTS = ["", "  indented\n\n\ttabs ", "I'm sure we'LL add 12345 + 3.14", "naïve café — 日本語 🙂", "<|im_start|>user\nhi<|im_end|>\n"]
CHATML = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
          "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nCount to 3.<|im_end|>\n")
LLAMA3 = llama3_rope_scaling(1024)
CASES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen2-sharded": ("qwen2", {"max_shard_size": "40KB"}),
    "llama-llama3-rope": ("llama", {"rope_scaling": LLAMA3, "rope_theta": 500000.0}),
}


def _state_dict(path: Path) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        sd.update(load_file(f))
    return sd


def _rope(cfg) -> dict:
    """Rope settings whichever transformers wrote them (5.x rope_parameters, 4.x rope_theta + rope_scaling)."""
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(cfg, "rope_theta", None))
    return params


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_loads_and_generates(tmp_path, case):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    arch, kw = CASES[case]
    out = make_tiny(arch, tmp_path / case, layers=2, hidden=64, vocab=512, heads=4, kv_heads=2, max_position=1024,
                    **kw)
    assert out == tmp_path / case and (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()

    # files: one safetensors file, or shards + index when max_shard_size is small
    shards = sorted(out.glob("*.safetensors"))
    if "max_shard_size" in kw:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(shards) > 1 and set(index["weight_map"].values()) == {s.name for s in shards}
        whole = make_tiny(arch, tmp_path / "whole", layers=2, hidden=64, vocab=512, max_position=1024)
        assert [p.name for p in whole.glob("*.safetensors")] == ["model.safetensors"]
        ref = _state_dict(whole)
        got = _state_dict(out)
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    else:
        assert [s.name for s in shards] == ["model.safetensors"]

    # config.json
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == arch and raw["max_position_embeddings"] == 1024 and raw["vocab_size"] == 512
    assert raw["bos_token_id"] == 0 and raw["eos_token_id"] == 1
    assert raw.get("dtype", raw.get("torch_dtype")) == "float32" and raw["torch_dtype"] == "float32"
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    cfg = model.config
    assert cfg.architectures == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                  "qwen3": "Qwen3ForCausalLM"}[arch]]
    tied = arch != "llama"
    assert cfg.tie_word_embeddings is tied
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) is tied
    assert ("lm_head.weight" in _state_dict(out)) is not tied
    attn = model.model.layers[0].self_attn
    assert (attn.q_proj.bias is not None) is (arch == "qwen2")
    assert (attn.k_proj.bias is not None) is (arch == "qwen2") and attn.o_proj.bias is None
    if arch == "qwen3":
        assert cfg.head_dim == 16 and raw["head_dim"] == 16 and attn.q_norm.weight.shape == (16,)
    rope = _rope(cfg)
    if "rope_scaling" in kw:
        assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0 and rope["rope_theta"] == 500000.0
        assert rope["original_max_position_embeddings"] == 128
        assert raw["rope_scaling"]["rope_type"] == "llama3" and raw["rope_theta"] == 500000.0  # 4.x readers too
    else:
        assert rope.get("rope_type", "default") == "default" and rope["rope_theta"] == 10000.0
    # weights were re-drawn wider than transformers' std 0.02; norms scattered around 1
    assert 0.06 < model.model.layers[0].mlp.up_proj.weight.std().item() < 0.1
    norm = model.model.norm.weight
    assert 0.9 < norm.mean().item() < 1.1 and norm.std().item() > 0.05

    # tokenizer: same ids from `tokenizers` and transformers (no BOS added), lossless round trip
    tok = AutoTokenizer.from_pretrained(out)
    raw_tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = tok(SNIPPET).input_ids
    assert ids == raw_tok.encode(SNIPPET).ids and ids[0] != tok.bos_token_id
    assert tok.decode(ids) == SNIPPET and raw_tok.decode(ids) == SNIPPET
    for text in TEXTS:  # for qwen2, transformers 5 loads Qwen2Tokenizer, which rebuilds the pipeline: still equal
        assert tok(text).input_ids == raw_tok.encode(text).ids and tok.decode(tok(text).input_ids) == text
    assert len(ids) < len(SNIPPET.encode()) * 0.8  # the BPE merges actually compress Python
    assert len(tok) == 512 and (tok.bos_token, tok.eos_token) == (BOS, EOS)
    assert tok.convert_tokens_to_ids(SPECIAL_TOKENS) == list(range(len(SPECIAL_TOKENS)))
    assert tok.bos_token_id == cfg.bos_token_id and tok.eos_token_id == cfg.eos_token_id

    # ChatML template
    assert tok.apply_chat_template(MESSAGES, tokenize=False) == CHATML
    prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt == CHATML + "<|im_start|>assistant\n"
    prompt_ids = tok(prompt).input_ids
    assert prompt_ids[0] == tok.convert_tokens_to_ids("<|im_start|>")

    # greedy generation runs and is plain argmax decoding
    x = torch.tensor([prompt_ids])
    with torch.no_grad():
        gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, min_new_tokens=8,
                             do_sample=False, pad_token_id=tok.eos_token_id)
        assert gen.shape == (1, len(prompt_ids) + 8)
        seq = x
        for _ in range(3):
            seq = torch.cat([seq, model(seq).logits[:, -1:].argmax(-1)], dim=1)
    assert gen[0, : seq.shape[1]].tolist() == seq[0].tolist()


def test_deterministic_and_shared_tokenizer(tmp_path):
    a = make_tiny("qwen3", tmp_path / "a", seed=3, dtype="bfloat16")
    b = make_tiny("qwen3", tmp_path / "b", seed=3, dtype="bfloat16")
    c = make_tiny("qwen3", tmp_path / "c", seed=4, dtype="bfloat16")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert next(iter(_state_dict(a).values())).dtype == torch.bfloat16
    assert json.loads((a / "config.json").read_text())["torch_dtype"] == "bfloat16"
    # training itself (not just the per-process cache) is deterministic
    corpus = stdlib_corpus()
    assert _train_bpe(512, corpus).to_str() == _train_bpe(512, corpus).to_str()
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    # a draft copies its target's tokenizer; its vocab may differ from the tokenizer's (padded / truncated)
    draft = make_tiny("llama", tmp_path / "draft", layers=1, vocab=600, tokenizer_from=str(a))
    assert (draft / "tokenizer.json").read_bytes() == (a / "tokenizer.json").read_bytes()
    assert json.loads((draft / "config.json").read_text())["vocab_size"] == 600


def test_large_vocab_is_padded(tmp_path):
    from transformers import AutoTokenizer

    out = make_tiny("llama", tmp_path / "big", layers=1, hidden=32, heads=2, kv_heads=1, vocab=5000)
    assert len(AutoTokenizer.from_pretrained(out)) == 4096
    assert _state_dict(out)["model.embed_tokens.weight"].shape == (5000, 32)
    with pytest.raises(ValueError, match="vocab >= 261"):
        make_tiny("llama", tmp_path / "small", vocab=100)


def test_cli(tmp_path, capsys):
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--arch", "llama", "--out", str(tmp_path / "cli"), "--layers", "1", "--hidden", "32",
                              "--heads", "2", "--kv-heads", "1", "--vocab", "300", "--tie", "--llama3-rope",
                              "--shard-size", "20KB", "--dtype", "float16"])
    run(args)
    out = Path(capsys.readouterr().out.strip())
    assert out == tmp_path / "cli" and (out / "model.safetensors.index.json").is_file()
    raw = json.loads((out / "config.json").read_text())
    assert raw["tie_word_embeddings"] is True and raw["num_hidden_layers"] == 1 and raw["torch_dtype"] == "float16"
    assert raw["rope_scaling"]["rope_type"] == "llama3"
    assert AutoTokenizer.from_pretrained(out).chat_template == CHAT_TEMPLATE
