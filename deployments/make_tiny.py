"""Tiny random-init checkpoints in real HuggingFace format (transformers ``save_pretrained``), with a byte-level BPE
tokenizer trained by ``tokenizers`` on the running interpreter's standard library (no download).

    specserve make-tiny --arch llama --out /tmp/tiny [--layers 2 --hidden 64 --vocab 512 --llama3-rope]
    specserve make-tiny --arch qwen2 --out /tmp/tiny-q2 --shard-size 100KB     # sharded safetensors + index
    specserve make-tiny --kind eagle3 --target /tmp/tiny --out /tmp/tiny-eagle3
    specserve make-tiny --arch deepseek_v32 --out /tmp/tiny-ds --index-topk 8   # MLA + lightning indexer, dense MLPs

Checkpoints are written by whatever transformers is installed. With transformers >= 5 the rope settings live in
``rope_parameters`` and the dtype in ``dtype``; ``config.json`` additionally carries the legacy ``torch_dtype`` (and
``rope_theta`` / ``rope_scaling`` when they differ from the defaults) so that 4.x readers see the same model.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

ARCHES = ("llama", "qwen2", "qwen3", "deepseek_v32")
BOS, EOS, IM_START, IM_END, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<unk>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END, UNK]  # ids 0..4 in a trained tokenizer
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The tokenizer is trained to at most this many entries (training stays fast); a larger model vocab is padded.
MAX_TRAINED_VOCAB = 4096
# Pre-tokenizer split (contractions, letter runs, single digits, punctuation, newlines, spaces), as in Qwen2's tokenizer.
_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ENGLISH = """\
The quick brown fox jumps over the lazy dog. Hello, world! This is a tiny model for tests.
A paged key-value cache stores attention keys and values in fixed-size blocks.
Speculative decoding drafts several tokens cheaply and verifies them with the target model in one pass.
The server batches requests continuously, so new prompts join while older ones are still generating.
Please answer the question briefly: what is the capital of France? The capital of France is Paris.
Once upon a time there was a small language model that could only count to ten, and it was happy.
"""


#: DeepSeek-V3 / V3.2's rope scaling as their checkpoints ship it (a 4096-token pretraining context stretched 40x)
DEEPSEEK_YARN: dict[str, Any] = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                 "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}


def llama3_rope_scaling(max_position: int) -> dict[str, Any]:
    """The Llama-3.1 rope scaling (factor 8) for a model whose context is ``max_position``."""
    return {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": max(16, max_position // 8)}


# ----------------------------------------------------------------------------------------------------- tokenizer


def stdlib_corpus(max_files: int = 40, chars_per_file: int = 10_000) -> list[str]:
    """Deterministic training text: the head of the first public standard-library modules by name, plus English."""
    lib = Path(os.__file__).parent
    files = [f for f in sorted(lib.glob("*.py")) if not f.name.startswith("_")][:max_files]
    texts = [f.read_text(encoding="utf-8", errors="replace")[:chars_per_file] for f in files]
    return texts + [_ENGLISH] * 20


@functools.lru_cache(maxsize=8)
def _trained_bpe_json(vocab: int) -> str:
    """``tokenizer.json`` text of a byte-level BPE trained on :func:`stdlib_corpus` (cached per process)."""
    return _train_bpe(vocab, stdlib_corpus()).to_str()


def _train_bpe(vocab: int, corpus: list[str]):
    """Train the raw ``tokenizers`` byte-level BPE (specials first: ids 0..4)."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(f"a byte-level tokenizer needs vocab >= {len(alphabet) + len(SPECIAL_TOKENS)}, got {vocab}")
    tok = Tokenizer(models.BPE())  # byte-level: every input is covered, no unk needed
    # The very pipeline transformers' Qwen2Tokenizer rebuilds around tokenizer.json (AutoTokenizer forces that class
    # for model_type qwen2), so `tokenizers` and transformers give the same ids for every arch.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # No post-processor: nothing (no BOS) is added on encode.
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return tok


