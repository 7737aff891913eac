"""Tiny random-init checkpoints in real HuggingFace format (transformers ``save_pretrained``), with a byte-level BPE
tokenizer trained by ``tokenizers`` on the running interpreter's standard library (no download).

    specserve make-tiny --arch llama --out /tmp/tiny [--layers 2 --hidden 64 --vocab 512]
    specserve make-tiny --kind eagle3 --target /tmp/tiny --out /tmp/tiny-eagle3
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def stdlib_corpus(max_files: int = 60, max_chars: int = 400_000) -> list[str]:
    """Deterministic training text: the first standard-library modules by name, plus a little English."""
    lib = Path(os.__file__).parent
    texts, total = [], 0
    for f in sorted(lib.glob("*.py"))[:max_files]:
        t = f.read_text(encoding="utf-8", errors="replace")
        texts.append(t)
        total += len(t)
        if total > max_chars:
            break
    texts.append("The quick brown fox jumps over the lazy dog. Hello, world! A tiny model for tests.\n" * 20)
    return texts


def train_tokenizer(vocab: int, corpus: list[str] | None = None):
    """A byte-level BPE tokenizer with ``vocab`` entries (specials included), wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(f"a byte-level tokenizer needs vocab >= {len(alphabet) + len(SPECIAL_TOKENS)}")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(corpus or stdlib_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
                                   unk_token="<unk>", pad_token="<|end_of_text|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _config(arch: str, **kw):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if arch == "llama":
        return LlamaConfig(**kw)
    if arch == "qwen2":
        kw.pop("head_dim", None)
        return Qwen2Config(**kw)
    if arch == "qwen3":
        return Qwen3Config(**kw)
    raise ValueError(f"unknown arch {arch!r}; choose llama, qwen2 or qwen3")


def make_tiny(arch: str, out, *, layers: int = 2, hidden: int = 64, vocab: int = 512, heads: int = 4,
              kv_heads: int = 2, intermediate: int | None = None, max_position: int = 2048,
              tie_embeddings: bool | None = None, dtype: str = "float32", seed: int = 0,
              rope_scaling: dict | None = None, rope_theta: float = 10000.0, max_shard_size: str | None = None,
              tokenizer_from: str | None = None, init_std: float = 0.08) -> Path:
    """Write a random checkpoint + tokenizer to ``out`` and return the path.

    Weights are re-drawn with a wider spread than transformers' default (std 0.02) so greedy logits are well
    separated and token-exact comparisons are not decided by float noise. The model vocab may exceed the
    tokenizer's (ids past it are never produced by text). ``tokenizer_from`` copies another checkpoint's tokenizer
    (a draft must share its target's)."""
    from transformers import AutoModelForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_from:
        for name in _TOKENIZER_FILES:
            if (Path(tokenizer_from) / name).is_file():
                shutil.copy(Path(tokenizer_from) / name, out / name)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_from)
    else:
        tok = train_tokenizer(min(vocab, 4096))
        tok.save_pretrained(out)
    tie = arch != "llama" if tie_embeddings is None else tie_embeddings
    kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
              num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
              head_dim=hidden // heads, max_position_embeddings=max_position, rms_norm_eps=1e-6,
              tie_word_embeddings=tie, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
              rope_theta=rope_theta)
    if rope_scaling:
        kw["rope_scaling"] = dict(rope_scaling, rope_theta=rope_theta)
    cfg = _config(arch, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, init_std)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    save_kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(dt).save_pretrained(out, **save_kw)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True)
    p.add_argument("--kind", choices=["model", "eagle", "eagle3"], default="model",
                   help="a decoder (default) or a random EAGLE / EAGLE-3 head for --target")
    p.add_argument("--target", help="target checkpoint (for --kind eagle/eagle3)")
    p.add_argument("--arch", choices=["llama", "qwen2", "qwen3"], default="llama")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--max-position", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--tie", dest="tie", action="store_true", default=None)
    p.add_argument("--no-tie", dest="tie", action="store_false")
    p.add_argument("--llama3-rope", action="store_true", help="llama3 rope scaling (factor 8)")
    p.add_argument("--shard-size", default=None, help="e.g. 200KB: write sharded safetensors with an index")
    p.add_argument("--draft-vocab", type=int, default=None, help="EAGLE-3 draft vocabulary size")
    p.add_argument("--tokenizer-from", default=None)


def run(args: argparse.Namespace) -> None:
    if args.kind != "model":
        from tools.make_heads import make_head

        if not args.target:
            raise ValueError("--kind eagle/eagle3 needs --target")
        print(make_head(args.kind, args.target, args.out, seed=args.seed, draft_vocab=args.draft_vocab))
        return
    rope = None
    if args.llama3_rope:
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": max(16, args.max_position // 8)}
    print(make_tiny(args.arch, args.out, layers=args.layers, hidden=args.hidden, vocab=args.vocab, heads=args.heads,
                    kv_heads=args.kv_heads, intermediate=args.intermediate, max_position=args.max_position,
                    tie_embeddings=args.tie, dtype=args.dtype, seed=args.seed, rope_scaling=rope,
                    max_shard_size=args.shard_size, tokenizer_from=args.tokenizer_from))