def train_tokenizer(vocab: int, corpus: list[str] | None = None, *, model_max_length: int | None = None):
    """A byte-level BPE tokenizer of ``vocab`` entries (specials included) with the ChatML template, wrapped as a
    transformers fast tokenizer. Deterministic: the same corpus gives the same tokenizer."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(_trained_bpe_json(vocab)) if corpus is None else _train_bpe(vocab, corpus)
    kw: dict[str, Any] = {"model_max_length": model_max_length} if model_max_length else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token=UNK, pad_token=EOS,
                                   **kw)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tokenizer(tok, out: Path) -> None:
    """``save_pretrained`` plus portability fixes: ``tokenizer_config.json`` names the generic fast class (transformers
    5 writes ``TokenizersBackend``, unknown to 4.x) and embeds the chat template (older 4.x ignore
    ``chat_template.jinja``)."""
    tok.save_pretrained(out)
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.setdefault("chat_template", tok.chat_template)
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def copy_tokenizer(src: str | Path, out: Path):
    """Copy ``src``'s tokenizer files into ``out`` and return the tokenizer loaded from there."""
    from transformers import AutoTokenizer

    src = Path(src)
    if not (src / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{src} has no tokenizer.json")
    for name in _TOKENIZER_FILES:
        if (src / name).is_file() and (src / name).resolve() != (out / name).resolve():
            shutil.copyfile(src / name, out / name)
    return AutoTokenizer.from_pretrained(out)


# ------------------------------------------------------------------------------------------------------- model


def _accepts(cls: type, name: str) -> bool:
    return name in inspect.signature(cls.__init__).parameters


def build_config(arch: str, *, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                 max_position: int, tie: bool, bos_token_id: int | None, eos_token_id: int | None, dtype: str,
                 rope_theta: float, rope_scaling: dict | None, deepseek: dict | None = None):
    """The transformers config for ``arch`` (llama: no bias; qwen2: qkv bias; qwen3: q/k RMSNorm + head_dim;
    deepseek_v32: MLA + lightning indexer, ``deepseek`` overriding its small dims)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    if arch == "deepseek_v32":
        return deepseek_v32_config(vocab=vocab, hidden=hidden, layers=layers, heads=heads, intermediate=intermediate,
                                   max_position=max_position, tie=tie, bos_token_id=bos_token_id,
                                   eos_token_id=eos_token_id, dtype=dtype, rope_theta=rope_theta,
                                   rope_scaling=rope_scaling, **(deepseek or {}))
    if arch not in classes:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHES)}")
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must divide by heads ({heads}) and heads by kv_heads ({kv_heads})")
    cls = classes[arch]
    kw: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_position,
        rms_norm_eps=1e-6, tie_word_embeddings=tie, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
    )
    if _accepts(cls, "head_dim"):  # qwen2 has no head_dim field (always hidden // heads)
        kw["head_dim"] = hidden // heads
    if _accepts(cls, "rope_parameters"):  # transformers >= 5
        kw["rope_parameters"] = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta}
    else:
        kw.update(rope_theta=rope_theta, rope_scaling=rope_scaling)
    kw["dtype" if _accepts(cls, "dtype") else "torch_dtype"] = dtype
    return cls(**kw)


def deepseek_v32_config(*, vocab: int, hidden: int, layers: int, heads: int, intermediate: int, max_position: int,
                        tie: bool, bos_token_id: int | None, eos_token_id: int | None, dtype: str, rope_theta: float,
                        rope_scaling: dict | None = None, index_topk: int = 8, index_n_heads: int = 16,
                        index_head_dim: int = 32, kv_lora_rank: int = 32,
                        q_lora_rank: int = 32, qk_rope_head_dim: int = 16, qk_nope_head_dim: int = 16,
                        v_head_dim: int = 16, num_nextn_predict_layers: int = 0):
    """A DeepSeek-V3.2 config with every MLP dense (``first_k_dense_replace`` = layers: MoE layers are refused by
    the workers) and small MLA / indexer dims. The indexer's RoPE covers its first ``qk_rope_head_dim`` dims.
    ``num_nextn_predict_layers``: 1 adds an MTP layer (written by ``make_tiny`` itself, after the model).
    ``rope_scaling``: e.g. ``DEEPSEEK_YARN`` (the released checkpoints' YaRN)."""
    from transformers import DeepseekV32Config

    if index_head_dim < qk_rope_head_dim:
        raise ValueError(f"index_head_dim ({index_head_dim}) must be >= qk_rope_head_dim ({qk_rope_head_dim})")
    return DeepseekV32Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, moe_intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        first_k_dense_replace=layers, mlp_layer_types=["dense"] * layers, n_routed_experts=4, n_group=1,
        topk_group=1, num_experts_per_tok=2, kv_lora_rank=kv_lora_rank, q_lora_rank=q_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim, qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim,
        index_topk=index_topk, index_n_heads=index_n_heads, index_head_dim=index_head_dim,
        max_position_embeddings=max_position, rms_norm_eps=1e-6, tie_word_embeddings=tie,
        bos_token_id=bos_token_id, eos_token_id=eos_token_id,
        rope_parameters={"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta}, dtype=dtype)


@torch.no_grad()
def init_weights(model: torch.nn.Module, seed: int, std: float) -> None:
    """Re-draw every parameter with a wider spread than transformers' default (std 0.02) so greedy logits are well
    separated: matrices/embeddings N(0, std²), norm weights 1 + 0.1·N(0, 1), biases 0.1·N(0, 1). Parameters are
    visited by name with a private generator, so the weights depend only on the seed and the shapes."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):  # tied weights are listed once
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * noise)
        elif name.endswith(".bias"):
            p.copy_(0.1 * noise)
        else:
            p.copy_(std * noise)


def _portable_config(path: Path, dtype: str) -> None:
    """Add the legacy keys of transformers 4.x to a 5.x ``config.json`` (same values, both readers agree)."""
    cfg = json.loads(path.read_text())
    cfg.setdefault("dtype", dtype)
    cfg.setdefault("torch_dtype", cfg["dtype"])
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict):
        cfg.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
        if rope.get("rope_type", "default") != "default":
            cfg.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def make_tiny(arch: str, out: str | os.PathLike, *, layers: int = 2, hidden: int = 64, vocab: int = 512,
              heads: int = 4, kv_heads: int = 2, intermediate: int | None = None, max_position: int = 2048,
              tie_embeddings: bool | None = None, dtype: str = "float32", seed: int = 0,
              rope_scaling: dict | None = None, rope_theta: float = 10000.0, max_shard_size: str | None = None,
              tokenizer_from: str | None = None, init_std: float = 0.08, deepseek: dict | None = None) -> Path:
    """Write a random ``arch`` checkpoint (safetensors, sharded with an index when ``max_shard_size`` is small) and its
    tokenizer to ``out``; returns ``out``.

    ``tie_embeddings`` defaults to untied for llama and deepseek_v32 and tied for qwen2/qwen3. The tokenizer is trained to
    ``min(vocab, MAX_TRAINED_VOCAB)`` entries and the model vocab is ``vocab`` (ids past the tokenizer are never
    produced by text). ``tokenizer_from`` copies another checkpoint's tokenizer instead (a draft must share its
    target's); then ``vocab`` may even be smaller than the tokenizer, for small-vocab sampling tests. ``deepseek``:
    ``deepseek_v32_config``'s keyword overrides (index_topk, MLA dims)."""
    from transformers import AutoModelForCausalLM, PreTrainedModel

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_from:
        tok = copy_tokenizer(tokenizer_from, out)
    else:
        tok = train_tokenizer(min(vocab, MAX_TRAINED_VOCAB), model_max_length=max_position)
        if len(tok) > vocab:
            raise ValueError(f"tokenizer has {len(tok)} entries but the model vocab is {vocab}")
        save_tokenizer(tok, out)
    tie = arch not in ("llama", "deepseek_v32") if tie_embeddings is None else tie_embeddings
    cfg = build_config(arch, vocab=vocab, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                       intermediate=intermediate or 2 * hidden, max_position=max_position, tie=tie,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, dtype=dtype,
                       rope_theta=rope_theta, rope_scaling=rope_scaling, deepseek=deepseek)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float()  # initialised in fp32, cast when saving
    init_weights(model, seed, init_std)
    save_kw: dict[str, Any] = {"max_shard_size": max_shard_size} if max_shard_size else {}
    if _accepts(PreTrainedModel.save_pretrained, "safe_serialization"):  # transformers 4.x; 5.x only writes safetensors
        save_kw["safe_serialization"] = True
    model.to(_DTYPES[dtype]).save_pretrained(out, **save_kw)
    _portable_config(out / "config.json", dtype)
    if arch == "deepseek_v32" and (deepseek or {}).get("num_nextn_predict_layers"):
        _write_mtp_layer(model, cfg, out, seed, init_std, _DTYPES[dtype])
    return out


@torch.no_grad()
def _write_mtp_layer(model, cfg, out: Path, seed: int, std: float, dtype: torch.dtype) -> None:
    """DeepSeek-V3's MTP (NextN) layer, which transformers neither builds nor saves: as in the released checkpoints,
    ``model.layers.{N}.`` holds enorm, hnorm, eh_proj, a decoder layer and shared_head (norm, head) plus a copy of
    the embedding, in a safetensors file of its own (transformers loads only ``model.safetensors``)."""
    from safetensors.torch import save_file
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32DecoderLayer

    n, h = cfg.num_hidden_layers, cfg.hidden_size
    layer = DeepseekV32DecoderLayer(cfg, 0).float()
    head = torch.nn.Module()
    head.layer = layer
    head.enorm, head.hnorm = torch.nn.Parameter(torch.empty(h)), torch.nn.Parameter(torch.empty(h))
    head.eh_proj = torch.nn.Parameter(torch.empty(h, 2 * h))
    head.shared_norm = torch.nn.Parameter(torch.empty(h))
    init_weights(head, seed + 1000, std)
    for norm in (head.enorm, head.hnorm, head.shared_norm):  # (their names do not end in norm.weight)
        norm.copy_(1.0 + 0.1 * torch.randn(h, generator=torch.Generator().manual_seed(seed + 1001)))
    prefix = f"model.layers.{n}."
    tensors = {prefix + k: v for k, v in layer.state_dict().items()}
    tensors.update({prefix + "enorm.weight": head.enorm, prefix + "hnorm.weight": head.hnorm,
                    prefix + "eh_proj.weight": head.eh_proj, prefix + "shared_head.norm.weight": head.shared_norm,
                    prefix + "shared_head.head.weight": model.get_output_embeddings().weight,
                    prefix + "embed_tokens.weight": model.get_input_embeddings().weight})
    tensors = {k: v.detach().to(dtype).contiguous().clone() for k, v in tensors.items()}
    save_file(tensors, str(out / "model-mtp.safetensors"), metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"].update({k: "model-mtp.safetensors" for k in tensors})
        index.write_text(json.dumps(data, indent=2) + "\n")
    path = out / "config.json"
    raw = json.loads(path.read_text())
    raw["num_nextn_predict_layers"] = 1
    path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``make-tiny`` command line."""
    p.add_argument("--out", required=True)
    p.add_argument("--kind", choices=["model", "eagle", "eagle3"], default="model",
                   help="a decoder (default) or a random EAGLE / EAGLE-3 head for --target")
    p.add_argument("--target", help="target checkpoint (for --kind eagle/eagle3)")
    p.add_argument("--arch", choices=list(ARCHES), default="llama")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default 2 * hidden)")
    p.add_argument("--max-position", type=int, default=2048)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=list(_DTYPES), default="float32")
    p.add_argument("--tie", dest="tie", action="store_true", default=None,
                   help="tie embeddings and LM head (default: untied for llama, tied for qwen2/qwen3)")
    p.add_argument("--no-tie", dest="tie", action="store_false")
    p.add_argument("--llama3-rope", action="store_true", help="llama3 rope scaling (factor 8)")
    p.add_argument("--shard-size", default=None, help="e.g. 100KB: write sharded safetensors with an index")
    p.add_argument("--draft-vocab", type=int, default=None, help="EAGLE-3 draft vocabulary size")
    p.add_argument("--tokenizer-from", default=None, help="copy this checkpoint's tokenizer instead of training one")
    p.add_argument("--index-topk", type=int, default=8, help="deepseek_v32: tokens the indexer keeps per query")
    p.add_argument("--mtp", action="store_true", help="deepseek_v32: add an MTP (NextN) layer (speculative method mtp)")
    p.add_argument("--yarn", action="store_true",
                   help="deepseek_v32: the released checkpoints' YaRN rope scaling (factor 40 over 4096 positions)")


def run(args: argparse.Namespace) -> None:
    """Build what ``args`` asks for and print the output directory."""
    if args.yarn and args.arch != "deepseek_v32":
        raise ValueError("--yarn is for --arch deepseek_v32")
    if args.kind != "model":
        from deployments.make_heads import make_head

        if not args.target:
            raise ValueError("--kind eagle/eagle3 needs --target")
        print(make_head(args.kind, args.target, args.out, seed=args.seed, draft_vocab=args.draft_vocab))
        return
    print(make_tiny(args.arch, args.out, layers=args.layers, hidden=args.hidden, vocab=args.vocab, heads=args.heads,
                    kv_heads=args.kv_heads, intermediate=args.intermediate, max_position=args.max_position,
                    tie_embeddings=args.tie, dtype=args.dtype, seed=args.seed, rope_theta=args.rope_theta,
                    rope_scaling=llama3_rope_scaling(args.max_position) if args.llama3_rope
                    else dict(DEEPSEEK_YARN) if args.yarn else None,
                    max_shard_size=args.shard_size, tokenizer_from=args.tokenizer_from,
                    deepseek={"index_topk": args.index_topk, "num_nextn_predict_layers": int(args.mtp)}
                    if args.arch == "deepseek_v32" else None))
